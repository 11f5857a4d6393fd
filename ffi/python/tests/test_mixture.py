"""Mixture streams from Python on the CPU backend: `open_stream(sources=[(name, weight), ...])`,
the realised proportions over an epoch, determinism for a seed, `state_dict` resume on another world
size, and sources whose fields disagree refused naming the source and the field."""

import subprocess

import numpy as np
import pytest

import gpufeed
from conftest import Daemon, gpufeed_bin

WEB = 2000
CODE = 500


def pack(root, name, source, samples, id_dtype=np.int32, extra=False):
    """A dataset whose `id` field is [source, index] for each sample."""
    ids = np.stack([np.full(samples, source), np.arange(samples)], axis=1).astype(id_dtype)
    emb = (np.arange(samples * 4, dtype=np.float32).reshape(samples, 4) + source * 100_000)
    emb = emb.astype(np.float32)  # f32 under every numpy's promotion rules
    inputs = []
    for field, array in [("id", ids), ("emb", emb)] + ([("flag", np.ones(samples, np.uint8))] if extra else []):
        path = root / f"{name}-{field}.npy"
        np.save(path, array)
        inputs += ["--field", f"{field}={path}"]
    subprocess.run(
        [gpufeed_bin(), "pack", "--out", str(root / "data" / name), "--samples-per-shard", "128", *inputs],
        check=True, capture_output=True,
    )


@pytest.fixture(scope="module")
def mixture_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpufeed-mixture")
    (root / "data").mkdir()
    pack(root, "web", 0, WEB)
    pack(root, "code", 1, CODE)
    pack(root, "wide", 2, 100, id_dtype=np.int64)
    pack(root, "extra", 3, 100, extra=True)
    daemon = Daemon(root, "cpu")
    yield daemon
    daemon.stop()


SOURCES = [("web", 0.7), ("code", 0.3)]


def rows(stream, limit=None):
    """(source, index) of every row of the stream's batches, each row's `emb` checked against it."""
    out = []
    for n, batch in enumerate(stream):
        with batch:
            ids = np.asarray(batch["id"]).copy()
            emb = np.asarray(batch["emb"]).copy()
        np.testing.assert_array_equal(emb[:, 0], ids[:, 1] * 4 + ids[:, 0] * 100_000)
        out += [tuple(r) for r in ids.tolist()]
        if limit is not None and n + 1 == limit:
            break
    return out


def test_an_epoch_follows_the_weights(mixture_daemon):
    with gpufeed.Client(mixture_daemon.socket) as client:
        stream = client.open_stream(batch_size=50, sources=SOURCES, shuffle="full", seed=3)
        assert stream.epoch_samples == WEB + CODE
        served = rows(stream)
    assert len(served) == WEB + CODE
    code = [i for s, i in served if s == 1]
    assert abs(len(code) / len(served) - 0.3) < 0.01
    # Code (500 samples) is drawn 750 times: each sample once, then a new epoch of it.
    assert sorted(code[:CODE]) == list(range(CODE))
    web = [i for s, i in served if s == 0]
    assert len(set(web)) == len(web)


def test_the_same_seed_gives_the_same_rows(mixture_daemon):
    with gpufeed.Client(mixture_daemon.socket) as client:
        once = rows(client.open_stream(batch_size=32, sources=SOURCES, shuffle="full", seed=5), 10)
    with gpufeed.Client(mixture_daemon.socket) as client:
        again = rows(client.open_stream(batch_size=32, sources=SOURCES, shuffle="full", seed=5), 10)
        other = rows(client.open_stream(batch_size=32, sources=SOURCES, shuffle="full", seed=6), 10)
    assert once == again
    assert once != other


