#!/usr/bin/env python3
"""GPU benchmark: our server (the real launcher, router and shard) on a Llama-3-8B-shaped model
with random bf16 weights, against HF transformers on the same GPU in the same run.

Nothing is downloaded: the checkpoint (a HF Llama folder, ~16 GB of safetensors shards) is
written on the spot with numpy and cached in --model-dir; the tokenizer is the Llama-3-style
test fixture (its ids are all < 128256, so it works with the full-size vocabulary).

Reports, in one markdown table and a JSON file (--out):
  * batch-1 decode tokens/s (128-token prompt, 256 new tokens, decode part only) and its
    fraction of the HBM roofline: tok/s x weight bytes read per token (every weight but the
    embedding table) / HBM bandwidth measured in the same run (torch device-to-device copy);
  * time to first token for prompts of 128 and 2048 tokens (median of --ttft-runs);
  * output tokens/s with 1, 8, 64 and 256 concurrent streams of 1000 in / 1000 out through
    the public gRPC API, each level for --duration seconds, counting streamed tokens;
  * the same figures (batch 16 with fewer new tokens, see --hf-new-tokens) from HF
    transformers, when a python with torch (CUDA) and transformers is found, after our server
    has been stopped (so that both get the whole GPU).

    python3 benchmarks/gpu_bench.py                                   # H100: ~5-7 minutes
    python3 benchmarks/gpu_bench.py --levels 1,8 --duration 20 --no-hf
    python3 benchmarks/gpu_bench.py --tiny --device cpu --levels 1,4 --duration 5 \\
        --model-dir /tmp/tgis-bench-tiny                              # smoke test on a CPU
"""

# The code is in the gpubench package beside this file (a package named gpu_bench would collide
# with this module on import); this file stays the entry point and --help's text.

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # e.g. under python3 -P
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpubench.cli import main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main(description=__doc__))
    except KeyboardInterrupt as e:
        print(f"[gpu_bench] interrupted ({e or 'Ctrl-C'}); the launcher, if started, was stopped",
              file=sys.stderr)
        sys.exit(130)
