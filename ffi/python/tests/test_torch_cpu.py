"""gpufeed.torch on the CPU backend, where torch is installed (the GPU machine; skipped loudly
elsewhere unless GPUFEED_REQUIRE_TORCH=1 makes its absence a failure): resume at another world size,
rank and world size read when iterated, DataLoader workers refused, len(), step and replaced."""

import os
import subprocess

import numpy as np
import pytest

import gpufeed

if os.environ.get("GPUFEED_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401
else:
    torch = pytest.importorskip("torch", reason="torch is not installed here")


def test_state_dict_resumes_at_another_world_size(daemon):
    from gpufeed.torch import GpufeedDataset

    full = GpufeedDataset(daemon.socket, "toy", 50, shuffle="full", seed=4, rank=0, world_size=1,
                          device="cpu", fields=["ids"])
    # Copies: a view would keep its slot, and the stream has only `prefetch` of them.
    order = np.concatenate([b["ids"][:, 0].numpy().copy() for b in full])
    first = GpufeedDataset(daemon.socket, "toy", 50, shuffle="full", seed=4, rank=0, world_size=1,
                           device="cpu", fields=["ids"])
    it = iter(first)
    head = [next(it)["ids"][:, 0].numpy().copy() for _ in range(4)]
    state = first.state_dict()
    del it
    rest = []
    for rank in range(2):
        part = GpufeedDataset(daemon.socket, "toy", 50, rank=rank, world_size=2, device="cpu",
                              fields=["ids"])
        part.load_state_dict(state)
        rest += [b["ids"][:, 0].numpy().copy() for b in part]
    served = np.concatenate(head + rest)
    assert len(served) == len(order) and set(served.tolist()) == set(order.tolist())
    np.testing.assert_array_equal(np.concatenate(head), order[:200])


def dataset(daemon, batch_size, **options):
    from gpufeed.torch import GpufeedDataset

    options.setdefault("device", "cpu")
    options.setdefault("fields", ["ids"])
    return GpufeedDataset(daemon.socket, "toy", batch_size, **options)


def ids_of(data):
    """Sample indices of every batch of one iteration (copies: a view keeps its slot)."""
    return [b["ids"][:, 0].numpy().copy() for b in data]


def test_rank_and_world_size_are_read_when_iterated_not_at_construction(daemon, monkeypatch):
    """A dataset made before init_process_group (world 1 then) reads the group's rank and world
    size when the loop starts."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = dataset(daemon, 100)
    assert (data.rank, data.world_size) == (0, 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    client = gpufeed.Client(daemon.socket)
    expected = [np.from_dlpack(b["ids"])[:, 0].copy() for b in
                client.open_stream("toy", 100, fields=["ids"], rank=1, world_size=4)]
    served = ids_of(data)
    assert len(served) == 2 and len(data) == 2
    np.testing.assert_array_equal(np.concatenate(served), np.concatenate(expected))
    # The environment, without a group (torchrun sets RANK and WORLD_SIZE).
    monkeypatch.undo()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (data.rank, data.world_size) == (0, 2)
    assert len(ids_of(data)) == 5
    # Given values win.
    pinned = dataset(daemon, 100, rank=0, world_size=1)
    assert len(ids_of(pinned)) == 10


def test_dataloader_workers_are_refused_with_a_clear_message(daemon):
    loader = torch.utils.data.DataLoader(dataset(daemon, 100), batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match=r"num_workers=0"):
        next(iter(loader))
    from gpufeed.torch import loader as gpufeed_loader

    assert len(ids_of(gpufeed_loader(dataset(daemon, 100)))) == 10


@pytest.mark.parametrize("batch_size, world_size, tail", [(64, 1, "drop"), (64, 1, "pad"),
                                                          (64, 3, "drop"), (64, 3, "pad"),
                                                          (100, 2, "drop"), (1000, 1, "drop"),
                                                          (1001, 1, "pad")])
def test_len_is_the_batches_an_iteration_yields(daemon, batch_size, world_size, tail):
    data = dataset(daemon, batch_size, rank=world_size - 1, world_size=world_size, tail=tail)
    step = batch_size * world_size
    expected = 1000 // step if tail == "drop" else -(-1000 // step)
    assert len(data) == expected  # before any iteration: from a stream opened to learn the size
    it = iter(data)
    batches = [next(it, None) for _ in range(1)]
    assert len(data) == expected  # while iterating
    batches += list(it)
    assert len([b for b in batches if b is not None]) == expected == len(data)


def test_len_after_load_state_dict_counts_from_the_checkpoint(daemon):
    first = dataset(daemon, 50, rank=0, world_size=2)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert state["stream"]["cursor"] == 400
    del it
    resumed = dataset(daemon, 50, rank=1, world_size=3)
    resumed.load_state_dict(state)
    assert len(resumed) == 600 // 150
    assert len(ids_of(resumed)) == 4
    assert len(resumed) == 1000 // 150  # the next epoch is whole


def test_step_follows_the_batches_and_dtypes_take_torch_types(daemon, source):
    data = dataset(daemon, 100, fields={"ids": None, "emb": torch.float32})
    assert data.step is None and data.replaced == 0
    for step, batch in enumerate(data):
        assert data.step == step and data.replaced == 0
        assert batch["emb"].dtype == torch.float32
        expected = source["emb"][step * 100:(step + 1) * 100].astype(np.float32)
        np.testing.assert_array_equal(batch["emb"].numpy(), expected)
    with pytest.raises(ValueError, match=r'fields\["emb"\]'):
        dataset(daemon, 100, fields={"emb": "float"})


@pytest.fixture(scope="module")
def corrupt_daemon(tmp_path_factory, source):
    """A daemon whose "toy" has one corrupt block: a byte of sample 300's `emb` row is flipped in
    the shard of samples 250..500 (raw blocks: the row's bytes are in the file as they are)."""
    from conftest import Daemon, gpufeed_bin

    root = tmp_path_factory.mktemp("gpufeed-corrupt")
    (root / "data").mkdir()
    inputs = []
    for name, array in source.items():
        np.save(root / f"{name}.npy", array)
        inputs += ["--field", f"{name}={root / name}.npy"]
    subprocess.run([gpufeed_bin(), "pack", "--out", str(root / "data" / "toy"), "--codec", "raw",
                    "--samples-per-shard", "250", *inputs], check=True, capture_output=True)
    shard = root / "data" / "toy" / "shard-000001.gfs"
    data = bytearray(shard.read_bytes())
    row = source["emb"][300].tobytes()
    at = data.find(row)
    assert at >= 0 and data.find(row, at + 1) < 0, "sample 300's row must occur once in its shard"
    data[at + 3] ^= 0x40
    shard.write_bytes(bytes(data))
    daemon = Daemon(root, "cpu")
    yield daemon
    daemon.stop()


def test_replaced_counts_the_zero_filled_samples_of_each_batch(corrupt_daemon):
    data = dataset(corrupt_daemon, 100, fields=["ids", "emb"], on_corrupt="replace")
    replaced = []
    for batch in data:
        replaced.append(data.replaced)
        zero_rows = int((batch["emb"] == 0).all(dim=1).sum())
        assert zero_rows >= data.replaced
    # The block is shard 1's `emb`, samples 250..500: half of step 2, all of steps 3 and 4.
    assert replaced == [0, 0, 50, 100, 100, 0, 0, 0, 0, 0]


def test_torch_dtypes_map_to_gpufeed_names():
    from gpufeed._dtypes import dtype_name

    assert dtype_name(torch.bfloat16, "x") == "bf16"
    assert dtype_name(torch.half, "x") == "f16"
    assert dtype_name(torch.long, "x") == "i64"
    assert dtype_name(torch.uint8, "x") == "u8"
    with pytest.raises(ValueError, match="torch.complex64"):
        dtype_name(torch.complex64, "x")


def test_the_next_epoch_opened_ahead_serves_that_epoch_exactly(daemon):
    """With open_ahead the next epoch's stream is opened before the current one ends, and the
    iteration that follows uses it: each epoch's batches are those of a dataset that opens every
    epoch when it starts; a set_epoch to another epoch discards the stream opened ahead."""
    ahead = dataset(daemon, 50, shuffle="full", seed=9, open_ahead=0.5)
    plain = dataset(daemon, 50, shuffle="full", seed=9, open_ahead=0.0)
    first = []
    for batch in ahead:
        first.append(batch["ids"][:, 0].numpy().copy())
    # The epoch ran to its end with the next epoch's stream open.
    assert ahead._ahead is not None and ahead.epoch == 1
    opened_ahead = ahead._ahead[2]
    second = ids_of(ahead)
    assert ahead._stream is None and opened_ahead.closed
    for epoch, served in ((0, first), (1, second)):
        plain.set_epoch(epoch)
        expected = ids_of(plain)
        assert len(served) == len(expected)
        for got, want in zip(served, expected):
            np.testing.assert_array_equal(got, want)
    # Another epoch than the one opened ahead: that stream is closed and the asked epoch served.
    assert ahead._ahead is not None
    skipped = ahead._ahead[2]
    ahead.set_epoch(5)
    fifth = ids_of(ahead)
    assert skipped.closed
    plain.set_epoch(5)
    for got, want in zip(fifth, ids_of(plain)):
        np.testing.assert_array_equal(got, want)
    ahead.close()
    assert ahead._ahead is None
    with pytest.raises(ValueError, match="open_ahead"):
        dataset(daemon, 50, open_ahead=1.0)
