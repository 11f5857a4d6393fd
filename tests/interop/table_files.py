"""Writes Parquet and Arrow IPC inputs with pyarrow and checks what `gpufeed unpack` returns.

    table_files.py write DIR            the inputs below, in DIR
    table_files.py check FILE... -- FIELD=COLUMN=UNPACKED.npy ...
    table_files.py check-variable DATASET FILE... -- FIELD=COLUMN ...
    table_files.py truncate SRC DST N   DST = SRC without its last N bytes

Written: `a.parquet` (snappy, several row groups) and `b.parquet` (zstd) of one schema: `emb`
fixed_size_list<float32>[8], `img` fixed_size_list<fixed_size_list<uint8>[4]>[3], `label` int64,
`w` float16, `flag` bool; `a.arrow` (an IPC file, lz4) of that schema; `hf/data-00000-of-00001.arrow`
an IPC stream as Hugging Face `datasets` writes its cache (1000-row batches, `huggingface` schema
metadata, a `text` string column and an `input_ids` list column beside fixed ones); and malformed
ones: `nulls.parquet` (a null in `label`, row 13; one inside an `emb` list, row 40),
`nested.parquet` (a list of lists), `other.parquet` (`label` int32). Variable-length inputs:
`varlen.parquet` (snappy, row groups of 300) and `varlen.arrow` (an IPC file) of one schema: `ids`
list<int32> (some lists empty), `text` string, `pairs` large_list<fixed_size_list<float32>[2]>,
`blob` binary, `label` int64; `list.parquet` (a list column beside fixed ones).

`check` reads every FILE with pyarrow, concatenates each COLUMN over the files, and compares it
exactly with the unpacked `.npy` of FIELD; it prints `ok ROWS`. `check-variable` reads DATASET with
`read_shards.py`'s independent reader and compares each variable-length FIELD, row by row, with
pyarrow's reading of COLUMN over the FILEs; it prints `ok ROWS`.
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


def variable_table(seed, rows):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, rows)
    lengths[::7] = 0
    return pa.table(
        {
            "ids": pa.array([rng.integers(-(2**31), 2**31, n).astype(np.int32) for n in lengths],
                            pa.list_(pa.int32())),
            "text": pa.array(["x" * int(n) + str(i) for i, n in enumerate(lengths)]),
            "pairs": pa.array([rng.standard_normal((int(n) % 5, 2)).astype(np.float32).tolist() for n in lengths],
                              pa.large_list(pa.list_(pa.float32(), 2))),
            "blob": pa.array([bytes(rng.integers(0, 256, int(n) % 3, dtype=np.uint8)) for n in lengths]),
            "label": pa.array(np.arange(rows, dtype=np.int64)),
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
    nested = bad.append_column("ids", pa.array([[[1], [2, 3]]] * 100, pa.list_(pa.list_(pa.int32()))))
    pq.write_table(nested, os.path.join(out, "nested.parquet"))
    pq.write_table(variable_table(6, 1000), os.path.join(out, "varlen.parquet"), row_group_size=300)
    varlen = variable_table(7, 700)
    with ipc.new_file(os.path.join(out, "varlen.arrow"), varlen.schema) as writer:
        writer.write_table(varlen, max_chunksize=256)
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


def row_bytes(column, row):
    """Row `row` of a list, string or binary column as the bytes gpufeed stores: its values in C
    order."""
    value = column[row]
    if pa.types.is_string(column.type) or pa.types.is_binary(column.type):
        data = value.as_py()
        return data.encode() if isinstance(data, str) else data
    values = value.values
    while pa.types.is_fixed_size_list(values.type):
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).tobytes()


def check_variable(dataset, files, specs):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import read_shards

    manifest, fields = read_shards.read_dataset(dataset)
    tables = [read(f) for f in files]
    rows = sum(t.num_rows for t in tables)
    for spec in specs:
        field, column = spec.split("=", 1)
        listed = next(f for f in manifest["fields"] if f["name"] == field)
        if not listed.get("variable_length"):
            sys.exit(f"{field}: not a variable-length field in {dataset}")
        ends, values = fields[field]
        element = read_shards.DTYPES[next(c for c, (n, _) in read_shards.DTYPES.items() if n == listed["dtype"])][1].itemsize
        element *= int(np.prod(listed["shape"], dtype=np.int64))
        expected = pa.chunked_array([c for t in tables for c in t.column(column).chunks]).combine_chunks()
        if len(ends) != len(expected):
            sys.exit(f"{field}: {len(ends)} samples, pyarrow reads {len(expected)} rows")
        start = 0
        longest = 0
        for row in range(len(expected)):
            end = int(ends[row])
            got = values[start * element:end * element]
            want = row_bytes(expected, row)
            if got != want:
                sys.exit(f"{field}: row {row} differs from pyarrow's reading of column {column}")
            longest = max(longest, end - start)
            start = end
        if longest != listed["length_max"]:
            sys.exit(f"{field}: length_max {listed['length_max']}, the longest row has {longest}")
    print(f"ok {rows}")


def main():
    command = sys.argv[1]
    if command == "write":
        write(sys.argv[2])
    elif command == "check":
        split = sys.argv.index("--")
        check(sys.argv[2:split], sys.argv[split + 1 :])
    elif command == "check-variable":
        split = sys.argv.index("--")
        check_variable(sys.argv[2], sys.argv[3:split], sys.argv[split + 1 :])
    elif command == "truncate":
        with open(sys.argv[2], "rb") as f:
            data = f.read()
        with open(sys.argv[3], "wb") as f:
            f.write(data[: len(data) - int(sys.argv[4])])
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
