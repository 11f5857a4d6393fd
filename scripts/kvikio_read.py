"""KvikIO peer for the read benchmark: reads a file into device memory and prints one JSON line.

Usage: python3 scripts/kvikio_read.py FILE --threads N --temperature cold|warm [--repeat 3]
Runs in KvikIO's compatibility (POSIX) mode unless GDS is present, as KvikIO decides by itself.
"""
import argparse
import json
import os
import resource
import time

import cupy
import kvikio
import kvikio.defaults


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def set_threads(n):
    try:
        kvikio.defaults.set("num_threads", n)
    except (AttributeError, TypeError):
        kvikio.defaults.num_threads_reset(n)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--temperature", choices=["cold", "warm"], required=True)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    size = os.path.getsize(args.file)
    buffer = cupy.empty(size, dtype=cupy.uint8)
    runs = []
    repeats = 1 if args.temperature == "cold" else args.repeat
    for _ in range(repeats):
        fd = os.open(args.file, os.O_RDONLY)
        if args.temperature == "cold":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        else:
            while os.read(fd, 64 << 20):
                pass
        os.close(fd)
        cupy.cuda.runtime.deviceSynchronize()
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        with kvikio.CuFile(args.file, "r") as f:
            f.read(buffer)
        cupy.cuda.runtime.deviceSynchronize()
        seconds = time.perf_counter() - t0
        runs.append((seconds, cpu_seconds() - cpu0))
    runs.sort()
    seconds, cpu = runs[len(runs) // 2]
    print(json.dumps({
        "path": args.label or f"kvikio-{args.threads}t",
        "temperature": args.temperature,
        "bytes": size,
        "seconds": seconds,
        "gb_per_s": size / seconds / 1e9,
        "cpu_seconds": cpu,
        "host_cores": cpu / seconds,
        "compat_mode_env": os.environ.get("KVIKIO_COMPAT_MODE", "unset"),
    }))


if __name__ == "__main__":
    main()
