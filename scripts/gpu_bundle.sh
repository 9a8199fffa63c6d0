#!/usr/bin/env bash
# Packs what the GPU checks need into .device/ for the device tool (a lent GPU machine that
# has CUDA, cuBLAS, NCCL and PyTorch but none of our C++ dependencies and no network):
#   .device/bundle.tar.xz  stripped binaries in the build tree's layout, and the shared
#                          libraries they need beyond glibc and what the GPU machine has
#                          (CUDA runtime, cuBLAS, NCCL)
#   .device/wheels/        grpcio, grpcio-tools and protobuf for Python 3.12, so the Python
#                          client side matches the versions the stubs are generated with
# GPU_BUNDLE=tests packs only the test binaries and engine_, attention_ and ssm_bench, and no wheels
# (the router's ICU data alone is ~7.5 MB compressed). The device tool's 64 MiB must cover what
# travels of the tree and the bundle: the tracked tree alone is over it (78 MB, 68 of them model
# fixtures), so scripts/gpu_tree.sh slim leaves the fixtures a call does not read behind.
# Then, with the device tool: run(carry=[".device"], command="bash scripts/gpu_checks.sh").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
OUT=.device
rm -rf "$OUT" && mkdir -p "$OUT/stage/lib" "$OUT/wheels"

if [ "${GPU_BUNDLE:-all}" = tests ]; then
  bins=(tests/kernels_test tests/model_parity_test tests/tensor_parallel_test
        benchmarks/engine_bench benchmarks/attention_bench benchmarks/ssm_bench)
else
  bins=(tests/kernels_test tests/model_parity_test tests/tensor_parallel_test
        server/text-generation-server router/text-generation-router
        launcher/text-generation-launcher benchmarks/engine_bench benchmarks/attention_bench
        benchmarks/ssm_bench)
fi
for b in "${bins[@]}"; do
  test -x "$BUILD_DIR/$b" || { echo "missing $BUILD_DIR/$b: run make build first" >&2; exit 1; }
  mkdir -p "$OUT/stage/build/$(dirname "$b")"
  strip --strip-debug -o "$OUT/stage/build/$b" "$BUILD_DIR/$b"
done

# Shared libraries, minus glibc's and the GPU stack the device machine brings itself.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libcuda\.so|libcudart|libcublas|libnccl)'
# OpenBLAS is dlopen'ed (kernels/cpu/blas.h), so ldd does not list it: add it and its needs.
blas=$(ldconfig -p | awk '$1 == "libopenblas.so.0" && !seen {print $NF; seen = 1}')  # no early exit: ldconfig would die of SIGPIPE under pipefail
test -n "$blas" || { echo "libopenblas.so.0 not found: run make deps" >&2; exit 1; }
{
  echo "libopenblas.so.0 $blas"
  for f in "${bins[@]/#/$BUILD_DIR/}" "$blas"; do
    ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
  done
} | sort -u | while read -r name path; do
  if [[ ! $name =~ $skip ]]; then cp -L "$path" "$OUT/stage/lib/$name"; fi
done
strip --strip-unneeded "$OUT"/stage/lib/*.so* 2>/dev/null || true
XZ_OPT=-9e tar -C "$OUT/stage" -cJf "$OUT/bundle.tar.xz" .
rm -rf "$OUT/stage"

[ "${GPU_BUNDLE:-all}" = tests ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$OUT/wheels" \
  "grpcio==$(python3 -c 'import grpc; print(grpc.__version__)')" \
  "grpcio-tools==$(python3 -m pip show grpcio-tools | awk '/^Version/ {print $2}')" \
  "protobuf==$(python3 -m pip show protobuf | awk '/^Version/ {print $2}')"
du -sh "$OUT"/* | sed 's/^/  /'
echo "bundle ready in $OUT (carry it: run(carry=[\".device\"], command=\"bash scripts/gpu_checks.sh\"))"
