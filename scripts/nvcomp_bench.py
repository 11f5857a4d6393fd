#!/usr/bin/env python3
"""nvCOMP's batched LZ4 decoder on the blocks kernel_bench wrote: the comparison of the kernel benchmark.

Usage: nvcomp_bench.py DATA_DIR          (runs each measurement below in its own process)
       nvcomp_bench.py DATA_DIR ours NAME  (nvCOMP decoding gpufeed's blocks of NAME)
       nvcomp_bench.py DATA_DIR own NAME   (nvCOMP compressing NAME.raw itself, then decoding that)

For each data set NAME it reads NAME.lz4 (the LZ4 blocks, at 16-byte aligned offsets), NAME.idx (u64
offset, stored bytes, raw bytes per block) and, for the unshuffled sets, NAME.raw. It calls nvCOMP's
low-level C API (nvcompBatchedLZ4DecompressAsync from libnvcomp.so, through ctypes) on all blocks of a
set at once, the same 64 KiB blocks gpufeed's kernel decodes, and times it like kernel_bench does: CUDA
events, 3 warm-up runs, median of 20. Outputs are checked (statuses, sizes, and the bytes against
NAME.raw). If the C API cannot be loaded it falls back to the Python API (nvcomp.Codec, RAW bitstream),
whose timings include Python overhead and are labelled so. Each measurement runs in a child process,
so that a fault in one (nvCOMP has raised illegal-address errors on lz4_flex blocks) cannot poison the
CUDA context of the others. Buffers get 64 KiB of slack past their ends, since nvCOMP may read or write
past a chunk. Needs cupy and the nvidia-nvcomp-cu13 /
nvidia-libnvcomp-cu13 wheels (scripts/gpu-check.sh installs them).
"""

import ctypes
import glob
import os
import statistics
import sys

import cupy as cp
import numpy as np

SETS = ["zipf_i32", "relu_f16", "zipf_i32_shuffled", "relu_f16_shuffled"]
WARMUP = 3
REPS = 20


class DecompressOpts(ctypes.Structure):
    # nvcompBatchedLZ4DecompressOpts_t (nvcomp/lz4.h, nvCOMP 6): 64 bytes, passed by value.
    _fields_ = [
        ("backend", ctypes.c_int),
        ("sort_before_hw_decompress", ctypes.c_int),
        ("data_type", ctypes.c_int),
        ("bitshuffle_mode", ctypes.c_int),
        ("reserved", ctypes.c_char * 48),
    ]


class CompressOpts(ctypes.Structure):
    # nvcompBatchedLZ4CompressOpts_t (nvcomp/lz4.h, nvCOMP 6): 64 bytes, passed by value.
    _fields_ = [("data_type", ctypes.c_int), ("bitshuffle_mode", ctypes.c_int), ("reserved", ctypes.c_char * 56)]


SLACK = 64 << 10


class Alignments(ctypes.Structure):
    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


def find_libnvcomp():
    for root in sys.path:
        hits = glob.glob(os.path.join(root, "nvidia", "libnvcomp", "lib64", "libnvcomp.so*"))
        if hits:
            return sorted(hits)[0]
    return None


def load(data_dir, name):
    comp = np.fromfile(os.path.join(data_dir, name + ".lz4"), dtype=np.uint8)
    idx = np.fromfile(os.path.join(data_dir, name + ".idx"), dtype=np.uint64).reshape(-1, 3)
    raw_path = os.path.join(data_dir, name + ".raw")
    raw = np.fromfile(raw_path, dtype=np.uint8) if os.path.exists(raw_path) else None
    return comp, idx, raw


def time_events(stream, run):
    for _ in range(WARMUP):
        run()
    stream.synchronize()
    samples = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(REPS):
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(samples), min(samples), max(samples)


def bench_c_api(lib, data_dir, name):
    comp, idx, raw = load(data_dir, name)
    return decode_timed(lib, name, comp, idx, raw)


