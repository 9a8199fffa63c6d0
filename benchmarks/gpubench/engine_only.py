"""Batch-1 decode of the Llama-3-8B-shaped checkpoint through engine_bench (the engine without
the router or the shard's gRPC service), beside the HBM copy bandwidth and HF transformers, all
in one run. For a GPU call whose bundle has no router (see scripts/gpu_bundle.sh's
GPU_BUNDLE=tests): it needs only the test binaries' libraries.

    python3 -m gpubench.engine_only BUILD_DIR [MODEL_DIR] [--no-hf] [--ncu] [--overhead]
                                    [--prefill N] [--graphs] [--quantize M1,M2] [--pdl-off]
                                    [--mma-gemv] [--gptq]

--overhead also times decode of a model with the 8B shape's 32 layers (so as many kernels per
step) but tiny matrices (hidden 256, vocabulary 32000): its ms/step is the per-step cost that
is not the weights' bytes (launches, host work, synchronization), the floor CUDA graphs lower.

--prefill N also times the first token of one N-token prompt alone (engine_bench --prompt N).

--graphs also times batch-1 decode (and, with --overhead, the tiny-layer floor) with the
shard's --cuda-graphs: decode steps replayed from captured CUDA graphs.

--pdl-off also times batch-1 decode (eager, and with --graphs in graphs) with programmatic
dependent launch off (engine_bench --cuda-pdl false): kernels in plain stream order, the way
they ran before it, for the ratio in the same run.

--mma-gemv also times decode of 1, 2, 4, 8 and 16 rows with the 16-bit decode GEMVs on tensor
cores (engine_bench --cuda-mma-gemv true; with --graphs, also in graphs), against the first
run's figures (CUDA cores).

--quantize M1,M2 also times batch-1 decode with each of the shard's --quantize methods applied
at load (bitsandbytes: int8 rows; bitsandbytes-nf4: 4-bit codes), against bf16's ms/token
(with --graphs, in graphs against bf16 in graphs; with --ncu, the first method is profiled too).

--gptq also times decode of 1 and 16 rows on a GPTQ 4-bit copy of the shape (groups of 128,
random codes, written beside the bf16 one: gpubench.gptq_checkpoint) with the CUDA-core 4-bit
GEMV and with the tensor-core one (engine_bench --cuda-mma-gemv true), in graphs with --graphs,
against bf16's ms/token.

--ncu also runs a short engine_bench (16-token prompt, 3 decode steps) under Nsight Compute
with one metric, the GPU time of every kernel, into $OUT/ncu.csv (or /tmp): the sum over a
decode step's kernels against the step's wall time separates kernel time from host overhead;
the last decode step's kernels, grouped and heaviest first, are printed (gpubench.ncu_summary).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from .bandwidth import measure_bandwidth
from .checkpoint import LLAMA3_8B, TINY, make_checkpoint
from .common import log
from .gptq_checkpoint import make_gptq_checkpoint
from .hf_reference import run_hf
from .ncu_summary import summarize


def main(argv: list[str]) -> int:
    build = Path(argv[0])
    model_dir = Path(argv[1] if len(argv) > 1 and not argv[1].startswith("--") else
                     "/tmp/tgis-bench-llama3-8b")
    results: dict = {"checkpoint": make_checkpoint(model_dir, LLAMA3_8B)}
    results["bandwidth"] = measure_bandwidth(sys.executable)
    bw = results["bandwidth"].get("hbm_bytes_per_s") or 0
    cmd = [str(build / "benchmarks" / "engine_bench"), str(model_dir), "--device", "cuda",
           "--dtype", "bfloat16", "--prompt", "128", "--steps", "256", "--batches", "1,16"]
    # The first run also times 2, 4 and 8 rows: those take the decode GEMV with several
    # accumulators a lane (kernels/cuda/gemv.cuh), which 16 rows (cuBLASLt) do not; session
    # 33's router levels suggested 8 streams ran 23 ms steps against 7.8 at 16 rows.
    first = cmd[:-1] + ["1,2,4,8,16"]
    log(" ".join(first))
    p = subprocess.run(first, capture_output=True, text=True, timeout=400)
    print(p.stdout + p.stderr[-4000:], flush=True)
    results["engine_bench_rc"] = p.returncode
    streamed = re.search(r"streamed/token ([0-9.e+]+) MB", p.stdout)
    step = re.search(r"batch 1: .*\(([0-9.e+]+) ms/step\)", p.stdout)
    if streamed and step and bw:
        mb, ms = float(streamed.group(1)), float(step.group(1))
        results["decode_ms_per_token"] = ms
        results["roofline_fraction"] = mb * 1e6 / (ms / 1e3) / bw
        log(f"batch-1 decode {ms:.2f} ms/token = {100 * results['roofline_fraction']:.1f}% of "
            f"the {bw / 1e12:.2f} TB/s copy bandwidth")
    def decode_ms(extra: list[str], model: Path = model_dir, what: str = "") -> float | None:
        q = subprocess.run([cmd[0], str(model)] + cmd[2:] + extra, capture_output=True,
                           text=True, timeout=600)
        print(q.stdout + q.stderr[-3000:], flush=True)
        m = re.search(r"batch 1: .*\(([0-9.e+]+) ms/step\)", q.stdout)
        if m is None:
            log(f"{what}: no batch-1 figure (rc {q.returncode})")
            return None
        log(f"{what}: batch-1 decode {float(m.group(1)):.2f} ms/token")
        return float(m.group(1))

    if "--graphs" in argv:
        ms = decode_ms(["--cuda-graphs", "true"], what="cuda graphs")
        if ms is not None:
            results["decode_ms_per_token_graphs"] = ms
            if streamed and bw:
                results["roofline_fraction_graphs"] = float(streamed.group(1)) * 1e6 / (ms / 1e3) / bw
    if "--pdl-off" in argv:
        ms = decode_ms(["--cuda-pdl", "false"], what="programmatic launch off")
        if ms is not None:
            results["decode_ms_per_token_pdl_off"] = ms
            if results.get("decode_ms_per_token"):
                log(f"programmatic launch: {ms:.2f} -> {results['decode_ms_per_token']:.2f} ms/token "
                    "eager")
        if "--graphs" in argv:
            ms = decode_ms(["--cuda-pdl", "false", "--cuda-graphs", "true"],
                           what="programmatic launch off, cuda graphs")
            if ms is not None:
                results["decode_ms_per_token_graphs_pdl_off"] = ms
                if results.get("decode_ms_per_token_graphs"):
                    log(f"programmatic launch: {ms:.2f} -> "
                        f"{results['decode_ms_per_token_graphs']:.2f} ms/token with graphs")
    if "--mma-gemv" in argv:
        # The tensor-core decode GEMV (kernels/cuda/mma_gemv.cuh) at 1, 2, 4 and 8 rows, against
        # the CUDA-core GEMV's figures of the first run (in graphs too with --graphs).
        for graphs in ([False, True] if "--graphs" in argv else [False]):
            extra = ["--cuda-mma-gemv", "true", "--batches", "1,2,4,8,16"]
            extra += ["--cuda-graphs", "true"] if graphs else []
            ms = decode_ms(extra, what="tensor-core GEMV" + (", graphs" if graphs else ""))
            if ms is not None:
                results["decode_ms_per_token_mma_gemv" + ("_graphs" if graphs else "")] = ms
    if "--quantize" in argv:
        # With --graphs, in graphs only: the ratio to bf16 free of launch overhead, and each
        # quantized load (20-40 s of the device's time) once.
        graphs = "--graphs" in argv
        base = results.get("decode_ms_per_token_graphs" if graphs else "decode_ms_per_token")
        for method in argv[argv.index("--quantize") + 1].split(","):
            extra = ["--quantize", method] + (["--cuda-graphs", "true"] if graphs else [])
            what = f"--quantize {method}" + (", graphs" if graphs else "")
            ms = decode_ms(extra, what=what)
            if ms is not None:
                results[f"decode_ms_per_token_{method}" + ("_graphs" if graphs else "")] = ms
                if base:
                    log(f"{what}: {base / ms:.2f}x bf16")
    if "--gptq" in argv:
        # The 4-bit decode GEMVs on the 8B shape: a GPTQ g128 copy with random codes, batch 1
        # (and 16 in the log) with the CUDA-core kernel and the tensor-core one, against bf16.
        graphs = "--graphs" in argv
        base = results.get("decode_ms_per_token_graphs" if graphs else "decode_ms_per_token")
        gptq_dir = Path(str(model_dir) + "-gptq4-g128")
        results["gptq_checkpoint"] = make_gptq_checkpoint(gptq_dir, LLAMA3_8B)
        for mma in (False, True):
            extra = ["--batches", "1,16"] + (["--cuda-mma-gemv", "true"] if mma else [])
            extra += ["--cuda-graphs", "true"] if graphs else []
            what = "GPTQ 4-bit g128, " + ("tensor-core" if mma else "CUDA-core") + " GEMV" + (
                ", graphs" if graphs else "")
            ms = decode_ms(extra, gptq_dir, what)
            if ms is not None:
                results["decode_ms_per_token_gptq4" + ("_mma" if mma else "") +
                        ("_graphs" if graphs else "")] = ms
                if base:
                    log(f"{what}: {base / ms:.2f}x bf16")
    if "--prefill" in argv:  # --prefill N: time to first token of an N-token prompt, alone
        n = argv[argv.index("--prefill") + 1]
        q = subprocess.run([cmd[0], str(model_dir), "--device", "cuda", "--dtype", "bfloat16",
                            "--prompt", n, "--steps", "8", "--batches", "1"],
                           capture_output=True, text=True, timeout=300)
        print(q.stdout + q.stderr[-2000:], flush=True)
        rate = re.search(r"batch 1: prefill ([0-9.e+]+) tok/s", q.stdout)
        if rate:
            results[f"prefill_{n}_ms"] = int(n) / float(rate.group(1)) * 1e3
            log(f"prefill of {n} tokens: {results[f'prefill_{n}_ms']:.1f} ms")
    if "--overhead" in argv:
        small = Path("/tmp/tgis-bench-overhead")
        make_checkpoint(small, dict(TINY, num_hidden_layers=32, vocab_size=32000))
        ms = decode_ms([], small, "32 tiny layers (not bytes)")
        if ms is not None:
            results["overhead_ms_per_step"] = ms
        if "--graphs" in argv:
            ms = decode_ms(["--cuda-graphs", "true"], small, "32 tiny layers, cuda graphs")
            if ms is not None:
                results["overhead_ms_per_step_graphs"] = ms
    if "--ncu" in argv:
        ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))),
                                          None)
        csv = Path(os.environ.get("OUT", "/tmp")) / "ncu.csv"
        if ncu is None:
            log("--ncu: no ncu found")
        else:
            # bf16, and with --quantize the first method too (where its GEMVs' time goes).
            runs = [("", [])]
            if "--quantize" in argv:
                first = argv[argv.index("--quantize") + 1].split(",")[0]
                runs.append((f"-{first}", ["--quantize", first]))
            for suffix, extra in runs:
                out = csv.with_name(f"ncu{suffix}.csv")
                prof = [ncu, "--metrics", "gpu__time_duration.sum", "--csv", "--log-file",
                        str(out), cmd[0], str(model_dir), "--device", "cuda", "--dtype",
                        "bfloat16", "--prompt", "16", "--steps", "3", "--batches", "1"] + extra
                log(" ".join(prof))
                q = subprocess.run(prof, capture_output=True, text=True, timeout=300)
                print(q.stdout[-3000:] + q.stderr[-2000:], flush=True)
                if out.exists():
                    print(summarize(out), flush=True)
    if "--no-hf" not in argv:
        args = SimpleNamespace(ttft_lengths=[128, 2048], ttft_runs=3, decode_prompt=128,
                               decode_tokens=256, hf_batch=16, level_prompt=1000,
                               hf_new_tokens=100, hf_timeout=240)
        results["hf"] = run_hf(sys.executable, model_dir, args)
    print("RESULTS " + json.dumps(results), flush=True)
    return 0 if p.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
