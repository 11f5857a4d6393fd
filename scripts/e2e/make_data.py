"""Writes the two .npy inputs of the end-to-end benchmark (scripts/gpu-e2e.sh), deterministically.

    python3 scripts/e2e/make_data.py --out-dir /var/tmp/gpufeed-e2e/npy --emb-gib 8 --tokens-gib 4

- `emb_fp16.npy`, shape [N, 1024] float16: N(0, 0.02) like trained embedding rows. LZ4 cannot shrink
  it (the packer stores its blocks raw), so it measures reading and fp16 -> fp32 conversion.
- `tokens_i32.npy`, shape [M, 2048] int32: numpy's zipf(a = 1.2) clipped to a vocabulary of 50,000 and
  made 0-based (ids 0 .. 49,999; about 10 % of draws land on the clipped id 49,999). It compresses
  about 2x with LZ4, more after a byte shuffle, so it measures the decode path.

Sizes are in GiB of payload and rounded down to whole rows. numpy's zipf sampler runs at a few million
values per second, too slow for a billion values, so the token file is tiled from a pool of fresh draws:
each 4 MiB chunk is a copy of the pool starting at a random position. The packer compresses 64 KiB
blocks independently and LZ4's window is 64 KiB, so repeats between chunks cannot change the
compression ratio. The fp16 file is drawn fresh, chunk by chunk on several threads (numpy's generators
release the GIL), every chunk from its own seed, so the bytes do not depend on the thread count.

An existing file with the requested shape is kept unless --force is given. One JSON line per file.
"""
import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

EMB_ROW = 1024
TOKEN_ROW = 2048
CHUNK_BYTES = 4 << 20
ZIPF_POOL_VALUES = 1 << 24


def existing_shape(path, dtype):
    """The shape of the .npy at `path` if it holds `dtype`, else None."""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    return array.shape if array.dtype == dtype else None


def write_chunks(path, dtype, shape, chunk_values, make_chunk, threads):
    """Writes an .npy file of `shape` whose flat contents are make_chunk(i) for i = 0, 1, ...

    Chunks are made `threads` at a time and written in order, so memory stays bounded.
    """
    total = int(np.prod(shape))
    count = (total + chunk_values - 1) // chunk_values
    tmp = path + ".partial"
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    flat = out.reshape(-1)
    with ThreadPoolExecutor(threads) as pool:
        for first in range(0, count, threads):
            indices = range(first, min(first + threads, count))
            for index, chunk in zip(indices, pool.map(make_chunk, indices)):
                start = index * chunk_values
                end = min(start + chunk_values, total)
                flat[start:end] = chunk[: end - start]
    out.flush()
    del flat, out
    os.replace(tmp, path)


def make_embeddings(path, rows, seed, threads):
    chunk_values = CHUNK_BYTES // 2

    def chunk(index):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 1, index]))
        values = rng.standard_normal(chunk_values, dtype=np.float32)
        values *= 0.02
        return values.astype(np.float16)

    write_chunks(path, np.float16, (rows, EMB_ROW), chunk_values, chunk, threads)


def make_tokens(path, rows, seed, threads, zipf_a, vocab):
    parts = threads
    part_values = ZIPF_POOL_VALUES // parts

    def pool_part(index):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 2, index]))
        draws = rng.zipf(zipf_a, part_values)
        np.minimum(draws, vocab, out=draws)
        return (draws - 1).astype(np.int32)

    with ThreadPoolExecutor(threads) as executor:
        zipf_pool = np.concatenate(list(executor.map(pool_part, range(parts))))
    # The pool twice over, so any start position has a whole chunk after it.
    doubled = np.concatenate([zipf_pool, zipf_pool])
    chunk_values = CHUNK_BYTES // 4
    assert chunk_values <= zipf_pool.size

    def chunk(index):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 3, index]))
        start = int(rng.integers(0, zipf_pool.size))
        return doubled[start : start + chunk_values]

    write_chunks(path, np.int32, (rows, TOKEN_ROW), chunk_values, chunk, threads)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--emb-gib", type=float, default=8.0, help="0 skips the file")
    parser.add_argument("--tokens-gib", type=float, default=4.0, help="0 skips the file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf-a", type=float, default=1.2)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    parser.add_argument("--force", action="store_true", help="rewrite files that already exist")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    jobs = [
        ("emb_fp16.npy", np.float16, EMB_ROW, args.emb_gib,
         lambda path, rows: make_embeddings(path, rows, args.seed, args.threads)),
        ("tokens_i32.npy", np.int32, TOKEN_ROW, args.tokens_gib,
         lambda path, rows: make_tokens(path, rows, args.seed, args.threads, args.zipf_a, args.vocab)),
    ]
    for name, dtype, row, gib, make in jobs:
        if gib <= 0:
            continue
        path = os.path.join(args.out_dir, name)
        rows = int(gib * (1 << 30)) // (row * np.dtype(dtype).itemsize)
        if rows == 0:
            parser.error(f"{name}: {gib} GiB holds no whole row")
        started = time.perf_counter()
        kept = not args.force and existing_shape(path, dtype) == (rows, row)
        if not kept:
            make(path, rows)
        print(json.dumps({
            "file": path,
            "dtype": np.dtype(dtype).name,
            "shape": [rows, row],
            "bytes": os.path.getsize(path),
            "seconds": time.perf_counter() - started,
            "kept": kept,
        }), flush=True)


if __name__ == "__main__":
    main()
