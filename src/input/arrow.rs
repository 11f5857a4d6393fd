//! Parquet files and Arrow IPC files and streams (the format of a Hugging Face `datasets` cache) as
//! pack inputs: primitive columns become scalar fields, fixed-size list columns fixed-shape fields
//! (nested fixed-size lists a shape of several dimensions), list columns (`list`, `large_list` of
//! such values) variable-length fields of their values, strings and binaries variable-length `u8`
//! fields of their bytes.
//!
//! A pack copies a field's samples range by range and, with `--codec auto`, samples blocks spread
//! over the whole field first ([`FieldSource::copy_samples`] is random access). Parquet and IPC
//! data are encoded, so they are decoded once, record batch by record batch, into one scratch file
//! per field beside the output, which the field then maps like an `.npy`: memory holds one record
//! batch at a time (Parquet batches are cut to about [`BATCH_BYTES_TARGET`]; an IPC batch is read
//! as written, so its largest batch bounds the memory), and the scratch files, unlinked from the
//! start, take the raw size of the fields until the pack ends: in memory (anonymous `memfd` files)
//! when the inputs' decoded size is at most an eighth of the host's available memory, otherwise on
//! the output's disk (see `scratch_in_memory`).
//!
//! A file with a variable-length column: each variable-length field keeps its samples' ends (8
//! bytes a row) in memory for the pack. An IPC file, or a pack on one thread, decodes it in order;
//! a Parquet file on several threads decodes its row groups (or slices of them) on the threads, each
//! appending each column to a scratch file of its own for that field, and the pieces and ends are
//! put back in file order once all are decoded (`read_parquet_parallel_appending`).
//!
//! Refused, naming the file and column (and row): list views, maps, string and binary views,
//! lists of lists, types with no gpufeed dtype, null values (a null list, or a null inside one),
//! files whose columns differ in type, and Parquet files whose footer disagrees with the rows their
//! row groups hold.

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, SchemaRef};
use gpufeed_proto::DType;
use parquet::arrow::arrow_reader::{
    ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder, RowSelection, RowSelector,
};
use parquet::arrow::ProjectionMask;

use super::{checked_sample_bytes, Backing, FieldSource, InputError, SourcePart};
use crate::storage::mapped::MappedFile;

/// Raw bytes a Parquet record batch is cut to: large enough that per-batch costs vanish, small
/// enough that memory stays bounded whatever the row groups' size.
pub const BATCH_BYTES_TARGET: usize = 32 << 20;

/// Raw bytes of a record batch of a sequential Parquet read (a file with a variable-length column,
/// or one thread): as for the threads of a parallel read, batches small enough for their buffers
/// to be reused from batch to batch (batches of 32 MiB of token lists spent more time faulting in
/// and zeroing new buffers than decoding).
const SEQUENTIAL_BATCH_BYTES: usize = THREAD_BATCH_BYTES_MAX;

/// Raw bytes of a record batch that one thread of a parallel Parquet read decodes at most: a batch
/// small enough to stay in the core's cache between its decoding and its write to the scratch
/// file, and for its buffers to be reused from batch to batch rather than handed back to the
/// system and faulted in (and zeroed) again, which cost more than the decoding itself with batches
/// of 16 MiB.
const THREAD_BATCH_BYTES_MAX: usize = 1 << 20;

/// Raw bytes of a slice of a Parquet row group at least: when a file has fewer row groups than
/// the pack has threads, each row group is cut into slices for several threads to decode, each
/// skipping the rows before its slice (which costs about a tenth of decoding them), but none
/// smaller than this, so that the skipping stays small beside the decoding.
const SLICE_BYTES_MIN: u64 = 16 << 20;

/// Rows of a Parquet record batch at most, whatever the row size.
const BATCH_ROWS_MAX: usize = 1 << 16;

/// Buffer of each scratch file's writer.
const SCRATCH_BUFFER_BYTES: usize = 1 << 20;

/// The kinds of table file read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableFormat {
    /// A Parquet file (`PAR1` magic).
    Parquet,
    /// An Arrow IPC file (`ARROW1` magic; Feather version 2).
    IpcFile,
    /// An Arrow IPC stream, as Hugging Face `datasets` writes its cache files.
    IpcStream,
}

impl TableFormat {
    /// The format's name in messages.
    pub fn describe(self) -> &'static str {
        match self {
            TableFormat::Parquet => "Parquet",
            TableFormat::IpcFile => "Arrow IPC file",
            TableFormat::IpcStream => "Arrow IPC stream",
        }
    }
}

/// Whether `path` is named like a table input (`.parquet`, `.pq`, `.arrow`, `.arrows`, `.ipc`,
/// `.feather`).
pub fn is_table_path(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| {
        matches!(
            e.to_ascii_lowercase().as_str(),
            "parquet" | "pq" | "arrow" | "arrows" | "ipc" | "feather"
        )
    })
}

/// The rows of each row group of the Parquet file at `path` (`metadata`, its footer), checked
/// against the footer's total.
fn row_group_rows(
    path: &Path,
    metadata: &parquet::file::metadata::ParquetMetaData,
) -> Result<Vec<u64>, InputError> {
    let footer_rows = metadata.file_metadata().num_rows();
    let group_rows: Vec<u64> = metadata
        .row_groups()
        .iter()
        .map(|g| u64::try_from(g.num_rows()).unwrap_or(u64::MAX))
        .collect();
    let rows: u64 = group_rows.iter().sum();
    if footer_rows < 0 || footer_rows as u64 != rows {
        return Err(table_error(
            path,
            format!("the footer says {footer_rows} rows but its row groups say {rows}"),
        ));
    }
    Ok(group_rows)
}

/// A record batch of row group `group` of the file at `path`, after row `first_row`, that could not
/// be read.
fn batch_error(path: &Path, group: usize, first_row: u64, e: impl std::fmt::Display) -> InputError {
    table_error(
        path,
        format!(
            "reading a record batch: {e} (row group {group}, after row {first_row}: is the file \
             truncated or corrupt?)"
        ),
    )
}

