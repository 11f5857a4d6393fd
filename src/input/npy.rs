//! NumPy `.npy` files: a header parser for pack inputs and a streaming writer for `unpack`.
//!
//! Format (see numpy's `numpy/lib/format.py`): the magic `\x93NUMPY`, a major and a minor version
//! byte, the header length (u16 little-endian in version 1.0, u32 in 2.0 and 3.0), then the header:
//! a Python dict literal such as `{'descr': '<f2', 'fortran_order': False, 'shape': (3, 4), }`
//! padded with spaces and ended by a newline. The raw array data follows immediately. numpy pads
//! so the data starts at a multiple of 64, but we accept any offset because other writers exist.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed_proto::DType;

use super::{
    checked_sample_bytes, map_file, split_shape, Backing, FieldSource, InputError, NpyHeaderError,
    SourcePart, MAX_HEADER_LEN, MAX_NESTING,
};

/// The 6-byte magic every `.npy` file starts with.
const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// Data alignment numpy uses, which we reproduce when writing so numpy can mmap our output
/// efficiently.
const DATA_ALIGN: usize = 64;

/// The parsed header of a `.npy` file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyHeader {
    /// Format version `(major, minor)`: `(1, 0)`, `(2, 0)` or `(3, 0)`.
    pub version: (u8, u8),
    /// The element type.
    pub dtype: DType,
    /// The full array shape (C order); empty for a 0-d array.
    pub shape: Vec<u64>,
    /// Byte offset of the array data from the start of the file.
    pub data_offset: usize,
}

impl NpyHeader {
    /// Bytes of array data the header calls for, or `None` if that overflows a u64.
    pub fn data_bytes(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
    }
}

/// Parses the header at the start of `bytes` (the file's contents, or at least its header).
///
/// Checks only that the header itself is complete and valid; whether the data that follows is the
/// right size is for the caller, who knows the file length. `path` is used in errors only.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<NpyHeader, InputError> {
    let truncated = |expected: usize| InputError::Truncated {
        path: path.to_path_buf(),
        expected_bytes: expected as u64,
        actual_bytes: bytes.len() as u64,
    };
    let bad = |reason: NpyHeaderError| InputError::BadHeader {
        path: path.to_path_buf(),
        reason,
    };

    if !bytes.starts_with(MAGIC) {
        // A non-empty proper prefix of the magic is a file cut short, not a different format.
        if !bytes.is_empty() && bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
            return Err(truncated(10));
        }
        return Err(InputError::NotNpy {
            path: path.to_path_buf(),
        });
    }
    let (Some(&major), Some(&minor)) = (bytes.get(6), bytes.get(7)) else {
        return Err(truncated(10));
    };
    let (len_field, prefix_len) = match (major, minor) {
        (1, 0) => (2, 10),
        (2, 0) | (3, 0) => (4, 12),
        _ => {
            return Err(InputError::UnsupportedNpyVersion {
                path: path.to_path_buf(),
                major,
                minor,
            })
        }
    };
    let Some(len_bytes) = bytes.get(8..8 + len_field) else {
        return Err(truncated(prefix_len));
    };
    let header_len = len_bytes
        .iter()
        .rev()
        .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
    if header_len > MAX_HEADER_LEN {
        return Err(bad(NpyHeaderError::TooLong(header_len)));
    }
    let data_offset = prefix_len + header_len;
    let Some(raw) = bytes.get(prefix_len..data_offset) else {
        return Err(truncated(data_offset));
    };
    // Versions 1 and 2 store the header as latin-1, version 3 as UTF-8 (for unicode field names).
    let text: String = if major == 3 {
        std::str::from_utf8(raw)
            .map_err(|e| bad(NpyHeaderError::NotUtf8(e)))?
            .to_string()
    } else {
        raw.iter().map(|&b| char::from(b)).collect()
    };

    let entries = parse_dict(&text).map_err(bad)?;
    let get = |key: &'static str| {
        entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .ok_or_else(|| {
                bad(NpyHeaderError::MissingKey {
                    key,
                    header: text.trim_end().to_string(),
                })
            })
    };
    // Shape first: a malformed header is worth reporting before what it contains.
    let shape = parse_shape(get("shape")?).map_err(bad)?;
    let dtype = match get("descr")? {
        Lit::Str(descr) => parse_descr(path, descr)?,
        other => {
            return Err(InputError::UnsupportedDtype {
                path: path.to_path_buf(),
                descr: other.to_string(),
                detail: "structured (record) dtypes are not supported; save each field as its own \
                         .npy file"
                    .to_string(),
            })
        }
    };
    match get("fortran_order")? {
        Lit::Bool(false) => {}
        Lit::Bool(true) => {
            return Err(InputError::FortranOrder {
                path: path.to_path_buf(),
            })
        }
        other => return Err(bad(NpyHeaderError::FortranOrderNotBool(other.to_string()))),
    }
    Ok(NpyHeader {
        version: (major, minor),
        dtype,
        shape,
        data_offset,
    })
}

/// Memory-maps a `.npy` file and validates its header and size.
///
/// On success the mapping holds exactly `header.data_offset + header.data_bytes()` bytes.
pub(super) fn open(path: &Path) -> Result<(NpyHeader, Arc<Backing>), InputError> {
    let backing = map_file(path)?;
    let bytes = backing.bytes();
    let header = parse_header(path, bytes);
    // The header was read from the mapping: if the file was cut meanwhile, what was read may be
    // zeros, and the error to report is that.
    backing.check(path)?;
    let header = header?;
    let expected = header
        .data_bytes()
        .and_then(|n| n.checked_add(header.data_offset as u64))
        .ok_or_else(|| InputError::ShapeOverflow {
            path: path.to_path_buf(),
            shape: header.shape.clone(),
        })?;
    let actual = bytes.len() as u64;
    if actual < expected {
        return Err(InputError::Truncated {
            path: path.to_path_buf(),
            expected_bytes: expected,
            actual_bytes: actual,
        });
    }
    // numpy never writes anything after the data; extra bytes mean the header does not describe
    // the file (e.g. it was overwritten in place), so its samples cannot be trusted.
    if actual > expected {
        return Err(InputError::TrailingBytes {
            path: path.to_path_buf(),
            expected_bytes: expected,
            actual_bytes: actual,
        });
    }
    Ok((header, backing))
}

