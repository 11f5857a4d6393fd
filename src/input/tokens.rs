//! Token files as pack inputs, cut into fixed-length sequences: Megatron-LM indexed datasets
//! (`PREFIX.bin` + `PREFIX.idx`), flat token arrays (a headerless `.bin` of `uint16` or `uint32`
//! ids, the dtype given by the caller, as nanoGPT writes them) and 1-D `.npy` arrays.
//!
//! The tokens of an input are read as one stream (for a Megatron dataset, its sequences back to
//! back in index order) and cut into `floor(tokens / seq_len)` samples of field `tokens`, shape
//! `[seq_len]`, in the input's dtype; the `tokens % seq_len` remainder tokens at the end, which do
//! not fill a sequence, are dropped and reported ([`TokenCut::dropped_tokens`]). A Megatron input
//! also gets field `doc_start`, `uint8` of shape `[seq_len]`: 1 at each position where a document
//! starts (the first token of the first sequence of each non-empty document, per the index's
//! document indices), 0 elsewhere. Like the token ids it lines up with, it says where attention
//! must not cross and where position ids restart, and it stores in almost nothing (LZ4 shrinks
//! runs of zeros). It is computed from the index as blocks are packed, not held in memory.
//! Several inputs of one dtype pack as one dataset ([`cut_all`]): each is cut on its own, so a
//! sequence never spans two files, and each file's remainder is dropped.
//!
//! Instead of cutting, Megatron inputs may be packed one sample per document ([`documents_all`]):
//! field `tokens` is then variable-length (format version 2), each sample a document's tokens (an
//! empty document an empty sample), nothing dropped; the documents' ends are taken from the index
//! (8 bytes a document in memory while packing).
//!
//! The `.idx` layout (version 1, all little-endian), as Megatron-LM's `_IndexWriter` writes it:
//!
//! | offset | bytes | what |
//! |---|---|---|
//! | 0 | 9 | magic `MMIDIDX\x00\x00` |
//! | 9 | 8 | version, u64 = 1 |
//! | 17 | 1 | dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 |
//! | 18 | 8 | sequence count `S`, u64 |
//! | 26 | 8 | document index count `D`, u64 (documents + 1) |
//! | 34 | 4·S | sequence sizes in tokens, i32 |
//! | 34 + 4·S | 8·S | sequence pointers: byte offsets into the `.bin`, i64 |
//! | 34 + 12·S | 8·D | document indices: document `j` is sequences `[d[j], d[j+1])`, i64 |
//!
//! A multimodal index (a mode byte per sequence after the document indices) is refused. Every index
//! is checked against its `.bin` before anything is packed: the pointers must start at 0 and each
//! follow the previous sequence's end (the writer's layout, which lets the `.bin` be read as one
//! stream), the sizes must end exactly at the `.bin`'s length, and the document indices must start
//! at 0, not decrease, and end at `S`. An error names the index and the sequence or document index
//! at fault.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed_proto::DType;

use super::{
    map_file, open_npy_field, Backing, FieldSource, GeneratedBytes, InputError, SourcePart,
};

/// The magic that starts a Megatron-LM `.idx` file.
pub const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// Bytes of a Megatron `.idx` header: magic, version, dtype code, sequence and document counts.
pub const MEGATRON_HEADER_BYTES: usize = 34;

/// Name of the field of token ids.
pub const TOKENS_FIELD: &str = "tokens";

/// Name of the field that marks document starts (Megatron inputs only).
pub const DOC_START_FIELD: &str = "doc_start";

/// What kind of token file an input is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenFormat {
    /// A Megatron-LM indexed dataset; the `.idx` beside the `.bin`.
    Megatron {
        /// The index file.
        index: PathBuf,
        /// Sequences in the index.
        sequences: u64,
        /// Documents in the index (its document index count less one).
        documents: u64,
    },
    /// A headerless `.bin` of token ids of a dtype given by the caller.
    Flat,
    /// A 1-D NumPy array.
    Npy,
}

