//! The offline tools over a dataset directory: `inspect`, `verify` and `unpack`.
//!
//! They read payloads with plain positional reads and decode on the CPU; the daemon's storage engines
//! are not involved, so these tools also serve as an independent check of what the daemon serves.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use gpufeed_proto::DType;
use serde_json::{json, Value};

use crate::decode::{self, BlockError, BlockRef, ConvertError};
use crate::durable;
use crate::format::{Codec, Dataset, Filter, FormatError, Manifest, Shard};
use crate::input::{npy, InputError};
use crate::pack::OnExisting;

/// Receives progress from a long-running tool.
pub trait ToolProgress {
    /// Called once with the total amount of work (stored or raw bytes, as the tool says).
    fn started(&self, _total: u64) {}
    /// Called with the amount done so far.
    fn progress(&self, _done: u64) {}
}

/// Progress that goes nowhere.
pub struct NoProgress;

impl ToolProgress for NoProgress {}

/// The JSON summary printed by `gpufeed inspect`.
pub fn inspect(dataset: &Dataset) -> Value {
    let manifest = &dataset.manifest;
    let mut fields = Vec::new();
    let (mut raw_total, mut stored_total) = (0u64, 0u64);
    for (field_index, field) in manifest.fields.iter().enumerate() {
        let (mut raw, mut stored, mut blocks) = (0u64, 0u64, 0u64);
        let (mut raw_blocks, mut lz4_blocks, mut shuffled_blocks) = (0u64, 0u64, 0u64);
        for shard in &dataset.shards {
            for block in shard.metadata.field_blocks(field_index) {
                raw += block.raw_bytes as u64;
                stored += block.stored_bytes as u64;
                blocks += 1;
                match (block.codec, block.filter) {
                    (Codec::Raw, _) => raw_blocks += 1,
                    (Codec::Lz4, Filter::None) => lz4_blocks += 1,
                    (Codec::Lz4, Filter::ByteShuffle) => shuffled_blocks += 1,
                }
            }
        }
        raw_total += raw;
        stored_total += stored;
        fields.push(json!({
            "name": field.name,
            "dtype": field.dtype.name(),
            "shape": field.shape,
            "sample_bytes": field.sample_bytes(),
            "variable_length": field.is_variable(),
            "length_max": field.length_max,
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": ratio(raw, stored),
            "blocks": blocks,
            "codecs": {"raw": raw_blocks, "lz4": lz4_blocks, "lz4_shuffled": shuffled_blocks},
        }));
    }
    let file_bytes: u64 = manifest.shards.iter().map(|s| s.file_bytes).sum();
    json!({
        "name": manifest.name,
        "format_version": manifest.format_version(),
        "samples": manifest.sample_count,
        "block_bytes": manifest.block_bytes,
        "shards": manifest.shards.len(),
        "fields": fields,
        "raw_bytes": raw_total,
        "stored_bytes": stored_total,
        "file_bytes": file_bytes,
        "ratio": ratio(raw_total, stored_total),
    })
}

fn ratio(raw: u64, stored: u64) -> f64 {
    if stored == 0 {
        return 1.0;
    }
    // Three decimals are plenty for a human and keep the JSON stable.
    (raw as f64 / stored as f64 * 1000.0).round() / 1000.0
}

/// What `gpufeed verify` found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Shards whose metadata could be opened.
    pub shards_ok: usize,
    /// Shards in the manifest.
    pub shards_total: usize,
    /// Blocks whose checksum matched and which decoded to their raw size.
    pub blocks_ok: u64,
    /// Every problem found, each naming the shard (and field and block where it applies) and
    /// starting with its kind: `missing: ` (a file is gone), `unreadable: ` (a file cannot be read:
    /// permissions, an I/O error — not damage) or `corrupt: ` (the bytes are wrong).
    pub problems: Vec<String>,
}

/// The kind of a verification problem, as its message starts.
fn problem_kind(error: &FormatError) -> &'static str {
    match error {
        FormatError::MissingShard { .. } => "missing",
        FormatError::Io { .. } => "unreadable",
        _ => "corrupt",
    }
}

