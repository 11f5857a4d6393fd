# Sourced on the GPU machine by scripts/gpu-check.sh and scripts/gpu-checksum.sh, from the repository
# root, once they have set OUT (where logs go), budget_s (seconds all steps may take) and
# step_name_width (the width of the step names in the summary). Sets up the CUDA environment and
# defines `step`, which runs each step under the time budget, and `step_summary`, which prints the
# verdicts.

mkdir -p "$OUT"
. scripts/lib/gpu-env.sh
. scripts/lib/skipped.sh
export GPUFEED_CACHE_DIR=/tmp/gpufeed-kernel-cache
started=$(date +%s)
summary=()
# compute-sanitizer over the GPU tests, on small inputs (it slows kernels down a hundredfold); the tool
# and the test command follow.
sanitize=(env GPUFEED_TEST_SCALE=small compute-sanitizer --error-exitcode 99 --print-limit 20)

# step NAME LOG LIMIT_S MIN_S COMMAND...: runs COMMAND with its output appended to $OUT/LOG.log, within
# LIMIT_S and what is left of the budget; skipped when less than MIN_S (at most LIMIT_S) is left. (The
# device tool brings back at most 8 files, so related steps share a log.)
step() {
  local name=$1 log=$2 limit=$3 min=$4
  shift 4
  [ "$min" -gt "$limit" ] && min=$limit
  local left=$((budget_s - ($(date +%s) - started)))
  if [ "$left" -lt "$min" ]; then
    summary+=("$(printf "%-${step_name_width}s SKIPPED (%ss of budget left)" "$name" "$left")")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc
  t0=$(date +%s)
  echo "=== $name: $*" >>"$OUT/$log.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log.log" 2>&1
  rc=$?
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict="FAIL (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'))"
  summary+=("$(printf "%-${step_name_width}s %-28s %4ss" "$name" "$verdict" "$(($(date +%s) - t0))")")
}

# sanitizer_verdicts: the sanitizer steps' commands and summaries, from $OUT/sanitizer.log.
sanitizer_verdicts() {
  grep -E '^=== |ERROR SUMMARY|RACECHECK SUMMARY|^test result' "$OUT/sanitizer.log" 2>/dev/null | cut -c1-160
}

# step_summary: one line per step, the tests that said SKIPPED (counted, not failed), then the total
# time; fails (status 1) when a step failed, so that a script ending with it fails too (a step skipped
# for the time budget is reported, not failed).
step_summary() {
  printf '%s\n' "${summary[@]}"
  said_skipped
  echo "total $(($(date +%s) - started))s"
  ! printf '%s\n' "${summary[@]}" | grep -q FAIL
}
