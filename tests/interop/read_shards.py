#!/usr/bin/env python3
"""An independent reader of gpufeed datasets (format versions 1 and 2), written from the byte layout.

It shares no code with gpufeed: the tables are parsed with `struct`, checksums are computed with the
`xxhash` package (xxh3-64, seed 0), LZ4 blocks are decoded by the reference C implementation through
the `lz4` package, and the byte shuffle is undone with NumPy.

Usage: read_shards.py DATASET_DIR [--expect NAME=FILE.npy]... [--expect-shards N]

Every --expect names a field and a reference .npy file; repeat a NAME to concatenate several files
along axis 0 (as `gpufeed pack --field` does). Every field listed must exist, and with at least one
--expect every field of the dataset must be listed. The decoded field must equal the reference in
dtype, shape and every byte.

On success prints one line of JSON, e.g.
  {"shards": 11, "samples": 1037, "blocks": {"raw": 30, "lz4": 12, "lz4+shuffle": 40}, ...}
On any difference prints `read_shards.py: FAIL: ...` to stderr and exits 1.

Layout (all integers little-endian):
  header, 64 bytes:
    0 magic "GFEDSHRD" | 8 version u32 | 12 header_bytes u32 | 16 first_sample u64
    24 sample_count u64 | 32 field_count u32 | 36 block_count u32 | 40 block_bytes u32
    44 checksum_kind u32 (1 = xxh3-64) | 48 payload_offset u64 | 56 xxh3-64 of bytes 0..56
  field entry, 128 bytes:
    0 name (64 bytes, zero-padded) | 64 dtype u8 | 65 ndim u8 | 66 length_kind u8 (0 fixed; 1
    variable-length, version 2) | 67 zero | 68 offset_block_count u32 (0 if fixed) | 72 first_block u32
    76 block_count u32 | 80 shape u64 x 6 (unused dims zero; of a variable-length field, one element)
  block entry, 64 bytes:
    0 stored_offset u64 | 8 stored_bytes u32 | 12 raw_bytes u32 | 16 codec u8 (0 raw, 1 lz4)
    17 filter u8 (0 none, 1 byte shuffle) | 18 field u16 | 20 zero (4) | 24 raw_offset u64
    32 first_sample u64 | 40 xxh3-64 of the stored payload | 48 zero (16)
  a variable-length field's byte stream in a shard: sample_count u64 ends (in elements, relative to
  the shard's values), in its first offset_block_count blocks, then the values; an offsets block's
  first_sample is first_sample + raw_offset / 8, a values block's the sample holding its first value.
  then the table checksum: xxh3-64 of the field and block tables, u64; zero padding to payload_offset
  (the metadata length rounded up to 4096); payloads at 4096-aligned offsets; file length a multiple
  of 4096.
"""

import argparse
import json
import os
import struct
import sys

import lz4.block
import numpy as np
import xxhash

ALIGN = 4096
HEADER_BYTES = 64
FIELD_ENTRY_BYTES = 128
BLOCK_ENTRY_BYTES = 64
SAMPLE_NDIM_MAX = 6
MAGIC = b"GFEDSHRD"

# gpufeed dtype code -> (manifest name, NumPy dtype). bf16 (code 10) has no NumPy dtype; its bytes are
# compared as uint16.
DTYPES = {
    1: ("u8", np.dtype("|u1")),
    2: ("i8", np.dtype("|i1")),
    3: ("u16", np.dtype("<u2")),
    4: ("i16", np.dtype("<i2")),
    5: ("u32", np.dtype("<u4")),
    6: ("i32", np.dtype("<i4")),
    7: ("u64", np.dtype("<u8")),
    8: ("i64", np.dtype("<i8")),
    9: ("f16", np.dtype("<f2")),
    10: ("bf16", np.dtype("<u2")),
    11: ("f32", np.dtype("<f4")),
    12: ("f64", np.dtype("<f8")),
}


