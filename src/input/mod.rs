//! Readers of pack inputs (NumPy `.npy`, safetensors, token files: [`tokens`], Parquet and Arrow
//! IPC: [`arrow`]), and the `.npy` writer used by `unpack`.
//!
//! A pack input is turned into a [`FieldSource`]: a dtype, a per-sample shape and a list of
//! memory-mapped file regions whose concatenation along axis 0 is the field's samples. Nothing is
//! read into memory up front, so packing a dataset larger than RAM only costs page cache.
//!
//! Every input is untrusted: headers are validated and every region is bounds-checked against the
//! file length when it is opened, so [`FieldSource::copy_samples`] can slice without re-checking.

pub mod arrow;
pub mod npy;
mod parquet_pages;
pub mod safetensors;
pub mod tokens;

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed_proto::DType;

use crate::storage::mapped::{MapChange, MappedFile};

pub use self::npy::{open_npy_field, write_npy, NpyHeader, NpyWriter};
pub use self::safetensors::open_safetensors_field;

/// Largest `.npy` header we parse. numpy itself refuses headers over 10 000 bytes by default; a real
/// header is ~128 bytes, so anything near this limit is corrupt and not worth the memory.
const MAX_HEADER_LEN: usize = 1 << 20;

/// Deepest nesting of tuples/lists/dicts we follow in a `.npy` header, so a hostile header cannot
/// overflow the stack of the recursive-descent parser.
const MAX_NESTING: usize = 32;

/// What is wrong with a `.npy` header's text (the file is named by [`InputError::BadHeader`]). Here
/// beside [`InputError`] rather than in [`npy`], which builds on this module and is not imported back.
#[derive(Debug, thiserror::Error)]
pub enum NpyHeaderError {
    /// The header length field exceeds the bound.
    #[error("header length {0} exceeds the {MAX_HEADER_LEN}-byte limit")]
    TooLong(usize),
    /// A version 3.0 header is not UTF-8.
    #[error("version 3.0 header is not UTF-8: {0}")]
    NotUtf8(std::str::Utf8Error),
    /// A required key is absent.
    #[error("missing key '{key}' in {header}")]
    MissingKey {
        /// The key.
        key: &'static str,
        /// The header text.
        header: String,
    },
    /// `'fortran_order'` is not a boolean.
    #[error("'fortran_order' is {0}, not True or False")]
    FortranOrderNotBool(String),
    /// `'shape'` is not a tuple or list.
    #[error("'shape' is {0}, not a tuple")]
    ShapeNotTuple(String),
    /// A dimension is negative.
    #[error("negative dimension {dimension} in shape {shape}")]
    NegativeDimension {
        /// The dimension.
        dimension: i128,
        /// The shape, as written.
        shape: String,
    },
    /// A dimension does not fit 64 bits.
    #[error("dimension {dimension} in shape {shape} is too large")]
    DimensionTooLarge {
        /// The dimension.
        dimension: i128,
        /// The shape, as written.
        shape: String,
    },
    /// A dimension is not an integer.
    #[error("dimension {dimension} in shape {shape} is not an integer")]
    DimensionNotInteger {
        /// The dimension, as written.
        dimension: String,
        /// The shape, as written.
        shape: String,
    },
    /// The header is not one dict.
    #[error("header is not a dict: {0}")]
    NotADict(String),
    /// Text follows the header dict.
    #[error("unexpected text after the header dict at offset {0}")]
    TrailingText(usize),
    /// A key of the header dict is not a string.
    #[error("header key {0} is not a string")]
    KeyNotString(String),
    /// A key appears twice.
    #[error("duplicate header key '{0}'")]
    DuplicateKey(String),
    /// Literals nest deeper than the bound.
    #[error("nesting deeper than {MAX_NESTING} levels")]
    TooDeep,
    /// A bare name other than True, False, None or a string prefix.
    #[error("unexpected name {name:?} at offset {offset}")]
    UnexpectedName {
        /// The name.
        name: String,
        /// Where it starts.
        offset: usize,
    },
    /// A character that starts no literal.
    #[error("unexpected {found} at offset {offset}")]
    Unexpected {
        /// The character, or the end of the header.
        found: String,
        /// Where.
        offset: usize,
    },
    /// A tuple or list item is followed by neither a comma nor the closing bracket.
    #[error("expected ',' or {close:?} at offset {offset}, found {found}")]
    ExpectedSeparator {
        /// The closing bracket.
        close: char,
        /// Where.
        offset: usize,
        /// What was there instead.
        found: String,
    },
    /// A dict key is not followed by a colon.
    #[error("expected ':' after key {key}, found {found}")]
    ExpectedColon {
        /// The key, as written.
        key: String,
        /// What was there instead.
        found: String,
    },
    /// A dict entry is followed by neither a comma nor `}`.
    #[error("expected ',' or '}}' at offset {offset}, found {found}")]
    ExpectedDictSeparator {
        /// Where.
        offset: usize,
        /// What was there instead.
        found: String,
    },
    /// The header ends where a string should start.
    #[error("expected a string at end of header")]
    StringAtEnd,
    /// A string has no closing quote.
    #[error("unterminated string starting at offset {0}")]
    UnterminatedString(usize),
    /// An integer does not fit 128 bits.
    #[error("integer at offset {0} is too large")]
    IntegerTooLarge(usize),
    /// A sign without digits.
    #[error("expected digits at offset {0}")]
    ExpectedDigits(usize),
}

