#!/usr/bin/env bash
# The device tool carries at most 64 MiB a call: the tracked tree (78 MB on 2026-11-29, 68 MB of
# it model fixtures) and what `carry` names (.device/: the full bundle is ~37 MB, the tests-only
# one ~8 MB). Fixtures a call does not read are left behind by taking them out of the index
# and ignoring them for that call; they stay on disk here, and `restore` puts them back.
#   scripts/gpu_tree.sh slim [FIXTURE ...]  leave tests/fixtures/models (all but the named
#                                           model folders: CudaParityTest runs the ones that
#                                           travel) and tests/fixtures/bin_checkpoints behind
#   scripts/gpu_tree.sh size                what would travel now, in MB (.device/ included)
#   scripts/gpu_tree.sh restore             the index and .git/info/exclude as they were
# Calls that read no model fixture (GPU_CHECKS="ops engine", "bench") take `slim` alone; a
# parity call with the tests-only bundle names at most ~40 MB of model folders.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
saved=$exclude.gpu_tree
case "${1:-}" in
  slim)
    shift
    if [ -e "$saved" ]; then
      echo "already slim (scripts/gpu_tree.sh restore first)"
      exit 1
    fi
    mkdir -p "$(dirname "$exclude")"
    touch "$exclude"
    cp "$exclude" "$saved"
    leave=(tests/fixtures/bin_checkpoints)
    for d in tests/fixtures/models/*/; do
      name=$(basename "$d")
      keep=0
      for k in "$@"; do [ "$k" = "$name" ] && keep=1; done
      [ "$keep" = 1 ] || leave+=("tests/fixtures/models/$name")
    done
    git rm -r -q --cached "${leave[@]}"
    for p in "${leave[@]}"; do echo "/$p/" >> "$exclude"; done
    "$0" size
    ;;
  size)
    { git ls-files -z; git ls-files -z --others --exclude-standard; } |
      xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "tree %.1f MB", $1 / 1e6}'
    if [ -d .device ]; then du -sb .device | awk '{printf ", .device %.1f MB", $1 / 1e6}'; fi
    echo " (the limit: 64 MiB = 67.1 MB)"
    ;;
  restore)
    git reset -q
    if [ -e "$saved" ]; then mv "$saved" "$exclude"; fi
    git status --short | head -5
    ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
