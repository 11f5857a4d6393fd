//! The packer: turns field sources (NumPy, safetensors, in-memory bytes) into a dataset directory.
//!
//! Writing is atomic at the directory level: everything is written into a hidden staging directory next
//! to the destination, fsynced, and renamed into place last. An interrupted pack leaves at most a
//! `.NAME.partial-PID-N` directory behind, never a manifest at the destination, and an existing
//! dataset is replaced only when asked. The packer holds a lock on its staging directory while it
//! runs; the next pack into the same directory, and the daemon at start for its data root, remove
//! the staging that dead packers left ([`remove_stale_staging`]).
//!
//! The directory that is to hold `--out` must exist: a pack does not create it, so that a mistyped
//! path is an error naming the missing directory rather than a dataset of many gigabytes written
//! somewhere unexpected.

use std::fs::{self, File};
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::decode::shuffle;
use crate::durable::{self, WriterLock};
use crate::format::{
    self, checksum, encode_shard_metadata, payload_offset, BlockEntry, Codec, Field, Filter,
    Manifest, ManifestField, ManifestShard, BLOCK_BYTES_MAX, BLOCK_BYTES_MIN, FIELDS_MAX,
    MANIFEST_FILE_NAME, PAYLOAD_ALIGN_BYTES, SAMPLE_NDIM_MAX, SHARD_BLOCKS_MAX,
};
use crate::input::FieldSource;

/// `--codec auto` stores a field LZ4 only if its sampled blocks compress to at most half their raw
/// bytes (`stored ≤ raw − raw / MIN_SAVING_DIVISOR`, a ratio of about 2 or more); otherwise the whole
/// field is stored raw. Why 2: a read that moves compressed bytes over the link and decodes them
/// before the next read delivers `1 / (1 / (r · L) + 1 / D)` raw-equivalent bytes per second for a
/// ratio `r`, link rate `L` and decode rate `D`; it beats raw (`L`) only when `D ≥ L · r / (r − 1)`.
/// At the 55 GB/s PCIe link (and a page cache that reads at that rate) `r = 1.26` needs a decoder
/// at 4.8 L, 267 GB/s, far past any LZ4 decoder; `r = 2` needs 2 L, 110 GB/s, the rate the GPU LZ4
/// path is built to reach, and a decode overlapped with the transfer needs only `L`. On a cold disk
/// (1.2–2.1 GB/s) any `r > 1` pays, and `r ≥ 2` at least doubles it. Below 2 the certain loss on warm
/// reads outweighs the gain on cold ones.
///
/// The sizes weighed are the LZ4 payloads' own. Each payload starts on a 4096-byte boundary
/// ([`crate::format::PAYLOAD_ALIGN_BYTES`]) and is read in whole pages, so with blocks of a few pages
/// the bytes read shrink less than the ratio says (a 16 KiB block of tokens compresses to about
/// 7.2 KiB and reads 8 KiB; a 4 KiB block reads 4 KiB whatever it compresses to).
///
/// What it does not weigh: the CPU backend reading a warm page cache, where LZ4 at any ratio serves
/// slower than raw (decoding on the host's cores runs below the memory copy it replaces;
/// `docs/benchmarks/cpu-lz4-2026-11-28.md` measures tokens stored both ways). A dataset meant only for
/// the CPU backend with its shards in the page cache reads fastest packed `--codec raw`.
pub const MIN_SAVING_DIVISOR: u32 = 2;

/// Blocks of a field that `--codec auto` compresses to decide the field's codec: spread evenly over
/// the field's whole byte stream, so the decision is deterministic and costs at most this many
/// block compressions (two each with `--byte-shuffle auto`), whatever the dataset's size.
pub const AUTO_SAMPLE_BLOCKS: u64 = 16;

/// Raw bytes per shard the packer aims for when `samples_per_shard` is not given (256 MiB): large enough
/// for long sequential reads, small enough to spread over readers and to re-pack cheaply.
pub const SHARD_RAW_BYTES_TARGET: u64 = 256 << 20;

/// Blocks encoded together in one parallel step; bounds the packer's memory to about this many blocks
/// of raw plus stored bytes.
const BLOCKS_PER_STEP: usize = 256;

