#!/usr/bin/env bash
# `make run`: starts the launcher on the CPU with the bundled demo model, streams a sample
# generation with the bundled client, and leaves the server running.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL_NAME:-tests/fixtures/models/gpt2}
GRPC_PORT=${GRPC_PORT:-8033}
PORT=${PORT:-3000}
RUN_DIR=${RUN_DIR:-$BUILD_DIR/run}
mkdir -p "$RUN_DIR"

if python3 scripts/tgis_client.py --target "localhost:$GRPC_PORT" --tokenize "ping" >/dev/null 2>&1; then
  echo "A server already answers on port $GRPC_PORT; using it."
else
  echo "Starting text-generation-launcher with $MODEL (logs: $RUN_DIR/launcher.log)"
  MODEL_NAME="$MODEL" GRPC_PORT="$GRPC_PORT" PORT="$PORT" \
    SHARD_UDS_PATH="$(realpath "$RUN_DIR")/shard" TERMINATION_LOG="$RUN_DIR/termination-log" \
    MAX_SEQUENCE_LENGTH="${MAX_SEQUENCE_LENGTH:-256}" KV_CACHE_BLOCKS="${KV_CACHE_BLOCKS:-256}" \
    nohup "$BUILD_DIR/launcher/text-generation-launcher" >"$RUN_DIR/launcher.log" 2>&1 &
  echo $! >"$RUN_DIR/launcher.pid"
fi
python3 scripts/tgis_client.py --target "localhost:$GRPC_PORT" --wait 120 --max-new-tokens 24 \
  "The quick brown fox"
cat <<EOT

The server keeps running (launcher pid $(cat "$RUN_DIR/launcher.pid" 2>/dev/null || echo '?')):
  gRPC fmaas.GenerationService  localhost:$GRPC_PORT   (reflection on: grpcurl works without protos)
  HTTP /health, /metrics        http://localhost:$PORT
  stop it with:                 kill \$(cat $RUN_DIR/launcher.pid)
The demo model has random weights (a tiny test fixture): the text is nonsense by design.
Examples are in README.md.
EOT