def decode_timed(lib, name, comp, idx, raw):
    n = idx.shape[0]
    raw_sizes = idx[:, 2]
    total_raw = int(raw_sizes.sum())
    d_comp = cp.zeros(comp.size + SLACK, dtype=cp.uint8)
    d_comp[: comp.size] = cp.asarray(comp)
    comp_ptrs = cp.asarray(np.uint64(d_comp.data.ptr) + idx[:, 0])
    comp_bytes = cp.asarray(idx[:, 1])
    out_offsets = np.concatenate([[0], np.cumsum(raw_sizes)[:-1]]).astype(np.uint64)
    d_out_padded = cp.full(total_raw + SLACK, 0xA5, dtype=cp.uint8)
    d_out = d_out_padded[:total_raw]
    out_ptrs = cp.asarray(np.uint64(d_out.data.ptr) + out_offsets)
    out_bytes = cp.asarray(raw_sizes)
    actual = cp.zeros(n, dtype=cp.uint64)
    statuses = cp.full(n, -1, dtype=cp.int32)

    opts = DecompressOpts()  # zeroed: default backend (CUDA on the H100), no bitshuffle
    temp_bytes = ctypes.c_size_t(0)
    stream = cp.cuda.Stream(non_blocking=True)
    rc = lib.nvcompBatchedLZ4DecompressGetTempSize(
        ctypes.c_size_t(n), ctypes.c_size_t(int(raw_sizes.max())), opts, ctypes.byref(temp_bytes),
        ctypes.c_size_t(total_raw), ctypes.c_void_p(stream.ptr))
    if rc != 0:
        raise RuntimeError(f"nvcompBatchedLZ4DecompressGetTempSize returned {rc}")
    d_temp = cp.empty(max(temp_bytes.value, 1), dtype=cp.uint8)

    def run():
        rc = lib.nvcompBatchedLZ4DecompressAsync(
            ctypes.c_void_p(comp_ptrs.data.ptr), ctypes.c_void_p(comp_bytes.data.ptr),
            ctypes.c_void_p(out_bytes.data.ptr), ctypes.c_void_p(actual.data.ptr), ctypes.c_size_t(n),
            ctypes.c_void_p(d_temp.data.ptr), ctypes.c_size_t(temp_bytes.value),
            ctypes.c_void_p(out_ptrs.data.ptr), opts, ctypes.c_void_p(statuses.data.ptr),
            ctypes.c_void_p(stream.ptr))
        if rc != 0:
            raise RuntimeError(f"nvcompBatchedLZ4DecompressAsync returned {rc}")

    run()
    stream.synchronize()
    bad = int((statuses != 0).sum())
    if bad:
        raise RuntimeError(f"{name}: {bad} blocks failed (first status {int(statuses[statuses != 0][0])})")
    if not bool((actual == out_bytes).all()):
        raise RuntimeError(f"{name}: decoded sizes differ from the raw sizes")
    verified = "sizes only (shuffled set)"
    if raw is not None:
        if not bool((d_out == cp.asarray(raw)).all()):
            raise RuntimeError(f"{name}: nvCOMP output differs from the raw bytes")
        verified = "bytes equal the raw data"
    med, lo, hi = time_events(stream, run)
    ratio = total_raw / float(idx[:, 1].sum())
    return total_raw / (med * 1e-3) / 1e9, med, lo, hi, ratio, verified


def bench_own_round_trip(lib, data_dir, name):
    """nvCOMP compresses NAME.raw in 64 KiB chunks on the GPU, then decodes its own blocks."""
    raw = np.fromfile(os.path.join(data_dir, name + ".raw"), dtype=np.uint8)
    chunk = 65536
    n = (raw.size + chunk - 1) // chunk
    raw_sizes = np.full(n, chunk, dtype=np.uint64)
    raw_sizes[-1] = raw.size - chunk * (n - 1)
    d_raw = cp.zeros(raw.size + SLACK, dtype=cp.uint8)
    d_raw[: raw.size] = cp.asarray(raw)
    in_ptrs = cp.asarray(np.uint64(d_raw.data.ptr) + np.arange(n, dtype=np.uint64) * chunk)
    in_bytes = cp.asarray(raw_sizes)
    copts = CompressOpts()
    max_out = ctypes.c_size_t(0)
    check(lib.nvcompBatchedLZ4CompressGetMaxOutputChunkSize(ctypes.c_size_t(chunk), copts, ctypes.byref(max_out)),
          "GetMaxOutputChunkSize")
    stride = (max_out.value + 15) // 16 * 16
    d_comp = cp.zeros(n * stride + SLACK, dtype=cp.uint8)
    out_ptrs = cp.asarray(np.uint64(d_comp.data.ptr) + np.arange(n, dtype=np.uint64) * stride)
    comp_bytes = cp.zeros(n, dtype=cp.uint64)
    statuses = cp.full(n, -1, dtype=cp.int32)
    temp = ctypes.c_size_t(0)
    check(lib.nvcompBatchedLZ4CompressGetTempSize(ctypes.c_size_t(n), ctypes.c_size_t(chunk), copts,
                                                  ctypes.byref(temp), ctypes.c_size_t(raw.size), None),
          "CompressGetTempSize")
    d_temp = cp.empty(max(temp.value, 1), dtype=cp.uint8)
    check(lib.nvcompBatchedLZ4CompressAsync(
        ctypes.c_void_p(in_ptrs.data.ptr), ctypes.c_void_p(in_bytes.data.ptr), ctypes.c_size_t(chunk),
        ctypes.c_size_t(n), ctypes.c_void_p(d_temp.data.ptr), ctypes.c_size_t(temp.value),
        ctypes.c_void_p(out_ptrs.data.ptr), ctypes.c_void_p(comp_bytes.data.ptr), copts,
        ctypes.c_void_p(statuses.data.ptr), None), "CompressAsync")
    cp.cuda.Device().synchronize()
    if int((statuses != 0).sum()):
        raise RuntimeError("nvCOMP compression failed on some chunks")
    sizes = cp.asnumpy(comp_bytes)
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(stride)
    comp = cp.asnumpy(d_comp[: n * stride])
    idx = np.stack([offsets, sizes, raw_sizes], axis=1)
    return decode_timed(lib, name, comp, idx, raw)


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"nvcompBatchedLZ4{what} returned {rc}")