class Fail(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Fail(message)


def xxh3(data):
    return xxhash.xxh3_64_intdigest(bytes(data), seed=0)


def align_up(value):
    return (value + ALIGN - 1) // ALIGN * ALIGN


def unshuffle(shuffled, width):
    """Inverse of gpufeed's byte shuffle, out[b * n + i] = raw[i * width + b]."""
    n = len(shuffled) // width
    planes = np.frombuffer(shuffled, dtype=np.uint8).reshape(width, n)
    return np.ascontiguousarray(planes.T).tobytes()


def read_manifest(directory):
    path = os.path.join(directory, "manifest.json")
    with open(path, "rb") as f:
        manifest = json.load(f)
    check(manifest.get("format") == "gpufeed-dataset", f"{path}: format is {manifest.get('format')!r}")
    variable = any(f.get("variable_length") for f in manifest["fields"])
    check(manifest.get("format_version") == (2 if variable else 1),
          f"{path}: format_version is {manifest.get('format_version')!r} with{'' if variable else 'out'} variable-length fields")
    check(manifest.get("checksum") == "xxh3-64", f"{path}: checksum is {manifest.get('checksum')!r}")
    check(len(manifest["fields"]) >= 1, f"{path}: no fields")
    check(len(manifest["shards"]) >= 1, f"{path}: no shards")
    next_sample = 0
    for index, shard in enumerate(manifest["shards"]):
        check(shard["first_sample"] == next_sample,
              f"{path}: shards[{index}] starts at {shard['first_sample']}, expected {next_sample}")
        check(shard["sample_count"] > 0, f"{path}: shards[{index}] is empty")
        check("/" not in shard["file"] and not shard["file"].startswith("."),
              f"{path}: shards[{index}].file {shard['file']!r} is not a plain name")
        check(len(shard["table_checksum"]) == 16, f"{path}: shards[{index}].table_checksum is not 16 hex digits")
        next_sample += shard["sample_count"]
    check(next_sample == manifest["sample_count"],
          f"{path}: shards hold {next_sample} samples, sample_count says {manifest['sample_count']}")
    return manifest


def read_shard(path, manifest_shard, manifest, counts):
    """Validates one shard and returns {field name: bytes of that field in this shard}."""
    with open(path, "rb") as f:
        data = f.read()
    where = os.path.basename(path)
    check(len(data) == manifest_shard["file_bytes"],
          f"{where}: file has {len(data)} bytes, manifest says {manifest_shard['file_bytes']}")
    check(len(data) % ALIGN == 0, f"{where}: length {len(data)} is not a multiple of {ALIGN}")
    check(len(data) >= HEADER_BYTES, f"{where}: shorter than the header")

    # Header.
    (magic, version, header_bytes, first_sample, sample_count, field_count, block_count,
     block_bytes, checksum_kind, payload_offset, header_checksum) = struct.unpack_from(
        "<8sIIQQIIIIQQ", data, 0)
    check(magic == MAGIC, f"{where}: magic is {magic!r}")
    check(version == manifest["format_version"], f"{where}: version {version}")
    check(header_checksum == xxh3(data[:56]),
          f"{where}: header checksum {header_checksum:016x} != xxh3-64 {xxh3(data[:56]):016x}")
    check(header_bytes == HEADER_BYTES, f"{where}: header_bytes {header_bytes}")
    check(checksum_kind == 1, f"{where}: checksum kind {checksum_kind}")
    check(first_sample == manifest_shard["first_sample"],
          f"{where}: first_sample {first_sample}, manifest says {manifest_shard['first_sample']}")
    check(sample_count == manifest_shard["sample_count"],
          f"{where}: sample_count {sample_count}, manifest says {manifest_shard['sample_count']}")
    check(field_count == len(manifest["fields"]),
          f"{where}: {field_count} fields, manifest lists {len(manifest['fields'])}")
    check(block_bytes == manifest["block_bytes"],
          f"{where}: block_bytes {block_bytes}, manifest says {manifest['block_bytes']}")
    fields_end = HEADER_BYTES + field_count * FIELD_ENTRY_BYTES
    blocks_end = fields_end + block_count * BLOCK_ENTRY_BYTES
    check(payload_offset == align_up(blocks_end + 8),
          f"{where}: payload_offset {payload_offset}, expected {align_up(blocks_end + 8)}")
    check(len(data) >= payload_offset, f"{where}: shorter than its metadata")

    # Table checksum, also recorded in the manifest.
    (table_checksum,) = struct.unpack_from("<Q", data, blocks_end)
    computed = xxh3(data[HEADER_BYTES:blocks_end])
    check(table_checksum == computed,
          f"{where}: table checksum {table_checksum:016x} != xxh3-64 {computed:016x}")
    check(table_checksum == int(manifest_shard["table_checksum"], 16),
          f"{where}: table checksum {table_checksum:016x}, manifest says {manifest_shard['table_checksum']}")
    check(not any(data[blocks_end + 8:payload_offset]), f"{where}: metadata padding is not zero")

    # Field table.
    fields = []
    next_block = 0
    for index in range(field_count):
        at = HEADER_BYTES + index * FIELD_ENTRY_BYTES
        entry = data[at:at + FIELD_ENTRY_BYTES]
        raw_name = entry[:64]
        name = raw_name.split(b"\0", 1)[0].decode("ascii")
        check(not any(raw_name[len(name):]), f"{where}: field {index}: name padding is not zero")
        dtype_code, ndim = entry[64], entry[65]
        length_kind, reserved = entry[66], entry[67]
        (offset_blocks,) = struct.unpack_from("<I", entry, 68)
        check(reserved == 0, f"{where}: field {index}: reserved byte is not zero")
        check(length_kind in (0, 1) and (length_kind == 0 or version == 2),
              f"{where}: field {index}: length kind {length_kind} in version {version}")
        variable = length_kind == 1
        check(variable or offset_blocks == 0, f"{where}: field {index}: offset_block_count of a fixed field")
        first_block, field_blocks = struct.unpack_from("<II", entry, 72)
        dims = struct.unpack_from("<6Q", entry, 80)
        check(dtype_code in DTYPES, f"{where}: field {index}: unknown dtype code {dtype_code}")
        check(ndim <= SAMPLE_NDIM_MAX and not any(dims[ndim:]), f"{where}: field {index}: bad shape slots")
        shape = list(dims[:ndim])
        expected = manifest["fields"][index]
        dtype_name, np_dtype = DTYPES[dtype_code]
        check(name == expected["name"], f"{where}: field {index} is {name!r}, manifest says {expected['name']!r}")
        check(dtype_name == expected["dtype"],
              f"{where}: field {name!r} dtype {dtype_name}, manifest says {expected['dtype']}")
        check(shape == expected["shape"], f"{where}: field {name!r} shape {shape}, manifest says {expected['shape']}")
        check(variable == bool(expected.get("variable_length")),
              f"{where}: field {name!r} is{'' if variable else ' not'} variable-length, unlike the manifest")
        check(not variable or 1 <= offset_blocks <= field_blocks,
              f"{where}: field {name!r}: {offset_blocks} offsets blocks of {field_blocks}")
        check(first_block == next_block and field_blocks >= 1,
              f"{where}: field {name!r} blocks {first_block}..+{field_blocks} do not follow on from {next_block}")
        next_block = first_block + field_blocks
        fields.append((name, np_dtype, shape, first_block, field_blocks, offset_blocks if variable else None))
    check(next_block == block_count, f"{where}: fields cover {next_block} of {block_count} blocks")

    # Block table and payloads.
    out = {}
    previous_end = payload_offset
    for field_index, (name, np_dtype, shape, first_block, field_blocks, offset_blocks) in enumerate(fields):
        width = np_dtype.itemsize
        sample_bytes = width * int(np.prod(shape, dtype=np.int64))
        field_bytes = sample_bytes * sample_count
        offsets_bytes = 8 * sample_count if offset_blocks is not None else 0
        first_samples = []
        pieces = []
        raw_offset_expected = 0
        for block_in_field in range(field_blocks):
            index = first_block + block_in_field
            at = fields_end + index * BLOCK_ENTRY_BYTES
            (stored_offset, stored_bytes, raw_bytes, codec, filt, field, reserved, raw_offset,
             block_first_sample, payload_checksum) = struct.unpack_from("<QIIBBHIQQQ", data, at)
            place = f"{where}: field {name!r} block {block_in_field} (entry {index})"
            check(reserved == 0 and not any(data[at + 48:at + 64]), f"{place}: reserved bytes are not zero")
            check(field == field_index, f"{place}: names field {field}")
            check(0 < raw_bytes <= block_bytes, f"{place}: raw_bytes {raw_bytes}")
            check(raw_bytes % width == 0, f"{place}: raw_bytes {raw_bytes} is not whole elements")
            check(raw_offset == raw_offset_expected, f"{place}: raw_offset {raw_offset}, expected {raw_offset_expected}")
            if offset_blocks is None:
                check(block_first_sample == first_sample + raw_offset // sample_bytes,
                      f"{place}: first_sample {block_first_sample}, expected {first_sample + raw_offset // sample_bytes}")
            elif block_in_field < offset_blocks:
                check(raw_offset + raw_bytes <= offsets_bytes, f"{place}: an offsets block past the offsets")
                check(raw_bytes % 8 == 0, f"{place}: an offsets block of {raw_bytes} bytes")
                check(block_first_sample == first_sample + raw_offset // 8,
                      f"{place}: first_sample {block_first_sample}, expected {first_sample + raw_offset // 8}")
            else:
                check(raw_offset >= offsets_bytes, f"{place}: a values block inside the offsets")
                first_samples.append((place, (raw_offset - offsets_bytes) // sample_bytes, block_first_sample))
            check(stored_offset % ALIGN == 0 and stored_offset >= previous_end,
                  f"{place}: stored_offset {stored_offset} not aligned at or after {previous_end}")
            check(stored_offset + stored_bytes <= len(data), f"{place}: payload runs past the end of the file")
            previous_end = stored_offset + stored_bytes
            payload = data[stored_offset:stored_offset + stored_bytes]
            computed = xxh3(payload)
            check(computed == payload_checksum,
                  f"{place}: payload checksum {payload_checksum:016x} != xxh3-64 {computed:016x}")
            if codec == 0:
                check(filt == 0 and stored_bytes == raw_bytes, f"{place}: raw block with filter {filt} "
                      f"or stored_bytes {stored_bytes} != raw_bytes {raw_bytes}")
                raw = payload
                counts["raw"] += 1
            elif codec == 1:
                try:
                    decoded = lz4.block.decompress(payload, uncompressed_size=raw_bytes)
                except lz4.block.LZ4BlockError as e:
                    raise Fail(f"{place}: liblz4 cannot decode the payload: {e}")
                check(len(decoded) == raw_bytes, f"{place}: LZ4 decoded {len(decoded)} bytes, table says {raw_bytes}")
                if filt == 0:
                    raw = decoded
                    counts["lz4"] += 1
                elif filt == 1:
                    check(width > 1, f"{place}: byte shuffle on {width}-byte elements")
                    raw = unshuffle(decoded, width)
                    counts["lz4+shuffle"] += 1
                else:
                    raise Fail(f"{place}: unknown filter {filt}")
            else:
                raise Fail(f"{place}: unknown codec {codec}")
            pieces.append(raw)
            raw_offset_expected += raw_bytes
        stream = b"".join(pieces)
        if offset_blocks is None:
            check(raw_offset_expected == field_bytes,
                  f"{where}: field {name!r} blocks hold {raw_offset_expected} bytes, need {field_bytes}")
            out[name] = stream
            continue
        values = stream[offsets_bytes:]
        check(len(values) % sample_bytes == 0, f"{where}: field {name!r}: values are not whole elements")
        ends = np.frombuffer(stream[:offsets_bytes], dtype="<u8")
        elements = len(values) // sample_bytes
        starts = np.concatenate([[0], ends[:-1]]).astype(np.uint64)
        check(bool(np.all(ends >= starts)), f"{where}: field {name!r}: offsets go back")
        check(len(ends) == 0 or int(ends[-1]) == elements,
              f"{where}: field {name!r}: offsets end at {int(ends[-1])}, values hold {elements}")
        check(int((ends - starts).max(initial=0)) <= manifest["fields"][field_index]["length_max"],
              f"{where}: field {name!r}: a sample longer than length_max")
        for place, element, block_first_sample in first_samples:
            expected = first_sample + int(np.searchsorted(ends, element, side="right"))
            check(block_first_sample == expected, f"{place}: first_sample {block_first_sample}, expected {expected}")
        out[name] = ("variable", ends, values)
    check(len(data) == align_up(max(previous_end, payload_offset)),
          f"{where}: file length {len(data)}, expected {align_up(max(previous_end, payload_offset))}")
    return out


def read_dataset(directory):
    """The dataset's fields, checked shard by shard: a fixed-shape field as its bytes, a
    variable-length one as (ends over the whole dataset, values bytes)."""
    manifest = read_manifest(directory)
    counts = {"raw": 0, "lz4": 0, "lz4+shuffle": 0}
    fields = {}
    for shard in manifest["shards"]:
        parts = read_shard(os.path.join(directory, shard["file"]), shard, manifest, counts)
        for name, part in parts.items():
            if isinstance(part, tuple):
                _, ends, values = part
                previous = fields.get(name, (np.zeros(0, dtype=np.uint64), b""))
                base = int(previous[0][-1]) if len(previous[0]) else 0
                fields[name] = (np.concatenate([previous[0], ends + np.uint64(base)]), previous[1] + values)
            else:
                fields[name] = fields.get(name, b"") + part
    return manifest, fields


def describe_difference(got, want):
    """Index and values of the first differing element (compared as bytes)."""
    g = got.reshape(-1).view(f"V{got.dtype.itemsize}")
    w = want.reshape(-1).view(f"V{want.dtype.itemsize}")
    diff = np.nonzero(g != w)[0]
    first = int(diff[0])
    index = np.unravel_index(first, got.shape)
    return (f"{diff.size} of {g.size} elements differ; first at index {tuple(int(i) for i in index)}: "
            f"decoded {got.reshape(-1)[first]!r} (bytes {g[first].tobytes().hex()}), "
            f"expected {want.reshape(-1)[first]!r} (bytes {w[first].tobytes().hex()})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--expect", action="append", default=[], metavar="NAME=FILE.npy")
    parser.add_argument("--expect-shards", type=int)
    args = parser.parse_args()

    try:
        manifest = read_manifest(args.dataset)
        if args.expect_shards is not None:
            check(len(manifest["shards"]) == args.expect_shards,
                  f"{len(manifest['shards'])} shards, expected {args.expect_shards}")
        counts = {"raw": 0, "lz4": 0, "lz4+shuffle": 0}
        per_field = {f["name"]: [] for f in manifest["fields"]}
        for shard in manifest["shards"]:
            parts = read_shard(os.path.join(args.dataset, shard["file"]), shard, manifest, counts)
            for name, raw in parts.items():
                per_field[name].append(raw)

        expected_files = {}
        for spec in args.expect:
            name, sep, file = spec.partition("=")
            check(sep == "=", f"--expect {spec!r}: expected NAME=FILE.npy")
            expected_files.setdefault(name, []).append(file)
        if expected_files:
            missing = sorted(set(per_field) - set(expected_files))
            check(not missing, f"no --expect given for fields {missing}")
        for name, files in expected_files.items():
            field = next((f for f in manifest["fields"] if f["name"] == name), None)
            check(field is not None, f"--expect {name}: the dataset has no field {name!r}")
            check(not field.get("variable_length"), f"--expect {name}: a variable-length field")
            code = next(c for c, (n, _) in DTYPES.items() if n == field["dtype"])
            np_dtype = DTYPES[code][1]
            got = np.frombuffer(b"".join(per_field[name]), dtype=np_dtype)
            got = got.reshape([manifest["sample_count"]] + field["shape"])
            want = np.concatenate([np.load(f, allow_pickle=False) for f in files], axis=0)
            if field["dtype"] != "bf16":
                check(want.dtype == np_dtype, f"field {name!r}: dtype {field['dtype']} "
                      f"({np_dtype.str}) but the reference is {want.dtype.str}")
            check(got.shape == want.shape, f"field {name!r}: shape {got.shape}, reference {want.shape}")
            want = np.ascontiguousarray(want)
            if got.tobytes() != want.tobytes():
                raise Fail(f"field {name!r}: decoded values differ from {', '.join(files)}: "
                           + describe_difference(got, want.view(got.dtype)))
    except Fail as e:
        print(f"read_shards.py: FAIL: {args.dataset}: {e}", file=sys.stderr)
        sys.exit(1)

    print(json.dumps({
        "dataset": manifest["name"],
        "shards": len(manifest["shards"]),
        "samples": manifest["sample_count"],
        "block_bytes": manifest["block_bytes"],
        "blocks": counts,
        "fields_checked": sorted(expected_files),
    }, sort_keys=True))


if __name__ == "__main__":
    main()
