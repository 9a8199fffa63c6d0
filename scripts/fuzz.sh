#!/usr/bin/env bash
# Runs every libFuzzer target of a TGIS_FUZZ build for SECONDS each, starting from the seed
# corpus and the regressions, and prints executions and speed per target. A crash, leak,
# sanitizer report or timeout fails the run; the input that caused it is left in
# BUILD/fuzz/artifacts/<target>/ (add it to tests/fuzz/regressions/<target>/ with the fix).
#   [FUZZ_SEED=N] scripts/fuzz.sh BUILD_DIR SECONDS
# FUZZ_SEED fixes libFuzzer's random seed (make test does, so that a CI run does not stumble on
# a new finding by chance; `make fuzz` does not, to explore).
set -uo pipefail
build=${1:?build dir}
seconds=${2:?seconds per target}
root=$(cd "$(dirname "$0")/.." && pwd)
# One target per tests/fuzz/<name>_fuzz.cc (tests/CMakeLists.txt builds each).
targets=()
for src in "$root"/tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$src" _fuzz.cc)"); done
rc=0
summary=()
for t in "${targets[@]}"; do
  bin="$build/tests/${t}_fuzz"
  if [ ! -x "$bin" ]; then
    echo "fuzz: $bin is not built" >&2
    rc=1
    continue
  fi
  corpus="$build/fuzz/corpus/$t"   # what this machine found so far (kept between runs)
  artifacts="$build/fuzz/artifacts/$t/"
  mkdir -p "$corpus" "$artifacts"
  log="$build/fuzz/$t.log"
  # -timeout: one input taking this long is a hang; -rss_limit_mb: a parser that allocates
  # this much for one input is a bug too; -max_len: larger than every seed.
  "$bin" "$corpus" "$root/tests/fuzz/corpus/$t" "$root/tests/fuzz/regressions/$t" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    ${FUZZ_SEED:+-seed="$FUZZ_SEED"} -artifact_prefix="$artifacts" -print_final_stats=1 -close_fd_mask=1 >"$log" 2>&1
  status=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  if [ $status -ne 0 ]; then
    rc=1
    echo "fuzz: $t FAILED (exit $status); log $log, input in $artifacts" >&2
    grep -E 'ERROR|SUMMARY|runtime error|==[0-9]+==' "$log" | head -20 >&2
    summary+=("$t: FAILED after ${execs:-?} executions")
  else
    summary+=("$t: ${execs:-?} executions, ${speed:-?}/s, no failure")
  fi
done
echo "fuzz: ${seconds}s per target"
printf '  %s\n' "${summary[@]}"
exit $rc