/// Errors reading pack inputs (and writing `.npy` outputs); every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// The file could not be opened, mapped, read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file at fault.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the `.npy` magic `\x93NUMPY`.
    #[error("{}: not a NumPy .npy file (missing the \\x93NUMPY magic)", path.display())]
    NotNpy {
        /// The file at fault.
        path: PathBuf,
    },
    /// The `.npy` format version is not 1.0, 2.0 or 3.0.
    #[error("{}: unsupported .npy format version {major}.{minor} (supported: 1.0, 2.0, 3.0)", path.display())]
    UnsupportedNpyVersion {
        /// The file at fault.
        path: PathBuf,
        /// Major version byte.
        major: u8,
        /// Minor version byte.
        minor: u8,
    },
    /// The `.npy` header dictionary is malformed or misses a key.
    #[error("{}: bad .npy header: {reason}", path.display())]
    BadHeader {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: NpyHeaderError,
    },
    /// The array is stored in Fortran (column-major) order.
    #[error(
        "{}: Fortran-order (column-major) arrays are not supported, even where the layout would \
         match C order; re-save it with np.save(path, np.ascontiguousarray(a))",
        path.display()
    )]
    FortranOrder {
        /// The file at fault.
        path: PathBuf,
    },
    /// The element type has no gpufeed dtype.
    #[error("{}: unsupported dtype {descr:?}: {detail}", path.display())]
    UnsupportedDtype {
        /// The file at fault.
        path: PathBuf,
        /// The dtype as the file spells it (`.npy` descr, safetensors dtype, or gpufeed name).
        descr: String,
        /// Why it is unsupported and, where there is one, what to do instead.
        detail: String,
    },
    /// The array is big-endian; gpufeed serves little-endian data only.
    #[error(
        "{}: big-endian dtype {descr:?} is not supported; convert it with \
         a.astype(a.dtype.newbyteorder('<'))",
        path.display()
    )]
    BigEndian {
        /// The file at fault.
        path: PathBuf,
        /// The `.npy` descr.
        descr: String,
    },
    /// The file is shorter than its header says.
    #[error("{}: truncated: the header implies {expected_bytes} bytes but the file has {actual_bytes}", path.display())]
    Truncated {
        /// The file at fault.
        path: PathBuf,
        /// File size implied by the header.
        expected_bytes: u64,
        /// Actual file size.
        actual_bytes: u64,
    },
    /// The file is longer than its header says (a sign of a corrupt or mislabeled file).
    #[error("{}: {} unexpected trailing bytes: the header implies {expected_bytes} bytes but the file has {actual_bytes}",
        path.display(), actual_bytes.saturating_sub(*expected_bytes))]
    TrailingBytes {
        /// The file at fault.
        path: PathBuf,
        /// File size implied by the header.
        expected_bytes: u64,
        /// Actual file size.
        actual_bytes: u64,
    },
    /// The array has no dimensions, so there is no sample axis.
    #[error("{}: 0-d (scalar) array: there is no axis 0 to take samples along", path.display())]
    ScalarArray {
        /// The file at fault.
        path: PathBuf,
    },
    /// The per-sample shape contains a 0, so every sample would be zero bytes.
    #[error("{}: per-sample shape {shape:?} contains 0, so every sample would be empty", path.display())]
    EmptySample {
        /// The file at fault.
        path: PathBuf,
        /// The per-sample shape (dims 1..).
        shape: Vec<u64>,
    },
    /// The shape's byte size does not fit in memory-addressable integers.
    #[error("{}: shape {shape:?} is too large (its byte size overflows)", path.display())]
    ShapeOverflow {
        /// The file at fault.
        path: PathBuf,
        /// The full shape.
        shape: Vec<u64>,
    },
    /// A file to concatenate has a different per-sample shape than the first file.
    #[error(
        "{}: per-sample shape {found:?} differs from {expected:?} of {}; files concatenated into one \
         field must agree on all dims but the first",
        path.display(), first.display()
    )]
    ShapeMismatch {
        /// The first file that differs.
        path: PathBuf,
        /// Per-sample shape of the first file.
        expected: Vec<u64>,
        /// Per-sample shape of this file.
        found: Vec<u64>,
        /// The first file of the field, which sets the expected shape.
        first: PathBuf,
    },
    /// A file to concatenate has a different dtype than the first file.
    #[error(
        "{}: dtype {found} differs from {expected} of {}; files concatenated into one field must share a dtype",
        path.display(), first.display()
    )]
    DtypeMismatch {
        /// The first file that differs.
        path: PathBuf,
        /// Dtype of the first file.
        expected: DType,
        /// Dtype of this file.
        found: DType,
        /// The first file of the field, which sets the expected dtype.
        first: PathBuf,
    },
    /// The safetensors file is malformed.
    #[error("{}: bad safetensors file: {reason}", path.display())]
    Safetensors {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The safetensors header names a key twice (the `safetensors` crate would keep the last).
    #[error("{}: the safetensors header gives {key:?} twice: which one is meant is ambiguous, so the file is refused", path.display())]
    DuplicateKey {
        /// The file at fault.
        path: PathBuf,
        /// The key given twice.
        key: String,
    },
    /// A tensor of the safetensors header breaks a rule of the format, which refuses the whole file.
    #[error("{}: tensor {tensor:?}: {reason}; a safetensors file with such a tensor cannot be packed", path.display())]
    BadTensor {
        /// The file at fault.
        path: PathBuf,
        /// The tensor at fault.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The safetensors file has no tensor of that name.
    #[error("{}: no tensor named {tensor:?}; available: {}", path.display(), list_names(available, *omitted))]
    TensorNotFound {
        /// The file at fault.
        path: PathBuf,
        /// The tensor asked for.
        tensor: String,
        /// Tensor names in the file, sorted; at most 20.
        available: Vec<String>,
        /// How many more names the file has beyond those listed.
        omitted: usize,
    },
    /// An in-memory field's byte length is not a whole number of samples.
    #[error(
        "in-memory field {name:?}: {len} bytes is not a multiple of the sample size {sample_bytes} \
         (dtype {dtype}, sample shape {sample_shape:?})"
    )]
    InMemorySize {
        /// The field's name (an in-memory field has no file).
        name: String,
        /// The dtype.
        dtype: DType,
        /// The per-sample shape.
        sample_shape: Vec<u64>,
        /// Bytes per sample (0 when the shape contains 0).
        sample_bytes: usize,
        /// The length of the buffer given.
        len: usize,
    },
    /// A field was asked to concatenate an empty list of files.
    #[error("field {name:?}: no input files given")]
    NoFiles {
        /// The field's name (there is no file to name).
        name: String,
    },
    /// The file changed while it was read (truncated, or saved again, during a pack): what was read
    /// of it cannot be trusted.
    #[error("{}: {reason}; the pack stops rather than pack what was read of it", path.display())]
    Changed {
        /// The file at fault.
        path: PathBuf,
        /// How it changed.
        reason: MapChange,
    },
    /// A token input (a Megatron `.bin`/`.idx` pair, a flat token `.bin`, a 1-D `.npy`) is malformed
    /// or cannot be cut as asked; `reason` names the record at fault where there is one.
    #[error("{}: {reason}", path.display())]
    Tokens {
        /// The file at fault (the `.idx` for a bad index).
        path: PathBuf,
        /// What is wrong, naming the record (sequence or document index) at fault.
        reason: String,
    },
    /// A Parquet or Arrow IPC input is malformed or holds what cannot be packed; `reason` names the
    /// column (and row) at fault where there is one.
    #[error("{}: {reason}", path.display())]
    Table {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong, naming the column and row.
        reason: String,
    },
    /// An `.npy` writer was given more or fewer data bytes than its shape holds.
    #[error("{}: writing .npy: the shape holds {expected_bytes} data bytes but {written_bytes} were written", path.display())]
    WriteSize {
        /// The file being written.
        path: PathBuf,
        /// Data bytes the shape and dtype call for.
        expected_bytes: u64,
        /// Data bytes written (or that would have been, for an over-long write).
        written_bytes: u64,
    },
}