fn table_error(path: &Path, reason: impl Into<String>) -> InputError {
    InputError::Table {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io_error(path: &Path) -> impl Fn(io::Error) -> InputError + '_ {
    move |source| InputError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Tells the format of `path` by its first bytes.
pub fn table_format(path: &Path) -> Result<TableFormat, InputError> {
    let mut file = crate::format::open_regular(path).map_err(io_error(path))?;
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < head.len() {
        let n = file.read(&mut head[got..]).map_err(io_error(path))?;
        if n == 0 {
            break;
        }
        got += n;
    }
    let head = &head[..got];
    if head.starts_with(b"PAR1") {
        Ok(TableFormat::Parquet)
    } else if head.starts_with(b"ARROW1") {
        Ok(TableFormat::IpcFile)
    } else if head.starts_with(&[0xff; 4]) {
        Ok(TableFormat::IpcStream)
    } else if head.starts_with(b"FEA1") {
        Err(table_error(
            path,
            "Feather version 1 is not supported; save it again as Feather version 2 (Arrow IPC)",
        ))
    } else {
        Err(table_error(
            path,
            "neither Parquet (PAR1) nor Arrow IPC (ARROW1 or a stream's 0xFFFFFFFF marker)",
        ))
    }
}

/// What a column can be: a field of a dtype and per-sample shape, or why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ColumnKind {
    /// A fixed-shape field.
    Field {
        /// The element type.
        dtype: DType,
        /// The per-sample shape (empty for a scalar column).
        shape: Vec<u64>,
    },
    /// A variable-length field: each row a run of elements of this dtype and shape.
    Variable {
        /// The element type.
        dtype: DType,
        /// The shape of one element (empty for a list of scalars).
        shape: Vec<u64>,
    },
    /// Why the column cannot be a field.
    Refused(String),
}

const VARIABLE: &str = "this kind of variable-length column is not supported";

/// What `data_type` can be as a field.
pub fn column_kind(data_type: &DataType) -> ColumnKind {
    let dtype = match data_type {
        DataType::Int8 => DType::I8,
        DataType::Int16 => DType::I16,
        DataType::Int32 => DType::I32,
        DataType::Int64 => DType::I64,
        DataType::UInt8 => DType::U8,
        DataType::UInt16 => DType::U16,
        DataType::UInt32 => DType::U32,
        DataType::UInt64 => DType::U64,
        DataType::Float16 => DType::F16,
        DataType::Float32 => DType::F32,
        DataType::Float64 => DType::F64,
        // Bit-packed in Arrow; stored one byte (0 or 1) per value.
        DataType::Boolean => DType::U8,
        DataType::FixedSizeList(child, length) => {
            if *length <= 0 {
                return ColumnKind::Refused(format!(
                    "fixed-size lists of {length} values: every sample would be empty"
                ));
            }
            return match column_kind(child.data_type()) {
                ColumnKind::Field { dtype, mut shape } => {
                    shape.insert(0, *length as u64);
                    ColumnKind::Field { dtype, shape }
                }
                ColumnKind::Variable { .. } => ColumnKind::Refused(format!(
                    "fixed-size lists of variable-length values: {VARIABLE}"
                )),
                ColumnKind::Refused(why) => ColumnKind::Refused(format!("its values: {why}")),
            };
        }
        DataType::List(child) | DataType::LargeList(child) => {
            return match column_kind(child.data_type()) {
                ColumnKind::Field { dtype, shape } => ColumnKind::Variable { dtype, shape },
                ColumnKind::Variable { .. } => ColumnKind::Refused(format!(
                    "lists of lists: {VARIABLE} (a list of fixed-size lists packs)"
                )),
                ColumnKind::Refused(why) => ColumnKind::Refused(format!("its values: {why}")),
            }
        }
        DataType::ListView(_) | DataType::LargeListView(_) | DataType::Map(..) => {
            return ColumnKind::Refused(format!(
                "list views and maps: {VARIABLE} (a list or a fixed-size list packs)"
            ))
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Binary | DataType::LargeBinary => {
            return ColumnKind::Variable {
                dtype: DType::U8,
                shape: Vec::new(),
            }
        }
        DataType::Utf8View | DataType::BinaryView => {
            return ColumnKind::Refused(format!(
                "string and binary views: {VARIABLE} (cast to string or binary)"
            ))
        }
        other => return ColumnKind::Refused(format!("{other} has no gpufeed dtype")),
    };
    ColumnKind::Field {
        dtype,
        shape: Vec::new(),
    }
}

/// An Arrow type as pyarrow spells it, shortly: `int64`, `fixed_size_list<float>[8]`, `list<int32>`.
pub fn type_name(data_type: &DataType) -> String {
    match data_type {
        DataType::FixedSizeList(child, length) => {
            format!(
                "fixed_size_list<{}>[{length}]",
                type_name(child.data_type())
            )
        }
        DataType::List(child) | DataType::ListView(child) => {
            format!("list<{}>", type_name(child.data_type()))
        }
        DataType::LargeList(child) | DataType::LargeListView(child) => {
            format!("large_list<{}>", type_name(child.data_type()))
        }
        DataType::Utf8 | DataType::Utf8View => "string".into(),
        DataType::LargeUtf8 => "large_string".into(),
        DataType::Boolean => "bool".into(),
        other => other.to_string().to_ascii_lowercase(),
    }
}

/// One column of a table input, as `list-inputs` shows it.
#[derive(Clone, Debug)]
pub struct TableColumn {
    /// The column's name.
    pub name: String,
    /// The Arrow type.
    pub data_type: DataType,
    /// What it can be.
    pub kind: ColumnKind,
}

/// A table input described: format, rows, columns.
#[derive(Clone, Debug)]
pub struct TableListing {
    /// The format.
    pub format: TableFormat,
    /// Rows (Parquet: from the footer; IPC: counted batch by batch).
    pub rows: u64,
    /// The columns, in file order.
    pub columns: Vec<TableColumn>,
}

impl TableListing {
    /// Lines for `gpufeed list-inputs`.
    pub fn describe(&self, path: &Path) -> String {
        let mut text = format!(
            "{}: {}, {} rows, {} column(s)",
            path.display(),
            self.format.describe(),
            self.rows,
            self.columns.len()
        );
        let types: Vec<String> = self
            .columns
            .iter()
            .map(|c| type_name(&c.data_type))
            .collect();
        let name_width = self.columns.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let type_width = types.iter().map(String::len).max().unwrap_or(0);
        for (column, arrow_type) in self.columns.iter().zip(&types) {
            let what = match &column.kind {
                ColumnKind::Field { dtype, shape } => {
                    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
                    format!("{dtype} [{}]", dims.join(", "))
                }
                ColumnKind::Variable { dtype, shape } => {
                    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
                    format!("{dtype} [*, {}] variable-length", dims.join(", "))
                        .replace(", ] ", "] ")
                }
                ColumnKind::Refused(why) => format!("(gpufeed cannot pack this: {why})"),
            };
            text.push_str(&format!(
                "\n  {:name_width$}  {arrow_type:type_width$}  {what}",
                column.name
            ));
        }
        text
    }
}

fn columns_of(schema: &SchemaRef) -> Vec<TableColumn> {
    schema
        .fields()
        .iter()
        .map(|f| TableColumn {
            name: f.name().clone(),
            data_type: f.data_type().clone(),
            kind: column_kind(f.data_type()),
        })
        .collect()
}

/// Describes a table input without decoding its values (an IPC stream's batches are read to count
/// its rows).
pub fn describe_table(path: &Path) -> Result<TableListing, InputError> {
    let format = table_format(path)?;
    let mut reader = BatchReader::open(path, format, None, None)?;
    let columns = columns_of(&reader.schema);
    let rows = match reader.footer_rows {
        Some(rows) => rows,
        None => {
            let mut rows = 0u64;
            while let Some(batch) = reader.next_batch()? {
                rows += batch.num_rows() as u64;
            }
            rows
        }
    };
    Ok(TableListing {
        format,
        rows,
        columns,
    })
}

/// Record batches of one table file, whichever the format.
struct BatchReader<'a> {
    path: &'a Path,
    schema: SchemaRef,
    /// Rows the Parquet footer announces (checked against the rows read).
    footer_rows: Option<u64>,
    batches: Box<dyn Iterator<Item = Result<RecordBatch, arrow_schema::ArrowError>> + 'a>,
}

impl<'a> BatchReader<'a> {
    /// Opens `path`; with `columns`, reads only those (by name; all of them must exist, which the
    /// caller checked against `schema`). `row_bytes` sizes Parquet batches.
    fn open(
        path: &'a Path,
        format: TableFormat,
        columns: Option<&[String]>,
        row_bytes: Option<usize>,
    ) -> Result<BatchReader<'a>, InputError> {
        let file = crate::format::open_regular(path).map_err(io_error(path))?;
        let bad = |e: &dyn std::fmt::Display| {
            table_error(path, format!("reading {}: {e}", format.describe()))
        };
        match format {
            TableFormat::Parquet => {
                let builder =
                    ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| bad(&e))?;
                let schema = builder.schema().clone();
                let footer_rows = builder.metadata().file_metadata().num_rows();
                let group_rows: i64 = builder
                    .metadata()
                    .row_groups()
                    .iter()
                    .map(|g| g.num_rows())
                    .sum();
                if footer_rows != group_rows || footer_rows < 0 {
                    return Err(table_error(
                        path,
                        format!(
                            "the footer says {footer_rows} rows but its row groups say {group_rows}"
                        ),
                    ));
                }
                let mut builder = builder;
                if let Some(columns) = columns {
                    let roots = indices(&schema, columns);
                    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
                    builder = builder.with_projection(mask);
                }
                // A variable-length column's row is longer than the element `row_bytes` counts:
                // the footer's decoded bytes per row (every column's: an over-estimate) size the
                // batch as well, so that a batch of long documents stays near its target.
                let footer_row_bytes = builder
                    .metadata()
                    .row_groups()
                    .iter()
                    .map(|g| g.total_byte_size().max(0) as u64)
                    .sum::<u64>()
                    / (footer_rows.max(1) as u64);
                let row_bytes = row_bytes.unwrap_or(1).max(footer_row_bytes as usize).max(1);
                let rows = (SEQUENTIAL_BATCH_BYTES / row_bytes).clamp(1, BATCH_ROWS_MAX);
                let reader = builder.with_batch_size(rows).build().map_err(|e| bad(&e))?;
                Ok(BatchReader {
                    path,
                    schema,
                    footer_rows: Some(footer_rows as u64),
                    batches: Box::new(reader),
                })
            }
            TableFormat::IpcFile => {
                let probe = arrow_ipc::reader::FileReader::try_new_buffered(
                    file.try_clone().map_err(io_error(path))?,
                    None,
                )
                .map_err(|e| bad(&e))?;
                let schema = probe.schema();
                drop(probe);
                let projection = columns.map(|c| indices(&schema, c));
                let reader = arrow_ipc::reader::FileReader::try_new_buffered(file, projection)
                    .map_err(|e| bad(&e))?;
                Ok(BatchReader {
                    path,
                    schema,
                    footer_rows: None,
                    batches: Box::new(reader),
                })
            }
            TableFormat::IpcStream => {
                // The schema is the stream's first message: read it, then open the stream again
                // with the projection.
                let probe = arrow_ipc::reader::StreamReader::try_new_buffered(
                    file.try_clone().map_err(io_error(path))?,
                    None,
                )
                .map_err(|e| bad(&e))?;
                let schema = probe.schema();
                drop(probe);
                let file = crate::format::open_regular(path).map_err(io_error(path))?;
                let projection = columns.map(|c| indices(&schema, c));
                let reader = arrow_ipc::reader::StreamReader::try_new_buffered(file, projection)
                    .map_err(|e| bad(&e))?;
                Ok(BatchReader {
                    path,
                    schema,
                    footer_rows: None,
                    batches: Box::new(reader),
                })
            }
        }
    }

    fn next_batch(&mut self) -> Result<Option<RecordBatch>, InputError> {
        let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.batches.next()))
            .map_err(|_| table_error(self.path, "the reader panicked on malformed data"))?;
        match next {
            None => Ok(None),
            Some(Ok(batch)) => Ok(Some(batch)),
            Some(Err(e)) => Err(table_error(
                self.path,
                format!("reading a record batch: {e}"),
            )),
        }
    }
}

/// Indices of `columns` in `schema`, ascending (as a Parquet projection reads them).
fn indices(schema: &SchemaRef, columns: &[String]) -> Vec<usize> {
    let mut indices: Vec<usize> = columns
        .iter()
        .filter_map(|c| schema.index_of(c).ok())
        .collect();
    indices.sort_unstable();
    indices.dedup();
    indices
}

