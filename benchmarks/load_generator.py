#!/usr/bin/env python3
"""Load generator for a running server (the public fmaas.GenerationService API).

For each concurrency level, N concurrent clients send GenerateStream requests back to back for
a fixed duration; every token's arrival time is recorded. Prints and writes (CSV + PNG) for
each level: requests/s, generated tokens/s, time to first token (TTFT) and inter-token latency
(ITL) p50/p90/p99. The client is asyncio gRPC in one process: at high concurrency check that
its CPU use stays well below one core, or run several instances.

    python3 benchmarks/load_generator.py --target localhost:8033 --concurrency 1,4,16 \
        --duration 20 --max-new-tokens 64 --out benchmarks/results/load
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "integration"))
from procs import proto_module  # noqa: E402

WORDS = ("the model server streams tokens to many clients while the batcher keeps every "
         "request moving through prefill and decode steps on the accelerator").split()


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(stub, pb, prompt, max_new, min_new):
    req = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=prompt),
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new,
                                                          min_new_tokens=min_new)))
    start = time.perf_counter()
    arrivals = []
    tokens = 0
    async for msg in stub.GenerateStream(req):
        if msg.generated_token_count > tokens:
            now = time.perf_counter()
            arrivals.extend([now] * (msg.generated_token_count - tokens))
            tokens = msg.generated_token_count
    end = time.perf_counter()
    return start, arrivals, end


async def run_level(target, pb, pb_grpc, concurrency, duration, max_new, min_new, prompt_words,
                    credentials):
    import grpc

    channel = (grpc.aio.secure_channel(target, credentials) if credentials
               else grpc.aio.insecure_channel(target))
    stub = pb_grpc.GenerationServiceStub(channel)
    rng = random.Random(concurrency)
    results = []
    deadline = time.perf_counter() + duration

    async def worker():
        while time.perf_counter() < deadline:
            prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
            results.append(await one_request(stub, pb, prompt, max_new, min_new))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await channel.close()
    ttft = [a[0] - s for s, a, _ in results if a]
    itl = [b - a for _, arr, _ in results for a, b in zip(arr, arr[1:])]
    gen = sum(len(a) for _, a, _ in results)
    return {
        "concurrency": concurrency, "requests": len(results), "seconds": round(wall, 3),
        "requests_per_s": len(results) / wall, "generated_tokens_per_s": gen / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p90_ms": percentile(ttft, 90) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3, "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p90_ms": percentile(itl, 90) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "mean_tokens_per_request": statistics.mean(len(a) for _, a, _ in results) if results else 0,
    }


def write_chart(rows, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    c = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(c, [r["generated_tokens_per_s"] for r in rows], marker="o")
    ax[0].set(title="generated tokens/s", xlabel="concurrency", xscale="log")
    for p in ("p50", "p90", "p99"):
        ax[1].plot(c, [r[f"ttft_{p}_ms"] for r in rows], marker="o", label=p)
        ax[2].plot(c, [r[f"itl_{p}_ms"] for r in rows], marker="o", label=p)
    ax[1].set(title="time to first token (ms)", xlabel="concurrency", xscale="log")
    ax[2].set(title="inter-token latency (ms)", xlabel="concurrency", xscale="log")
    ax[1].legend()
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default="localhost:8033")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--min-new-tokens", type=int, default=0,
                    help="set to --max-new-tokens for fixed-length outputs")
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--ca-cert", help="PEM CA for a TLS server")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "load"))
    args = ap.parse_args()
    pb, pb_grpc = proto_module("generation")
    credentials = None
    if args.ca_cert:
        import grpc

        credentials = grpc.ssl_channel_credentials(Path(args.ca_cert).read_bytes())
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        row = asyncio.run(run_level(args.target, pb, pb_grpc, c, args.duration, args.max_new_tokens,
                                    args.min_new_tokens, args.prompt_words, credentials))
        rows.append(row)
        print(f"concurrency {c:4d}: {row['requests_per_s']:7.2f} req/s "
              f"{row['generated_tokens_per_s']:9.1f} tok/s  TTFT p50/p90/p99 "
              f"{row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms  "
              f"ITL p50/p90/p99 {row['itl_p50_ms']:.1f}/{row['itl_p90_ms']:.1f}/"
              f"{row['itl_p99_ms']:.1f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_chart(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
