"""The package's conveniences against a CPU daemon: Client and Stream as context managers and
Client.close(); Batch as a Mapping; dtypes given as NumPy and PyTorch names and types; world_size=
(and the deprecated world=); the socket path from GPUFEED_SOCKET or GPUFEED_DATA_ROOT."""

import collections.abc
import os
import time

import numpy as np
import pytest

import gpufeed


def sessions(daemon):
    return daemon.status()["pools"]["sessions"]


def wait_for(condition, what):
    """Polls the daemon's status until `condition` holds (a session's end is noticed by the daemon's
    session thread, asynchronously to the client's close); bounded."""
    for _ in range(500):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_closing_a_client_ends_its_streams_and_keeps_held_batches(daemon, source):
    before = sessions(daemon)
    with gpufeed.Client(daemon.socket) as client:
        assert not client.closed
        stream = client.open_stream("toy", batch_size=10, fields=["ids"])
        other = client.open_stream("toy", batch_size=10, fields=["ids"])
        batch = next(stream)
        held = np.from_dlpack(batch["ids"])
        assert sessions(daemon) == before + 2
    assert client.closed and stream.closed and other.closed
    with pytest.raises(StopIteration):
        next(stream)
    with pytest.raises(ValueError, match="closed"):
        client.open_stream("toy", batch_size=10)
    with pytest.raises(ValueError, match="closed"):
        stream.state_dict()
    client.close()  # idempotent
    # A batch taken before the close stays valid until released.
    np.testing.assert_array_equal(held, source["ids"][:10])
    del held, batch
    wait_for(lambda: sessions(daemon) == before, "the closed client's sessions to end")


def test_a_stream_closes_on_leaving_its_with_block(daemon):
    client = gpufeed.Client(daemon.socket)
    with client.open_stream("toy", batch_size=100, fields=["ids"]) as stream:
        assert stream.epoch_samples == 1000 and stream.steps == 10
        with next(stream) as batch:
            assert batch.step == 0
    assert stream.closed and not client.closed
    # The client opens further streams after one of them closed.
    with client.open_stream("toy", batch_size=500, fields=["ids"]) as again:
        assert [b.step for b in again] == [0, 1]


def test_a_batch_is_a_mapping_of_name_to_field(daemon, source):
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=10, fields=["ids", "emb"])
    batch = next(stream)
    assert isinstance(batch, collections.abc.Mapping)
    assert list(batch) == ["ids", "emb"] == batch.keys()
    assert len(batch) == 2 and "emb" in batch and "nope" not in batch and 3 not in batch
    items = batch.items()
    assert [name for name, _ in items] == ["ids", "emb"]
    assert [field.name for field in batch.values()] == ["ids", "emb"]
    arrays = {name: np.from_dlpack(field) for name, field in items}
    np.testing.assert_array_equal(arrays["ids"], source["ids"][:10])
    assert arrays["emb"].tobytes() == source["emb"][:10].tobytes()
    assert batch.get("ids").name == "ids"
    assert batch.get("nope") is None and batch.get("nope", 7) == 7
    # dict() takes a Mapping through keys() and [].
    assert sorted(dict(batch)) == ["emb", "ids"]


def dtype_spellings():
    spellings = ["f32", "float32", np.float32, np.dtype("float32"), np.dtype("<f4")]
    try:
        import torch
    except ImportError:
        return spellings
    return spellings + [torch.float32, torch.float]


@pytest.mark.parametrize("dtype", dtype_spellings(), ids=repr)
def test_a_dtype_may_be_named_as_numpy_and_torch_name_it(daemon, source, dtype):
    client = gpufeed.Client(daemon.socket)
    with client.open_stream("toy", batch_size=100, fields={"emb": dtype}) as stream:
        batch = next(stream)
        assert batch["emb"].dtype == "f32"
        np.testing.assert_array_equal(np.from_dlpack(batch["emb"]),
                                      source["emb"][:100].astype(np.float32))


