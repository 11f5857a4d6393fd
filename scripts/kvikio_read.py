"""KvikIO peer for the read benchmark: reads a file into device memory and prints one JSON line per
thread count.

Usage: python3 scripts/kvikio_read.py FILE --threads 4,8,16 --temperature cold|warm [--repeat 3]
       [--label 'kvikio-{threads}t']
Runs in KvikIO's compatibility (POSIX) mode unless GDS is present, as KvikIO decides by itself. With
several thread counts each is measured in turn (the median of --repeat reads); every line says its
count (`threads`) and the counts swept (`threads_swept`), and the fastest count's line has
`"best": true`, so that a figure quoted for KvikIO is its best setting and says which it was.
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
    parser.add_argument("--threads", type=lambda text: [int(part) for part in text.split(",") if part],
                        default=[8], help="thread counts, comma-separated (each measured)")
    parser.add_argument("--temperature", choices=["cold", "warm"], required=True)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--label", default=None,
                        help="the lines' `path`; {threads} is replaced by the count (default kvikio-{threads}t)")
    args = parser.parse_args()
    size = os.path.getsize(args.file)
    buffer = cupy.empty(size, dtype=cupy.uint8)
    repeats = 1 if args.temperature == "cold" else args.repeat
    lines = []
    for threads in args.threads:
        set_threads(threads)
        runs = []
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
        lines.append({
            "path": (args.label or "kvikio-{threads}t").replace("{threads}", str(threads)),
            "temperature": args.temperature,
            "threads": threads,
            "threads_swept": args.threads,
            "bytes": size,
            "seconds": seconds,
            "gb_per_s": size / seconds / 1e9,
            "cpu_seconds": cpu,
            "host_cores": cpu / seconds,
            "compat_mode_env": os.environ.get("KVIKIO_COMPAT_MODE", "unset"),
        })
    best = max(lines, key=lambda line: line["gb_per_s"])
    for line in lines:
        line["best"] = line is best
        print(json.dumps(line))

if __name__ == "__main__":
    main()
