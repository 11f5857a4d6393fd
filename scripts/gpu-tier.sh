#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh staged .gpu/read/ here, in one command:
#   1. GPU tests of the device-memory tier (tests/gpu_tier.rs: bit-exact against the CPU backend in
#      every order from a filling and a whole tier, eviction while read, a dataset over the budget,
#      two consumer processes, memory back to its baseline), and compute-sanitizer memcheck over
#      them (the gather kernel reading the tier);
#   2. the tier benchmark on the read benchmark's data (scripts/gpu-read.sh prepares it: an fp16 .npy
#      of TIER_GIB (8) GiB, [N, 1024] rows of 2 KiB, packed raw in shards of 512 MiB; page cache
#      warm; the host has 125 GiB of RAM, the H100 80 GB of HBM):
#      - case no-tier: a daemon without the tier, per order (none, window of 4 shards, full) one
#        warm-up run then TIER_REPEAT (3) runs of 3 epochs, batch TIER_BATCH (4096): the first-epoch
#        baseline;
#      - case tier: a daemon with --device-cache TIER_CACHE (TIER_GIB + 2 GiB); per order and run
#        the dataset is evicted through the API first, so that the run's first epoch fills the tier
#        and its TIER_EPOCHS - 1 (15) later epochs read it;
#      - case tier-b1024: the same daemon, the dataset resident, batch 1024, full shuffle;
#      - case tier-2proc: two consumer processes at once, full shuffle, batch 4096, different seeds:
#        their aggregate rate (all bytes over the span from the first's start to the last's end, on
#        one monotonic clock) against one consumer's;
#      - the in-process peer (scripts/e2e/torch_resident.py): the dataset in a PyTorch program's own
#        device memory, `x[idx].float()` per batch (full) or slices (none), batches 4096 and 1024.
#      Each consumer run is one JSON line in $OUT/tier.jsonl with its per-epoch times; the summary
#      gives, per case and order, the median over runs of the first epoch's rate and of the later
#      epochs' median rate, GB/s of fp16 in, beside the targets of the tier. Epoch rates are from the
#      consumer's own per-epoch times (from its wait for the stream to the epoch's last batch; the
#      next epoch's stream is opened when 0.3 of the current one is left, as a training process
#      does). Shapes not run are said so. TIER_BENCH_ONLY=1: step 2 only; TIER_TESTS_ONLY=1: step 1
#      only.
# Any failed step makes the script exit non-zero; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT="${OUT:-/tmp/gpufeed-tier}"
budget_s="${GPUFEED_CHECK_BUDGET_S:-560}"
step_name_width=14
. scripts/lib/check.sh
. scripts/lib/staged.sh

gib=${TIER_GIB:-8}
batch=${TIER_BATCH:-4096}
repeat=${TIER_REPEAT:-3}
epochs=${TIER_EPOCHS:-16}
work=/var/tmp/gpufeed-read
source_npy="$work/npy/emb_fp16.npy"
jsonl="$OUT/tier.jsonl"
socket=/tmp/gpufeed-tier.sock
http=127.0.0.1:7173

start_daemon() {
  rm -f "$socket"
  "$bin/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0 --http "$http" \
    "$@" >"$work/tier-daemon.out" 2>>"$OUT/daemon.log" &
  daemon=$!
  for _ in $(seq 1 300); do
    grep -q "serving" "$work/tier-daemon.out" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "daemon did not start" >&2
  return 1
}

stop_daemon() {
  kill -TERM "$daemon" 2>/dev/null
  wait "$daemon" 2>/dev/null
}

# evict: takes the dataset out of the tier (a 404, when it is not there, is fine).
evict() {
  python3 - "$http" <<'PY'
import sys, urllib.error, urllib.request
request = urllib.request.Request(f"http://{sys.argv[1]}/v1/devices/cuda:0/cache/emb", method="DELETE")
try:
    urllib.request.urlopen(request, timeout=10)
except urllib.error.HTTPError as error:
    if error.code != 404:
        raise
PY
}

tier_view() {
  python3 -c "import json,sys,urllib.request; v=json.load(urllib.request.urlopen('http://$http/v1/devices/cuda:0/cache', timeout=5)); print(json.dumps(v))"
}

