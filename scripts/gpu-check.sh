#!/usr/bin/env bash
# Runs on the GPU machine, in one command, after scripts/gpu-stage.sh staged .gpu/ here:
#   1. the kernel tests, GPU ones included;
#   2. compute-sanitizer memcheck, racecheck and synccheck over the kernel tests (smaller inputs);
#   3. the kernel benchmark and nvCOMP's LZ4 decoder on the same blocks;
#   4. an ncu profile of the kernels (--clock-control none).
# Full logs go to $OUT (the device tool brings them back); a short table is printed last. Steps run in
# order of importance under one time budget (GPUFEED_CHECK_BUDGET_S, default 540 s): a step that would
# start too late is skipped and reported so.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/gpufeed-check}"
budget_s="${GPUFEED_CHECK_BUDGET_S:-540}"
step_name_width=12
. scripts/lib/check.sh
export PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
  nvcc --version | tail -2
  compute-sanitizer --version | head -2
} >"$OUT/tests.log" 2>&1

tests=.gpu/bin/gpu_kernels
step tests tests 150 30 "$tests" --include-ignored --test-threads=4 --nocapture

run_tests=("$tests" --include-ignored --test-threads=1)
step memcheck sanitizer 150 40 "${sanitize[@]}" --tool memcheck "${run_tests[@]}" gpu_lz4 gpu_gather gpu_captured
step racecheck sanitizer 120 40 "${sanitize[@]}" --tool racecheck "${run_tests[@]}" gpu_lz4 gpu_gather
step synccheck sanitizer 60 30 "${sanitize[@]}" --tool synccheck "${run_tests[@]}" gpu_lz4

step bench bench 240 60 .gpu/bin/kernel_bench --mib 1024 --data /tmp/gpufeed-bench --out "$OUT"
step nvcomp-pip nvcomp 60 20 python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/nvcomp-site .gpu/whl/nvidia_nvcomp_cu13-*.whl .gpu/whl/nvidia_libnvcomp_cu13-*.whl
step nvcomp nvcomp 170 30 env PYTHONPATH=/tmp/nvcomp-site python3 scripts/nvcomp_bench.py /tmp/gpufeed-bench
step ncu ncu 120 45 ncu --clock-control none --kernel-name regex:gf_ --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  .gpu/bin/kernel_bench --profile --mib 256

# Sanitizer verdicts (their summaries), then the tables.
sanitizer_verdicts
grep -E '^test result|FAILED|panicked' "$OUT/tests.log" | head -20
echo
grep -E '^\| ' "$OUT/nvcomp.log" 2>/dev/null
echo
[ -f "$OUT/kernel_bench.md" ] && cat "$OUT/kernel_bench.md"
echo
step_summary
