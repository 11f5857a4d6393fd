"""The training benchmark's feeders (examples/python/train_bench.py), on the CPU: the ideal feeder and
the DataLoader feeder serve the same batches (as sets of rows) in every epoch, so that their step times
compare like with like; the gpufeed feeder serves every sample once per epoch across epochs; a short
run records every (model, feeder, run) and the summary compares each feeder with the ideal one.
The parts that need torch skip loudly where it is not installed, unless GPUFEED_REQUIRE_TORCH=1."""

import importlib.util
import json
import os

import numpy as np
import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("train_bench", REPO / "examples" / "python" / "train_bench.py")
train_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_bench)


# Checked before the fixtures start a daemon.
needs_torch = pytest.mark.skipif(
    os.environ.get("GPUFEED_REQUIRE_TORCH") != "1" and importlib.util.find_spec("torch") is None,
    reason="torch is not installed here")


def need_torch():
    import torch
    return torch


def test_epoch_orders_are_permutations_drawn_per_epoch():
    first = train_bench.epoch_order(1000, 64, epoch=0)
    assert first.shape == (15, 64)
    # Whole batches of distinct rows; the 40 rows of the tail are left out.
    assert len(np.unique(first)) == 960
    np.testing.assert_array_equal(first, train_bench.epoch_order(1000, 64, epoch=0))
    second = train_bench.epoch_order(1000, 64, epoch=1)
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, train_bench.epoch_order(1000, 64, epoch=0, seed=1))


def test_steps_and_feeders_parse_and_refuse_unknown_names():
    assert train_bench.parse_steps("tiny=5,large=7") == {"tiny": 5, "medium": 200, "large": 7}
    assert train_bench.parse_steps("9") == {"tiny": 9, "medium": 9, "large": 9}
    with pytest.raises(Exception, match="unknown model"):
        train_bench.parse_steps("huge=3")
    with pytest.raises(SystemExit):
        train_bench.main(["run", "--npy", "x.npy", "--feeders", "ideal,nope"])


@pytest.fixture(scope="module")
def rows_npy(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "rows.npy"
    train_bench.make_rows(str(path), 1000, seed=3)
    return path


def test_made_rows_are_fp16_and_never_zero(rows_npy):
    rows = np.load(rows_npy)
    assert rows.shape == (1000, train_bench.ROW) and rows.dtype == np.float16
    assert 0.015 < float(rows.astype(np.float32).std()) < 0.025


@needs_torch
@pytest.mark.parametrize("workers", [0, 2])
def test_ideal_and_dataloader_feeders_serve_the_same_batches(rows_npy, workers):
    torch = need_torch()
    source = np.load(rows_npy)
    ideal = train_bench.ideal_batches(torch.from_numpy(source), 64, seed=5, epochs_ahead=1)
    loader = train_bench.dataloader_batches(str(rows_npy), 64, workers, "cpu", seed=5,
                                            with_indices=True)
    # Two epochs and a bit (15 batches each): the second epoch's order is drawn when it starts.
    for step in range(32):
        a = next(ideal)
        indices, b = next(loader)
        assert a.dtype == b.dtype == torch.float32
        # The same rows: the DataLoader reads them sorted (file order), the ideal one as drawn.
        order = np.argsort(train_bench.epoch_order(1000, 64, step // 15, seed=5)[step % 15])
        np.testing.assert_array_equal(a.numpy()[order], b.numpy(), err_msg=f"step {step}")
        np.testing.assert_array_equal(b.numpy(), source[indices.numpy()].astype(np.float32))


@needs_torch
def test_gpufeed_feeder_serves_every_sample_once_per_epoch(daemon, source):
    need_torch()
    batches = train_bench.gpufeed_batches(daemon.socket, "toy", "emb", 50, "cpu", seed=2)
    index = {row.tobytes(): i for i, row in enumerate(source["emb"].astype(np.float32))}
    epochs = []
    for _ in range(3):
        seen = [index[row.tobytes()] for _ in range(20) for row in next(batches).numpy()]
        epochs.append(seen)
        assert sorted(seen) == list(range(1000))
    # A full shuffle: another order each epoch.
    assert epochs[0] != epochs[1] != epochs[2]
    batches.close()


@needs_torch
def test_a_short_run_records_every_run_and_the_summary_compares_with_the_ideal(rows_npy, tmp_path):
    need_torch()
    jsonl = tmp_path / "train.jsonl"
    code = train_bench.main(["run", "--npy", str(rows_npy), "--feeders", "ideal,dataloader",
                             "--models", "tiny,medium", "--steps", "3", "--warmup", "1", "--runs",
                             "2", "--workers", "0,2", "--batch-size", "64", "--device", "cpu",
                             "--jsonl", str(jsonl)])
    assert code == 0
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    runs = {(r["model"], r["feeder"], r.get("workers"), r["run"]) for r in records}
    assert runs == {(m, f, w, r) for m in ("tiny", "medium") for r in (1, 2)
                    for f, w in (("ideal", None), ("dataloader", 0), ("dataloader", 2))}
    assert all(r["step_ms"] > 0 and r["steps"] == 3 for r in records)
    table = train_bench.summarize(records)
    ideal = [line for line in table if line.startswith("| tiny | ideal |")]
    assert len(ideal) == 1 and "| 1.000 |" in ideal[0]
    assert any(line.startswith("| medium | dataloader (") for line in table)
    assert any(line.startswith("tiny: DataLoader step ms by workers: 0: ") for line in table)
