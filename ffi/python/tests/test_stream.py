"""The Python package against a daemon on the CPU backend: NumPy through DLPack and the array
interface, bit-exact against the source, in every order; resume from state_dict; errors; slot
release through the DLPack deleter; a killed consumer leaks nothing."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import gpufeed


def rows(batch, name):
    return np.from_dlpack(batch[name])


def collect(stream):
    """(ids column 0, emb rows) of every batch of the stream, in order."""
    ids, emb = [], []
    for batch in stream:
        with batch:
            ids.append(rows(batch, "ids")[:, 0].copy())
            emb.append(rows(batch, "emb").copy())
    return np.concatenate(ids), np.concatenate(emb)


def test_in_order_batches_equal_the_source(daemon, source):
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=100)
    assert stream.steps == 10 and stream.device == "cpu"
    ids, emb = collect(stream)
    np.testing.assert_array_equal(ids, np.arange(1000))
    assert emb.dtype == np.float16
    assert emb.tobytes() == source["emb"].tobytes()


@pytest.mark.parametrize("shuffle", ["window", "full"])
def test_shuffled_batches_are_the_source_rows(daemon, source, shuffle):
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=64, shuffle=shuffle, window_shards=2, seed=3,
                                fields={"ids": None, "emb": "f32"})
    ids, emb = collect(stream)
    assert len(ids) == 1000 // 64 * 64
    assert len(set(ids.tolist())) == len(ids), "a sample served twice in one epoch"
    assert not np.array_equal(ids, np.sort(ids)), "not shuffled"
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(emb, source["emb"][ids].astype(np.float32))


def test_array_interface_is_read_only_and_exact(daemon, source):
    client = gpufeed.Client(daemon.socket)
    batch = next(iter(client.open_stream("toy", batch_size=10, fields=["ids"])))
    field = batch["ids"]
    assert field.shape == (10, 2) and field.dtype == "i32" and field.nbytes == 80
    array = np.asarray(field)
    assert not array.flags.writeable
    np.testing.assert_array_equal(array, source["ids"][:10])
    assert batch.keys() == ["ids"] and "ids" in batch and "emb" not in batch
    with pytest.raises(KeyError):
        batch["emb"]


def test_resume_from_state_dict_at_the_same_and_another_world_size(daemon):
    """Two ranks consume 4 steps of 50 samples each; rank 0's state_dict (cursor 400) resumes the
    same epoch order at world 1 (positions 400.. in order) and at world 4 (the same samples, split
    over the ranks)."""
    client = gpufeed.Client(daemon.socket)
    whole, _ = collect(client.open_stream("toy", batch_size=50, shuffle="full", seed=9))
    streams = [client.open_stream("toy", batch_size=50, shuffle="full", seed=9, rank=r,
                                  world_size=2)
               for r in range(2)]
    before = []
    for stream in streams:
        for _ in range(4):
            with next(stream) as batch:
                before.append(rows(batch, "ids")[:, 0].copy())
    state = streams[0].state_dict()
    assert state["cursor"] == 4 * 2 * 50 and state["shuffle"] == "full" and state["seed"] == 9
    for stream in streams:
        stream.close()
    assert set(np.concatenate(before).tolist()) == set(whole[:400].tolist())
    resumed, _ = collect(client.open_stream("toy", batch_size=50, state=state))
    np.testing.assert_array_equal(resumed, whole[400:])
    after = [collect(client.open_stream("toy", batch_size=50, rank=r, world_size=4, state=state))[0]
             for r in range(4)]
    served = np.concatenate(after)
    assert len(served) == 600 and set(served.tolist()) == set(whole[400:].tolist())


def test_a_resume_state_does_not_override_explicit_arguments(daemon):
    """A resume state silently overrode explicit arguments: open_stream('ds1', state=<checkpoint of
    toy>) streamed toy, and shuffle="full", seed=7 with a state in dataset order, seed 0, streamed in
    dataset order. A mismatch is a ValueError naming the field and both values; arguments left unset,
    or given the state's values, resume."""
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=50)
    with next(stream):
        pass
    state = stream.state_dict()
    stream.close()
    assert state["dataset"] == "toy" and state["shuffle"] == "none" and state["seed"] == 0
    cases = [
        (dict(), "ds1", ("dataset 'ds1'", "dataset 'toy'")),
        (dict(shuffle="full", seed=7), "toy", ("seed 7", "seed 0")),
        (dict(shuffle="full"), "toy", ("shuffle full", "shuffle none")),
        (dict(epoch=3), "toy", ("epoch 3", "epoch 0")),
    ]
    for arguments, dataset, named in cases:
        with pytest.raises(ValueError) as raised:
            client.open_stream(dataset, batch_size=50, state=state, **arguments)
        assert all(part in str(raised.value) for part in named), (arguments, str(raised.value))
    resumed, _ = collect(client.open_stream("toy", batch_size=50, shuffle="none", seed=0, epoch=0,
                                            state=state))
    np.testing.assert_array_equal(resumed, np.arange(50, 1000))
    # The state's own non-default values pass too.
    shuffled = client.open_stream("toy", batch_size=50, shuffle="window", window_shards=2, seed=3)
    with next(shuffled):
        pass
    window_state = shuffled.state_dict()
    shuffled.close()
    with pytest.raises(ValueError) as raised:
        client.open_stream("toy", batch_size=50, shuffle="none", state=window_state)
    assert "shuffle none" in str(raised.value) and "window (2 shards)" in str(raised.value)
    resumed, _ = collect(client.open_stream("toy", batch_size=50, shuffle="window", window_shards=2,
                                            seed=3, state=window_state))
    assert len(resumed) == 950


