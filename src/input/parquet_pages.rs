//! A Parquet column read page by page, for the layouts pack inputs most often have: a primitive
//! column, a fixed-size list of one, or a list of one (variable-length rows: token lists), of
//! fixed-width values (`int32`, `int64`, `float`, `double`, and `float16` stored as 2-byte
//! fixed-length byte arrays), plain or dictionary encoded, with no nulls and no empty lists.
//!
//! The `parquet` crate's Arrow reader builds such a column as Arrow arrays: a validity bitmap from
//! every element's definition level, the list's offsets from its repetition levels, the values
//! through a generic decoder (a fixed-length byte array one value at a time), then a copy into the
//! scratch file. On 1024-wide `float16` rows written by pyarrow, that machinery took about two
//! thirds of the pack's time (a profile on the development VM). This reader takes the decompressed
//! pages from the crate's page reader instead and copies the values straight out of them (plain
//! pages) or through the dictionary (dictionary pages); the levels are only checked: every
//! definition level at its maximum (no nulls) and, for a fixed-size list, a repetition level of 0
//! exactly at the first value of each row of `per_row` values. For a list, the repetition levels
//! give the rows (a 0 starts one), whose ends are recorded ([`read_list_rows`]).
//!
//! Anything else (another encoding, a null, a row of another length, a malformed page, a
//! truncated row group) makes it give up (`Ok(false)`) without an error: the caller then decodes
//! the rows with the Arrow reader, which names what is wrong where there is something wrong. The
//! bytes it wrote before giving up are overwritten by that decode (they lie in the same place).

use std::fs::File;
use std::os::unix::fs::FileExt;

use std::sync::Arc;

use arrow_schema::DataType;
use parquet::basic::{Encoding, Type as PhysicalType};
use parquet::column::page::Page;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::SchemaDescriptor;

/// Bytes gathered through a dictionary before they are written.
const GATHER_BYTES: usize = 1 << 20;

/// How [`read_rows`] reads one column: its leaf in the Parquet schema and its layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PageColumn {
    leaf: usize,
    value_bytes: usize,
    per_row: usize,
    max_def: i16,
    max_rep: i16,
}

impl PageColumn {
    /// Bytes of one row.
    pub(super) fn row_bytes(&self) -> u64 {
        (self.per_row * self.value_bytes) as u64
    }
}

/// The page reader's plan for the root column `root` of a file whose Parquet schema is `schema`,
/// read as Arrow type `data_type`; `None` when it is not a layout this reader takes.
pub(super) fn plan_column(
    schema: &SchemaDescriptor,
    root: usize,
    data_type: &DataType,
) -> Option<PageColumn> {
    let (value, per_row, max_rep) = match data_type {
        DataType::FixedSizeList(item, n) if *n > 0 => (item.data_type(), *n as usize, 1),
        other => (other, 1, 0),
    };
    let mut leaves = (0..schema.num_columns()).filter(|&i| schema.get_column_root_idx(i) == root);
    let leaf = leaves.next()?;
    if leaves.next().is_some() {
        return None;
    }
    let column = schema.column(leaf);
    let value_bytes = match (column.physical_type(), value) {
        (PhysicalType::INT32, DataType::Int32 | DataType::UInt32) => 4,
        (PhysicalType::FLOAT, DataType::Float32) => 4,
        (PhysicalType::INT64, DataType::Int64 | DataType::UInt64) => 8,
        (PhysicalType::DOUBLE, DataType::Float64) => 8,
        (PhysicalType::FIXED_LEN_BYTE_ARRAY, DataType::Float16) if column.type_length() == 2 => 2,
        _ => return None,
    };
    if column.max_rep_level() != max_rep {
        return None;
    }
    Some(PageColumn {
        leaf,
        value_bytes,
        per_row,
        max_def: column.max_def_level(),
        max_rep: column.max_rep_level(),
    })
}

/// How [`read_list_rows`] reads a list column (variable-length rows) of fixed-width values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ListColumn {
    leaf: usize,
    value_bytes: usize,
    max_def: i16,
}

/// The page reader's plan for the root column `root`, a `list` or `large_list` of fixed-width
/// values read as Arrow type `data_type`; `None` when it is not one.
pub(super) fn plan_list_column(
    schema: &SchemaDescriptor,
    root: usize,
    data_type: &DataType,
) -> Option<ListColumn> {
    let item = match data_type {
        DataType::List(item) | DataType::LargeList(item) => item.data_type(),
        _ => return None,
    };
    // The same leaf rules as a fixed-size list's, one level of repetition.
    let fixed = plan_column(
        schema,
        root,
        &DataType::FixedSizeList(
            Arc::new(arrow_schema::Field::new("item", item.clone(), true)),
            1,
        ),
    )?;
    Some(ListColumn {
        leaf: fixed.leaf,
        value_bytes: fixed.value_bytes,
        max_def: fixed.max_def,
    })
}

