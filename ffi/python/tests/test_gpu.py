"""Device batches (run on a CUDA machine with GPUFEED_TEST_DEVICE=cuda:0; skipped elsewhere):
torch and CuPy read them through DLPack bit-exact against the source, and a consumer stream that
sleeps before reading keeps its slot from being rewritten under it."""

import os

import numpy as np
import pytest

import gpufeed

DEVICE = os.environ.get("GPUFEED_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(not DEVICE.startswith("cuda"),
                                reason="device batches need GPUFEED_TEST_DEVICE=cuda:N")


def test_torch_and_cupy_read_device_batches_bit_exact(daemon, source):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=100, device=DEVICE,
                                fields={"ids": None, "emb": "f32"})
    assert stream.device == DEVICE
    for step, batch in enumerate(stream):
        rows = slice(step * 100, step * 100 + 100)
        emb = torch.from_dlpack(batch["emb"])
        assert emb.device.type == "cuda" and emb.dtype == torch.float32
        expected = source["emb"][rows].astype(np.float32)
        assert emb.cpu().numpy().tobytes() == expected.tobytes()
        ids = cupy.from_dlpack(batch["ids"])
        assert cupy.asnumpy(ids).tobytes() == source["ids"][rows].tobytes()
        via_cai = cupy.asarray(batch["ids"])
        assert cupy.asnumpy(via_cai).tobytes() == source["ids"][rows].tobytes()


def test_a_sleeping_consumer_stream_keeps_its_slot(daemon, source):
    """One slot: the daemon refills it for the next batch only after the release event, which
    follows the consumer stream's sleep and copy. Were the slot released at once, the copy would see
    the next batch's rows."""
    torch = pytest.importorskip("torch")
    client = gpufeed.Client(daemon.socket)
    stream = client.open_stream("toy", batch_size=100, device=DEVICE, prefetch=1,
                                fields={"emb": "f32"})
    consumer = torch.cuda.Stream(device=DEVICE)
    copies = []
    with torch.cuda.stream(consumer):
        for step in range(3):
            batch = next(stream)
            emb = torch.from_dlpack(batch["emb"])  # waits for the batch on `consumer`
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before reading
            copies.append(emb.clone())
            del emb, batch  # released after the sleep and the clone, on the device
    consumer.synchronize()
    for step, copy in enumerate(copies):
        expected = source["emb"][step * 100:(step + 1) * 100].astype(np.float32)
        assert copy.cpu().numpy().tobytes() == expected.tobytes(), f"step {step} was overwritten"


def test_the_torch_dataset_yields_tensors_on_the_ranks_gpu(daemon, source):
    torch = pytest.importorskip("torch")
    from gpufeed.torch import GpufeedDataset

    dataset = GpufeedDataset(daemon.socket, "toy", 100, fields={"emb": "f32", "ids": None},
                             rank=0, world_size=1, device=DEVICE)
    seen = []
    for step, batch in enumerate(dataset):
        assert batch["emb"].device == torch.device(DEVICE)
        seen.append(batch["ids"][:, 0].cpu())
        if step == 3:
            state = dataset.state_dict()
            break
    resumed = GpufeedDataset(daemon.socket, "toy", 100, rank=0, world_size=1, device=DEVICE)
    resumed.load_state_dict(state)
    rest = [b["ids"][:, 0].cpu() for b in resumed]
    served = torch.cat(seen + rest).numpy()
    np.testing.assert_array_equal(served, np.arange(1000))


def test_the_status_says_whether_the_daemon_runs_under_mps(daemon):
    """The daemon's /v1/status `mps` block against how this run was started: under an MPS control
    daemon (GPU_UNDER_MPS=1, scripts/gpu-python.sh starts it with its own pipe directory before the
    daemon) the driver reports the daemon an MPS client and the control daemon is found; otherwise
    the driver reports no client (SM-count execution affinity is offered to MPS clients only) and
    the block is not active."""
    mps = daemon.status()["mps"]
    devices = daemon.status()["platform"]["devices"]
    assert devices and all(d["mps_client"] is not None for d in devices), devices
    if os.environ.get("GPU_UNDER_MPS") == "1":
        assert mps["active"] is True and mps["client"] is True, mps
        assert mps["control_daemon_pid"] is not None, mps
        assert mps["pipe_directory"] == os.environ["CUDA_MPS_PIPE_DIRECTORY"], mps
    else:
        assert mps["active"] is False and mps["client"] is False, mps


@pytest.fixture(scope="module")
def mixture_daemons(tmp_path_factory):
    """Two datasets (`web` and `code`, as in test_mixture) served by a daemon on the test device
    and by a CPU one."""
    from conftest import Daemon
    from test_mixture import pack

    root = tmp_path_factory.mktemp("gpufeed-gpu-mixture")
    (root / "data").mkdir()
    pack(root, "web", 0, 700)
    pack(root, "code", 1, 300)
    cpu_root = tmp_path_factory.mktemp("gpufeed-cpu-mixture")
    import shutil
    shutil.copytree(root / "data", cpu_root / "data")
    gpu, cpu = Daemon(root, DEVICE), Daemon(cpu_root, "cpu")
    yield gpu, cpu
    gpu.stop()
    cpu.stop()


def test_the_torch_dataset_serves_a_mixture_on_the_gpu_as_the_cpu_backend(mixture_daemons):
    """gpufeed.torch.GpufeedDataset over a mixture's sources with no device given: tensors on the
    GPU (where torch sees one), batches assembled on the host and uploaded, equal row for row to
    the CPU backend's over two epochs of a full shuffle."""
    torch = pytest.importorskip("torch")
    from gpufeed.torch import GpufeedDataset

    gpu, cpu = mixture_daemons
    sources = [("web", 0.7), ("code", 0.3)]

    def epochs(socket, device):
        dataset = GpufeedDataset(socket, sources, 64, fields={"id": None, "emb": "f32"},
                                 shuffle="full", seed=4, rank=0, world_size=1, device=device)
        served = []
        for epoch in range(2):
            dataset.set_epoch(epoch)
            for batch in dataset:
                served.append({name: tensor.cpu().numpy().copy() for name, tensor in batch.items()})
                devices = {tensor.device.type for tensor in batch.values()}
                assert devices == ({"cuda"} if device is None else {"cpu"}), devices
        dataset.close()
        return served

    on_gpu = epochs(gpu.socket, None)
    on_cpu = epochs(cpu.socket, "cpu")
    assert len(on_gpu) == len(on_cpu) > 10
    for step, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        for name in ("id", "emb"):
            assert g[name].tobytes() == c[name].tobytes(), f"batch {step}, field {name}"