/// Which codec the packer uses for each block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodecChoice {
    /// Per field: LZ4 for every block of a field whose sampled blocks ([`AUTO_SAMPLE_BLOCKS`])
    /// compress at least about 2x (see [`MIN_SAVING_DIVISOR`]), raw for every block otherwise. For
    /// one block alone ([`encode_block`]), the same rule over that block.
    Auto,
    /// LZ4 for every block, even when it does not shrink it (for testing decoders).
    Lz4,
    /// Every block raw.
    Raw,
}

/// Whether compressed blocks are byte-shuffled first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShuffleChoice {
    /// Per block, whichever of shuffled and unshuffled compresses smaller.
    Auto,
    /// Always shuffle (for elements wider than one byte).
    On,
    /// Never shuffle.
    Off,
}

/// What to do when the destination already holds something.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnExisting {
    /// Fail ([`PackError::Exists`], [`crate::tools::UnpackError::Exists`]).
    Refuse,
    /// Replace it once the new output is complete, but only if it is what the tool writes (a gpufeed
    /// dataset for `pack`, a regular file for `unpack`); anything else is left untouched and the tool
    /// fails naming the path.
    Replace,
}

/// Options of one pack.
#[derive(Clone, Debug)]
pub struct PackOptions {
    /// Dataset name recorded in the manifest.
    pub name: String,
    /// Largest raw size of a block; a power of two in 4 KiB..=16 MiB.
    pub block_bytes: u32,
    /// Samples per shard; `None` aims at [`SHARD_RAW_BYTES_TARGET`] raw bytes per shard.
    pub samples_per_shard: Option<u64>,
    /// Codec policy.
    pub codec: CodecChoice,
    /// Shuffle-filter policy.
    pub shuffle: ShuffleChoice,
    /// Policy for an existing destination.
    pub on_existing: OnExisting,
    /// Threads compressing blocks (at least 1).
    pub threads: usize,
}

/// Receives progress from a pack and may cancel it.
pub trait PackObserver: Sync {
    /// Called once with the total raw bytes to pack.
    fn started(&self, _raw_bytes_total: u64) {}
    /// Called as blocks are written, with the raw bytes done so far.
    fn progress(&self, _raw_bytes_done: u64) {}
    /// Polled between steps; returning true stops the pack and removes everything it wrote.
    fn cancelled(&self) -> bool {
        false
    }
}

/// An observer that ignores progress and never cancels.
pub struct Quiet;

impl PackObserver for Quiet {}

/// What a finished pack wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackSummary {
    /// The dataset directory.
    pub dir: PathBuf,
    /// Samples packed.
    pub sample_count: u64,
    /// Shard files written.
    pub shard_count: usize,
    /// Raw bytes over all fields.
    pub raw_bytes: u64,
    /// Payload bytes stored over all fields (without metadata and padding).
    pub stored_bytes: u64,
}

/// A pack failed; nothing was left at the destination.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The options or inputs break a rule of the format.
    #[error("invalid pack request: {0}")]
    Invalid(String),
    /// The fields do not all have the same number of samples.
    #[error("field '{field}' ({paths}) has {count} samples but field '{first_field}' has {first_count}; all fields need the same sample count")]
    SampleCountMismatch {
        /// The field that differs.
        field: String,
        /// Its input files.
        paths: String,
        /// Its sample count.
        count: u64,
        /// The first field.
        first_field: String,
        /// The first field's sample count.
        first_count: u64,
    },
    /// The destination exists and replacing was not asked for.
    #[error("{path}: already exists (pass --force to replace it)")]
    Exists {
        /// The destination.
        path: PathBuf,
    },
    /// The destination holds something other than a gpufeed dataset, which is never replaced.
    #[error("{path}: {reason}; it was left untouched (--force replaces only a gpufeed dataset: a directory holding a valid manifest.json and the shards it names, nothing else)")]
    NotADataset {
        /// The destination.
        path: PathBuf,
        /// What is there instead and why it is not a dataset.
        reason: String,
    },
    /// The directory that is to hold the destination does not exist (a pack does not create it).
    #[error("{}: the directory {} does not exist; create it first (a pack creates only the dataset directory itself)", path.display(), directory.display())]
    MissingDirectory {
        /// The destination.
        path: PathBuf,
        /// The directory that is missing: the destination's parent.
        directory: PathBuf,
    },
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The observer cancelled the pack.
    #[error("pack cancelled")]
    Cancelled,
    /// An input could not be read as it was when the pack started (it changed while it was
    /// packed); the error names the file.
    #[error(transparent)]
    Input(#[from] crate::input::InputError),
}