/// Maps a numpy type string (`'<f4'`, `'|u1'`, ...) to a gpufeed dtype.
fn parse_descr(path: &Path, descr: &str) -> Result<DType, InputError> {
    let unsupported = |detail: &str| InputError::UnsupportedDtype {
        path: path.to_path_buf(),
        descr: descr.to_string(),
        detail: detail.to_string(),
    };
    // numpy always writes a byte-order character; without one, np.dtype assumes native order.
    let (order, rest) = match descr.as_bytes().first() {
        Some(b'<' | b'>' | b'|' | b'=') => (descr.as_bytes()[0], &descr[1..]),
        _ => (b'=', descr),
    };
    let mut chars = rest.chars();
    let kind = chars.next();
    let size_str = chars.as_str();
    // Not `str::parse` alone: it would also accept "+4".
    let size = if !size_str.is_empty() && size_str.bytes().all(|b| b.is_ascii_digit()) {
        size_str.parse::<usize>().ok()
    } else {
        None
    };
    let dtype =
        match (kind, size) {
            (Some('u'), Some(1)) => DType::U8,
            (Some('i'), Some(1)) => DType::I8,
            (Some('u'), Some(2)) => DType::U16,
            (Some('i'), Some(2)) => DType::I16,
            (Some('u'), Some(4)) => DType::U32,
            (Some('i'), Some(4)) => DType::I32,
            (Some('u'), Some(8)) => DType::U64,
            (Some('i'), Some(8)) => DType::I64,
            (Some('f'), Some(2)) => DType::F16,
            (Some('f'), Some(4)) => DType::F32,
            (Some('f'), Some(8)) => DType::F64,
            (Some('b'), _) => {
                return Err(unsupported(
                    "booleans are not supported; convert with a.astype(np.uint8)",
                ))
            }
            (Some('V'), Some(2)) => return Err(unsupported(
                "raw 2-byte void; this is how ml_dtypes saves bfloat16, but .npy cannot say which \
                 2-byte type it holds; convert to float32, or store the tensor as BF16 in a \
                 .safetensors file",
            )),
            (Some('V'), _) => {
                return Err(unsupported(
                    "raw void (opaque bytes) types are not supported",
                ))
            }
            (Some('c'), _) => return Err(unsupported("complex numbers are not supported")),
            (Some('S' | 'a' | 'U'), _) => return Err(unsupported("strings are not supported")),
            (Some('O'), _) => return Err(unsupported("Python objects are not supported")),
            (Some('M' | 'm'), _) => {
                return Err(unsupported(
                    "datetime/timedelta types are not supported; convert with a.astype(np.int64)",
                ))
            }
            (Some('f'), Some(_)) => {
                return Err(unsupported(
                    "only float16, float32 and float64 are supported",
                ))
            }
            (Some('u' | 'i'), Some(_)) => {
                return Err(unsupported(
                    "only 1, 2, 4 and 8-byte integers are supported",
                ))
            }
            _ => return Err(unsupported("not a recognised NumPy type string")),
        };
    if dtype.size_bytes() > 1 {
        let big = match order {
            b'<' => false,
            b'>' => true,
            // '=' is the writer's native order; we can only assume the writer was like us.
            b'=' => cfg!(target_endian = "big"),
            _ => {
                return Err(unsupported(
                    "byte order '|' (not applicable) is invalid for a multi-byte type",
                ))
            }
        };
        if big {
            return Err(InputError::BigEndian {
                path: path.to_path_buf(),
                descr: descr.to_string(),
            });
        }
    }
    Ok(dtype)
}

/// Converts the `'shape'` value to dimensions.
fn parse_shape(value: &Lit) -> Result<Vec<u64>, NpyHeaderError> {
    // numpy writes a tuple; a list is accepted too since it is unambiguous.
    let (Lit::Tuple(items) | Lit::List(items)) = value else {
        return Err(NpyHeaderError::ShapeNotTuple(value.to_string()));
    };
    items
        .iter()
        .map(|item| match item {
            Lit::Int(n) => u64::try_from(*n).map_err(|_| {
                if *n < 0 {
                    NpyHeaderError::NegativeDimension {
                        dimension: *n,
                        shape: value.to_string(),
                    }
                } else {
                    NpyHeaderError::DimensionTooLarge {
                        dimension: *n,
                        shape: value.to_string(),
                    }
                }
            }),
            other => Err(NpyHeaderError::DimensionNotInteger {
                dimension: other.to_string(),
                shape: value.to_string(),
            }),
        })
        .collect()
}

/// The subset of Python literals that can appear in a `.npy` header.
#[derive(Clone, Debug, PartialEq)]
enum Lit {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Lit>),
    List(Vec<Lit>),
    Dict(Vec<(Lit, Lit)>),
}

impl fmt::Display for Lit {
    /// Python-like rendering, for error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn seq(f: &mut fmt::Formatter<'_>, items: &[Lit]) -> fmt::Result {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{item}")?;
            }
            Ok(())
        }
        match self {
            Lit::Str(s) => write!(f, "'{}'", s.escape_default()),
            Lit::Int(n) => write!(f, "{n}"),
            Lit::Bool(true) => f.write_str("True"),
            Lit::Bool(false) => f.write_str("False"),
            Lit::None => f.write_str("None"),
            Lit::Tuple(items) => {
                f.write_str("(")?;
                seq(f, items)?;
                f.write_str(if items.len() == 1 { ",)" } else { ")" })
            }
            Lit::List(items) => {
                f.write_str("[")?;
                seq(f, items)?;
                f.write_str("]")
            }
            Lit::Dict(entries) => {
                f.write_str("{")?;
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}: {v}")?;
                }
                f.write_str("}")
            }
        }
    }
}