/// The first row of `array` holding a null (at any depth of a fixed-size list).
fn first_null(array: &dyn Array) -> Option<usize> {
    let own = if array.null_count() > 0 {
        (0..array.len()).find(|&i| array.is_null(i))
    } else {
        None
    };
    let inner = match array.data_type() {
        DataType::FixedSizeList(_, length) => {
            let list = array.as_fixed_size_list();
            let length = *length as usize;
            first_null(list.values().slice(0, list.len() * length).as_ref()).map(|i| i / length)
        }
        DataType::List(_) => list_first_null(array.as_list::<i32>()),
        DataType::LargeList(_) => list_first_null(array.as_list::<i64>()),
        _ => None,
    };
    match (own, inner) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The first row of a list array holding a null inside its list.
fn list_first_null<O: arrow_array::OffsetSizeTrait>(
    list: &arrow_array::GenericListArray<O>,
) -> Option<usize> {
    let offsets = list.value_offsets();
    let first = offsets[0].as_usize();
    let last = offsets[list.len()].as_usize();
    let element = first_null(list.values().slice(first, last - first).as_ref())?;
    // The row whose values hold that element.
    Some(offsets[1..].partition_point(|end| end.as_usize() - first <= element))
}

/// Appends the values of variable-length `array` (a list, string or binary column without nulls)
/// to `out` in C order, and each row's end (counted in elements from the field's first, `total`
/// before this array) to `ends`.
fn write_variable(
    array: &dyn Array,
    out: &mut impl Write,
    bytes: &mut Vec<u8>,
    ends: &mut Vec<u64>,
) -> io::Result<()> {
    fn list<O: arrow_array::OffsetSizeTrait>(
        list: &arrow_array::GenericListArray<O>,
        out: &mut impl Write,
        bytes: &mut Vec<u8>,
        ends: &mut Vec<u64>,
    ) -> io::Result<()> {
        let offsets = list.value_offsets();
        let first = offsets[0].as_usize();
        let last = offsets[list.len()].as_usize();
        write_values(
            list.values().slice(first, last - first).as_ref(),
            out,
            bytes,
        )?;
        push_ends(offsets, ends);
        Ok(())
    }
    fn push_ends<O: arrow_array::OffsetSizeTrait>(offsets: &[O], ends: &mut Vec<u64>) {
        let base = ends.last().copied().unwrap_or(0);
        let first = offsets[0].as_usize();
        ends.extend(
            offsets[1..]
                .iter()
                .map(|end| base + (end.as_usize() - first) as u64),
        );
    }
    fn bytes_of<O: arrow_array::OffsetSizeTrait>(
        offsets: &[O],
        values: &[u8],
        out: &mut impl Write,
        ends: &mut Vec<u64>,
    ) -> io::Result<()> {
        let first = offsets[0].as_usize();
        let last = offsets[offsets.len() - 1].as_usize();
        out.write_all(&values[first..last])?;
        push_ends(offsets, ends);
        Ok(())
    }
    match array.data_type() {
        DataType::List(_) => list(array.as_list::<i32>(), out, bytes, ends),
        DataType::LargeList(_) => list(array.as_list::<i64>(), out, bytes, ends),
        DataType::Utf8 => {
            let strings = array.as_string::<i32>();
            bytes_of(strings.value_offsets(), strings.value_data(), out, ends)
        }
        DataType::LargeUtf8 => {
            let strings = array.as_string::<i64>();
            bytes_of(strings.value_offsets(), strings.value_data(), out, ends)
        }
        DataType::Binary => {
            let binary = array.as_binary::<i32>();
            bytes_of(binary.value_offsets(), binary.value_data(), out, ends)
        }
        DataType::LargeBinary => {
            let binary = array.as_binary::<i64>();
            bytes_of(binary.value_offsets(), binary.value_data(), out, ends)
        }
        other => unreachable!("column_kind admitted {other} as variable-length"),
    }
}

/// Writes the values of `array` (no nulls) to `out` in C order, little-endian.
fn write_values(array: &dyn Array, out: &mut impl Write, bytes: &mut Vec<u8>) -> io::Result<()> {
    match array.data_type() {
        DataType::FixedSizeList(_, length) => {
            let list = array.as_fixed_size_list();
            let values = list.values().slice(0, list.len() * *length as usize);
            write_values(values.as_ref(), out, bytes)
        }
        DataType::Boolean => {
            bytes.clear();
            bytes.extend(array.as_boolean().values().iter().map(u8::from));
            out.write_all(bytes)
        }
        data_type => {
            let width = data_type
                .primitive_width()
                .expect("column_kind admitted only primitive leaves");
            let data = array.to_data();
            let begin = data.offset() * width;
            let end = begin + data.len() * width;
            out.write_all(&data.buffers()[0].as_slice()[begin..end])
        }
    }
}

/// A column read into a field: which file column, which field.
#[derive(Clone, Debug)]
pub struct ColumnRequest {
    /// The field's name in the dataset.
    pub field: String,
    /// The table file.
    pub path: PathBuf,
    /// The column of that file.
    pub column: String,
}

struct Scratch {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    /// Bytes of one row, or of one element of a variable-length field.
    sample_bytes: usize,
    /// Of a variable-length field: each row's end, in elements, over the files read so far.
    ends: Option<Vec<u64>>,
    writer: BufWriter<File>,
    written: u64,
    /// (input file, scratch file holding it, first byte there, samples) of each piece, in
    /// concatenation order.
    pieces: Vec<(PathBuf, ScratchFile, u64, u64)>,
}

/// Which scratch file holds a piece of a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScratchFile {
    /// The field's own, written in row order by a sequential read.
    Own,
    /// One of the files of a parallel Parquet read, by thread: each thread writes its own, since
    /// the kernel serialises writes to one file (threads queued at its lock spin rather than
    /// decode), and the rows of every row group it decodes go there, column after column.
    Thread(usize),
}

/// The scratch files of a parallel Parquet read, one per thread, shared by every file read.
struct ThreadScratch {
    /// The file, and the bytes written to it so far (where the next row group goes).
    files: Vec<(File, u64)>,
    /// Of a read of files with a variable-length column (see `read_parquet_parallel_appending`):
    /// the file that thread `t` appends field `f`'s values to, at `appending[&(t, f)]` in `files`.
    appending: std::collections::HashMap<(usize, usize), usize>,
    /// The directory they are created in.
    dir: PathBuf,
    /// Whether they are anonymous memory files instead (see [`scratch_in_memory`]).
    in_memory: bool,
}

/// Share of the host's available memory the decoded inputs may take as memory-backed scratch.
const SCRATCH_MEMORY_SHARE_DIVISOR: u64 = 8;