/// Formats a (possibly shortened) list of tensor names for [`InputError::TensorNotFound`].
fn list_names(names: &[String], omitted: usize) -> String {
    if names.is_empty() {
        return "(none)".to_string();
    }
    let mut s = names.join(", ");
    if omitted > 0 {
        s.push_str(&format!(", ... and {omitted} more"));
    }
    s
}

/// The bytes behind a [`SourcePart`]: a read-only file mapping, or an owned buffer for fields
/// built in memory (tests, demo data), so both kinds go through one copy path.
enum Backing {
    /// The file's mapping, with the file itself, to tell whether it changed since it was mapped.
    Mapped {
        map: MappedFile,
        file: File,
    },
    Owned(Vec<u8>),
    /// Bytes computed from a file on demand rather than stored: the `doc_start` field of a
    /// Megatron input, one byte per token, would otherwise cost a byte of memory per token.
    Generated(Box<dyn GeneratedBytes>),
}

/// A byte stream computed on demand from a file (see [`Backing::Generated`]).
trait GeneratedBytes: Send + Sync {
    /// Length of the byte stream.
    fn len(&self) -> usize;
    /// Appends bytes `[begin, end)` of the stream to `out`.
    fn append(&self, begin: usize, end: usize, out: &mut Vec<u8>);
    /// Fails, naming the file it computes from, if that file changed since it was opened.
    fn check(&self) -> Result<(), InputError>;
}

