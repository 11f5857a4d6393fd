"""Peers of gpufeed for the end-to-end benchmark: the same .npy data, in file order, into GPU batches.

    python3 scripts/e2e/peers.py torch  --file emb_fp16.npy --batch-sizes 256,1024,4096 --workers 4,8,12
    python3 scripts/e2e/peers.py kvikio --file emb_fp16.npy --batch-sizes 256,1024,4096 [--read-only]
    python3 scripts/e2e/peers.py dali   --file emb_fp16.npy --batch-sizes 256,1024,4096
    python3 scripts/e2e/peers.py register-copy --file emb_fp16.npy --batch-sizes 4096 --temperatures warm

Each prints one JSON line per measurement (and appends it to --jsonl): loader, kind, temperature,
batch_size, samples, bytes_in (bytes of the .npy payload read), bytes_out (bytes of the batches made on
the GPU), seconds, samples_per_s, gb_per_s_in, gb_per_s_out, host_cpu_seconds (user + system of this
process and its waited-for children, DataLoader workers included), cores (host_cpu_seconds / seconds)
and gpu_busy_pct (nvidia-smi utilization.gpu, mean over the run), and `verified` (the batches checked
against the source; the script exits 1 when one was not). Batches hold whole rows in file
order; a last partial batch is left out, as gpufeed's default tail policy does. fp16 becomes fp32 on
the GPU; int32 stays int32 (copied into an output batch). `seconds` runs from the loader's start (worker
start-up included, as gpufeed's includes opening the stream) to a device synchronize after the last
batch; except `torch --random` (a full shuffle, loader `torch-random`), which is timed over its
steady state: after a warm-up of `warmup_batches` (worker start-up and the batches prefetched
meanwhile, `warmup_seconds`), over --batches-max batches, with the CPU of this process and of its
live workers over that part. Its `verified` checks values: three timed batches against the source
rows they name, and that no index was drawn twice.

Temperatures: `cold` drops the page cache first (root: sync and /proc/sys/vm/drop_caches; otherwise
posix_fadvise on the file); `warm` reads the file once through the page cache first (once per cache
drop: warm runs in a row share the read). Before the first
measurement each process runs a few batches so that CUDA start-up and kernel compilation are not
timed.

These scripts exist only to compare against; they are no part of gpufeed.
"""
import argparse
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


