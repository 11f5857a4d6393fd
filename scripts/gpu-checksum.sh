#!/usr/bin/env bash
# Runs on the GPU machine, in one command, after scripts/gpu-stage-checksum.sh staged .gpu/checksum/:
#   1. the checksum kernel's tests (GPU ones included);
#   2. compute-sanitizer memcheck, then racecheck, over those tests (smaller inputs);
#   3. the checksum benchmark (one JSON line).
# Full logs go to $OUT (the device tool brings them back); a short table is printed last. Steps run
# under one time budget (GPUFEED_CHECK_BUDGET_S, default 270 s): a step that would start too late is
# skipped and reported so.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/gpufeed-checksum}"
budget_s="${GPUFEED_CHECK_BUDGET_S:-270}"
step_name_width=10
. scripts/lib/check.sh
bin=.gpu/checksum/bin

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
  compute-sanitizer --version | head -2
} >"$OUT/tests.log" 2>&1

step tests tests 90 20 "$bin/gpu_checksum" --include-ignored --test-threads=2 --nocapture

step memcheck sanitizer 100 30 "${sanitize[@]}" --tool memcheck "$bin/gpu_checksum" --include-ignored --test-threads=1
step racecheck sanitizer 60 20 "${sanitize[@]}" --tool racecheck "$bin/gpu_checksum" --include-ignored --test-threads=1 gpu_xxh3_checks gpu_xxh3_matches

step bench bench 60 20 "$bin/checksum_bench" --mib 1024 --reps 20
grep -h '^{' "$OUT/bench.log" >"$OUT/checksum_bench.jsonl" 2>/dev/null

sanitizer_verdicts
grep -E '^test |^test result|FAILED|panicked' "$OUT/tests.log" | head -20
echo
python3 - "$OUT/checksum_bench.jsonl" <<'PY'
import json, sys
try:
    line = json.loads(open(sys.argv[1]).readline())
except (OSError, ValueError):
    sys.exit("no benchmark line")
print(f"{line['device']}: xxh3 verify {line['verify_gb_per_s']:.0f} GB/s (64 KiB blocks), "
      f"D2D copy {line['copy_gb_per_s']:.0f} GB/s copied ({line['copy_read_write_gb_per_s']:.0f} read+write), "
      f"one CPU core {line['cpu_one_core_gb_per_s']:.1f} GB/s")
print(f"{'block':>9} {'warps/blk':>9} {'blk/step':>8} {'warps/SM':>8} {'ms':>8} {'GB/s':>7}")
for r in line["runs"]:
    print(f"{r['block_bytes']:>9} {r['warps_per_block']:>9} {r['blocks_per_step']:>8} "
          f"{r['resident_warps_per_sm']:>8} {r['ms_median']:>8.3f} {r['gb_per_s']:>7.0f}")
PY
echo
step_summary
