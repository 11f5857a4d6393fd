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
#      - case tier-host-order: every row planned on the host (GPUFEED_DEVICE_ORDER=off), one run
#        per order; case tier-rows1: the ordered gather moving one row at a time per thread block
#        (GPUFEED_ORDERED_ROWS=1), one run per order;
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
# The dataset the consumers read, its source .npy, the consumer's dtype flags and output bytes per
# byte in (the fp16 embeddings by default; lz4_bench switches).
ds=emb ds_npy=$source_npy dtype_flags="--dtype f32" out_per_in=2
jsonl="$OUT/tier.jsonl"
socket=/tmp/gpufeed-tier.sock
http=127.0.0.1:7173

start_daemon() {
  rm -f "$socket"
  # shellcheck disable=SC2086  # daemon_env: NAME=VALUE words
  env ${daemon_env:-} ${daemon_wrap:-} "$bin/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0 --http "$http" \
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
  python3 - "$http" "$ds" <<'PY'
import sys, urllib.error, urllib.request
request = urllib.request.Request(f"http://{sys.argv[1]}/v1/devices/cuda:0/cache/{sys.argv[2]}", method="DELETE")
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
  fields=$(python3 -c "import json,urllib.request; d=json.load(urllib.request.urlopen('http://$http/v1/datasets/$ds', timeout=5)); print(' '.join('--field ' + f for f in d['dataset']['fields']))")
  # shellcheck disable=SC2086  # fields, dtype_flags: lists of words
  line=$(timeout 120 "$bin/consume" --socket "$socket" --dataset "$ds" --device cuda:0 \
    --batch-size "$b" $dtype_flags $fields --shuffle "$order" --window-shards 4 --seed "$seed" \
    --prefetch "${prefetch:-4}" --epochs "$e" --open-ahead 0.3 --daemon-pid "$daemon" | tail -1)
  status=$?
  python3 - "$case" "$order" "$run" "$b" "$e" "$status" "$line" "$(stat -c %s "$ds_npy")" "$out_per_in" "$ds" <<'PY'
import json, sys
case, order, run, batch, epochs, status, line, npy_bytes, out_per_in, dataset = sys.argv[1:]
try:
    summary = json.loads(line)
except ValueError:
    summary = {"error": line[-300:] or "no summary on stdout"}
record = {"loader": "gpufeed", "dataset": dataset, "case": case, "order": order, "run": int(run),
          "batch_size": int(batch), "epochs": int(epochs), "exit_status": int(status)}
if int(status) != 0 or "error" in summary:
    record["error"] = summary.get("error", f"consume exited {status}")
else:
    bytes_in = summary["bytes"] // int(out_per_in)
    epoch_bytes_in = bytes_in / int(epochs)
    record.update(
        bytes_in=bytes_in, stream_seconds=summary["seconds"],
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
  # The same with every row planned on the host (GPUFEED_DEVICE_ORDER=off), one run per order:
  # what computing the order on the device changes.
  stop_daemon
  daemon_env=GPUFEED_DEVICE_ORDER=off start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" \
    || { echo "FAILED: the daemon with host planning did not start"; return 1; }
  for order in none window full; do
    consume_line tier-host-order-warmup "$order" 0 "$batch" 3 100 >/dev/null
    run_one tier-host-order "$order" 1 "$batch" "$epochs" 1
  done
  run_one tier-host-order-b1024 full 1 1024 "$epochs" 1
  stop_daemon
  # The order on the device with its gather moving one row at a time per thread block
  # (GPUFEED_ORDERED_ROWS=1; default 4 at once), one run per order: what the fast path changes.
  daemon_env=GPUFEED_ORDERED_ROWS=1 start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" \
    || { echo "FAILED: the daemon with one row at a time did not start"; return 1; }
  for order in none window full; do
    consume_line tier-rows1-warmup "$order" 0 "$batch" 3 100 >/dev/null
    run_one tier-rows1 "$order" 1 "$batch" "$epochs" 1
  done
  stop_daemon
  start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" \
    || { echo "FAILED: the daemon with the tier did not start again"; return 1; }
  consume_line tier-warmup full 0 "$batch" 3 100 >/dev/null
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

# The LZ4 datasets in the tier (TIER_LZ4=1): 'tok', TIER_GIB of int32 zipf tokens (rows of 8 KiB,
# make_data.py) packed with the defaults (codec auto: LZ4 with a byte shuffle), served as int32;
# 'emblz4', the fp16 embeddings packed with --codec lz4 (LZ4 barely shrinks them: the case where
# compression buys nothing), served as fp32. Per dataset: a daemon without the tier, dataset order,
# one run of 2 epochs (the path LZ4 data took before: its window and full shuffles ran at 0.44 GB/s
# and are not run here); then a daemon with the tier, per order the dataset evicted first, one
# warm-up run and TIER_REPEAT runs of TIER_LZ4_EPOCHS (6) epochs: the first epoch decodes the
# dataset into the tier, the later ones read it. The raw fp16 dataset in the tier, same daemon,
# in order, is the comparison for 'emblz4'.
lz4_bench() {
  mkdir -p "$work/npy" "$work/data"
  OUT="$work/prepare-out" READ_BENCH_ONLY=1 READ_CASES=none READ_GIB="$gib" bash scripts/gpu-read.sh --bench-only \
    >"$OUT/prepare.log" 2>&1 || { echo "FAILED: preparing the fp16 data (prepare.log)"; return 1; }
  python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib 0 --tokens-gib "$gib" >>"$OUT/prepare.log" 2>&1 \
    || { echo "FAILED: making the tokens (prepare.log)"; return 1; }
  local started
  if [ ! -d "$work/data/tok" ]; then
    started=$(date +%s)
    "$bin/gpufeed" pack --out "$work/data/tok" --samples-per-shard 65536 "$work/npy/tokens_i32.npy" >>"$OUT/prepare.log" 2>&1 \
      || { echo "FAILED: packing the tokens"; return 1; }
    echo "packed tok in $(( $(date +%s) - started )) s"
  fi
  if [ ! -d "$work/data/emblz4" ]; then
    "$bin/gpufeed" pack --out "$work/data/emblz4" --codec lz4 --samples-per-shard 262144 "$source_npy" >>"$OUT/prepare.log" 2>&1 \
      || { echo "FAILED: packing emblz4"; return 1; }
  fi
  du -sb "$work/data/tok" "$work/data/emblz4" "$work/data/emb" "$work/npy/tokens_i32.npy" "$source_npy"
  cat "$work/npy/tokens_i32.npy" "$source_npy" "$work"/data/{tok,emblz4,emb}/*.gfs >/dev/null 2>&1
  local order run lz4_epochs=${TIER_LZ4_EPOCHS:-6}
  for ds in tok emblz4; do
    if [ "$ds" = tok ]; then
      ds_npy="$work/npy/tokens_i32.npy" dtype_flags="" out_per_in=1
    else
      ds_npy=$source_npy dtype_flags="--dtype f32" out_per_in=2
    fi
    start_daemon || { echo "FAILED: the daemon without the tier did not start"; return 1; }
    run_one lz4-no-tier none 1 "$batch" 2 1
    stop_daemon
    start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" \
      || { echo "FAILED: the daemon with the tier did not start"; return 1; }
    for order in none window full; do
      evict
      consume_line lz4-tier-warmup "$order" 0 "$batch" 2 100 >/dev/null
      for run in $(seq 1 "$repeat"); do
        evict
        run_one lz4-tier "$order" "$run" "$batch" "$lz4_epochs" "$run"
      done
    done
    echo "tier after $ds: $(tier_view)"
    if [ "$ds" = emblz4 ]; then
      ds=emb ds_npy=$source_npy
      for run in $(seq 1 "$repeat"); do
        evict
        run_one raw-tier none "$run" "$batch" "$lz4_epochs" "$run"
      done
    fi
    stop_daemon
  done
  grep -E "decoded .* into .* of the device-memory tier" "$OUT/daemon.log" | tail -8
  if [ "${#failed_runs[@]}" -ne 0 ]; then
    printf 'FAILED run: %s\n' "${failed_runs[@]}"
    return 1
  fi
}

if [ "${1:-}" = --lz4-only ]; then
  lz4_bench
  exit $?
fi
# knobs_bench: the dataset resident, full shuffle and dataset order, batch TIER_BATCH, one run of
# TIER_EPOCHS per variant of TIER_KNOBS ("LABEL:PREFETCH:DAEMON FLAGS" entries separated by ';'):
# where a resident stream's per-batch time goes (slots, rounds in flight, the filler's wait).
knobs_bench() {
  : >"$jsonl"
  mkdir -p "$work"
  OUT="$work/prepare-out" READ_BENCH_ONLY=1 READ_CASES=none READ_GIB="$gib" bash scripts/gpu-read.sh --bench-only \
    >"$OUT/prepare.log" 2>&1 || { echo "FAILED: preparing the data (prepare.log)"; return 1; }
  local knobs variant label flags order
  knobs=${TIER_KNOBS:-"base:4:;prefetch8:8:;rounds6:8:--rounds-in-flight 6;spin:4:--filler-spin-us 50;spin-rounds6:8:--rounds-in-flight 6 --filler-spin-us 50"}
  IFS=';' read -r -a variants <<<"$knobs"
  for variant in "${variants[@]}"; do
    IFS=':' read -r label prefetch flags <<<"$variant"
    # shellcheck disable=SC2086  # flags: words
    start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" $flags \
      || { echo "FAILED: the daemon for $label did not start"; return 1; }
    for order in full none; do
      prefetch=$prefetch consume_line "knob-$label-warmup" "$order" 0 "$batch" 3 100 >/dev/null
      prefetch=$prefetch run_one "knob-$label" "$order" 1 "$batch" "$epochs" 1
    done
    stop_daemon
  done
  prefetch=4
}

# ncu_bench: the ordered gather's kernels under Nsight Compute (duration, memory throughput,
# occupancy), the dataset resident, batch TIER_BATCH: TIER_NCU_COUNT (4) launches after
# TIER_NCU_SKIP (400) of a full shuffle, then as many of dataset order; report in $OUT/ncu.txt.
ncu_bench() {
  mkdir -p "$work"
  OUT="$work/prepare-out" READ_BENCH_ONLY=1 READ_CASES=none READ_GIB="$gib" bash scripts/gpu-read.sh --bench-only \
    >"$OUT/prepare.log" 2>&1 || { echo "FAILED: preparing the data (prepare.log)"; return 1; }
  local order
  for order in full none; do
    daemon_wrap="ncu --target-processes all --clock-control none --kernel-name regex:gf_gather_ordered \
      --launch-skip ${TIER_NCU_SKIP:-400} --launch-count ${TIER_NCU_COUNT:-4} --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
      --log-file $OUT/ncu-$order.txt" start_daemon --device-cache "${TIER_CACHE:-$((gib + 2))G}" \
      || { echo "FAILED: the daemon under ncu did not start"; return 1; }
    consume_line "ncu-$order" "$order" 1 "$batch" 6 1 >>"$jsonl"
    pkill -TERM -f "gpufeed serve --data-root $work/data" 2>/dev/null
    wait "$daemon" 2>/dev/null
  done
}

if [ "${1:-}" = --ncu-only ]; then
  ncu_bench
  exit $?
fi
if [ "${1:-}" = --knobs-only ]; then
  knobs_bench
  exit $?
fi
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
[ -z "${TIER_TESTS_ONLY:-}" ] && [ -z "${TIER_LZ4:-}" ] && step tier_bench bench "${TIER_BENCH_S:-400}" 60 bash "$0" --bench-only
[ -n "${TIER_LZ4:-}" ] && step tier_lz4 bench "${TIER_LZ4_S:-400}" 60 bash "$0" --lz4-only

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
        groups.setdefault((r.get("dataset", "emb"), r["case"], r["order"], r["batch_size"]), []).append(r)
firsts = {}
for (dataset, case, order, b), rs in groups.items():
    first = med([r["epoch_gb_per_s_in"][0] for r in rs])
    later = [med(r["epoch_gb_per_s_in"][1:]) for r in rs if len(r["epoch_gb_per_s_in"]) > 1]
    cores = [r["daemon_cpu_s_stream"] / r["stream_seconds"] for r in rs if r.get("daemon_cpu_s_stream") is not None]
    firsts[(dataset, case, order, b)] = (first, med(later) if later else float("nan"))
    print(f"| {dataset}: {case} | {order} | {b} | {len(rs)} | {first:.2f} | {med(later) if later else float('nan'):.2f} | {med(cores) if cores else float('nan'):.2f} |")
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
    tier = firsts.get(("emb", "tier", order, 4096))
    base = firsts.get(("emb", "no-tier", order, 4096))
    p = peer.get(("full" if order != "none" else "none", 4096))
    if tier and base:
        print(f"  {order}: later epochs {tier[1]:.1f} GB/s (target >= 300)"
              + (f", {tier[1] / med(p):.2f}x the in-process peer (target >= 0.8)" if p else "")
              + f"; first epoch {tier[0] / base[0]:.2f}x without the tier (target >= 0.95)")
one = firsts.get(("emb", "tier", "full", 4096))
if aggregates and one:
    print(f"  two processes: aggregate {med(aggregates):.1f} GB/s = {med(aggregates) / one[1]:.2f}x one consumer (target >= 1.6)")
b1024 = firsts.get(("emb", "tier-b1024", "full", 1024))
if b1024:
    print(f"  batch 1024, full: {b1024[1]:.1f} GB/s (target >= 150)")
for ds in ("tok", "emblz4"):
    before = firsts.get((ds, "lz4-no-tier", "none", 4096))
    tiers = {o: firsts.get((ds, "lz4-tier", o, 4096)) for o in ("none", "window", "full")}
    if not tiers["none"]:
        continue
    unit = "GB/s of int32 tokens (decoded)" if ds == "tok" else "GB/s of fp16 in (decoded)"
    print(f"  {ds}, {unit}: later epochs " + " / ".join(f"{o} {t[1]:.1f}" for o, t in tiers.items() if t)
          + " (target >= 300); first epoch (decoding into the tier) "
          + " / ".join(f"{o} {t[0]:.1f}" for o, t in tiers.items() if t)
          + (f"; without the tier, in order: {before[0]:.1f}" if before else ""))
    raw = firsts.get(("emb", "raw-tier", "none", 4096))
    if ds == "emblz4" and raw:
        print(f"  emblz4 against the same data raw in the tier, in order: first epoch {tiers['none'][0] / raw[0]:.2f}x,"
              f" later epochs {tiers['none'][1] / raw[1]:.2f}x (target >= 0.95)")
for r in rows:
    if "error" in r:
        print(f"FAILED: {r.get('loader')} {r.get('case', '')} {r.get('order', '')} run {r.get('run', '')}: {str(r['error'])[:160]}")
    if "skipped" in r:
        print(f"skipped: {r.get('loader')} {r.get('order')} {r.get('batch_size')}: {r['skipped']}")
PY
step_summary
