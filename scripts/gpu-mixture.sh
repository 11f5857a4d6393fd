#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-stage-read.sh staged .gpu/read/ here (device tool, carry
# [".gpu/read"]): the rate of a mixture stream on a CUDA device, whose batches are assembled by the
# CPU backend's assembler and uploaded (src/pipeline/upload.rs), beside a one-dataset stream on the
# device (the GPU pipeline) and the same mixture on the CPU backend (host slots), in one run.
# Data: MIX_GIB (2) GiB of fp16 rows of 2 KiB (scripts/e2e/make_data.py), packed raw twice, as the
# sources `a` and `b` (weights 0.5 / 0.5); page cache warm; fp32 batches of MIX_BATCH (4096) rows;
# one epoch a consumer (`consume`, timed from before it connects), in dataset order and in a full
# shuffle; MIX_RUNS (3) rounds, the cases taking turns. One JSON line per run in $OUT/mixture.jsonl
# (`gb_per_s_in`: GB/s of fp16 in); medians printed last. Any failed consumer makes the script exit
# non-zero after the other runs.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-/tmp/gpufeed-mixture}"
mkdir -p "$OUT"
. scripts/lib/gpu-env.sh
bin="$PWD/.gpu/read/bin"
work=/var/tmp/gpufeed-mixture
gib=${MIX_GIB:-2}
batch=${MIX_BATCH:-4096}
runs=${MIX_RUNS:-3}
jsonl="$OUT/mixture.jsonl"
socket="$work/gpufeed.sock"

mkdir -p "$work/npy" "$work/data"
python3 scripts/e2e/make_data.py --out-dir "$work/npy" --emb-gib "$gib" --tokens-gib 0 || exit 1
for name in a b; do
  rm -rf "${work:?}/data/$name"
  "$bin/gpufeed" pack --quiet --out "$work/data/$name" --codec raw "$work/npy/emb_fp16.npy" || exit 1
done
cat "$work"/data/*/* >/dev/null

rm -f "$socket"
"$bin/gpufeed" serve --data-root "$work/data" --socket "$socket" --device cuda:0 --http off \
  >"$work/daemon.out" 2>"$OUT/daemon.log" &
daemon=$!
trap 'kill -TERM "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null' EXIT
for _ in $(seq 1 300); do
  grep -q serving "$work/daemon.out" 2>/dev/null && break
  sleep 0.1
done
grep -q serving "$work/daemon.out" || { echo "gpu-mixture: the daemon did not start" >&2; exit 1; }

failed=0
for run in $(seq 1 "$runs"); do
  for order in none full; do
    for case in mixture-cuda dataset-cuda mixture-cpu; do
      case $case in
        mixture-cuda) source=(--source a=0.5 --source b=0.5); device=cuda:0 ;;
        dataset-cuda) source=(--dataset a); device=cuda:0 ;;
        mixture-cpu) source=(--source a=0.5 --source b=0.5); device=cpu ;;
      esac
      if ! line=$("$bin/consume" --socket "$socket" "${source[@]}" --device "$device" \
        --batch-size "$batch" --field data --dtype f32 --shuffle "$order" --prefetch 4 | tail -1); then
        echo "gpu-mixture: $case $order run $run FAILED" >&2
        failed=1
        continue
      fi
      python3 - "$line" "$case" "$order" "$run" "$gib" <<'PY' | tee -a "$jsonl"
import json, sys
line, case, order, run, gib = sys.argv[1:]
d = json.loads(line)
# `bytes` counts the fp32 batches delivered: half of it is the fp16 read.
d.update(case=case, order=order, run=int(run), dataset_gib_per_source=float(gib),
         gb_per_s_in=d["bytes"] / 2 / d["seconds"] / 1e9)
print(json.dumps(d))
PY
    done
  done
done

python3 - "$jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
groups = {}
for r in rows:
    groups.setdefault((r["case"], r["order"]), []).append(r["gb_per_s_in"])
print("GB/s of fp16 in, median (runs):")
for (case, order), values in sorted(groups.items()):
    print(f"  {case:13} {order:5} {statistics.median(values):7.3f}  ({', '.join(f'{v:.3f}' for v in values)})")
PY
exit "$failed"