impl From<durable::PathError> for PackError {
    fn from(error: durable::PathError) -> PackError {
        PackError::Io {
            path: error.path,
            source: error.source,
        }
    }
}

/// One block after encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EncodedBlock {
    /// Codec of the stored bytes.
    pub codec: Codec,
    /// Filter applied before compression.
    pub filter: Filter,
    /// The stored bytes.
    pub stored: Vec<u8>,
}

/// Encodes one block's raw bytes under the given policies.
///
/// `element_bytes` is the field's element width, used by the shuffle filter.
pub fn encode_block(
    raw: &[u8],
    element_bytes: usize,
    codec: CodecChoice,
    shuffle_choice: ShuffleChoice,
) -> EncodedBlock {
    let raw_block = || EncodedBlock {
        codec: Codec::Raw,
        filter: Filter::None,
        stored: raw.to_vec(),
    };
    if codec == CodecChoice::Raw {
        return raw_block();
    }
    let shuffle_possible = element_bytes > 1 && raw.len() % element_bytes == 0;
    let plain = || lz4_flex::block::compress(raw);
    let shuffled = || {
        let mut filtered = vec![0u8; raw.len()];
        shuffle(raw, element_bytes, &mut filtered);
        lz4_flex::block::compress(&filtered)
    };
    let (filter, stored) = match (shuffle_choice, shuffle_possible) {
        (ShuffleChoice::Off, _) | (_, false) => (Filter::None, plain()),
        (ShuffleChoice::On, true) => (Filter::ByteShuffle, shuffled()),
        (ShuffleChoice::Auto, true) => {
            let a = plain();
            let plain_saves = a.len() < raw.len() - raw.len() / MIN_SAVING_DIVISOR as usize;
            // When the codec may store the block raw and plain LZ4 did not save enough, shuffle and
            // compress a probe of the block first: data that LZ4 cannot shrink either way (fp16
            // weights, embeddings) then costs one full compression instead of two.
            let worth_trying = codec != CodecChoice::Auto
                || plain_saves
                || shuffled_probe_saves(raw, element_bytes);
            let b = if worth_trying { shuffled() } else { Vec::new() };
            if worth_trying && b.len() < a.len() {
                (Filter::ByteShuffle, b)
            } else {
                (Filter::None, a)
            }
        }
    };
    let saves_enough =
        stored.len() as u64 <= raw.len() as u64 - raw.len() as u64 / MIN_SAVING_DIVISOR as u64;
    if codec == CodecChoice::Auto && !saves_enough {
        return raw_block();
    }
    EncodedBlock {
        codec: Codec::Lz4,
        filter,
        stored,
    }
}

/// Bytes of a block probed before deciding whether to compress it shuffled in full.
const SHUFFLE_PROBE_BYTES: usize = 16 << 10;

/// Whether the shuffled first [`SHUFFLE_PROBE_BYTES`] of `raw` save at least 1/4 (half the saving a
/// whole block must show, since a short probe gives LZ4 less history to match against).
fn shuffled_probe_saves(raw: &[u8], element_bytes: usize) -> bool {
    let len = raw.len().min(SHUFFLE_PROBE_BYTES) / element_bytes * element_bytes;
    if len == raw.len() || len == 0 {
        // The block is no larger than the probe: the full attempt costs the same.
        return true;
    }
    let mut shuffled = vec![0u8; len];
    shuffle(&raw[..len], element_bytes, &mut shuffled);
    let compressed = lz4_flex::block::compress(&shuffled);
    compressed.len() < len - len / (2 * MIN_SAVING_DIVISOR as usize)
}

