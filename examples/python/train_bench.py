"""Training-step benchmark: how much a data loader slows a real training loop down, against the same
loop fed from batches already in device memory.

Three models, each trained on fp16 rows of 1024 (2 KiB) converted to fp32 batches of 4096 in a full
shuffle:

- ``tiny``: one Linear(1024, 8) and a mean of squares, SGD: loader-bound (a few kernels per step);
- ``medium``: the MLP 1024 -> 4096 -> 4096 -> 1024, bf16 autocast, AdamW;
- ``large``: the MLP 1024 -> 8192 -> 8192 -> 8192 -> 1024, bf16 autocast, AdamW: compute-bound.

Feeders (``--feeders``, comma-separated; several run interleaved, run by run, in one process):

- ``ideal``: the whole .npy in device memory, each batch ``x[idx].float()`` with the same per-epoch
  permutation the DataLoader uses;
- ``gpufeed``: ``gpufeed.torch.GpufeedDataset`` (full shuffle, fp16 stored, fp32 delivered), epoch
  after epoch (the next epoch's stream opened ahead);
- ``dataloader``: a strong PyTorch DataLoader: a Dataset whose ``__getitems__`` takes a batch's
  indices (sorted, one fancy index of the memory-mapped .npy), pinned memory, ``.to(device,
  non_blocking=True).float()``; every worker count of ``--workers`` (the summary takes the best);
- ``dali``: NVIDIA DALI's numpy reader on the GPU, if ``nvidia.dali`` imports (else a ``skipped``
  record): batches of consecutive rows at shuffled offsets (the reader reads regions of one file; a
  per-row shuffle would need a file per row).

Each run takes ``--warmup`` steps untimed, then ``--steps`` steps timed between two device
synchronisations; ``--runs`` runs per (model, feeder); one JSON line per run in ``--jsonl``.
``--label-suffix=-mps`` names the feeders of a process started under CUDA MPS (scripts/gpu-train.sh
runs that). ``summary`` prints the table: median step time, samples/s, the ratio to the ideal feeder
(under MPS: to the ideal feeder under MPS) and the targets.

    python examples/python/train_bench.py make-data /tmp/rows.npy --rows 65536
    python examples/python/train_bench.py run --npy /tmp/rows.npy --feeders ideal,dataloader \\
        --jsonl /tmp/train.jsonl
    python examples/python/train_bench.py summary --jsonl /tmp/train.jsonl

This file imports torch only where it runs a model or a loader, so that its argument parsing, data
and orders can be used without it.
"""

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

ROW = 1024
MODELS = ("tiny", "medium", "large")
FEEDERS = ("ideal", "gpufeed", "dataloader", "dali")
# Timed steps per run by model: each run lasts about half a second to a second on an H100 with the
# ideal feeder (tiny ~0.2 ms a step, medium ~2.5 ms, large ~8 ms).
DEFAULT_STEPS = {"tiny": 600, "medium": 200, "large": 80}
# Step time of gpufeed over the ideal feeder's: at most this, without MPS and with it (issue targets).
TARGETS = {"gpufeed": 1.03, "gpufeed-mps": 1.01, "gpufeed-tier": 1.03}


# --- data and orders (NumPy only) ----------------------------------------------------------------

