"""gpufeed.pack: datasets written from NumPy arrays, streamed iterables and Parquet files, checked
exactly by unpacking each field with the gpufeed binary and loading it with NumPy; refusals leave
`out` untouched and no scratch directory behind."""

import os
import subprocess

import numpy as np
import pytest

import gpufeed
from conftest import gpufeed_bin


@pytest.fixture(autouse=True)
def binary(monkeypatch):
    monkeypatch.setenv("GPUFEED_BIN", gpufeed_bin())


def unpacked(dataset, field, tmp_path):
    out = tmp_path / f"unpacked-{os.path.basename(dataset)}-{field}.npy"
    subprocess.run(
        [gpufeed_bin(), "unpack", str(dataset), "--field", field, "--out", str(out), "--quiet", "--force"],
        check=True,
    )
    return np.load(out)


def no_scratch(tmp_path):
    return not [p for p in os.listdir(tmp_path) if p.startswith(".gpufeed-pack-")]


def test_arrays_and_streamed_iterables_pack_exactly(tmp_path):
    rng = np.random.default_rng(3)
    emb = rng.standard_normal((1000, 16)).astype(np.float16)
    label = rng.integers(0, 1 << 40, 1000)
    chunks = [rng.integers(0, 255, (n, 2, 3), dtype=np.uint8) for n in (1, 400, 599)]

    def stream():
        # A generator: only one chunk is alive at a time.
        yield from chunks

    out = tmp_path / "ds"
    summary = gpufeed.pack(
        out,
        fields={"emb": emb, "label": label, "img": stream()},
        codec="lz4",
        block_bytes="4K",
        samples_per_shard=300,
    )
    assert "packed 1000 samples into 4 shard(s)" in summary
    assert np.array_equal(unpacked(out, "emb", tmp_path), emb)
    assert np.array_equal(unpacked(out, "label", tmp_path), label)
    assert np.array_equal(unpacked(out, "img", tmp_path), np.concatenate(chunks))
    assert no_scratch(tmp_path)


def test_existing_dataset_is_kept_without_force_and_replaced_with_it(tmp_path):
    out = tmp_path / "ds"
    first = np.arange(10, dtype=np.int32)
    gpufeed.pack(out, fields={"x": first})
    with pytest.raises(gpufeed.PackError, match="exists"):
        gpufeed.pack(out, fields={"x": first + 1})
    assert np.array_equal(unpacked(out, "x", tmp_path), first)
    gpufeed.pack(out, fields={"x": first + 1}, force=True, codec="raw")
    assert np.array_equal(unpacked(out, "x", tmp_path), first + 1)
    assert no_scratch(tmp_path)