/// Checks every shard's metadata and every block's checksum and decoding.
///
/// Fails only when the manifest itself cannot be read; every other problem is collected in the report
/// so that one run lists all damage.
pub fn verify(dir: &Path, progress: &dyn ToolProgress) -> Result<VerifyReport, FormatError> {
    let manifest = Manifest::load(dir)?;
    let mut report = VerifyReport {
        shards_total: manifest.shards.len(),
        ..VerifyReport::default()
    };
    progress.started(manifest.shards.iter().map(|s| s.file_bytes).sum());
    let mut done = 0u64;
    let mut stored = Vec::new();
    let mut raw = Vec::new();
    let mut scratch = Vec::new();
    for index in 0..manifest.shards.len() {
        let shard = match Shard::open(dir, &manifest, index) {
            Ok(shard) => shard,
            Err(error) => {
                report
                    .problems
                    .push(format!("{}: {error}", problem_kind(&error)));
                continue;
            }
        };
        report.shards_ok += 1;
        let file = match crate::format::open_regular(&shard.path) {
            Ok(file) => file,
            Err(error) => {
                report
                    .problems
                    .push(format!("unreadable: {}: {error}", shard.path.display()));
                continue;
            }
        };
        let mut reader = BlockReader {
            shard: &shard,
            file: &file,
        };
        for (field_index, field) in shard.metadata.fields.iter().enumerate() {
            // A variable-length field's offsets, gathered from its first blocks to be checked.
            let mut ends: Option<Vec<u64>> = field.offset_blocks.map(|_| Vec::new());
            for block_index in 0..field.block_count {
                let result = reader.decode(
                    field_index,
                    block_index,
                    &mut stored,
                    &mut scratch,
                    &mut raw,
                );
                if block_index < field.offset_blocks.unwrap_or(0) {
                    match (&mut ends, &result) {
                        (Some(ends), Ok(())) => ends.extend(
                            raw.chunks_exact(8)
                                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))),
                        ),
                        // A block of offsets that does not decode leaves them unchecked.
                        _ => ends = None,
                    }
                }
                match result {
                    Ok(()) => report.blocks_ok += 1,
                    Err(error) => {
                        let kind = match &error {
                            crate::decode::BlockError::Io { .. } => "unreadable",
                            _ => "corrupt",
                        };
                        report.problems.push(format!("{kind}: {error}"));
                    }
                }
            }
            if let (Some(ends), Some(length_max)) = (ends, manifest.fields[field_index].length_max)
            {
                let metadata = &shard.metadata;
                let element_bytes = field.sample_bytes();
                let values_elements = (metadata.field_stream_bytes(field_index)
                    - metadata.offsets_bytes(field_index))
                    / element_bytes;
                let first_sample = metadata.header.first_sample;
                let checked = crate::format::check_offsets(
                    &shard.path,
                    &field.name,
                    first_sample,
                    &ends,
                    values_elements,
                    length_max,
                )
                .and_then(|()| {
                    crate::format::check_values_blocks(
                        &shard.path,
                        &field.name,
                        first_sample,
                        &ends,
                        metadata.field_blocks(field_index),
                        field.offset_blocks.unwrap_or(0),
                        element_bytes,
                    )
                });
                if let Err(error) = checked {
                    report.problems.push(format!("corrupt: {error}"));
                }
            }
        }
        done += manifest.shards[index].file_bytes;
        progress.progress(done);
    }
    Ok(report)
}

/// Reads and decodes the blocks of one open shard.
pub struct BlockReader<'a> {
    /// The shard's metadata.
    pub shard: &'a Shard,
    /// The open shard file.
    pub file: &'a File,
}

