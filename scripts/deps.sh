#!/usr/bin/env bash
# Installs every system package and Python test package the project needs on Debian 12.
# Idempotent and quick when all is present: it checks before it installs.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libgflags-dev libgoogle-glog-dev libgtest-dev libgmock-dev libbenchmark-dev
  libsentencepiece-dev nlohmann-json3-dev libonig-dev libicu-dev libssl-dev libopenblas-dev
  libcpp-httplib-dev prometheus libgloo-dev libcurl4-openssl-dev
  clang libclang-rt-14-dev
  python3-venv
)
PY_PACKAGES=(
  "tokenizers==0.21.1" "sentencepiece==0.2.0" "transformers==4.55.4" "protobuf" "pytest" "huggingface_hub" "opentelemetry-proto"
  "grpcio" "grpcio-tools" "numpy" "pyyaml" "kubernetes-validate" "matplotlib"
)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
    missing+=("$p")
  fi
done
apt_updated=0
apt_install() {
  if [ $apt_updated = 0 ]; then
    $SUDO apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@"
}
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  apt_install "${missing[@]}"
fi

# kubectl (for `kubectl kustomize` in the manifest tests): any kubectl on PATH will do (some
# images ship Google Cloud SDK's); otherwise Debian's kubernetes-client.
if ! command -v kubectl >/dev/null 2>&1; then
  echo "deps: installing kubernetes-client (kubectl)"
  apt_install kubernetes-client
fi

PY=${PYTHON:-python3}
py_missing=()
for spec in "${PY_PACKAGES[@]}"; do
  name=${spec%%==*}
  want=""
  [[ "$spec" == *==* ]] && want=${spec##*==}
  have=$($PY -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
  if [ -z "$have" ] || { [ -n "$want" ] && [ "$have" != "$want" ]; }; then
    py_missing+=("$spec")
  fi
done
if [ ${#py_missing[@]} -gt 0 ]; then
  echo "deps: pip installing ${py_missing[*]}"
  $PY -m pip install -q --disable-pip-version-check "${py_missing[@]}" ||
    $PY -m pip install -q --disable-pip-version-check --break-system-packages "${py_missing[@]}"
fi
echo "deps: all present"
