//! The offline tools over a dataset directory: `inspect`, `verify` and `unpack`.
//!
//! They read payloads with plain positional reads and decode on the CPU; the daemon's storage engines
//! are not involved, so these tools also serve as an independent check of what the daemon serves.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use gpufeed_client::DType;
use serde_json::{json, Value};

use crate::decode::{self, BlockError, BlockRef, ConvertError};
use crate::format::{Codec, Dataset, Filter, FormatError, Manifest, Shard};
use crate::input::{npy, InputError};

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
        "format_version": crate::format::FORMAT_VERSION,
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
    /// Every problem found, each naming the shard (and field and block where it applies).
    pub problems: Vec<String>,
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
                report.problems.push(error.to_string());
                continue;
            }
        };
        report.shards_ok += 1;
        let file = match File::open(&shard.path) {
            Ok(file) => file,
            Err(error) => {
                report
                    .problems
                    .push(format!("{}: {error}", shard.path.display()));
                continue;
            }
        };
        let mut reader = BlockReader {
            shard: &shard,
            file: &file,
        };
        for (field_index, field) in shard.metadata.fields.iter().enumerate() {
            for block_index in 0..field.block_count {
                let result = reader.decode(
                    field_index,
                    block_index,
                    &mut stored,
                    &mut scratch,
                    &mut raw,
                );
                match result {
                    Ok(()) => report.blocks_ok += 1,
                    Err(error) => report.problems.push(error.to_string()),
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
    /// A shard file could not be opened.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// Decodes a whole field to a `.npy` file of shape `[samples, ...shape]`, converting to `dtype` if given.
/// Returns the number of bytes of array data written.
pub fn unpack(
    dataset: &Dataset,
    field_name: &str,
    out: &Path,
    dtype: Option<DType>,
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
    let mut shape = vec![dataset.manifest.sample_count];
    shape.extend_from_slice(&field.shape);
    // Written beside `out` under a hidden name and renamed over it only when complete: a corrupt
    // dataset or a failed write leaves no truncated file and an existing `out` as it was.
    let partial = partial_path(out);
    let written = write_field(dataset, field_index, to, &shape, &partial, progress);
    if let Err(error) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(error);
    }
    std::fs::rename(&partial, out).map_err(|source| {
        let _ = std::fs::remove_file(&partial);
        UnpackError::Io {
            path: out.to_path_buf(),
            source,
        }
    })?;
    Ok(
        dataset.manifest.sample_count
            * field.shape.iter().product::<u64>()
            * to.size_bytes() as u64,
    )
}

/// The hidden name `out` is written under before it is complete.
fn partial_path(out: &Path) -> std::path::PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Decodes field `field_index` of every shard, converted to `to`, into a new `.npy` file at `path`.
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
        let file = File::open(&shard.path).map_err(|source| UnpackError::Io {
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
            if to == field.dtype {
                writer.write_all(&raw)?;
            } else {
                let elements = raw.len() / field.dtype.size_bytes();
                converted.clear();
                converted.resize(elements * to.size_bytes(), 0);
                decode::convert(field.dtype, &raw, to, &mut converted)?;
                writer.write_all(&converted)?;
            }
            done += raw.len() as u64;
            progress.progress(done);
        }
    }
    writer.finish()?;
    Ok(())
}