impl BlockReader<'_> {
    /// Where block `block_index` of field `field_index` is, for messages.
    pub fn block_ref(&self, field_index: usize, block_index: u32) -> BlockRef {
        let block = &self.shard.metadata.field_blocks(field_index)[block_index as usize];
        BlockRef {
            shard: self.shard.path.clone(),
            field: self.shard.metadata.fields[field_index].name.clone(),
            block: block_index,
            stored_offset: block.stored_offset,
        }
    }

    /// Reads block `block_index` of field `field_index` and decodes it into `raw` (resized to fit).
    pub fn decode(
        &mut self,
        field_index: usize,
        block_index: u32,
        stored: &mut Vec<u8>,
        scratch: &mut Vec<u8>,
        raw: &mut Vec<u8>,
    ) -> Result<(), BlockError> {
        let block = self.shard.metadata.field_blocks(field_index)[block_index as usize];
        let at = || self.block_ref(field_index, block_index);
        stored.clear();
        stored.resize(block.stored_bytes as usize, 0);
        self.file
            .read_exact_at(stored, block.stored_offset)
            .map_err(|source| BlockError::Io { at: at(), source })?;
        raw.clear();
        raw.resize(block.raw_bytes as usize, 0);
        let element_bytes = self.shard.metadata.fields[field_index].dtype.size_bytes();
        decode::decode_block(stored, &block, element_bytes, scratch, raw, at)
    }
}

