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

use std::collections::{BTreeMap, VecDeque};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Condvar, Mutex};

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
    /// Threads reading, encoding and writing blocks (at least 1).
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
    let mut stored = Vec::new();
    let (codec, filter) = encode_block_into(
        raw,
        element_bytes,
        codec,
        shuffle_choice,
        &mut stored,
        &mut BlockScratch::default(),
    );
    EncodedBlock {
        codec,
        filter,
        stored,
    }
}

/// Buffers that [`encode_block_into`] reuses from block to block on one thread.
#[derive(Default)]
struct BlockScratch {
    /// The byte-shuffled block.
    shuffled: Vec<u8>,
    /// The second of two compressions of a block, while the smaller is chosen.
    second: Vec<u8>,
}

/// Appends LZ4's compression of `input` to `out`.
fn compress_append(input: &[u8], out: &mut Vec<u8>) {
    let at = out.len();
    out.resize(
        at + lz4_flex::block::get_maximum_output_size(input.len()),
        0,
    );
    let written = lz4_flex::block::compress_into(input, &mut out[at..])
        .expect("the output has room for LZ4's largest expansion");
    out.truncate(at + written);
}

/// [`encode_block`] appending the stored bytes to `out` (whose earlier bytes it leaves alone):
/// the same bytes, codec and filter, without a buffer allocated per block.
fn encode_block_into(
    raw: &[u8],
    element_bytes: usize,
    codec: CodecChoice,
    shuffle_choice: ShuffleChoice,
    out: &mut Vec<u8>,
    scratch: &mut BlockScratch,
) -> (Codec, Filter) {
    let start = out.len();
    if codec == CodecChoice::Raw {
        out.extend_from_slice(raw);
        return (Codec::Raw, Filter::None);
    }
    let shuffle_possible = element_bytes > 1 && raw.len() % element_bytes == 0;
    let shuffled = |scratch: &mut BlockScratch| {
        scratch.shuffled.resize(raw.len(), 0);
        shuffle(raw, element_bytes, &mut scratch.shuffled);
    };
    let filter = match (shuffle_choice, shuffle_possible) {
        (ShuffleChoice::Off, _) | (_, false) => {
            compress_append(raw, out);
            Filter::None
        }
        (ShuffleChoice::On, true) => {
            shuffled(scratch);
            compress_append(&scratch.shuffled, out);
            Filter::ByteShuffle
        }
        (ShuffleChoice::Auto, true) => {
            compress_append(raw, out);
            let plain = out.len() - start;
            let plain_saves = plain < raw.len() - raw.len() / MIN_SAVING_DIVISOR as usize;
            // When the codec may store the block raw and plain LZ4 did not save enough, shuffle and
            // compress a probe of the block first: data that LZ4 cannot shrink either way (fp16
            // weights, embeddings) then costs one full compression instead of two.
            let worth_trying = codec != CodecChoice::Auto
                || plain_saves
                || shuffled_probe_saves(raw, element_bytes);
            if worth_trying {
                shuffled(scratch);
                scratch.second.clear();
                compress_append(&scratch.shuffled, &mut scratch.second);
            }
            if worth_trying && scratch.second.len() < plain {
                out.truncate(start);
                out.extend_from_slice(&scratch.second);
                Filter::ByteShuffle
            } else {
                Filter::None
            }
        }
    };
    let stored = (out.len() - start) as u64;
    let saves_enough = stored <= raw.len() as u64 - raw.len() as u64 / MIN_SAVING_DIVISOR as u64;
    if codec == CodecChoice::Auto && !saves_enough {
        out.truncate(start);
        out.extend_from_slice(raw);
        return (Codec::Raw, Filter::None);
    }
    (Codec::Lz4, filter)
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
        raw.clear();
        field.copy_bytes(begin, end, &mut raw)?;
        let block = &raw[..];
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

/// Where a field's byte stream in one shard lies: of a variable-length field, its offsets
/// ([`format::OFFSET_BYTES`] a sample, relative to the shard's values) then its values; of a
/// fixed-shape field, its samples.
#[derive(Clone, Copy, Debug)]
struct ShardStream {
    /// Bytes of the offsets region at the start (0 for a fixed-shape field).
    offsets_bytes: u64,
    /// Bytes of the whole stream.
    total_bytes: u64,
    /// The field's row (of a variable-length field: element) that the shard's data starts at.
    first_row: u64,
}

impl ShardStream {
    /// Field `field`'s stream in the shard of samples `first_sample..first_sample + count`.
    fn of(field: &FieldSource, first_sample: u64, count: u64) -> ShardStream {
        let element_bytes = field.sample_bytes() as u64;
        match field.ends() {
            None => ShardStream {
                offsets_bytes: 0,
                total_bytes: element_bytes * count,
                first_row: first_sample,
            },
            Some(ends) => {
                let first_row = first_sample
                    .checked_sub(1)
                    .map_or(0, |previous| ends[previous as usize]);
                let last_row = ends[(first_sample + count - 1) as usize];
                let offsets_bytes = format::OFFSET_BYTES * count;
                ShardStream {
                    offsets_bytes,
                    total_bytes: offsets_bytes + (last_row - first_row) * element_bytes,
                    first_row,
                }
            }
        }
    }

    /// The block size of the region holding byte `at`: blocks never straddle the offsets and the
    /// values, whose elements differ in size.
    fn chunk(&self, field: &FieldSource, at: u64, block_bytes: u32) -> u64 {
        if at < self.offsets_bytes {
            chunk_bytes(format::OFFSET_BYTES, block_bytes)
        } else {
            chunk_bytes(field.sample_bytes() as u64, block_bytes)
        }
    }

    /// Blocks of the offsets region, and of the values region (or of the whole stream of a
    /// fixed-shape field).
    fn blocks(&self, field: &FieldSource, block_bytes: u32) -> (u64, u64) {
        let offsets = self
            .offsets_bytes
            .div_ceil(chunk_bytes(format::OFFSET_BYTES, block_bytes));
        let values = (self.total_bytes - self.offsets_bytes)
            .div_ceil(chunk_bytes(field.sample_bytes() as u64, block_bytes));
        (offsets, values)
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
        if field.samples() != fields[0].samples() {
            return Err(PackError::SampleCountMismatch {
                field: field.name.clone(),
                paths: describe_paths(field),
                count: field.samples(),
                first_field: fields[0].name.clone(),
                first_count: fields[0].samples(),
            });
        }
    }
    let sample_count = fields[0].samples();
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
    // A variable-length field counts its offset and its average sample.
    let sample_bytes_all: u64 = fields
        .iter()
        .map(|f| match f.is_variable() {
            false => f.sample_bytes() as u64,
            true => format::OFFSET_BYTES + f.total_bytes().div_ceil(sample_count),
        })
        .sum();
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
        // The shard with the most blocks (every shard's of a variable-length field).
        let shards = if field.is_variable() {
            sample_count.div_ceil(samples_per_shard)
        } else {
            1
        };
        let blocks = (0..shards)
            .map(|shard| {
                let first = shard * samples_per_shard;
                let count = samples_per_shard.min(sample_count - first);
                let (offsets, values) =
                    ShardStream::of(field, first, count).blocks(field, options.block_bytes);
                offsets + values
            })
            .max()
            .unwrap_or(0);
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
    let raw_total: u64 = fields
        .iter()
        .map(|f| ShardStream::of(f, 0, sample_count).total_bytes)
        .sum();
    observer.started(raw_total);
    let shard_count = sample_count.div_ceil(samples_per_shard);
    let packer = Packer {
        staging,
        fields,
        codecs,
        options,
        sample_count,
        samples_per_shard,
        shard_count,
        observer,
        shards_open_max: (options.threads as u64).clamp(1, SHARDS_OPEN_MAX),
        state: Mutex::new(PackState {
            cursors: VecDeque::new(),
            next_shard: 0,
            open: BTreeMap::new(),
            failed: None,
        }),
        placed: Condvar::new(),
        progress: Mutex::new(0),
    };
    let mut shards = vec![None; shard_count as usize];
    let (finished_tx, finished_rx) = mpsc::sync_channel(packer.shards_open_max as usize);
    std::thread::scope(|scope| {
        for _ in 0..options.threads.max(1) {
            let finished = finished_tx.clone();
            let packer = &packer;
            scope.spawn(move || packer.work(finished));
        }
        drop(finished_tx);
        // This thread syncs the shards that the others finish, so that no encoding waits on the
        // disk; it ends when they all have.
        for (index, shard) in finished_rx {
            match packer.finish_shard(index, shard) {
                Ok(entry) => shards[index as usize] = Some(entry),
                Err(error) => {
                    let mut state = packer
                        .state
                        .lock()
                        .expect("no panics while holding the lock");
                    packer.fail(&mut state, (index, u64::MAX), error);
                }
            }
        }
    });
    let state = packer
        .state
        .into_inner()
        .expect("no panics while holding the lock");
    if let Some((_, error)) = state.failed {
        return Err(error);
    }
    let mut manifest_shards = Vec::with_capacity(shard_count as usize);
    let mut stored_bytes = 0u64;
    for shard in shards {
        let (shard, stored) = shard.expect("every shard was written when no step failed");
        manifest_shards.push(shard);
        stored_bytes += stored;
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
                length_max: f.is_variable().then(|| f.length_max()),
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

/// Raw bytes of one field of one shard that a packing step covers at most (whole blocks, and at
/// least one): each of the packer's threads reads, encodes and writes one step at a time, so the
/// packer holds about `threads` steps of raw plus stored bytes (64 MiB on 8 threads), and a step is
/// one write of a few MiB.
const STEP_RAW_BYTES: u64 = 4 << 20;

/// Blocks of a packing step at most: progress is reported, and a pack job's rate limit applied,
/// step by step, so small blocks make small steps (1 MiB of 4 KiB blocks), as they did when the
/// packer encoded this many blocks at a time.
const STEP_BLOCKS_MAX: u64 = 256;

/// Shards whose steps are handed out at once, at most (and at most one per thread): each is an
/// open file.
const SHARDS_OPEN_MAX: u64 = 64;

/// Writes a dataset's shards on `options.threads` threads, and syncs them on the calling thread.
///
/// The work is cut into steps, a run of whole blocks of one field of one shard ([`STEP_RAW_BYTES`],
/// [`STEP_BLOCKS_MAX`]). Steps are handed
/// out from up to one shard per thread in turn, each shard's in the order its bytes go into it, so
/// that the threads mostly write different files: the kernel serialises buffered writes to one
/// file, and threads waiting their turn at one file spin on its lock. Each thread takes the next
/// step, copies its raw bytes from the input, encodes and checksums its blocks into one buffer laid
/// out as the shard stores them (every payload padded to [`PAYLOAD_ALIGN_BYTES`]), then waits for
/// the step before it in the same shard to have been given its place (handed out a turn earlier,
/// so it rarely waits), takes the place after it, writes its buffer there with one positional
/// write, and asks the kernel to start writing it to the disk. The thread that writes a shard's
/// last step hands the shard to the calling thread, which writes its metadata and syncs it while
/// the others go on. Nothing is serial but the placing of a step (a few additions under a lock):
/// reading, encoding, checksums, writes and syncs of several steps and shards overlap, so a pack
/// runs as fast as the cores encode or the disk writes, whichever is slower. Block order, offsets
/// and bytes are those of one thread writing the steps in order.
struct Packer<'a> {
    staging: &'a Path,
    fields: &'a [FieldSource],
    codecs: &'a [CodecChoice],
    options: &'a PackOptions,
    sample_count: u64,
    samples_per_shard: u64,
    shard_count: u64,
    observer: &'a dyn PackObserver,
    /// Shards whose steps are handed out at once, at most.
    shards_open_max: u64,
    state: Mutex<PackState>,
    /// Signalled when a step is placed, and when the pack fails.
    placed: Condvar,
    /// Raw bytes written so far; reported under this lock so that the observer sees them rise.
    progress: Mutex<u64>,
}

/// A shard whose steps are all written, for the syncing thread: its index and state.
type FinishedShard = (u64, OpenShard);

/// The packer's shared state.
struct PackState {
    /// Where the next step of each shard being handed out starts, in turn order.
    cursors: VecDeque<NextStep>,
    /// The next shard to start handing out.
    next_shard: u64,
    /// Shards with steps handed out and not all synced, by index: those being handed out (at most
    /// [`Packer::shards_open_max`]) and those whose last steps are being written.
    open: BTreeMap<u64, OpenShard>,
    /// The first failure in step order, with its step's (shard, seq): the error reported.
    failed: Option<((u64, u64), PackError)>,
}

/// Where the next step of a shard starts.
#[derive(Clone, Copy)]
struct NextStep {
    shard: u64,
    field: usize,
    /// Raw offset in the field's bytes of the shard.
    offset: u64,
    /// Index of the step in its shard.
    seq: u64,
}

/// One step: raw bytes `[begin, end)` of field `field` of shard `shard`, whole blocks.
struct Step {
    shard: u64,
    seq: u64,
    field: usize,
    begin: u64,
    end: u64,
    /// The shard's first sample.
    first_sample: u64,
    /// Where the field's stream lies in the shard.
    stream: ShardStream,
}

/// A shard being written.
struct OpenShard {
    path: PathBuf,
    file: Arc<File>,
    first_sample: u64,
    sample_count: u64,
    fields: Vec<Field>,
    /// Bytes of the shard's metadata, where its first payload starts.
    payload_start: u64,
    /// Where the next step placed goes: the shard's length so far.
    position: u64,
    /// Steps placed (given their position), which is the seq of the next to place.
    placed: u64,
    /// Steps written.
    written: u64,
    /// The shard's step count, once its last step is handed out.
    steps: Option<u64>,
    /// Block entries of the steps placed, in order.
    blocks: Vec<BlockEntry>,
    stored_bytes: u64,
}

/// A step's blocks as encoded, before the step is placed.
struct EncodedStep {
    /// The stored payloads back to back, each padded to [`PAYLOAD_ALIGN_BYTES`].
    bytes: Vec<u8>,
    /// Per block: offset in `bytes`, stored length, raw length, codec, filter, checksum.
    blocks: Vec<(u64, u32, u32, Codec, Filter, u64)>,
}

impl Packer<'_> {
    /// One thread's loop: steps until there are none left or the pack failed; each shard whose
    /// last step it writes goes to `finished`.
    fn work(&self, finished: mpsc::SyncSender<FinishedShard>) {
        let _stop = StopOnPanic(self);
        let mut raw = Vec::new();
        let mut encoded = EncodedStep {
            bytes: Vec::new(),
            blocks: Vec::new(),
        };
        let mut scratch = BlockScratch::default();
        loop {
            let step = {
                let mut state = self.state.lock().expect("no panics while holding the lock");
                if state.failed.is_some() {
                    return;
                }
                if self.observer.cancelled() {
                    // Reported after a failure of any step handed out before.
                    self.fail(&mut state, (u64::MAX, u64::MAX), PackError::Cancelled);
                    return;
                }
                match self.hand_out(&mut state) {
                    Ok(Some(step)) => step,
                    Ok(None) => return,
                    Err(error) => {
                        // The shard whose file could not be created.
                        let key = (state.next_shard, 0);
                        self.fail(&mut state, key, error);
                        return;
                    }
                }
            };
            let key = (step.shard, step.seq);
            let written = self
                .encode(&step, &mut raw, &mut encoded, &mut scratch)
                .and_then(|()| self.place_and_write(&step, &encoded));
            match written {
                Ok(Some(shard)) => {
                    if finished.send((step.shard, shard)).is_err() {
                        // The syncing thread is gone, which only a panic there does (the scope
                        // then panics too).
                        return;
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    let mut state = self.state.lock().expect("no panics while holding the lock");
                    self.fail(&mut state, key, error);
                    return;
                }
            }
        }
    }

    /// Records a failure (keeping the first in step order) and wakes the threads waiting to place
    /// a step, which then stop.
    fn fail(&self, state: &mut PackState, key: (u64, u64), error: PackError) {
        if state.failed.as_ref().is_none_or(|(at, _)| key < *at) {
            state.failed = Some((key, error));
        }
        self.placed.notify_all();
    }

    /// Hands out the next step (`None` when none is left): from a shard started now if fewer
    /// than [`Packer::shards_open_max`] are being handed out and one is left (creating its file),
    /// else from the shard whose turn it is. Fails if the file of the shard started cannot be
    /// created (`state.next_shard` is that shard).
    fn hand_out(&self, state: &mut PackState) -> Result<Option<Step>, PackError> {
        if (state.cursors.len() as u64) < self.shards_open_max
            && state.next_shard < self.shard_count
        {
            let index = state.next_shard;
            let first_sample = index * self.samples_per_shard;
            let count = self.samples_per_shard.min(self.sample_count - first_sample);
            let shard = self.open_shard(index, first_sample, count)?;
            state.open.insert(index, shard);
            state.next_shard += 1;
            // A shard's first step goes out at once, as its file exists.
            state.cursors.push_front(NextStep {
                shard: index,
                field: 0,
                offset: 0,
                seq: 0,
            });
        }
        let Some(next) = state.cursors.pop_front() else {
            return Ok(None);
        };
        let first_sample = next.shard * self.samples_per_shard;
        let count = self.samples_per_shard.min(self.sample_count - first_sample);
        let field = &self.fields[next.field];
        let stream = ShardStream::of(field, first_sample, count);
        let field_bytes = stream.total_bytes;
        let chunk = stream.chunk(field, next.offset, self.options.block_bytes);
        let region_end = if next.offset < stream.offsets_bytes {
            stream.offsets_bytes
        } else {
            field_bytes
        };
        let step_bytes = chunk * (STEP_RAW_BYTES / chunk).clamp(1, STEP_BLOCKS_MAX);
        let end = (next.offset + step_bytes).min(region_end);
        let step = Step {
            shard: next.shard,
            seq: next.seq,
            field: next.field,
            begin: next.offset,
            end,
            first_sample,
            stream,
        };
        if end < field_bytes {
            state.cursors.push_back(NextStep {
                offset: end,
                seq: next.seq + 1,
                ..next
            });
        } else if next.field + 1 < self.fields.len() {
            state.cursors.push_back(NextStep {
                field: next.field + 1,
                offset: 0,
                seq: next.seq + 1,
                ..next
            });
        } else {
            state
                .open
                .get_mut(&next.shard)
                .expect("the shard is open")
                .steps = Some(next.seq + 1);
        }
        Ok(Some(step))
    }

    /// Creates shard `index`'s file in the staging directory.
    fn open_shard(
        &self,
        index: u64,
        first_sample: u64,
        sample_count: u64,
    ) -> Result<OpenShard, PackError> {
        let path = self.staging.join(shard_file_name(index));
        let file = File::create(&path).map_err(|source| PackError::Io {
            path: path.clone(),
            source,
        })?;
        let mut fields = Vec::with_capacity(self.fields.len());
        let mut block_total = 0u64;
        for field in self.fields {
            let (offset_blocks, values_blocks) = ShardStream::of(field, first_sample, sample_count)
                .blocks(field, self.options.block_bytes);
            let blocks = offset_blocks + values_blocks;
            fields.push(Field {
                name: field.name.clone(),
                dtype: field.dtype,
                shape: field.sample_shape.clone(),
                first_block: block_total as u32,
                block_count: blocks as u32,
                offset_blocks: field.is_variable().then_some(offset_blocks as u32),
            });
            block_total += blocks;
        }
        let payload_start = payload_offset(self.fields.len(), block_total as usize);
        Ok(OpenShard {
            path,
            file: Arc::new(file),
            first_sample,
            sample_count,
            fields,
            payload_start,
            position: payload_start,
            placed: 0,
            written: 0,
            steps: None,
            blocks: Vec::with_capacity(block_total as usize),
            stored_bytes: 0,
        })
    }

    /// Copies a step's raw bytes and encodes its blocks into `encoded`.
    fn encode(
        &self,
        step: &Step,
        raw: &mut Vec<u8>,
        encoded: &mut EncodedStep,
        scratch: &mut BlockScratch,
    ) -> Result<(), PackError> {
        let field = &self.fields[step.field];
        let sample_bytes = field.sample_bytes() as u64;
        let stream = step.stream;
        let chunk = stream.chunk(field, step.begin, self.options.block_bytes) as usize;
        encoded.bytes.clear();
        encoded.blocks.clear();
        if step.begin < stream.offsets_bytes {
            // A variable-length field's offsets, relative to the shard's first value.
            raw.clear();
            let ends = field
                .ends()
                .expect("only variable-length fields have offsets");
            let first = step.first_sample + step.begin / format::OFFSET_BYTES;
            let last = step.first_sample + step.end / format::OFFSET_BYTES;
            for &end in &ends[first as usize..last as usize] {
                raw.extend_from_slice(&(end - stream.first_row).to_le_bytes());
            }
            self.encode_pieces(step, raw, chunk, encoded, scratch);
            return Ok(());
        }
        // The step's bytes in the field's (its values', past the offsets region).
        let begin = stream.first_row * sample_bytes + (step.begin - stream.offsets_bytes);
        let end = begin + (step.end - step.begin);
        field.advise(begin, end);
        if self.codecs[step.field] == CodecChoice::Raw && chunk as u64 % PAYLOAD_ALIGN_BYTES == 0 {
            // Raw blocks of whole pages lie back to back as stored, only the step's last one
            // padded: copied from the input straight to where they are written.
            field.copy_bytes(begin, end, &mut encoded.bytes)?;
            let mut at = 0;
            while at < encoded.bytes.len() {
                let len = chunk.min(encoded.bytes.len() - at);
                let block_checksum = checksum(&encoded.bytes[at..at + len]);
                encoded.blocks.push((
                    at as u64,
                    len as u32,
                    len as u32,
                    Codec::Raw,
                    Filter::None,
                    block_checksum,
                ));
                at += len;
            }
            let padded = format::align_up(encoded.bytes.len() as u64) as usize;
            encoded.bytes.resize(padded, 0);
            return Ok(());
        }
        raw.clear();
        field.copy_bytes(begin, end, raw)?;
        self.encode_pieces(step, raw, chunk, encoded, scratch);
        Ok(())
    }

    /// Encodes `raw` (a step's bytes) as blocks of `chunk` bytes into `encoded`.
    fn encode_pieces(
        &self,
        step: &Step,
        raw: &[u8],
        chunk: usize,
        encoded: &mut EncodedStep,
        scratch: &mut BlockScratch,
    ) {
        let field = &self.fields[step.field];
        for piece in raw.chunks(chunk) {
            let at = encoded.bytes.len();
            let (codec, filter) = encode_block_into(
                piece,
                field.dtype.size_bytes(),
                self.codecs[step.field],
                self.options.shuffle,
                &mut encoded.bytes,
                scratch,
            );
            let stored = encoded.bytes.len() - at;
            let block_checksum = checksum(&encoded.bytes[at..]);
            let padded = format::align_up(stored as u64) as usize;
            encoded.bytes.resize(at + padded, 0);
            encoded.blocks.push((
                at as u64,
                stored as u32,
                piece.len() as u32,
                codec,
                filter,
                block_checksum,
            ));
        }
    }

    /// Waits for the step before `step` in its shard to be placed, places `step` after it, writes
    /// it and reports progress; returns the shard if this was its last step written.
    fn place_and_write(
        &self,
        step: &Step,
        encoded: &EncodedStep,
    ) -> Result<Option<OpenShard>, PackError> {
        let field = &self.fields[step.field];
        let sample_bytes = field.sample_bytes() as u64;
        let stream = step.stream;
        // The sample holding a block's first byte.
        let block_first_sample = |raw_offset: u64| match field.ends() {
            None => step.first_sample + raw_offset / sample_bytes,
            Some(_) if raw_offset < stream.offsets_bytes => {
                step.first_sample + raw_offset / format::OFFSET_BYTES
            }
            Some(ends) => {
                let row = stream.first_row + (raw_offset - stream.offsets_bytes) / sample_bytes;
                ends.partition_point(|&end| end <= row) as u64
            }
        };
        let (file, path, at) = {
            let mut state = self.state.lock().expect("no panics while holding the lock");
            loop {
                if state.failed.is_some() {
                    // Another step failed: this one's result no longer matters.
                    return Ok(None);
                }
                let shard = state.open.get(&step.shard).expect("the shard is open");
                if shard.placed == step.seq {
                    break;
                }
                state = self
                    .placed
                    .wait(state)
                    .expect("no panics while holding the lock");
            }
            let shard = state.open.get_mut(&step.shard).expect("the shard is open");
            let at = shard.position;
            let mut raw_offset = step.begin;
            for &(offset, stored, raw, codec, filter, block_checksum) in &encoded.blocks {
                shard.blocks.push(BlockEntry {
                    stored_offset: at + offset,
                    stored_bytes: stored,
                    raw_bytes: raw,
                    codec,
                    filter,
                    field: step.field as u16,
                    raw_offset,
                    first_sample: block_first_sample(raw_offset),
                    checksum: block_checksum,
                });
                shard.stored_bytes += stored as u64;
                raw_offset += raw as u64;
            }
            shard.position += encoded.bytes.len() as u64;
            shard.placed += 1;
            self.placed.notify_all();
            (shard.file.clone(), shard.path.clone(), at)
        };
        file.write_all_at(&encoded.bytes, at)
            .map_err(|source| PackError::Io { path, source })?;
        start_writeback(&file, at, encoded.bytes.len() as u64);
        {
            // Reporting and asking whether to cancel are one step under this lock: once a report
            // cancels the pack, no later step reports (as when one thread wrote the steps in
            // order), whatever other threads had under way.
            let mut done = self
                .progress
                .lock()
                .expect("no panics while holding the lock");
            let mut state = self.state.lock().expect("no panics while holding the lock");
            if state.failed.is_some() {
                return Ok(None);
            }
            drop(state);
            *done += step.end - step.begin;
            self.observer.progress(*done);
            if self.observer.cancelled() {
                state = self.state.lock().expect("no panics while holding the lock");
                self.fail(&mut state, (u64::MAX, u64::MAX), PackError::Cancelled);
                return Ok(None);
            }
        }
        let mut state = self.state.lock().expect("no panics while holding the lock");
        let shard = state.open.get_mut(&step.shard).expect("the shard is open");
        shard.written += 1;
        Ok(if Some(shard.written) == shard.steps {
            state.open.remove(&step.shard)
        } else {
            None
        })
    }

    /// Writes a shard's metadata once all its payloads are written, then syncs it.
    fn finish_shard(
        &self,
        index: u64,
        shard: OpenShard,
    ) -> Result<(ManifestShard, u64), PackError> {
        let io = |source| PackError::Io {
            path: shard.path.clone(),
            source,
        };
        let block_total: u32 = shard.fields.iter().map(|f| f.block_count).sum();
        assert_eq!(shard.blocks.len(), block_total as usize);
        assert_eq!(shard.position % PAYLOAD_ALIGN_BYTES, 0);
        let metadata = encode_shard_metadata(
            shard.first_sample,
            shard.sample_count,
            self.options.block_bytes,
            &shard.fields,
            &shard.blocks,
        );
        assert_eq!(metadata.len() as u64, shard.payload_start);
        shard.file.write_all_at(&metadata, 0).map_err(io)?;
        // Every step is written padded, so the file has its full length already unless a write
        // fell short; this makes sure of it.
        shard.file.set_len(shard.position).map_err(io)?;
        shard.file.sync_all().map_err(io)?;
        let at = table_checksum_at(&shard.fields, &shard.blocks);
        let table_checksum = u64::from_le_bytes(metadata[at..at + 8].try_into().expect("8 bytes"));
        Ok((
            ManifestShard {
                file: shard_file_name(index),
                first_sample: shard.first_sample,
                sample_count: shard.sample_count,
                file_bytes: shard.position,
                table_checksum,
            },
            shard.stored_bytes,
        ))
    }
}

/// Stops the other packing threads if the one holding it panics, so that none waits forever for a
/// step that this one would have placed; the panic then reaches the caller through the thread scope.
struct StopOnPanic<'a, 'b>(&'a Packer<'b>);

impl Drop for StopOnPanic<'_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut state = self
                .0
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let error = PackError::Invalid("a packing thread panicked".into());
            self.0.fail(&mut state, (0, 0), error);
        }
    }
}

/// The file name of shard `index` of a dataset.
fn shard_file_name(index: u64) -> String {
    format!("shard-{index:06}.gfs")
}

/// Asks the kernel to start writing `len` bytes of `file` at `offset` to the disk now, without
/// waiting for it (`sync_file_range` with `SYNC_FILE_RANGE_WRITE`): the disk then writes while the
/// pack goes on, rather than only once the page cache holds enough dirty pages or at the shard's
/// sync. Best effort: it makes nothing durable (the shard's `fsync` does), and where a file system
/// does not support it the bytes are just written later.
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a system call on a file descriptor that `file` keeps open; it reads and writes no
    // memory of this process.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

fn table_checksum_at(fields: &[Field], blocks: &[BlockEntry]) -> usize {
    format::HEADER_BYTES
        + fields.len() * format::FIELD_ENTRY_BYTES
        + blocks.len() * format::BLOCK_ENTRY_BYTES
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
