#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh and scripts/gpu-stage-python.sh staged
# .gpu/read/ here (the daemon, the consume example, the Python wheel), in one command: the training
# benchmark, examples/python/train_bench.py. Three models (tiny: loader-bound; medium: the MLP
# 1024-4096-4096-1024, bf16 autocast, AdamW; large: compute-bound) trained on TRAIN_GIB (8) GiB of
# fp16 rows of 1024 (2 KiB; scripts/e2e/make_data.py, packed raw into shards of 512 MiB, page cache
# warm), fp32 batches of TRAIN_BATCH (4096) in a full shuffle, each fed by:
#   a. ideal: the dataset already in device memory, x[idx].float();
#   b. gpufeed: gpufeed.torch.GpufeedDataset (a and b interleaved, run by run, in one process);
#   c. gpufeed under CUDA MPS: an MPS control daemon of this script's own (its own pipe and log
#      directories), a second gpufeed daemon and the trainer started under it (a and c interleaved:
#      ideal-mps, gpufeed-mps); the control daemon is stopped at the end, whatever happens (trap);
#   d. a strong PyTorch DataLoader (batched __getitems__ over the memory-mapped .npy, pinned memory),
#      4, 8 and 16 workers, the best taken;
#   e. NVIDIA DALI's numpy reader, only when `import nvidia.dali` works (a wheel staged in
#      .gpu/read/dali/ is installed first); otherwise a "skipped: DALI not installed" line. (The
#      machine reaches no package index, and DALI's wheel, about 200 MB, is over the 64 MiB the
#      device tool carries: on the lent machines it is skipped.)
# Each (model, feeder) runs TRAIN_RUNS (3) times: TRAIN_WARMUP (20) untimed steps, then TRAIN_STEPS
# timed steps (train_bench.py's default: tiny=600,medium=200,large=80); every run is a JSON line in
# $OUT/train.jsonl. Also: the pipeline alone (`consume`, the Rust consumer, one epoch in the same
# full shuffle), for the tiny model's share of the rate it sustains; and each daemon's /v1/status
# `mps` block (MPS detected or not). The summary prints the table (median step ms, samples/s, ratio
# to the ideal feeder of the same mode, the targets: <= 1.03x without MPS, <= 1.01x with it).
# About 4 minutes of device time at the defaults (data made and packed: about a minute of it).
# TRAIN_DAEMON_FLAGS adds flags to the gpufeed daemon (say `--device-cache 10G`, the device-memory
# tier), and TRAIN_LABEL a suffix to the feeders' labels for such a variant (`--plain` run once per
# variant in one call compares them); TRAIN_MODELS, TRAIN_STEPS (model=N,...) and TRAIN_WARMUP choose
# what runs (a warm-up longer than an epoch's steps, 1024 at the defaults, times later epochs only);
# TRAIN_PREFETCH the slots gpufeed fills ahead (4). The daemon inherits the script's environment.
# Any failed step makes the script exit non-zero; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT="${OUT:-/tmp/gpufeed-train}"
export OUT
budget_s="${GPUFEED_CHECK_BUDGET_S:-480}"
step_name_width=14
. scripts/lib/check.sh
. scripts/lib/staged.sh
gib=${TRAIN_GIB:-8}
work=/var/tmp/gpufeed-train
npy="$work/npy/emb_fp16.npy"
jsonl="$OUT/train.jsonl"
socket=/tmp/gpufeed-train.sock
http=127.0.0.1:7173
. scripts/lib/mps.sh
export PYTHONPATH=/tmp/gpufeed-site:/tmp/dali-site

bench_args() {
  echo --npy "$npy" --socket "$socket" --dataset emb --field data --batch-size "${TRAIN_BATCH:-4096}" \
    --runs "${TRAIN_RUNS:-3}" --warmup "${TRAIN_WARMUP:-20}" --jsonl "$jsonl" \
    ${TRAIN_STEPS:+--steps "$TRAIN_STEPS"} ${TRAIN_MODELS:+--models "$TRAIN_MODELS"} \
    ${TRAIN_PREFETCH:+--prefetch "$TRAIN_PREFETCH"}
}