impl Backing {
    /// The stored bytes of a file mapping or an owned buffer, for the readers that parse them.
    ///
    /// # Panics
    ///
    /// On a generated backing, which has no stored bytes: readers only parse the files they map.
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped { map, .. } => map.bytes(),
            Backing::Owned(vec) => vec,
            Backing::Generated(_) => unreachable!("a generated backing is never parsed"),
        }
    }

    /// Length of the backing's byte stream.
    fn len(&self) -> usize {
        match self {
            Backing::Mapped { .. } | Backing::Owned(_) => self.bytes().len(),
            Backing::Generated(generated) => generated.len(),
        }
    }

    /// Appends bytes `[begin, end)` of the backing's byte stream to `out`.
    fn append(&self, begin: usize, end: usize, out: &mut Vec<u8>) {
        match self {
            Backing::Mapped { .. } | Backing::Owned(_) => {
                out.extend_from_slice(&self.bytes()[begin..end])
            }
            Backing::Generated(generated) => generated.append(begin, end, out),
        }
    }

    /// Fails, naming `path`, if the mapped file changed since it was mapped: then bytes read from
    /// the mapping may be zeros (where the file was cut) or another version's.
    fn check(&self, path: &Path) -> Result<(), InputError> {
        match self {
            Backing::Mapped { map, file } => {
                map.check(file).map_err(|reason| InputError::Changed {
                    path: path.to_path_buf(),
                    reason,
                })
            }
            Backing::Owned(_) => Ok(()),
            Backing::Generated(generated) => generated.check(),
        }
    }
}