/// An opened token input: its token stream, checked, ready to be cut into sequences.
#[derive(Debug)]
pub struct TokenInput {
    /// The file holding the token ids (`.bin` or `.npy`).
    pub path: PathBuf,
    /// What kind of input it is.
    pub format: TokenFormat,
    /// The token ids' dtype.
    pub dtype: DType,
    /// Tokens in the stream.
    pub tokens: u64,
    data: Arc<Backing>,
    data_offset: usize,
    index: Option<IndexLayout>,
}

/// Where the arrays of a checked Megatron index lie in its mapping.
#[derive(Clone, Debug)]
struct IndexLayout {
    backing: Arc<Backing>,
    sequences: u64,
    document_entries: u64,
    pointers_at: usize,
    documents_at: usize,
}

/// The fields a token input is cut into.
#[derive(Debug)]
pub struct TokenCut {
    /// `tokens`, and `doc_start` for a Megatron input.
    pub fields: Vec<FieldSource>,
    /// Sequences (samples) cut.
    pub sequences: u64,
    /// Tokens at the end that did not fill a sequence and were dropped.
    pub dropped_tokens: u64,
}

/// Whether `path` names a token file by its extension alone (`.bin` or `.idx`); a `.npy` may be
/// either an array or a token stream and is read as tokens only when asked.
pub fn is_token_path(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("bin") | Some("idx")
    )
}

