#!/usr/bin/env bash
# Runs on the GPU machine (device tool) from the repository root, with .device/ carried (made
# by scripts/gpu_bundle.sh): the CUDA op tests, the CUDA model parity tests, then the GPU
# benchmark. Logs and figures go to $OUT when the device tool sets it; $OUT/summary.txt says
# in one page what passed, what failed and the benchmark's figures.
#   GPU_CHECKS="ops parity bench"   which parts to run (default: all three; "engine" is batch-1
#                                   decode through engine_bench, for a GPU_BUNDLE=tests bundle;
#                                   "attention" the attention op alone, attention_bench at the
#                                   8B shape in bf16)
#   ATTENTION_ARGS="..."            extra arguments for attention_bench
#   BENCH_ARGS="..."                extra arguments for benchmarks/gpu_bench.py
#   ENGINE_ARGS="..."               extra arguments for the engine part (gpubench.engine_only)
#   PARITY_FILTER="a:b"             the CUDA parity tests of these fixtures only (those a slim
#                                   tree carries: scripts/gpu_tree.sh slim a b); default all
#   OPS_TIMEOUT, PARITY_TIMEOUT, ATTENTION_TIMEOUT, BENCH_TIMEOUT  seconds per part (default
#                                   120, 180, 60, 600; bench also times the engine part), so
#                                   that a hang in one part still leaves the others and the
#                                   summary inside the device call's limit
set -uo pipefail
OUT=${OUT:-/tmp/tgis-gpu-checks}
mkdir -p "$OUT"
B=/tmp/tgis-bundle
rm -rf "$B" && mkdir -p "$B" && tar -C "$B" -xJf .device/bundle.tar.xz || exit 1

# The GPU stack from the machine: CUDA's own folders, and NCCL from PyTorch's wheels.
gpu_libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && gpu_libs="$gpu_libs:$d"
done
for lib in libnccl.so.2 libcublasLt.so.13 libcudart.so.13; do
  if ! ldconfig -p | grep -q "$lib"; then
    found=$(find / -xdev -name "$lib" -not -path '/proc/*' 2>/dev/null | head -1)
    [ -n "$found" ] && gpu_libs="$gpu_libs:$(dirname "$found")"
  fi
done
export LD_LIBRARY_PATH="$B/lib$gpu_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TGIS_FIXTURES_DIR="$PWD/tests/fixtures" TGIS_BUILD_DIR="$B/build"
ls .device/wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/tgis-site .device/wheels/*.whl && export PYTHONPATH=/tmp/tgis-site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
ldd "$B/build/server/text-generation-server" | grep -E "not found|cuda|cublas|nccl" | tee "$OUT/ldd.txt"

rc=0
parts=${GPU_CHECKS:-ops parity bench}
if [[ " $parts " == *" ops "* ]]; then
  timeout -k 5 "${OPS_TIMEOUT:-120}" "$B/build/tests/kernels_test" --gtest_filter='*Cuda*' 2>&1 | tee "$OUT/ops.log" |
    grep -E "FAILED|PASSED|SKIPPED \]|error" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  # NCCL with one rank (tensor parallelism's collectives on the GPU).
  timeout -k 5 60 "$B/build/tests/tensor_parallel_test" --gtest_filter='Nccl*' 2>&1 |
    tee "$OUT/nccl.log" | grep -E "FAILED|PASSED|SKIPPED \]|error" | tail -10
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $parts " == *" parity "* ]]; then
  filter='*Cuda*'
  if [ -n "${PARITY_FILTER:-}" ]; then
    filter=""
    for m in ${PARITY_FILTER//:/ }; do filter="$filter:*CudaParityTest*/${m}_cuda_*"; done
    filter=${filter#:}
  fi
  timeout -k 5 "${PARITY_TIMEOUT:-180}" "$B/build/tests/model_parity_test" --gtest_filter="$filter" 2>&1 | tee "$OUT/parity.log" |
    grep -E "FAILED|PASSED|Failure|error" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $parts " == *" attention "* ]]; then
  timeout -k 5 "${ATTENTION_TIMEOUT:-60}" "$B/build/benchmarks/attention_bench" --device cuda --dtype bf16 \
    --prefill 512,2048,8192 --batch 1,64,256 --context 1024,4096 ${ATTENTION_ARGS:-} 2>&1 |
    tee "$OUT/attention.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $parts " == *" engine "* ]]; then
  (cd benchmarks && PYTHONUNBUFFERED=1 timeout -k 10 "${BENCH_TIMEOUT:-600}" \
    python3 -m gpubench.engine_only "$B/build" ${ENGINE_ARGS:-}) 2>&1 | tee "$OUT/engine.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $parts " == *" bench "* ]]; then
  PYTHONUNBUFFERED=1 timeout -k 10 "${BENCH_TIMEOUT:-600}" python3 benchmarks/gpu_bench.py --build-dir "$B/build" \
    --out "$OUT/gpu_bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
# One file to read first: the GPU, each part's gtest verdicts (and which tests failed), the
# benchmark's last lines.
{
  cat "$OUT/gpu.txt"
  for part in ops nccl parity; do
    [ -f "$OUT/$part.log" ] || continue
    echo "== $part"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|^\[  FAILED  \] .*\(" "$OUT/$part.log" | head -80
  done
  for part in attention engine bench; do
    [ -f "$OUT/$part.log" ] || continue
    echo "== $part"
    grep -v "^RESULTS " "$OUT/$part.log" | tail -60
  done
  echo "== exit $rc"
} > "$OUT/summary.txt" 2>&1
exit $rc