def make_rows(path: str, rows: int, seed: int = 0) -> None:
    """An .npy of ``rows`` fp16 rows of ``ROW`` values drawn from N(0, 0.02), like trained embedding
    rows (never zeros), written in chunks of 64 Ki rows."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(rows, ROW))
    chunk = 1 << 16
    for start in range(0, rows, chunk):
        end = min(start + chunk, rows)
        rng = np.random.default_rng(np.random.SeedSequence([seed, start // chunk]))
        values = rng.standard_normal((end - start, ROW), dtype=np.float32)
        values *= 0.02
        out[start:end] = values.astype(np.float16)
    out.flush()
    del out


def epoch_order(rows: int, batch_size: int, epoch: int, seed: int = 0) -> np.ndarray:
    """The ideal and DataLoader feeders' sample order of ``epoch``: a permutation of the rows drawn
    from (seed, epoch), cut to whole batches (the tail that does not fill one is dropped), shaped
    [batches, batch_size]."""
    perm = np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(rows)
    batches = rows // batch_size
    return perm[: batches * batch_size].reshape(batches, batch_size)


def parse_steps(text: str) -> Dict[str, int]:
    """``tiny=600,medium=200`` (models not named keep DEFAULT_STEPS); a bare number sets all."""
    steps = dict(DEFAULT_STEPS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            steps = {model: int(part) for model in MODELS}
            continue
        model, value = part.split("=", 1)
        if model not in MODELS:
            raise argparse.ArgumentTypeError(f"--steps: unknown model {model!r} (one of {MODELS})")
        steps[model] = int(value)
    if any(v <= 0 for v in steps.values()):
        raise argparse.ArgumentTypeError(f"--steps: every count must be positive: {text!r}")
    return steps


def name_list(allowed: Sequence[str], what: str):
    def parse(text: str) -> List[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{what}: {unknown or text!r} not among {list(allowed)}")
        return names
    return parse


def int_list(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part]


# --- models --------------------------------------------------------------------------------------

class Trainer:
    """One model, its optimizer and its training step (no host synchronisation inside a step)."""

    def __init__(self, name: str, device: str):
        import torch
        import torch.nn as nn

        torch.manual_seed(0)
        self.name = name
        self.device = torch.device(device)
        if name == "tiny":
            model = nn.Linear(ROW, 8)
            self.autocast = False
        elif name == "medium":
            model = nn.Sequential(nn.Linear(ROW, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                                  nn.Linear(4096, ROW))
            self.autocast = True
        elif name == "large":
            model = nn.Sequential(nn.Linear(ROW, 8192), nn.GELU(), nn.Linear(8192, 8192), nn.GELU(),
                                  nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, ROW))
            self.autocast = True
        else:
            raise ValueError(f"unknown model {name!r} (one of {MODELS})")
        self.model = model.to(self.device)
        if name == "tiny":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, x) -> None:
        import torch
        import torch.nn.functional as F

        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                            enabled=self.autocast):
            out = self.model(x)
        if self.name == "tiny":
            loss = out.float().square().mean()
        else:
            loss = F.mse_loss(out.float(), x)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


# --- feeders: each an endless iterator of fp32 [batch, ROW] batches on the device ---------------------

def ideal_batches(source, batch_size: int, seed: int = 0, epochs_ahead: int = 1) -> Iterator:
    """Batches gathered from ``source`` (the whole dataset, a tensor already on the device) in
    :func:`epoch_order`, converted to fp32: the cost of the gather and the conversion only. The
    orders of the first ``epochs_ahead`` epochs are drawn and put on the device here, before any
    timing (drawing one takes tens of milliseconds on the host, as long as hundreds of tiny steps);
    later epochs' when they start."""
    import torch

    rows = source.shape[0]

    def order(epoch):
        return torch.from_numpy(epoch_order(rows, batch_size, epoch, seed)).to(source.device)

    ahead = [order(epoch) for epoch in range(max(epochs_ahead, 1))]

    def batches():
        epoch = 0
        while True:
            for idx in (ahead[epoch] if epoch < len(ahead) else order(epoch)):
                yield source[idx].float()
            epoch += 1

    return batches()


