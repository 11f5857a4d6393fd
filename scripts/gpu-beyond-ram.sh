#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh staged .gpu/read/ here: a dataset larger
# than the memory its page cache may hold. The daemon runs in a memory cgroup of BEYOND_MEM (4G);
# the dataset is BEYOND_GIB (12) GiB of fp16 rows of 2 KiB ([N, 1024], make_data.py), packed raw into
# shards of 512 MiB (the source .npy is then deleted: the disk is 64 GiB). Every figure is over the
# dataset at 3x the cgroup's limit, cold (the page cache dropped before each measurement, a fresh
# daemon for each consumer), fp32 device batches of BEYOND_BATCH (4096) rows, one consumer process
# (`consume`) per run, BEYOND_ROUNDS (3) interleaved rounds of:
#   - `dd iflag=direct bs=16M` of every shard file, one after the other (the disk's sequential rate);
#   - scripts/random_read_probe.py: 4 KiB O_DIRECT reads at random offsets of one shard file at queue
#     depth 64 (a 2 KiB row aligned to 2 KiB lies in one such page) for 5 s;
#   - gpufeed in dataset order and in a window shuffle (4 shards): one epoch each;
#   - gpufeed in a full shuffle: BEYOND_FULL_STEPS (400) batches of a fresh daemon, whose blocks are
#     verified as they are first read (a row of a block not verified yet reads its whole block);
#     then, on the same daemon, BEYOND_FULL_STEPS more from another seed (more blocks verified).
# BEYOND_ORDERS (none window full) chooses the orders (a skipped one is said so); BEYOND_DAEMON_FLAGS
# adds flags to every daemon. BEYOND_WINDOW_AB=1 adds, in each round, the window shuffle once more
# without its cold start (GPUFEED_COLD_START_STEPS=0: the first batch waits for the window's shards),
# case beyond-ram-no-cold-start. Each consumer line has first_batch_seconds (from before it connects), the rate over its stream,
# the daemon's cores over the stream and the cgroup's memory.peak. Shapes not run are said so.
# Every run is a JSON line in $OUT/beyond.jsonl; a summary table is printed last. Any failed consumer
# run fails the script (non-zero exit) after the remaining runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpufeed-beyond}"
mkdir -p "$OUT"
. scripts/lib/check.sh
. scripts/lib/staged.sh

gib=${BEYOND_GIB:-12}
mem=${BEYOND_MEM:-4G}
batch=${BEYOND_BATCH:-4096}
rounds=${BEYOND_ROUNDS:-3}
full_steps=${BEYOND_FULL_STEPS:-400}
work=/var/tmp/gpufeed-beyond
jsonl="$OUT/beyond.jsonl"
socket=/tmp/gpufeed-beyond.sock
http=127.0.0.1:7172
cg=/sys/fs/cgroup/gpufeed-beyond
failed=0
: >"$jsonl"

drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
cpu_seconds() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }

mkdir -p "$work/npy" "$work/data"
if [ ! -f "$work/data/emb/manifest.json" ]; then
  python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib "$gib" --tokens-gib 0 || exit 1
  "$bin/gpufeed" pack --out "$work/data/emb" --codec raw --samples-per-shard 262144 \
    "$work/npy/emb_fp16.npy" || exit 1
  rm -f "$work/npy/emb_fp16.npy"
