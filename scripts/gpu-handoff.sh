#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh and scripts/gpu-stage-python.sh staged
# .gpu/read/ here, in one command, the checks of the shared-memory hand-off:
#   1. the GPU serving tests (two consumer processes bit-exact, corrupt blocks, 100 killed consumers
#      and device memory back to its baseline), through the hand-off ring;
#   2. the Python package's tests against a CPU daemon (torch required) and its device tests (torch
#      and CuPy through DLPack bit-exact, a sleeping consumer stream keeps its slot);
#   3. the hand-off benchmark (examples/handoff_bench.rs): HANDOFF_GIB GiB (default 8) of fp16 rows
#      of 2 KiB, in order, page cache warm, fp32 device batches, batch sizes HANDOFF_BATCHES, 3 runs
#      of >= 10 000 batches each: the pipeline alone beside a consumer process (GPUFEED_SPIN_US, if
#      set, is the consumer's spin before it sleeps; HANDOFF_RUNS and HANDOFF_MIN_BATCHES change the 3
#      runs and the 10 000 batches). The dataset is packed once per machine in
#      /var/tmp/gpufeed-handoff and reused by later invocations of the same size (--reuse);
#   4. with HANDOFF_PY_BENCH=1, the Python consumer against the Rust one (scripts/gpu-python.sh).
# JSON lines in $OUT/handoff.jsonl. Any failed step makes the script exit non-zero; a summary is
# printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpufeed-handoff}"
export OUT
budget_s="${GPUFEED_CHECK_BUDGET_S:-570}"
step_name_width=14
. scripts/lib/check.sh
. scripts/lib/staged.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; } >"$OUT/tests.log" 2>&1

rows=$(( ${HANDOFF_GIB:-8} * 1024 * 1024 * 1024 / 2048 ))
[ -n "${HANDOFF_BENCH_ONLY:-}" ] || step gpu_serve tests 200 30 "$bin/gpu_serve" --include-ignored --test-threads=1 \
  --skip two_devices
if ls .gpu/read/py/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --force-reinstall --target /tmp/gpufeed-site .gpu/read/py/*.whl \
    .gpu/read/py/deps/*.whl >>"$OUT/tests.log" 2>&1
fi
if [ -z "${HANDOFF_BENCH_ONLY:-}" ] && ls .gpu/read/py/*.whl >/dev/null 2>&1; then
  step py_cpu tests 120 20 env PYTHONPATH=/tmp/gpufeed-site GPUFEED_REQUIRE_TORCH=1 \
    python3 -m pytest -q -rs -p no:cacheprovider ffi/python/tests
  step py_gpu tests 150 20 env PYTHONPATH=/tmp/gpufeed-site GPUFEED_TEST_DEVICE=cuda:0 \
    python3 -m pytest -q -rs -p no:cacheprovider ffi/python/tests/test_gpu.py
fi
mkdir -p /var/tmp/gpufeed-handoff
step handoff bench "${HANDOFF_BENCH_S:-330}" 60 "$bin/handoff_bench" --device cuda:0 \
  --consume-bin "$bin/consume" --dir /var/tmp/gpufeed-handoff --reuse --row-bytes 2048 --samples "$rows" \
  --dtype f32 --batch-sizes "${HANDOFF_BATCHES:-64,256,1024,4096,16384}" --runs "${HANDOFF_RUNS:-3}" \
  --min-batches "${HANDOFF_MIN_BATCHES:-10000}" --out "$OUT/handoff.jsonl"
python3 - "$OUT/handoff.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if '"median"' in l]
except OSError:
    rows = []
print("| batch | batches | pipeline GB/s in | consumer GB/s in | ratio | hand-off p50 / p99 / max us | daemon / consumer cores |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print("| %d | %d | %.1f | %.1f | %.2f | %.1f / %.1f / %.0f | %.2f / %.2f |" % (
        r["batch_size"], r["batches"], r["pipeline_input_gb_per_s"], r["consumer_input_gb_per_s"],
        r["consumer_over_pipeline"], r["handoff_us_p50"], r["handoff_us_p99"], r["handoff_us_max"],
        r["daemon_cpu_cores"], r["consumer_cpu_cores"]))
PY
# The Python consumer against the Rust one (scripts/gpu-python.sh's benchmark), when asked for.
if [ -n "${HANDOFF_PY_BENCH:-}" ]; then
  step py_bench bench 240 60 env PYTHONPATH=/tmp/gpufeed-site bash scripts/gpu-python.sh --bench-only
  grep -A8 '^| consumer' "$OUT/bench.log"
fi
grep -E "^test result|FAILED|panicked|passed|failed" "$OUT/tests.log" | tail -12
step_summary
