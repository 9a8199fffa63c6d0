"""Measurements through the public gRPC API, one stream at a time: prompts of an exact token
count, time to first token, batch-1 decode."""

from __future__ import annotations

import random
import statistics
import time

from .common import log

WORDS = ("the model server streams tokens to many clients while the batcher keeps every request "
         "moving through prefill and decode steps on the accelerator under a steady load of long "
         "prompts with random words from a small list").split()


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def words_for(tokens: int, tokens_per_word: float) -> int:
    """Words of random text that make comfortably more than `tokens` tokens."""
    return int(tokens / tokens_per_word * 1.25) + 16


def gen_request(pb, text: str, input_tokens: int, max_new: int, min_new: int):
    # generated_tokens: every token gets its own stream message. Without it the server (as
    # TGIS) sends none for a token whose text is empty, and most of this random model's tokens
    # are outside the small fixture tokenizer's vocabulary (empty text): tokens would arrive in
    # bursts, or all at the end.
    return pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text),
        params=pb.Parameters(method=pb.GREEDY, truncate_input_tokens=input_tokens,
                             response=pb.ResponseOptions(generated_tokens=True),
                             stopping=pb.StoppingCriteria(max_new_tokens=max_new,
                                                          min_new_tokens=min_new)))


def stream_once(stub, pb, text: str, input_tokens: int, max_new: int, min_new: int,
                timeout: float) -> dict:
    """One GenerateStream: times of the first generated token and of the last one."""
    t0 = time.perf_counter()
    first = last = None
    first_count = count = 0
    input_count = None
    for msg in stub.GenerateStream(gen_request(pb, text, input_tokens, max_new, min_new),
                                   timeout=timeout):
        if msg.input_token_count:
            input_count = msg.input_token_count
        if msg.generated_token_count > count:
            now = time.perf_counter()
            if first is None:
                first, first_count = now, msg.generated_token_count
            last, count = now, msg.generated_token_count
    if first is None:
        raise RuntimeError("the stream ended without a generated token")
    return {"ttft_s": first - t0, "first_count": first_count, "decode_s": last - first,
            "generated": count, "input_tokens": input_count, "total_s": last - t0}


def measure_ttft(stub, pb, lengths, runs, tokens_per_word, timeout) -> dict:
    rng = random.Random(7)
    out = {}
    for n in lengths:
        samples, inputs = [], set()
        for _ in range(runs):
            r = stream_once(stub, pb, prompt_text(rng, words_for(n, tokens_per_word)), n, 1, 1,
                            timeout)
            samples.append(r["ttft_s"])
            inputs.add(r["input_tokens"])
        out[str(n)] = {"median_ms": statistics.median(samples) * 1e3,
                       "min_ms": min(samples) * 1e3, "runs": runs,
                       "input_tokens_seen": sorted(i for i in inputs if i is not None)}
        log(f"TTFT {n} tokens: median {out[str(n)]['median_ms']:.1f} ms "
            f"(min {out[str(n)]['min_ms']:.1f}, inputs {out[str(n)]['input_tokens_seen']})")
    return out


def measure_decode(stub, pb, prompt, new, runs, tokens_per_word, timeout) -> dict:
    rng = random.Random(11)
    rates, samples = [], []
    for _ in range(runs):
        r = stream_once(stub, pb, prompt_text(rng, words_for(prompt, tokens_per_word)), prompt,
                        new, new, timeout)
        if r["generated"] != new:
            raise RuntimeError(f"decode run generated {r['generated']} tokens, not {new}")
        if r["decode_s"] <= 0:
            raise RuntimeError("decode run: all tokens arrived in one message")
        rates.append((r["generated"] - r["first_count"]) / r["decode_s"])
        samples.append(r)
    res = {"tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
           "prompt_tokens": prompt, "new_tokens": new,
           "input_tokens_seen": samples[0]["input_tokens"]}
    log(f"batch-1 decode: {res['tokens_per_s']:.1f} tok/s (runs: "
        + ", ".join(f"{x:.1f}" for x in rates) + ")")
    return res
