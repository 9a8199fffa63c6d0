#!/usr/bin/env python3
"""Scheduling features on the CPU, each against the same server with the feature off, one run.

prefix: prefix caching (PREFIX_CACHING). 90% of the requests start with the same ~1,000-token
  prefix (a system prompt) followed by a short question of their own; the other 10% are as
  long but share nothing. Each generates 16 tokens. Printed per mode: requests/s, generated
  tokens/s, time to first token (p50, p90), the tgis_prefix_cache_* counters, the ratios.
preemption: admission by the next block's need with preemption (PREEMPTION) against TGIS's
  whole-run reservation, in a fixed KV cache (96 blocks of 16 tokens). 48 requests of a
  ~100-token prompt, max_new_tokens 300, seeded sampling that stops at the first "x" in the
  text (so lengths vary as real ones do, mostly far below max_new_tokens). Printed per mode:
  requests/s, generated tokens/s, the mean decode batch size (requests served at once),
  preemptions, and the ratios.
chunked: chunked prefill (PREFILL_CHUNK_TOKENS=128) against whole prompts. Four streams run;
  then a 4,000-token prompt arrives. Printed per mode: the streams' inter-token latency while
  that prompt is prefilled (p50, p99, max), their tokens/s then, and the long prompt's time to
  first token.
speculation: prompt-lookup speculative decoding (SPECULATE=4) against plain decoding: one
  greedy stream at a time, 256 new tokens after a code-like prompt (a function and an edit
  request), five prompts. Printed per mode: tokens/s of the stream after its first token, and
  the draft tokens proposed and accepted.

Clients send the requests through the public GenerateStream API at a fixed concurrency, back to
back.

The model is Llama-shaped with random weights (hidden 768, 12 layers; ~78M parameters, f32,
written with numpy under benchmarks/data/, nothing downloaded) and the Llama-2-style fixture
tokenizer (its 1,500-token vocabulary sizes the model's).

    python3 benchmarks/scheduling_bench.py [--only prefix|preemption|chunked|speculation] [--build-dir build]
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


def checkpoint(positions: int = CONFIG["max_position_embeddings"]) -> Path:
    vocab = len(json.loads((TOKENIZER / "tokenizer.json").read_text())["model"]["vocab"])
    folder = REPO / "benchmarks" / "data" / f"llama-78m-v{vocab}-p{positions}"
    make_checkpoint(folder, {**CONFIG, "vocab_size": vocab, "max_position_embeddings": positions})
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
    def __init__(self, build: Path, model: Path, extra_env: dict):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.tmp = tempfile.mkdtemp(prefix="tgis-prefix-bench-")
        env = {"MODEL_NAME": str(model), "NUM_SHARD": "1", "TGIS_DEVICE": "cpu",
               "DTYPE_STR": "float32", "GRPC_PORT": str(self.grpc_port),
               "PORT": str(self.http_port), "MASTER_PORT": str(free_port()),
               "SHARD_UDS_PATH": os.path.join(self.tmp, "shard"),
               "MAX_SEQUENCE_LENGTH": "1200", "MAX_NEW_TOKENS": "64", "MAX_BATCH_SIZE": "16",
               "KV_CACHE_BLOCKS": "1024", "HF_HUB_OFFLINE": "1", **extra_env}
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

    def steps_over(self, seconds: float) -> dict:
        """How many prefill and next_token steps took longer than `seconds` (from the
        tgi_batch_inference_duration buckets, at the first bound above it)."""
        body = urllib.request.urlopen(f"http://localhost:{self.http_port}/metrics").read().decode()
        counts: dict = {}
        for method in ("prefill", "next_token"):
            total, below = 0.0, None
            for line in body.splitlines():
                if not line.startswith("tgi_batch_inference_duration_") or f'method="{method}"' not in line:
                    continue
                value = float(line.split()[-1])
                if line.startswith("tgi_batch_inference_duration_count"):
                    total = value
                elif 'le="' in line and below is None:
                    bound = line.split('le="')[1].split('"')[0]
                    if bound != "+Inf" and float(bound) >= seconds:
                        below = value
            counts[method] = int(total - (below or 0))
        return counts

    def batch_size_mean(self) -> float:
        """The mean size of the decode (next_token) batches so far."""
        body = urllib.request.urlopen(f"http://localhost:{self.http_port}/metrics").read().decode()
        total = count = 0.0
        for line in body.splitlines():
            if line.startswith('tgi_batch_inference_batch_size_sum{method="next_token"}'):
                total = float(line.split()[-1])
            elif line.startswith('tgi_batch_inference_batch_size_count{method="next_token"}'):
                count = float(line.split()[-1])
        return total / count if count else 0.0

    def close(self):
        self.proc.close(sig_timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


def run(launcher: Launcher, prompts: list[str], concurrency: int, make_params,
        warm_up: bool) -> dict:
    """Sends `prompts` (request i with make_params(pb, i)) from `concurrency` clients."""
    import grpc

    pb, pb_grpc = proto_module("generation")
    channel = grpc.insecure_channel(f"localhost:{launcher.grpc_port}")
    stub = pb_grpc.GenerationServiceStub(channel)
    if warm_up:
        # One request first, alone: it puts the shared prefix in the cache (when caching), as
        # the first of many users of a system prompt would; it is not counted.
        list(stub.GenerateStream(pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=prompts[1]), params=make_params(pb, 1)),
            timeout=600))
    todo: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    ttft, tokens, errors = [], [0], []
    lock = threading.Lock()

    def worker():
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            first = None
            n = 0
            try:
                for m in stub.GenerateStream(pb.SingleGenerationRequest(
                        request=pb.GenerationRequest(text=p), params=make_params(pb, i)),
                        timeout=600):
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
            "wall": wall, "errors": len(errors), "tokens": tokens[0],
            "hits": launcher.metric("tgis_prefix_cache_hits_total"),
            "reused": launcher.metric("tgis_prefix_cache_reused_tokens_total"),
            "preemptions": launcher.metric("tgis_preemptions_total"),
            "batch_mean": launcher.batch_size_mean()}


def bench_prefix(build: Path, model: Path, args) -> None:
    prompts = workload(args.requests, 0.9)

    def params(pb, i):
        return pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=16, min_new_tokens=16))

    results = {}
    for caching in (True, False):
        name = "on" if caching else "off"
        print(f"== prefix caching {name}: {args.requests} requests, concurrency "
              f"{args.concurrency}, 16 new tokens each", flush=True)
        launcher = Launcher(build, model, {"PREFIX_CACHING": "true" if caching else "false"})
        try:
            r = run(launcher, prompts, args.concurrency, params, warm_up=True)
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


def bench_preemption(build: Path, model: Path, args) -> None:
    rng = random.Random(1)
    prompts = [f"Request {i}: " + text(rng, 30) for i in range(48)]

    def params(pb, i):
        p = pb.Parameters(method=pb.SAMPLE,
                          stopping=pb.StoppingCriteria(max_new_tokens=300, stop_sequences=["x"]))
        p.sampling.seed = 1000 + i
        p.sampling.top_k = 50
        return p

    results = {}
    for preemption in (True, False):
        name = "on" if preemption else "off"
        print(f"== preemption {name}: {len(prompts)} requests, concurrency 24, KV cache 96 "
              f"blocks of 16 tokens, max_new_tokens 300 (stop at \"x\")", flush=True)
        launcher = Launcher(build, model, {"PREEMPTION": "true" if preemption else "false",
                                           "KV_CACHE_BLOCKS": "96", "MAX_BATCH_SIZE": "32",
                                           "MAX_NEW_TOKENS": "300"})
        try:
            r = run(launcher, prompts, 24, params, warm_up=False)
        finally:
            launcher.close()
        results[name] = r
        print(f"   {r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.1f} generated tok/s "
              f"({r['tokens']} tokens), mean decode batch {r['batch_mean']:.2f}, "
              f"preemptions {r['preemptions']:.0f}, wall {r['wall']:.1f} s, "
              f"errors {r['errors']}", flush=True)
    on, off = results["on"], results["off"]
    print(f"== on/off: throughput x{on['tokens_per_s'] / off['tokens_per_s']:.2f}, requests "
          f"at once x{on['batch_mean'] / off['batch_mean']:.2f}")


def bench_chunked(build: Path, args) -> None:
    import grpc

    model = checkpoint(positions=4608)
    rng = random.Random(2)
    long_text = "Document: " + text(rng, 1600)  # over 4,000 tokens: truncated to exactly 4,000
    results = {}
    for chunk in (128, 0):
        name = f"chunks of {chunk}" if chunk else "whole prompts"
        print(f"== {name}: 4 streams running, then a 4,000-token prompt", flush=True)
        launcher = Launcher(build, model, {"PREFILL_CHUNK_TOKENS": str(chunk),
                                           "MAX_SEQUENCE_LENGTH": "4500",
                                           "MAX_NEW_TOKENS": "3000"})
        try:
            pb, pb_grpc = proto_module("generation")
            channel = grpc.insecure_channel(f"localhost:{launcher.grpc_port}")
            stub = pb_grpc.GenerationServiceStub(channel)
            arrivals: list[list[float]] = [[] for _ in range(4)]
            calls = []
            for i in range(4):
                calls.append(stub.GenerateStream(pb.SingleGenerationRequest(
                    request=pb.GenerationRequest(text=f"Stream {i}: " + text(rng, 10)),
                    # generated_tokens: a message for every token (none is sent for a token
                    # whose text is empty otherwise, which would look like a stall).
                    params=pb.Parameters(
                        stopping=pb.StoppingCriteria(max_new_tokens=3000, min_new_tokens=3000),
                        response=pb.ResponseOptions(generated_tokens=True))), timeout=900))

            def read(i):
                try:
                    for m in calls[i]:
                        if m.generated_token_count > 0:
                            arrivals[i].append(time.perf_counter())
                except grpc.RpcError:
                    pass  # cancelled at the end

            readers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
            for t in readers:
                t.start()
            while min(len(a) for a in arrivals) < 20:
                time.sleep(0.05)
            sent = time.perf_counter()
            first = None
            for m in stub.GenerateStream(pb.SingleGenerationRequest(
                    request=pb.GenerationRequest(text=long_text),
                    params=pb.Parameters(truncate_input_tokens=4000,
                                         stopping=pb.StoppingCriteria(max_new_tokens=4))),
                    timeout=900):
                if first is None and m.generated_token_count > 0:
                    first = time.perf_counter()
                if m.input_token_count:
                    assert m.input_token_count == 4000, m.input_token_count
            for c in calls:
                c.cancel()
            for t in readers:
                t.join()
            channel.close()
            slow = launcher.steps_over(5.0)
        finally:
            launcher.close()
        # Each stream's gaps from its last token before the long prompt was sent to its first
        # token after that prompt's first token: the whole time the prefill could hold it up.
        gaps, tokens, where = [], 0, []
        for a in arrivals:
            window = [t for t in a if sent <= t <= first]
            tokens += len(window)
            seq = [t for t in a if t < sent][-1:] + window + [t for t in a if t > first][:1]
            gaps += [y - x for x, y in zip(seq, seq[1:])]
            where += [(y - x, x - sent) for x, y in zip(seq, seq[1:])]
        gaps.sort()
        worst = max(where)
        print(f"   (longest gap {worst[0]:.1f} s, starting {worst[1]:.1f} s after the prompt was "
              f"sent; server steps over 5 s: {slow})", flush=True)
        r = {"ttft": first - sent, "p50": statistics.median(gaps),
             "p99": gaps[int(0.99 * (len(gaps) - 1))], "max": gaps[-1],
             "tok_s": tokens / (first - sent)}
        results[chunk] = r
        print(f"   streams' ITL during the prefill: p50 {r['p50'] * 1e3:.0f} ms, p99 "
              f"{r['p99'] * 1e3:.0f} ms, max {r['max'] * 1e3:.0f} ms; their tokens/s "
              f"{r['tok_s']:.1f}; the long prompt's TTFT {r['ttft']:.1f} s", flush=True)
    on, off = results[128], results[0]
    print(f"== chunked/whole: ITL max x{off['max'] / on['max']:.1f} lower, streams' tokens/s "
          f"x{on['tok_s'] / max(off['tok_s'], 1e-9):.1f}, long prompt TTFT "
          f"x{on['ttft'] / off['ttft']:.2f}")


CODE = """def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "model" not in data:
        raise ValueError("config has no model")
    return data

