#!/usr/bin/env python3
"""The disk's random-read rate: DEPTH threads, each reading 4 KiB at random 4 KiB-aligned offsets of
FILE with O_DIRECT (so DEPTH reads are in flight), for SECONDS. Prints one JSON line: reads, bytes,
seconds, IOPS and GB/s. Drop the page cache first for a cold figure (O_DIRECT bypasses it anyway)."""

import argparse
import json
import mmap
import os
import random
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--file", required=True)
parser.add_argument("--depth", type=int, default=64)
parser.add_argument("--seconds", type=float, default=5.0)
parser.add_argument("--block", type=int, default=4096)
args = parser.parse_args()

size = os.path.getsize(args.file)
blocks = size // args.block
counts = [0] * args.depth
stop = time.perf_counter() + args.seconds


def worker(index):
    fd = os.open(args.file, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, args.block)  # page aligned, as O_DIRECT needs
    rng = random.Random(index)
    n = 0
    try:
        while time.perf_counter() < stop:
            os.preadv(fd, [buf], rng.randrange(blocks) * args.block)
            n += 1
    finally:
        os.close(fd)
    counts[index] = n


start = time.perf_counter()
threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.depth)]
for t in threads:
    t.start()
for t in threads:
    t.join()
seconds = time.perf_counter() - start
reads = sum(counts)
print(json.dumps({"loader": "random-read-probe", "depth": args.depth, "block": args.block,
                  "reads": reads, "bytes": reads * args.block, "seconds": seconds,
                  "iops": reads / seconds, "gb_per_s": reads * args.block / seconds / 1e9}))
