#!/usr/bin/env python3
"""Prefix caching on the CPU: the real launcher with the cache on and off, same workload, one run.

The workload: 90% of the requests start with the same ~1,000-token prefix (a system prompt)
followed by a short question of their own; the other 10% are as long but share nothing. Each
generates 16 tokens. Clients send them through the public GenerateStream API at a fixed
concurrency, back to back. Printed per mode: requests/s, generated tokens/s, time to first
token (p50, p90), the tgis_prefix_cache_* counters, and the ratio on/off.

The model is Llama-shaped with random weights (hidden 768, 12 layers; ~78M parameters, f32,
written with numpy under benchmarks/data/, nothing downloaded) and the Llama-2-style fixture
tokenizer (its 1,500-token vocabulary sizes the model's).

    python3 benchmarks/prefix_cache_bench.py [--build-dir build] [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
from engine_bench import CONFIG, make_checkpoint  # noqa: E402
from procs import Process, free_port, proto_module  # noqa: E402

TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "llama2"
WORDS = ("install upgrade backup restore the server client manual command line option network "
         "storage volume cluster node pod service route secret config map log metric alert "
         "token model batch queue shard cache block prefix stream request answer").split()


def checkpoint() -> Path:
    vocab = len(json.loads((TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"])
    folder = REPO / "benchmarks" / "data" / f"llama-78m-v{vocab}"
    make_checkpoint(folder, {**CONFIG, "vocab_size": vocab})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / f, folder / f)
    return folder


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(n: int, shared_share: float, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    system = "System: " + text(rng, 330) + "\n"
    prompts = []
    for i in range(n):
        question = f"Question {i}: " + text(rng, 20) + "?"
        if i % round(1 / (1 - shared_share)) == 0:  # the unshared tenth, as long
            prompts.append("Other: " + text(rng, 330) + "\n" + question)
        else:
            prompts.append(system + question)
    return prompts


class Launcher:
    def __init__(self, build: Path, model: Path, caching: bool, log_dir: Path):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.tmp = tempfile.mkdtemp(prefix="tgis-prefix-bench-")
        env = {"MODEL_NAME": str(model), "NUM_SHARD": "1", "TGIS_DEVICE": "cpu",
               "DTYPE_STR": "float32", "GRPC_PORT": str(self.grpc_port),
               "PORT": str(self.http_port), "MASTER_PORT": str(free_port()),
               "SHARD_UDS_PATH": os.path.join(self.tmp, "shard"),
               "MAX_SEQUENCE_LENGTH": "1200", "MAX_NEW_TOKENS": "64", "MAX_BATCH_SIZE": "16",
               "KV_CACHE_BLOCKS": "1024", "PREFIX_CACHING": "true" if caching else "false",
               "HF_HUB_OFFLINE": "1"}
        self.proc = Process([build / "launcher" / "text-generation-launcher"], env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"launcher exited:\n{self.proc.output()[-3000:]}")
            try:
                if urllib.request.urlopen(f"http://localhost:{self.http_port}/health",
                                          timeout=5).status == 200:
                    return
            except Exception:
                time.sleep(0.5)
        raise RuntimeError("not healthy after 300 s")

    def metric(self, name: str) -> float:
        body = urllib.request.urlopen(f"http://localhost:{self.http_port}/metrics").read().decode()
        for line in body.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def close(self):
        self.proc.close(sig_timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


def run(launcher: Launcher, prompts: list[str], concurrency: int, max_new: int) -> dict:
    import grpc

    pb, pb_grpc = proto_module("generation")
    channel = grpc.insecure_channel(f"localhost:{launcher.grpc_port}")
    stub = pb_grpc.GenerationServiceStub(channel)
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new,
                                                        min_new_tokens=max_new))
    # One request first, alone: it puts the shared prefix in the cache (when caching), as the
    # first of many users of a system prompt would; it is not counted.
    list(stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=prompts[1]), params=params), timeout=600))
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    ttft, tokens, errors = [], [0], []
    lock = threading.Lock()

    def worker():
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            first = None
            n = 0
            try:
                for m in stub.GenerateStream(pb.SingleGenerationRequest(
                        request=pb.GenerationRequest(text=p), params=params), timeout=600):
                    if m.generated_token_count > 0 and first is None:
                        first = time.perf_counter() - start
                    n = m.generated_token_count
            except Exception as e:  # noqa: BLE001 - reported, not fatal to the run
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                ttft.append(first)
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    channel.close()
    ttft.sort()
    return {"requests_per_s": len(ttft) / wall, "tokens_per_s": tokens[0] / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "wall": wall, "errors": len(errors),
            "hits": launcher.metric("tgis_prefix_cache_hits"),
            "reused": launcher.metric("tgis_prefix_cache_reused_tokens")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    build = Path(args.build_dir)
    build = build if build.is_absolute() else REPO / build
    model = checkpoint()
    prompts = workload(args.requests, 0.9)
    results = {}
    for caching in (True, False):
        name = "on" if caching else "off"
        print(f"== prefix caching {name}: {args.requests} requests, concurrency "
              f"{args.concurrency}, {args.max_new_tokens} new tokens each", flush=True)
        launcher = Launcher(build, model, caching, REPO / "benchmarks" / "results")
        try:
            r = run(launcher, prompts, args.concurrency, args.max_new_tokens)
        finally:
            launcher.close()
        results[name] = r
        print(f"   {r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.1f} generated tok/s, "
              f"TTFT p50 {r['ttft_p50'] * 1e3:.0f} ms p90 {r['ttft_p90'] * 1e3:.0f} ms, "
              f"wall {r['wall']:.1f} s, errors {r['errors']}, cache hits {r['hits']:.0f}, "
              f"reused tokens {r['reused']:.0f}", flush=True)
    on, off = results["on"], results["off"]
    print(f"== on/off: throughput x{on['requests_per_s'] / off['requests_per_s']:.2f}, "
          f"TTFT p50 x{off['ttft_p50'] / on['ttft_p50']:.2f} faster, "
          f"p90 x{off['ttft_p90'] / on['ttft_p90']:.2f} faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