/// Parses the header text: one dict with string keys, surrounded by whitespace only.
fn parse_dict(text: &str) -> Result<Vec<(String, Lit)>, NpyHeaderError> {
    let mut parser = Parser {
        chars: text.chars().collect(),
        pos: 0,
    };
    parser.skip_ws();
    if parser.peek() != Some('{') {
        return Err(NpyHeaderError::NotADict(text.trim_end().to_string()));
    }
    let Lit::Dict(entries) = parser.value(0)? else {
        return Err(NpyHeaderError::NotADict(text.trim_end().to_string()));
    };
    parser.skip_ws();
    if parser.pos != parser.chars.len() {
        return Err(NpyHeaderError::TrailingText(parser.pos));
    }
    let mut out: Vec<(String, Lit)> = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        let Lit::Str(key) = key else {
            return Err(NpyHeaderError::KeyNotString(key.to_string()));
        };
        if out.iter().any(|(k, _)| *k == key) {
            return Err(NpyHeaderError::DuplicateKey(key));
        }
        // Unknown keys are tolerated: they cannot change how the known ones are read.
        out.push((key, value));
    }
    Ok(out)
}

/// A recursive-descent parser for Python literals (strings, ints, True/False/None, tuples, lists,
/// dicts), the only syntax `np.save` emits. Errors do not name the file; the caller adds the path.
struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += 1;
        Some(c)
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn describe(c: Option<char>) -> String {
        match c {
            Some(c) => format!("{c:?}"),
            None => "end of header".to_string(),
        }
    }

    fn value(&mut self, depth: usize) -> Result<Lit, NpyHeaderError> {
        if depth > MAX_NESTING {
            return Err(NpyHeaderError::TooDeep);
        }
        self.skip_ws();
        let start = self.pos;
        match self.peek() {
            Some('\'' | '"') => self.string(),
            Some('(') => {
                self.pos += 1;
                let (items, comma) = self.seq(')', depth)?;
                // `(x)` is just a parenthesised x in Python; only `(x,)` is a 1-tuple.
                if items.len() == 1 && !comma {
                    Ok(items.into_iter().next().unwrap_or(Lit::None))
                } else {
                    Ok(Lit::Tuple(items))
                }
            }
            Some('[') => {
                self.pos += 1;
                Ok(Lit::List(self.seq(']', depth)?.0))
            }
            Some('{') => {
                self.pos += 1;
                self.dict(depth)
            }
            Some(c) if c.is_ascii_digit() || c == '-' || c == '+' => self.int(),
            Some(c) if c.is_alphabetic() || c == '_' => {
                while self.peek().is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    self.pos += 1;
                }
                let word: String = self.chars[start..self.pos].iter().collect();
                match word.as_str() {
                    "True" => Ok(Lit::Bool(true)),
                    "False" => Ok(Lit::Bool(false)),
                    "None" => Ok(Lit::None),
                    // String prefixes: Python 2 numpy could write u'...'.
                    "u" | "U" | "b" | "B" | "r" | "R"
                        if matches!(self.peek(), Some('\'' | '"')) =>
                    {
                        self.string()
                    }
                    _ => Err(NpyHeaderError::UnexpectedName {
                        name: word,
                        offset: start,
                    }),
                }
            }
            other => Err(NpyHeaderError::Unexpected {
                found: Self::describe(other),
                offset: start,
            }),
        }
    }

    /// Parses comma-separated values up to `close` (the opener already consumed). Returns the
    /// items and whether any comma was seen, which distinguishes `(x,)` from `(x)`.
    fn seq(&mut self, close: char, depth: usize) -> Result<(Vec<Lit>, bool), NpyHeaderError> {
        let mut items = Vec::new();
        let mut comma = false;
        loop {
            self.skip_ws();
            if self.peek() == Some(close) {
                self.pos += 1;
                return Ok((items, comma));
            }
            items.push(self.value(depth + 1)?);
            self.skip_ws();
            match self.bump() {
                Some(',') => comma = true,
                Some(c) if c == close => return Ok((items, comma)),
                other => {
                    return Err(NpyHeaderError::ExpectedSeparator {
                        close,
                        offset: self.pos.saturating_sub(1),
                        found: Self::describe(other),
                    })
                }
            }
        }
    }

    /// Parses `key: value` pairs up to `}` (the `{` already consumed).
    fn dict(&mut self, depth: usize) -> Result<Lit, NpyHeaderError> {
        let mut entries = Vec::new();
        loop {
            self.skip_ws();
            if self.peek() == Some('}') {
                self.pos += 1;
                return Ok(Lit::Dict(entries));
            }
            let key = self.value(depth + 1)?;
            self.skip_ws();
            match self.bump() {
                Some(':') => {}
                other => {
                    return Err(NpyHeaderError::ExpectedColon {
                        key: key.to_string(),
                        found: Self::describe(other),
                    })
                }
            }
            let value = self.value(depth + 1)?;
            entries.push((key, value));
            self.skip_ws();
            match self.bump() {
                Some(',') => {}
                Some('}') => return Ok(Lit::Dict(entries)),
                other => {
                    return Err(NpyHeaderError::ExpectedDictSeparator {
                        offset: self.pos.saturating_sub(1),
                        found: Self::describe(other),
                    })
                }
            }
        }
    }

    /// Parses a quoted string (the cursor on the opening quote).
    fn string(&mut self) -> Result<Lit, NpyHeaderError> {
        let start = self.pos;
        let Some(quote) = self.bump() else {
            return Err(NpyHeaderError::StringAtEnd);
        };
        let mut s = String::new();
        loop {
            match self.bump() {
                None => return Err(NpyHeaderError::UnterminatedString(start)),
                Some(c) if c == quote => return Ok(Lit::Str(s)),
                Some('\\') => match self.bump() {
                    None => return Err(NpyHeaderError::UnterminatedString(start)),
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some('r') => s.push('\r'),
                    Some('0') => s.push('\0'),
                    Some(c @ ('\\' | '\'' | '"')) => s.push(c),
                    // Python keeps unknown escapes verbatim.
                    Some(c) => {
                        s.push('\\');
                        s.push(c);
                    }
                },
                Some(c) => s.push(c),
            }
        }
    }

    /// Parses an integer with an optional sign and an optional `L` suffix (Python 2 longs, which
    /// old numpy wrote into shapes).
    fn int(&mut self) -> Result<Lit, NpyHeaderError> {
        let start = self.pos;
        let negative = match self.peek() {
            Some('-') => {
                self.pos += 1;
                true
            }
            Some('+') => {
                self.pos += 1;
                false
            }
            _ => false,
        };
        let mut value: i128 = 0;
        let mut digits = 0;
        while let Some(d) = self.peek().and_then(|c| c.to_digit(10)) {
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(i128::from(d)))
                .ok_or(NpyHeaderError::IntegerTooLarge(start))?;
            digits += 1;
            self.pos += 1;
        }
        if digits == 0 {
            return Err(NpyHeaderError::ExpectedDigits(self.pos));
        }
        if matches!(self.peek(), Some('L' | 'l')) {
            self.pos += 1;
        }
        Ok(Lit::Int(if negative { -value } else { value }))
    }
}