def test_refusals_name_the_field_and_leave_nothing(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(gpufeed.PackError, match=r"field 'y', item 1: float32\[3\] per sample"):
        gpufeed.pack(out, fields={"y": iter([np.zeros((2, 2), np.float32), np.zeros((2, 3), np.float32)])})
    with pytest.raises(gpufeed.PackError, match="'b'"):
        gpufeed.pack(out, fields={"a": np.zeros(4, np.int32), "b": np.zeros(5, np.int32)})
    with pytest.raises(gpufeed.PackError, match="codec"):
        gpufeed.pack(out, fields={"a": np.zeros(4)}, codec="zip")
    assert not out.exists()
    assert no_scratch(tmp_path)


def test_from_parquet_packs_every_column_as_pyarrow_reads_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = np.random.default_rng(5)
    emb = rng.standard_normal((500, 4)).astype(np.float32)
    label = np.arange(500, dtype=np.int64)
    files = []
    for index, rows in enumerate([slice(0, 200), slice(200, 500)]):
        table = pa.table(
            {
                "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb[rows].reshape(-1)), 4),
                "label": pa.array(label[rows]),
            }
        )
        files.append(tmp_path / f"part-{index}.parquet")
        pq.write_table(table, files[-1], row_group_size=64)
    out = tmp_path / "ds"
    gpufeed.pack(out, from_parquet=files)
    assert np.array_equal(unpacked(out, "emb", tmp_path), emb)
    assert np.array_equal(unpacked(out, "label", tmp_path), label)
    # A list column packs as a variable-length field (tests/test_variable.py serves them); a list
    # of lists is refused naming the column.
    listed = pa.table({"ids": pa.array([[1], [2, 3]], pa.list_(pa.int64()))})
    pq.write_table(listed, tmp_path / "list.parquet")
    gpufeed.pack(tmp_path / "listed", from_parquet=[tmp_path / "list.parquet"])
    nested = pa.table({"ids": pa.array([[[1]], [[2, 3]]], pa.list_(pa.list_(pa.int64())))})
    pq.write_table(nested, tmp_path / "nested.parquet")
    with pytest.raises(gpufeed.PackError, match="column 'ids'.*lists of lists"):
        gpufeed.pack(tmp_path / "other", from_parquet=[tmp_path / "nested.parquet"])


def test_arrow_tables_and_streamed_record_batches_pack_exactly(tmp_path):
    pa = pytest.importorskip("pyarrow")
    rng = np.random.default_rng(7)
    emb = rng.standard_normal((600, 8)).astype(np.float32)
    label = np.arange(600, dtype=np.int32)

    def table(rows):
        return pa.table(
            {
                "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb[rows].reshape(-1)), 8),
                "label": pa.array(label[rows]),
            }
        )

    whole = tmp_path / "whole"
    gpufeed.pack(whole, arrow=table(slice(0, 600)), samples_per_shard=250)
    assert np.array_equal(unpacked(whole, "emb", tmp_path), emb)
    assert np.array_equal(unpacked(whole, "label", tmp_path), label)

    def batches():
        # A generator of record batches: one alive at a time.
        for start in range(0, 600, 128):
            yield from table(slice(start, start + 128)).to_batches()

    streamed = tmp_path / "streamed"
    gpufeed.pack(streamed, arrow=batches(), codec="lz4")
    assert np.array_equal(unpacked(streamed, "emb", tmp_path), emb)
    assert np.array_equal(unpacked(streamed, "label", tmp_path), label)

    other = pa.table({"label": pa.array([1.0, 2.0])}).to_batches()
    with pytest.raises(gpufeed.PackError, match="item 1 has the schema"):
        gpufeed.pack(tmp_path / "mixed", arrow=iter(table(slice(0, 2)).to_batches() + other))
    with pytest.raises(gpufeed.PackError, match="exactly one of"):
        gpufeed.pack(tmp_path / "both", fields={"a": label}, arrow=table(slice(0, 2)))
    assert not (tmp_path / "mixed").exists()
    assert no_scratch(tmp_path)


def test_ragged_fields_pack_variable_length_and_unpack_to_values_and_offsets(tmp_path):
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 50000, n, dtype=np.int32) for n in (0, 3, 17, 1, 400, 0, 9)]
    pairs = [rng.standard_normal((n, 2)).astype(np.float16) for n in (1, 2, 0, 5, 3, 1, 4)]
    objects = np.empty(len(pairs), dtype=object)
    objects[:] = pairs
    out = tmp_path / "ds"
    gpufeed.pack(
        out,
        fields={
            "tokens": gpufeed.Ragged.from_arrays(docs),
            "pairs": objects,
            "id": np.arange(len(docs), dtype=np.int64),
        },
        samples_per_shard=3,
    )
    for name, samples in (("tokens", docs), ("pairs", pairs)):
        values = unpacked(out, name, tmp_path)
        offsets = np.load(tmp_path / f"unpacked-ds-{name}.offsets.npy")
        assert offsets.dtype == np.int64 and offsets[0] == 0 and len(offsets) == len(samples) + 1
        for i, sample in enumerate(samples):
            assert np.array_equal(values[offsets[i] : offsets[i + 1]], sample)
    assert np.array_equal(unpacked(out, "id", tmp_path), np.arange(len(docs)))
    # The same from values and offsets directly.
    again = tmp_path / "again"
    values = np.concatenate(docs)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    gpufeed.pack(again, fields={"tokens": gpufeed.Ragged(values, offsets)})
    assert np.array_equal(unpacked(again, "tokens", tmp_path), values)
    with pytest.raises(gpufeed.PackError, match="sample 1"):
        gpufeed.Ragged.from_arrays([np.zeros(2, np.int32), np.zeros(2, np.int64)])
    with pytest.raises(gpufeed.PackError, match="offsets"):
        gpufeed.pack(tmp_path / "bad", fields={"tokens": gpufeed.Ragged(values, offsets + 1)})
    assert no_scratch(tmp_path)
