#!/usr/bin/env bash
# Runs on a GPU machine with two GPUs after scripts/gpu-stage-read.sh staged .gpu/read/ here:
#   1. the two-device serving test (gpu_serve two_devices_are_served_by_one_daemon);
#   2. the aggregate benchmark: one daemon serving cuda:0 and cuda:1 (`--device cuda:0,cuda:1`), an
#      fp16 .npy of MULTI_GIB GiB ([N, 1024], rows of 2 KiB) packed raw in shards of 512 MiB, page
#      cache warm; per order (dataset order, window of 4 shards) one consumer on cuda:0 alone, then a
#      consumer on each device at once (each a whole epoch, fp32 device batches of 4096 rows), three
#      runs each after a warm-up, interleaved. The aggregate rate is the bytes of both epochs over the
#      time from the first start to the last end (process walls included). JSON lines in
#      $OUT/multi.jsonl (with the daemon's and the consumers' CPU over the streams, see `record`), a
#      table last, and the daemon's
#      per-device figures from /v1/status in $OUT/multi.log;
#   3. the Python training example as two ranks under torchrun, one per GPU (needs the wheel staged by
#      scripts/gpu-stage-python.sh). Any failed step fails the script.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpufeed-multi}"
export OUT
budget_s="${GPUFEED_CHECK_BUDGET_S:-560}"
step_name_width=14
. scripts/lib/check.sh
. scripts/lib/staged.sh
work=/var/tmp/gpufeed-multi
socket=/tmp/gpufeed-multi.sock
jsonl="$OUT/multi.jsonl"

cpu_seconds() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }

# record CASE ORDER RUN T0 T1 CPU0 CPU1 SUMMARY...: one JSON line for a run of one or more consumers
# (their JSON summaries in the files SUMMARY...). `wall` runs from the first start to the last end,
# process start-up included, and `daemon_cores` is the daemon's CPU over it (kept for older reports).
# Over the streams instead (each consumer reads the daemon's CPU and its own when its clock starts
# and after its last batch, --daemon-pid): stream_span_seconds runs from the first stream's start to
# the last one's end, daemon_cpu_s_stream is the daemon's CPU over that span, consumer_cpu_s_stream
# the consumers' own CPU over their streams (summed), and the *_cores_stream figures divide them by
# the span.
record() {
  python3 - "$@" <<'PY'
import json, sys
case, order, run, t0, t1, c0, c1, *paths = sys.argv[1:]
summaries = [json.load(open(path)) for path in paths]
wall = float(t1) - float(t0)
samples = [s["cpu_samples"] for s in summaries]
span = max(x["end_monotonic_s"] for x in samples) - min(x["start_monotonic_s"] for x in samples)
daemon_ends = [x["daemon_cpu_s"] for x in samples]
daemon_cpu = (max(end for _, end in daemon_ends) - min(start for start, _ in daemon_ends)
              if all(None not in pair for pair in daemon_ends) else None)
consumer_cpu = sum(s["consumer_cpu_s_stream"] for s in summaries)
print(json.dumps({
    "case": case, "order": order, "run": int(run),
    "bytes_in": sum(s["bytes"] for s in summaries) // 2,
    "seconds": max(s["seconds"] for s in summaries), "wall": wall,
    "daemon_cores": (float(c1) - float(c0)) / wall,
    "stream_span_seconds": span,
    "daemon_cpu_s_stream": daemon_cpu, "consumer_cpu_s_stream": consumer_cpu,
    "daemon_cores_stream": daemon_cpu / span if daemon_cpu is not None and span > 0 else None,
    "consumer_cores_stream": consumer_cpu / span if span > 0 else None,
}))
PY
}