/// The numpy type string for `dtype`, or `None` for bfloat16, which numpy has no type for.
fn npy_descr(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::U16 => "<u2",
        DType::I16 => "<i2",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::U64 => "<u8",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::BF16 => return None,
    })
}

/// Builds a complete `.npy` header (magic through the newline) padded so the data starts at a
/// multiple of 64, as numpy does. Uses version 1.0 unless the header needs more than 65535 bytes.
/// `None` if even a version 2.0 length field cannot hold it.
fn encode_header(descr: &str, shape: &[u64]) -> Option<Vec<u8>> {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    let shape_text = match dims.as_slice() {
        [one] => format!("({one},)"),
        _ => format!("({})", dims.join(", ")),
    };
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_text}, }}");
    let padded_len = |prefix_len: usize| {
        let unpadded = prefix_len + dict.len() + 1;
        dict.len() + 1 + (DATA_ALIGN - unpadded % DATA_ALIGN) % DATA_ALIGN
    };
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    let v1_len = padded_len(10);
    let header_len = if let Ok(len) = u16::try_from(v1_len) {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&len.to_le_bytes());
        v1_len
    } else {
        let v2_len = padded_len(12);
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&u32::try_from(v2_len).ok()?.to_le_bytes());
        v2_len
    };
    out.extend_from_slice(dict.as_bytes());
    out.resize(out.len() + header_len - dict.len() - 1, b' ');
    out.push(b'\n');
    Some(out)
}

/// A `.npy` file being written by [`write_npy`]. Feed it exactly the array's data bytes with
/// [`NpyWriter::write_all`], then call [`NpyWriter::finish`]; dropping it without `finish` leaves
/// an incomplete file behind.
#[derive(Debug)]
pub struct NpyWriter {
    path: PathBuf,
    out: BufWriter<File>,
    expected_bytes: u64,
    written_bytes: u64,
}

/// Creates (or truncates) `path` and writes a `.npy` header for a C-order array of `dtype` and
/// `shape`. BF16 is refused with [`InputError::UnsupportedDtype`]: numpy has no bfloat16, so the
/// caller must convert to f32 first.
pub fn write_npy(path: &Path, dtype: DType, shape: &[u64]) -> Result<NpyWriter, InputError> {
    let descr = npy_descr(dtype).ok_or_else(|| InputError::UnsupportedDtype {
        path: path.to_path_buf(),
        descr: dtype.name().to_string(),
        detail: "NumPy has no bfloat16 type, so .npy cannot hold it; convert to f32 first"
            .to_string(),
    })?;
    let overflow = || InputError::ShapeOverflow {
        path: path.to_path_buf(),
        shape: shape.to_vec(),
    };
    let expected_bytes = shape
        .iter()
        .try_fold(dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let header = encode_header(descr, shape).ok_or_else(overflow)?;
    let io = |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::create(path).map_err(io)?;
    // Large buffer: unpack writes sample by sample, and samples are often small.
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&header).map_err(io)?;
    Ok(NpyWriter {
        path: path.to_path_buf(),
        out,
        expected_bytes,
        written_bytes: 0,
    })
}

impl NpyWriter {
    fn io(&self, source: std::io::Error) -> InputError {
        InputError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Appends array data. Fails, writing nothing, if it would exceed the bytes the shape holds.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), InputError> {
        let total = self.written_bytes.saturating_add(bytes.len() as u64);
        if total > self.expected_bytes {
            return Err(InputError::WriteSize {
                path: self.path.clone(),
                expected_bytes: self.expected_bytes,
                written_bytes: total,
            });
        }
        self.out.write_all(bytes).map_err(|e| self.io(e))?;
        self.written_bytes = total;
        Ok(())
    }

    /// Checks that exactly the array's data bytes were written, then flushes and fsyncs the file,
    /// so a completed `unpack` survives a crash.
    pub fn finish(mut self) -> Result<(), InputError> {
        if self.written_bytes != self.expected_bytes {
            return Err(InputError::WriteSize {
                path: self.path.clone(),
                expected_bytes: self.expected_bytes,
                written_bytes: self.written_bytes,
            });
        }
        self.out.flush().map_err(|e| self.io(e))?;
        self.out.get_ref().sync_all().map_err(|e| self.io(e))
    }
}