# start_daemon LABEL: a daemon serving $work/data on cuda:0 (in this shell's environment: under MPS
# when the MPS variables are exported), its /v1/status `mps` block recorded in the jsonl.
start_daemon() {
  rm -f "$socket"
  # shellcheck disable=SC2086  # TRAIN_DAEMON_FLAGS: words
  "$bin/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0 --http "$http" \
    ${TRAIN_DAEMON_FLAGS:-} >"$work/daemon.out" 2>>"$OUT/daemon.log" &
  daemon=$!
  for _ in $(seq 1 300); do
    grep -q "serving" "$work/daemon.out" 2>/dev/null && break
    sleep 0.1
  done
  grep -q "serving" "$work/daemon.out" || { echo "daemon did not start" >&2; return 1; }
  python3 - "$1" "$http" <<'PY' | tee -a "$jsonl"
import json, sys, urllib.request
status = json.load(urllib.request.urlopen(f"http://{sys.argv[2]}/v1/status", timeout=30))
print(json.dumps({"daemon": sys.argv[1], "mps_status": status.get("mps"),
                  "devices": [{k: d.get(k) for k in ("device", "name", "mps_client")}
                              for d in status["platform"]["devices"]]}))
PY
}

stop_daemon() {
  [ -n "${daemon:-}" ] || return 0
  kill -TERM "$daemon" 2>/dev/null || true
  wait "$daemon" 2>/dev/null || true
  daemon=
}

setup() {
  set -e
  python3 -m pip install -q --no-deps --force-reinstall --target /tmp/gpufeed-site .gpu/read/py/*.whl
  if ls .gpu/read/dali/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/dali-site .gpu/read/dali/*.whl \
      || echo "DALI: its staged wheel did not install"
  fi
  mkdir -p "$work/npy" "$work/data"
  python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib "$gib" --tokens-gib 0
  rm -rf "$work/data/emb"
  "$bin/gpufeed" pack --out "$work/data/emb" --samples-per-shard 262144 --codec raw "$npy"
  # The page cache warm for every feeder: the packed shards (gpufeed) and the .npy (the others).
  cat "$work/data/emb"/* "$npy" >/dev/null
}

# The ideal feeder and gpufeed, interleaved; then the pipeline alone (consume) on the same daemon.
plain() {
  set -e
  start_daemon "no MPS"
  local rc=0
  # shellcheck disable=SC2046  # bench_args: words
  python3 examples/python/train_bench.py run $(bench_args) --feeders ideal,gpufeed \
    ${TRAIN_LABEL:+--label-suffix="$TRAIN_LABEL"} || rc=$?
  "$bin/consume" --socket "$socket" --dataset emb --device cuda:0 --batch-size "${TRAIN_BATCH:-4096}" \
    --field data --dtype f32 --shuffle full --prefetch 4 | tail -1 \
    | python3 -c "import json,sys; d=json.load(sys.stdin); d.update(loader='consume', order='full shuffle'); print(json.dumps(d))" \
    | tee -a "$jsonl" || rc=1
  stop_daemon
  return "$rc"
}

# The ideal feeder and gpufeed again, the daemon and the trainer both MPS clients.
under_mps() {
  set -e
  trap 'stop_daemon; mps_stop' EXIT
  trap 'exit 143' TERM INT
  mps_start
  start_daemon "under MPS"
  local rc=0
  # shellcheck disable=SC2046
  python3 examples/python/train_bench.py run $(bench_args) --feeders ideal,gpufeed --label-suffix=-mps \
    || rc=$?
  echo "MPS servers: $(echo get_server_list | nvidia-cuda-mps-control)"
  return "$rc"
}

case "${1:-}" in
  --setup) setup; exit $? ;;
  --plain) plain; exit $? ;;
  --mps) under_mps; exit $? ;;
  --dataloader)
    # shellcheck disable=SC2046
    python3 examples/python/train_bench.py run $(bench_args) --feeders dataloader \
      --workers "${TRAIN_WORKERS:-4,8,16}"
    exit $? ;;
  --dali)
    # shellcheck disable=SC2046
    python3 examples/python/train_bench.py run $(bench_args) --feeders dali
    exit $? ;;
esac

# An MPS control daemon left by a step killed for time is stopped here too.
trap mps_stop EXIT
{
  date -u
  cat "$bin/COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
} >"$OUT/bench.log" 2>&1
: >"$jsonl"
step train_setup bench 150 60 bash "$0" --setup
step train_plain bench 150 30 bash "$0" --plain
step train_mps bench 120 30 bash "$0" --mps
step train_dl bench 150 30 bash "$0" --dataloader
step train_dali bench 60 10 bash "$0" --dali
mps_stop
grep -h "^skipped: \|^MPS servers" "$OUT/bench.log" | sort -u
python3 examples/python/train_bench.py summary --jsonl "$jsonl" | tee "$OUT/summary.md"
step_summary