/// The codec every block of `field` is stored with: `options.codec` itself for `lz4` and `raw`; for
/// `auto`, [`CodecChoice::Lz4`] if the field's [`AUTO_SAMPLE_BLOCKS`] sampled blocks, each
/// compressed as the pack would (plain or byte-shuffled per `options.shuffle`), together store in at
/// most `raw − raw / MIN_SAVING_DIVISOR` bytes, and [`CodecChoice::Raw`] otherwise.
///
/// The blocks sampled are those the field's byte stream would be cut into in one shard: block `j`
/// covers bytes `[j · c, min((j + 1) · c, total))` for the field's block size `c` ([`chunk_bytes`]),
/// and the ones taken are `j = floor(i · n / k)` for `i` in `0..k`, with `n` the field's block count
/// and `k = min(AUTO_SAMPLE_BLOCKS, n)`. Deciding once per field rather than per block keeps a field
/// from being a mix of raw and LZ4 blocks, whose reads would pay for decode without the saving.
pub fn field_codec(field: &FieldSource, options: &PackOptions) -> Result<CodecChoice, PackError> {
    if options.codec != CodecChoice::Auto {
        return Ok(options.codec);
    }
    let sample_bytes = field.sample_bytes() as u64;
    let total = field.total_bytes();
    let chunk = chunk_bytes(sample_bytes, options.block_bytes);
    let blocks = total.div_ceil(chunk);
    let taken = AUTO_SAMPLE_BLOCKS.min(blocks);
    let (mut raw_sum, mut stored_sum) = (0u64, 0u64);
    let mut raw = Vec::new();
    for i in 0..taken {
        let j = (i as u128 * blocks as u128 / taken as u128) as u64;
        let begin = j * chunk;
        let end = (begin + chunk).min(total);
        let first = begin / sample_bytes;
        let last = end.div_ceil(sample_bytes);
        raw.clear();
        field.copy_samples(first, last - first, &mut raw)?;
        let skip = (begin - first * sample_bytes) as usize;
        let block = &raw[skip..skip + (end - begin) as usize];
        let encoded = encode_block(
            block,
            field.dtype.size_bytes(),
            CodecChoice::Lz4,
            options.shuffle,
        );
        raw_sum += block.len() as u64;
        stored_sum += encoded.stored.len() as u64;
    }
    Ok(
        if raw_sum > 0 && stored_sum <= raw_sum - raw_sum / MIN_SAVING_DIVISOR as u64 {
            CodecChoice::Lz4
        } else {
            CodecChoice::Raw
        },
    )
}

/// Raw bytes per block for a field: whole samples when a sample fits in a block, so that most samples
/// live in exactly one block; otherwise `block_bytes` pieces of the field's byte stream.
pub fn chunk_bytes(sample_bytes: u64, block_bytes: u32) -> u64 {
    let block_bytes = block_bytes as u64;
    if sample_bytes <= block_bytes {
        (block_bytes / sample_bytes) * sample_bytes
    } else {
        block_bytes
    }
}

/// Checks `fields` and `options` as packing does before it reads any sample (names, dimensions,
/// sample counts agreeing across fields, block size, shard size); returns the sample count.
pub fn check_inputs(fields: &[FieldSource], options: &PackOptions) -> Result<u64, PackError> {
    let invalid = |s: String| Err(PackError::Invalid(s));
    format::validate_dataset_name(&options.name).map_err(PackError::Invalid)?;
    if fields.is_empty() {
        return invalid("no fields to pack".into());
    }
    if fields.len() > FIELDS_MAX {
        return invalid(format!("{} fields; at most {FIELDS_MAX}", fields.len()));
    }
    if !options.block_bytes.is_power_of_two()
        || !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&options.block_bytes)
    {
        return invalid(format!(
            "block size {} is not a power of two in {BLOCK_BYTES_MIN}..={BLOCK_BYTES_MAX}",
            options.block_bytes
        ));
    }
    if options.threads == 0 {
        return invalid("threads must be at least 1".into());
    }
    for (index, field) in fields.iter().enumerate() {
        format::validate_field_name(&field.name).map_err(PackError::Invalid)?;
        if fields[..index].iter().any(|f| f.name == field.name) {
            return invalid(format!("field name '{}' is given twice", field.name));
        }
        if field.sample_shape.len() > SAMPLE_NDIM_MAX {
            return invalid(format!(
                "field '{}' has {} dimensions per sample; at most {SAMPLE_NDIM_MAX}",
                field.name,
                field.sample_shape.len()
            ));
        }
        if field.sample_count() != fields[0].sample_count() {
            return Err(PackError::SampleCountMismatch {
                field: field.name.clone(),
                paths: describe_paths(field),
                count: field.sample_count(),
                first_field: fields[0].name.clone(),
                first_count: fields[0].sample_count(),
            });
        }
    }
    let sample_count = fields[0].sample_count();
    if sample_count == 0 {
        return invalid("the inputs hold no samples".into());
    }
    Ok(sample_count)
}