/// `gpufeed unpack` failed.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The dataset's metadata is unreadable.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A block is corrupt.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// No field has that name.
    #[error("no field named '{name}' (fields: {available})")]
    NoSuchField {
        /// The name asked for.
        name: String,
        /// The dataset's field names.
        available: String,
    },
    /// The conversion is not offered.
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// NumPy has no such dtype.
    #[error("field '{field}' is {dtype}, which .npy cannot hold; pass --dtype f32")]
    NotNpy {
        /// The field.
        field: String,
        /// Its dtype.
        dtype: DType,
    },
    /// The output file could not be written.
    #[error(transparent)]
    Output(#[from] InputError),
    /// The output exists and replacing it was not asked for.
    #[error("{path}: already exists (pass --force to replace it)")]
    Exists {
        /// The output path.
        path: PathBuf,
    },
    /// The output exists and is not a regular file, which is never replaced.
    #[error("{path}: already exists and is {what}; it was left untouched (--force replaces only a regular file)")]
    NotAFile {
        /// The output path.
        path: PathBuf,
        /// What is there, for the message.
        what: &'static str,
    },
    /// A shard file could not be opened, or the output could not be written or renamed into place.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// Decodes a whole field to a `.npy` file of shape `[samples, ...shape]`, converting to `dtype` if given,
/// replacing a regular file at `out`. Returns the number of bytes of array data written.
///
/// Like [`unpack_to`] with [`OnExisting::Replace`]: `out` holds either its old contents or the whole
/// new array, never a partial one.
pub fn unpack(
    dataset: &Dataset,
    field_name: &str,
    out: &Path,
    dtype: Option<DType>,
    progress: &dyn ToolProgress,
) -> Result<u64, UnpackError> {
    unpack_to(
        dataset,
        field_name,
        out,
        dtype,
        OnExisting::Replace,
        progress,
    )
}

/// Decodes a whole field to a `.npy` file of shape `[samples, ...shape]`, converting to `dtype` if given.
/// Returns the number of bytes of array data written.
///
/// The array is written to a hidden temporary file beside `out` and renamed into place only once
/// every block has decoded and the file is synced, so a corrupt block or a crash leaves no truncated
/// `.npy` behind and an existing `out` intact. An existing `out` is replaced only under
/// [`OnExisting::Replace`], and only if it is a regular file.
pub fn unpack_to(
    dataset: &Dataset,
    field_name: &str,
    out: &Path,
    dtype: Option<DType>,
    on_existing: OnExisting,
    progress: &dyn ToolProgress,
) -> Result<u64, UnpackError> {
    let field_index = dataset
        .field_index(field_name)
        .ok_or_else(|| UnpackError::NoSuchField {
            name: field_name.to_string(),
            available: dataset
                .manifest
                .fields
                .iter()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    let field = &dataset.manifest.fields[field_index];
    let to = dtype.unwrap_or(field.dtype);
    if !decode::convert_supported(field.dtype, to) {
        return Err(ConvertError {
            from: field.dtype,
            to,
        }
        .into());
    }
    if to == DType::BF16 {
        return Err(UnpackError::NotNpy {
            field: field.name.clone(),
            dtype: to,
        });
    }
    if field.is_variable() {
        return unpack_variable(dataset, field_index, out, to, on_existing, progress);
    }
    let mut shape = vec![dataset.manifest.sample_count];
    shape.extend_from_slice(&field.shape);
    // Checked before decoding anything so that a refusal costs nothing; the final link or rename
    // decides again, since `out` may appear meanwhile.
    check_output(out, on_existing)?;
    let temporary = temporary_beside(out)?;
    let result = write_field(dataset, field_index, to, &shape, &temporary, progress)
        .map_err(|error| output_error(error, &temporary, out))
        .and_then(|()| install_output(&temporary, out, on_existing));
    if result.is_err() {
        // Best effort: the temporary file is hidden and never read, but should not accumulate.
        let _ = fs::remove_file(&temporary);
    }
    result?;
    Ok(
        dataset.manifest.sample_count
            * field.shape.iter().product::<u64>()
            * to.size_bytes() as u64,
    )
}

/// Decodes field `field_index` into a new `.npy` file at `path`, converted to `to`.
fn write_field(
    dataset: &Dataset,
    field_index: usize,
    to: DType,
    shape: &[u64],
    path: &Path,
    progress: &dyn ToolProgress,
) -> Result<(), UnpackError> {
    let field = &dataset.manifest.fields[field_index];
    let mut writer = npy::write_npy(path, to, shape)?;
    let raw_total = field.sample_bytes() * dataset.manifest.sample_count;
    progress.started(raw_total);
    let (mut stored, mut scratch, mut raw, mut converted) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut done = 0u64;
    for shard in &dataset.shards {
        let file = crate::format::open_regular(&shard.path).map_err(|source| UnpackError::Io {
            path: shard.path.clone(),
            source,
        })?;
        let mut reader = BlockReader { shard, file: &file };
        let field_meta = &shard.metadata.fields[field_index];
        for block_index in 0..field_meta.block_count {
            reader.decode(
                field_index,
                block_index,
                &mut stored,
                &mut scratch,
                &mut raw,
            )?;
            write_converted(&mut writer, field.dtype, to, &raw, &mut converted)?;
            done += raw.len() as u64;
            progress.progress(done);
        }
    }
    writer.finish()?;
    Ok(())
}

/// Where [`unpack_to`] writes a variable-length field's offsets beside its values at `out`:
/// `NAME.offsets.npy` for `NAME.npy`, else `out` with `.offsets.npy` appended.
pub fn offsets_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".npy").unwrap_or(&name);
    out.with_file_name(format!("{stem}.offsets.npy"))
}

/// [`unpack_to`] for a variable-length field: its values, every sample's elements one after the
/// other, as a `.npy` of shape `[elements, ...element shape]` at `out`, and int64 offsets of shape
/// `[samples + 1]` at [`offsets_path`] (sample `i`'s values are elements `offsets[i] ..
/// offsets[i + 1]`), the form of Arrow's list arrays and of `np.split`. Every shard's offsets are
/// checked before use; the offsets file is installed first, then the values, each only once whole.
/// Returns the bytes of values written.
fn unpack_variable(
    dataset: &Dataset,
    field_index: usize,
    out: &Path,
    to: DType,
    on_existing: OnExisting,
    progress: &dyn ToolProgress,
) -> Result<u64, UnpackError> {
    let field = &dataset.manifest.fields[field_index];
    let element_bytes = field.sample_bytes();
    let offsets_out = offsets_path(out);
    check_output(out, on_existing)?;
    check_output(&offsets_out, on_existing)?;
    // Elements in all: each shard's field bytes less its offsets, from the block tables.
    let mut elements = 0u64;
    for shard in &dataset.shards {
        let raw: u64 = shard
            .metadata
            .field_blocks(field_index)
            .iter()
            .map(|b| b.raw_bytes as u64)
            .sum();
        let offsets = shard.metadata.header.sample_count * crate::format::OFFSET_BYTES;
        elements += raw.saturating_sub(offsets) / element_bytes.max(1);
    }
    let mut shape = vec![elements];
    shape.extend_from_slice(&field.shape);
    let values_tmp = temporary_beside(out)?;
    let offsets_tmp = temporary_beside(&offsets_out)?;
    let written = write_variable(
        dataset,
        field_index,
        to,
        &shape,
        (&values_tmp, &offsets_tmp),
        progress,
    )
    .map_err(|error| {
        output_error(
            output_error(error, &values_tmp, out),
            &offsets_tmp,
            &offsets_out,
        )
    })
    .and_then(|()| install_output(&offsets_tmp, &offsets_out, on_existing))
    .and_then(|()| install_output(&values_tmp, out, on_existing));
    let _ = fs::remove_file(&values_tmp);
    let _ = fs::remove_file(&offsets_tmp);
    written?;
    Ok(elements * element_bytes / field.dtype.size_bytes() as u64 * to.size_bytes() as u64)
}

/// Decodes a variable-length field's value blocks, shard by shard, into the values file and writes
/// its offsets, read and checked as streams read them (`varlen::read_offsets`), into the offsets
/// file (`paths`).
fn write_variable(
    dataset: &Dataset,
    field_index: usize,
    to: DType,
    shape: &[u64],
    paths: (&Path, &Path),
    progress: &dyn ToolProgress,
) -> Result<(), UnpackError> {
    let field = &dataset.manifest.fields[field_index];
    let all_ends = crate::pipeline::varlen::read_offsets(dataset, field_index).map_err(|what| {
        UnpackError::Io {
            path: dataset.dir.clone(),
            source: io::Error::new(io::ErrorKind::InvalidData, what),
        }
    })?;
    let mut values = npy::write_npy(paths.0, to, shape)?;
    let mut offsets = npy::write_npy(paths.1, DType::I64, &[dataset.manifest.sample_count + 1])?;
    offsets.write_all(&0i64.to_le_bytes())?;
    progress.started(shape[0] * field.sample_bytes());
    let (mut stored, mut scratch, mut raw, mut converted) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut base, mut done) = (0u64, 0u64);
    for (shard, ends) in dataset.shards.iter().zip(&all_ends) {
        for &end in ends {
            offsets.write_all(&((base + end) as i64).to_le_bytes())?;
        }
        let file = crate::format::open_regular(&shard.path).map_err(|source| UnpackError::Io {
            path: shard.path.clone(),
            source,
        })?;
        let mut reader = BlockReader { shard, file: &file };
        // The blocks after the offsets hold the values.
        let listed = &shard.metadata.fields[field_index];
        for block_index in listed.offset_blocks.unwrap_or(0)..listed.block_count {
            reader.decode(
                field_index,
                block_index,
                &mut stored,
                &mut scratch,
                &mut raw,
            )?;
            write_converted(&mut values, field.dtype, to, &raw, &mut converted)?;
            done += raw.len() as u64;
            progress.progress(done);
        }
        // The last end is the shard's element count (checked).
        base += ends.last().copied().unwrap_or(0);
    }
    values.finish()?;
    offsets.finish()?;
    Ok(())
}