impl fmt::Debug for Backing {
    // Printing the contents of a multi-gigabyte mapping would be useless; the length is enough.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backing::Mapped { map, .. } => write!(f, "Mapped({} bytes)", map.len()),
            Backing::Owned(vec) => write!(f, "Owned({} bytes)", vec.len()),
            Backing::Generated(generated) => write!(f, "Generated({} bytes)", generated.len()),
        }
    }
}

/// Memory-maps `path` read-only, refusing what is not a regular file (opening a FIFO would block
/// until a writer comes, and a device such as `/dev/zero` has no end).
///
/// The mapping is a [`MappedFile`]: if the file shrinks while it is packed (saved again, or
/// truncated), reading it does not kill the process; [`FieldSource::copy_samples`] fails instead.
fn map_file(path: &Path) -> Result<Arc<Backing>, InputError> {
    let io = |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = crate::format::open_regular(path).map_err(io)?;
    let map = MappedFile::map(&file).map_err(io)?;
    Ok(Arc::new(Backing::Mapped { map, file }))
}

/// One contiguous piece of a field's samples: a memory-mapped file region (or an owned buffer)
/// holding `samples` samples back to back in C order.
#[derive(Clone, Debug)]
pub struct SourcePart {
    path: PathBuf,
    backing: Arc<Backing>,
    data_offset: usize,
    samples: u64,
}

impl SourcePart {
    /// Builds a part after checking that `samples * sample_bytes` bytes starting at `data_offset`
    /// lie inside the backing buffer. Readers check sizes themselves to report precise errors;
    /// this is the single guard that lets [`FieldSource::copy_samples`] slice without checks.
    fn new(
        path: &Path,
        backing: Arc<Backing>,
        data_offset: usize,
        samples: u64,
        sample_bytes: usize,
    ) -> Result<SourcePart, InputError> {
        let len = backing.len() as u64;
        let needed = (samples as u128) * (sample_bytes as u128) + data_offset as u128;
        if needed > len as u128 {
            return Err(InputError::Truncated {
                path: path.to_path_buf(),
                expected_bytes: u64::try_from(needed).unwrap_or(u64::MAX),
                actual_bytes: len,
            });
        }
        Ok(SourcePart {
            path: path.to_path_buf(),
            backing,
            data_offset,
            samples,
        })
    }

    /// Fails if the file behind this part changed since it was opened (see [`Backing::check`]).
    fn check(&self) -> Result<(), InputError> {
        self.backing.check(&self.path)
    }

    /// Appends the bytes of samples `[start, start + count)` of this part to `out`. The range must
    /// be within `self.samples`, which the caller guarantees.
    fn append_samples(&self, sample_bytes: usize, start: u64, count: u64, out: &mut Vec<u8>) {
        // Cannot overflow or go out of bounds: `new` checked that all samples fit in the buffer,
        // whose length is a usize.
        let begin = self.data_offset + start as usize * sample_bytes;
        let end = begin + count as usize * sample_bytes;
        self.backing.append(begin, end, out);
    }
}

