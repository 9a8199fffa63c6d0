"""The command line: options, and the steps in order (checkpoint, bandwidth, our server, HF,
report)."""

from __future__ import annotations

import argparse
import json
import math
import signal
import time
from pathlib import Path

from .bandwidth import measure_bandwidth
from .checkpoint import LLAMA3_8B, TINY, make_checkpoint
from .common import REPO, log
from .device import device_name, find_torch_python
from .hf_reference import run_hf
from .ours import bench_server
from .report import report


def parse_args(argv=None, description: str | None = None):
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--model-dir", default=None,
                    help="checkpoint folder (default /tmp/tgis-bench-llama3-8b, or "
                         "/tmp/tgis-bench-tiny with --tiny); reused when complete")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model of the same architecture (hidden 256, 2 layers): for "
                         "testing this script, e.g. on a CPU with --device cpu")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"),
                    help="TGIS_DEVICE for the shard (default cuda)")
    ap.add_argument("--dtype", default="bfloat16", help="DTYPE_STR (default bfloat16)")
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--levels", type=ints, default=[1, 8, 64, 256],
                    help="concurrent streams per level (default 1,8,64,256, the issue's)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per level (default 30)")
    ap.add_argument("--level-prompt", type=int, default=1000, help="input tokens per level request")
    ap.add_argument("--level-new", type=int, default=1000, help="new tokens per level request")
    ap.add_argument("--ttft-lengths", type=ints, default=[128, 2048])
    ap.add_argument("--ttft-runs", type=int, default=5)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--decode-runs", type=int, default=3)
    ap.add_argument("--max-sequence-length", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=1000)
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-concurrent-requests", type=int, default=512)
    ap.add_argument("--kv-cache-blocks", type=int, default=0,
                    help="KV_CACHE_BLOCKS (default: the shard sizes it from free memory; with "
                         "--tiny: enough for the largest level)")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes per level (default: one per 32 streams, at most "
                         "half the cores)")
    ap.add_argument("--startup-timeout", type=float, default=420.0,
                    help="seconds for the server to become healthy")
    ap.add_argument("--rpc-timeout", type=float, default=120.0, help="seconds per measured RPC")
    ap.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds to wait for the server to go idle after a level")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--hf-python", help="python with torch (CUDA) and transformers")
    ap.add_argument("--hf-timeout", type=float, default=360.0,
                    help="seconds for the HF run (its torch.compile anchor compiles for ~1-2 min)")
    ap.add_argument("--no-hf-compile", action="store_true",
                    help="skip HF's static cache + torch.compile decode (the gpt-fast anchor)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-new-tokens", type=int, default=200,
                    help="new tokens per sequence in HF's batch run (default 200)")
    ap.add_argument("--quantize", choices=("bitsandbytes",),
                    help="ours only: QUANTIZE for the shard (bitsandbytes: int8 per row at load, "
                         "decode through the quantized GEMV); the roofline counts 1 byte a weight")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_bench.json"))
    args = ap.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = "/tmp/tgis-bench-tiny" if args.tiny else "/tmp/tgis-bench-llama3-8b"
    need = max([*args.ttft_lengths, args.decode_prompt + args.decode_tokens,
                args.level_prompt + args.level_new])
    if args.max_sequence_length <= need:
        ap.error(f"--max-sequence-length must exceed {need}")
    if max(args.level_new, args.decode_tokens) > args.max_new_tokens:
        ap.error("--max-new-tokens is smaller than --level-new or --decode-tokens")
    if args.tiny and not args.kv_cache_blocks:
        args.kv_cache_blocks = math.ceil(
            max(args.levels + [1]) * (args.level_prompt + args.level_new) / 16) + 64
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None, description: str | None = None) -> int:
    """The whole run; `description` is --help's text (gpu_bench.py's docstring)."""
    args = parse_args(argv, description)
    t_start = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so that the launcher is always stopped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    results = {"args": vars(args), "device_name": device_name(args.device), "ours": {},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    log(f"device: {results['device_name']}")
    model_dir = Path(args.model_dir)
    results["checkpoint"] = make_checkpoint(model_dir, TINY if args.tiny else LLAMA3_8B)
    if args.quantize == "bitsandbytes":  # 16-bit weights become 1 byte each (scales: ~0.01%)
        results["checkpoint"]["weight_bytes_per_token"] //= 2

    torch_py, why = (None, f"--device {args.device}") if args.device == "cpu" else \
        find_torch_python(args.hf_python)
    results["torch_python"] = {"python": torch_py, "info": why}
    if torch_py:
        results["bandwidth"] = measure_bandwidth(torch_py)
    else:
        results["bandwidth"] = {"skipped": f"no torch with CUDA: {why}"}
        log(f"HBM bandwidth: skipped ({why})")

    bench_server(args, model_dir, results)

    if args.no_hf:
        results["hf"] = {"skipped": "--no-hf"}
    elif not torch_py:
        results["hf"] = {"skipped": f"no torch with CUDA: {why}"}
    elif not why.get("transformers"):
        results["hf"] = {"skipped": f"{torch_py} has no transformers"}
    else:
        results["hf"] = run_hf(torch_py, model_dir, args)
    if "skipped" in results["hf"]:
        log(f"HF transformers: skipped ({results['hf']['skipped']})")

    results["total_s"] = time.monotonic() - t_start
    table = report(results, args)
    results["table_markdown"] = table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print("\n" + table + "\n", flush=True)
    log(f"wrote {out}")
    return 1 if results["ours"].get("error") or results["ours"].get("phase_errors") else 0