Rename load_config to read_config and data to config in the function above:
"""


def bench_speculation(build: Path, model: Path, args) -> None:
    import grpc

    prompts = [CODE.replace("config", word) for word in
               ("config", "settings", "options", "profile", "manifest")]
    results = {}
    for speculate in (4, 0):
        name = f"speculate {speculate}" if speculate else "plain decoding"
        print(f"== {name}: {len(prompts)} greedy streams one at a time, 256 new tokens",
              flush=True)
        launcher = Launcher(build, model, {"SPECULATE": str(speculate), "MAX_NEW_TOKENS": "300"})
        try:
            pb, pb_grpc = proto_module("generation")
            channel = grpc.insecure_channel(f"localhost:{launcher.grpc_port}")
            stub = pb_grpc.GenerationServiceStub(channel)
            decode_time, tokens, texts = 0.0, 0, []
            for p in prompts:
                first = last = None
                for m in stub.GenerateStream(pb.SingleGenerationRequest(
                        request=pb.GenerationRequest(text=p),
                        params=pb.Parameters(
                            stopping=pb.StoppingCriteria(max_new_tokens=256, min_new_tokens=256),
                            response=pb.ResponseOptions(generated_tokens=True))), timeout=600):
                    if m.generated_token_count > 0:
                        last = time.perf_counter()
                        first = first or last
                    texts.append(m.text)
                decode_time += last - first
                tokens += 255
            channel.close()
            r = {"tok_s": tokens / decode_time, "text": "".join(texts),
                 "proposed": launcher.metric("tgis_draft_tokens_total"),
                 "accepted": launcher.metric("tgis_accepted_draft_tokens_total")}
        finally:
            launcher.close()
        results[speculate] = r
        rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        print(f"   {r['tok_s']:.1f} tok/s after the first token; drafts: {r['proposed']:.0f} "
              f"proposed, {r['accepted']:.0f} accepted ({rate:.0%})", flush=True)
    same = results[4]["text"] == results[0]["text"]
    print(f"== speculate/plain: x{results[4]['tok_s'] / results[0]['tok_s']:.2f} tok/s; "
          f"outputs {'identical' if same else 'DIFFERENT'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--only", choices=["prefix", "preemption", "chunked", "speculation"])
    ap.add_argument("--requests", type=int, default=40, help="prefix: requests")
    ap.add_argument("--concurrency", type=int, default=4, help="prefix: clients")
    args = ap.parse_args()
    build = Path(args.build_dir)
    build = build if build.is_absolute() else REPO / build
    model = checkpoint()
    if args.only in (None, "prefix"):
        bench_prefix(build, model, args)
    if args.only in (None, "preemption"):
        bench_preemption(build, model, args)
    if args.only in (None, "chunked"):
        bench_chunked(build, args)
    if args.only in (None, "speculation"):
        bench_speculation(build, model, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