/// Whether a pack's scratch files are anonymous memory files (`memfd`) rather than files on the
/// output's disk: when the inputs' decoded size (a Parquet file's row groups' uncompressed bytes,
/// an IPC file's size) is at most an eighth of the host's available memory. On disk, the scratch
/// files' writeback shared the disk with the dataset being written (Parquet packed at 0.79 GB/s
/// against 1.94 for the same rows from a `.npy` on the 16-core test host). `GPUFEED_PACK_SCRATCH`
/// = `disk` or `memory` decides instead.
fn scratch_in_memory(paths: &[&Path]) -> bool {
    match std::env::var("GPUFEED_PACK_SCRATCH").as_deref() {
        Ok("disk") => return false,
        Ok("memory") => return true,
        _ => {}
    }
    let Some(available) = mem_available_bytes() else {
        return false;
    };
    let mut decoded = 0u64;
    for path in paths {
        let bytes = match table_format(path) {
            Ok(TableFormat::Parquet) => {
                let builder = crate::format::open_regular(path)
                    .ok()
                    .and_then(|file| ParquetRecordBatchReaderBuilder::try_new(file).ok());
                let Some(builder) = builder else {
                    return false;
                };
                builder
                    .metadata()
                    .row_groups()
                    .iter()
                    .map(|group| group.total_byte_size().max(0) as u64)
                    .sum()
            }
            _ => match std::fs::metadata(path) {
                Ok(metadata) => metadata.len(),
                Err(_) => return false,
            },
        };
        decoded = decoded.saturating_add(bytes);
    }
    decoded <= available / SCRATCH_MEMORY_SHARE_DIVISOR
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A scratch file: anonymous memory when `in_memory` (falling back to `dir` if that fails),
/// otherwise an unlinked file in `dir`.
fn scratch_file(dir: &Path, in_memory: bool) -> Result<File, InputError> {
    if in_memory {
        if let Ok(fd) = nix::sys::memfd::memfd_create(
            c"gpufeed-pack-scratch",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        ) {
            return Ok(File::from(fd));
        }
    }
    tempfile::tempfile_in(dir).map_err(io_error(dir))
}

/// Reads the columns asked for into fields, decoding each file once (batch by batch) into scratch
/// files created in `scratch_dir`. A field given several files concatenates them in the order
/// given; every file of a field must give the column the same type.
pub fn open_table_fields(
    requests: &[ColumnRequest],
    scratch_dir: &Path,
    threads: usize,
) -> Result<Vec<FieldSource>, InputError> {
    // Fields in first-mention order.
    let mut fields: Vec<Scratch> = Vec::new();
    // Files in first-mention order, each with the (field, column) pairs read from it.
    let mut files: Vec<(PathBuf, Vec<(usize, String)>)> = Vec::new();
    let mut paths: Vec<&Path> = Vec::new();
    for request in requests {
        if !paths.contains(&request.path.as_path()) {
            paths.push(&request.path);
        }
    }
    let in_memory = scratch_in_memory(&paths);
    for request in requests {
        let index = match fields.iter().position(|f| f.name == request.field) {
            Some(index) => index,
            None => {
                fields.push(Scratch {
                    name: request.field.clone(),
                    dtype: DType::U8,
                    shape: Vec::new(),
                    sample_bytes: 0,
                    ends: None,
                    writer: BufWriter::with_capacity(
                        SCRATCH_BUFFER_BYTES,
                        scratch_file(scratch_dir, in_memory)?,
                    ),
                    written: 0,
                    pieces: Vec::new(),
                });
                fields.len() - 1
            }
        };
        match files.iter_mut().find(|(p, _)| *p == request.path) {
            Some((_, columns)) => {
                if columns.iter().any(|(f, _)| *f == index) {
                    return Err(table_error(
                        &request.path,
                        format!("field '{}' reads this file twice", request.field),
                    ));
                }
                columns.push((index, request.column.clone()));
            }
            None => files.push((request.path.clone(), vec![(index, request.column.clone())])),
        }
    }
    check_file_order(requests, &fields, &files)?;
    // The first file and type of each field, which later files must agree with.
    let mut first: Vec<Option<(PathBuf, DataType)>> = vec![None; fields.len()];
    let mut thread_scratch = ThreadScratch {
        files: Vec::new(),
        appending: std::collections::HashMap::new(),
        dir: scratch_dir.to_path_buf(),
        in_memory,
    };
    for (path, columns) in &files {
        let format = table_format(path)?;
        let probe = BatchReader::open(path, format, None, None)?;
        let schema = probe.schema.clone();
        drop(probe);
        let mut row_bytes = 0usize;
        for (index, column) in columns {
            let Ok(at) = schema.index_of(column) else {
                let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                return Err(table_error(
                    path,
                    format!("no column '{column}'; columns: {}", names.join(", ")),
                ));
            };
            let data_type = schema.field(at).data_type().clone();
            let field = &mut fields[*index];
            match &first[*index] {
                Some((first_path, first_type))
                    if column_kind(first_type) != column_kind(&data_type) =>
                {
                    return Err(table_error(
                        path,
                        format!(
                            "column '{column}' is {} here but {} in {} (field '{}'): files \
                             packed as one dataset must agree",
                            type_name(&data_type),
                            type_name(first_type),
                            first_path.display(),
                            field.name
                        ),
                    ));
                }
                Some(_) => {}
                None => {
                    let (dtype, shape) = match column_kind(&data_type) {
                        ColumnKind::Field { dtype, shape } => (dtype, shape),
                        ColumnKind::Variable { dtype, shape } => {
                            field.ends = Some(Vec::new());
                            (dtype, shape)
                        }
                        ColumnKind::Refused(why) => {
                            return Err(table_error(
                                path,
                                format!("column '{column}' ({}): {why}", type_name(&data_type)),
                            ))
                        }
                    };
                    field.sample_bytes = checked_sample_bytes(dtype, &shape).ok_or_else(|| {
                        table_error(
                            path,
                            format!("column '{column}': shape {shape:?} overflows"),
                        )
                    })?;
                    field.dtype = dtype;
                    field.shape = shape;
                    first[*index] = Some((path.clone(), data_type));
                }
            }
            row_bytes += field.sample_bytes;
        }
        read_file(
            path,
            format,
            columns,
            row_bytes,
            &mut fields,
            &mut thread_scratch,
            threads,
        )?;
    }
    // Each thread's scratch file mapped once, for every field it holds pieces of.
    let mut thread_backings = Vec::with_capacity(thread_scratch.files.len());
    for (file, written) in thread_scratch.files {
        let backing = if written == 0 {
            None
        } else {
            let map = MappedFile::map(&file).map_err(io_error(Path::new("(scratch file)")))?;
            Some(Arc::new(Backing::Mapped { map, file }))
        };
        thread_backings.push(backing);
    }
    fields
        .into_iter()
        .map(|field| finish(field, &thread_backings))
        .collect()
}

/// Files are decoded in first-mention order, so each field's pieces come in that order: a field
/// whose files were given in another order is refused rather than concatenated out of order.
fn check_file_order(
    requests: &[ColumnRequest],
    fields: &[Scratch],
    files: &[(PathBuf, Vec<(usize, String)>)],
) -> Result<(), InputError> {
    for (index, field) in fields.iter().enumerate() {
        let given: Vec<&PathBuf> = requests
            .iter()
            .filter(|r| r.field == field.name)
            .map(|r| &r.path)
            .collect();
        let decoded: Vec<&PathBuf> = files
            .iter()
            .filter(|(_, columns)| columns.iter().any(|(f, _)| *f == index))
            .map(|(p, _)| p)
            .collect();
        if given != decoded {
            return Err(table_error(
                given[0],
                format!(
                    "field '{}' gives its files in another order than earlier fields do; give \
                     every field's files in one order",
                    field.name
                ),
            ));
        }
    }
    Ok(())
}

/// Decodes the `columns` of one file, appending each to its field's scratch file.
fn read_file(
    path: &Path,
    format: TableFormat,
    columns: &[(usize, String)],
    row_bytes: usize,
    fields: &mut [Scratch],
    thread_scratch: &mut ThreadScratch,
    threads: usize,
) -> Result<(), InputError> {
    let names: Vec<String> = columns.iter().map(|(_, c)| c.clone()).collect();
    let names = names.as_slice();
    // Rows of variable-length columns differ in size, so their places in the scratch files are
    // only known in order.
    let variable = columns.iter().any(|(i, _)| fields[*i].ends.is_some());
    if format == TableFormat::Parquet && threads > 1 && variable {
        return read_parquet_parallel_appending(
            path,
            columns,
            names,
            fields,
            thread_scratch,
            threads,
        );
    }
    if format == TableFormat::Parquet && threads > 1 && !variable {
        return read_parquet_parallel(
            path,
            columns,
            names,
            row_bytes,
            fields,
            thread_scratch,
            threads,
        );
    }
    let mut reader = BatchReader::open(path, format, Some(names), Some(row_bytes))?;
    let starts: Vec<u64> = columns.iter().map(|(i, _)| fields[*i].written).collect();
    let mut rows = 0u64;
    let mut bytes = Vec::new();
    loop {
        let batch = match reader.next_batch() {
            Ok(Some(batch)) => batch,
            Ok(None) => break,
            Err(InputError::Table { path, reason }) => {
                return Err(InputError::Table {
                    path,
                    reason: format!(
                        "{reason} (after row {rows}: is the file truncated or corrupt?)"
                    ),
                })
            }
            Err(error) => return Err(error),
        };
        for (index, column) in columns {
            let array = batch
                .column_by_name(column)
                .expect("the projection keeps every column asked for");
            check_nulls(path, column, rows, array.as_ref())?;
            let field = &mut fields[*index];
            match &mut field.ends {
                None => {
                    write_values(array.as_ref(), &mut field.writer, &mut bytes)
                        .map_err(io_error(Path::new("(scratch file)")))?;
                    field.written += (batch.num_rows() * field.sample_bytes) as u64;
                }
                Some(ends) => {
                    let before = ends.last().copied().unwrap_or(0);
                    write_variable(array.as_ref(), &mut field.writer, &mut bytes, ends)
                        .map_err(io_error(Path::new("(scratch file)")))?;
                    let after = ends.last().copied().unwrap_or(0);
                    field.written += (after - before) * field.sample_bytes as u64;
                }
            }
        }
        rows += batch.num_rows() as u64;
    }
    if let Some(footer) = reader.footer_rows {
        if footer != rows {
            return Err(table_error(
                path,
                format!("the footer says {footer} rows but the row groups hold {rows}"),
            ));
        }
    }
    for ((index, _), start) in columns.iter().zip(starts) {
        let field = &mut fields[*index];
        // A variable-length field's piece counts its elements (its scratch file's rows).
        let count = match field.ends {
            Some(_) => (field.written - start) / field.sample_bytes as u64,
            None => rows,
        };
        field
            .pieces
            .push((path.to_path_buf(), ScratchFile::Own, start, count));
    }
    Ok(())
}

/// The error for a Parquet reader that panicked on a malformed row group: the pack stops, naming
/// the file, rather than the process.
fn reader_panicked(path: &Path, first_row: u64) -> InputError {
    table_error(
        path,
        format!("the Parquet reader panicked on malformed data (row group from row {first_row})"),
    )
}

/// Fails, naming the row, if `array` (rows from `first_row` of the file on) holds a null.
fn check_nulls(
    path: &Path,
    column: &str,
    first_row: u64,
    array: &dyn Array,
) -> Result<(), InputError> {
    match first_null(array) {
        None => Ok(()),
        Some(row) => Err(table_error(
            path,
            format!(
                "column '{column}', row {}: null; gpufeed packs no nulls (fill or drop them first)",
                first_row + row as u64
            ),
        )),
    }
}

/// [`read_file`] for a Parquet file on `threads` threads, row group by row group: each thread
/// decodes the row groups it takes into its own scratch file (see [`ScratchFile::Thread`]), each
/// column's rows of a group back to back at the place the footer's row count gives them (written
/// with `pwrite`, straight from the decoded buffers), and every field gets a piece per row group. A
/// row group holding other than its count is refused. Memory: up to [`THREAD_BATCH_BYTES_MAX`] of
/// decoded rows per thread, plus the pages each thread decodes.
fn read_parquet_parallel(
    path: &Path,
    columns: &[(usize, String)],
    names: &[String],
    row_bytes: usize,
    fields: &mut [Scratch],
    thread_scratch: &mut ThreadScratch,
    threads: usize,
) -> Result<(), InputError> {
    let file = crate::format::open_regular(path).map_err(io_error(path))?;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file.try_clone().map_err(io_error(path))?)
            .map_err(|e| parquet_error(path, &e))?;
    let schema = builder.schema().clone();
    let group_rows = row_group_rows(path, builder.metadata())?;
    let batch_bytes = (BATCH_BYTES_TARGET / threads).min(THREAD_BATCH_BYTES_MAX);
    let mut group_starts = Vec::with_capacity(group_rows.len());
    let mut at = 0u64;
    for &count in &group_rows {
        group_starts.push(at);
        at += count;
    }
    // Per column: its name, its sample bytes, and where its rows start within a row group's
    // region of a thread's file (after the columns before it), in rows times bytes.
    let mut targets = Vec::with_capacity(columns.len());
    let mut column_offset = 0u64;
    for (index, column) in columns {
        let sample_bytes = fields[*index].sample_bytes as u64;
        targets.push((column.as_str(), sample_bytes, column_offset));
        column_offset += sample_bytes;
    }
    let units = parquet_units(&group_rows, threads, row_bytes);
    let workers = threads.min(units.len());
    while thread_scratch.files.len() < workers {
        let file = scratch_file(&thread_scratch.dir, thread_scratch.in_memory)?;
        thread_scratch.files.push((file, 0));
    }
    // The columns' page-by-page plans, where every column has one (see `parquet_pages`).
    let pages = super::parquet_pages::enabled()
        .then(|| {
            columns
                .iter()
                .map(|(_, column)| {
                    let root = schema.index_of(column).ok()?;
                    let data_type = schema.field(root).data_type();
                    super::parquet_pages::plan_column(builder.parquet_schema(), root, data_type)
                })
                .collect::<Option<Vec<_>>>()
        })
        .flatten();
    let read = ParquetRead {
        path,
        pages,
        appending_pages: None,
        mask: ProjectionMask::roots(builder.parquet_schema(), indices(&schema, names)),
        batch_rows: (batch_bytes / row_bytes.max(1)).clamp(1, BATCH_ROWS_MAX),
        group_rows,
        group_starts,
        targets,
    };
    let decoded = read.decode_units(&units, &mut thread_scratch.files[..workers], row_bytes)?;
    let mut done: Vec<(usize, usize, u64)> = decoded
        .into_iter()
        .flat_map(|(thread, done)| done.into_iter().map(move |(u, base)| (u, thread, base)))
        .collect();
    done.sort_unstable();
    assert_eq!(done.len(), units.len(), "every unit decoded once");
    for (index, thread, base) in done {
        let count = units[index].count;
        if count == 0 {
            continue;
        }
        for ((field, _), &(_, _, column_offset)) in columns.iter().zip(&read.targets) {
            fields[*field].pieces.push((
                path.to_path_buf(),
                ScratchFile::Thread(thread),
                base + count * column_offset,
                count,
            ));
        }
    }
    Ok(())
}

