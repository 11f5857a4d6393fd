"""`gpufeed.pack`: write a dataset from NumPy arrays, iterables of arrays, Arrow tables, or
Parquet/Arrow files.

The packing itself is `gpufeed pack`'s (the same checks, codecs, checksums and atomic install): the
fields are written as temporary `.npy` files in a directory beside `out` (the disk that receives the
dataset), the `gpufeed` binary packs them, and the directory is removed whatever happens. The binary
is `$GPUFEED_BIN`, else `gpufeed` on PATH.
"""

import itertools
import os
import shutil
import subprocess
import tempfile

from gpufeed.errors import Error

__all__ = ["PackError", "Ragged", "pack"]

# Bytes reserved for the header of a streamed `.npy` (written once the samples are counted): room
# for a shape of 8 dimensions of 20 digits each, a multiple of 64 as NumPy aligns its data.
_STREAM_HEADER_BYTES = 1024

_CODECS = ("auto", "lz4", "raw")
_BYTE_SHUFFLES = ("auto", "on", "off")


class PackError(Error):
    """`gpufeed pack` refused the inputs or failed; the message is its error (naming the file,
    field, column or row at fault)."""


class Ragged:
    """A variable-length field for `pack(fields=...)`: sample i is `values[offsets[i]:offsets[i + 1]]`
    (rows of `values` along axis 0; `offsets` one more than the samples, from 0), the form `gpufeed
    unpack` writes and Arrow's list arrays hold. `Ragged.from_arrays(arrays)` makes one from a
    sequence of arrays of one dtype and element shape, one per sample (a NumPy array of objects
    packs the same way)."""

    def __init__(self, values, offsets):
        import numpy as np

        self.values = np.ascontiguousarray(values)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        if self.values.ndim == 0:
            raise PackError("Ragged: values hold elements along axis 0; got a 0-d array")
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0:
            raise PackError("Ragged: offsets are 1-D, one more than the samples, starting at 0")

    @classmethod
    def from_arrays(cls, arrays):
        import numpy as np

        arrays = [np.asarray(a) for a in arrays]
        if not arrays:
            raise PackError("Ragged.from_arrays: no samples")
        first = arrays[0]
        for index, array in enumerate(arrays):
            if array.ndim == 0 or array.dtype != first.dtype or array.shape[1:] != first.shape[1:]:
                raise PackError(
                    f"Ragged.from_arrays: sample {index} is {array.dtype}{list(array.shape)}, but "
                    f"sample 0 is {first.dtype}[n, {', '.join(map(str, first.shape[1:]))}]"
                )
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        return cls(np.concatenate(arrays), offsets)


def _binary():
    explicit = os.environ.get("GPUFEED_BIN")
    if explicit:
        return explicit
    found = shutil.which("gpufeed")
    if found is None:
        raise PackError("gpufeed.pack needs the gpufeed binary: put it on PATH or set GPUFEED_BIN")
    return found


