"""Writes token files as other tools do and checks what `gpufeed unpack` returns, with NumPy only.

    token_files.py write-megatron PREFIX DTYPE SEED   PREFIX.bin + PREFIX.idx, Megatron-LM's layout
    token_files.py write-flat PATH DTYPE SEED         a headerless .bin of token ids (nanoGPT)
    token_files.py write-npy PATH DTYPE SEED          a 1-D .npy
    token_files.py check TOKENS_FILE SEQ_LEN TOKENS_NPY [--dtype D] [--doc-start NPY]
    token_files.py check-documents DATASET BIN...

`check` reads TOKENS_FILE itself (for a Megatron .bin, through its .idx: sequences by pointer and
size, documents by the document indices), cuts it into SEQ_LEN-token rows dropping the remainder,
and compares the unpacked arrays exactly; it prints `ok SEQUENCES DROPPED`. `check-documents`
reads DATASET with `read_shards.py`'s independent reader and compares its variable-length `tokens`
field, sample by sample, with the documents of the Megatron BINs (in order); it prints
`ok DOCUMENTS`.
"""

import struct
import sys

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
DTYPES = {code: np.dtype(name) for name, code in CODES.items()}


def documents(seed, dtype):
    """Token documents of random lengths (some empty), Zipf-ish ids that fit the dtype."""
    rng = np.random.default_rng(seed)
    high = min(np.iinfo(dtype).max, 50_000)
    docs = []
    for i in range(int(rng.integers(20, 40))):
        length = int(rng.integers(0, 300))
        if i % 7 == 3:
            length = 0  # empty documents exist (Megatron's builder keeps them)
        docs.append((rng.zipf(1.3, length) % high).astype(dtype))
    return docs


def write_megatron(prefix, dtype, seed):
    dtype = np.dtype(dtype)
    docs = documents(seed, dtype)
    # As Megatron's builder: one sequence per document here, and every second document split in
    # two sequences, so that documents and sequences differ.
    sizes, document_indices = [], [0]
    with open(prefix + ".bin", "wb") as bin_file:
        for i, doc in enumerate(docs):
            parts = [doc] if i % 2 == 0 else [doc[: len(doc) // 2], doc[len(doc) // 2 :]]
            for part in parts:
                bin_file.write(part.tobytes(order="C"))
                sizes.append(len(part))
            document_indices.append(len(sizes))
    pointers, at = [], 0
    for size in sizes:
        pointers.append(at)
        at += size * dtype.itemsize
    with open(prefix + ".idx", "wb") as idx:
        idx.write(MAGIC)
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", CODES[dtype.name]))
        idx.write(struct.pack("<Q", len(sizes)))
        idx.write(struct.pack("<Q", len(document_indices)))
        idx.write(np.array(sizes, dtype=np.int32).tobytes(order="C"))
        idx.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        idx.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))


def read_megatron(bin_path):
    """The token stream and a per-token document-start mask, from the .idx and .bin."""
    idx_path = bin_path[: -len(".bin")] + ".idx"
    with open(idx_path, "rb") as f:
        raw = f.read()
    assert raw[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    dtype = DTYPES[raw[17]]
    count, doc_count = struct.unpack_from("<QQ", raw, 18)
    sizes = np.frombuffer(raw, np.int32, count, 34)
    pointers = np.frombuffer(raw, np.int64, count, 34 + 4 * count)
    doc_idx = np.frombuffer(raw, np.int64, doc_count, 34 + 12 * count)
    data = np.fromfile(bin_path, dtype=np.uint8)
    sequences = [data[p : p + s * dtype.itemsize].view(dtype) for p, s in zip(pointers, sizes)]
    stream = np.concatenate(sequences) if sequences else np.zeros(0, dtype)
    starts = np.zeros(len(stream), np.uint8)
    seq_start = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    for j in range(doc_count - 1):
        first, end = doc_idx[j], doc_idx[j + 1]
        if seq_start[end] > seq_start[first]:  # a document with tokens
            starts[seq_start[first]] = 1
    return stream, starts


def megatron_documents(bin_path):
    """Each document's tokens, from the .idx and .bin."""
    stream, _ = read_megatron(bin_path)
    with open(bin_path[: -len(".bin")] + ".idx", "rb") as f:
        raw = f.read()
    count, doc_count = struct.unpack_from("<QQ", raw, 18)
    sizes = np.frombuffer(raw, np.int32, count, 34)
    doc_idx = np.frombuffer(raw, np.int64, doc_count, 34 + 12 * count)
    seq_start = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    return [stream[seq_start[doc_idx[j]] : seq_start[doc_idx[j + 1]]] for j in range(doc_count - 1)]


def check_documents(dataset, bins):
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import read_shards

    manifest, fields = read_shards.read_dataset(dataset)
    (field,) = manifest["fields"]
    assert field["name"] == "tokens" and field.get("variable_length"), field
    ends, values = fields["tokens"]
    docs = [doc for path in bins for doc in megatron_documents(path)]
    assert len(ends) == len(docs), (len(ends), len(docs))
    assert any(len(doc) == 0 for doc in docs), "the test data should hold an empty document"
    start = 0
    for index, doc in enumerate(docs):
        end = int(ends[index])
        got = np.frombuffer(values, dtype=doc.dtype)[start:end]
        assert np.array_equal(got, doc), f"document {index} differs"
        start = end
    assert field["length_max"] == max(len(doc) for doc in docs)
    print("ok", len(docs))


def main(argv):
    command = argv[1]
    if command == "write-megatron":
        write_megatron(argv[2], argv[3], int(argv[4]))
    elif command == "write-flat":
        np.concatenate(documents(int(argv[4]), np.dtype(argv[3]))).tofile(argv[2])
    elif command == "write-npy":
        np.save(argv[2], np.concatenate(documents(int(argv[4]), np.dtype(argv[3]))))
    elif command == "check":
        source, seq_len, unpacked = argv[2], int(argv[3]), argv[4]
        options = dict(zip(argv[5::2], argv[6::2]))
        starts = None
        if source.endswith(".npy"):
            stream = np.load(source)
        elif "--dtype" in options:
            stream = np.fromfile(source, dtype=np.dtype(options["--dtype"]))
        else:
            stream, starts = read_megatron(source)
        rows = len(stream) // seq_len
        expected = stream[: rows * seq_len].reshape(rows, seq_len)
        got = np.load(unpacked)
        assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
        assert got.shape == expected.shape, (got.shape, expected.shape)
        assert np.array_equal(got, expected), "token values differ"
        if "--doc-start" in options:
            got_starts = np.load(options["--doc-start"])
            expected_starts = starts[: rows * seq_len].reshape(rows, seq_len)
            assert got_starts.dtype == np.uint8, got_starts.dtype
            assert np.array_equal(got_starts, expected_starts), "doc_start differs"
            assert expected_starts.sum() > 1, "the test data should hold several documents"
        print("ok", rows, len(stream) - rows * seq_len)
    elif command == "check-documents":
        check_documents(argv[2], argv[3:])
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main(sys.argv)
