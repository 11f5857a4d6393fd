#!/usr/bin/env bash
# The CPU backend beyond RAM, on this machine (root, a cgroup v1 or v2 memory controller): a raw
# dataset of CPU_BEYOND_GIB (1.5) GiB of fp16 rows of 2 KiB, a CPU-backend daemon in a memory cgroup
# of CPU_BEYOND_MEM_MIB (512) MiB, the page cache dropped before each run. Per round (3): the disk's
# 4 KiB random-read rate at queue depth 64 (scripts/random_read_probe.py, 4 s), a full shuffle of
# 200 batches of 1024 rows read from the disk (GPUFEED_ROW_READS=auto: the dataset is larger than the
# cgroup), the same through the page cache (GPUFEED_ROW_READS=page-cache) for 3 batches within 60 s,
# a window shuffle of 2 shards (512 MiB, twice of which the cgroup cannot keep) the same two ways
# (200 and 20 batches), dataset order for 200 batches, and `dd iflag=direct bs=16M` of every shard (the
# disk's sequential rate, for dataset order). CPU_BEYOND_CASES (probe full window order dd) chooses
# the cases. Release binaries from target/release (built first). Every run is a JSON line in
# $OUT/cpu-beyond.jsonl (OUT defaults to /tmp/gpufeed-cpu-beyond).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpufeed-cpu-beyond}"
mkdir -p "$OUT"
jsonl="$OUT/cpu-beyond.jsonl"
: >"$jsonl"
cargo build --release --bin gpufeed --example consume -q || exit 1
bin=target/release
work=/var/tmp/gpufeed-cpu-beyond
gib=${CPU_BEYOND_GIB:-1.5}
mem=$(( ${CPU_BEYOND_MEM_MIB:-512} << 20 ))
mkdir -p "$work/data"
if [ ! -f "$work/data/emb/manifest.json" ]; then
  python3 - "$work/emb.npy" "$gib" <<'PY' || exit 1
import sys, numpy as np
n = int(float(sys.argv[2]) * (1 << 30)) // 2048
a = np.lib.format.open_memmap(sys.argv[1], mode="w+", dtype=np.float16, shape=(n, 1024))
rng = np.random.default_rng(1)
for i in range(0, n, 65536):
    a[i:i + 65536] = rng.standard_normal((min(65536, n - i), 1024), dtype=np.float32).astype(np.float16)
a.flush()
PY
  "$bin/gpufeed" pack --out "$work/data/emb" --codec raw --samples-per-shard 131072 "$work/emb.npy" || exit 1
  rm -f "$work/emb.npy"
fi
if [ -d /sys/fs/cgroup/memory ]; then
  cg=/sys/fs/cgroup/memory/gpufeed-cpu-beyond; limit_file=memory.limit_in_bytes
else
  cg=/sys/fs/cgroup/gpufeed-cpu-beyond; limit_file=memory.max
fi
mkdir -p "$cg" && echo "$mem" >"$cg/$limit_file" || { echo "no writable memory cgroup"; exit 1; }
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# run CASE ORDER STEPS BOUND_S READS: a fresh daemon in the cgroup, one consumer; a JSON line.
run() {
  local case=$1 order=$2 steps=$3 bound=$4 reads=$5 line
  drop
  rm -f /tmp/gpufeed-cpu-beyond.sock
  GPUFEED_ROW_READS=$reads sh -c "echo \$\$ >$cg/cgroup.procs && exec $bin/gpufeed serve --data-root $work/data \
    --socket /tmp/gpufeed-cpu-beyond.sock --device cpu --http off" 2>>"$OUT/cpu-beyond-daemon.log" &
  local daemon=$!
  for _ in $(seq 100); do [ -S /tmp/gpufeed-cpu-beyond.sock ] && break; sleep 0.1; done
  line=$(timeout "$bound" "$bin/examples/consume" --socket /tmp/gpufeed-cpu-beyond.sock --dataset emb \
    --device cpu --batch-size 1024 --dtype f32 --field data --shuffle "$order" --window-shards 2 \
    --seed "$round" --steps "$steps" --daemon-pid "$daemon" | tail -1)
  local status=$?
  kill "$daemon"; wait "$daemon" 2>/dev/null
  python3 - "$case" "$order" "$round" "$status" "$bound" "$steps" "$line" >>"$jsonl" <<'PY'
import json, sys
case, order, run, status, bound, steps, line = sys.argv[1:]
try:
    s = json.loads(line)
except ValueError:
    s = {}
secs = s.get("seconds")
rec = {"loader": "gpufeed-cpu", "case": case, "order": order, "run": int(run), "batch_size": 1024,
       "steps": int(steps), "exit_status": int(status), "stream_seconds": secs,
       "first_batch_seconds": s.get("first_batch_seconds"), "bytes_in": s.get("bytes", 0) // 2,
       "gb_per_s_in_stream": s["bytes"] / 2 / secs / 1e9 if secs else None,
       "daemon_cores_stream": s["daemon_cpu_s_stream"] / secs if secs and s.get("daemon_cpu_s_stream") is not None else None}
if int(status) == 124:
    rec["timed_out"] = True
    rec["gb_per_s_in_upper_bound"] = int(steps) * 1024 * 2048 / float(bound) / 1e9
print(json.dumps(rec))
PY
  tail -1 "$jsonl"
}
cases=" ${CPU_BEYOND_CASES:-probe full window order dd} "
want() { case "$cases" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for skipped in probe full window order dd; do
  want "$skipped" || echo "skipped: $skipped (not in CPU_BEYOND_CASES)"
done
# dd_round: dd iflag=direct of every shard, one after the other; a JSON line.
dd_round() {
  drop
  local start end bytes
  bytes=$(cat "$work"/data/emb/*.gfs | wc -c)
  start=$(date +%s.%N)
  for f in "$work"/data/emb/*.gfs; do dd if="$f" of=/dev/null bs=16M iflag=direct status=none; done
  end=$(date +%s.%N)
  python3 -c 'import json,sys; b,s,e,r=int(sys.argv[1]),float(sys.argv[2]),float(sys.argv[3]),int(sys.argv[4]); print(json.dumps({"loader": "dd-direct", "case": "cpu-beyond", "run": r, "bytes": b, "seconds": e - s, "gb_per_s_in": b / (e - s) / 1e9}))' "$bytes" "$start" "$end" "$round" >>"$jsonl"
  tail -1 "$jsonl"
}
shard=$(ls "$work"/data/emb/*.gfs | head -1)
for round in 1 2 3; do
  if want probe; then
    drop
    python3 scripts/random_read_probe.py --file "$shard" --depth 64 --seconds 4 \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); d.update(case="cpu-beyond", run=int(sys.argv[1])); print(json.dumps(d))' "$round" >>"$jsonl"
    tail -1 "$jsonl"
  fi
  if want full; then
    run disk full 200 120 auto
    run page-cache full 3 60 page-cache
  fi
  if want window; then
    run disk window 200 120 auto
    run page-cache window 20 60 page-cache
  fi
  want order && run order none 200 120 auto
  want dd && dd_round
done
rmdir "$cg" 2>/dev/null