def load_to_device(npy: str, device: str):
    """The whole .npy as one fp16 tensor on ``device``, copied in chunks of 256 MiB."""
    import torch

    mapped = np.load(npy, mmap_mode="r")
    out = torch.empty(mapped.shape, dtype=torch.float16, device=device)
    chunk = max(1, (256 << 20) // (mapped.shape[1] * 2))
    for start in range(0, mapped.shape[0], chunk):
        part = np.array(mapped[start:start + chunk])  # a writable copy for torch.from_numpy
        out[start:start + part.shape[0]].copy_(torch.from_numpy(part))
    return out


class MemmapRows:
    """Rows of a memory-mapped .npy fetched a batch at a time (the strong form of a map-style
    dataset): the DataLoader hands :meth:`__getitems__` a batch's indices, which it reads sorted (file
    order: fewer, more local page-cache reads; a batch is a set to SGD) with one fancy index of the
    mapping. Returns (the indices in the rows' order, the rows)."""

    def __init__(self, npy: str):
        self.npy = npy
        self.rows = int(np.load(npy, mmap_mode="r").shape[0])
        self.array = None  # opened in each worker: a memmap would be pickled as a copy

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int):
        return self.__getitems__([index])

    def __getitems__(self, indices):
        import torch

        if self.array is None:
            self.array = np.load(self.npy, mmap_mode="r")
        order = np.sort(np.asarray(indices, dtype=np.int64))
        return torch.from_numpy(order), torch.from_numpy(np.asarray(self.array[order]))


class EpochOrderSampler:
    """Yields :func:`epoch_order`'s indices of the current epoch (whole batches only); the caller
    moves it to the next epoch with :meth:`set_epoch`."""

    def __init__(self, rows: int, batch_size: int, seed: int = 0):
        self.rows, self.batch_size, self.seed, self.epoch = rows, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.rows // self.batch_size) * self.batch_size

    def __iter__(self):
        return iter(epoch_order(self.rows, self.batch_size, self.epoch, self.seed).reshape(-1).tolist())


def already_collated(batch):
    """The collate function of a dataset whose ``__getitems__`` returns whole batches (module level,
    so that worker processes can unpickle it)."""
    return batch


def dataloader_batches(npy: str, batch_size: int, workers: int, device: str, seed: int = 0,
                       with_indices: bool = False) -> Iterator:
    """A PyTorch DataLoader over :class:`MemmapRows` in :func:`epoch_order` (persistent workers,
    pinned memory on a GPU, prefetch factor 2), epoch after epoch; each batch moved to ``device``
    and converted to fp32. ``with_indices``: yields (indices, batch)."""
    import torch
    import torch.utils.data

    dataset = MemmapRows(npy)
    sampler = EpochOrderSampler(len(dataset), batch_size, seed)
    on_gpu = device.startswith("cuda")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, drop_last=True, sampler=sampler,
        collate_fn=already_collated, num_workers=workers, pin_memory=on_gpu,
        prefetch_factor=2 if workers > 0 else None, persistent_workers=workers > 0)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for indices, rows in loader:
            batch = rows.to(device, non_blocking=True).float()
            yield (indices, batch) if with_indices else batch
        epoch += 1


def gpufeed_batches(socket: Optional[str], dataset: str, field: str, batch_size: int, device: str,
                    seed: int = 0, prefetch: int = 4) -> Iterator:
    """``gpufeed.torch.GpufeedDataset`` in a full shuffle, the field converted to fp32 by the daemon,
    epoch after epoch (each iteration serves the next epoch; its stream was opened ahead)."""
    from gpufeed.torch import GpufeedDataset

    data = GpufeedDataset(socket, dataset, batch_size, fields={field: "f32"}, shuffle="full",
                          seed=seed, device=device, prefetch=prefetch, rank=0, world_size=1)
    try:
        while True:
            for batch in data:
                yield batch[field]
    finally:
        data.close()