class NpyLayout:
    """Where the payload of a C-ordered 2-D .npy file starts, and its rows."""

    def __init__(self, path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                shape, fortran_order, dtype = np.lib.format._read_array_header(f, version)
            self.offset = f.tell()
        if fortran_order or len(shape) != 2:
            raise SystemExit(f"{path}: expected a C-ordered 2-D array, got shape {shape}")
        self.path = path
        self.rows, self.row_values = shape
        self.dtype = np.dtype(dtype)
        self.row_bytes = self.row_values * self.dtype.itemsize
        expected = self.offset + self.rows * self.row_bytes
        if os.path.getsize(path) != expected:
            raise SystemExit(f"{path}: {os.path.getsize(path)} bytes, header says {expected}")

    def out_dtype(self):
        """What the batches are delivered as: fp32 for 16-bit floats, the stored type otherwise."""
        return np.dtype(np.float32) if self.dtype == np.float16 else self.dtype

    def batches(self, batch_size, batches_max):
        count = self.rows // batch_size
        return count if batches_max is None else min(count, batches_max)


def _already_collated(batch):
    """The collate function of a dataset whose `__getitems__` returns whole batches (module level, so
    that worker processes can pickle it)."""
    return batch


def kind_of(path):
    name = os.path.basename(path)
    if name.startswith("emb"):
        return "emb"
    if name.startswith("tokens"):
        return "tokens"
    return os.path.splitext(name)[0]


def base_record(args, loader, layout, temperature, batch_size, batches):
    samples = batches * batch_size
    return {
        "loader": loader,
        "kind": args.kind or kind_of(layout.path),
        "temperature": temperature,
        "batch_size": batch_size,
        "batches": batches,
        "samples": samples,
        "bytes_in": samples * layout.row_bytes,
        "bytes_out": samples * layout.row_values * layout.out_dtype().itemsize,
        "dtype_in": layout.dtype.name,
        "dtype_out": layout.out_dtype().name,
        "file": layout.path,
        "date": common.utc_now(),
    }


# Whether the file has been read through the page cache since the last cache drop.
_file_is_warm = {}


def prepare(temperature, path):
    """Sets the page-cache state; returns the fields that say how."""
    if temperature == "cold":
        _file_is_warm[path] = False
        return {"cold_method": common.make_cold(path)}
    if _file_is_warm.get(path):
        return {"warm_read_seconds": 0.0}
    _file_is_warm[path] = True
    return {"warm_read_seconds": common.make_warm(path)}


def timed(args, run):
    """Runs `run()` (which returns a dict of extra fields) under the CPU clock, the wall clock and the
    GPU busy sampler; returns the measured fields."""
    sampler = common.GpuBusySampler(args.gpu) if args.gpu_busy else None
    cpu0 = common.process_cpu_seconds()
    start_monotonic = time.monotonic()
    t0 = time.perf_counter()
    extra = run()
    seconds = time.perf_counter() - t0
    end_monotonic = time.monotonic()
    cpu = common.process_cpu_seconds() - cpu0
    fields = {"seconds": seconds, "host_cpu_seconds": cpu}
    if sampler is not None:
        sampler.stop()
        busy, count = sampler.mean_between(start_monotonic, end_monotonic)
        fields.update({"gpu_busy_pct": busy, "gpu_busy_samples": count})
        if sampler.error:
            fields["gpu_busy_error"] = sampler.error
    fields.update(extra)
    return fields


def temperatures_in_order(args):
    # Warm first: with several worker counts, the warm runs choose the count the cold run uses.
    order = {"warm": 0, "cold": 1}
    return sorted(args.temperatures, key=order.__getitem__)


# --- PyTorch DataLoader --------------------------------------------------------------------------

def run_torch(args, layout):
    import torch
    import torch.utils.data

    torch_dtype = {np.dtype(np.float16): torch.float16, np.dtype(np.int32): torch.int32,
                   np.dtype(np.float32): torch.float32}[layout.dtype]
    convert = layout.dtype == np.float16

    class NpyBatches(torch.utils.data.Dataset):
        """Batch `index` is rows [index * B, (index + 1) * B) of the memory-mapped .npy file, copied
        out of the mapping by a worker (the DataLoader then moves it to shared memory)."""

        def __init__(self, batch_size, count):
            self.batch_size = batch_size
            self.count = count
            self.array = None  # opened in each worker: a memmap would be pickled as a copy

        def __len__(self):
            return self.count

        def __getitem__(self, index):
            if self.array is None:
                self.array = np.load(layout.path, mmap_mode="r")
            rows = self.array[index * self.batch_size:(index + 1) * self.batch_size]
            return torch.from_numpy(np.array(rows))

    class NpyRowBatches(torch.utils.data.Dataset):
        """Rows of the memory-mapped .npy file for a full shuffle, fetched a batch at a time (the
        strong form of a map-style dataset): the DataLoader hands `__getitems__` a batch's indices
        drawn by a RandomSampler, which reads them sorted (file order within the batch: fewer, more
        local page-cache reads; a batch is a set to SGD) with one fancy index of the mapping. Returns
        (the indices in the rows' order, the rows), so that a batch can be checked against the
        source by index."""

        def __init__(self, rows):
            self.rows = rows
            self.array = None  # opened in each worker: a memmap would be pickled as a copy

        def __len__(self):
            return self.rows

        def __getitem__(self, index):
            return self.__getitems__([index])

        def __getitems__(self, indices):
            if self.array is None:
                self.array = np.load(layout.path, mmap_mode="r")
            order = np.sort(np.asarray(indices, dtype=np.int64))
            return torch.from_numpy(order), torch.from_numpy(np.asarray(self.array[order]))

    def to_device(rows):
        on_device = rows.cuda(non_blocking=True)
        return on_device.float() if convert else on_device.clone()

    def epoch(batch_size, workers, batches):
        """In file order: every batch timed from the loader's start (worker start-up included)."""
        loader = torch.utils.data.DataLoader(
            NpyBatches(batch_size, batches), batch_size=None, shuffle=False, num_workers=workers,
            pin_memory=True, prefetch_factor=args.prefetch_factor if workers > 0 else None,
            persistent_workers=False)
        last = None
        received = 0
        for batch in loader:
            last = to_device(batch)
            received += 1
            if received == batches:
                break
        torch.cuda.synchronize()
        # The workers are joined when the iterator ends, so their CPU time is in RUSAGE_CHILDREN.
        del loader
        return {"received": received, "last": last}

    def random_epoch(batch_size, workers, batches, warmup):
        """A full shuffle: `warmup` batches first (worker start-up, and the batches the workers
        prefetched meanwhile), then `batches` timed batches, the steady state. The timed CPU is this
        process's (the pin-memory thread included) and the live workers' (/proc/PID/stat). Keeps
        every timed batch's indices, and three batches on the device, for the checks."""
        generator = torch.Generator().manual_seed(0)
        dataset = NpyRowBatches(layout.rows)
        started = time.perf_counter()
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, drop_last=True,
            sampler=torch.utils.data.RandomSampler(dataset, generator=generator),
            collate_fn=_already_collated, num_workers=workers, pin_memory=True,
            prefetch_factor=args.prefetch_factor if workers > 0 else None, persistent_workers=False)
        batches_iter = iter(loader)
        for _ in range(warmup):
            to_device(next(batches_iter)[1])
        torch.cuda.synchronize()
        warmup_seconds = time.perf_counter() - started
        worker_pids = [w.pid for w in getattr(batches_iter, "_workers", [])]

        def cpu_now():
            own = resource.getrusage(resource.RUSAGE_SELF)
            return own.ru_utime + own.ru_stime + sum(common.pid_cpu_seconds(pid) for pid in worker_pids)

        cpu0 = cpu_now()
        t0 = time.perf_counter()
        kept, indices = {}, []
        keep = {0, batches // 2, batches - 1}
        for index in range(batches):
            order, rows = next(batches_iter)
            on_device = to_device(rows)
            indices.append(order)
            if index in keep:
                kept[index] = (order, on_device)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        cpu = cpu_now() - cpu0
        del batches_iter, loader
        return {"received": batches, "kept": kept, "indices": torch.cat(indices).numpy(),
                "fields": {"seconds": seconds, "host_cpu_seconds": cpu, "warmup_batches": warmup,
                           "warmup_seconds": warmup_seconds, "timed": "after the warm-up",
                           "fetch": "__getitems__, sorted indices, one fancy index of the mapping"}}

    def check(batch_size, result):
        source = np.load(layout.path, mmap_mode="r")
        if args.random:
            # Values, by index: three timed batches (the first, a middle one, the last) equal the
            # source rows they name, converted as the batches were; and the timed batches drew
            # every index at most once (a shuffle, not a sample with replacement).
            indices = result["indices"]
            rows_match = all(
                np.array_equal(on_device.cpu().numpy(),
                               source[order.numpy()].astype(layout.out_dtype()))
                for order, on_device in result["kept"].values())
            return bool(rows_match and len(np.unique(indices)) == len(indices)
                        and all(on_device.shape[0] == batch_size
                                for _, on_device in result["kept"].values()))
        received = result["received"]
        expected = source[(received - 1) * batch_size:received * batch_size]
        return bool(np.array_equal(result["last"].cpu().numpy(), expected.astype(layout.out_dtype())))

    torch.cuda.init()
    device_name = torch.cuda.get_device_name()
    epoch(args.batch_sizes[0], 0, min(4, layout.batches(args.batch_sizes[0], None)))

    for batch_size in args.batch_sizes:
        available = layout.batches(batch_size, None)
        batches = layout.batches(batch_size, args.batches_max)
        if batches == 0:
            continue
        best_workers = args.workers[0]
        for temperature in temperatures_in_order(args):
            tries = args.workers if (temperature == "warm" and len(args.workers) > 1) else [best_workers]
            best_rate = -1.0
            for workers in tries:
                # The warm-up covers the batches prefetched while the workers started (prefetch
                # factor per worker) and one round more; the timed batches then come at the
                # workers' steady pace.
                warmup = workers * args.prefetch_factor + max(workers, 1) if args.random else 0
                timed_batches = min(batches, available - warmup) if args.random else batches
                if timed_batches <= 0:
                    common.emit({"loader": "torch-random", "batch_size": batch_size, "workers": workers,
                                 "skipped": f"{available} batches in the file, fewer than the warm-up of {warmup}"},
                                args.jsonl)
                    continue
                for repeat in range(args.repeat if temperature == "warm" else 1):
                    loader_name = "torch-random" if args.random else "torch"
                    record = base_record(args, loader_name, layout, temperature, batch_size, timed_batches)
                    record.update(prepare(temperature, layout.path))
                    result = {}

                    def run():
                        if args.random:
                            result.update(random_epoch(batch_size, workers, timed_batches, warmup))
                            # The timed part's seconds and CPU replace the whole call's.
                            return result["fields"]
                        result.update(epoch(batch_size, workers, timed_batches))
                        return {}

                    record.update(timed(args, run))
                    assert result["received"] == timed_batches, (result["received"], timed_batches)
                    record.update({"workers": workers, "prefetch_factor": args.prefetch_factor,
                                   "pin_memory": True, "repeat": repeat, "device": device_name,
                                   "verified": check(batch_size, result),
                                   "torch": torch.__version__})
                    common.finish_record(record)
                    common.emit(record, args.jsonl)
                    if record["gb_per_s_in"] > best_rate:
                        best_rate, best_workers = record["gb_per_s_in"], workers


# --- KvikIO + CuPy --------------------------------------------------------------------------------

def run_kvikio(args, layout):
    import cupy
    import kvikio
    import kvikio.defaults

    def set_threads(count):
        try:
            kvikio.defaults.set("num_threads", count)
        except (AttributeError, TypeError):
            kvikio.defaults.num_threads_reset(count)

    set_threads(args.threads[0])
    if args.task_bytes:
        try:
            kvikio.defaults.set("task_size", args.task_bytes)
        except (AttributeError, TypeError):
            kvikio.defaults.task_size_reset(args.task_bytes)
    try:
        compat_mode = kvikio.defaults.get("compat_mode")
    except (AttributeError, TypeError):
        compat_mode = kvikio.defaults.compat_mode()
    compat_mode = getattr(compat_mode, "name", str(compat_mode))
    out_dtype = cupy.dtype(layout.out_dtype())
    loader = "kvikio-read" if args.read_only else "kvikio"

    def epoch(file, batch_size, batches):
        """Reads batches into a ring of `depth` device buffers, `depth` reads in flight; converts each
        into a new output batch on the current stream. A buffer is read into again only after the
        conversion that reads it has finished (a blocking-sync event, so the wait does not spin)."""
        batch_bytes = batch_size * layout.row_bytes
        depth = min(args.depth, batches)
        buffers = [cupy.empty(batch_bytes, dtype=cupy.uint8) for _ in range(depth)]
        released = [None] * depth
        in_flight = {}

        def submit(index):
            slot = index % depth
            if released[slot] is not None:
                released[slot].synchronize()
            in_flight[index] = file.pread(buffers[slot], batch_bytes,
                                          layout.offset + index * batch_bytes)

        for index in range(depth):
            submit(index)
        last = None
        for index in range(batches):
            got = in_flight.pop(index).get()
            assert got == batch_bytes, (got, batch_bytes)
            slot = index % depth
            if not args.read_only:
                source = buffers[slot].view(layout.dtype).reshape(batch_size, layout.row_values)
                last = source.astype(out_dtype)
                event = cupy.cuda.Event(block=True, disable_timing=True)
                event.record()
                released[slot] = event
            if index + depth < batches:
                submit(index + depth)
        cupy.cuda.runtime.deviceSynchronize()
        return last

    def check(batch_size, batches, last):
        if last is None:
            return None
        expected = np.load(layout.path, mmap_mode="r")[(batches - 1) * batch_size:batches * batch_size]
        return bool(np.array_equal(cupy.asnumpy(last), expected.astype(layout.out_dtype())))

    device_name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    with kvikio.CuFile(layout.path, "r") as file:
        epoch(file, args.batch_sizes[0], min(4, layout.batches(args.batch_sizes[0], None)))
        for batch_size in args.batch_sizes:
            batches = layout.batches(batch_size, args.batches_max)
            if batches == 0:
                continue
            # Warm, every thread count is measured (each record says its count); cold, the count
            # that was fastest warm (or the first), as the torch peer does with its workers.
            best_threads, best_rate = args.threads[0], -1.0
            for temperature, threads, repeat in [
                    (temperature, threads, repeat)
                    for temperature in temperatures_in_order(args)
                    for threads in (args.threads if temperature == "warm" else [None])
                    for repeat in range(args.repeat if temperature == "warm" else 1)]:
                threads = best_threads if threads is None else threads
                set_threads(threads)
                record = base_record(args, loader, layout, temperature, batch_size, batches)
                if args.read_only:
                    record["bytes_out"] = record["bytes_in"]
                    record["dtype_out"] = record["dtype_in"]
                record.update(prepare(temperature, layout.path))
                result = {}

                def run():
                    result["last"] = epoch(file, batch_size, batches)
                    return {}

                record.update(timed(args, run))
                record.update({"threads": threads, "threads_swept": args.threads, "depth": args.depth,
                               "task_bytes": args.task_bytes, "compat_mode": compat_mode,
                               "compat_mode_env": os.environ.get("KVIKIO_COMPAT_MODE", "unset"),
                               "repeat": repeat, "device": device_name,
                               "verified": check(batch_size, batches, result["last"]),
                               "kvikio": getattr(kvikio, "__version__", "?")})
                common.finish_record(record)
                common.emit(record, args.jsonl)
                if temperature == "warm" and record["gb_per_s_in"] > best_rate:
                    best_rate, best_threads = record["gb_per_s_in"], threads


# --- mmap + cuMemHostRegister + copy ---------------------------------------------------------------

def run_register_copy(args, layout):
    """The simplest strong peer in dataset order: the whole file mapped and page-locked once
    (cudaHostRegister, read-only), then each batch copied by the copy engine from the registered
    page cache into a device buffer on a copy stream and converted on the compute stream, `depth`
    buffers in flight. The registration is timed apart (`register_seconds`, once per process, as a
    long-running loader pays it once); `seconds` is the epoch. Needs the file to fit the host's
    lock limit."""
    import mmap

    import cupy

    runtime = cupy.cuda.runtime
    host_register_read_only = 8  # cudaHostRegisterReadOnly
    host_to_device = 1  # cudaMemcpyHostToDevice
    out_dtype = cupy.dtype(layout.out_dtype())
    device_name = runtime.getDeviceProperties(0)["name"].decode()
    with open(layout.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    size = len(mapped)
    prepare("warm", layout.path)
    started = time.perf_counter()
    runtime.hostRegister(base, size, host_register_read_only)
    register_seconds = time.perf_counter() - started
    copy_stream = cupy.cuda.Stream(non_blocking=True)
    compute_stream = cupy.cuda.Stream(non_blocking=True)

    def epoch(batch_size, batches):
        """Returns the converted batches at a few indices (the first, one at the middle, the last),
        for the check: the first two were made while later copies reused their buffers."""
        batch_bytes = batch_size * layout.row_bytes
        depth = min(args.depth, batches)
        buffers = [cupy.empty(batch_bytes, dtype=cupy.uint8) for _ in range(depth)]
        released = [None] * depth
        kept = {0: None, batches // 2: None, batches - 1: None}
        with compute_stream:
            for index in range(batches):
                slot = index % depth
                if released[slot] is not None:
                    copy_stream.wait_event(released[slot])
                runtime.memcpyAsync(buffers[slot].data.ptr,
                                    base + layout.offset + index * batch_bytes,
                                    batch_bytes, host_to_device, copy_stream.ptr)
                copied = cupy.cuda.Event(disable_timing=True)
                copied.record(copy_stream)
                compute_stream.wait_event(copied)
                source = buffers[slot].view(layout.dtype).reshape(batch_size, layout.row_values)
                converted = source.astype(out_dtype)
                if index in kept:
                    kept[index] = converted
                released[slot] = cupy.cuda.Event(disable_timing=True)
                released[slot].record(compute_stream)
            compute_stream.synchronize()
        return kept

    def check(batch_size, batches, kept):
        rows = np.load(layout.path, mmap_mode="r")
        return all(
            np.array_equal(cupy.asnumpy(batch),
                           rows[index * batch_size:(index + 1) * batch_size].astype(layout.out_dtype()))
            for index, batch in kept.items())

    try:
        epoch(args.batch_sizes[0], min(4, layout.batches(args.batch_sizes[0], None)))
        for batch_size in args.batch_sizes:
            batches = layout.batches(batch_size, args.batches_max)
            if batches == 0:
                continue
            for repeat in range(args.repeat):
                record = base_record(args, "register-copy", layout, "warm", batch_size, batches)
                record.update(prepare("warm", layout.path))
                result = {}

                def run():
                    result["kept"] = epoch(batch_size, batches)
                    return {}

                record.update(timed(args, run))
                record.update({"depth": args.depth, "repeat": repeat, "device": device_name,
                               "register_seconds": register_seconds, "registered_bytes": size,
                               "verified": check(batch_size, batches, result["kept"])})
                common.finish_record(record)
                common.emit(record, args.jsonl)
    finally:
        runtime.hostUnregister(base)


# --- DALI -----------------------------------------------------------------------------------------

def run_dali(args, layout):
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError as error:
        common.emit({"loader": "dali", "kind": args.kind or kind_of(layout.path),
                     "skipped": f"nvidia.dali cannot be imported: {error}"}, args.jsonl)
        return
    # Not run anywhere yet: the DALI wheel is too large to carry to the GPU machine. The numpy reader
    # takes a whole file as one sample; a batch of rows is a region of interest of that file, with its
    # start fed per iteration.
    dali_dtype = {np.dtype(np.float16): types.FLOAT16, np.dtype(np.int32): types.INT32}[layout.dtype]
    out_dtype = types.FLOAT if layout.dtype == np.float16 else dali_dtype

    def make_pipeline(batch_size, batches):
        starts = iter(range(batches))

        def roi_start():
            return [np.array([next(starts) * batch_size, 0], dtype=np.int32)]

        @pipeline_def(batch_size=1, num_threads=args.threads[0], device_id=args.gpu, prefetch_queue_depth=2)
        def pipe():
            start = fn.external_source(source=roi_start, batch=True, cycle=False)
            rows = fn.readers.numpy(device="gpu", file_root=os.path.dirname(layout.path) or ".",
                                    files=[os.path.basename(layout.path)], roi_start=start,
                                    roi_shape=[batch_size, layout.row_values], dtype=dali_dtype)
            return fn.cast(rows, dtype=out_dtype)

        built = pipe()
        built.build()
        return built

    for batch_size in args.batch_sizes:
        batches = layout.batches(batch_size, args.batches_max)
        for temperature in temperatures_in_order(args):
            record = base_record(args, "dali", layout, temperature, batch_size, batches)
            record.update(prepare(temperature, layout.path))
            try:
                built = make_pipeline(batch_size, batches)

                def run():
                    for _ in range(batches):
                        built.run()
                    return {}

                record.update(timed(args, run))
            except Exception as error:  # noqa: BLE001 - any failure of the untried peer is reported
                common.emit({"loader": "dali", "kind": record["kind"], "batch_size": batch_size,
                             "temperature": temperature, "skipped": f"DALI failed: {error!r}"[:500]},
                            args.jsonl)
                return
            common.finish_record(record)
            common.emit(record, args.jsonl)


def int_list(text):
    return [int(part) for part in text.split(",") if part]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("loader", choices=["torch", "kvikio", "dali", "register-copy"])
    parser.add_argument("--file", required=True, help="a 2-D .npy file (float16 or int32)")
    parser.add_argument("--kind", help="label (default: from the file name, emb or tokens)")
    parser.add_argument("--batch-sizes", type=int_list, required=True, help="comma-separated")
    parser.add_argument("--temperatures", type=lambda t: t.split(","), default=["cold", "warm"])
    parser.add_argument("--repeat", type=int, default=1, help="measurements per warm configuration")
    parser.add_argument("--batches-max", type=int, help="stop each epoch after this many batches")
    parser.add_argument("--jsonl", help="also append each line to this file")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--no-gpu-busy", dest="gpu_busy", action="store_false",
                        help="do not sample nvidia-smi")
    torch_group = parser.add_argument_group("torch")
    torch_group.add_argument("--workers", type=int_list, default=[4, 8, 12],
                             help="worker counts; with several, each warm configuration tries all "
                                  "and the cold run uses the fastest")
    torch_group.add_argument("--prefetch-factor", type=int, default=2)
    torch_group.add_argument("--random", action="store_true",
                             help="full shuffle: a RandomSampler whose batches of indices are fetched "
                                  "whole (__getitems__, sorted, one fancy index of the mapping), "
                                  "pinned; timed over --batches-max batches after a warm-up, a "
                                  "sampled batch checked against the source rows by index")
    kvikio_group = parser.add_argument_group("kvikio")
    kvikio_group.add_argument("--threads", type=int_list, default=[8],
                              help="KvikIO thread counts, comma-separated: warm, each is measured (a "
                                   "record each), cold uses the fastest; DALI takes the first")
    kvikio_group.add_argument("--depth", type=int, default=2,
                              help="batches read ahead (2: double buffering); register-copy too")
    kvikio_group.add_argument("--task-bytes", type=int, help="KvikIO task size (default: its own)")
    kvikio_group.add_argument("--read-only", action="store_true", help="read only, no conversion")
    args = parser.parse_args()
    for temperature in args.temperatures:
        if temperature not in ("cold", "warm"):
            parser.error(f"unknown temperature {temperature!r}")
    layout = NpyLayout(args.file)
    {"torch": run_torch, "kvikio": run_kvikio, "dali": run_dali,
     "register-copy": run_register_copy}[args.loader](args, layout)
    if common.unverified_records:
        sys.exit(f"{args.loader}: {len(common.unverified_records)} measurement(s) whose batches did not "
                 "match the source (verified: false)")


if __name__ == "__main__":
    main()
