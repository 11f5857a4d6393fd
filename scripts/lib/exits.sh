# Sourced by the GPU scripts that run their steps by hand (gpu-serve.sh, gpu-storage.sh, gpu-e2e.sh):
# a failed step must make the whole script fail, even though the script goes on to run and log the
# remaining steps (the device tool brings back the logs either way).

. scripts/lib/skipped.sh
failed_steps=0

# note_exit RC LOG: logs "exit RC" to LOG and counts the step as failed when RC is not 0.
note_exit() {
  echo "exit $1" >>"$2"
  if [ "$1" -ne 0 ]; then
    failed_steps=$((failed_steps + 1))
  fi
}

# finish: the tests that said SKIPPED (counted, not failed), then the script's exit status: 1 when any
# step failed (and says how many), else 0.
finish() {
  said_skipped
  if [ "$failed_steps" -ne 0 ]; then
    echo "FAILED: $failed_steps step(s) failed" >&2
    exit 1
  fi
  exit 0
}