/// Writes `raw` (elements of `from`) to `writer` as `to`, converting through `converted` when they
/// differ.
fn write_converted(
    writer: &mut npy::NpyWriter,
    from: DType,
    to: DType,
    raw: &[u8],
    converted: &mut Vec<u8>,
) -> Result<(), UnpackError> {
    if to == from {
        writer.write_all(raw)?;
    } else {
        let elements = raw.len() / from.size_bytes();
        converted.clear();
        converted.resize(elements * to.size_bytes(), 0);
        decode::convert(from, raw, to, converted)?;
        writer.write_all(converted)?;
    }
    Ok(())
}

/// Fails unless `unpack` may write to `out` under `on_existing`. A link is not followed: renaming
/// over it would replace the link rather than write where it points.
fn check_output(out: &Path, on_existing: OnExisting) -> Result<(), UnpackError> {
    let metadata = match fs::symlink_metadata(out) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(UnpackError::Io {
                path: out.to_path_buf(),
                source,
            })
        }
    };
    let file_type = metadata.file_type();
    let what = if file_type.is_file() {
        None
    } else if file_type.is_dir() {
        Some("a directory")
    } else if file_type.is_symlink() {
        Some("a symbolic link")
    } else {
        Some("a special file")
    };
    match (what, on_existing) {
        (Some(what), _) => Err(UnpackError::NotAFile {
            path: out.to_path_buf(),
            what,
        }),
        (None, OnExisting::Refuse) => Err(UnpackError::Exists {
            path: out.to_path_buf(),
        }),
        (None, OnExisting::Replace) => Ok(()),
    }
}

