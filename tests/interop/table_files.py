"""Writes Parquet and Arrow IPC inputs with pyarrow and checks what `gpufeed unpack` returns.

    table_files.py write DIR            the inputs below, in DIR
    table_files.py check FILE... -- FIELD=COLUMN=UNPACKED.npy ...
    table_files.py truncate SRC DST N   DST = SRC without its last N bytes

Written: `a.parquet` (snappy, several row groups) and `b.parquet` (zstd) of one schema: `emb`
fixed_size_list<float32>[8], `img` fixed_size_list<fixed_size_list<uint8>[4]>[3], `label` int64,
`w` float16, `flag` bool; `a.arrow` (an IPC file, lz4) of that schema; `hf/data-00000-of-00001.arrow`
an IPC stream as Hugging Face `datasets` writes its cache (1000-row batches, `huggingface` schema
metadata, a `text` string column and an `input_ids` list column beside fixed ones); and malformed
ones: `nulls.parquet` (a null in `label`, row 13; one inside an `emb` list, row 40),
`list.parquet` (a list column), `other.parquet` (`label` int32).

`check` reads every FILE with pyarrow, concatenates each COLUMN over the files, and compares it
exactly with the unpacked `.npy` of FIELD; it prints `ok ROWS`.
"""

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq


def table(seed, rows):
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((rows, 8)).astype(np.float32)
    img = rng.integers(0, 256, (rows, 3, 4), dtype=np.uint8)
    return pa.table(
        {
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), 8),
            "img": pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(pa.array(img.reshape(-1)), 4), 3
            ),
            "label": pa.array(rng.integers(-(2**40), 2**40, rows), pa.int64()),
            "w": pa.array(rng.standard_normal(rows).astype(np.float16)),
            "flag": pa.array(rng.integers(0, 2, rows).astype(bool)),
        }
    )


def write(out):
    os.makedirs(out, exist_ok=True)
    pq.write_table(table(1, 1000), os.path.join(out, "a.parquet"), row_group_size=300)
    pq.write_table(table(2, 777), os.path.join(out, "b.parquet"), compression="zstd")
    with ipc.new_file(
        os.path.join(out, "a.arrow"), table(3, 0).schema, options=ipc.IpcWriteOptions(compression="lz4")
    ) as writer:
        writer.write_table(table(3, 2500), max_chunksize=600)
    # The layout of a `datasets` cache file: an IPC stream of 1000-row batches whose schema carries
    # the `huggingface` features metadata.
    rows = 2345
    rng = np.random.default_rng(4)
    hf = table(4, rows).select(["emb", "label"])
    hf = hf.append_column("text", pa.array([f"document {i}" for i in range(rows)]))
    hf = hf.append_column(
        "input_ids",
        pa.array([list(range(int(rng.integers(1, 9)))) for _ in range(rows)], pa.list_(pa.int32())),
    )
    hf = hf.replace_schema_metadata({"huggingface": '{"info": {"features": {}}}'})
    os.makedirs(os.path.join(out, "hf"), exist_ok=True)
    with ipc.new_stream(os.path.join(out, "hf", "data-00000-of-00001.arrow"), hf.schema) as writer:
        for batch in hf.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
    bad = table(5, 100)
    label = bad.column("label").to_pylist()
    label[13] = None
    nulls = bad.set_column(2, "label", pa.array(label, pa.int64()))
    pq.write_table(nulls, os.path.join(out, "nulls.parquet"), row_group_size=10)
    emb = pa.array(
        [None if i == 40 * 8 + 3 else float(i) for i in range(100 * 8)], pa.float32()
    )
    inner_null = bad.set_column(0, "emb", pa.FixedSizeListArray.from_arrays(emb, 8))
    pq.write_table(inner_null, os.path.join(out, "inner-null.parquet"))
    listed = bad.append_column("ids", pa.array([[1, 2]] * 100, pa.list_(pa.int64())))
    pq.write_table(listed, os.path.join(out, "list.parquet"))
    other = bad.set_column(2, "label", pa.array(np.arange(100, dtype=np.int32)))
    pq.write_table(other, os.path.join(out, "other.parquet"))


def read(path):
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith(b"PAR1"):
        return pq.read_table(path)
    if head == b"ARROW1":
        return ipc.open_file(path).read_all()
    return ipc.open_stream(path).read_all()


def to_numpy(column):
    """A column as an array of shape (rows, *sample shape), without nulls."""
    column = column.combine_chunks()
    shape = [len(column)]
    while pa.types.is_fixed_size_list(column.type):
        shape.append(column.type.list_size)
        column = column.flatten()
    if pa.types.is_boolean(column.type):
        return column.to_numpy(zero_copy_only=False).astype(np.uint8).reshape(shape)
    return column.to_numpy(zero_copy_only=False).reshape(shape)


def check(files, specs):
    tables = [read(f) for f in files]
    rows = sum(t.num_rows for t in tables)
    for spec in specs:
        field, column, unpacked = spec.split("=", 2)
        expected = to_numpy(pa.chunked_array([c for t in tables for c in t.column(column).chunks]))
        got = np.load(unpacked)
        if got.dtype != expected.dtype or got.shape != expected.shape:
            sys.exit(f"{field}: unpacked {got.dtype}{got.shape}, pyarrow reads {expected.dtype}{expected.shape}")
        if got.tobytes() != expected.tobytes():
            sys.exit(f"{field}: values differ from pyarrow's reading of column {column}")
    print(f"ok {rows}")


def main():
    command = sys.argv[1]
    if command == "write":
        write(sys.argv[2])
    elif command == "check":
        split = sys.argv.index("--")
        check(sys.argv[2:split], sys.argv[split + 1 :])
    elif command == "truncate":
        with open(sys.argv[2], "rb") as f:
            data = f.read()
        with open(sys.argv[3], "wb") as f:
            f.write(data[: len(data) - int(sys.argv[4])])
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
