#!/usr/bin/env python3
"""Writes the .npy inputs of the interop tests with NumPy itself.

The files come from NumPy's own writer (np.save and np.lib.format.write_array), so packing them
tests gpufeed's .npy reader against the real thing, header versions 1.0, 2.0 and 3.0 included.

Usage: make_inputs.py OUT_DIR [--samples N]

Writes into OUT_DIR (all fields have N samples, default 1037, deliberately not a round number so the
last shard of a --samples-per-shard 100 pack is short):

  emb.npy          float16 (N, 64)     normal values: incompressible, so `--codec auto` stores raw
                                       blocks; NaNs (quiet, signalling, negative, with payloads),
                                       infinities, subnormals and signed zeros are injected.
  tokens_a.npy     int32 (K, 32)       zipf-like token ids, compressible; the field `tokens` is the
  tokens_b.npy     int32 (N-K, 32)     concatenation of both files (tokens_b uses .npy version 2.0).
  image.npy        uint8 (N, 8, 8, 3)  smooth image-like pixels: LZ4 compresses it, no shuffle
                                       possible (1-byte elements).
  feat.npy         float32 (N, 4)      slowly varying values: byte shuffle helps.
  ids.npy          int64 (N,)          sample ids: byte shuffle helps a lot.
  wave.npy         uint16 (N, 2, 1500) a sample of 6000 bytes, larger than a 4 KiB block, so blocks
                                       cut samples in pieces (.npy version 3.0).
  score.npy        float64 (N, 3)      values that round, overflow and underflow on the way to f32.
  fortran.npy      float32 (N, 3)      Fortran order: pack must refuse it.
  emb_altered.npy  emb.npy with one NaN's payload changed: equal as values, different as bytes, so
                   a reader that compares it with the packed emb field must report a difference.
  manifest.txt     one line per field: NAME FILE[,FILE...] (what the Rust test passes to pack).
"""

import argparse
import os
import sys

import numpy as np


def save(path, array, version=None):
    """np.save, or write_array with an explicit header version."""
    if version is None:
        np.save(path, array, allow_pickle=False)
    else:
        with open(path, "wb") as f:
            np.lib.format.write_array(f, array, version=version, allow_pickle=False)


def fp16_specials():
    """Raw binary16 bit patterns worth checking bit for bit."""
    return np.array(
        [
            0x7E00,  # quiet NaN
            0xFE00,  # negative quiet NaN
            0x7E2A,  # quiet NaN with a payload
            0x7C01,  # signalling NaN (smallest payload)
            0xFD55,  # negative signalling NaN with a payload
            0x7C00,  # +inf
            0xFC00,  # -inf
            0x0001,  # smallest positive subnormal
            0x8001,  # smallest negative subnormal
            0x03FF,  # largest subnormal
            0x0400,  # smallest normal
            0x7BFF,  # largest finite (65504)
            0xFBFF,  # most negative finite
            0x0000,  # +0
            0x8000,  # -0
            0x3C00,  # 1.0
        ],
        dtype="<u2",
    ).view("<f2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--samples", type=int, default=1037)
    args = parser.parse_args()
    n = args.samples
    if n < 64:
        sys.exit("make_inputs.py: --samples must be at least 64")
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(20240611)

    def path(name):
        return os.path.join(args.out_dir, name)

    # fp16 embeddings: normal values, with the special values spread over several samples/blocks.
    emb = rng.standard_normal((n, 64), dtype=np.float32).astype("<f2")
    specials = fp16_specials()
    flat = emb.reshape(-1)
    positions = rng.choice(flat.size, size=specials.size * 4, replace=False)
    flat[positions] = np.tile(specials, 4)
    assert emb.dtype == np.dtype("<f2")
    save(path("emb.npy"), emb)
    altered = emb.copy()
    altered_bits = altered.reshape(-1).view("<u2")
    nan_at = int(np.flatnonzero(altered_bits == 0x7E00)[0])
    altered_bits[nan_at] = 0x7E01
    save(path("emb_altered.npy"), altered)

    # Zipf-like token ids (int32), split over two files of different header versions.
    tokens = np.minimum(rng.zipf(1.3, size=(n, 32)), 50_000).astype("<i4") - 1
    k = n // 3
    save(path("tokens_a.npy"), tokens[:k])
    save(path("tokens_b.npy"), tokens[k:], version=(2, 0))

    # Image-like uint8: smooth gradients plus a little noise.
    yy, xx = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    base = (yy * 16 + xx * 8)[None, :, :, None] + np.arange(3)[None, None, None, :] * 40
    offset = (np.arange(n) % 32)[:, None, None, None]
    noise = rng.integers(0, 2, size=(n, 8, 8, 3))
    image = ((base + offset + noise) % 256).astype("|u1")
    save(path("image.npy"), image)

    # Slowly varying float32 features.
    t = np.arange(n, dtype=np.float64)[:, None]
    feat = (1000.0 + t * 0.25 + np.arange(4)[None, :]).astype("<f4")
    save(path("feat.npy"), feat)

    # Sample ids.
    ids = (np.arange(n, dtype=np.int64) * 3 + 1_000_000_000_000).astype("<i8")
    save(path("ids.npy"), ids)

    # Samples of 6000 bytes: larger than a 4 KiB block.
    phase = np.linspace(0.0, 20.0 * np.pi, 1500)
    wave = 30000 + 20000 * np.sin(phase[None, None, :] + np.arange(n)[:, None, None] * 0.01
                                  + np.arange(2)[None, :, None])
    wave = wave.astype("<u2")
    save(path("wave.npy"), wave, version=(3, 0))

    # float64 values that exercise f64 -> f32 rounding, overflow to inf and underflow.
    score = rng.standard_normal((n, 3)) * 1e3
    score[0] = [1e300, -1e300, 5e-324]
    score[1] = [np.inf, -np.inf, -0.0]
    score[2] = [1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, 3.4028235677973366e38]
    save(path("score.npy"), score.astype("<f8"))

    # Fortran order: gpufeed must refuse it (np.save records fortran_order: True).
    fortran = np.asfortranarray(rng.standard_normal((n, 3)).astype("<f4"))
    assert fortran.flags.f_contiguous and not fortran.flags.c_contiguous
    save(path("fortran.npy"), fortran)

    fields = [
        ("emb", ["emb.npy"]),
        ("tokens", ["tokens_a.npy", "tokens_b.npy"]),
        ("image", ["image.npy"]),
        ("feat", ["feat.npy"]),
        ("ids", ["ids.npy"]),
        ("wave", ["wave.npy"]),
        ("score", ["score.npy"]),
    ]
    with open(path("manifest.txt"), "w") as f:
        for name, files in fields:
            f.write(f"{name} {','.join(files)}\n")
    print(f"make_inputs.py: wrote {len(fields)} fields of {n} samples to {args.out_dir}")


if __name__ == "__main__":
    main()