# consume_line CASE ORDER RUN BATCH EPOCHS SEED: one consumer; prints its JSON summary with the
# run's labels (or a line with `error`).
consume_line() {
  local case=$1 order=$2 run=$3 b=$4 e=$5 seed=$6 line status fields
  # The dataset's fields, named as a training loop names them.
  fields=$(python3 -c "import json,urllib.request; d=json.load(urllib.request.urlopen('http://$http/v1/datasets/emb', timeout=5)); print(' '.join('--field ' + f for f in d['dataset']['fields']))")
  # shellcheck disable=SC2086  # fields: a list of words
  line=$(timeout 120 "$bin/consume" --socket "$socket" --dataset emb --device cuda:0 \
    --batch-size "$b" --dtype f32 $fields --shuffle "$order" --window-shards 4 --seed "$seed" \
    --prefetch 4 --epochs "$e" --open-ahead 0.3 --daemon-pid "$daemon" | tail -1)
  status=$?
  python3 - "$case" "$order" "$run" "$b" "$e" "$status" "$line" "$(stat -c %s "$source_npy")" <<'PY'
import json, sys
case, order, run, batch, epochs, status, line, npy_bytes = sys.argv[1:]
try:
    summary = json.loads(line)
except ValueError:
    summary = {"error": line[-300:] or "no summary on stdout"}
record = {"loader": "gpufeed", "case": case, "order": order, "run": int(run), "batch_size": int(batch),
          "epochs": int(epochs), "exit_status": int(status)}
if int(status) != 0 or "error" in summary:
    record["error"] = summary.get("error", f"consume exited {status}")
else:
    epoch_bytes_in = summary["bytes"] // 2 / int(epochs)
    record.update(
        bytes_in=summary["bytes"] // 2, stream_seconds=summary["seconds"],
        epoch_ms=[e["ms"] for e in summary["epoch_times"]],
        epoch_gb_per_s_in=[epoch_bytes_in / (e["ms"] / 1e3) / 1e9 for e in summary["epoch_times"]],
        first_batch_seconds=summary.get("first_batch_seconds"),
        daemon_cpu_s_stream=summary.get("daemon_cpu_s_stream"),
        consumer_cpu_s_stream=summary.get("consumer_cpu_s_stream"),
        start_monotonic_s=summary["cpu_samples"]["start_monotonic_s"],
        end_monotonic_s=summary["cpu_samples"]["end_monotonic_s"],
        handoff_us_p50=summary.get("handoff_us_p50"), handoff_us_p99=summary.get("handoff_us_p99"),
        dataset_bytes=int(npy_bytes))
print(json.dumps(record))
PY
  return "$status"
}

failed_runs=()
failed_run() {
  echo "FAILED: $1" >&2
  failed_runs+=("$1")
}

run_one() {
  consume_line "$@" >>"$jsonl" || failed_run "gpufeed $1 $2 run $3"
  tail -1 "$jsonl" | cut -c1-400
}

tier_bench() {
  : >"$jsonl"
  mkdir -p "$work"
  # The read benchmark's data (made and packed once per machine; reused when packed by this build).
  OUT="$work/prepare-out" READ_BENCH_ONLY=1 READ_CASES=none READ_GIB="$gib" bash scripts/gpu-read.sh --bench-only \
    >"$OUT/prepare.log" 2>&1 || { echo "FAILED: preparing the data (prepare.log)"; return 1; }
  cat "$source_npy" >/dev/null
  local order run
  start_daemon || { echo "FAILED: the daemon without the tier did not start"; return 1; }
  for order in none window full; do
    consume_line no-tier-warmup "$order" 0 "$batch" 3 100 >/dev/null
    for run in $(seq 1 "$repeat"); do
      run_one no-tier "$order" "$run" "$batch" 3 "$run"
    done
  done
  stop_daemon
  start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" \
    || { echo "FAILED: the daemon with the tier did not start"; return 1; }
  for order in none window full; do
    evict
    consume_line tier-warmup "$order" 0 "$batch" 3 100 >/dev/null
    for run in $(seq 1 "$repeat"); do
      evict
      run_one tier "$order" "$run" "$batch" "$epochs" "$run"
    done
  done
  echo "tier after the runs: $(tier_view)"
  for run in $(seq 1 "$repeat"); do
    run_one tier-b1024 full "$run" 1024 "$epochs" "$run"
  done
  # Two consumer processes at once on one resident dataset.
  consume_line tier-1proc-warmup full 0 "$batch" 3 100 >/dev/null
  for run in $(seq 1 "$repeat"); do
    consume_line tier-2proc full "$run" "$batch" "$epochs" "$run" >"$work/2proc-a.json" &
    local a=$!
    consume_line tier-2proc full "$run" "$batch" "$epochs" "$((run + 50))" >"$work/2proc-b.json" &
    local b=$!
    wait "$a" || failed_run "gpufeed tier-2proc run $run (first)"
    wait "$b" || failed_run "gpufeed tier-2proc run $run (second)"
    cat "$work/2proc-a.json" "$work/2proc-b.json" >>"$jsonl"
    echo "tier while two read: $(tier_view)"
  done
  stop_daemon
  timeout 300 python3 scripts/e2e/torch_resident.py --file "$source_npy" --batch-sizes "$batch,1024" \
    --orders none,window,full --epochs "$epochs" --repeat "$repeat" --jsonl "$jsonl" \
    || failed_run "torch-resident"
  if [ "${#failed_runs[@]}" -ne 0 ]; then
    printf 'FAILED run: %s\n' "${failed_runs[@]}"
    return 1
  fi
}