fn describe_paths(field: &FieldSource) -> String {
    let paths: Vec<String> = field
        .paths()
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    if paths.is_empty() {
        "in memory".into()
    } else {
        paths.join(", ")
    }
}

/// Packs `fields` into a new dataset at `out`.
pub fn pack(
    out: &Path,
    fields: &[FieldSource],
    options: &PackOptions,
    observer: &dyn PackObserver,
) -> Result<PackSummary, PackError> {
    let sample_count = check_inputs(fields, options)?;
    let sample_bytes_all: u64 = fields.iter().map(|f| f.sample_bytes() as u64).sum();
    let samples_per_shard = match options.samples_per_shard {
        Some(0) => {
            return Err(PackError::Invalid(
                "samples per shard must be at least 1".into(),
            ))
        }
        Some(n) => n,
        None => (SHARD_RAW_BYTES_TARGET / sample_bytes_all).max(1),
    };
    for field in fields {
        let field_bytes = field.sample_bytes() as u64 * samples_per_shard.min(sample_count);
        let blocks = field_bytes.div_ceil(chunk_bytes(
            field.sample_bytes() as u64,
            options.block_bytes,
        ));
        if blocks > SHARD_BLOCKS_MAX as u64 / fields.len() as u64 {
            return Err(PackError::Invalid(format!(
                "field '{}' would need {blocks} blocks per shard; lower --samples-per-shard or raise --block-bytes",
                field.name
            )));
        }
    }
    // Checked before any work so that a refusal costs nothing; `commit` checks again, since the
    // destination may change while the pack runs.
    check_destination(out, options.on_existing)?;
    let codecs = fields
        .iter()
        .map(|field| field_codec(field, options))
        .collect::<Result<Vec<_>, _>>()?;
    remove_stale_staging(durable::parent_dir(out));
    let staging = staging_dir(out, STAGING_KIND)?;
    fs::create_dir(&staging).map_err(durable::on(&staging))?;
    // Held until the pack ends: a concurrent pack's cleaning never takes a live pack's staging.
    let _lock = match WriterLock::take(&staging) {
        Ok(lock) => lock,
        Err(error) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(error.into());
        }
    };
    let result = write_dataset(
        &staging,
        fields,
        &codecs,
        options,
        sample_count,
        samples_per_shard,
        observer,
    )
    .and_then(|summary| {
        // A cancel that arrives while the last block is written (or while a rate limit holds the
        // pack back) must win over the commit: a cancelled job never installs its dataset.
        if observer.cancelled() {
            return Err(PackError::Cancelled);
        }
        commit(&staging, out, options.on_existing).map(|()| summary)
    });
    match result {
        Ok(mut summary) => {
            summary.dir = out.to_path_buf();
            Ok(summary)
        }
        Err(error) => {
            // Best effort: the staging directory holds no manifest at the destination, so a leftover
            // is harmless, but it should not accumulate.
            let _ = fs::remove_dir_all(&staging);
            Err(error)
        }
    }
}

/// What a pack found at its destination.
#[derive(Debug, PartialEq, Eq)]
enum Destination {
    /// Nothing: the dataset is renamed into place.
    Absent,
    /// An empty directory (not a link), which rename(2) replaces atomically.
    EmptyDir,
    /// A gpufeed dataset: a directory holding a valid manifest and only the shards it names.
    Dataset,
    /// Anything else, described for the error message; never replaced.
    Other(String),
}

