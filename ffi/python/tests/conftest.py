"""Fixtures: the gpufeed binary, datasets packed from NumPy arrays, and a daemon on the CPU backend
(or on a GPU when GPUFEED_TEST_DEVICE says so), started and stopped per test module."""

import json
import os
import pathlib
import signal
import subprocess
import urllib.request

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def gpufeed_bin() -> str:
    explicit = os.environ.get("GPUFEED_BIN")
    if explicit:
        return explicit
    built = REPO / "target" / "debug" / "gpufeed"
    if not built.exists():
        subprocess.run(["cargo", "build", "--bin", "gpufeed"], cwd=REPO, check=True)
    return str(built)


SAMPLES = 1000
WIDTH = 24


def source_arrays():
    """The dataset's fields: `emb` (f16, [SAMPLES, WIDTH]) and `ids` (i32, [SAMPLES, 2]); the
    sample index is ids[:, 0], so that any order can be checked against the source."""
    rng = np.random.default_rng(7)
    emb = rng.standard_normal((SAMPLES, WIDTH)).astype(np.float16)
    ids = np.stack([np.arange(SAMPLES, dtype=np.int32), rng.integers(0, 1 << 30, SAMPLES, dtype=np.int32)], axis=1)
    return {"emb": emb, "ids": ids}


class Daemon:
    def __init__(self, root: pathlib.Path, device: str):
        self.root = root
        self.socket = str(root / "gpufeed.sock")
        self.process = subprocess.Popen(
            [gpufeed_bin(), "serve", "--data-root", str(root / "data"), "--socket", self.socket,
             "--device", device, "--http", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=open(root / "daemon.log", "wb"), text=True,
        )
        first = self.process.stdout.readline()
        assert first.startswith("gpufeed: serving"), f"daemon said {first!r}: {self.log()}"
        second = self.process.stdout.readline().strip()
        assert second.startswith("gpufeed: http on "), f"daemon said {second!r}: {self.log()}"
        self.http = second.removeprefix("gpufeed: http on ")

    def log(self) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://{self.http}/v1/status", timeout=10) as reply:
            return json.load(reply)

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def source():
    return source_arrays()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, source):
    root = tmp_path_factory.mktemp("gpufeed")
    (root / "data").mkdir()
    inputs = []
    for name, array in source.items():
        path = root / f"{name}.npy"
        np.save(path, array)
        inputs += ["--field", f"{name}={path}"]
    # Four shards of 250 samples, raw blocks, so that window shuffles have windows to shuffle.
    subprocess.run(
        [gpufeed_bin(), "pack", "--out", str(root / "data" / "toy"), "--codec", "raw",
         "--samples-per-shard", "250", *inputs],
        check=True, capture_output=True,
    )
    daemon = Daemon(root, os.environ.get("GPUFEED_TEST_DEVICE", "cpu"))
    yield daemon
    daemon.stop()
