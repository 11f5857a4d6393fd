#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh and scripts/gpu-stage-python.sh staged
# .gpu/read/ here, in one command:
#   1. the Python package's tests against a CPU daemon, torch required (gpufeed.torch included);
#   2. its device tests against a GPU daemon: torch and CuPy through DLPack and the CUDA array
#      interface, bit-exact; a sleeping consumer stream keeps its slot; the torch dataset; the
#      status's MPS block; then the same tests once more with the daemon and the tests under CUDA MPS
#      (a control daemon of this script's own, stopped at the end: scripts/lib/mps.sh), where the
#      status must say MPS is active;
#   3. the Python consumer against the Rust consumer (examples/consume.rs), interleaved, 3 runs each
#      (the Python one twice: taking each batch only, and summing each batch on its CUDA stream),
#      on PY_GIB GiB of fp16 rows of 2 KiB (raw shards of 512 MiB, page cache warm), fp32 device
#      batches: batch 4096 (rate) and batch 64 (per-batch overhead). JSON lines in $OUT/python.jsonl.
# PY_SKIP_BENCH=1 skips step 3 (said so). Any failed step makes the script exit non-zero; a summary
# is printed last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/gpufeed-python}"
export OUT
budget_s="${GPUFEED_CHECK_BUDGET_S:-560}"
step_name_width=14
. scripts/lib/check.sh
. scripts/lib/staged.sh
gib=${PY_GIB:-2}
work=/var/tmp/gpufeed-python
jsonl="$OUT/python.jsonl"
socket=/tmp/gpufeed-python.sock
python_bench() {
  set -e
  : >"$jsonl"
  mkdir -p "$work/npy" "$work/data"
  python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib "$gib" --tokens-gib 0
  rm -rf "$work/data/emb"
  "$bin/gpufeed" pack --out "$work/data/emb" --samples-per-shard 262144 --codec raw "$work/npy/emb_fp16.npy"
  cat "$work/npy/emb_fp16.npy" >/dev/null
  "$bin/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0 --http off \
    >"$OUT/py-daemon.out" 2>"$OUT/py-daemon.log" &
  local daemon=$!
  for _ in $(seq 100); do [ -S "$socket" ] && break; sleep 0.1; done
  for batch in ${PY_BATCHES:-4096 64}; do
    for run in 1 2 3; do
      "$bin/consume" --socket "$socket" --dataset emb --device cuda:0 --batch-size "$batch" \
        --dtype f32 --prefetch "${PY_PREFETCH:-4}" | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); d.update(loader='gpufeed-rust', batch_size=$batch, run=$run, us_per_batch=d['seconds']/max(d['batches'],1)*1e6); print(json.dumps(d))" >>"$jsonl"
      for touch in "" --touch; do
        python3 ffi/python/bench/consume_bench.py --socket "$socket" --dataset emb --field data --batch-size "$batch" \
          --prefetch "${PY_PREFETCH:-4}" $touch \
          | python3 -c "import json,sys; d=json.load(sys.stdin); d['run']=$run; print(json.dumps(d))" >>"$jsonl"
      done
    done
  done
  kill "$daemon"; wait "$daemon" || true
  python3 - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| consumer | batch | runs | GB/s of fp32 out (median) | us per batch (median) |")
print("|---|---|---|---|---|")
for batch in (4096, 64):
    for loader in ("gpufeed-rust", "gpufeed-python", "gpufeed-python-touch"):
        sel = [r for r in rows if r["loader"] == loader and r["batch_size"] == batch]
        if not sel:
            continue
        rate = statistics.median(r["bytes"] / r["seconds"] / 1e9 for r in sel)
        per = statistics.median(r["us_per_batch"] for r in sel)
        print(f"| {loader} | {batch} | {len(sel)} | {rate:.2f} | {per:.1f} |")
PY
}
# train_example: examples/python/train_torch.py on one GPU, then two ranks under torchrun sharing
# GPU 0 (the daemon serves one device), or with TRAIN_GPUS=2 one rank per GPU (the daemon serves both).
train_example() {
  set -e
  local tw=/var/tmp/gpufeed-train tsock=/tmp/gpufeed-train.sock
  rm -rf "$tw"; mkdir -p "$tw/data"
  python3 examples/python/train_torch.py make-data "$tw/data/toy" --gpufeed "$bin/gpufeed"
  # TRAIN_GPUS=2: one daemon serving cuda:0 and cuda:1, one rank per GPU; else both ranks on GPU 0.
  local devices=cuda:0 same_gpu=--same-gpu
  if [ "${TRAIN_GPUS:-1}" = 2 ]; then devices=cuda:0,cuda:1; same_gpu=; fi
  "$bin/gpufeed" serve --data-root "$tw/data" --socket "$tsock" --device "$devices" --http off \
    >"$OUT/train-daemon.out" 2>"$OUT/train-daemon.log" &
  local daemon=$!
  for _ in $(seq 100); do [ -S "$tsock" ] && break; sleep 0.1; done
  python3 examples/python/train_torch.py train --socket "$tsock" --dataset toy --epochs 2
  python3 -m torch.distributed.run --nproc-per-node 2 examples/python/train_torch.py train \
    --socket "$tsock" --dataset toy --epochs 2 $same_gpu --checkpoint /tmp/gpufeed-train-2.pt
  kill "$daemon"; wait "$daemon" || true
}

. scripts/lib/mps.sh
# --under-mps COMMAND...: COMMAND with an MPS control daemon running, every CUDA process it starts a
# client (GPU_UNDER_MPS=1 tells the tests so); the control daemon is stopped when it ends.
if [ "${1:-}" = --under-mps ]; then
  shift
  trap mps_stop EXIT
  trap 'exit 143' TERM INT
  mps_start || exit 1
  GPU_UNDER_MPS=1 "$@"
  exit $?
fi
if [ "${1:-}" = --train-only ]; then
  train_example
  exit $?
fi
if [ "${1:-}" = --bench-only ]; then
  python_bench
  exit $?
fi
python3 -m pip install -q --no-deps --force-reinstall --target /tmp/gpufeed-site .gpu/read/py/*.whl \
  .gpu/read/py/deps/*.whl >"$OUT/python.log" 2>&1
export PYTHONPATH=/tmp/gpufeed-site
[ -n "${PY_BENCH_ONLY:-}" ] || step py_cpu python 120 20 env GPUFEED_REQUIRE_TORCH=1 python3 -m pytest -q -rs -p no:cacheprovider ffi/python/tests
[ -n "${PY_BENCH_ONLY:-}" ] || step py_gpu python 180 20 env GPUFEED_TEST_DEVICE=cuda:0 python3 -m pytest -q -rs -p no:cacheprovider ffi/python/tests/test_gpu.py
# A control daemon left by a step killed for time is stopped at the end too.
trap mps_stop EXIT
[ -n "${PY_BENCH_ONLY:-}" ] || step py_gpu_mps python 180 20 bash "$0" --under-mps env GPUFEED_TEST_DEVICE=cuda:0 python3 -m pytest -q -rs -p no:cacheprovider ffi/python/tests/test_gpu.py

[ -n "${PY_BENCH_ONLY:-}" ] || step py_train python 200 30 bash "$0" --train-only
if [ -n "${PY_SKIP_BENCH:-}" ]; then
  echo "skipped: the Python consumer benchmark (PY_SKIP_BENCH)"
else
  step py_bench bench 300 60 bash "$0" --bench-only
  grep -A8 '^| consumer' "$OUT/bench.log"
fi
step_summary