/// Classifies what is at `out` without following a symbolic link there: a link is never replaced,
/// since renaming over it would change the user's layout rather than the dataset it points to.
fn examine_destination(out: &Path) -> Result<Destination, PackError> {
    let metadata = match fs::symlink_metadata(out) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Destination::Absent),
        Err(source) => {
            return Err(PackError::Io {
                path: out.to_path_buf(),
                source,
            })
        }
    };
    let file_type = metadata.file_type();
    if file_type.is_symlink() {
        return Ok(Destination::Other(
            "is a symbolic link, not a dataset directory".into(),
        ));
    }
    if !file_type.is_dir() {
        let what = if file_type.is_file() {
            "is not a directory but a regular file"
        } else {
            "is not a directory but a special file"
        };
        return Ok(Destination::Other(what.into()));
    }
    let io = |source| PackError::Io {
        path: out.to_path_buf(),
        source,
    };
    let mut names = Vec::new();
    for entry in fs::read_dir(out).map_err(io)? {
        names.push(entry.map_err(io)?.file_name());
    }
    if names.is_empty() {
        return Ok(Destination::EmptyDir);
    }
    if !names.iter().any(|n| n.as_os_str() == MANIFEST_FILE_NAME) {
        return Ok(Destination::Other(format!(
            "is a non-empty directory but not a gpufeed dataset (no {MANIFEST_FILE_NAME})"
        )));
    }
    let manifest = match Manifest::load(out) {
        Ok(manifest) => manifest,
        Err(error) => {
            return Ok(Destination::Other(format!(
                "is a directory but not a gpufeed dataset: its {MANIFEST_FILE_NAME} is not a valid gpufeed manifest ({error})"
            )))
        }
    };
    // A file the manifest does not name is someone's data, not part of the dataset: replacing the
    // directory would delete it.
    let stranger = names.iter().find(|name| {
        name.as_os_str() != MANIFEST_FILE_NAME
            && !manifest
                .shards
                .iter()
                .any(|shard| name.as_os_str() == shard.file.as_str())
    });
    if let Some(stranger) = stranger {
        return Ok(Destination::Other(format!(
            "is a gpufeed dataset that also holds {:?}, which its manifest does not name",
            stranger
        )));
    }
    Ok(Destination::Dataset)
}

/// Fails unless a pack may write to `out` under `on_existing`; returns what is there.
fn check_destination(out: &Path, on_existing: OnExisting) -> Result<Destination, PackError> {
    let directory = durable::parent_dir(out);
    match fs::metadata(directory) {
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            return Err(PackError::MissingDirectory {
                path: out.to_path_buf(),
                directory: directory.to_path_buf(),
            })
        }
        Ok(metadata) if !metadata.is_dir() => {
            return Err(PackError::Io {
                path: directory.to_path_buf(),
                source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
            })
        }
        _ => {}
    }
    let destination = examine_destination(out)?;
    match (&destination, on_existing) {
        (Destination::Absent | Destination::EmptyDir, _)
        | (Destination::Dataset, OnExisting::Replace) => Ok(destination),
        (Destination::Dataset, OnExisting::Refuse) => Err(PackError::Exists {
            path: out.to_path_buf(),
        }),
        // Not suggesting --force here: it would not replace this either.
        (Destination::Other(reason), _) => Err(PackError::NotADataset {
            path: out.to_path_buf(),
            reason: reason.clone(),
        }),
    }
}

/// The kind in the name of a pack's staging directory, `.NAME.partial-PID-N`.
const STAGING_KIND: &str = "partial";

/// Removes from `dir` the staging directories of packs whose packer died (see
/// [`durable::remove_stale`]: never one whose packer still runs) and returns them. Run by every
/// pack for its destination's directory and by the daemon at start for its data root.
pub fn remove_stale_staging(dir: &Path) -> Vec<PathBuf> {
    durable::remove_stale(dir, STAGING_KIND)
}

/// A hidden name beside `out`: `.NAME.KIND-PID-N`.
fn staging_dir(out: &Path, kind: &str) -> Result<PathBuf, PackError> {
    durable::hidden_beside(out, kind).ok_or_else(|| {
        PackError::Invalid(format!("{}: not a usable directory name", out.display()))
    })
}