/// [`read_file`] for a Parquet file with a variable-length column, on `threads` threads: the units
/// of [`parquet_units`] (row groups, or slices of them) decoded by the threads in any order, each
/// column of a unit appended to a scratch file of the thread's own for that field (values go where
/// their lengths put them, known only once decoded), and the fields' pieces and rows' ends put
/// back in file order afterwards. A unit holding other than the footer's rows is refused, and the
/// error reported is that of the first unit in the file that failed.
fn read_parquet_parallel_appending(
    path: &Path,
    columns: &[(usize, String)],
    names: &[String],
    fields: &mut [Scratch],
    thread_scratch: &mut ThreadScratch,
    threads: usize,
) -> Result<(), InputError> {
    let file = crate::format::open_regular(path).map_err(io_error(path))?;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| parquet_error(path, &e))?;
    let schema = builder.schema().clone();
    let metadata = builder.metadata().clone();
    let group_rows = row_group_rows(path, &metadata)?;
    let rows: u64 = group_rows.iter().sum();
    // Decoded bytes per row (of every column: an over-estimate) size the units and batches.
    let total: u64 = metadata
        .row_groups()
        .iter()
        .map(|g| g.total_byte_size().max(0) as u64)
        .sum();
    let row_bytes = (total / rows.max(1)).max(1) as usize;
    let mut group_starts = Vec::with_capacity(group_rows.len());
    let mut at = 0u64;
    for &count in &group_rows {
        group_starts.push(at);
        at += count;
    }
    let units = parquet_units(&group_rows, threads, row_bytes);
    let workers = threads.min(units.len()).max(1);
    // Per thread, per column: the index of the scratch file it appends to.
    let mut file_of = vec![Vec::with_capacity(columns.len()); workers];
    for (thread, files) in file_of.iter_mut().enumerate() {
        for (field, _) in columns {
            let index = match thread_scratch.appending.get(&(thread, *field)) {
                Some(&index) => index,
                None => {
                    let file = scratch_file(&thread_scratch.dir, thread_scratch.in_memory)?;
                    thread_scratch.files.push((file, 0));
                    let index = thread_scratch.files.len() - 1;
                    thread_scratch.appending.insert((thread, *field), index);
                    index
                }
            };
            files.push(index);
        }
    }
    // Every column's page-by-page plan, where each has one (see `parquet_pages`).
    let appending_pages = super::parquet_pages::enabled()
        .then(|| {
            columns
                .iter()
                .map(|(_, column)| {
                    let root = schema.index_of(column).ok()?;
                    let data_type = schema.field(root).data_type();
                    let parquet = builder.parquet_schema();
                    match super::parquet_pages::plan_list_column(parquet, root, data_type) {
                        Some(list) => Some(AppendPlan::List(list)),
                        None => super::parquet_pages::plan_column(parquet, root, data_type)
                            .map(AppendPlan::Fixed),
                    }
                })
                .collect::<Option<Vec<_>>>()
        })
        .flatten();
    let read = ParquetRead {
        path,
        pages: None,
        appending_pages,
        mask: ProjectionMask::roots(builder.parquet_schema(), indices(&schema, names)),
        batch_rows: (THREAD_BATCH_BYTES_MAX / row_bytes).clamp(1, BATCH_ROWS_MAX),
        group_rows,
        group_starts,
        targets: Vec::new(),
    };
    let variable: Vec<bool> = columns
        .iter()
        .map(|(i, _)| fields[*i].ends.is_some())
        .collect();
    let names: Vec<&str> = columns.iter().map(|(_, c)| c.as_str()).collect();
    let appended = read.append_units(&units, &file_of, thread_scratch, &names, &variable)?;
    // Back in file order: each unit's pieces, and its rows' ends after the field's so far.
    for (index, unit) in units.iter().enumerate() {
        let (thread, columns_done) = &appended[index];
        for (c, (field, _)) in columns.iter().enumerate() {
            let (start, elements, ref ends) = columns_done[c];
            let field = &mut fields[*field];
            if let (Some(field_ends), Some(ends)) = (field.ends.as_mut(), ends) {
                let base = field_ends.last().copied().unwrap_or(0);
                field_ends.extend(ends.iter().map(|end| base + end));
            }
            if unit.count > 0 {
                field.pieces.push((
                    path.to_path_buf(),
                    ScratchFile::Thread(file_of[*thread][c]),
                    start,
                    elements,
                ));
            }
        }
    }
    Ok(())
}

/// How `parquet_pages` reads one column of a read that appends.
enum AppendPlan {
    Fixed(super::parquet_pages::PageColumn),
    List(super::parquet_pages::ListColumn),
}

/// What one unit appended: the thread, and per column where its bytes start in the thread's
/// file for it, its elements (rows, for a fixed-shape column), and, for a variable-length
/// column, each row's end in elements from the unit's start.
type Appended = (usize, Vec<ColumnAppended>);

/// One column of one unit: where its bytes start, its elements, and its rows' ends (see
/// [`Appended`]).
type ColumnAppended = (u64, u64, Option<Vec<u64>>);

impl ParquetRead<'_> {
    /// Decodes `units` on one thread per entry of `file_of` (the indices, in `scratch.files`,
    /// of the files the thread appends each column to), each column of a unit appended to its
    /// file; returns per unit what it appended (and advances the files' counts), or the error of
    /// the lowest unit that failed.
    fn append_units(
        &self,
        units: &[Unit],
        file_of: &[Vec<usize>],
        scratch: &mut ThreadScratch,
        names: &[&str],
        variable: &[bool],
    ) -> Result<Vec<Appended>, InputError> {
        let files = &scratch.files;
        // Per thread: its number, its files' indices and their offsets, advanced unit by unit.
        let states: Vec<(usize, &Vec<usize>, Vec<u64>)> = file_of
            .iter()
            .enumerate()
            .map(|(thread, indices)| {
                (
                    thread,
                    indices,
                    indices.iter().map(|&i| files[i].1).collect(),
                )
            })
            .collect();
        let outcomes = self.on_threads(units, states, |(thread, indices, offsets), unit| {
            let targets: Vec<&File> = indices.iter().map(|&i| &files[i].0).collect();
            let (columns, ends_at) = self.append(unit, &targets, offsets, names, variable)?;
            *offsets = ends_at;
            Ok((*thread, columns))
        })?;
        let offsets: Vec<(usize, u64)> = outcomes
            .iter()
            .flat_map(|((_, indices, offsets), _)| {
                indices.iter().copied().zip(offsets.iter().copied())
            })
            .collect();
        for (index, offset) in offsets {
            scratch.files[index].1 = offset;
        }
        let mut appended: Vec<Option<Appended>> = vec![None; units.len()];
        for (_, done) in outcomes {
            for (unit, result) in done {
                appended[unit] = Some(result);
            }
        }
        Ok(appended
            .into_iter()
            .map(|a| a.expect("every unit decoded once"))
            .collect())
    }

    /// Decodes `unit`, appending each column's values to its file of `targets` from its offset of
    /// `offsets`; returns what it appended per column and the files' new offsets.
    fn append(
        &self,
        unit: &Unit,
        targets: &[&File],
        offsets: &[u64],
        names: &[&str],
        variable: &[bool],
    ) -> Result<(Vec<ColumnAppended>, Vec<u64>), InputError> {
        // Page by page where it can (a panic there, on malformed pages, leaves the unit to the
        // Arrow reader, which names what is wrong); what it wrote is overwritten if it gives up.
        let paged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.append_pages(unit, targets, offsets)
        }));
        if let Ok(read) = paged {
            if let Some(done) = read? {
                return Ok(done);
            }
        }
        let (path, group) = (self.path, unit.group);
        let mut writers: Vec<BufWriter<WriteAt<'_>>> = targets
            .iter()
            .zip(offsets)
            .map(|(&file, &at)| {
                BufWriter::with_capacity(SCRATCH_BUFFER_BYTES, WriteAt { file, at })
            })
            .collect();
        let mut ends: Vec<Option<Vec<u64>>> = variable.iter().map(|&v| v.then(Vec::new)).collect();
        let mut read = 0u64;
        let mut bytes = Vec::new();
        for batch in self.reader(unit)? {
            let first_row = self.group_starts[group] + unit.first + read;
            let batch = batch.map_err(|e| batch_error(path, group, first_row, e))?;
            for ((column, writer), ends) in names.iter().zip(&mut writers).zip(&mut ends) {
                let array = batch
                    .column_by_name(column)
                    .expect("the projection keeps every column asked for");
                check_nulls(path, column, first_row, array.as_ref())?;
                let written = match ends {
                    Some(ends) => write_variable(array.as_ref(), writer, &mut bytes, ends),
                    None => write_values(array.as_ref(), writer, &mut bytes),
                };
                written.map_err(io_error(Path::new("(scratch file)")))?;
            }
            read += batch.num_rows() as u64;
        }
        if read != unit.count {
            return Err(table_error(
                path,
                format!(
                    "row group {group}: the footer says {} rows but the row group holds {read}",
                    self.group_rows[group]
                ),
            ));
        }
        let mut appended = Vec::with_capacity(writers.len());
        let mut ends_at = Vec::with_capacity(writers.len());
        for ((writer, ends), &start) in writers.into_iter().zip(ends).zip(offsets) {
            let end = writer
                .into_inner()
                .map_err(|e| io_error(Path::new("(scratch file)"))(e.into_error()))?
                .at;
            let elements = match &ends {
                Some(ends) => ends.last().copied().unwrap_or(0),
                None => read,
            };
            appended.push((start, elements, ends));
            ends_at.push(end);
        }
        Ok((appended, ends_at))
    }
}

