#!/usr/bin/env python3
"""Checks a .npy file written by `gpufeed unpack` by loading it with NumPy.

Usage: check_unpack.py UNPACKED.npy --source FILE.npy [--source FILE.npy]... [--dtype NAME]

The sources are concatenated along axis 0 (as `gpufeed pack --field` does). Without --dtype the
unpacked file must equal them in dtype, shape and every byte. With --dtype (a gpufeed dtype name such
as f32 or i64) the expected array is `source.astype(dtype)`, and:
  - f16 -> f32 must match bit for bit, NaNs included. One adjustment: IEEE 754 conversions deliver a
    quiet NaN for a signalling one, which is what gpufeed (the `half` crate, like F16C and CUDA)
    does, while NumPy's software cast copies the signalling NaN unchanged; for those elements the
    expected value is NumPy's with the quiet bit (0x00400000) set.
  - any other conversion to a float type must match bit for bit except that where the expected value
    is a NaN the result only has to be a NaN of the same sign (NaN payloads through `as` casts are not
    specified by Rust).
  - integer conversions must match exactly.
Exits 1 with a message naming the first difference.
"""

import argparse
import sys

import numpy as np

NUMPY_DTYPES = {
    "u8": "|u1", "i8": "|i1", "u16": "<u2", "i16": "<i2", "u32": "<u4", "i32": "<i4",
    "u64": "<u8", "i64": "<i8", "f16": "<f2", "f32": "<f4", "f64": "<f8",
}
UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def fail(message):
    print(f"check_unpack.py: FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def first_difference(got, want, mismatch):
    first = int(np.nonzero(mismatch.reshape(-1))[0][0])
    index = tuple(int(i) for i in np.unravel_index(first, got.shape))
    g, w = got.reshape(-1)[first], want.reshape(-1)[first]
    return (f"{int(mismatch.sum())} of {got.size} elements differ; first at index {index}: "
            f"got {g!r} (bytes {g.tobytes().hex()}), expected {w!r} (bytes {w.tobytes().hex()})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("unpacked")
    parser.add_argument("--source", action="append", required=True)
    parser.add_argument("--dtype", choices=sorted(NUMPY_DTYPES))
    args = parser.parse_args()

    source = np.concatenate([np.load(f, allow_pickle=False) for f in args.source], axis=0)
    got = np.load(args.unpacked, allow_pickle=False)
    target = np.dtype(NUMPY_DTYPES[args.dtype]) if args.dtype else source.dtype
    where = f"{args.unpacked} (from {', '.join(args.source)}"
    where += f" as {args.dtype})" if args.dtype else ")"

    if got.dtype != target:
        fail(f"{where}: dtype {got.dtype.str}, expected {target.str}")
    if got.shape != source.shape:
        fail(f"{where}: shape {got.shape}, expected {source.shape}")
    if not got.flags.c_contiguous:
        fail(f"{where}: not stored in C order")

    with np.errstate(over="ignore", invalid="ignore"):
        want = np.ascontiguousarray(source.astype(target))
    uint = UINT_OF_WIDTH[target.itemsize]
    got_bits = got.view(uint)
    want_bits = want.view(uint).copy()

    if source.dtype == np.float16 and target == np.float32:
        src_bits = source.view(np.uint16)
        signalling = ((src_bits & 0x7C00) == 0x7C00) & ((src_bits & 0x03FF) != 0) & ((src_bits & 0x0200) == 0)
        want_bits[signalling] |= np.uint32(0x00400000)
        mismatch = got_bits != want_bits
    elif target.kind == "f" and source.dtype != target:
        sign = np.array(1 << (8 * target.itemsize - 1), dtype=uint)
        both_nan = np.isnan(got) & np.isnan(want) & ((got_bits & sign) == (want_bits & sign))
        mismatch = (got_bits != want_bits) & ~both_nan
    else:
        mismatch = got_bits != want_bits
    if mismatch.any():
        fail(f"{where}: {first_difference(got, want_bits.view(target), mismatch)}")

    specials = ""
    if target.kind == "f":
        specials = (f", {int(np.isnan(got).sum())} NaN, {int(np.isinf(got).sum())} inf, "
                    f"{int(((got != 0) & (np.abs(got) < np.finfo(target).tiny)).sum())} subnormal")
    print(f"check_unpack.py: ok: {where}: {target.str} {got.shape}{specials}")


if __name__ == "__main__":
    main()