/// A hidden name in `out`'s directory for the file being written (`.NAME.partial-PID-N`).
fn temporary_beside(out: &Path) -> Result<PathBuf, UnpackError> {
    durable::hidden_beside(out, "partial").ok_or_else(|| UnpackError::Io {
        path: out.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "not a file name"),
    })
}

/// Names `out` instead of the temporary file in an I/O error, since that is the path the user gave.
fn output_error(error: UnpackError, temporary: &Path, out: &Path) -> UnpackError {
    match error {
        UnpackError::Output(InputError::Io { path, source }) if path == temporary => {
            UnpackError::Io {
                path: out.to_path_buf(),
                source,
            }
        }
        other => other,
    }
}

/// Moves the finished temporary file to `out`. Without replacing, a hard link creates `out` only if
/// nothing is there (rename(2) would silently replace a file that appeared meanwhile).
fn install_output(
    temporary: &Path,
    out: &Path,
    on_existing: OnExisting,
) -> Result<(), UnpackError> {
    let io = |source| UnpackError::Io {
        path: out.to_path_buf(),
        source,
    };
    match on_existing {
        OnExisting::Replace => {
            check_output(out, on_existing)?;
            fs::rename(temporary, out).map_err(io)?;
        }
        OnExisting::Refuse => match fs::hard_link(temporary, out) {
            Ok(()) => fs::remove_file(temporary).map_err(io)?,
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                return Err(UnpackError::Exists {
                    path: out.to_path_buf(),
                })
            }
            // A file system without hard links: fall back to checking, then renaming.
            Err(_) => {
                check_output(out, on_existing)?;
                fs::rename(temporary, out).map_err(io)?;
            }
        },
    }
    durable::sync_dir(durable::parent_dir(out)).map_err(|error| UnpackError::Io {
        path: error.path,
        source: error.source,
    })
}

/// Bytes of a safetensors header `list_input` reads at most (the `safetensors` crate's own limit).
const SAFETENSORS_HEADER_BYTES_MAX: u64 = 100_000_000;

/// The format of a pack input, as found from its first bytes (not its name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputFormat {
    /// A NumPy `.npy` file: one array.
    Npy,
    /// A safetensors file: named tensors.
    Safetensors,
}

/// One array of an input file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputArray {
    /// The tensor's name; `None` for the single array of a `.npy` file.
    pub name: Option<String>,
    /// The element type as gpufeed names it, or as the file spells it when gpufeed cannot pack it.
    pub dtype: String,
    /// Whether gpufeed can pack this element type.
    pub dtype_supported: bool,
    /// Why `pack` refuses this array as a field though its dtype is supported (a 0-d tensor, a 0 in
    /// its per-sample shape); `None` when it can be packed.
    pub problem: Option<String>,
    /// The full shape, samples first.
    pub shape: Vec<u64>,
}

/// What `gpufeed list-inputs` prints for one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputListing {
    /// The file.
    pub path: PathBuf,
    /// Its format.
    pub format: InputFormat,
    /// Its arrays; tensors sorted by name.
    pub arrays: Vec<InputArray>,
}

