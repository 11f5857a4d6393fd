"""Variable-length fields through Python on the CPU backend: Parquet list and string columns
packed with `gpufeed.pack(from_parquet=...)`, served padded (a tensor padded to the batch's longest
with a lengths tensor, capped when asked) and packed (values with int32 cu_seqlens), as NumPy and
torch tensors through DLPack, exact against pyarrow's reading, in every order; resumed from a
state_dict mid-epoch."""

import numpy as np
import pytest

import gpufeed
from conftest import Daemon, gpufeed_bin

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = 900


def documents():
    """Per row: `tokens` (0 to 60 int32, some empty), `text` (a string), `row` (the row index)."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 61, ROWS)
    lengths[::9] = 0
    tokens = [rng.integers(-(2**31), 2**31, n).astype(np.int32) for n in lengths]
    text = ["é" * int(n % 7) + str(i) for i, n in enumerate(lengths)]
    return tokens, text


@pytest.fixture(scope="module")
def docs_daemon(tmp_path_factory):
    import os

    os.environ.setdefault("GPUFEED_BIN", gpufeed_bin())
    root = tmp_path_factory.mktemp("gpufeed-variable")
    (root / "data").mkdir()
    tokens, text = documents()
    table = pa.table(
        {
            "tokens": pa.array(tokens, pa.list_(pa.int32())),
            "text": pa.array(text),
            "row": pa.array(np.arange(ROWS, dtype=np.int64)),
        }
    )
    files = []
    for index, rows in enumerate([slice(0, 400), slice(400, ROWS)]):
        files.append(root / f"part-{index}.parquet")
        pq.write_table(table.slice(rows.start, rows.stop - rows.start), files[-1], row_group_size=128)
    gpufeed.pack(root / "data" / "docs", from_parquet=files, samples_per_shard=200)
    daemon = Daemon(root, "cpu")
    # pyarrow's reading of what was packed: the reference.
    read = pa.concat_tables([pq.read_table(f) for f in files])
    yield daemon, [np.asarray(v, dtype=np.int32) for v in read.column("tokens").to_pylist()], [
        s.encode() for s in read.column("text").to_pylist()
    ]
    daemon.stop()


def rows_of(batch, name, form):
    """Each row of variable-length field `name` of `batch`, as NumPy arrays."""
    values = np.from_dlpack(batch[name])
    if form == "packed":
        cu = np.from_dlpack(batch[f"{name}.cu_seqlens"])
        assert cu.dtype == np.int32 and cu.shape == (batch.samples + 1,) and cu[0] == 0
        assert values.shape == (int(cu[-1]),)
        return [values[cu[i]:cu[i + 1]] for i in range(batch.samples)]
    lengths = np.from_dlpack(batch[f"{name}.lengths"])
    assert lengths.dtype == np.int32 and lengths.shape == (batch.samples,)
    assert values.shape == (batch.samples, int(lengths.max(initial=0)))
    for i, length in enumerate(lengths):
        assert not values[i, length:].any(), "padding is zeros"
    return [values[i, :length] for i, length in enumerate(lengths)]


@pytest.mark.parametrize("shuffle", ["none", "window", "full"])
@pytest.mark.parametrize("form,cap", [("padded", None), ("packed", None), ("padded", 17), ("packed", 5)])
def test_every_order_and_form_is_exact(docs_daemon, shuffle, form, cap):
    daemon, tokens, text = docs_daemon
    client = gpufeed.Client(daemon.socket)
    variable = {"tokens": (form, cap), "text": "packed"}
    stream = client.open_stream("docs", batch_size=64, shuffle=shuffle, window_shards=2, seed=4,
                                variable=variable)
    seen = []
    for batch in stream:
        with batch:
            assert set(batch.keys()) == {"tokens", "tokens.lengths" if form == "padded" else "tokens.cu_seqlens",
                                         "text", "text.cu_seqlens", "row"}
            row_ids = np.from_dlpack(batch["row"])
            for row, values, chars in zip(row_ids, rows_of(batch, "tokens", form), rows_of(batch, "text", "packed")):
                expected = tokens[row][: cap if cap else None]
                assert values.dtype == np.int32
                np.testing.assert_array_equal(values, expected)
                assert chars.tobytes() == text[row]
            seen.extend(row_ids.tolist())
    assert len(seen) == ROWS // 64 * 64 and len(set(seen)) == len(seen)
    if shuffle == "none":
        assert seen == list(range(len(seen)))


def test_a_field_not_named_is_padded(docs_daemon):
    daemon, tokens, _ = docs_daemon
    batch = next(iter(gpufeed.Client(daemon.socket).open_stream("docs", batch_size=10, fields=["tokens"])))
    assert list(batch.keys()) == ["tokens", "tokens.lengths"]
    for row, values in enumerate(rows_of(batch, "tokens", "padded")):
        np.testing.assert_array_equal(values, tokens[row])


def test_resume_from_state_dict_mid_epoch(docs_daemon):
    daemon, tokens, _ = docs_daemon
    client = gpufeed.Client(daemon.socket)
    options = dict(batch_size=50, shuffle="full", seed=9, variable={"tokens": "packed"}, fields=["tokens", "row"])
    whole = [np.from_dlpack(b["row"]).copy() for b in client.open_stream("docs", **options)]
    stream = client.open_stream("docs", **options)
    for _ in range(5):
        next(stream).release()
    state = stream.state_dict()
    stream.close()
    resumed = []
    for batch in client.open_stream("docs", batch_size=50, variable={"tokens": "packed"},
                                    fields=["tokens", "row"], state=state):
        with batch:
            ids = np.from_dlpack(batch["row"]).copy()
            for row, values in zip(ids, rows_of(batch, "tokens", "packed")):
                np.testing.assert_array_equal(values, tokens[row])
            resumed.append(ids)
    assert len(resumed) == len(whole) - 5
    for got, want in zip(resumed, whole[5:]):
        np.testing.assert_array_equal(got, want)


def test_torch_gets_the_padded_tensor_and_cu_seqlens(docs_daemon):
    torch = pytest.importorskip("torch")
    daemon, tokens, _ = docs_daemon
    client = gpufeed.Client(daemon.socket)
    for form in ["padded", "packed"]:
        batch = next(iter(client.open_stream("docs", batch_size=16, fields=["tokens"], variable={"tokens": form})))
        values = torch.from_dlpack(batch["tokens"])
        index = torch.from_dlpack(batch["tokens." + ("lengths" if form == "padded" else "cu_seqlens")])
        assert values.dtype == torch.int32 and index.dtype == torch.int32
        if form == "padded":
            assert values.shape == (16, int(index.max()))
            rows = [values[i, : index[i]] for i in range(16)]
        else:
            rows = [values[index[i]:index[i + 1]] for i in range(16)]
        for row, got in enumerate(rows):
            np.testing.assert_array_equal(got.numpy(), tokens[row])
        batch.release()


def test_bad_requests_are_refused_clearly(docs_daemon):
    daemon, _, _ = docs_daemon
    client = gpufeed.Client(daemon.socket)
    with pytest.raises(ValueError, match='form "ragged" is not padded or packed'):
        client.open_stream("docs", batch_size=10, variable={"tokens": "ragged"})
    with pytest.raises(gpufeed.DaemonError, match="fixed shape"):
        client.open_stream("docs", batch_size=10, variable={"row": "packed"})
    with pytest.raises(gpufeed.DaemonError, match="'tokens', which the stream does not serve"):
        client.open_stream("docs", batch_size=10, fields=["row"], variable={"tokens": "packed"})
    with pytest.raises(ValueError, match="cap of 0"):
        client.open_stream("docs", batch_size=10, variable={"tokens": ("padded", 0)})
