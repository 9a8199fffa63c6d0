"""Output tokens/s with many concurrent streams ("levels"), counted per 0.1 s bucket as the
tokens arrive."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue
import random
import sys
import time

from .measure import gen_request, prompt_text, words_for

# One level of concurrent streams runs in several client processes (spawned, so that gRPC is
# never forked), each an asyncio loop with its share of the streams.

BUCKET_S = 0.1


def _level_client(stub_dir, target, streams, start_q, go, t0_value, duration, prompt_tokens,
                  prompt_words, new_tokens, seed, result_q):
    sys.path.insert(0, stub_dir)
    import grpc
    import generation_pb2 as pb
    import generation_pb2_grpc as pb_grpc

    async def run():
        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
        stub = pb_grpc.GenerationServiceStub(channel)
        await channel.channel_ready()
        start_q.put("ready")
        while not go.is_set():
            await asyncio.sleep(0.005)
        t0 = t0_value.value
        deadline = t0 + duration
        while time.monotonic() < t0:
            await asyncio.sleep(0.001)
        rng = random.Random(seed)
        buckets = [0] * (int(math.ceil(duration / BUCKET_S)) + 1)
        stats = {"started": 0, "completed": 0, "errors": 0, "error_samples": [], "ttft": [],
                 "input_tokens": set()}

        async def stream_loop():
            while time.monotonic() < deadline:
                req = gen_request(pb, prompt_text(rng, prompt_words), prompt_tokens, new_tokens,
                                  new_tokens)
                stats["started"] += 1
                start, seen = time.monotonic(), 0
                try:
                    call = stub.GenerateStream(req, timeout=deadline - start + 30)
                    async for msg in call:
                        now = time.monotonic()
                        if msg.input_token_count:
                            stats["input_tokens"].add(msg.input_token_count)
                        if msg.generated_token_count > seen:
                            if seen == 0:
                                stats["ttft"].append(now - start)
                            if now < deadline:
                                buckets[int((now - t0) / BUCKET_S)] += msg.generated_token_count - seen
                            seen = msg.generated_token_count
                    stats["completed"] += 1
                except grpc.aio.AioRpcError as e:
                    stats["errors"] += 1
                    if len(stats["error_samples"]) < 3:
                        stats["error_samples"].append(f"{e.code().name}: {e.details()}")
                    await asyncio.sleep(0.1)

        cpu0 = time.process_time()
        tasks = [asyncio.ensure_future(stream_loop()) for _ in range(streams)]
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for t in tasks:
            t.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
                stats["errors"] += 1
                if len(stats["error_samples"]) < 3:
                    stats["error_samples"].append(f"client: {r!r}")
        cpu = time.process_time() - cpu0
        await channel.close()
        stats["input_tokens"] = sorted(stats["input_tokens"])
        return {"buckets": buckets, "cpu_s": cpu, **stats}

    try:
        result_q.put(asyncio.run(run()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        start_q.put(f"error: {e!r}")
        result_q.put({"fatal": repr(e)})


def run_level(stub_dir, target, concurrency, duration, prompt_tokens, new_tokens,
              tokens_per_word, procs) -> dict:
    ctx = mp.get_context("spawn")
    procs = max(1, min(procs, concurrency))
    start_q, result_q = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    t0_value = ctx.Value("d", 0.0)
    share = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    workers = [ctx.Process(target=_level_client, daemon=True,
                           args=(stub_dir, target, n, start_q, go, t0_value, duration,
                                 prompt_tokens, words_for(prompt_tokens, tokens_per_word),
                                 new_tokens, 1000 * concurrency + i, result_q))
               for i, n in enumerate(share)]
    for w in workers:
        w.start()
    done = False
    try:
        for _ in workers:
            try:
                msg = start_q.get(timeout=60)
            except queue.Empty:
                raise RuntimeError("the client processes did not connect within 60 s") from None
            if msg != "ready":
                raise RuntimeError(f"a client process failed: {msg}")
        t0_value.value = time.monotonic() + 0.2
        go.set()
        results = [result_q.get(timeout=duration + 90) for _ in workers]
        done = True
    finally:
        for w in workers:
            w.join(timeout=10 if done else 0)
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
    fatal = [r["fatal"] for r in results if "fatal" in r]
    if fatal:
        raise RuntimeError(f"client process failed: {fatal[0]}")
    n_buckets = len(results[0]["buckets"])
    buckets = [sum(r["buckets"][i] for r in results) for i in range(n_buckets)]
    total = sum(buckets)
    half = int(round(duration / 2 / BUCKET_S))
    ttft = sorted(t for r in results for t in r["ttft"])
    return {
        "concurrency": concurrency, "duration_s": duration, "client_processes": procs,
        "generated_tokens": total, "output_tokens_per_s": total / duration,
        "second_half_tokens_per_s": sum(buckets[half:]) / (duration - half * BUCKET_S),
        "requests_started": sum(r["started"] for r in results),
        "requests_completed": sum(r["completed"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "error_samples": [e for r in results for e in r["error_samples"]][:3],
        "streams_with_a_token": len(ttft),
        "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3 if ttft else None,
        "ttft_max_ms": ttft[-1] * 1e3 if ttft else None,
        "input_tokens_seen": sorted({i for r in results for i in r["input_tokens"]}),
        "client_cpu_fraction_max": max(r["cpu_s"] for r in results) / duration,
    }