def test_every_dtype_has_its_numpy_name():
    from gpufeed._dtypes import dtype_name

    for short, numpy_type in [("u8", np.uint8), ("i8", np.int8), ("u16", np.uint16),
                              ("i16", np.int16), ("u32", np.uint32), ("i32", np.int32),
                              ("u64", np.uint64), ("i64", np.int64), ("f16", np.float16),
                              ("f32", np.float32), ("f64", np.float64)]:
        assert dtype_name(short, "x") == short
        assert dtype_name(numpy_type, "x") == short
        assert dtype_name(np.dtype(numpy_type).name, "x") == short
    assert dtype_name("bfloat16", "x") == "bf16" and dtype_name(None, "x") is None


@pytest.mark.parametrize("dtype", ["float", "f8", np.complex64, np.dtype(">f4"), float, 32],
                         ids=repr)
def test_an_unknown_dtype_is_refused_naming_its_field(daemon, dtype):
    client = gpufeed.Client(daemon.socket)
    with pytest.raises(ValueError, match=r'fields\["emb"\]: .* is not an element type') as raised:
        client.open_stream("toy", batch_size=10, fields={"ids": None, "emb": dtype})
    assert "float32" in str(raised.value) and "f32" in str(raised.value)


def test_world_size_splits_the_epoch_and_world_is_a_deprecated_alias(daemon):
    client = gpufeed.Client(daemon.socket)

    def ids(stream):
        out = []
        for batch in stream:
            with batch:
                out.append(np.from_dlpack(batch["ids"])[:, 0].copy())
        return np.concatenate(out)

    ranks = [ids(client.open_stream("toy", batch_size=50, fields=["ids"], rank=r, world_size=2))
             for r in range(2)]
    assert sorted(np.concatenate(ranks).tolist()) == list(range(1000))
    with pytest.warns(DeprecationWarning, match="world_size="):
        old = client.open_stream("toy", batch_size=50, fields=["ids"], rank=1, world=2)
    np.testing.assert_array_equal(ids(old), ranks[1])
    with pytest.raises(ValueError, match="world_size only"):
        client.open_stream("toy", batch_size=50, rank=1, world_size=2, world=2)


def test_the_socket_comes_from_gpufeed_socket_then_the_data_root(daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFEED_SOCKET", daemon.socket)
    monkeypatch.setenv("GPUFEED_DATA_ROOT", str(tmp_path))
    with gpufeed.Client() as client:
        assert client.socket == daemon.socket
        assert client.open_stream("toy", batch_size=100).steps == 10
    # The daemon's own default: DATA_ROOT/gpufeed.sock (conftest's daemon listens there).
    monkeypatch.delenv("GPUFEED_SOCKET")
    monkeypatch.setenv("GPUFEED_DATA_ROOT", str(daemon.root))
    assert gpufeed.Client().socket == daemon.socket
    monkeypatch.setenv("GPUFEED_DATA_ROOT", str(tmp_path))
    with pytest.raises(gpufeed.ConnectError, match="from GPUFEED_DATA_ROOT"):
        gpufeed.Client()
    monkeypatch.setenv("GPUFEED_SOCKET", str(tmp_path / "absent.sock"))
    with pytest.raises(gpufeed.ConnectError, match="absent.sock.* from GPUFEED_SOCKET"):
        gpufeed.Client()
    monkeypatch.delenv("GPUFEED_SOCKET")
    monkeypatch.delenv("GPUFEED_DATA_ROOT")
    if not os.path.exists("/run/gpufeed.sock"):
        with pytest.raises(gpufeed.ConnectError, match="/run/gpufeed.sock.* the default"):
            gpufeed.Client()
    # An explicit path is used as given, whatever the environment says.
    monkeypatch.setenv("GPUFEED_SOCKET", str(tmp_path / "absent.sock"))
    assert gpufeed.Client(daemon.socket).socket == daemon.socket