def _header(np, dtype, shape):
    """A `.npy` version 1.0 header for `dtype` and `shape`, padded to _STREAM_HEADER_BYTES."""
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
        np.lib.format.dtype_to_descr(dtype),
        tuple(int(d) for d in shape),
    )
    room = _STREAM_HEADER_BYTES - 10
    if len(text) + 1 > room:
        raise PackError(f"shape {tuple(shape)} is too long for a streamed field")
    text = text.ljust(room - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + room.to_bytes(2, "little") + text.encode("latin1")


def _write_stream(np, name, items, path):
    """Writes an iterable of arrays (each one or more samples along axis 0, all of one dtype and
    sample shape) to `path` as a `.npy`, one item in memory at a time."""
    dtype = None
    sample_shape = None
    samples = 0
    with open(path, "wb") as f:
        f.write(b"\0" * _STREAM_HEADER_BYTES)
        for index, item in enumerate(items):
            array = np.asarray(item)
            if array.ndim == 0:
                raise PackError(
                    f"field {name!r}, item {index}: a 0-d array; each item holds samples along axis 0"
                )
            if dtype is None:
                dtype, sample_shape = array.dtype, array.shape[1:]
            elif array.dtype != dtype or array.shape[1:] != sample_shape:
                raise PackError(
                    f"field {name!r}, item {index}: {array.dtype}{list(array.shape[1:])} per sample, "
                    f"but earlier items are {dtype}{list(sample_shape)}"
                )
            f.write(np.ascontiguousarray(array).tobytes())
            samples += array.shape[0]
        if dtype is None:
            raise PackError(f"field {name!r}: the iterable yielded no arrays")
        f.seek(0)
        f.write(_header(np, dtype, (samples, *sample_shape)))


def _write_arrow(table, path):
    """Writes `table` (a pyarrow Table, RecordBatch or RecordBatchReader, or an iterable of
    RecordBatches or Tables, all of one schema) to `path` as an Arrow IPC file, one batch in memory
    at a time when it is an iterable or a reader."""
    import pyarrow as pa

    if isinstance(table, (pa.Table, pa.RecordBatch)):
        batches, schema = iter(table.to_batches()), table.schema
    elif isinstance(table, pa.RecordBatchReader):
        batches, schema = iter(table), table.schema
    else:
        batches = iter(table)
        first = next(batches, None)
        if first is None:
            raise PackError("arrow: the iterable yielded no record batches")
        schema = first.schema
        head = first.to_batches() if isinstance(first, pa.Table) else [first]
        batches = itertools.chain(head, batches)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for index, batch in enumerate(batches):
            if not batch.schema.equals(schema):
                raise PackError(
                    f"arrow: item {index} has the schema {batch.schema}, but the first has {schema}"
                )
            if isinstance(batch, pa.Table):
                writer.write_table(batch)
            else:
                writer.write_batch(batch)


def pack(
    out,
    fields=None,
    *,
    arrow=None,
    from_parquet=None,
    name=None,
    codec="auto",
    byte_shuffle="auto",
    block_bytes=None,
    samples_per_shard=None,
    force=False,
    threads=None,
):
    """Packs a dataset at `out` (its parent must exist), as `gpufeed pack` does.

    fields: a mapping of field name to a NumPy array (samples along axis 0), to an iterable of
        arrays, each holding one or more samples along axis 0 (streamed to disk: one item in memory
        at a time; yield `sample[None]` for single samples), or to a `Ragged` (or a NumPy array of
        objects, each a sample's array): a variable-length field (format version 2).
    arrow: a pyarrow Table, RecordBatch or RecordBatchReader, or an iterable of record batches (or
        tables) of one schema, streamed to disk one at a time (instead of `fields`): each column a
        field of its name, as `from_parquet` packs a file's columns (a Hugging Face dataset's
        `.data.table`, for instance).
    from_parquet: Parquet or Arrow IPC files (`.parquet`, `.arrow`, ...) packed as one dataset, each
        column a field of its name (instead of `fields`).
    codec: "auto", "lz4" or "raw"; byte_shuffle: "auto", "on" or "off"; block_bytes: the largest raw
        block (an int, or a string such as "64K"); samples_per_shard, threads: as the CLI's flags.
    force: replace an existing dataset at `out`, only once the new one is complete.

    Returns the pack's summary line. Raises PackError with the CLI's error on failure; `out` is then
    untouched.
    """
    if sum(x is not None for x in (fields, arrow, from_parquet)) != 1:
        raise PackError("give exactly one of fields=, arrow= and from_parquet=")
    if codec not in _CODECS:
        raise PackError(f"codec {codec!r}: expected one of {', '.join(_CODECS)}")
    if byte_shuffle not in _BYTE_SHUFFLES:
        raise PackError(f"byte_shuffle {byte_shuffle!r}: expected one of {', '.join(_BYTE_SHUFFLES)}")
    out = os.path.abspath(os.fspath(out))
    command = [_binary(), "pack", "--quiet", "--out", out, "--codec", codec, "--byte-shuffle", byte_shuffle]
    if name is not None:
        command += ["--name", str(name)]
    if block_bytes is not None:
        command += ["--block-bytes", str(block_bytes)]
    if samples_per_shard is not None:
        command += ["--samples-per-shard", str(int(samples_per_shard))]
    if threads is not None:
        command += ["--threads", str(int(threads))]
    if force:
        command.append("--force")
    if from_parquet is not None:
        paths = [from_parquet] if isinstance(from_parquet, (str, os.PathLike)) else list(from_parquet)
        if not paths:
            raise PackError("from_parquet: no files given")
        return _run(command + [os.fspath(p) for p in paths])

    if arrow is not None:
        scratch = tempfile.mkdtemp(prefix=".gpufeed-pack-", dir=os.path.dirname(out))
        try:
            path = os.path.join(scratch, "table.arrow")
            _write_arrow(arrow, path)
            return _run(command + [path])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    import numpy as np

    if not fields:
        raise PackError("fields: nothing to pack")
    scratch = tempfile.mkdtemp(prefix=".gpufeed-pack-", dir=os.path.dirname(out))
    try:
        for index, (field, value) in enumerate(fields.items()):
            path = os.path.join(scratch, f"{index}.npy")
            if isinstance(value, np.ndarray) and value.dtype == object:
                value = Ragged.from_arrays(list(value))
            if isinstance(value, Ragged):
                offsets = os.path.join(scratch, f"{index}.offsets.npy")
                np.save(path, value.values, allow_pickle=False)
                np.save(offsets, value.offsets, allow_pickle=False)
                command += ["--offsets", f"{field}={offsets}"]
            elif isinstance(value, np.ndarray):
                np.save(path, np.ascontiguousarray(value), allow_pickle=False)
            else:
                _write_stream(np, field, value, path)
            command += ["--field", f"{field}={path}"]
        return _run(command)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(command):
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        message = done.stderr.strip()
        if message.startswith("error: "):
            message = message[len("error: ") :]
        raise PackError(message or f"gpufeed pack exited with status {done.returncode}")
    return done.stderr.strip()