fn bad(path: &Path, reason: impl Into<String>) -> InputError {
    InputError::Tokens {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The gpufeed dtype of a Megatron dtype code, or why it cannot hold token ids.
fn megatron_dtype(code: u8) -> Result<DType, String> {
    Ok(match code {
        1 => DType::U8,
        2 => DType::I8,
        3 => DType::I16,
        4 => DType::I32,
        5 => DType::I64,
        8 => DType::U16,
        6 | 7 => {
            return Err(format!(
                "dtype code {code} ({}) is not an integer type; token ids must be integers",
                if code == 6 { "float64" } else { "float32" }
            ))
        }
        _ => return Err(format!("unknown dtype code {code} (Megatron uses 1 to 8)")),
    })
}

fn is_integer(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::U8
            | DType::I8
            | DType::U16
            | DType::I16
            | DType::U32
            | DType::I32
            | DType::U64
            | DType::I64
    )
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn read_i64(bytes: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn read_i32(bytes: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

/// Opens a token input: `PREFIX.idx`, or `PREFIX.bin` with `PREFIX.idx` beside it, as a Megatron
/// dataset; another `.bin` as flat token ids of `flat_dtype` (required then); a `.npy` as a 1-D
/// array of integer ids. `flat_dtype`, when given for a Megatron dataset, must match its index.
pub fn open_tokens(path: &Path, flat_dtype: Option<DType>) -> Result<TokenInput, InputError> {
    let extension = path.extension().and_then(|e| e.to_str());
    match extension {
        Some("idx") => open_megatron(&path.with_extension("bin"), path, flat_dtype),
        Some("bin") => {
            let index = path.with_extension("idx");
            if index.exists() {
                open_megatron(path, &index, flat_dtype)
            } else {
                let Some(dtype) = flat_dtype else {
                    return Err(bad(
                        path,
                        format!(
                            "a flat token file needs its dtype (--token-dtype u16 or u32); there is no Megatron index {} beside it",
                            index.display()
                        ),
                    ));
                };
                open_flat(path, dtype)
            }
        }
        Some("npy") => open_npy_tokens(path),
        _ => Err(bad(
            path,
            "not a token file: expected a Megatron PREFIX.bin or PREFIX.idx, a flat token .bin, or a 1-D .npy",
        )),
    }
}

fn open_flat(path: &Path, dtype: DType) -> Result<TokenInput, InputError> {
    if !is_integer(dtype) {
        return Err(bad(
            path,
            format!("token dtype {dtype} is not an integer type"),
        ));
    }
    let data = map_file(path)?;
    let len = data.len() as u64;
    let width = dtype.size_bytes() as u64;
    if len % width != 0 {
        return Err(bad(
            path,
            format!(
                "{len} bytes is not a whole number of {dtype} tokens ({width} bytes each): is --token-dtype right?"
            ),
        ));
    }
    Ok(TokenInput {
        path: path.to_path_buf(),
        format: TokenFormat::Flat,
        dtype,
        tokens: len / width,
        data,
        data_offset: 0,
        index: None,
    })
}

fn open_npy_tokens(path: &Path) -> Result<TokenInput, InputError> {
    let field = open_npy_field(TOKENS_FIELD, &[path.to_path_buf()])?;
    if !field.sample_shape.is_empty() {
        let mut shape = vec![field.sample_count()];
        shape.extend_from_slice(&field.sample_shape);
        return Err(bad(
            path,
            format!("a token .npy must be 1-D, but its shape is {shape:?}"),
        ));
    }
    if !is_integer(field.dtype) {
        return Err(bad(
            path,
            format!(
                "dtype {} is not an integer type; token ids must be integers",
                field.dtype
            ),
        ));
    }
    let part = field.parts.into_iter().next().expect("one file, one part");
    Ok(TokenInput {
        path: path.to_path_buf(),
        format: TokenFormat::Npy,
        dtype: field.dtype,
        tokens: part.samples,
        data: part.backing,
        data_offset: part.data_offset,
        index: None,
    })
}

fn open_megatron(
    bin: &Path,
    idx: &Path,
    flat_dtype: Option<DType>,
) -> Result<TokenInput, InputError> {
    let index_backing = map_file(idx)?;
    let bytes = index_backing.bytes();
    let len = bytes.len();
    if len < MEGATRON_HEADER_BYTES {
        return Err(bad(
            idx,
            format!("truncated Megatron index: {len} bytes, fewer than the {MEGATRON_HEADER_BYTES}-byte header"),
        ));
    }
    if &bytes[..9] != MEGATRON_MAGIC {
        return Err(bad(
            idx,
            "not a Megatron index: it does not start with the magic MMIDIDX\\x00\\x00",
        ));
    }
    let version = read_u64(bytes, 9);
    if version != 1 {
        return Err(bad(
            idx,
            format!("unsupported Megatron index version {version} (only 1 is known)"),
        ));
    }
    let dtype = megatron_dtype(bytes[17]).map_err(|reason| bad(idx, reason))?;
    if let Some(given) = flat_dtype {
        if given != dtype {
            return Err(bad(
                idx,
                format!("--token-dtype {given} disagrees with the index's dtype {dtype}"),
            ));
        }
    }
    let sequences = read_u64(bytes, 18);
    let document_entries = read_u64(bytes, 26);
    let expected =
        MEGATRON_HEADER_BYTES as u128 + 12 * sequences as u128 + 8 * document_entries as u128;
    let actual = len as u128;
    if actual != expected {
        let reason = if actual == expected + sequences as u128 && sequences > 0 {
            "a multimodal index (a mode byte per sequence) is not supported".to_string()
        } else if actual < expected {
            format!(
                "truncated: the header gives {sequences} sequences and {document_entries} document indices, {expected} bytes of index, but the file has {len}"
            )
        } else {
            format!(
                "{} trailing bytes: the header gives {sequences} sequences and {document_entries} document indices, {expected} bytes of index, but the file has {len}",
                actual - expected
            )
        };
        return Err(bad(idx, reason));
    }
    // The index fits in the mapping, so these fit in a usize.
    let sequences_usize = sequences as usize;
    let pointers_at = MEGATRON_HEADER_BYTES + 4 * sequences_usize;
    let documents_at = pointers_at + 8 * sequences_usize;

    let data = map_file(bin)?;
    let bin_len = data.len() as u64;
    let width = dtype.size_bytes() as u64;
    let mut end = 0u64;
    for i in 0..sequences_usize {
        let size = read_i32(bytes, MEGATRON_HEADER_BYTES + 4 * i);
        let pointer = read_i64(bytes, pointers_at + 8 * i);
        if size < 0 {
            return Err(bad(idx, format!("sequence {i}: negative size {size}")));
        }
        if pointer != end as i64 {
            let reason = if i == 0 {
                format!("sequence 0: pointer {pointer}, but the first sequence must start at byte 0 of the .bin")
            } else if pointer < end as i64 {
                format!(
                    "sequence {i}: pointer {pointer} does not increase past the end of sequence {} (byte {end})",
                    i - 1
                )
            } else {
                format!(
                    "sequence {i}: pointer {pointer} leaves a gap after sequence {} (which ends at byte {end}); sequences must lie back to back in the .bin",
                    i - 1
                )
            };
            return Err(bad(idx, reason));
        }
        end += size as u64 * width;
        if end > bin_len {
            return Err(bad(
                idx,
                format!(
                    "sequence {i}: the sizes sum to {end} bytes by its end, past the {bin_len} bytes of {}",
                    bin.display()
                ),
            ));
        }
    }
    if end != bin_len {
        return Err(bad(
            idx,
            format!(
                "the sizes of its {sequences} sequences sum to {end} bytes, but {} has {bin_len}: the index does not describe that .bin",
                bin.display()
            ),
        ));
    }
    check_documents(idx, bytes, documents_at, document_entries, sequences)?;
    Ok(TokenInput {
        path: bin.to_path_buf(),
        format: TokenFormat::Megatron {
            index: idx.to_path_buf(),
            sequences,
            documents: document_entries - 1,
        },
        dtype,
        tokens: bin_len / width,
        data,
        data_offset: 0,
        index: Some(IndexLayout {
            backing: index_backing,
            sequences,
            document_entries,
            pointers_at,
            documents_at,
        }),
    })
}

/// Checks a Megatron index's document indices (at byte `documents_at` of `bytes`, `document_entries`
/// of them): 0 first, never decreasing, within the `sequences`, ending at the sequence count.
fn check_documents(
    idx: &Path,
    bytes: &[u8],
    documents_at: usize,
    document_entries: u64,
    sequences: u64,
) -> Result<(), InputError> {
    if document_entries == 0 {
        return Err(bad(
            idx,
            "no document indices (a valid index has at least the leading 0)",
        ));
    }
    let mut previous = 0i64;
    for j in 0..document_entries as usize {
        let document = read_i64(bytes, documents_at + 8 * j);
        if j == 0 && document != 0 {
            return Err(bad(
                idx,
                format!("document index 0 is {document}, but it must be 0"),
            ));
        }
        if document < previous {
            return Err(bad(
                idx,
                format!(
                    "document index {j} is {document}, less than document index {} ({previous})",
                    j - 1
                ),
            ));
        }
        if document as u64 > sequences {
            return Err(bad(
                idx,
                format!("document index {j} is {document}, past the {sequences} sequences"),
            ));
        }
        previous = document;
    }
    if previous as u64 != sequences {
        return Err(bad(
            idx,
            format!(
                "the last document index ({}) is {previous}, but the index has {sequences} sequences: sequences after it belong to no document",
                document_entries - 1
            ),
        ));
    }
    Ok(())
}

impl TokenInput {
    /// Cuts the token stream into sequences of `seq_len` tokens: field `tokens` (and `doc_start` for
    /// a Megatron input), dropping the remainder.
    pub fn cut(&self, seq_len: u64) -> Result<TokenCut, InputError> {
        cut_all(std::slice::from_ref(self), seq_len)
    }

    /// [`TokenInput::cut`] of this input alone, which may give no sequence.
    fn cut_one(&self, seq_len: u64) -> Result<TokenCut, InputError> {
        let sequences = self.tokens / seq_len;
        let width = self.dtype.size_bytes();
        let sample_bytes = usize::try_from(seq_len)
            .ok()
            .and_then(|n| n.checked_mul(width))
            .ok_or_else(|| bad(&self.path, format!("--seq-len {seq_len} is too large")))?;
        let tokens = FieldSource {
            ends: None,
            name: TOKENS_FIELD.into(),
            dtype: self.dtype,
            sample_shape: vec![seq_len],
            parts: vec![SourcePart::new(
                &self.path,
                Arc::clone(&self.data),
                self.data_offset,
                sequences,
                sample_bytes,
            )?],
        };
        let mut fields = vec![tokens];
        if let (Some(layout), TokenFormat::Megatron { index, .. }) = (&self.index, &self.format) {
            let starts = DocStarts {
                path: index.clone(),
                layout: layout.clone(),
                width: width as u64,
                total_tokens: self.tokens,
                kept_tokens: sequences * seq_len,
            };
            fields.push(FieldSource {
                ends: None,
                name: DOC_START_FIELD.into(),
                dtype: DType::U8,
                sample_shape: vec![seq_len],
                parts: vec![SourcePart::new(
                    index,
                    Arc::new(Backing::Generated(Box::new(starts))),
                    0,
                    sequences,
                    seq_len as usize,
                )?],
            });
        }
        Ok(TokenCut {
            fields,
            sequences,
            dropped_tokens: self.tokens - sequences * seq_len,
        })
    }

    /// What `gpufeed list-inputs` prints for this input: its kind, tokens, documents and dtype, and
    /// with `seq_len` the sequences, dropped tokens and fields a pack would make.
    pub fn describe(&self, seq_len: Option<u64>) -> String {
        let mut text = match &self.format {
            TokenFormat::Megatron {
                index,
                sequences,
                documents,
            } => format!(
                "{}: Megatron-LM indexed dataset (index {}): {} {} tokens in {sequences} sequences, {documents} documents",
                self.path.display(),
                index.display(),
                self.tokens,
                self.dtype
            ),
            TokenFormat::Flat => format!(
                "{}: flat token file: {} {} tokens",
                self.path.display(),
                self.tokens,
                self.dtype
            ),
            TokenFormat::Npy => format!(
                "{}: 1-D NumPy token array: {} {} tokens",
                self.path.display(),
                self.tokens,
                self.dtype
            ),
        };
        match seq_len {
            Some(n) if n > 0 => {
                let sequences = self.tokens / n;
                let _ = write!(
                    text,
                    "\n  --seq-len {n}: {sequences} sequences, {} remainder tokens dropped; fields {TOKENS_FIELD} {} [{n}]",
                    self.tokens - sequences * n,
                    self.dtype
                );
                if self.index.is_some() {
                    let _ = write!(text, ", {DOC_START_FIELD} u8 [{n}]");
                }
            }
            _ => text.push_str("\n  (give --seq-len N to see the sequences a pack would cut)"),
        }
        text
    }
}

/// The documents of several Megatron inputs of one dtype as one variable-length field `tokens`, a
/// sample per document, the inputs' documents one after another in the order given. An input
/// without document boundaries (a flat `.bin`, a `.npy`) is refused naming it.
pub fn documents_all(inputs: &[TokenInput]) -> Result<FieldSource, InputError> {
    let Some(first) = inputs.first() else {
        return Err(InputError::NoFiles {
            name: TOKENS_FIELD.into(),
        });
    };
    let width = first.dtype.size_bytes();
    let mut parts = Vec::with_capacity(inputs.len());
    let mut ends = Vec::new();
    let mut base = 0u64;
    for input in inputs {
        if input.dtype != first.dtype {
            return Err(InputError::DtypeMismatch {
                path: input.path.clone(),
                expected: first.dtype,
                found: input.dtype,
                first: first.path.clone(),
            });
        }
        let Some(layout) = &input.index else {
            return Err(bad(
                &input.path,
                "has no document boundaries (only a Megatron-LM .bin/.idx pair has them): pack it with --seq-len instead of --documents",
            ));
        };
        let TokenFormat::Megatron { index, .. } = &input.format else {
            unreachable!("only Megatron inputs have an index")
        };
        let starts = DocStarts {
            path: index.clone(),
            layout: layout.clone(),
            width: width as u64,
            total_tokens: input.tokens,
            kept_tokens: input.tokens,
        };
        let bytes = layout.backing.bytes();
        // Document j ends where document j + 1 starts (checked: non-decreasing, the last at the
        // stream's end).
        ends.extend((1..layout.document_entries).map(|j| base + starts.start(bytes, j)));
        layout.backing.check(index)?;
        parts.push(SourcePart::new(
            &input.path,
            Arc::clone(&input.data),
            input.data_offset,
            input.tokens,
            width,
        )?);
        base += input.tokens;
    }
    if ends.is_empty() {
        return Err(bad(&first.path, "the inputs hold no document"));
    }
    let values = FieldSource {
        ends: None,
        name: TOKENS_FIELD.into(),
        dtype: first.dtype,
        sample_shape: Vec::new(),
        parts,
    };
    FieldSource::variable(values, ends)
}

/// Cuts several token inputs into one dataset's fields: each input is cut on its own (a sequence
/// never spans two files, and each file's remainder is dropped), and their sequences follow one
/// another in the order given. The inputs must share a dtype and all be Megatron datasets (with
/// `doc_start`) or none; an error names the first file that differs.
pub fn cut_all(inputs: &[TokenInput], seq_len: u64) -> Result<TokenCut, InputError> {
    let Some(first) = inputs.first() else {
        return Err(InputError::NoFiles {
            name: TOKENS_FIELD.into(),
        });
    };
    if seq_len == 0 {
        return Err(bad(&first.path, "--seq-len must be at least 1"));
    }
    let mut total = first.cut_one(seq_len)?;
    for input in &inputs[1..] {
        if input.dtype != first.dtype {
            return Err(InputError::DtypeMismatch {
                path: input.path.clone(),
                expected: first.dtype,
                found: input.dtype,
                first: first.path.clone(),
            });
        }
        if input.index.is_some() != first.index.is_some() {
            let megatron = |i: &TokenInput| {
                if i.index.is_some() {
                    "a Megatron dataset (with document boundaries)"
                } else {
                    "a token array without document boundaries"
                }
            };
            return Err(bad(
                &input.path,
                format!(
                    "is {}, but {} is {}; token files packed together must all have document boundaries or none",
                    megatron(input),
                    first.path.display(),
                    megatron(first)
                ),
            ));
        }
        let cut = input.cut_one(seq_len)?;
        for (field, more) in total.fields.iter_mut().zip(cut.fields) {
            field.parts.extend(more.parts);
        }
        total.sequences += cut.sequences;
        total.dropped_tokens += cut.dropped_tokens;
    }
    if total.sequences == 0 {
        let tokens: u64 = inputs.iter().map(|i| i.tokens).sum();
        return Err(bad(
            &first.path,
            format!(
                "{tokens} tokens{} are fewer than one sequence of --seq-len {seq_len}",
                if inputs.len() > 1 {
                    " (over all files, each cut on its own)"
                } else {
                    ""
                }
            ),
        ));
    }
    Ok(total)
}

/// The `doc_start` field's bytes, computed from a checked Megatron index: byte `t` is 1 if a
/// non-empty document starts at token `t` of the stream, else 0. Its length is the tokens kept.
#[derive(Debug)]
struct DocStarts {
    path: PathBuf,
    layout: IndexLayout,
    width: u64,
    total_tokens: u64,
    kept_tokens: u64,
}

impl DocStarts {
    /// Token at which document index `j` starts (the stream's end for an index equal to the
    /// sequence count); non-decreasing in `j`, since the index was checked.
    fn start(&self, bytes: &[u8], j: u64) -> u64 {
        let sequence = read_i64(bytes, self.layout.documents_at + 8 * j as usize) as u64;
        if sequence >= self.layout.sequences {
            return self.total_tokens;
        }
        read_i64(bytes, self.layout.pointers_at + 8 * sequence as usize) as u64 / self.width
    }
}

impl GeneratedBytes for DocStarts {
    fn len(&self) -> usize {
        self.kept_tokens as usize
    }

    /// Appends bytes `[begin, end)` of the field's byte stream (one byte per token) to `out`.
    fn append(&self, begin: usize, end: usize, out: &mut Vec<u8>) {
        let bytes = self.layout.backing.bytes();
        let (begin, end) = (begin as u64, end as u64);
        let base = out.len();
        out.resize(base + (end - begin) as usize, 0);
        // The first document index that starts at or after `begin`.
        let (mut low, mut high) = (0u64, self.layout.document_entries);
        while low < high {
            let middle = low + (high - low) / 2;
            if self.start(bytes, middle) < begin {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        let mut j = low;
        while j < self.layout.document_entries {
            let start = self.start(bytes, j);
            if start >= end {
                break;
            }
            out[base + (start - begin) as usize] = 1;
            j += 1;
        }
    }

    /// Fails, naming the index, if it changed since it was opened.
    fn check(&self) -> Result<(), InputError> {
        self.layout.backing.check(&self.path)
    }
}