if [ "${1:-}" = --bench-only ]; then
  tier_bench
  exit $?
fi
if [ -z "${TIER_BENCH_ONLY:-}" ]; then
  step gpu_tier tests 200 60 "$bin/gpu_tier" --include-ignored --nocapture --test-threads=1
  step memcheck sanitizer 200 60 compute-sanitizer --error-exitcode 99 --print-limit 20 \
    --report-api-errors no --target-processes all --tool memcheck \
    "$bin/gpu_tier" --include-ignored --test-threads=1 every_order
fi
[ -z "${TIER_TESTS_ONLY:-}" ] && step tier_bench bench "${TIER_BENCH_S:-400}" 60 bash "$0" --bench-only

grep -E '^test result|FAILED|panicked' "$OUT/tests.log" 2>/dev/null | head -20
grep -E '^=== |ERROR SUMMARY' "$OUT/sanitizer.log" 2>/dev/null | cut -c1-160
[ -s "$jsonl" ] && python3 - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = statistics.median
print("GB/s of fp16 in, medians over runs; 'later' is each run's median over its epochs after the first")
print("| case | order | batch | runs | first epoch | later epochs | daemon cores (stream) |")
print("|---|---|---|---|---|---|---|")
groups = {}
for r in rows:
    if r.get("loader") == "gpufeed" and "error" not in r and "warmup" not in r["case"] and r["case"] != "tier-2proc":
        groups.setdefault((r["case"], r["order"], r["batch_size"]), []).append(r)
firsts = {}
for (case, order, b), rs in groups.items():
    first = med([r["epoch_gb_per_s_in"][0] for r in rs])
    later = [med(r["epoch_gb_per_s_in"][1:]) for r in rs if len(r["epoch_gb_per_s_in"]) > 1]
    cores = [r["daemon_cpu_s_stream"] / r["stream_seconds"] for r in rs if r.get("daemon_cpu_s_stream") is not None]
    firsts[(case, order, b)] = (first, med(later) if later else float("nan"))
    print(f"| {case} | {order} | {b} | {len(rs)} | {first:.2f} | {med(later) if later else float('nan'):.2f} | {med(cores) if cores else float('nan'):.2f} |")
two = {}
for r in rows:
    if r.get("case") == "tier-2proc" and "error" not in r:
        two.setdefault(r["run"], []).append(r)
aggregates = []
for run, rs in sorted(two.items()):
    if len(rs) == 2:
        span = max(r["end_monotonic_s"] for r in rs) - min(r["start_monotonic_s"] for r in rs)
        aggregates.append(sum(r["bytes_in"] for r in rs) / span / 1e9)
peer = {}
for r in rows:
    if r.get("loader") == "torch-resident" and "skipped" not in r:
        peer.setdefault((r["order"], r["batch_size"]), []).append(r["gb_per_s_in"])
for (order, b), rates in sorted(peer.items()):
    print(f"| torch-resident (in-process peer) | {order} | {b} | {len(rates)} | | {med(rates):.2f} | |")
print()
print("targets:")
for order in ("none", "window", "full"):
    tier = firsts.get(("tier", order, 4096))
    base = firsts.get(("no-tier", order, 4096))
    p = peer.get(("full" if order != "none" else "none", 4096))
    if tier and base:
        print(f"  {order}: later epochs {tier[1]:.1f} GB/s (target >= 300)"
              + (f", {tier[1] / med(p):.2f}x the in-process peer (target >= 0.8)" if p else "")
              + f"; first epoch {tier[0] / base[0]:.2f}x without the tier (target >= 0.95)")
one = firsts.get(("tier", "full", 4096))
if aggregates and one:
    print(f"  two processes: aggregate {med(aggregates):.1f} GB/s = {med(aggregates) / one[1]:.2f}x one consumer (target >= 1.6)")
b1024 = firsts.get(("tier-b1024", "full", 1024))
if b1024:
    print(f"  batch 1024, full: {b1024[1]:.1f} GB/s (target >= 150)")
print("  not run: an LZ4 token dataset in the tier (the tier holds datasets whose streamed fields are stored raw)")
for r in rows:
    if "error" in r:
        print(f"FAILED: {r.get('loader')} {r.get('case', '')} {r.get('order', '')} run {r.get('run', '')}: {str(r['error'])[:160]}")
    if "skipped" in r:
        print(f"skipped: {r.get('loader')} {r.get('order')} {r.get('batch_size')}: {r['skipped']}")
PY
step_summary
