#!/usr/bin/env bash
# Pack speed from Parquet and Arrow IPC inputs against the same data as .npy: writes ROWS rows of a
# fixed_size_list<WIDTH> column (float16 and float32) and an int64 label with pyarrow (Parquet
# uncompressed and snappy in 16384-row groups, an IPC stream of 1000-row batches as Hugging Face
# `datasets` writes), packs each with `gpufeed pack --codec raw` twice (the second warm) and prints
# one line per input: seconds and GB/s of raw field bytes, decoding included, and peak RSS.
#   scripts/pack-bench-tables.sh [DIR] [ROWS] [WIDTH] [THREADS]    (needs numpy and pyarrow)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$(mktemp -d)}
rows=${2:-262144}
width=${3:-1024}
threads=${4:-$(nproc)}
bin=${GPUFEED_BIN:-$root/target/release/gpufeed}
[ -x "$bin" ] || (cd "$root" && cargo build --release --bin gpufeed)
mkdir -p "$dir"
python3 - "$dir" "$rows" "$width" <<'PY'
import sys
import numpy as np, pyarrow as pa, pyarrow.ipc as ipc, pyarrow.parquet as pq
out, rows, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
for dtype in ("float16", "float32"):
    emb = rng.standard_normal((rows, width)).astype(dtype)
    np.save(f"{out}/{dtype}.npy", emb)
    t = pa.table({"emb": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), width),
                  "label": np.arange(rows, dtype=np.int64)})
    for comp in ("none", "snappy"):
        pq.write_table(t, f"{out}/{dtype}-{comp}.parquet", compression=comp, row_group_size=16384)
    with ipc.new_stream(f"{out}/{dtype}-stream.arrow", t.schema) as w:
        for batch in t.to_batches(max_chunksize=1000):
            w.write_batch(batch)
PY
echo "host: $(nproc) CPUs, $(uname -m); threads $threads; rows $rows width $width"
for dtype in float16 float32; do
  for input in "$dtype.npy" "$dtype-none.parquet" "$dtype-snappy.parquet" "$dtype-stream.arrow"; do
    case $input in *.npy) spec="emb=$dir/$input" ;; *) spec="emb=$dir/$input:emb" ;; esac
    for run in cold warm; do
      rm -rf "$dir/out"
      line=$(/usr/bin/time -f "rss %M KB" "$bin" pack --quiet --codec raw --threads "$threads" \
        --out "$dir/out" --field "$spec" 2>&1 | tr '\n' ' ')
      echo "$input $run: ${line#*(1.000x) }"
    done
  done
done
rm -rf "$dir/out"