def test_state_dict_resumes_on_another_world_size(mixture_daemon):
    with gpufeed.Client(mixture_daemon.socket) as client:
        expected = rows(client.open_stream(batch_size=60, sources=SOURCES, shuffle="full", seed=9))
        # 4 ranks of 15 for 8 steps, then 3 ranks of 20 from the checkpoint.
        first = []
        state = None
        per_rank = []
        for rank in range(4):
            stream = client.open_stream(batch_size=15, sources=SOURCES, shuffle="full", seed=9,
                                        rank=rank, world_size=4)
            per_rank.append(rows(stream, 8))
            state = stream.state_dict()
        for step in range(8):
            for served in per_rank:
                first += served[step * 15:(step + 1) * 15]
        assert state["cursor"] == 480
        assert state["sources"] == [("web", 0.7), ("code", 0.3)]
        per_rank = []
        for rank in range(3):
            stream = client.open_stream(batch_size=20, sources=SOURCES, rank=rank, world_size=3,
                                        state=state)
            per_rank.append(rows(stream))
        rest = []
        for step in range(len(per_rank[0]) // 20):
            for served in per_rank:
                rest += served[step * 20:(step + 1) * 20]
        assert first + rest == expected
        with pytest.raises(ValueError, match="mixture of web"):
            client.open_stream(batch_size=20, sources=[("web", 0.5), ("code", 0.5)], state=state)


def test_sources_whose_fields_disagree_are_refused(mixture_daemon):
    with gpufeed.Client(mixture_daemon.socket) as client:
        with pytest.raises(gpufeed.DaemonError, match="mixture source 'wide': field 'id'"):
            client.open_stream(batch_size=10, sources=[("web", 1), ("wide", 1)])
        with pytest.raises(gpufeed.DaemonError, match="mixture source 'extra' has field 'flag'"):
            client.open_stream(batch_size=10, sources=[("web", 1), ("extra", 1)])
        with pytest.raises(ValueError, match="not both"):
            client.open_stream("web", 10, sources=SOURCES)
        stream = client.open_stream(batch_size=10, sources=[("web", 1), ("extra", 1)], fields=["id", "emb"])
        assert len(rows(stream, 1)) == 10


def test_gpufeed_dataset_takes_a_mixture_and_resumes_it(mixture_daemon):
    """gpufeed.torch.GpufeedDataset with a mixture's sources for a dataset: host tensors (the
    daemon here serves host memory), len(), and a state_dict resumed on another world size."""
    pytest.importorskip("torch", reason="torch is not installed here")
    from gpufeed.torch import GpufeedDataset

    def make(**options):
        return GpufeedDataset(mixture_daemon.socket, SOURCES, 50, shuffle="full", seed=2,
                              fields=["id"], device="cpu", **options)

    whole = make(rank=0, world_size=1)
    assert whole.device == "cpu"
    assert len(whole) == (WEB + CODE) // 50
    order = [tuple(r) for b in whole for r in b["id"].numpy().tolist()]
    first = make(rank=0, world_size=1)
    it = iter(first)
    head = [tuple(r) for _ in range(4) for r in next(it)["id"].numpy().tolist()]
    state = first.state_dict()
    del it
    parts = []
    for rank in range(2):
        part = make(rank=rank, world_size=2)
        part.load_state_dict(state)
        parts.append([[tuple(r) for r in b["id"].numpy().tolist()] for b in part])
    rest = [row for pair in zip(*parts) for batch in pair for row in batch]
    assert head + rest == order[:len(head) + len(rest)]


def test_a_checkpoint_through_json_resumes_and_bad_sources_are_named(mixture_daemon):
    """A state_dict written as JSON (its pairs become lists) resumes the mixture; sources that are
    not (dataset, weight) pairs are refused naming the entry."""
    import json

    with gpufeed.Client(mixture_daemon.socket) as client:
        expected = rows(client.open_stream(batch_size=40, sources=SOURCES, seed=1, shuffle="full"), 6)
        stream = client.open_stream(batch_size=40, sources=SOURCES, seed=1, shuffle="full")
        head = rows(stream, 3)
        state = json.loads(json.dumps(stream.state_dict()))
        assert state["sources"] == [["web", 0.7], ["code", 0.3]]
        rest = rows(client.open_stream(batch_size=40, sources=[["web", 0.7], ["code", 0.3]],
                                       state=state), 3)
        assert head + rest == expected
        with pytest.raises(ValueError, match=r"sources\[1\] is not a \(dataset, weight\) pair"):
            client.open_stream(batch_size=40, sources=[("web", 0.7), "code"])
