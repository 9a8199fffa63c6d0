#!/usr/bin/env python3
"""How far the opt-in int8 activations (CPU_INT8_ACTIVATIONS, 4-bit weights) move outputs: serves
one 4-bit GPTQ folder twice through the real router and shard, exact and with the mode on,
generates greedily from fixed texts, and prints the per-token logprob differences and where the
greedy ids first part. A figure, not a test.

    python3 benchmarks/int8_drift.py [MODEL_DIR] [--tokens 32]

MODEL_DIR defaults to the GPTQ 4-bit g32 TinyLlama-shaped folder that cpu_bench.py makes.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "integration"))
from router_harness import RouterServer  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog because",
         "def fibonacci(n):\n    if n < 2:\n        return n\n",
         "In 1492, Columbus sailed across the Atlantic Ocean and"]


def run(model: str, int8: bool, tokens: int):
    server = RouterServer(model, kv_blocks=512, block_size=16,
                          shard_args=[f"--cpu-int8-activations={'true' if int8 else 'false'}"])
    pb = server.pb
    try:
        p = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens),
                          response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
        reqs = [pb.GenerationRequest(text=t) for t in TEXTS]
        got = server.stub.Generate(pb.BatchedGenerationRequest(requests=reqs, params=p),
                                   timeout=600).responses
        return [[(t.text, t.logprob) for t in r.tokens] for r in got]
    finally:
        server.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", nargs="?",
                    default=str(REPO / "benchmarks" / "data" / "cpu_bench" / "llama-tinyllama-gptq4"))
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("TGIS_BUILD_DIR", str(REPO / "build"))
    exact, rounded = run(args.model, False, args.tokens), run(args.model, True, args.tokens)
    diffs = []
    for i, (a, b) in enumerate(zip(exact, rounded)):
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), len(a))
        d = [abs(x[1] - y[1]) for x, y in zip(a[:same], b[:same])]
        diffs += d
        print(f"text {i}: greedy ids equal for {same} of {len(a)} tokens; |logprob diff| over "
              f"those: max {max(d, default=0):.4f}, mean {sum(d) / max(1, len(d)):.4f}")
    print(f"all: {len(diffs)} tokens, max {max(diffs, default=0):.4f}, "
          f"mean {sum(diffs) / max(1, len(diffs)):.4f} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