/// A field to pack: name, dtype, per-sample shape, and the parts concatenated along axis 0.
#[derive(Clone, Debug)]
pub struct FieldSource {
    /// The field's name, as it will appear in the dataset manifest.
    pub name: String,
    /// The element type.
    pub dtype: DType,
    /// The shape of one sample (dims 1.. of the input arrays); empty for scalar samples. Of a
    /// variable-length field, the shape of one element.
    pub sample_shape: Vec<u64>,
    parts: Vec<SourcePart>,
    /// Of a variable-length field: per sample, the end of its elements in the parts' rows
    /// (cumulative, starting after 0); the parts then hold the elements of every sample back to
    /// back. `None` for a fixed-shape field, whose parts' rows are its samples.
    ends: Option<Arc<Vec<u64>>>,
}

/// Bytes per sample of `shape` with `dtype`, or `None` if it overflows a usize.
fn checked_sample_bytes(dtype: DType, shape: &[u64]) -> Option<usize> {
    shape.iter().try_fold(dtype.size_bytes(), |acc, &d| {
        acc.checked_mul(usize::try_from(d).ok()?)
    })
}

impl FieldSource {
    /// A variable-length field: sample `i` is rows `[ends[i - 1], ends[i])` of `values` (with
    /// `ends[-1] = 0`), `values` holding every sample's elements back to back. Fails if `ends` goes
    /// back or does not end at `values`' last row.
    pub fn variable(values: FieldSource, ends: Vec<u64>) -> Result<FieldSource, InputError> {
        let bad = |reason: String| InputError::Table {
            path: PathBuf::from(format!("<field {}>", values.name)),
            reason,
        };
        if values.ends.is_some() {
            return Err(bad(
                "the values of a variable-length field are variable-length".into(),
            ));
        }
        let mut previous = 0u64;
        for (sample, &end) in ends.iter().enumerate() {
            if end < previous {
                return Err(bad(format!(
                    "sample {sample}: offsets go back ({end} < {previous})"
                )));
            }
            previous = end;
        }
        if previous != values.sample_count() {
            return Err(bad(format!(
                "the offsets end at row {previous} but the values hold {} rows",
                values.sample_count()
            )));
        }
        Ok(FieldSource {
            ends: Some(Arc::new(ends)),
            ..values
        })
    }

    /// Per sample of a variable-length field, the end of its elements (`None` for a fixed-shape
    /// field).
    pub fn ends(&self) -> Option<&[u64]> {
        self.ends.as_deref().map(Vec::as_slice)
    }

    /// Whether the field's samples vary in length.
    pub fn is_variable(&self) -> bool {
        self.ends.is_some()
    }

    /// Samples of the field: of a fixed-shape field its rows, of a variable-length one its runs of
    /// rows.
    pub fn samples(&self) -> u64 {
        match &self.ends {
            Some(ends) => ends.len() as u64,
            None => self.sample_count(),
        }
    }

    /// Elements of the longest sample of a variable-length field (0 for a fixed-shape one).
    pub fn length_max(&self) -> u64 {
        self.ends().map_or(0, |ends| {
            let mut previous = 0;
            ends.iter()
                .map(|&end| {
                    let length = end - previous;
                    previous = end;
                    length
                })
                .max()
                .unwrap_or(0)
        })
    }

    /// Total number of rows over all parts: of a fixed-shape field its samples, of a
    /// variable-length field its elements.
    pub fn sample_count(&self) -> u64 {
        self.parts.iter().map(|p| p.samples).sum()
    }

    /// Bytes per sample: product of `sample_shape` times the dtype size.
    pub fn sample_bytes(&self) -> usize {
        // Every constructor checked this product fits in a usize (and is non-zero).
        self.sample_shape
            .iter()
            .fold(self.dtype.size_bytes(), |acc, &d| acc * d as usize)
    }

    /// Total data bytes over all parts (`sample_count() * sample_bytes()`).
    pub fn total_bytes(&self) -> u64 {
        self.sample_count() * self.sample_bytes() as u64
    }

    /// The files this field reads, in concatenation order (empty for an in-memory field).
    pub fn paths(&self) -> Vec<&Path> {
        self.parts
            .iter()
            .filter(|p| matches!(*p.backing, Backing::Mapped { .. } | Backing::Generated(_)))
            .map(|p| p.path.as_path())
            .collect()
    }