impl ParquetRead<'_> {
    /// [`Self::append`] page by page (`parquet_pages`), where every column has a plan: `None`
    /// where the Arrow reader must decode the unit.
    #[allow(clippy::type_complexity)]
    fn append_pages(
        &self,
        unit: &Unit,
        targets: &[&File],
        offsets: &[u64],
    ) -> Result<Option<(Vec<ColumnAppended>, Vec<u64>)>, InputError> {
        let Some(plans) = &self.appending_pages else {
            return Ok(None);
        };
        let Ok(file) = crate::format::open_regular(self.path) else {
            return Ok(None);
        };
        let Ok(reader) = parquet::file::reader::SerializedFileReader::new(file) else {
            return Ok(None);
        };
        let scratch_error = io_error(Path::new("(scratch file)"));
        let rows = (unit.first, unit.count);
        let mut appended = Vec::with_capacity(plans.len());
        let mut ends_at = Vec::with_capacity(plans.len());
        for ((plan, &file), &start) in plans.iter().zip(targets).zip(offsets) {
            match plan {
                AppendPlan::Fixed(column) => {
                    let read = super::parquet_pages::read_rows(
                        &reader, unit.group, column, rows, file, start,
                    )
                    .map_err(&scratch_error)?;
                    if !read {
                        return Ok(None);
                    }
                    appended.push((start, unit.count, None));
                    ends_at.push(start + unit.count * column.row_bytes());
                }
                AppendPlan::List(column) => {
                    let mut out =
                        BufWriter::with_capacity(SCRATCH_BUFFER_BYTES, WriteAt { file, at: start });
                    let mut ends = Vec::with_capacity(unit.count as usize);
                    let read = super::parquet_pages::read_list_rows(
                        &reader, unit.group, column, rows, &mut out, &mut ends,
                    )
                    .map_err(&scratch_error)?;
                    let end = out
                        .into_inner()
                        .map_err(|e| scratch_error(e.into_error()))?
                        .at;
                    if !read {
                        return Ok(None);
                    }
                    let elements = ends.last().copied().unwrap_or(0);
                    appended.push((start, elements, Some(ends)));
                    ends_at.push(end);
                }
            }
        }
        Ok(Some((appended, ends_at)))
    }
}

fn parquet_error(path: &Path, e: &dyn std::fmt::Display) -> InputError {
    table_error(path, format!("reading Parquet: {e}"))
}

/// The units of work of a parallel Parquet read: whole row groups, or, when there are fewer row
/// groups than threads, slices of each (see `SLICE_BYTES_MIN`), in file order.
fn parquet_units(group_rows: &[u64], threads: usize, row_bytes: usize) -> Vec<Unit> {
    let mut units: Vec<Unit> = Vec::new();
    let slices_wanted = if group_rows.len() >= threads {
        1
    } else {
        threads.div_ceil(group_rows.len().max(1)) as u64
    };
    for (group, &count) in group_rows.iter().enumerate() {
        let by_size = (count.saturating_mul(row_bytes as u64) / SLICE_BYTES_MIN).max(1);
        let slices = slices_wanted.min(by_size);
        if slices <= 1 {
            units.push(Unit {
                group,
                first: 0,
                count,
                whole: true,
            });
            continue;
        }
        let per = count.div_ceil(slices);
        let mut first = 0;
        while first < count {
            let take = per.min(count - first);
            units.push(Unit {
                group,
                first,
                count: take,
                whole: false,
            });
            first += take;
        }
    }
    units
}

/// One Parquet file read in parallel: its projection, batch size, row groups and where each
/// column's rows go in a thread's scratch file.
struct ParquetRead<'a> {
    path: &'a Path,
    /// Per column, how `parquet_pages` reads it, where it reads every column: tried first for
    /// each unit, the Arrow reader decoding the unit where it gives up.
    pages: Option<Vec<super::parquet_pages::PageColumn>>,
    /// The same for a read that appends (`read_parquet_parallel_appending`), whose columns may be
    /// lists.
    appending_pages: Option<Vec<AppendPlan>>,
    mask: ProjectionMask,
    batch_rows: usize,
    /// Rows of each row group, and the first row of each.
    group_rows: Vec<u64>,
    group_starts: Vec<u64>,
    /// Per column: its name, its sample bytes, and where its rows start within a unit's region of
    /// a thread's file (after the columns before it), in rows times bytes.
    targets: Vec<(&'a str, u64, u64)>,
}

impl ParquetRead<'_> {
    /// A reader of `unit`'s rows.
    fn reader(&self, unit: &Unit) -> Result<ParquetRecordBatchReader, InputError> {
        let path = self.path;
        // Opened again, not cloned: a clone shares the file position the reader seeks.
        let file = crate::format::open_regular(path).map_err(io_error(path))?;
        let mut builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| parquet_error(path, &e))?
            .with_projection(self.mask.clone())
            .with_row_groups(vec![unit.group])
            .with_batch_size(self.batch_rows);
        if !unit.whole {
            // Rows before the slice are skipped (their pages decompressed and their levels
            // counted, not decoded: about a tenth of decoding them), rows after it not read.
            builder = builder.with_row_selection(RowSelection::from(vec![
                RowSelector::skip(unit.first as usize),
                RowSelector::select(unit.count as usize),
            ]));
        }
        builder.build().map_err(|e| parquet_error(path, &e))
    }

    /// Reads `unit` into `scratch` from byte `base` on page by page (`parquet_pages`), where
    /// every column allows it: true once done; false where the Arrow reader must decode it.
    fn read_pages(&self, unit: &Unit, scratch: &File, base: u64) -> Result<bool, InputError> {
        let Some(pages) = &self.pages else {
            return Ok(false);
        };
        let Ok(file) = crate::format::open_regular(self.path) else {
            return Ok(false);
        };
        let Ok(reader) = parquet::file::reader::SerializedFileReader::new(file) else {
            return Ok(false);
        };
        for (column, &(_, _, column_offset)) in pages.iter().zip(&self.targets) {
            let at = base + unit.count * column_offset;
            let rows = (unit.first, unit.count);
            let read =
                super::parquet_pages::read_rows(&reader, unit.group, column, rows, scratch, at)
                    .map_err(io_error(Path::new("(scratch file)")))?;
            if !read {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Decodes `unit` into `scratch` from byte `base` on: each column's rows back to back.
    fn decode(&self, unit: &Unit, scratch: &File, base: u64) -> Result<(), InputError> {
        // Page by page where it can; a panic there (malformed pages) leaves it to the Arrow
        // reader, which names what is wrong.
        let paged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.read_pages(unit, scratch, base)
        }));
        if let Ok(read) = paged {
            if read? {
                return Ok(());
            }
        }
        let (path, group) = (self.path, unit.group);
        let mut read = 0u64;
        let mut bytes = Vec::new();
        for batch in self.reader(unit)? {
            let first_row = self.group_starts[group] + unit.first + read;
            let batch = batch.map_err(|e| batch_error(path, group, first_row, e))?;
            if read + batch.num_rows() as u64 > unit.count {
                // More rows than the footer gives the group: counted for the error, not written
                // (they would overwrite the next column's or group's rows).
                read += batch.num_rows() as u64;
                continue;
            }
            for &(column, sample_bytes, column_offset) in &self.targets {
                let array = batch
                    .column_by_name(column)
                    .expect("the projection keeps every column asked for");
                check_nulls(path, column, first_row, array.as_ref())?;
                let mut out = WriteAt {
                    file: scratch,
                    at: base + unit.count * column_offset + read * sample_bytes,
                };
                write_values(array.as_ref(), &mut out, &mut bytes)
                    .map_err(io_error(Path::new("(scratch file)")))?;
            }
            read += batch.num_rows() as u64;
        }
        if read != unit.count {
            return Err(table_error(
                path,
                format!(
                    "row group {group}: the footer says {} rows but the row group holds {read}",
                    self.group_rows[group]
                ),
            ));
        }
        Ok(())
    }

    /// A slice that failed: if its row group holds other than the footer's count (read whole),
    /// that is the error, as for a row group read whole; otherwise the slice's own.
    fn explain(&self, unit: &Unit, error: InputError) -> InputError {
        let whole = Unit {
            first: 0,
            count: self.group_rows[unit.group],
            whole: true,
            ..*unit
        };
        let counted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut rows = 0u64;
            for batch in self.reader(&whole).ok()? {
                rows += batch.ok()?.num_rows() as u64;
            }
            Some(rows)
        }));
        match counted {
            Ok(Some(rows)) if rows != whole.count => table_error(
                self.path,
                format!(
                    "row group {}: the footer says {} rows but the row group holds {rows}",
                    unit.group, whole.count
                ),
            ),
            _ => error,
        }
    }

    /// Decodes `units` on one thread per scratch file of `files` (each with the bytes written to
    /// it so far); returns, per thread, the units it decoded and where each starts in its file, or
    /// the error of the lowest unit that failed.
    #[allow(clippy::type_complexity)]
    fn decode_units(
        &self,
        units: &[Unit],
        files: &mut [(File, u64)],
        row_bytes: usize,
    ) -> Result<Vec<(usize, Vec<(usize, u64)>)>, InputError> {
        let states: Vec<(usize, &mut (File, u64))> = files.iter_mut().enumerate().collect();
        let decoded = self.on_threads(units, states, |(_, (scratch, written)), unit| {
            let base = *written;
            self.decode(unit, scratch, base)?;
            *written += unit.count * row_bytes as u64;
            Ok(base)
        })?;
        Ok(decoded
            .into_iter()
            .map(|((thread, _), done)| (thread, done))
            .collect())
    }

    /// Runs `work` on `units` on one thread per entry of `states` (the thread's own state), each
    /// thread taking the next unit in file order as it comes free; returns each state with the
    /// units it did (their index and `work`'s result), or the error of the lowest unit that failed
    /// (a slice's explained as its row group's would be, a panic reported as malformed data).
    /// Units after one that failed are not started; earlier ones still run, so the error reported
    /// is the first in the file whatever the threads' timing.
    #[allow(clippy::type_complexity)]
    fn on_threads<S: Send, T: Send>(
        &self,
        units: &[Unit],
        states: Vec<S>,
        work: impl Fn(&mut S, &Unit) -> Result<T, InputError> + Sync,
    ) -> Result<Vec<(S, Vec<(usize, T)>)>, InputError> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Mutex;
        let next = AtomicUsize::new(0);
        let failed_at = AtomicUsize::new(usize::MAX);
        let errors: Mutex<Vec<(usize, InputError)>> = Mutex::new(Vec::new());
        let work = &work;
        let outcomes: Vec<(S, Vec<(usize, T)>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = states
                .into_iter()
                .map(|mut state| {
                    let (next, failed_at, errors) = (&next, &failed_at, &errors);
                    scope.spawn(move || {
                        let mut done = Vec::new();
                        loop {
                            let index = next.fetch_add(1, Ordering::Relaxed);
                            if index >= units.len() || index > failed_at.load(Ordering::Relaxed) {
                                break;
                            }
                            let unit = &units[index];
                            let result =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    work(&mut state, unit)
                                }))
                                .unwrap_or_else(|_| {
                                    Err(reader_panicked(
                                        self.path,
                                        self.group_starts[unit.group] + unit.first,
                                    ))
                                });
                            match result {
                                Ok(value) => done.push((index, value)),
                                Err(error) => {
                                    let error = if unit.whole {
                                        error
                                    } else {
                                        self.explain(unit, error)
                                    };
                                    failed_at.fetch_min(index, Ordering::Relaxed);
                                    errors
                                        .lock()
                                        .expect("no panics while holding the lock")
                                        .push((index, error));
                                }
                            }
                        }
                        (state, done)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().expect("a decoding thread catches its panics"))
                .collect()
        });
        let mut errors = errors
            .into_inner()
            .expect("no panics while holding the lock");
        errors.sort_by_key(|(index, _)| *index);
        match errors.into_iter().next() {
            Some((_, error)) => Err(error),
            None => Ok(outcomes),
        }
    }
}