multi_bench() {
  set -e
  : >"$jsonl"
  mkdir -p "$work/npy" "$work/data"
  python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib "${MULTI_GIB:-4}" --tokens-gib 0
  rm -rf "$work/data/emb"
  "$bin/gpufeed" pack --out "$work/data/emb" --samples-per-shard 262144 --codec raw "$work/npy/emb_fp16.npy"
  cat "$work/npy/emb_fp16.npy" >/dev/null
  "$bin/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0,cuda:1 --http 127.0.0.1:7172 \
    >"$OUT/multi-daemon.out" 2>"$OUT/multi-daemon.log" &
  local daemon=$!
  for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done
  consume() {
    "$bin/consume" --socket "$socket" --dataset emb --device "$1" --batch-size 4096 --dtype f32 \
      --shuffle "$2" --window-shards 4 --seed "$3" --daemon-pid "$daemon" | tail -1
  }
  for order in none window; do
    consume cuda:0 "$order" 0 >/dev/null; consume cuda:1 "$order" 0 >/dev/null  # warm-up
    for run in 1 2 3; do
      c0=$(cpu_seconds "$daemon"); t0=$(date +%s.%N)
      consume cuda:0 "$order" "$run" >"$work/a.json"
      t1=$(date +%s.%N); c1=$(cpu_seconds "$daemon")
      record one "$order" "$run" "$t0" "$t1" "$c0" "$c1" "$work/a.json" >>"$jsonl"
      c0=$(cpu_seconds "$daemon"); t0=$(date +%s.%N)
      consume cuda:0 "$order" "$run" >"$work/a.json" & a=$!
      consume cuda:1 "$order" "$run" >"$work/b.json" & b=$!
      wait "$a"; wait "$b"
      t1=$(date +%s.%N); c1=$(cpu_seconds "$daemon")
      record two "$order" "$run" "$t0" "$t1" "$c0" "$c1" "$work/a.json" "$work/b.json" >>"$jsonl"
    done
  done
  # Per-device figures after the runs (streams closed: 0 streams and stream bytes on each device;
  # batches, samples and bytes read per device), into the log.
  python3 -c 'import json,urllib.request; print(json.dumps(json.load(urllib.request.urlopen("http://127.0.0.1:7172/v1/status", timeout=5))["devices"], indent=1))' \
    >>"$OUT/multi.log" 2>&1 || true
  kill "$daemon"; wait "$daemon" || true
  python3 - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| order | consumers | runs | GB/s in (slowest stream) | GB/s in (wall, first start to last end) | daemon cores (streams) | consumer cores (streams) | daemon cores (process wall) |")
print("|---|---|---|---|---|---|---|---|")
for order in ("none", "window"):
    for case in ("one", "two"):
        sel = [r for r in rows if r["order"] == order and r["case"] == case]
        s = statistics.median(r["bytes_in"] / r["seconds"] / 1e9 for r in sel)
        w = statistics.median(r["bytes_in"] / r["wall"] / 1e9 for r in sel)
        c = statistics.median(r["daemon_cores"] for r in sel)
        ds = statistics.median(r["daemon_cores_stream"] for r in sel)
        cs = statistics.median(r["consumer_cores_stream"] for r in sel)
        print(f"| {order} | {case} | {len(sel)} | {s:.2f} | {w:.2f} | {ds:.2f} | {cs:.2f} | {c:.2f} |")
PY
}

if [ "${1:-}" = --bench-only ]; then
  multi_bench
  exit $?
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >"$OUT/multi.log" 2>&1
if ls .gpu/read/py/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --force-reinstall --target /tmp/gpufeed-site .gpu/read/py/*.whl \
    .gpu/read/py/deps/*.whl >>"$OUT/multi.log" 2>&1
fi
step two_devices multi 200 30 "$bin/gpu_serve" --include-ignored --test-threads=1 two_devices
step multi_bench bench 300 60 bash "$0" --bench-only
# The training example as two ranks, one per GPU, through one daemon serving both.
step two_rank_train python 200 30 env PYTHONPATH=/tmp/gpufeed-site TRAIN_GPUS=2 bash scripts/gpu-python.sh --train-only
grep -A6 '^| order' "$OUT/bench.log"
step_summary