    /// Appends the bytes of samples `[start, start + count)` to `out`; the range may cross part
    /// boundaries.
    ///
    /// Fails, naming the file, if a file read changed since it was opened (it was truncated or
    /// saved again during the pack): the bytes appended are then not the file's and must not be
    /// used.
    ///
    /// # Panics
    ///
    /// Only on a programmer error: if the range extends past [`FieldSource::sample_count`].
    pub fn copy_samples(
        &self,
        start: u64,
        count: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), InputError> {
        let total = self.sample_count();
        assert!(
            start.checked_add(count).is_some_and(|end| end <= total),
            "copy_samples({start}, {count}) past the {total} samples of field {:?}",
            self.name
        );
        let sample_bytes = self.sample_bytes();
        out.reserve(count as usize * sample_bytes);
        // `start` and `remaining` are relative to the current part as we walk the parts.
        let mut start = start;
        let mut remaining = count;
        for part in &self.parts {
            if remaining == 0 {
                break;
            }
            if start >= part.samples {
                start -= part.samples;
                continue;
            }
            let take = remaining.min(part.samples - start);
            part.append_samples(sample_bytes, start, take, out);
            // After the copy: a read beyond the end of a file cut meanwhile has read zeros, which
            // this catches before the caller uses them.
            part.check()?;
            remaining -= take;
            start = 0;
        }
        Ok(())
    }

    /// Appends bytes `[begin, end)` of the field's byte stream (its samples back to back) to `out`;
    /// the range may start and end inside a sample and cross part boundaries. The packer copies
    /// blocks this way: a block of a sample larger than a block then costs its own bytes, not the
    /// whole sample's.
    ///
    /// Fails, naming the file, as [`FieldSource::copy_samples`] does.
    ///
    /// # Panics
    ///
    /// Only on a programmer error: if the range is reversed or extends past
    /// [`FieldSource::total_bytes`].
    pub fn copy_bytes(&self, begin: u64, end: u64, out: &mut Vec<u8>) -> Result<(), InputError> {
        let total = self.total_bytes();
        assert!(
            begin <= end && end <= total,
            "copy_bytes({begin}, {end}) past the {total} bytes of field {:?}",
            self.name
        );
        let sample_bytes = self.sample_bytes() as u64;
        out.reserve((end - begin) as usize);
        // `begin` and `end` are relative to the current part as we walk the parts.
        let (mut begin, mut end) = (begin, end);
        for part in &self.parts {
            if begin == end {
                break;
            }
            let part_bytes = part.samples * sample_bytes;
            if begin >= part_bytes {
                begin -= part_bytes;
                end -= part_bytes;
                continue;
            }
            let take_end = end.min(part_bytes);
            // Within the part: `new` checked that its samples lie inside the backing buffer.
            let at = part.data_offset;
            part.backing
                .append(at + begin as usize, at + take_end as usize, out);
            part.check()?;
            end -= take_end;
            begin = 0;
        }
        Ok(())
    }

    /// Tells the kernel that bytes `[begin, end)` of the field's byte stream will be read soon, so
    /// that a file not in the page cache is read ahead in large requests rather than page by page
    /// as the copy faults (best effort; nothing for in-memory and generated bytes).
    pub fn advise(&self, begin: u64, end: u64) {
        let sample_bytes = self.sample_bytes() as u64;
        let (mut begin, mut end) = (begin, end);
        for part in &self.parts {
            if begin >= end {
                break;
            }
            let part_bytes = part.samples * sample_bytes;
            if begin < part_bytes {
                if let Backing::Mapped { map, .. } = part.backing.as_ref() {
                    map.advise_will_need(
                        part.data_offset + begin as usize,
                        (end.min(part_bytes) - begin) as usize,
                    );
                }
                end = end.saturating_sub(part_bytes);
                begin = 0;
            } else {
                begin -= part_bytes;
                end -= part_bytes;
            }
        }
    }