/// Whether the page reader is used (`GPUFEED_PACK_PARQUET_PAGES=off` turns it off, for
/// comparisons with the Arrow reader).
pub(super) fn enabled() -> bool {
    std::env::var("GPUFEED_PACK_PARQUET_PAGES").map_or(true, |v| v != "off")
}

/// Reads rows `first .. first + count` of row group `group` of `column` from `reader` and writes
/// their values, back to back, at byte `at` of `out`. `Ok(false)`: the column holds something this
/// reader does not read (see the module documentation); the caller decodes the rows otherwise.
/// A whole row group (`first` 0, `count` its rows) must hold exactly `count` rows.
pub(super) fn read_rows(
    reader: &SerializedFileReader<File>,
    group: usize,
    column: &PageColumn,
    (first, count): (u64, u64),
    out: &File,
    at: u64,
) -> std::io::Result<bool> {
    let Ok(row_group) = reader.get_row_group(group) else {
        return Ok(false);
    };
    let whole = first == 0 && row_group.metadata().num_rows() as u64 == count;
    let Ok(mut pages) = row_group.get_column_page_reader(column.leaf) else {
        return Ok(false);
    };
    let mut state = ColumnState {
        column: *column,
        skip: first * column.per_row as u64,
        take: count * column.per_row as u64,
        seen: 0,
        in_row: 0,
        dictionary: None,
        indices: Vec::new(),
        gathered: Vec::new(),
        out,
        at,
    };
    loop {
        let page = match pages.get_next_page() {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(_) => return Ok(false),
        };
        if !state.page(page)? {
            return Ok(false);
        }
        if !whole && state.seen >= state.skip + state.take && state.in_row == 0 {
            break;
        }
    }
    let end = state.skip + state.take;
    Ok(state.in_row == 0
        && if whole {
            state.seen == end
        } else {
            state.seen >= end
        })
}

/// What [`read_rows`] keeps from page to page.
struct ColumnState<'a> {
    column: PageColumn,
    /// Values before the rows asked for, and values asked for.
    skip: u64,
    take: u64,
    /// Values seen so far, and the place of the next one in its row.
    seen: u64,
    in_row: usize,
    /// The dictionary page's values (plain), once read.
    dictionary: Option<Vec<u8>>,
    indices: Vec<u32>,
    gathered: Vec<u8>,
    out: &'a File,
    at: u64,
}

impl ColumnState<'_> {
    /// Takes one page; false where this reader gives up.
    fn page(&mut self, page: Page) -> std::io::Result<bool> {
        let column = self.column;
        match page {
            Page::DictionaryPage {
                buf,
                num_values,
                encoding,
                ..
            } => {
                self.dictionary = dictionary_values(&buf, num_values, encoding, column.value_bytes);
                Ok(self.dictionary.is_some())
            }
            page => {
                let Some(data) = DataPage::of(page) else {
                    return Ok(false);
                };
                // Levels a column has none of are not looked at.
                if !data.levels_decodable(column.max_rep > 0, column.max_def > 0) {
                    return Ok(false);
                }
                let n = data.values;
                let Some((rep, def, values)) =
                    split_levels(&data.buf, data.v2_lengths(), column.max_rep, column.max_def)
                else {
                    return Ok(false);
                };
                if column.max_rep > 0 && !self.check_rep(rep, n) {
                    return Ok(false);
                }
                if column.max_def > 0 && !check_def(def, n, column.max_def) {
                    return Ok(false);
                }
                self.values(values, n, data.encoding)
            }
        }
    }

    /// Checks `n` repetition levels: 0 at the first value of each row, 1 at the others.
    fn check_rep(&mut self, levels: &[u8], n: usize) -> bool {
        let per_row = self.column.per_row;
        let in_row = &mut self.in_row;
        hybrid_runs(levels, level_bits(self.column.max_rep), n, |value, len| {
            let ok = match value {
                0 => *in_row == 0 && (len == 1 || per_row == 1),
                1 => *in_row > 0 && *in_row + len <= per_row,
                _ => false,
            };
            *in_row = (*in_row + len) % per_row;
            ok
        })
    }

    /// Writes the part of a page's `n` values (encoded as `encoding` in `data`) that lies in the
    /// rows asked for.
    fn values(&mut self, data: &[u8], n: usize, encoding: Encoding) -> std::io::Result<bool> {
        let bytes = self.column.value_bytes;
        let (start, end) = (self.seen, self.seen + n as u64);
        self.seen = end;
        // Without repetition levels, a row is one value: the place in a row stays 0.
        let (from, to) = (start.max(self.skip), end.min(self.skip + self.take));
        if from >= to {
            // No value of the rows asked for: the page is not decoded.
            return Ok(decodable(encoding));
        }
        let (out, mut at) = (self.out, self.at + (from - self.skip) * bytes as u64);
        let mut decoder = PageValues {
            dictionary: self.dictionary.as_deref(),
            bytes,
            indices: &mut self.indices,
            gathered: &mut self.gathered,
        };
        let range = ((from - start) as usize, (to - start) as usize);
        decoder.emit(data, n, encoding, range, |part| {
            out.write_all_at(part, at)?;
            at += part.len() as u64;
            Ok(())
        })
    }
}

