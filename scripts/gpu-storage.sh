#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-storage.sh staged .gpu/storage/ here:
#   1. the per-file cuFile fallback test, before the udev entry exists (registration fails);
#   2. the udev entry cuFile needs on this VM (see shared/GPU_MACHINE.md), then all GPU storage tests;
#   3. the read benchmark per path, cold and warm, with dd iflag=direct and KvikIO on the same file
#      (warm: 4, 8 and 16 threads, each a line, the best marked).
# Logs go to $OUT; a short table is printed last, with the tests that said `SKIPPED:` (could not test
# what they are for here) counted. Any failed test, benchmark or peer run fails the script.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/exits.sh
OUT="${OUT:-/tmp/gpufeed-storage}"
mkdir -p "$OUT"
. scripts/lib/gpu-env.sh
export PYTHONUNBUFFERED=1
export GPUFEED_TEST_DIR=/var/tmp
bin=.gpu/storage/bin
log="$OUT/storage.log"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; df -hT /var/tmp; } >"$log" 2>&1

echo "=== fallback test without the udev entry" >>"$log"
timeout 120 "$bin/gpu_storage" --include-ignored --nocapture cufile_falls_back >>"$log" 2>&1
note_exit $? "$log"

cufile_udev_entry
echo "=== all storage tests with the udev entry" >>"$log"
timeout 300 "$bin/gpu_storage" --include-ignored --nocapture --test-threads=1 >>"$log" 2>&1
note_exit $? "$log"

bench="$OUT/read_bench.jsonl"
: >"$bench"
file=/var/tmp/gpufeed-read-bench.bin
dd if=/dev/urandom of="$file" bs=64M count=64 status=none && sync
# dd iflag=direct, the disk's own pace, measured before and after the other cold reads (the virtio disk
# varies from run to run).
dd_direct() {
  echo "=== dd iflag=direct cold" >>"$log"
  echo 3 >/proc/sys/vm/drop_caches
  dd if="$file" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | tee -a "$log" |
    python3 -c 'import sys,json,re; l=sys.stdin.read(); m=re.search(r"(\d+) bytes.*?([\d.]+) s",l); b,s=int(m[1]),float(m[2]); print(json.dumps({"path":"dd-direct","temperature":"cold","bytes":b,"seconds":s,"gb_per_s":b/s/1e9}))' >>"$bench"
}
dd_direct
for run in "bounce cold" "bounce cold 64" "cufile cold - 1" "cufile cold - 8" "auto cold" "page_cache warm" "bounce warm" "auto warm" "cufile warm - 8"; do
  set -- $run
  echo "=== read_bench $*" >>"$log"
  [ "$2" = cold ] && echo 3 >/proc/sys/vm/drop_caches
  extra=()
  [ "${3:--}" != - ] && extra+=(--bounce-mib "$3")
  [ -n "${4:-}" ] && extra+=(--cufile-threads "$4")
  timeout 120 "$bin/read_bench" --file "$file" --path "$1" --temperature "$2" "${extra[@]}" >>"$bench" 2>>"$log"
  note_exit $? "$log"
done
dd_direct
# Interleaved cold rounds (STORAGE_COLD_ROUNDS, default 0): dd, then gpufeed's auto and bounce paths,
# each after dropping the cache, so that the disk's drift within a run hits both sides alike.
for round in $(seq 1 "${STORAGE_COLD_ROUNDS:-0}"); do
  dd_direct
  for path in auto bounce; do
    echo "=== read_bench $path cold (interleaved round $round)" >>"$log"
    echo 3 >/proc/sys/vm/drop_caches
    timeout 120 "$bin/read_bench" --file "$file" --path "$path" --temperature cold >>"$bench" 2>>"$log"
    note_exit $? "$log"
  done
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvikio-site .gpu/storage/whl/*.whl >>"$log" 2>&1
note_exit $? "$log"
# KvikIO twice: as it configures itself (it finds libcufile and, with the udev entry, uses cuFile's
# compatibility mode, which reads with O_DIRECT), and forced to its POSIX path (KVIKIO_COMPAT_MODE=ON),
# which reads through the page cache with its thread pool. Warm, the thread counts are swept (each a
# line, the fastest marked best); cold, 8 threads (a cold read per count would need a drop each).
for run in "4,8,16 warm AUTO" "8 cold AUTO" "4,8,16 warm ON" "1 warm ON" "8 cold ON"; do
  set -- $run
  [ "$2" = cold ] && echo 3 >/proc/sys/vm/drop_caches
  KVIKIO_COMPAT_MODE=$3 PYTHONPATH=/tmp/kvikio-site timeout 180 python3 scripts/kvikio_read.py "$file" \
    --threads "$1" --temperature "$2" --label "kvikio-{threads}t-compat-$3" >>"$bench" 2>>"$log"
  note_exit $? "$log"
done
rm -f "$file"

grep -E '^test |^test result|exit [0-9]|cold path|GB/s|falls back|registered|refused|SKIPPED: ' "$log" | cut -c1-200
echo
python3 - "$bench" <<'PY'
import json, sys
print(f"{'path':<22} {'temp':<5} {'GB/s':>7} {'host cores':>10}")
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    best = " best of " + ",".join(map(str, r["threads_swept"])) + " threads" if r.get("best") and len(r.get("threads_swept", [])) > 1 else ""
    print(f"{r['path']:<22} {r['temperature']:<5} {r['gb_per_s']:>7.2f} {r.get('host_cores', float('nan')):>10.2f}{best}")
PY
finish