fi
shards=("$work"/data/emb/*.gfs)
dataset_bytes=$(du -cb "${shards[@]}" | tail -1 | cut -f1)
# new_cgroup: the daemon's cgroup, made afresh (so that its memory.peak is the daemon's own).
new_cgroup() {
  rmdir "$cg" 2>/dev/null
  mkdir -p "$cg" && echo "$mem" >"$cg/memory.max"
}
new_cgroup || { echo "no writable memory cgroup: cannot run"; exit 1; }
echo "dataset $dataset_bytes bytes in ${#shards[@]} shards; cgroup memory.max $(cat "$cg/memory.max")"

# start_daemon [VAR=VALUE...]: a fresh daemon in a fresh cgroup, with the variables given.
start_daemon() {
  rm -f "$socket"
  new_cgroup || return 1
  # The daemon joins the cgroup before it starts: the page cache it reads is charged there.
  sh -c "echo \$\$ >$cg/cgroup.procs && exec env $* $bin/gpufeed serve --data-root $work/data --socket $socket \
    --device cuda:0 --http $http ${BEYOND_DAEMON_FLAGS:-}" >"$work/daemon.out" 2>>"$OUT/beyond-daemon.log" &
  daemon=$!
  for _ in $(seq 1 300); do
    grep -q "serving" "$work/daemon.out" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "daemon did not start" >&2
  return 1
}
stop_daemon() { kill -TERM "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; }

# consume_run CASE ORDER SEED [FLAGS...]: one consumer over one epoch (or FLAGS' --steps); a JSON line.
consume_run() {
  local case=$1 order=$2 seed=$3 line status
  shift 3
  line=$(timeout 200 "$bin/consume" --socket "$socket" --dataset emb --device cuda:0 \
    --batch-size "$batch" --dtype f32 --field data --shuffle "$order" --window-shards 4 --seed "$seed" \
    --prefetch 4 --epochs 1 --daemon-pid "$daemon" "$@" | tail -1)
  status=$?
  python3 - "$case" "$order" "$round" "$batch" "$status" "$line" "$(cat "$cg/memory.peak" 2>/dev/null)" \
    "$dataset_bytes" "$mem" >>"$jsonl" <<'PY'
import json, sys
case, order, run, batch, status, line, peak, dataset_bytes, mem = sys.argv[1:]
try:
    s = json.loads(line)
except ValueError:
    s = {"error": line[-300:] or "no summary on stdout"}
secs = s.get("seconds")
bytes_in = s.get("bytes", 0) // 2
rec = {"loader": "gpufeed", "case": case, "order": order, "run": int(run), "batch_size": int(batch),
       "dataset_bytes": int(dataset_bytes), "cgroup_memory_max": mem,
       "cgroup_memory_peak": int(peak) if peak.isdigit() else None,
       "stream_seconds": secs, "first_batch_seconds": s.get("first_batch_seconds"),
       "batches": s.get("batches"), "bytes_in": bytes_in,
       "gb_per_s_in_stream": bytes_in / secs / 1e9 if secs else None,
       "daemon_cores_stream": (s["daemon_cpu_s_stream"] / secs) if secs and s.get("daemon_cpu_s_stream") is not None else None,
       "exit_status": int(status)}
if int(status) != 0 or "error" in s:
    rec["error"] = s.get("error", f"consume exited {status}")
print(json.dumps(rec))
PY
  tail -1 "$jsonl"
  [ "$status" -eq 0 ] && [ -n "$line" ] || failed=$((failed + 1))
}

for round in $(seq 1 "$rounds"); do
  drop
  python3 - "$round" "${shards[@]}" >>"$jsonl" <<'PY'
import json, subprocess, sys, time
run, files = int(sys.argv[1]), sys.argv[2:]
t0, total = time.perf_counter(), 0
for f in files:
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                   stderr=subprocess.DEVNULL)
    total += __import__("os").path.getsize(f)
secs = time.perf_counter() - t0
print(json.dumps({"loader": "dd-direct", "case": "beyond-ram", "run": run, "bytes": total,
                  "seconds": secs, "gb_per_s_in": total / secs / 1e9}))
PY
  tail -1 "$jsonl"
  python3 scripts/random_read_probe.py --file "${shards[0]}" --depth 64 --seconds 5 --block 4096 \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); d.update(case="beyond-ram", run=int(sys.argv[1])); print(json.dumps(d))' "$round" >>"$jsonl"
  tail -1 "$jsonl"
  for order in ${BEYOND_ORDERS:-none window full}; do
    drop
    start_daemon || { failed=$((failed + 1)); continue; }
    if [ "$order" = full ]; then
      consume_run beyond-ram-first full "$round" --steps "$full_steps"
      consume_run beyond-ram-after full $((round + 100)) --steps "$full_steps"
    else
      consume_run beyond-ram "$order" "$round"
    fi
    stop_daemon
    if [ "$order" = window ] && [ "${BEYOND_WINDOW_AB:-0}" = 1 ]; then
      drop
      start_daemon GPUFEED_COLD_START_STEPS=0 || { failed=$((failed + 1)); continue; }
      consume_run beyond-ram-no-cold-start window "$round"
      stop_daemon
    fi
  done
done
for order in none window full; do
  case " ${BEYOND_ORDERS:-none window full} " in
    *" $order "*) ;;
    *) echo "skipped: $order (not in BEYOND_ORDERS)"
       printf '{"loader": "gpufeed", "case": "beyond-ram", "order": "%s", "skipped": "not in BEYOND_ORDERS"}\n' "$order" >>"$jsonl" ;;
  esac
done
grep -h "rows read from the disk\|full shuffle of a dataset larger\|window shuffle of a dataset larger" \
  "$OUT/beyond-daemon.log" | tail -4

python3 - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def med(xs):
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.3f} ({', '.join(f'{x:.3f}' for x in xs)})" if xs else "-"
print("\nbeyond RAM: medians (runs)")
for loader, key in (("dd-direct", "gb_per_s_in"), ("random-read-probe", "gb_per_s")):
    print(f"  {loader:34s} GB/s {med([r.get(key) for r in rows if r['loader'] == loader])}")
for case, order in (("beyond-ram", "none"), ("beyond-ram", "window"),
                    ("beyond-ram-no-cold-start", "window"), ("beyond-ram-first", "full"),
                    ("beyond-ram-after", "full")):
    rs = [r for r in rows if r.get("case") == case and r.get("order") == order]
    print(f"  gpufeed {case:17s} {order:7s} GB/s {med([r.get('gb_per_s_in_stream') for r in rs])}"
          f"  first batch s {med([r.get('first_batch_seconds') for r in rs])}"
          f"  cores {med([r.get('daemon_cores_stream') for r in rs])}")
PY
[ "$failed" -eq 0 ] || { echo "FAILED: $failed consumer run(s)"; exit 1; }