/// Opens `.npy` files and concatenates them along axis 0 into one field. All must share dtype
/// and per-sample shape (dims 1..); an error names the first file that differs. A file with 0
/// samples is allowed and contributes nothing.
pub fn open_npy_field(name: &str, paths: &[PathBuf]) -> Result<FieldSource, InputError> {
    // The first file sets the dtype and per-sample shape every later file must match.
    let mut first: Option<(&Path, DType, Vec<u64>)> = None;
    let mut parts = Vec::with_capacity(paths.len());
    for path in paths {
        let (header, backing) = open(path)?;
        let (samples, sample_shape) = split_shape(path, &header.shape)?;
        match &first {
            Some((first_path, dtype, shape)) => {
                if header.dtype != *dtype {
                    return Err(InputError::DtypeMismatch {
                        path: path.clone(),
                        expected: *dtype,
                        found: header.dtype,
                        first: first_path.to_path_buf(),
                    });
                }
                if sample_shape != *shape {
                    return Err(InputError::ShapeMismatch {
                        path: path.clone(),
                        expected: shape.clone(),
                        found: sample_shape,
                        first: first_path.to_path_buf(),
                    });
                }
            }
            None => first = Some((path.as_path(), header.dtype, sample_shape.clone())),
        }
        // `open` checked the data fits the file, but a file with 0 samples says nothing
        // about the size of one sample, which may still overflow.
        let sample_bytes = checked_sample_bytes(header.dtype, &sample_shape).ok_or_else(|| {
            InputError::ShapeOverflow {
                path: path.clone(),
                shape: header.shape.clone(),
            }
        })?;
        parts.push(SourcePart::new(
            path,
            backing,
            header.data_offset,
            samples,
            sample_bytes,
        )?);
    }
    let Some((_, dtype, sample_shape)) = first else {
        return Err(InputError::NoFiles {
            name: name.to_string(),
        });
    };
    Ok(FieldSource {
        name: name.to_string(),
        dtype,
        sample_shape,
        parts,
        ends: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::{open_npy_field, FieldSource};
    use gpufeed_proto::dtype::ALL_DTYPES;

    /// Builds `.npy` bytes by hand (independently of `encode_header`), padding to 64 like numpy.
    fn npy_bytes(major: u8, dict: &str, data: &[u8]) -> Vec<u8> {
        let prefix = if major == 1 { 10 } else { 12 };
        let unpadded = prefix + dict.len() + 1;
        let pad = (64 - unpadded % 64) % 64;
        let header_len = dict.len() + pad + 1;
        let mut out = b"\x93NUMPY".to_vec();
        out.extend_from_slice(&[major, 0]);
        if major == 1 {
            out.extend_from_slice(&(header_len as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(header_len as u32).to_le_bytes());
        }
        out.extend_from_slice(dict.as_bytes());
        out.extend(std::iter::repeat_n(b' ', pad));
        out.push(b'\n');
        assert_eq!(out.len() % 64, 0);
        out.extend_from_slice(data);
        out
    }

    fn dict(descr: &str, shape: &str) -> String {
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")
    }

    fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn open_one(path: &Path) -> Result<FieldSource, InputError> {
        open_npy_field("f", &[path.to_path_buf()])
    }

    fn all_bytes(field: &FieldSource) -> Vec<u8> {
        let mut out = Vec::new();
        field
            .copy_samples(0, field.sample_count(), &mut out)
            .unwrap();
        out
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn parses_every_supported_descr() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("|u1", DType::U8),
            ("<u1", DType::U8),
            (">u1", DType::U8),
            ("|i1", DType::I8),
            ("<u2", DType::U16),
            ("<i2", DType::I16),
            ("<u4", DType::U32),
            ("<i4", DType::I32),
            ("<u8", DType::U64),
            ("<i8", DType::I64),
            ("<f2", DType::F16),
            ("<f4", DType::F32),
            ("<f8", DType::F64),
            ("=f4", DType::F32),
            ("f8", DType::F64),
        ];
        for (i, (descr, dtype)) in cases.into_iter().enumerate() {
            let data = pattern(3 * dtype.size_bytes());
            let path = write(
                &dir,
                &format!("{i}.npy"),
                &npy_bytes(1, &dict(descr, "(3,)"), &data),
            );
            let field = open_one(&path).unwrap_or_else(|e| panic!("{descr}: {e}"));
            assert_eq!(field.dtype, dtype, "{descr}");
            assert_eq!(field.sample_shape, Vec::<u64>::new());
            assert_eq!(field.sample_count(), 3);
            assert_eq!(field.sample_bytes(), dtype.size_bytes());
            assert_eq!(all_bytes(&field), data);
            assert_eq!(field.paths(), vec![path.as_path()]);
        }
    }

    #[test]
    fn versions_1_2_and_3_parse_alike() {
        let dir = tempfile::tempdir().unwrap();
        let data = pattern(2 * 3 * 4 * 2);
        for major in [1u8, 2, 3] {
            let bytes = npy_bytes(major, &dict("<i2", "(2, 3, 4)"), &data);
            let header = parse_header(Path::new("x.npy"), &bytes).unwrap();
            assert_eq!(header.version, (major, 0));
            assert_eq!(header.shape, vec![2, 3, 4]);
            assert_eq!(header.data_offset % 64, 0);
            let path = write(&dir, &format!("v{major}.npy"), &bytes);
            let field = open_one(&path).unwrap();
            assert_eq!(field.sample_shape, vec![3, 4]);
            assert_eq!(field.sample_count(), 2);
            assert_eq!(field.sample_bytes(), 24);
            assert_eq!(all_bytes(&field), data);
        }
    }

    #[test]
    fn unaligned_data_offset_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let d = "{'descr':'<u2','fortran_order':False,'shape':(2,)}\n";
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(d.len() as u16).to_le_bytes());
        bytes.extend_from_slice(d.as_bytes());
        bytes.extend_from_slice(&[1, 0, 2, 0]);
        let field = open_one(&write(&dir, "a.npy", &bytes)).unwrap();
        assert_eq!(all_bytes(&field), vec![1, 0, 2, 0]);
    }

    #[test]
    fn header_dict_syntax_variants() {
        let variants = [
            "{'shape': (4, 2), 'fortran_order': False, 'descr': '<f4'}",
            "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (4, 2)}",
            "{'descr':'<f4','fortran_order':False,'shape':(4L, 2L),}",
            "{ 'descr' : u'<f4' ,\t'fortran_order' : False , 'shape' : ( 4 , 2 , ) , }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': [4, 2], 'extra': None}",
        ];
        for v in variants {
            let bytes = npy_bytes(1, v, &[]);
            let header =
                parse_header(Path::new("x.npy"), &bytes).unwrap_or_else(|e| panic!("{v}: {e}"));
            assert_eq!(header.dtype, DType::F32, "{v}");
            assert_eq!(header.shape, vec![4, 2], "{v}");
        }
        let one = npy_bytes(1, &dict("<f4", "(5,)"), &[]);
        assert_eq!(parse_header(Path::new("x"), &one).unwrap().shape, vec![5]);
        let scalar = npy_bytes(1, &dict("<f4", "()"), &[]);
        assert!(parse_header(Path::new("x"), &scalar)
            .unwrap()
            .shape
            .is_empty());
    }

    #[test]
    fn scalar_array_has_no_sample_axis() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "s.npy", &npy_bytes(1, &dict("<f4", "()"), &[0; 4]));
        let err = open_one(&path).unwrap_err();
        assert!(
            matches!(&err, InputError::ScalarArray { path: p } if *p == path),
            "{err}"
        );
    }

    #[test]
    fn zero_in_sample_shape_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "z.npy", &npy_bytes(1, &dict("<f4", "(3, 0)"), &[]));
        let err = open_one(&path).unwrap_err();
        assert!(
            matches!(&err, InputError::EmptySample { path: p, shape } if *p == path && *shape == vec![0]),
            "{err}"
        );
    }

    #[test]
    fn concatenates_three_files_including_an_empty_one() {
        let dir = tempfile::tempdir().unwrap();
        // Samples of shape (2,) u16 = 4 bytes each: 3 + 0 + 4 samples.
        let a = pattern(12);
        let c: Vec<u8> = pattern(16).iter().map(|b| b ^ 0xff).collect();
        let paths = vec![
            write(&dir, "a.npy", &npy_bytes(1, &dict("<u2", "(3, 2)"), &a)),
            write(&dir, "b.npy", &npy_bytes(1, &dict("<u2", "(0, 2)"), &[])),
            write(&dir, "c.npy", &npy_bytes(2, &dict("<u2", "(4, 2)"), &c)),
        ];
        let field = open_npy_field("xy", &paths).unwrap();
        assert_eq!(field.name, "xy");
        assert_eq!(field.sample_count(), 7);
        assert_eq!(field.sample_bytes(), 4);
        assert_eq!(field.total_bytes(), 28);
        assert_eq!(
            field.paths(),
            paths.iter().map(PathBuf::as_path).collect::<Vec<_>>()
        );
        let all: Vec<u8> = a.iter().chain(&c).copied().collect();
        assert_eq!(all_bytes(&field), all);
        // Every sub-range, including ones crossing the empty part and the a/c boundary.
        for start in 0..=7u64 {
            for count in 0..=(7 - start) {
                let mut out = vec![0xAA];
                field.copy_samples(start, count, &mut out).unwrap();
                assert_eq!(out[0], 0xAA, "copy_samples must append");
                let range = start as usize * 4..(start + count) as usize * 4;
                assert_eq!(&out[1..], &all[range], "start {start} count {count}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "past the 3 samples")]
    fn copy_past_the_end_panics() {
        let field = FieldSource::from_bytes("f", DType::U8, vec![], vec![1, 2, 3]).unwrap();
        let _ = field.copy_samples(2, 2, &mut Vec::new());
    }

    #[test]
    fn no_files_is_an_error() {
        let err = open_npy_field("f", &[]).unwrap_err();
        assert!(matches!(err, InputError::NoFiles { .. }), "{err}");
    }

    #[test]
    fn missing_file_is_io_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing.npy");
        let err = open_one(&path).unwrap_err();
        assert!(
            matches!(&err, InputError::Io { path: p, .. } if *p == path),
            "{err}"
        );
        assert!(err.to_string().contains("missing.npy"), "{err}");
    }

    #[test]
    fn truncated_data_reports_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let full = npy_bytes(1, &dict("<f4", "(3, 2)"), &pattern(24));
        let path = write(&dir, "t.npy", &full[..full.len() - 5]);
        let err = open_one(&path).unwrap_err();
        match &err {
            InputError::Truncated {
                path: p,
                expected_bytes,
                actual_bytes,
            } => {
                assert_eq!(p, &path);
                assert_eq!(*expected_bytes, full.len() as u64);
                assert_eq!(*actual_bytes, full.len() as u64 - 5);
            }
            other => panic!("{other}"),
        }
        assert!(err.to_string().contains("t.npy"));
    }

    #[test]
    fn truncated_header_is_detected() {
        let full = npy_bytes(1, &dict("<f4", "(3,)"), &[]);
        for cut in [3, 7, 9, full.len() - 1] {
            let err = parse_header(Path::new("h.npy"), &full[..cut]).unwrap_err();
            assert!(
                matches!(err, InputError::Truncated { .. }),
                "cut {cut}: {err}"
            );
        }
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            &dir,
            "x.npy",
            &npy_bytes(1, &dict("|u1", "(3,)"), &[1, 2, 3, 4]),
        );
        let err = open_one(&path).unwrap_err();
        assert!(matches!(err, InputError::TrailingBytes { .. }), "{err}");
    }

    #[test]
    fn fortran_order_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let d = "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }";
        let path = write(&dir, "f.npy", &npy_bytes(1, d, &[0; 16]));
        let err = open_one(&path).unwrap_err();
        assert!(
            matches!(&err, InputError::FortranOrder { path: p } if *p == path),
            "{err}"
        );
    }

    #[test]
    fn big_endian_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(&dir, "b.npy", &npy_bytes(1, &dict(">f4", "(2,)"), &[0; 8]));
        let err = open_one(&path).unwrap_err();
        assert!(
            matches!(&err, InputError::BigEndian { path: p, descr } if *p == path && descr == ">f4"),
            "{err}"
        );
    }

    #[test]
    fn bad_magic_and_empty_file_are_not_npy() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = npy_bytes(1, &dict("<f4", "(2,)"), &[0; 8]);
        bytes[1] = b'X';
        let path = write(&dir, "m.npy", &bytes);
        let err = open_one(&path).unwrap_err();
        assert!(
            matches!(&err, InputError::NotNpy { path: p } if *p == path),
            "{err}"
        );
        let empty = write(&dir, "empty.npy", &[]);
        assert!(matches!(
            open_one(&empty).unwrap_err(),
            InputError::NotNpy { .. }
        ));
    }

    #[test]
    fn unknown_version_is_rejected() {
        let mut bytes = npy_bytes(1, &dict("<f4", "(2,)"), &[0; 8]);
        bytes[6] = 4;
        let err = parse_header(Path::new("v.npy"), &bytes).unwrap_err();
        assert!(
            matches!(
                err,
                InputError::UnsupportedNpyVersion {
                    major: 4,
                    minor: 0,
                    ..
                }
            ),
            "{err}"
        );
        bytes[6] = 1;
        bytes[7] = 1;
        let err = parse_header(Path::new("v.npy"), &bytes).unwrap_err();
        assert!(
            matches!(
                err,
                InputError::UnsupportedNpyVersion {
                    major: 1,
                    minor: 1,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn unsupported_descrs_are_named() {
        let cases = [
            ("|b1", "booleans"),
            ("<V2", "bfloat16"),
            ("|V16", "void"),
            ("<c8", "complex"),
            ("|S10", "strings"),
            ("<U3", "strings"),
            ("|O", "objects"),
            ("<M8[ns]", "datetime"),
            ("<f16", "float16, float32"),
            ("<i16", "integers"),
            ("<q", "recognised"),
            ("<u+4", "recognised"),
            ("|f4", "byte order"),
        ];
        for (descr, needle) in cases {
            let bytes = npy_bytes(1, &dict(descr, "(2,)"), &[]);
            let err = parse_header(Path::new("d.npy"), &bytes).unwrap_err();
            match &err {
                InputError::UnsupportedDtype { descr: d, .. } => assert_eq!(d, descr),
                other => panic!("{descr}: {other}"),
            }
            let msg = err.to_string();
            assert!(
                msg.contains(needle) && msg.contains("d.npy"),
                "{descr}: {msg}"
            );
        }
        // Structured dtypes arrive as a list of (name, type) tuples.
        let d = "{'descr': [('a', '<f4'), ('b', '<i4')], 'fortran_order': False, 'shape': (2,), }";
        let err = parse_header(Path::new("d.npy"), &npy_bytes(1, d, &[])).unwrap_err();
        match &err {
            InputError::UnsupportedDtype { descr, detail, .. } => {
                assert_eq!(descr, "[('a', '<f4'), ('b', '<i4')]");
                assert!(detail.contains("structured"));
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn malformed_headers_are_bad_header() {
        let deep = format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': {}{}}}",
            "(".repeat(100),
            ")".repeat(100)
        );
        let cases = [
            "{'descr': '<f4', 'fortran_order': False}".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1)}".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 'a')}".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': 2}".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,)}"
                .to_string(),
            "{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}".to_string(),
            "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}".to_string(),
            "{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}".to_string(),
            "{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk".to_string(),
            "{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}".to_string(),
            "{1: '<f4'}".to_string(),
            "['descr']".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2,".to_string(),
            "{'descr': '<f4', 'fortran_order': False, 'shape': (9".to_string()
                + &"9".repeat(50)
                + ",)}",
            deep,
        ];
        for d in &cases {
            let err = parse_header(Path::new("h.npy"), &npy_bytes(1, d, &[])).unwrap_err();
            assert!(matches!(err, InputError::BadHeader { .. }), "{d}: {err}");
            assert!(err.to_string().contains("h.npy"));
        }
        // Non-UTF-8 is fine in latin-1 (v1) but not in v3.
        let d = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': '\u{e9}'}";
        let mut bytes = npy_bytes(3, d, &[]);
        let pos = bytes
            .windows(2)
            .position(|w| w == "\u{e9}".as_bytes())
            .unwrap();
        bytes[pos] = 0xe9;
        bytes[pos + 1] = b' ';
        let err = parse_header(Path::new("h.npy"), &bytes).unwrap_err();
        assert!(matches!(err, InputError::BadHeader { .. }), "{err}");
        bytes[6] = 2;
        assert!(parse_header(Path::new("h.npy"), &bytes).is_ok());
    }

    #[test]
    fn oversized_shape_is_rejected_not_overflowed() {
        let dir = tempfile::tempdir().unwrap();
        let d = dict("<f8", "(4294967296, 4294967296, 4294967296)");
        let path = write(&dir, "big.npy", &npy_bytes(1, &d, &[]));
        let err = open_one(&path).unwrap_err();
        assert!(matches!(err, InputError::ShapeOverflow { .. }), "{err}");
        // Zero samples of an absurd sample shape: the file is the right size, the sample is not.
        let d = dict("<f8", "(0, 4294967296, 4294967296, 4294967296)");
        let path = write(&dir, "big0.npy", &npy_bytes(1, &d, &[]));
        let err = open_one(&path).unwrap_err();
        assert!(matches!(err, InputError::ShapeOverflow { .. }), "{err}");
    }

    #[test]
    fn mismatched_shape_names_the_differing_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = write(
            &dir,
            "a.npy",
            &npy_bytes(1, &dict("<f4", "(1, 3)"), &[0; 12]),
        );
        let b = write(
            &dir,
            "b.npy",
            &npy_bytes(1, &dict("<f4", "(2, 3)"), &[0; 24]),
        );
        let c = write(
            &dir,
            "c.npy",
            &npy_bytes(1, &dict("<f4", "(1, 4)"), &[0; 16]),
        );
        let err = open_npy_field("f", &[a.clone(), b.clone(), c.clone()]).unwrap_err();
        match &err {
            InputError::ShapeMismatch {
                path,
                expected,
                found,
                first,
            } => {
                assert_eq!(path, &c);
                assert_eq!(first, &a);
                assert_eq!(expected, &vec![3]);
                assert_eq!(found, &vec![4]);
            }
            other => panic!("{other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("c.npy") && msg.contains("a.npy"), "{msg}");

        let d = write(
            &dir,
            "d.npy",
            &npy_bytes(1, &dict("<i4", "(1, 3)"), &[0; 12]),
        );
        let err = open_npy_field("f", &[a.clone(), b, d.clone()]).unwrap_err();
        assert!(
            matches!(&err, InputError::DtypeMismatch { path, first, expected: DType::F32, found: DType::I32 } if *path == d && *first == a),
            "{err}"
        );
    }

    #[test]
    fn writer_round_trips_every_dtype() {
        let dir = tempfile::tempdir().unwrap();
        for dtype in ALL_DTYPES.into_iter().filter(|&d| d != DType::BF16) {
            for shape in [vec![5u64], vec![2, 3, 4], vec![0, 3], vec![1]] {
                let n: u64 = shape.iter().product::<u64>() * dtype.size_bytes() as u64;
                let data = pattern(n as usize);
                let path = dir.path().join(format!("{dtype}-{}.npy", shape.len()));
                let mut w = write_npy(&path, dtype, &shape).unwrap();
                // Uneven chunks, to exercise buffering.
                for chunk in data.chunks(7) {
                    w.write_all(chunk).unwrap();
                }
                w.finish().unwrap();

                let bytes = std::fs::read(&path).unwrap();
                let header = parse_header(&path, &bytes).unwrap();
                assert_eq!(header.version, (1, 0));
                assert_eq!(header.data_offset % 64, 0);
                assert_eq!(header.shape, shape);
                assert_eq!(bytes[header.data_offset - 1], b'\n');

                let field = open_one(&path).unwrap();
                assert_eq!(field.dtype, dtype);
                assert_eq!(field.sample_shape, shape[1..].to_vec());
                assert_eq!(field.sample_count(), shape[0]);
                assert_eq!(all_bytes(&field), data);
            }
        }
    }

    #[test]
    fn writer_writes_scalars_and_exact_numpy_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.npy");
        let mut w = write_npy(&path, DType::F32, &[]).unwrap();
        w.write_all(&1.5f32.to_le_bytes()).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // Byte-identical to np.save(np.float32(1.5)): numpy adds no growth padding to 0-d headers.
        let expected = npy_bytes(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
            &1.5f32.to_le_bytes(),
        );
        assert_eq!(bytes, expected);
        assert!(matches!(
            open_one(&path).unwrap_err(),
            InputError::ScalarArray { .. }
        ));
    }

    #[test]
    fn writer_uses_version_2_for_huge_headers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wide.npy");
        let shape = vec![1u64; 22_000];
        let mut w = write_npy(&path, DType::U16, &shape).unwrap();
        w.write_all(&[7, 0]).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let header = parse_header(&path, &bytes).unwrap();
        assert_eq!(header.version, (2, 0));
        assert_eq!(header.data_offset % 64, 0);
        let field = open_one(&path).unwrap();
        assert_eq!(field.sample_shape.len(), 21_999);
        assert_eq!(all_bytes(&field), vec![7, 0]);
    }

    #[test]
    fn writer_checks_byte_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.npy");
        let mut w = write_npy(&path, DType::I32, &[2, 2]).unwrap();
        w.write_all(&[0; 12]).unwrap();
        let err = w.finish().unwrap_err();
        assert!(
            matches!(&err, InputError::WriteSize { path: p, expected_bytes: 16, written_bytes: 12 } if *p == path),
            "{err}"
        );

        let mut w = write_npy(&path, DType::I32, &[2, 2]).unwrap();
        w.write_all(&[0; 12]).unwrap();
        let err = w.write_all(&[0; 8]).unwrap_err();
        assert!(
            matches!(
                err,
                InputError::WriteSize {
                    expected_bytes: 16,
                    written_bytes: 20,
                    ..
                }
            ),
            "{err}"
        );
        // The rejected write wrote nothing, so the writer can still complete.
        w.write_all(&[0; 4]).unwrap();
        w.finish().unwrap();
        assert_eq!(open_one(&path).unwrap().sample_count(), 2);
    }

    #[test]
    fn writer_refuses_bf16_and_overflow() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bf.npy");
        let err = write_npy(&path, DType::BF16, &[3]).unwrap_err();
        assert!(
            matches!(&err, InputError::UnsupportedDtype { path: p, .. } if *p == path),
            "{err}"
        );
        assert!(!path.exists(), "a refused write must not create the file");
        let err = write_npy(&path, DType::F64, &[u64::MAX, 2]).unwrap_err();
        assert!(matches!(err, InputError::ShapeOverflow { .. }), "{err}");
    }

    #[test]
    fn writer_reports_io_errors_with_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/dir/x.npy");
        let err = write_npy(&path, DType::U8, &[1]).unwrap_err();
        assert!(
            matches!(&err, InputError::Io { path: p, .. } if *p == path),
            "{err}"
        );
    }
}
