# Sourced by scripts/lib/check.sh and scripts/lib/exits.sh: `said_skipped`, which counts the tests that
# said they were skipped. A Rust test cannot report itself skipped, and one that returns early reads as
# a pass: a test that could not test what it is for on this machine prints a line
# `SKIPPED: <test>: <reason>` instead (tests/gpu_storage.rs's say_skipped), and the scripts count them.

# said_skipped: prints how many `SKIPPED: ` lines the logs under $OUT hold, then those lines.
said_skipped() {
  local lines count=0
  # Not the `=== step: command` lines the step helper logs.
  lines=$(grep -h 'SKIPPED: ' "$OUT"/*.log 2>/dev/null | grep -v '^=== ' | grep -o 'SKIPPED: .*')
  [ -n "$lines" ] && count=$(printf '%s\n' "$lines" | wc -l)
  echo "tests that said SKIPPED: $count"
  if [ -n "$lines" ]; then
    printf '%s\n' "$lines" | cut -c1-200
  fi
}