/// `gpufeed list-inputs` could not read a file.
#[derive(Debug, thiserror::Error)]
pub enum ListInputError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The path is not a regular file (reading a FIFO or a device could block or never end).
    #[error("{path}: not a regular file")]
    NotAFile {
        /// The path.
        path: PathBuf,
    },
    /// The file starts like neither format.
    #[error("{path}: neither a NumPy .npy file (no \\x93NUMPY magic) nor a safetensors file (no JSON header)")]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// The `.npy` file is invalid.
    #[error(transparent)]
    Npy(#[from] InputError),
    /// The safetensors header is invalid.
    #[error("{path}: bad safetensors header: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// Lists the arrays of a `.npy` or safetensors file (name, dtype, shape), reading only its header.
///
/// The format is recognised from the file's first bytes, so a safetensors file named otherwise is
/// still listed as one.
pub fn list_input(path: &Path) -> Result<InputListing, ListInputError> {
    let io = |source| ListInputError::Io {
        path: path.to_path_buf(),
        source,
    };
    // Checked before opening: opening a FIFO for reading blocks until a writer comes.
    if !fs::metadata(path).map_err(io)?.is_file() {
        return Err(ListInputError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let file = File::open(path).map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    let mut prefix = [0u8; 9];
    let prefix_len = read_at_most(&file, 0, &mut prefix).map_err(io)?;
    let prefix = &prefix[..prefix_len];
    if prefix.starts_with(b"\x93NUMPY") {
        // The input module validates the header and the file's length against it.
        let source = crate::input::open_npy_field("array", &[path.to_path_buf()])?;
        let mut shape = vec![source.sample_count()];
        shape.extend_from_slice(&source.sample_shape);
        return Ok(InputListing {
            path: path.to_path_buf(),
            format: InputFormat::Npy,
            arrays: vec![InputArray {
                name: None,
                dtype: source.dtype.name().to_string(),
                dtype_supported: true,
                // `open_npy_field` refused the file already if its array cannot be a field.
                problem: None,
                shape,
            }],
        });
    }
    // safetensors: an 8-byte little-endian header length, then that many bytes of JSON.
    let header_len = match prefix {
        [len @ .., b'{'] => u64::from_le_bytes(len.try_into().expect("8 bytes")),
        _ => {
            return Err(ListInputError::UnknownFormat {
                path: path.to_path_buf(),
            })
        }
    };
    let bad = |reason: String| ListInputError::Safetensors {
        path: path.to_path_buf(),
        reason,
    };
    if header_len > SAFETENSORS_HEADER_BYTES_MAX || 8 + header_len > metadata.len() {
        return Err(bad(format!(
            "header length {header_len} does not fit the file's {} bytes",
            metadata.len()
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8).map_err(io)?;
    // The checks `pack` applies to the header, so that a file listed is a file whose tensors can be
    // packed (the format refuses the whole file when one tensor breaks its rules).
    let tensors = crate::input::safetensors::check_header(path, &header, metadata.len())?;
    let mut arrays = Vec::with_capacity(tensors.len());
    for tensor in tensors {
        // safetensors spells dtypes in capitals (F32, BF16); gpufeed's names are the same in lower case.
        let file_dtype = tensor.dtype.to_string();
        let (dtype, dtype_supported) = match file_dtype.to_ascii_lowercase().parse::<DType>() {
            Ok(dtype) => (dtype.name().to_string(), true),
            Err(_) => (file_dtype, false),
        };
        // The rules `pack` applies to the tensor it is asked for (`split_shape` in the input module).
        let problem = match tensor.shape.split_first() {
            None => Some("a 0-d tensor has no axis 0 to take samples along".to_string()),
            Some((_, sample_shape)) if sample_shape.contains(&0) => {
                Some("its per-sample shape contains 0: every sample would be empty".to_string())
            }
            Some(_) => None,
        };
        arrays.push(InputArray {
            name: Some(tensor.name),
            dtype,
            dtype_supported,
            problem,
            shape: tensor.shape,
        });
    }
    arrays.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(InputListing {
        path: path.to_path_buf(),
        format: InputFormat::Safetensors,
        arrays,
    })
}

/// Reads up to `buf.len()` bytes at `offset`, fewer only at the end of the file.
fn read_at_most(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(filled)
}

impl InputArray {
    /// `NAME DTYPE [SHAPE]` (or `DTYPE [SHAPE]` for a `.npy` array), noting an unsupported dtype.
    pub fn describe(&self) -> String {
        let shape = self
            .shape
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let mut text = match &self.name {
            Some(name) => format!("{name} {} [{shape}]", self.dtype),
            None => format!("{} [{shape}]", self.dtype),
        };
        if !self.dtype_supported {
            text.push_str(" (gpufeed cannot pack this dtype)");
        } else if let Some(problem) = &self.problem {
            text.push_str(&format!(" (gpufeed cannot pack this: {problem})"));
        }
        text
    }
}