    /// Builds a field from in-memory bytes (tests, the demo generator). The bytes are written
    /// nowhere; the field owns them. `bytes.len()` must be a whole number of samples.
    pub fn from_bytes(
        name: &str,
        dtype: DType,
        sample_shape: Vec<u64>,
        bytes: Vec<u8>,
    ) -> Result<FieldSource, InputError> {
        let size_error =
            |sample_bytes: usize, sample_shape: Vec<u64>, len: usize| InputError::InMemorySize {
                name: name.to_string(),
                dtype,
                sample_shape,
                sample_bytes,
                len,
            };
        let sample_bytes = match checked_sample_bytes(dtype, &sample_shape) {
            Some(n) if n > 0 && bytes.len() % n == 0 => n,
            Some(n) => return Err(size_error(n, sample_shape, bytes.len())),
            // Overflowing usize can never divide a buffer that exists.
            None => return Err(size_error(usize::MAX, sample_shape, bytes.len())),
        };
        let samples = (bytes.len() / sample_bytes) as u64;
        let path = PathBuf::from(format!("<in-memory field {name}>"));
        let part = SourcePart::new(
            &path,
            Arc::new(Backing::Owned(bytes)),
            0,
            samples,
            sample_bytes,
        )?;
        Ok(FieldSource {
            name: name.to_string(),
            dtype,
            sample_shape,
            parts: vec![part],
            ends: None,
        })
    }
}

/// Splits a full array shape into (samples, per-sample shape), rejecting shapes that cannot be a
/// field: 0-d arrays (no sample axis) and per-sample shapes with a 0 (zero-byte samples).
fn split_shape(path: &Path, shape: &[u64]) -> Result<(u64, Vec<u64>), InputError> {
    let Some((&samples, sample_shape)) = shape.split_first() else {
        return Err(InputError::ScalarArray {
            path: path.to_path_buf(),
        });
    };
    if sample_shape.contains(&0) {
        return Err(InputError::EmptySample {
            path: path.to_path_buf(),
            shape: sample_shape.to_vec(),
        });
    }
    Ok((samples, sample_shape.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_bytes_builds_an_in_memory_field() {
        let bytes: Vec<u8> = (0..24).collect();
        let field = FieldSource::from_bytes("m", DType::U16, vec![3], bytes.clone()).unwrap();
        assert_eq!(field.name, "m");
        assert_eq!(field.sample_bytes(), 6);
        assert_eq!(field.sample_count(), 4);
        assert_eq!(field.total_bytes(), 24);
        assert!(field.paths().is_empty(), "an in-memory field reads no file");
        let mut out = Vec::new();
        field.copy_samples(1, 2, &mut out).unwrap();
        assert_eq!(out, bytes[6..18]);
        out.clear();
        field.copy_samples(4, 0, &mut out).unwrap();
        assert!(out.is_empty());

        let empty = FieldSource::from_bytes("e", DType::F64, vec![], Vec::new()).unwrap();
        assert_eq!(empty.sample_count(), 0);
    }

    #[test]
    fn from_bytes_rejects_partial_and_empty_samples() {
        let err = FieldSource::from_bytes("m", DType::F32, vec![2], vec![0; 12]).unwrap_err();
        assert!(
            matches!(&err, InputError::InMemorySize { name, sample_bytes: 8, len: 12, .. } if name == "m"),
            "{err}"
        );
        let err = FieldSource::from_bytes("m", DType::F32, vec![2, 0], vec![]).unwrap_err();
        assert!(
            matches!(
                err,
                InputError::InMemorySize {
                    sample_bytes: 0,
                    ..
                }
            ),
            "{err}"
        );
        let err =
            FieldSource::from_bytes("m", DType::F64, vec![u64::MAX, 2], vec![0; 8]).unwrap_err();
        assert!(matches!(err, InputError::InMemorySize { .. }), "{err}");
    }

    #[test]
    fn field_source_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<FieldSource>();
    }
}