fn write_dataset(
    staging: &Path,
    fields: &[FieldSource],
    codecs: &[CodecChoice],
    options: &PackOptions,
    sample_count: u64,
    samples_per_shard: u64,
    observer: &dyn PackObserver,
) -> Result<PackSummary, PackError> {
    let raw_total: u64 = fields.iter().map(|f| f.sample_bytes() as u64).sum::<u64>() * sample_count;
    observer.started(raw_total);
    let mut progress = Progress {
        observer,
        raw_bytes_done: 0,
    };
    let mut manifest_shards = Vec::new();
    let mut stored_bytes = 0u64;
    let mut first_sample = 0u64;
    while first_sample < sample_count {
        let count = samples_per_shard.min(sample_count - first_sample);
        let file = format!("shard-{:06}.gfs", manifest_shards.len());
        let path = staging.join(&file);
        let written = write_shard(
            &path,
            fields,
            codecs,
            options,
            first_sample,
            count,
            &mut progress,
        )?;
        stored_bytes += written.stored_bytes;
        manifest_shards.push(ManifestShard {
            file,
            first_sample,
            sample_count: count,
            file_bytes: written.file_bytes,
            table_checksum: written.table_checksum,
        });
        first_sample += count;
    }
    let manifest = Manifest {
        name: options.name.clone(),
        sample_count,
        block_bytes: options.block_bytes,
        fields: fields
            .iter()
            .map(|f| ManifestField {
                name: f.name.clone(),
                dtype: f.dtype,
                shape: f.sample_shape.clone(),
            })
            .collect(),
        shards: manifest_shards,
    };
    let manifest_path = staging.join(MANIFEST_FILE_NAME);
    durable::write_synced(&manifest_path, manifest.to_json().as_bytes())?;
    durable::sync_dir(staging)?;
    Ok(PackSummary {
        dir: staging.to_path_buf(),
        sample_count,
        shard_count: manifest.shards.len(),
        raw_bytes: raw_total,
        stored_bytes,
    })
}

struct Progress<'a> {
    observer: &'a dyn PackObserver,
    raw_bytes_done: u64,
}

struct WrittenShard {
    file_bytes: u64,
    table_checksum: u64,
    stored_bytes: u64,
}

fn write_shard(
    path: &Path,
    fields: &[FieldSource],
    codecs: &[CodecChoice],
    options: &PackOptions,
    first_sample: u64,
    sample_count: u64,
    progress: &mut Progress<'_>,
) -> Result<WrittenShard, PackError> {
    let io = |source| PackError::Io {
        path: path.to_path_buf(),
        source,
    };
    let block_counts: Vec<u64> = fields
        .iter()
        .map(|f| {
            let sample_bytes = f.sample_bytes() as u64;
            (sample_bytes * sample_count).div_ceil(chunk_bytes(sample_bytes, options.block_bytes))
        })
        .collect();
    let block_total: u64 = block_counts.iter().sum();
    let payload_start = payload_offset(fields.len(), block_total as usize);

    let file = File::create(path).map_err(io)?;
    let mut writer = io::BufWriter::with_capacity(8 << 20, file);
    writer.seek(SeekFrom::Start(payload_start)).map_err(io)?;
    let mut position = payload_start;
    let mut table_fields = Vec::with_capacity(fields.len());
    let mut blocks: Vec<BlockEntry> = Vec::with_capacity(block_total as usize);
    let mut stored_bytes = 0u64;
    let mut raw = Vec::new();

    for (field_index, field) in fields.iter().enumerate() {
        let sample_bytes = field.sample_bytes() as u64;
        let field_bytes = sample_bytes * sample_count;
        let chunk = chunk_bytes(sample_bytes, options.block_bytes);
        table_fields.push(Field {
            name: field.name.clone(),
            dtype: field.dtype,
            shape: field.sample_shape.clone(),
            first_block: blocks.len() as u32,
            block_count: block_counts[field_index] as u32,
        });
        let mut raw_offset = 0u64;
        while raw_offset < field_bytes {
            if progress.observer.cancelled() {
                return Err(PackError::Cancelled);
            }
            let step_end = (raw_offset + chunk * BLOCKS_PER_STEP as u64).min(field_bytes);
            // Copy whole samples covering [raw_offset, step_end), then cut blocks out of them.
            let first = raw_offset / sample_bytes;
            let last = step_end.div_ceil(sample_bytes);
            raw.clear();
            field.copy_samples(first_sample + first, last - first, &mut raw)?;
            let skip = (raw_offset - first * sample_bytes) as usize;
            let step_raw = &raw[skip..skip + (step_end - raw_offset) as usize];
            let pieces: Vec<&[u8]> = step_raw.chunks(chunk as usize).collect();
            let encoded = encode_parallel(
                &pieces,
                field.dtype.size_bytes(),
                codecs[field_index],
                options,
            );
            for (piece, block) in pieces.iter().zip(encoded) {
                writer.write_all(&block.stored).map_err(io)?;
                let padded = format::align_up(block.stored.len() as u64);
                write_zeros(&mut writer, padded - block.stored.len() as u64).map_err(io)?;
                blocks.push(BlockEntry {
                    stored_offset: position,
                    stored_bytes: block.stored.len() as u32,
                    raw_bytes: piece.len() as u32,
                    codec: block.codec,
                    filter: block.filter,
                    field: field_index as u16,
                    raw_offset,
                    first_sample: first_sample + raw_offset / sample_bytes,
                    checksum: checksum(&block.stored),
                });
                stored_bytes += block.stored.len() as u64;
                position += padded;
                raw_offset += piece.len() as u64;
            }
            progress.raw_bytes_done += step_raw.len() as u64;
            progress.observer.progress(progress.raw_bytes_done);
        }
    }
    assert_eq!(blocks.len() as u64, block_total);
    assert_eq!(position % PAYLOAD_ALIGN_BYTES, 0);
    let metadata = encode_shard_metadata(
        first_sample,
        sample_count,
        options.block_bytes,
        &table_fields,
        &blocks,
    );
    assert_eq!(metadata.len() as u64, payload_start);
    writer.seek(SeekFrom::Start(0)).map_err(io)?;
    writer.write_all(&metadata).map_err(io)?;
    let file = writer.into_inner().map_err(|e| io(e.into_error()))?;
    // A shard whose last block is shorter than its padding must still have its full padded length.
    file.set_len(position).map_err(io)?;
    file.sync_all().map_err(io)?;
    let at = table_checksum_at(&table_fields, &blocks);
    let table_checksum = u64::from_le_bytes(metadata[at..at + 8].try_into().expect("8 bytes"));
    Ok(WrittenShard {
        file_bytes: position,
        table_checksum,
        stored_bytes,
    })
}

