#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-serve.sh staged .gpu/serve/ here:
#   1. the GPU serving tests (two consumer processes, bit-exact against the source and the CPU backend,
#      corrupt blocks, 100 killed consumers and device memory back to its baseline);
#   2. the serving benchmark: pipeline alone against a consumer process, hand-off latency, per batch
#      size (SERVE_BATCHES) and rounds in flight (SERVE_ROUNDS, default: the node default).
# Logs go to $OUT; a short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/exits.sh
OUT="${OUT:-/tmp/gpufeed-serve}"
mkdir -p "$OUT"
. scripts/lib/gpu-env.sh
export GPUFEED_CACHE_DIR=/var/tmp/gpufeed-kernels
bin="$PWD/.gpu/serve/bin"
export GPUFEED_BIN="$bin/gpufeed" GPUFEED_CONSUME_BIN="$bin/consume"
export TMPDIR=/var/tmp
log="$OUT/serve.log"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; } >"$log" 2>&1
cufile_udev_entry

echo "=== gpu_serve tests" >>"$log"
timeout "${SERVE_TEST_TIMEOUT:-300}" "$bin/gpu_serve" --include-ignored --nocapture --test-threads=1 \
  --skip two_devices >>"$log" 2>&1
rc=$?; echo "tests exit $rc"; note_exit "$rc" "$log"

bench="$OUT/serve_bench.jsonl"
: >"$bench"
for rounds in ${SERVE_ROUNDS:-default}; do
  rounds_args=()
  [ "$rounds" != default ] && rounds_args=(--rounds-in-flight "$rounds")
  for batch in ${SERVE_BATCHES:-1024 4096}; do
    echo "=== serve_bench batch $batch rounds in flight $rounds" >>"$log"
    timeout 200 "$bin/serve_bench" --device cuda:0 --consume-bin "$bin/consume" --dir /var/tmp \
      --samples "${SERVE_SAMPLES:-524288}" --batch-size "$batch" "${rounds_args[@]}" >>"$bench" 2>>"$log"
    note_exit $? "$log"
  done
done
grep -E "^test |test result|exit" "$log" | tail -20
cat "$bench"
finish