def dali_batches(npy: str, batch_size: int, device: str, seed: int = 0) -> Iterator:
    """NVIDIA DALI's numpy reader on the GPU: each batch ``batch_size`` consecutive rows of the .npy
    (a region of interest of the one file) at a batch-aligned offset, the offsets in a shuffled
    order per epoch; cast to fp32 by DALI and copied into a torch tensor."""
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    rows = int(np.load(npy, mmap_mode="r").shape[0])
    batches = rows // batch_size
    ordinal = torch.device(device).index or 0

    def starts():
        epoch = 0
        while True:
            for b in np.random.default_rng([seed, epoch]).permutation(batches):
                yield [np.array([b * batch_size, 0], dtype=np.int32)]
            epoch += 1

    offsets = starts()

    @pipeline_def(batch_size=1, num_threads=4, device_id=ordinal, prefetch_queue_depth=2)
    def pipe():
        start = fn.external_source(source=lambda: next(offsets), batch=True)
        data = fn.readers.numpy(device="gpu", file_root=os.path.dirname(os.path.abspath(npy)),
                                files=[os.path.basename(npy)], roi_start=start,
                                roi_shape=[batch_size, ROW], dtype=types.FLOAT16)
        return fn.cast(data, dtype=types.FLOAT)

    built = pipe()
    built.build()
    stream = torch.cuda.current_stream(torch.device(device))
    while True:
        (out,) = built.run()
        batch = torch.empty((batch_size, ROW), dtype=torch.float32, device=device)
        feed_ndarray(out.as_tensor(), batch, cuda_stream=stream)
        yield batch


# --- runs ----------------------------------------------------------------------------------------

def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def timed_run(trainer: Trainer, batches: Iterator, warmup: int, steps: int, device: str) -> float:
    """``warmup`` untimed steps, then the seconds of ``steps`` steps, from a synchronised device to
    the last step's end on the device."""
    for _ in range(warmup):
        trainer.step(next(batches))
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.step(next(batches))
    synchronize(device)
    return time.perf_counter() - started