fn table_checksum_at(fields: &[Field], blocks: &[BlockEntry]) -> usize {
    format::HEADER_BYTES
        + fields.len() * format::FIELD_ENTRY_BYTES
        + blocks.len() * format::BLOCK_ENTRY_BYTES
}

fn write_zeros(writer: &mut impl Write, mut count: u64) -> io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while count > 0 {
        let n = count.min(ZEROS.len() as u64) as usize;
        writer.write_all(&ZEROS[..n])?;
        count -= n as u64;
    }
    Ok(())
}

/// Encodes blocks on `options.threads` threads; results come back in input order.
fn encode_parallel(
    pieces: &[&[u8]],
    element_bytes: usize,
    codec: CodecChoice,
    options: &PackOptions,
) -> Vec<EncodedBlock> {
    let threads = options.threads.min(pieces.len()).max(1);
    if threads == 1 {
        return pieces
            .iter()
            .map(|p| encode_block(p, element_bytes, codec, options.shuffle))
            .collect();
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<EncodedBlock>>> = Mutex::new(vec![None; pieces.len()]);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= pieces.len() {
                    break;
                }
                let block = encode_block(pieces[index], element_bytes, codec, options.shuffle);
                results.lock().expect("no panics while holding the lock")[index] = Some(block);
            });
        }
    });
    results
        .into_inner()
        .expect("no panics while holding the lock")
        .into_iter()
        .map(|b| b.expect("every index was encoded"))
        .collect()
}

/// Moves the finished staging directory to `out`, replacing an existing one if asked.
fn commit(staging: &Path, out: &Path, on_existing: OnExisting) -> Result<(), PackError> {
    let mut retired = None;
    if check_destination(out, on_existing)? == Destination::Dataset {
        let old = staging_dir(out, "old")?;
        fs::rename(out, &old).map_err(durable::on(out))?;
        retired = Some(old);
    }
    // rename(2) replaces an empty directory atomically and fails on a non-empty one, so a concurrent
    // pack to the same destination cannot be silently overwritten here.
    if let Err(source) = fs::rename(staging, out) {
        if let Some(old) = &retired {
            let _ = fs::rename(old, out);
        }
        return Err(durable::on(out)(source).into());
    }
    durable::sync_dir(durable::parent_dir(out))?;
    if let Some(old) = retired {
        fs::remove_dir_all(&old).map_err(durable::on(&old))?;
    }
    Ok(())
}