/// A dictionary page's `count` values of `value_bytes` each, where it is plain and holds them.
fn dictionary_values(
    buf: &[u8],
    count: u32,
    encoding: Encoding,
    value_bytes: usize,
) -> Option<Vec<u8>> {
    let plain = matches!(encoding, Encoding::PLAIN | Encoding::PLAIN_DICTIONARY);
    let bytes = count as usize * value_bytes;
    (plain && buf.len() >= bytes).then(|| buf[..bytes].to_vec())
}

/// Whether this reader decodes values of `encoding`.
fn decodable(encoding: Encoding) -> bool {
    matches!(
        encoding,
        Encoding::PLAIN | Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY
    )
}

/// Decodes a page's values, plain or through the dictionary.
struct PageValues<'a> {
    dictionary: Option<&'a [u8]>,
    bytes: usize,
    indices: &'a mut Vec<u32>,
    gathered: &'a mut Vec<u8>,
}

impl PageValues<'_> {
    /// Hands values `range.0 .. range.1` of a page's `n` values (encoded as `encoding` in `data`)
    /// to `emit`, in order, as byte slices; false where this reader gives up.
    fn emit(
        &mut self,
        data: &[u8],
        n: usize,
        encoding: Encoding,
        (from, to): (usize, usize),
        mut emit: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<bool> {
        let bytes = self.bytes;
        match encoding {
            Encoding::PLAIN => {
                let Some(values) = data.get(..n * bytes) else {
                    return Ok(false);
                };
                emit(&values[from * bytes..to * bytes])?;
                Ok(true)
            }
            Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY => {
                let Some(dictionary) = self.dictionary else {
                    return Ok(false);
                };
                let Some((&bits, indices)) = data.split_first() else {
                    return Ok(false);
                };
                self.indices.clear();
                if bits > 32 || !hybrid_values(indices, u32::from(bits), to, self.indices) {
                    return Ok(false);
                }
                for chunk in self.indices[from..].chunks(GATHER_BYTES / bytes) {
                    self.gathered.resize(chunk.len() * bytes, 0);
                    let gathered = match bytes {
                        2 => gather::<2>(dictionary, chunk, self.gathered),
                        4 => gather::<4>(dictionary, chunk, self.gathered),
                        8 => gather::<8>(dictionary, chunk, self.gathered),
                        _ => false,
                    };
                    if !gathered {
                        return Ok(false);
                    }
                    emit(self.gathered)?;
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// Reads rows `first .. first + count` of row group `group` of the list column `column` from
/// `reader`, writing their values, back to back, to `out` and each row's end (in values, from this
/// call's first) to `ends`. `Ok(false)`: the column holds something this reader does not read (an
/// empty or null list, a null value, another encoding, a malformed page, other than the rows
/// asked for in a whole row group); what it wrote is then to be discarded.
pub(super) fn read_list_rows(
    reader: &SerializedFileReader<File>,
    group: usize,
    column: &ListColumn,
    (first, count): (u64, u64),
    out: &mut impl std::io::Write,
    ends: &mut Vec<u64>,
) -> std::io::Result<bool> {
    let Ok(row_group) = reader.get_row_group(group) else {
        return Ok(false);
    };
    let whole = first == 0 && row_group.metadata().num_rows() as u64 == count;
    let Ok(mut pages) = row_group.get_column_page_reader(column.leaf) else {
        return Ok(false);
    };
    let end_row = (first + count) as i64;
    let first = first as i64;
    // The row of the last value seen, and the values of the rows asked for so far.
    let (mut row, mut elements) = (-1i64, 0u64);
    let mut dictionary: Option<Vec<u8>> = None;
    let (mut indices, mut gathered) = (Vec::new(), Vec::new());
    let mut stopped = false;
    while !stopped {
        let page = match pages.get_next_page() {
            Ok(Some(page)) => page,
            Ok(None) => break,
            Err(_) => return Ok(false),
        };
        let (buf, n, encoding, v2_lengths) = match page {
            Page::DictionaryPage {
                buf,
                num_values,
                encoding,
                ..
            } => {
                dictionary = dictionary_values(&buf, num_values, encoding, column.value_bytes);
                if dictionary.is_none() {
                    return Ok(false);
                }
                continue;
            }
            page => {
                let Some(data) = DataPage::of(page) else {
                    return Ok(false);
                };
                // A list's pages are checked for both level encodings.
                if !data.levels_decodable(true, true) {
                    return Ok(false);
                }
                let v2_lengths = data.v2_lengths();
                (data.buf, data.values, data.encoding, v2_lengths)
            }
        };
        let Some((rep, def, values)) = split_levels(&buf, v2_lengths, 1, column.max_def) else {
            return Ok(false);
        };
        if column.max_def > 0 && !check_def(def, n, column.max_def) {
            return Ok(false);
        }
        // The page's values of the rows asked for: `from .. to`.
        let (mut from, mut to, mut at) = (usize::MAX, 0usize, 0usize);
        let walked = hybrid_runs(rep, 1, n, |level, len| {
            match level {
                0 => {
                    for _ in 0..len {
                        if row >= first {
                            ends.push(elements);
                        }
                        row += 1;
                        if row >= end_row {
                            stopped = true;
                            return false;
                        }
                        if row >= first {
                            from = from.min(at);
                            to = at + 1;
                            elements += 1;
                        }
                        at += 1;
                    }
                }
                1 if row >= 0 => {
                    if row >= first {
                        from = from.min(at);
                        to = at + len;
                        elements += len as u64;
                    }
                    at += len;
                }
                _ => return false,
            }
            true
        });
        if !walked && !stopped {
            return Ok(false);
        }
        if from < to {
            let mut decoder = PageValues {
                dictionary: dictionary.as_deref(),
                bytes: column.value_bytes,
                indices: &mut indices,
                gathered: &mut gathered,
            };
            if !decoder.emit(values, n, encoding, (from, to), |part| out.write_all(part))? {
                return Ok(false);
            }
        } else if !decodable(encoding) {
            return Ok(false);
        }
    }
    if stopped && whole {
        // More rows than the footer gives the group: the Arrow reader says so.
        return Ok(false);
    }
    if !stopped {
        // The group ended: its last row is complete, and it must end where asked.
        if row >= first {
            ends.push(elements);
        }
        if row + 1 != end_row {
            return Ok(false);
        }
    }
    Ok(ends.len() as i64 == end_row - first)
}

/// A data page (v1 or v2) taken apart.
struct DataPage {
    buf: bytes::Bytes,
    values: usize,
    encoding: Encoding,
    levels: PageLevels,
}

/// How a data page's levels are stored.
enum PageLevels {
    /// Length-prefixed, in these encodings (repetition, definition).
    V1(Encoding, Encoding),
    /// Of these lengths (repetition, definition), with this many nulls.
    V2(usize, usize, u32),
}

impl DataPage {
    /// The data page `page`; `None` for a dictionary page.
    fn of(page: Page) -> Option<DataPage> {
        match page {
            Page::DataPage {
                buf,
                num_values,
                encoding,
                def_level_encoding,
                rep_level_encoding,
                ..
            } => Some(DataPage {
                buf,
                values: num_values as usize,
                encoding,
                levels: PageLevels::V1(rep_level_encoding, def_level_encoding),
            }),
            Page::DataPageV2 {
                buf,
                num_values,
                encoding,
                num_nulls,
                def_levels_byte_len,
                rep_levels_byte_len,
                ..
            } => Some(DataPage {
                buf,
                values: num_values as usize,
                encoding,
                levels: PageLevels::V2(
                    rep_levels_byte_len as usize,
                    def_levels_byte_len as usize,
                    num_nulls,
                ),
            }),
            Page::DictionaryPage { .. } => None,
        }
    }

    /// Whether this reader takes the page's levels: RLE-encoded (v1; the repetition levels only
    /// when `rep`, the definition levels only when `def`), and no null (v2).
    fn levels_decodable(&self, rep: bool, def: bool) -> bool {
        match self.levels {
            PageLevels::V1(rep_encoding, def_encoding) => {
                (!rep || rep_encoding == Encoding::RLE) && (!def || def_encoding == Encoding::RLE)
            }
            PageLevels::V2(_, _, nulls) => nulls == 0,
        }
    }

    /// A v2 page's level lengths (repetition, definition); `None` for a v1 page.
    fn v2_lengths(&self) -> Option<(usize, usize)> {
        match self.levels {
            PageLevels::V1(..) => None,
            PageLevels::V2(rep, def, _) => Some((rep, def)),
        }
    }
}

/// A data page split into its repetition levels (none when `max_rep` is 0), its definition levels
/// (none when `max_def` is 0) and its values: a v1 page's levels are length-prefixed, a v2 page's
/// lengths (`v2`: repetition, definition) are in its header. `None` when the page is shorter than
/// that.
fn split_levels(
    buf: &[u8],
    v2: Option<(usize, usize)>,
    max_rep: i16,
    max_def: i16,
) -> Option<(&[u8], &[u8], &[u8])> {
    match v2 {
        None => {
            let (rep, rest) = if max_rep > 0 {
                length_prefixed(buf)?
            } else {
                (&buf[..0], buf)
            };
            let (def, values) = if max_def > 0 {
                length_prefixed(rest)?
            } else {
                (&rest[..0], rest)
            };
            Some((rep, def, values))
        }
        Some((rep_len, def_len)) => {
            if buf.len() < rep_len + def_len {
                return None;
            }
            let (rep, rest) = buf.split_at(rep_len);
            let (def, values) = rest.split_at(def_len);
            Some((rep, def, values))
        }
    }
}

/// Checks that `n` definition levels are all `max`.
fn check_def(levels: &[u8], n: usize, max: i16) -> bool {
    let max = max as u32;
    hybrid_runs(levels, level_bits(max as i16), n, |value, _| value == max)
}

/// Bits of a level of at most `max`.
fn level_bits(max: i16) -> u32 {
    u32::BITS - (max as u32).leading_zeros()
}

/// A v1 page's levels: a 4-byte little-endian length, then that many bytes; and what follows.
fn length_prefixed(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let length = u32::from_le_bytes(data.get(..4)?.try_into().ok()?) as usize;
    let levels = data.get(4..4 + length)?;
    Some((levels, &data[4 + length..]))
}

/// Copies the `B`-byte dictionary entry of each of `indices` into `out`, one after the other;
/// false at an index past the dictionary's end.
fn gather<const B: usize>(dictionary: &[u8], indices: &[u32], out: &mut [u8]) -> bool {
    let entries = dictionary.len() / B;
    for (place, &index) in out.chunks_exact_mut(B).zip(indices) {
        let index = index as usize;
        if index >= entries {
            return false;
        }
        place.copy_from_slice(&dictionary[index * B..index * B + B]);
    }
    true
}

/// A piece of Parquet's RLE / bit-packed hybrid encoding: a run of one value, or values packed
/// `bits` bits each (least significant bit first) in the bytes given.
enum Segment<'a> {
    Run(u32, usize),
    Packed(&'a [u8], usize),
}

/// The segments holding the first `count` values of a hybrid encoding of `bits`-bit values, in
/// order; `Err` (and then nothing more) where the data end first or are malformed.
struct Segments<'a> {
    data: &'a [u8],
    bits: u32,
    left: usize,
}

impl<'a> Iterator for Segments<'a> {
    type Item = Result<Segment<'a>, ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        let segment = self.segment();
        if segment.is_err() {
            self.left = 0;
        }
        Some(segment)
    }
}

impl<'a> Segments<'a> {
    fn segment(&mut self) -> Result<Segment<'a>, ()> {
        let (header, after) = uleb128(self.data).ok_or(())?;
        if header & 1 == 0 {
            let value_bytes = self.bits.div_ceil(8) as usize;
            let value = after.get(..value_bytes).ok_or(())?;
            self.data = &after[value_bytes..];
            let mut word = [0u8; 4];
            word[..value_bytes].copy_from_slice(value);
            let take = ((header >> 1) as usize).min(self.left);
            if take == 0 {
                return Err(());
            }
            self.left -= take;
            Ok(Segment::Run(u32::from_le_bytes(word), take))
        } else {
            let groups = (header >> 1) as usize;
            let packed = (groups * self.bits as usize).min(after.len());
            let take = (groups * 8).min(self.left);
            if take == 0 {
                return Err(());
            }
            self.data = &after[packed..];
            self.left -= take;
            Ok(Segment::Packed(&after[..packed], take))
        }
    }
}

/// Walks the first `count` values of the hybrid encoding of `bits`-bit values in `data`, calling
/// `run(value, length)` for each run of equal values it finds (a packed value is a run of one);
/// false when the data end first, or `run` says false.
fn hybrid_runs(
    data: &[u8],
    bits: u32,
    count: usize,
    mut run: impl FnMut(u32, usize) -> bool,
) -> bool {
    let segments = Segments {
        data,
        bits,
        left: count,
    };
    for segment in segments {
        let ok = match segment {
            Err(()) => false,
            Ok(Segment::Run(value, length)) => run(value, length),
            Ok(Segment::Packed(bytes, values)) => {
                unpack(bytes, bits, values, |value| run(value, 1))
            }
        };
        if !ok {
            return false;
        }
    }
    true
}

/// Appends the first `count` values of the hybrid encoding of `bits`-bit values in `data` to
/// `out`; false when the data end first.
fn hybrid_values(data: &[u8], bits: u32, count: usize, out: &mut Vec<u32>) -> bool {
    out.reserve(count);
    let segments = Segments {
        data,
        bits,
        left: count,
    };
    for segment in segments {
        let ok = match segment {
            Err(()) => false,
            Ok(Segment::Run(value, length)) => {
                out.extend(std::iter::repeat_n(value, length));
                true
            }
            Ok(Segment::Packed(bytes, values)) => unpack(bytes, bits, values, |value| {
                out.push(value);
                true
            }),
        };
        if !ok {
            return false;
        }
    }
    true
}

/// Calls `each` for each of `n` `bits`-bit values packed least significant bit first in `bytes`;
/// false when the bytes end first, or `each` says false.
#[inline]
fn unpack(bytes: &[u8], bits: u32, n: usize, mut each: impl FnMut(u32) -> bool) -> bool {
    if bits == 0 {
        return (0..n).all(|_| each(0));
    }
    let mask = (1u64 << bits) - 1;
    let (mut word, mut held, mut at) = (0u64, 0u32, 0usize);
    for _ in 0..n {
        while held < bits {
            let Some(&byte) = bytes.get(at) else {
                return false;
            };
            word |= u64::from(byte) << held;
            held += 8;
            at += 1;
        }
        if !each((word & mask) as u32) {
            return false;
        }
        word >>= bits;
        held -= bits;
    }
    true
}

/// An unsigned LEB128 number at the start of `data`, and what follows it.
fn uleb128(data: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, &byte) in data.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, &data[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(data: &[u8], bits: u32, count: usize) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        hybrid_runs(data, bits, count, |v, n| {
            out.extend(std::iter::repeat_n(v, n));
            true
        })
        .then_some(out)
    }

    #[test]
    fn the_hybrid_encoding_decodes_rle_and_bit_packed_runs() {
        // An RLE run of five 3s (bit width 2: one value byte), then one bit-packed group of
        // eight 2-bit values 0..4, 0..4.
        let data = [5 << 1, 3, (1 << 1) | 1, 0b11_10_01_00, 0b11_10_01_00];
        assert_eq!(
            runs(&data, 2, 13).unwrap(),
            vec![3, 3, 3, 3, 3, 0, 1, 2, 3, 0, 1, 2, 3]
        );
        // Fewer values asked for than the group holds: the rest is padding.
        assert_eq!(runs(&data, 2, 7).unwrap(), vec![3, 3, 3, 3, 3, 0, 1]);
        // Data that end first.
        assert!(runs(&data[..3], 2, 13).is_none());
        // 16-bit values: two value bytes in an RLE run.
        assert_eq!(runs(&[2 << 1, 0x34, 0x12], 16, 2).unwrap(), vec![0x1234; 2]);
        // Bit width 0: every value is 0 and takes no bytes.
        assert_eq!(runs(&[4 << 1], 0, 4).unwrap(), vec![0; 4]);
    }

    use arrow_array::{ArrayRef, FixedSizeListArray, Float16Array, Float64Array, Int32Array};
    use arrow_array::{RecordBatch, StringArray};
    use arrow_schema::Field;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::file::properties::{WriterProperties, WriterVersion};
    use std::sync::Arc;

    const ROWS: usize = 1000;
    const WIDTH: usize = 8;

    /// A batch of a fixed-size list of `float16` (row r, element e: r * 8 + e, as f16 bits),
    /// an `int32` column (r * 3 - 7), a `double` one (r / 4) and a string one.
    fn batch() -> RecordBatch {
        let halves: Vec<half::f16> = (0..ROWS * WIDTH)
            .map(|i| half::f16::from_bits((i % 60_000) as u16))
            .collect();
        let item = Arc::new(Field::new_list_field(arrow_schema::DataType::Float16, true));
        let emb = FixedSizeListArray::try_new(
            item,
            WIDTH as i32,
            Arc::new(Float16Array::from(halves)),
            None,
        )
        .unwrap();
        let ints = Int32Array::from_iter_values((0..ROWS as i32).map(|r| r * 3 - 7));
        let doubles = Float64Array::from_iter_values((0..ROWS).map(|r| r as f64 / 4.0));
        let text = StringArray::from_iter_values((0..ROWS).map(|r| r.to_string()));
        RecordBatch::try_from_iter([
            ("emb", Arc::new(emb) as ArrayRef),
            ("ints", Arc::new(ints) as ArrayRef),
            ("doubles", Arc::new(doubles) as ArrayRef),
            ("text", Arc::new(text) as ArrayRef),
        ])
        .unwrap()
    }

    /// The little-endian bytes of rows `rows` of column `name` as a pack stores them.
    fn expected(name: &str, rows: std::ops::Range<usize>) -> Vec<u8> {
        match name {
            "emb" => (rows.start * WIDTH..rows.end * WIDTH)
                .flat_map(|i| ((i % 60_000) as u16).to_le_bytes())
                .collect(),
            "ints" => rows
                .flat_map(|r| (r as i32 * 3 - 7).to_le_bytes())
                .collect(),
            _ => rows.flat_map(|r| (r as f64 / 4.0).to_le_bytes()).collect(),
        }
    }

    /// Writes `batch` with `dictionary` on or off (plain values then), in data pages of version
    /// `version`, pages of 64 rows and row groups of 300.
    fn write_batch(
        path: &std::path::Path,
        batch: &RecordBatch,
        dictionary: bool,
        version: WriterVersion,
    ) {
        let mut properties = WriterProperties::builder();
        if !dictionary {
            // Version 2's default for values without a dictionary is a delta encoding.
            properties = properties.set_encoding(parquet::basic::Encoding::PLAIN);
        }
        let properties = properties
            .set_dictionary_enabled(dictionary)
            .set_writer_version(version)
            .set_data_page_row_count_limit(64)
            .set_write_batch_size(64)
            .set_max_row_group_row_count(Some(300))
            .build();
        let file = File::create(path).unwrap();
        let mut writer =
            parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(properties)).unwrap();
        writer.write(batch).unwrap();
        writer.close().unwrap();
    }

    /// Writes [`batch`] as [`write_batch`] does.
    fn write(path: &std::path::Path, dictionary: bool, version: WriterVersion) {
        write_batch(path, &batch(), dictionary, version);
    }

    /// Rows `first .. first + count` of row group `group` of column `name`, read by `read_rows`
    /// (`None` where it gives up).
    fn read(path: &std::path::Path, name: &str, group: usize, rows: (u64, u64)) -> Option<Vec<u8>> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap()).unwrap();
        let schema = builder.schema().clone();
        let root = schema.index_of(name).unwrap();
        let column = plan_column(
            builder.parquet_schema(),
            root,
            schema.field(root).data_type(),
        )
        .unwrap();
        let reader = SerializedFileReader::new(File::open(path).unwrap()).unwrap();
        let out = tempfile::tempfile().unwrap();
        let at = 100;
        read_rows(&reader, group, &column, rows, &out, at)
            .unwrap()
            .then(|| {
                let mut bytes = vec![0u8; rows.1 as usize * column.per_row * column.value_bytes];
                out.read_exact_at(&mut bytes, at).unwrap();
                bytes
            })
    }

    #[test]
    fn plain_and_dictionary_pages_of_both_versions_read_as_the_values() {
        let dir = tempfile::tempdir().unwrap();
        for dictionary in [true, false] {
            for version in [WriterVersion::PARQUET_1_0, WriterVersion::PARQUET_2_0] {
                let path = dir
                    .path()
                    .join(format!("t-{dictionary}-{version:?}.parquet"));
                write(&path, dictionary, version);
                for name in ["emb", "ints", "doubles"] {
                    let case = format!("{name}, dictionary {dictionary}, {version:?}");
                    // Whole row groups (300, 300, 300, 100 rows), and slices across pages.
                    for (group, first, count) in [
                        (0, 0, 300),
                        (1, 0, 300),
                        (3, 0, 100),
                        (2, 37, 100),
                        (1, 250, 50),
                    ] {
                        let rows = 300 * group + first;
                        let read = read(&path, name, group, (first as u64, count as u64));
                        assert!(
                            read.as_deref() == Some(&expected(name, rows..rows + count)[..]),
                            "{case}: group {group}, rows {first} + {count}: {}",
                            read.map_or("given up".into(), |r| format!("{} bytes differ", r.len()))
                        );
                    }
                    // A whole group claimed with more rows than it holds is given up.
                    assert!(read(&path, name, 3, (0, 101)).is_none(), "{case}");
                }
            }
        }
    }

    #[test]
    fn nulls_and_other_layouts_are_left_to_the_arrow_reader() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nulls.parquet");
        let ints = Int32Array::from_iter((0..100).map(|r| (r != 42).then_some(r)));
        let batch = RecordBatch::try_from_iter([("ints", Arc::new(ints) as ArrayRef)]).unwrap();
        let file = File::create(&path).unwrap();
        let mut writer = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        assert!(read(&path, "ints", 0, (0, 100)).is_none());
        // So are rows before it in its page: levels are checked page by page.
        assert!(read(&path, "ints", 0, (0, 40)).is_none());
        // Strings, lists and narrower integers are not planned.
        let other = dir.path().join("other.parquet");
        write(&other, true, WriterVersion::PARQUET_1_0);
        let builder =
            ParquetRecordBatchReaderBuilder::try_new(File::open(&other).unwrap()).unwrap();
        let text = builder.schema().index_of("text").unwrap();
        let text_type = builder.schema().field(text).data_type().clone();
        assert_eq!(
            plan_column(builder.parquet_schema(), text, &text_type),
            None
        );
        let list = arrow_schema::DataType::List(Arc::new(Field::new_list_field(
            arrow_schema::DataType::Int32,
            true,
        )));
        assert_eq!(plan_column(builder.parquet_schema(), 1, &list), None);
        assert_eq!(
            plan_column(builder.parquet_schema(), 1, &arrow_schema::DataType::Int16),
            None
        );
    }

    /// Token lists: row r holds `r % 9 + 1` values `r * 16 + j` (an `int32` list column).
    fn write_lists(
        path: &std::path::Path,
        rows: usize,
        dictionary: bool,
        version: WriterVersion,
        empty_at: Option<usize>,
    ) {
        use arrow_array::builder::{Int32Builder, ListBuilder};
        let mut lists = ListBuilder::new(Int32Builder::new());
        for row in 0..rows {
            if Some(row) != empty_at {
                for j in 0..row % 9 + 1 {
                    lists.values().append_value((row * 16 + j) as i32);
                }
            }
            lists.append(true);
        }
        let batch =
            RecordBatch::try_from_iter([("tokens", Arc::new(lists.finish()) as ArrayRef)]).unwrap();
        write_batch(path, &batch, dictionary, version);
    }

    /// Rows `first .. first + count` of row group `group` of the list column, read by
    /// `read_list_rows`: the values' bytes and the rows' ends (`None` where it gives up).
    fn read_lists(
        path: &std::path::Path,
        group: usize,
        rows: (u64, u64),
    ) -> Option<(Vec<u8>, Vec<u64>)> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(path).unwrap()).unwrap();
        let schema = builder.schema().clone();
        let column =
            plan_list_column(builder.parquet_schema(), 0, schema.field(0).data_type()).unwrap();
        let reader = SerializedFileReader::new(File::open(path).unwrap()).unwrap();
        let (mut out, mut ends) = (Vec::new(), Vec::new());
        read_list_rows(&reader, group, &column, rows, &mut out, &mut ends)
            .unwrap()
            .then_some((out, ends))
    }

    #[test]
    fn list_pages_of_both_versions_read_as_the_values_and_each_rows_end() {
        let dir = tempfile::tempdir().unwrap();
        for dictionary in [true, false] {
            for version in [WriterVersion::PARQUET_1_0, WriterVersion::PARQUET_2_0] {
                let path = dir
                    .path()
                    .join(format!("l-{dictionary}-{version:?}.parquet"));
                write_lists(&path, 1000, dictionary, version, None);
                for (group, first, count) in [
                    (0, 0, 300),
                    (3, 0, 100),
                    (1, 37, 100),
                    (2, 250, 50),
                    (1, 0, 1),
                ] {
                    let rows = 300 * group + first..300 * group + first + count;
                    let mut values = Vec::new();
                    let mut ends = Vec::new();
                    for row in rows {
                        for j in 0..row % 9 + 1 {
                            values.extend_from_slice(&((row * 16 + j) as i32).to_le_bytes());
                        }
                        ends.push(values.len() as u64 / 4);
                    }
                    let read = read_lists(&path, group, (first as u64, count as u64));
                    assert!(
                        read == Some((values, ends)),
                        "dictionary {dictionary}, {version:?}: group {group}, rows {first} + \
                         {count}: {}",
                        read.map_or("given up".into(), |r| format!("{} ends differ", r.1.len()))
                    );
                }
                // More rows than the group holds are given up.
                assert!(read_lists(&path, 3, (0, 101)).is_none());
            }
        }
        // An empty list (a definition level below the maximum) is left to the Arrow reader.
        let path = dir.path().join("empty.parquet");
        write_lists(&path, 300, true, WriterVersion::PARQUET_1_0, Some(120));
        assert!(read_lists(&path, 0, (0, 300)).is_none());
        // A plain list plan is not a fixed-width one, and the other way round.
        let builder = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap();
        let list_type = builder.schema().field(0).data_type().clone();
        assert_eq!(plan_column(builder.parquet_schema(), 0, &list_type), None);
    }

    #[test]
    fn levels_take_the_bits_their_maximum_needs() {
        assert_eq!(level_bits(0), 0);
        assert_eq!(level_bits(1), 1);
        assert_eq!(level_bits(2), 2);
        assert_eq!(level_bits(3), 2);
        assert_eq!(level_bits(4), 3);
    }
}