/// Rows of one row group that one thread of a parallel Parquet read decodes: the whole group, or
/// a slice of it.
#[derive(Clone, Copy)]
struct Unit {
    group: usize,
    /// The slice's first row within the group.
    first: u64,
    /// Rows in the slice.
    count: u64,
    /// Whether the slice is the whole group (read without a row selection).
    whole: bool,
}

/// Positional writes to a file from an offset on, as a [`Write`]: what the threads of a parallel
/// Parquet read write their decoded columns with, without a copy into a buffer first.
struct WriteAt<'a> {
    file: &'a File,
    at: u64,
}

impl Write for WriteAt<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let written = self.file.write_at(buf, self.at)?;
        self.at += written as u64;
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Maps a field's finished scratch file, if any piece is there, and makes a part of every piece
/// (one per input file read sequentially, one per row group read in parallel, the latter over
/// `thread_backings`, the threads' files mapped).
fn finish(
    scratch: Scratch,
    thread_backings: &[Option<Arc<Backing>>],
) -> Result<FieldSource, InputError> {
    let path = scratch
        .pieces
        .first()
        .map(|p| p.0.clone())
        .unwrap_or_default();
    let own = if scratch.pieces.iter().any(|p| p.1 == ScratchFile::Own) {
        let file = scratch.writer.into_inner().map_err(|e| InputError::Io {
            path: path.clone(),
            source: e.into_error(),
        })?;
        let map = MappedFile::map(&file).map_err(io_error(&path))?;
        Some(Arc::new(Backing::Mapped { map, file }))
    } else {
        None
    };
    let parts = scratch
        .pieces
        .iter()
        .map(|(path, source, start, samples)| {
            let backing = match source {
                ScratchFile::Own => own.clone(),
                ScratchFile::Thread(thread) => thread_backings[*thread].clone(),
            }
            .expect("a scratch file holding a piece was written and mapped");
            SourcePart::new(
                path,
                backing,
                *start as usize,
                *samples,
                scratch.sample_bytes,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let values = FieldSource {
        name: scratch.name,
        dtype: scratch.dtype,
        sample_shape: scratch.shape,
        parts,
        ends: None,
    };
    match scratch.ends {
        None => Ok(values),
        Some(ends) => FieldSource::variable(values, ends),
    }
}

/// Every column of `paths` as a field named after it, the files concatenated as one dataset: they
/// must have the same columns, of the same types, and every column must be able to be a field
/// (otherwise pick columns with `--field NAME=FILE:COLUMN`).
pub fn open_table_dataset(
    paths: &[PathBuf],
    scratch_dir: &Path,
    threads: usize,
) -> Result<Vec<FieldSource>, InputError> {
    let Some(first_path) = paths.first() else {
        return Err(InputError::NoFiles {
            name: "(table columns)".into(),
        });
    };
    let first = describe_schema(first_path)?;
    for column in &first {
        if let ColumnKind::Refused(why) = column_kind(column.1.as_ref()) {
            return Err(table_error(
                first_path,
                format!(
                    "column '{}' ({}): {why}; to pack the other columns, name them with --field \
                     NAME=FILE:COLUMN",
                    column.0,
                    type_name(&column.1)
                ),
            ));
        }
    }
    for path in &paths[1..] {
        let schema = describe_schema(path)?;
        for (name, data_type) in &schema {
            match first.iter().find(|(n, _)| n == name) {
                None => {
                    return Err(table_error(
                        path,
                        format!("column '{name}' is not in {}: files packed as one dataset must have the same columns", first_path.display()),
                    ))
                }
                Some((_, first_type)) if column_kind(first_type) != column_kind(data_type) => {
                    return Err(table_error(
                        path,
                        format!(
                            "column '{name}' is {} here but {} in {}: files packed as one \
                             dataset must agree",
                            type_name(data_type),
                            type_name(first_type),
                            first_path.display()
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        if let Some((name, _)) = first
            .iter()
            .find(|(n, _)| !schema.iter().any(|(m, _)| m == n))
        {
            return Err(table_error(
                path,
                format!(
                    "has no column '{name}' of {}: files packed as one dataset must have the same columns",
                    first_path.display()
                ),
            ));
        }
    }
    let requests: Vec<ColumnRequest> = paths
        .iter()
        .flat_map(|path| {
            first.iter().map(move |(name, _)| ColumnRequest {
                field: name.clone(),
                path: path.clone(),
                column: name.clone(),
            })
        })
        .collect();
    open_table_fields(&requests, scratch_dir, threads)
}

/// The (name, type) of each column of a table file.
fn describe_schema(path: &Path) -> Result<Vec<(String, Box<DataType>)>, InputError> {
    let format = table_format(path)?;
    let reader = BatchReader::open(path, format, None, None)?;
    Ok(reader
        .schema
        .fields()
        .iter()
        .map(|f| (f.name().clone(), Box::new(f.data_type().clone())))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::Field;

    /// Scratch files of both kinds (in memory, on disk) hold what was written where it was written,
    /// and map like the files a field reads.
    #[test]
    fn scratch_files_in_memory_and_on_disk_hold_and_map_what_was_written() {
        use std::io::{Seek, SeekFrom};
        let dir = tempfile::tempdir().unwrap();
        for in_memory in [true, false] {
            let mut file = scratch_file(dir.path(), in_memory).unwrap();
            let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            file.write_all(&data).unwrap();
            file.seek(SeekFrom::Start(0)).unwrap();
            let mut back = Vec::new();
            file.read_to_end(&mut back).unwrap();
            assert!(back == data, "in_memory {in_memory}: read back differs");
            let map = MappedFile::map(&file).unwrap();
            assert!(
                map.bytes() == &data[..],
                "in_memory {in_memory}: mapping differs"
            );
        }
        // Nothing of either is left in the directory: both are unlinked from the start.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn nested_fixed_size_lists_are_multi_dimensional() {
        let inner =
            DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, true)), 4);
        let outer = DataType::FixedSizeList(Arc::new(Field::new("item", inner, true)), 3);
        assert_eq!(
            column_kind(&outer),
            ColumnKind::Field {
                dtype: DType::F32,
                shape: vec![3, 4]
            }
        );
    }

    #[test]
    fn lists_strings_and_binaries_are_variable_length() {
        let item = |data_type| Arc::new(Field::new("item", data_type, true));
        let list = DataType::List(item(DataType::Int64));
        assert_eq!(
            column_kind(&list),
            ColumnKind::Variable {
                dtype: DType::I64,
                shape: vec![]
            }
        );
        let pairs = DataType::LargeList(item(DataType::FixedSizeList(item(DataType::Float32), 2)));
        assert_eq!(
            column_kind(&pairs),
            ColumnKind::Variable {
                dtype: DType::F32,
                shape: vec![2]
            }
        );
        for text in [DataType::Utf8, DataType::LargeBinary] {
            assert_eq!(
                column_kind(&text),
                ColumnKind::Variable {
                    dtype: DType::U8,
                    shape: vec![]
                }
            );
        }
        for refused in [
            DataType::List(item(list.clone())),
            DataType::FixedSizeList(item(list), 2),
            DataType::Utf8View,
        ] {
            match column_kind(&refused) {
                ColumnKind::Refused(why) => assert!(why.contains(VARIABLE), "{why}"),
                kind => panic!("{refused} became {kind:?}"),
            }
        }
    }

    /// Writes `batches` (one schema) as a Parquet file of row groups of `group_rows`.
    fn parquet(path: &Path, batches: &[RecordBatch], group_rows: usize) {
        let properties = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(group_rows))
            .build();
        let mut writer = parquet::arrow::ArrowWriter::try_new(
            File::create(path).unwrap(),
            batches[0].schema(),
            Some(properties),
        )
        .unwrap();
        for batch in batches {
            writer.write(batch).unwrap();
        }
        writer.close().unwrap();
    }

    /// Files with a variable-length column read on several threads (row groups and slices of one,
    /// two files concatenated) give the fields one thread gives: the same values, the same ends.
    #[test]
    fn variable_length_files_read_on_threads_equal_one_thread() {
        use arrow_array::builder::ListBuilder;
        use arrow_array::{ArrayRef, Int64Array};
        let dir = tempfile::tempdir().unwrap();
        // Row r: tokens r * 7 + [0, r % 1200), and its id. One file of a single large row group
        // (cut into slices for the threads), one of many small groups.
        let write = |name: &str, rows: std::ops::Range<i64>, group_rows: usize| {
            let mut tokens = ListBuilder::new(arrow_array::builder::Int32Builder::new());
            for row in rows.clone() {
                let base = (row * 7) as i32;
                tokens
                    .values()
                    .append_slice(&(base..base + (row % 1200) as i32).collect::<Vec<i32>>());
                tokens.append(true);
            }
            let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(rows));
            let batch = RecordBatch::try_from_iter([
                ("tokens", Arc::new(tokens.finish()) as ArrayRef),
                ("id", ids),
            ])
            .unwrap();
            let path = dir.path().join(name);
            parquet(&path, &[batch], group_rows);
            path
        };
        let big = write("big.parquet", 0..30_000, 30_000);
        let small = write("small.parquet", 30_000..31_000, 64);
        let paths = [big, small];
        let read = |threads: usize| {
            open_table_dataset(&paths, dir.path(), threads)
                .unwrap()
                .into_iter()
                .map(|field| {
                    let mut values = Vec::new();
                    field
                        .copy_samples(0, field.sample_count(), &mut values)
                        .unwrap();
                    (field.ends().map(<[u64]>::to_vec), values)
                })
                .collect::<Vec<_>>()
        };
        let one = read(1);
        let (ends, values) = &one[0];
        let ends = ends.as_ref().expect("tokens are variable-length");
        assert_eq!(ends.len(), 31_000);
        assert_eq!(values.len() as u64, ends[30_999] * 4);
        let row = 29_999usize;
        let start = ends[row - 1] as usize * 4;
        assert_eq!(
            i32::from_le_bytes(values[start..start + 4].try_into().unwrap()),
            (row * 7) as i32
        );
        for threads in [2, 4, 5] {
            assert!(read(threads) == one, "{threads} threads read other fields");
        }
    }

    #[test]
    fn list_and_string_columns_pack_as_their_values_with_each_rows_end() {
        use arrow_array::builder::{ListBuilder, StringBuilder};
        use arrow_array::{ArrayRef, Int64Array};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("docs.parquet");
        // Row r: tokens [r * 10, r * 10 + r % 5), text "r" repeated r % 3 times.
        let rows = 500;
        let mut tokens = ListBuilder::new(arrow_array::builder::Int32Builder::new());
        let mut text = StringBuilder::new();
        for row in 0..rows {
            tokens
                .values()
                .append_slice(&(row * 10..row * 10 + row % 5).collect::<Vec<i32>>());
            tokens.append(true);
            text.append_value(row.to_string().repeat(row as usize % 3));
        }
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
        let batch = RecordBatch::try_from_iter([
            ("tokens", Arc::new(tokens.finish()) as ArrayRef),
            ("text", Arc::new(text.finish()) as ArrayRef),
            ("id", ids),
        ])
        .unwrap();
        parquet(&path, &[batch.slice(0, 200), batch.slice(200, 300)], 70);
        let fields = open_table_dataset(std::slice::from_ref(&path), dir.path(), 3).unwrap();
        let [tokens, text, id] = &fields[..] else {
            panic!("three fields")
        };
        assert!(tokens.is_variable() && text.is_variable() && !id.is_variable());
        assert_eq!(
            (tokens.samples(), text.samples(), id.samples()),
            (500, 500, 500)
        );
        assert_eq!((tokens.dtype, text.dtype), (DType::I32, DType::U8));
        let mut values = Vec::new();
        tokens
            .copy_samples(0, tokens.sample_count(), &mut values)
            .unwrap();
        let values: Vec<i32> = values
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut bytes = Vec::new();
        text.copy_samples(0, text.sample_count(), &mut bytes)
            .unwrap();
        let (mut token_start, mut text_start) = (0usize, 0usize);
        for row in 0..rows {
            let token_end = tokens.ends().unwrap()[row as usize] as usize;
            let expected: Vec<i32> = (row * 10..row * 10 + row % 5).collect();
            assert_eq!(values[token_start..token_end], expected[..], "row {row}");
            token_start = token_end;
            let text_end = text.ends().unwrap()[row as usize] as usize;
            assert_eq!(
                &bytes[text_start..text_end],
                row.to_string().repeat(row as usize % 3).as_bytes()
            );
            text_start = text_end;
        }
        assert_eq!(tokens.length_max(), 4);

        // A null inside a list is refused naming the column and the row.
        let mut nulls = ListBuilder::new(arrow_array::builder::Int32Builder::new());
        for row in 0..50 {
            nulls.values().append_value(row);
            if row == 37 {
                nulls.values().append_null();
            }
            nulls.append(true);
        }
        let batch =
            RecordBatch::try_from_iter([("ids", Arc::new(nulls.finish()) as ArrayRef)]).unwrap();
        let bad = dir.path().join("nulls.parquet");
        parquet(&bad, &[batch], 20);
        let error = open_table_dataset(std::slice::from_ref(&bad), dir.path(), 2)
            .unwrap_err()
            .to_string();
        assert!(error.contains("column 'ids', row 37: null"), "{error}");
    }

    /// A Parquet file whose metadata lies, its row group claiming 50 rows more than its pages
    /// hold (the file's own count agreeing with the lie), is refused naming the file rather than
    /// packed short or padded.
    #[test]
    fn a_row_group_claiming_more_rows_than_its_pages_hold_is_refused() {
        lying_row_group_is_refused(100);
    }

    /// The same for a row group large enough to be cut into slices for several threads (two of
    /// 2.5 M rows, of 5 M rows of 8 bytes): the second slice reads past the rows the group holds,
    /// and the error is still the group's count against the footer's, not the slice's.
    #[test]
    fn a_sliced_row_group_claiming_more_rows_than_its_pages_hold_is_refused() {
        lying_row_group_is_refused(5_000_000);
    }

    fn lying_row_group_is_refused(rows: i64) {
        use arrow_array::{ArrayRef, Int64Array};
        let values: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows));
        lying_row_group_of(RecordBatch::try_from_iter([("x", values)]).unwrap());
    }

    /// The same with a variable-length column (token lists): its rows are read on the threads too
    /// (`read_parquet_parallel_appending`), and a row group short of the footer's rows is refused
    /// with the same words.
    #[test]
    fn a_row_group_of_lists_claiming_more_rows_than_it_holds_is_refused() {
        use arrow_array::builder::ListBuilder;
        use arrow_array::ArrayRef;
        let mut lists = ListBuilder::new(arrow_array::builder::Int32Builder::new());
        for row in 0..3000 {
            lists.values().append_slice(&vec![row; row as usize % 7]);
            lists.append(true);
        }
        let values: ArrayRef = Arc::new(lists.finish());
        lying_row_group_of(RecordBatch::try_from_iter([("x", values)]).unwrap());
    }

    /// A null element in a fixed-size list column: the page-by-page reader gives its unit up, and
    /// the Arrow reader refuses it naming the row, on one thread and on several.
    #[test]
    fn a_null_in_a_fixed_size_list_is_refused_naming_its_row_on_threads() {
        use arrow_array::builder::{FixedSizeListBuilder, Int32Builder};
        use arrow_array::ArrayRef;
        let mut lists = FixedSizeListBuilder::new(Int32Builder::new(), 4);
        for row in 0..1000 {
            for element in 0..4 {
                if row == 777 && element == 2 {
                    lists.values().append_null();
                } else {
                    lists.values().append_value(row * 4 + element);
                }
            }
            lists.append(true);
        }
        let values: ArrayRef = Arc::new(lists.finish());
        let batch = RecordBatch::try_from_iter([("x", values)]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("null.parquet");
        parquet(&path, &[batch], 300);
        for threads in [1, 3] {
            let error = open_table_dataset(std::slice::from_ref(&path), dir.path(), threads)
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("column 'x', row 777: null"),
                "{threads} threads: {error}"
            );
        }
    }

    /// `batch` (a column `x`) written as one row group whose footer claims 50 rows more: refused by
    /// one thread and by four, naming the file and the counts.
    fn lying_row_group_of(batch: RecordBatch) {
        use parquet::arrow::ArrowWriter;
        use parquet::file::metadata::{
            ParquetMetaDataBuilder, ParquetMetaDataReader, ParquetMetaDataWriter,
        };
        let rows = batch.num_rows() as i64;
        let dir = tempfile::tempdir().unwrap();
        let honest = dir.path().join("honest.parquet");
        // One row group, however many rows.
        let properties = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(rows as usize))
            .build();
        let mut writer = ArrowWriter::try_new(
            File::create(&honest).unwrap(),
            batch.schema(),
            Some(properties),
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        let bytes = std::fs::read(&honest).unwrap();
        let metadata = ParquetMetaDataReader::new()
            .parse_and_finish(&File::open(&honest).unwrap())
            .unwrap();
        let mut builder = ParquetMetaDataBuilder::new_from_metadata(metadata);
        let groups = builder
            .take_row_groups()
            .into_iter()
            .map(|group| {
                let rows = group.num_rows();
                group
                    .into_builder()
                    .set_num_rows(rows + 50)
                    .build()
                    .unwrap()
            })
            .collect();
        let lying = builder.set_row_groups(groups).build();
        let footer =
            u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
        let mut out = bytes[..bytes.len() - 8 - footer as usize].to_vec();
        ParquetMetaDataWriter::new(&mut out, &lying)
            .finish()
            .unwrap();
        let path = dir.path().join("lying.parquet");
        std::fs::write(&path, &out).unwrap();
        assert_eq!(
            describe_table(&path).unwrap().rows,
            rows as u64 + 50,
            "the footer does lie"
        );
        let request = ColumnRequest {
            field: "x".into(),
            path: path.clone(),
            column: "x".into(),
        };
        // One thread reads the file in order; several read row group by row group.
        for (threads, ending) in [
            (
                1,
                format!(
                    "the footer says {} rows but the row groups hold {rows}",
                    rows + 50
                ),
            ),
            (
                4,
                format!(
                    "row group 0: the footer says {} rows but the row group holds {rows}",
                    rows + 50
                ),
            ),
        ] {
            let error =
                open_table_fields(std::slice::from_ref(&request), dir.path(), threads).unwrap_err();
            let text = error.to_string();
            assert!(text.starts_with(&format!("{}: ", path.display())), "{text}");
            assert!(text.ends_with(&ending), "{threads} threads: {text}");
        }
    }
}