def emit(record: dict, jsonl: Optional[str]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if jsonl:
        with open(jsonl, "a") as out:
            out.write(line + "\n")


def run(args) -> int:
    import torch

    device = args.device
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(device))
        torch.zeros((), device=device)  # the context first, as a training process has it
    rows = int(np.load(args.npy, mmap_mode="r").shape[0])
    common = {
        "batch_size": args.batch_size, "rows": rows, "row_bytes_in": ROW * 2, "warmup": args.warmup,
        "device": torch.cuda.get_device_name(torch.device(device)) if on_gpu else "cpu",
        "torch": torch.__version__, "mps_env": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    suffix = args.label_suffix
    # Feeder name -> list of (label, extra record fields, endless batch iterator).
    sources: Dict[str, list] = {}
    failures = 0
    for feeder in args.feeders:
        try:
            if feeder == "ideal":
                source = load_to_device(args.npy, device)
                # Every epoch the runs reach, drawn before the first is timed.
                total = sum(args.runs * (args.warmup + args.steps[m]) for m in args.models)
                epochs = total // max(rows // args.batch_size, 1) + 1
                sources[feeder] = [("ideal" + suffix, {"order": "full shuffle (epoch_order)"},
                                    ideal_batches(source, args.batch_size, args.seed, epochs))]
            elif feeder == "gpufeed":
                sources[feeder] = [("gpufeed" + suffix, {"order": "full shuffle (daemon's)",
                                                         "prefetch": args.prefetch},
                                    gpufeed_batches(args.socket, args.dataset, args.field,
                                                    args.batch_size, device, args.seed,
                                                    args.prefetch))]
            elif feeder == "dataloader":
                sources[feeder] = [
                    ("dataloader" + suffix, {"workers": w, "order": "full shuffle (epoch_order)",
                                             "pin_memory": on_gpu},
                     dataloader_batches(args.npy, args.batch_size, w, device, args.seed))
                    for w in args.workers]
            elif feeder == "dali":
                try:
                    import nvidia.dali  # noqa: F401
                except ImportError as error:
                    reason = f"DALI not installed (nvidia.dali cannot be imported: {error})"
                    print(f"skipped: dali{suffix}: {reason}", flush=True)
                    emit({"feeder": "dali" + suffix, **common, "skipped": reason}, args.jsonl)
                    continue
                sources[feeder] = [("dali" + suffix, {"order": "consecutive rows at shuffled "
                                                               "batch offsets (numpy reader ROI)"},
                                    dali_batches(args.npy, args.batch_size, device, args.seed))]
        except Exception as error:  # noqa: BLE001 - a feeder that cannot start is recorded, not fatal
            emit({"feeder": feeder + suffix, **common, "error": f"start: {error!r}"[:500]}, args.jsonl)
            failures += 1
    for model in args.models:
        trainer = Trainer(model, device)
        steps = args.steps[model]
        for run_index in range(1, args.runs + 1):
            # Interleaved: every feeder's run r before any feeder's run r + 1.
            for feeder, variants in list(sources.items()):
                for label, extra, batches in list(variants):
                    record = {"model": model, "feeder": label, "run": run_index, "steps": steps,
                              **common, **extra}
                    try:
                        seconds = timed_run(trainer, batches, args.warmup, steps, device)
                    except Exception as error:  # noqa: BLE001 - recorded; the other feeders go on
                        record["error"] = repr(error)[:500]
                        emit(record, args.jsonl)
                        variants.remove((label, extra, batches))
                        failures += 1
                        continue
                    record.update({
                        "seconds": seconds, "step_ms": seconds / steps * 1e3,
                        "samples_per_s": steps * args.batch_size / seconds,
                        "gb_per_s_in": steps * args.batch_size * ROW * 2 / seconds / 1e9,
                    })
                    emit(record, args.jsonl)
        del trainer
    # Each feeder's end: gpufeed's streams closed, the DataLoaders' workers shut down.
    for variants in sources.values():
        for _, _, batches in variants:
            batches.close()
    return 1 if failures else 0


# --- summary -------------------------------------------------------------------------------------

def summarize(rows: List[dict]) -> List[str]:
    """The summary table's lines (Markdown): per (model, feeder) the median step time and samples/s
    over the runs, the ratio to the ideal feeder of the same mode (MPS or not) and the target; for
    the DataLoader, the best worker count. Then the reference lines: the pipeline alone (a ``consume``
    record), MPS detection, skipped feeders and failures."""
    lines = []
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        if "model" in r and "step_ms" in r:
            key = (r["model"], r["feeder"], r.get("workers"))
            groups.setdefault(key, []).append(r)
    medians = {key: (statistics.median(x["step_ms"] for x in rs),
                     statistics.median(x["samples_per_s"] for x in rs), len(rs))
               for key, rs in groups.items()}
    # The DataLoader: its best worker count per (model, feeder).
    best: Dict[tuple, tuple] = {}
    for (model, feeder, workers), value in medians.items():
        if workers is None:
            best[(model, feeder)] = (None, value)
        elif (model, feeder) not in best or value[0] < best[(model, feeder)][1][0]:
            best[(model, feeder)] = (workers, value)
    runs = {r["model"]: (r["steps"], r["warmup"]) for r in rows if "model" in r and "steps" in r}
    lines.append("| model | feeder | runs | step ms (median) | samples/s (median) | x ideal | target |")
    lines.append("|---|---|---|---|---|---|---|")
    order = {m: i for i, m in enumerate(MODELS)}
    feeder_order = {f: i for i, f in enumerate(
        ("ideal", "gpufeed", "ideal-mps", "gpufeed-mps", "dataloader", "dali"))}
    for (model, feeder), (workers, (step_ms, rate, count)) in sorted(
            best.items(), key=lambda kv: (order.get(kv[0][0], 9), feeder_order.get(kv[0][1], 9),
                                          kv[0][1])):
        # The ideal feeder of the same variant (its label suffix: "-mps", a daemon variant's).
        suffix = feeder[len("gpufeed"):] if feeder.startswith("gpufeed") else ""
        ideal_name = "ideal" + suffix
        ideal = best.get((model, ideal_name)) or best.get((model, "ideal"))
        ratio = step_ms / ideal[1][0] if ideal else float("nan")
        target = TARGETS.get(feeder)
        verdict = ""
        if target is not None:
            verdict = f"<= {target:.2f}x: {'met' if ratio <= target else 'MISSED'}"
        name = f"{feeder} ({workers} workers)" if workers is not None else feeder
        lines.append(f"| {model} | {name} | {count} | {step_ms:.3f} | {rate:,.0f} | {ratio:.3f} | {verdict} |")
    for model in sorted({k[0] for k in medians}, key=lambda m: order.get(m, 9)):
        counts = sorted((k[2], v[0]) for k, v in medians.items()
                        if k[0] == model and k[2] is not None)
        if len(counts) > 1:
            lines.append(f"{model}: DataLoader step ms by workers: " + ", ".join(
                f"{w}: {ms:.3f}" for w, ms in counts))
    if runs:
        lines.append("run length: " + ", ".join(
            f"{m} {s} timed steps after {w} warm-up steps" for m, (s, w) in sorted(
                runs.items(), key=lambda kv: order.get(kv[0], 9))) + " per run")
    for r in rows:
        if r.get("loader") == "consume" and r.get("batches"):
            alone_ms = r["seconds"] / r["batches"] * 1e3
            tiny = best.get(("tiny", "gpufeed"))
            line = f"pipeline alone (consume, {r['batches']} batches): {alone_ms:.3f} ms per batch"
            if tiny:
                share = alone_ms / tiny[1][0]
                line += (f"; tiny model on gpufeed runs at {share:.2f}x that rate (target >= 0.90: "
                         f"{'met' if share >= 0.9 else 'MISSED'})")
            lines.append(line)
        elif "mps_status" in r:
            m = r["mps_status"] or {}
            lines.append(f"/v1/status mps ({r.get('daemon')}): active={m.get('active')} "
                         f"client={m.get('client')} control_daemon_pid={m.get('control_daemon_pid')}")
        elif "skipped" in r:
            lines.append(f"skipped: {r.get('feeder')}: {r['skipped']}")
        elif "error" in r:
            lines.append(f"FAILED: {r.get('model', '')} {r.get('feeder', r.get('loader'))} "
                         f"run {r.get('run', '')}: {r['error'][:200]}")
    return lines


# --- command line --------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-data", help="an .npy of fp16 rows of 1024 (small sizes; the GPU "
                                            "script uses scripts/e2e/make_data.py)")
    make.add_argument("out")
    make.add_argument("--rows", type=int, default=1 << 16)
    make.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="train and time")
    r.add_argument("--npy", required=True, help="the fp16 [N, 1024] .npy (ideal, dataloader, dali)")
    r.add_argument("--feeders", type=name_list(FEEDERS, "--feeders"), default=["ideal"])
    r.add_argument("--models", type=name_list(MODELS, "--models"), default=list(MODELS))
    r.add_argument("--label-suffix", default="",
                   help="appended to the feeder names in the records (-mps under MPS)")
    r.add_argument("--socket", help="the daemon's socket (gpufeed; default $GPUFEED_SOCKET)")
    r.add_argument("--dataset", default="emb", help="the dataset packed from --npy (gpufeed)")
    r.add_argument("--field", default="data", help="its field (gpufeed)")
    r.add_argument("--prefetch", type=int, default=4, help="gpufeed's slots filled ahead")
    r.add_argument("--batch-size", type=int, default=4096)
    r.add_argument("--steps", type=parse_steps, default=dict(DEFAULT_STEPS),
                   help="timed steps per run: tiny=600,medium=200,large=80 (the default)")
    r.add_argument("--warmup", type=int, default=20, help="untimed steps before each run")
    r.add_argument("--runs", type=int, default=3)
    r.add_argument("--workers", type=int_list, default=[4, 8, 16],
                   help="DataLoader worker counts (each measured; the summary takes the best)")
    r.add_argument("--device", default="cuda:0")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--jsonl", help="append one JSON line per run here")
    s = sub.add_parser("summary", help="the table from a jsonl")
    s.add_argument("--jsonl", required=True)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "make-data":
        make_rows(args.out, args.rows, args.seed)
        return 0
    if args.command == "summary":
        with open(args.jsonl) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print("\n".join(summarize(rows)))
        return 0
    if args.runs < 1 or args.warmup < 0 or args.batch_size < 1:
        print("--runs must be at least 1, --warmup at least 0, --batch-size at least 1",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