def test_errors_carry_the_daemons_codes(daemon, tmp_path):
    with pytest.raises(gpufeed.ConnectError):
        gpufeed.Client(str(tmp_path / "no-such.sock"))
    client = gpufeed.Client(daemon.socket)
    with pytest.raises(gpufeed.DaemonError) as raised:
        client.open_stream("no-such-dataset", batch_size=10)
    assert raised.value.code == "UnknownDataset"
    with pytest.raises(gpufeed.InvalidSpecError):
        client.open_stream("toy", batch_size=10, rank=2, world_size=2)
    with pytest.raises(ValueError):
        client.open_stream("toy", batch_size=10, shuffle="sideways")
    with pytest.raises(gpufeed.DaemonError) as raised:
        client.open_stream("toy", batch_size=10, fields=["nope"])
    assert raised.value.code == "BadRequest"


def test_a_slot_is_released_when_the_last_exported_array_goes(daemon, source):
    """Holding an array exported through DLPack keeps its slot (its data stays valid after the batch
    object is gone): with every slot kept so, the stream cannot go on; dropping one array lets it."""
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=10, prefetch=1, fields=["ids"])
    slots = stream.slot_count
    kept = []
    for _ in range(slots):
        batch = next(stream)
        kept.append(np.from_dlpack(batch["ids"]))
        del batch
    with pytest.raises(gpufeed.AllSlotsHeldError):
        next(stream)
    np.testing.assert_array_equal(kept[0], source["ids"][:10])
    del kept[0]
    batch = next(stream)
    start = 10 * slots
    np.testing.assert_array_equal(rows(batch, "ids"), source["ids"][start:start + 10])
    del kept
    field = batch["ids"]
    batch.release()
    with pytest.raises(BufferError):
        field.__dlpack__()
    with pytest.raises(ValueError):
        batch["ids"]


def test_holding_every_slot_raises_instead_of_waiting_forever(daemon, source):
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=10, prefetch=2, fields=["ids"])
    # Slot rings are sized in bytes: at least `prefetch` slots, more for small batches (at most
    # 64, and no more than the stream's 100 steps).
    slots = stream.slot_count
    assert 2 <= slots <= 64
    views = [np.from_dlpack(next(stream)["ids"]) for _ in range(slots)]
    with pytest.raises(gpufeed.AllSlotsHeldError):
        next(stream)
    views.pop(0)
    batch = next(stream)
    start = 10 * slots
    np.testing.assert_array_equal(rows(batch, "ids"), source["ids"][start:start + 10])


def wait_for(condition, what):
    """Polls the daemon's status until `condition` holds (a session's end is noticed by the daemon's
    session thread, asynchronously to the consumer's death); bounded."""
    for _ in range(500):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_consumer_leaks_no_slot(daemon):
    script = textwrap.dedent(f"""
        import sys, gpufeed, numpy as np
        stream = gpufeed.Client({daemon.socket!r}).open_stream("toy", batch_size=100, prefetch=3)
        held = [next(stream) for _ in range(3)]
        arrays = [np.from_dlpack(b["ids"]) for b in held]
        print("holding", flush=True)
        sys.stdin.read()
    """)
    pools = lambda: daemon.status()["pools"]
    before = (pools()["sessions"], pools()["slots_allocated"])
    for _ in range(5):
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "holding"
        assert daemon.status()["pools"]["slots_allocated"] >= 3
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    wait_for(lambda: (pools()["sessions"], pools()["slots_allocated"]) == before,
             "the killed sessions' slots to be freed")
    client = gpufeed.Client(daemon.socket)
    ids, _ = collect(client.open_stream("toy", batch_size=100, prefetch=3))
    np.testing.assert_array_equal(ids, np.arange(1000))


def test_keep_thread_off_interrupt_cpus_takes_a_cuda_device_only():
    with pytest.raises(ValueError, match="CUDA device"):
        gpufeed.keep_thread_off_interrupt_cpus("cpu")
    with pytest.raises(ValueError, match="not cpu, cuda or cuda:N"):
        gpufeed.keep_thread_off_interrupt_cpus("gpu7")
    try:
        kept = gpufeed.keep_thread_off_interrupt_cpus("cuda:0")
    except gpufeed.CudaError as error:
        # No NVIDIA driver here: a clear error, not a crash.
        assert "libcuda" in str(error) or "cu" in str(error)
    else:
        assert kept is None or (kept and all(isinstance(cpu, int) for cpu in kept))