def bench_python_api(data_dir, name):
    from nvidia import nvcomp

    comp, idx, _ = load(data_dir, name)
    d_comp = cp.asarray(comp)
    arrays = [nvcomp.as_array(d_comp[int(o):int(o) + int(s)]) for o, s, _ in idx]
    codec = nvcomp.Codec(algorithm="LZ4", bitstream_kind=nvcomp.BitstreamKind.RAW)
    stream = cp.cuda.get_current_stream()
    med, lo, hi = time_events(stream, lambda: codec.decode(arrays))
    total_raw = int(idx[:, 2].sum())
    return total_raw / (med * 1e-3) / 1e9, med, lo, hi


def open_lib():
    path = find_libnvcomp()
    if not path:
        return None
    lib = ctypes.CDLL(path)
    lib.nvcompBatchedLZ4DecompressGetTempSize.argtypes = [
        ctypes.c_size_t, ctypes.c_size_t, DecompressOpts, ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_size_t, ctypes.c_void_p]
    lib.nvcompBatchedLZ4DecompressAsync.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, DecompressOpts, ctypes.c_void_p,
        ctypes.c_void_p]
    lib.nvcompBatchedLZ4DecompressGetRequiredAlignments.argtypes = [
        DecompressOpts, ctypes.POINTER(Alignments)]
    lib.nvcompBatchedLZ4CompressGetMaxOutputChunkSize.argtypes = [
        ctypes.c_size_t, CompressOpts, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvcompBatchedLZ4CompressGetTempSize.argtypes = [
        ctypes.c_size_t, ctypes.c_size_t, CompressOpts, ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
        ctypes.c_void_p]
    lib.nvcompBatchedLZ4CompressAsync.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_void_p, CompressOpts, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def child(data_dir, kind, name):
    try:
        lib = open_lib()
    except Exception as e:  # fall back to the Python API below
        print(f"cannot load libnvcomp: {e}")
        lib = None
    try:
        if lib is None:
            rate, med, lo, hi = bench_python_api(data_dir, name)
            print(f"| nvCOMP LZ4 {name} (Python API, includes Python overhead) | {rate:.1f} GB/s out | "
                  f"median {med:.3f} ms |")
            return
        if kind == "ours":
            what = f"nvCOMP LZ4 decode of gpufeed's blocks, {name} (C API, batched)"
            rate, med, lo, hi, ratio, verified = bench_c_api(lib, data_dir, name)
        else:
            what = f"nvCOMP LZ4 decode of nvCOMP's own blocks, {name} (C API, batched)"
            rate, med, lo, hi, ratio, verified = bench_own_round_trip(lib, data_dir, name)
        print(f"| {what} | {rate:.1f} GB/s out | "
              f"ratio {ratio:.2f}, median {med:.3f} ms (min {lo:.3f}, max {hi:.3f}); {verified} |")
    except Exception as e:
        print(f"| nvCOMP {kind} {name} | failed | {str(e)[:200]} |")


def main():
    data_dir = sys.argv[1]
    if len(sys.argv) == 4:
        child(data_dir, sys.argv[2], sys.argv[3])
        return
    import subprocess

    path = find_libnvcomp()
    print(f"libnvcomp: {path}")
    if path:
        lib = open_lib()
        align = Alignments()
        lib.nvcompBatchedLZ4DecompressGetRequiredAlignments(DecompressOpts(), ctypes.byref(align))
        print(f"nvCOMP LZ4 alignments: input {align.input}, output {align.output}, temp {align.temp}")
    rows = []
    jobs = [("ours", name) for name in SETS] + [("own", name) for name in SETS if "shuffled" not in name]
    for kind, name in jobs:
        done = subprocess.run([sys.executable, __file__, data_dir, kind, name], capture_output=True, text=True,
                              timeout=120)
        sys.stdout.write(done.stdout)
        sys.stdout.write(done.stderr[-2000:])
        table_rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
        rows.extend(table_rows or [f"| nvCOMP {kind} {name} | failed | exit {done.returncode} |"])
    print("| measurement | result | notes |")
    print("|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
