//! Batch assembly on the CPU backend: read the blocks a batch needs, decode them, gather and convert
//! each sample into the slot.
//!
//! The same plan ([`StreamPlan`]) drives the GPU backend (`pipeline::gpu`), where reads land in device
//! memory and the kernels decode and gather; only [`Assembler`] is CPU-specific.

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use gpufeed_proto::spec::{self, FIELD_OFFSET_ALIGN_BYTES};
use gpufeed_proto::DType;

use super::block_cache::{self, BlockCache, CacheHandle, CachedBlock, DecodedBlock};
use super::order::{EpochOrder, RankPlan, ShuffleMode, Tail};
use crate::decode::{self, BlockRef};
use crate::device::DeviceError;
use crate::format::{Codec, Dataset};
use crate::kernels::Lz4Status;
use crate::metrics::{Metrics, ReadPath};
use crate::storage::gpu::GpuReadError;
use crate::storage::residency::ResidencyMap;
use crate::storage::{
    AlignedBuffer, AnyQueue, DirectIo, EngineLimits, Extent, FileId, FileTable, ReadEngine,
    StorageError, IO_ALIGN_BYTES,
};

/// Bounds applied to every stream.
#[derive(Clone, Copy, Debug)]
pub struct StreamLimits {
    /// Largest batch size.
    pub batch_size_max: u32,
    /// Largest world size.
    pub world_size_max: u32,
    /// Largest slot in bytes.
    pub slot_bytes_max: u64,
    /// Decoded blocks kept per stream, in bytes (a batch that needs more still decodes, then the cache
    /// shrinks back).
    pub cache_bytes_max: usize,
    /// Reads in flight per stream.
    pub queue_depth: usize,
    /// Threads decoding the blocks of one batch on the CPU backend.
    pub decode_threads: usize,
    /// Slot bytes a stream of small batches gets in flight: a stream has `prefetch` slots, or more,
    /// up to `PREFETCH_MAX` (64), while they fit in this many bytes, so that a consumer of small batches is
    /// not held up by a round trip per few kilobytes.
    pub ring_bytes: u64,
}

/// The default [`StreamLimits::ring_bytes`]: 32 MiB, 64 slots of batches up to 512 KiB, 16 of 2 MiB.
pub const RING_BYTES_DEFAULT: u64 = 32 << 20;

/// Slots of a stream: the requested `prefetch`, raised while `slot_bytes` more still fit in
/// `ring_bytes`, at most [`spec::PREFETCH_MAX`] and no more than the stream's `steps` (a slot that
/// could never be filled is memory for nothing).
pub fn slot_count(prefetch: u32, slot_bytes: usize, ring_bytes: u64, steps: u64) -> u32 {
    let by_bytes = (ring_bytes / slot_bytes.max(1) as u64)
        .min(u64::from(spec::PREFETCH_MAX))
        .min(steps) as u32;
    prefetch.max(by_bytes)
}

impl StreamLimits {
    /// Bounds suited to a training node: batches up to 1 Mi samples and 1 GiB a slot.
    pub fn node_defaults() -> StreamLimits {
        StreamLimits {
            batch_size_max: 1 << 20,
            world_size_max: 1 << 16,
            slot_bytes_max: 1 << 30,
            cache_bytes_max: 256 << 20,
            queue_depth: 64,
            decode_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8),
            ring_bytes: RING_BYTES_DEFAULT,
        }
    }
}

/// What a stream asks for, in the pipeline's terms. The socket server converts the consumer's wire
/// request into it (`ipc`), so that the pipeline knows nothing of the wire format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamRequest {
    /// The fields to deliver, in slot order; empty for every field of the dataset in its order.
    pub fields: Vec<FieldSelection>,
    /// Samples per batch.
    pub batch_size: u32,
    /// Ranks sharing the epoch.
    pub world_size: u32,
    /// This stream's rank.
    pub rank: u32,
    /// Seed of the epoch's order.
    pub seed: u64,
    /// The epoch.
    pub epoch: u64,
    /// Position in the global order to start at (resume).
    pub start_cursor: u64,
    /// The order of the epoch.
    pub shuffle: ShuffleMode,
    /// What happens to the samples that do not fill a last step.
    pub tail: Tail,
    /// Slots in the stream's ring: how many batches may be filled ahead of the consumer.
    pub prefetch: u32,
    /// What to do with a sample whose block is corrupt.
    pub on_corrupt: CorruptPolicy,
    /// Where the slots live.
    pub device: StreamDevice,
}

/// One field a stream asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldSelection {
    /// The field's name in the dataset.
    pub name: String,
    /// The dtype to deliver; `None` for the stored one.
    pub dtype: Option<DType>,
}

/// What to do with a sample whose block turns out corrupt while a stream is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorruptPolicy {
    /// End the stream with an error naming the block.
    Fail,
    /// Deliver an all-zero sample instead, counted in the batch's report.
    Replace,
}

/// Where a stream's slots live, which decides the backend that fills them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamDevice {
    /// Host memory, filled by the CPU backend.
    Host,
    /// Memory of this CUDA device, filled by the GPU backend.
    Cuda(u32),
}

/// A stream request that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The request breaks a rule or a bound; the message names the field of the request.
    #[error("{0}")]
    Invalid(String),
}

impl PlanError {
    fn spec(error: spec::SpecError) -> PlanError {
        PlanError::Invalid(error.0)
    }
}

/// Where one field goes in a slot.
#[derive(Clone, Debug)]
pub struct FieldPlan {
    /// Index of the field in the dataset.
    pub field_index: usize,
    /// Field name.
    pub name: String,
    /// Stored dtype.
    pub stored: DType,
    /// Delivered dtype.
    pub out: DType,
    /// Per-sample shape.
    pub sample_shape: Vec<u64>,
    /// Stored bytes per sample.
    pub sample_bytes_in: usize,
    /// Delivered bytes per sample.
    pub sample_bytes_out: usize,
    /// Offset of the field's batch within a slot.
    pub offset: usize,
}

/// Everything a stream needs to produce its batches: validated request, order, geometry.
#[derive(Debug)]
pub struct StreamPlan {
    /// The dataset.
    pub dataset: Arc<Dataset>,
    /// The epoch.
    pub epoch: u64,
    /// Global order of the epoch.
    pub order: EpochOrder,
    /// This rank's share.
    pub rank: RankPlan,
    /// Start position in the global order.
    pub start_cursor: u64,
    /// Batches this stream will produce.
    pub steps: u64,
    /// Fields in slot order.
    pub fields: Vec<FieldPlan>,
    /// Bytes of one slot.
    pub slot_bytes: usize,
    /// Slots in the stream's ring.
    pub slot_count: u32,
    /// What to do with corrupt blocks.
    pub on_corrupt: CorruptPolicy,
}

impl StreamPlan {
    /// Validates `spec` against `dataset` and `limits`.
    pub fn new(
        dataset: Arc<Dataset>,
        spec: &StreamRequest,
        limits: &StreamLimits,
    ) -> Result<StreamPlan, PlanError> {
        let invalid = |s: String| Err(PlanError::Invalid(s));
        // The spec's own rules (shared with the client and the socket server), then the daemon's
        // limits.
        spec::check_batch_size(spec.batch_size).map_err(PlanError::spec)?;
        spec::check_rank(spec.rank, spec.world_size).map_err(PlanError::spec)?;
        spec::check_prefetch(spec.prefetch).map_err(PlanError::spec)?;
        if let ShuffleMode::Window { shards } = spec.shuffle {
            spec::check_window_shards(shards).map_err(PlanError::spec)?;
        }
        if spec.batch_size > limits.batch_size_max {
            return invalid(format!(
                "batch_size {} is above the daemon's limit of {}",
                spec.batch_size, limits.batch_size_max
            ));
        }
        if spec.world_size > limits.world_size_max {
            return invalid(format!(
                "world_size {} is above the daemon's limit of {}",
                spec.world_size, limits.world_size_max
            ));
        }
        let manifest = &dataset.manifest;
        let sample_count = manifest.sample_count;
        if spec.start_cursor > sample_count {
            return invalid(format!(
                "start cursor {} is past the epoch's {sample_count} samples",
                spec.start_cursor
            ));
        }
        let mode = spec.shuffle;
        let requested: Vec<(usize, Option<DType>)> = if spec.fields.is_empty() {
            (0..manifest.fields.len()).map(|i| (i, None)).collect()
        } else {
            let mut out = Vec::with_capacity(spec.fields.len());
            for request in &spec.fields {
                let Some(index) = dataset.field_index(&request.name) else {
                    let names: Vec<&str> =
                        manifest.fields.iter().map(|f| f.name.as_str()).collect();
                    return invalid(format!(
                        "dataset '{}' has no field '{}' (fields: {})",
                        manifest.name,
                        request.name,
                        names.join(", ")
                    ));
                };
                if out.iter().any(|&(i, _)| i == index) {
                    return invalid(format!("field '{}' is requested twice", request.name));
                }
                out.push((index, request.dtype));
            }
            out
        };
        let mut fields = Vec::with_capacity(requested.len());
        let mut offset = 0u64;
        for (index, dtype) in requested {
            let field = &manifest.fields[index];
            let out = dtype.unwrap_or(field.dtype);
            if !decode::convert_supported(field.dtype, out) {
                return invalid(format!(
                    "field '{}': cannot convert {} to {out}",
                    field.name, field.dtype
                ));
            }
            let elements: u64 = field.shape.iter().product();
            let sample_bytes_out = elements * out.size_bytes() as u64;
            let batch_bytes = sample_bytes_out * spec.batch_size as u64;
            fields.push(FieldPlan {
                field_index: index,
                name: field.name.clone(),
                stored: field.dtype,
                out,
                sample_shape: field.shape.clone(),
                sample_bytes_in: field.sample_bytes() as usize,
                sample_bytes_out: sample_bytes_out as usize,
                offset: offset as usize,
            });
            offset = (offset + batch_bytes).div_ceil(FIELD_OFFSET_ALIGN_BYTES)
                * FIELD_OFFSET_ALIGN_BYTES;
            if offset > limits.slot_bytes_max {
                return invalid(format!(
                    "a batch of {} samples needs more than the {}-byte slot limit",
                    spec.batch_size, limits.slot_bytes_max
                ));
            }
        }
        let rank = RankPlan {
            world_size: spec.world_size,
            rank: spec.rank,
            batch_size: spec.batch_size,
            tail: spec.tail,
        };
        if spec.start_cursor == 0 && rank.tail == Tail::Drop && rank.step_samples() > sample_count {
            // Nothing would be served: say so rather than end the epoch at once, silently.
            return invalid(format!(
                "batch_size {} x world_size {} is more than the dataset's {sample_count} samples: \
                 with tail drop no batch would be served (lower the batch size, or use tail pad)",
                spec.batch_size, spec.world_size
            ));
        }
        let shard_samples: Vec<u64> = manifest.shards.iter().map(|s| s.sample_count).collect();
        let order = EpochOrder::new(&shard_samples, spec.seed, spec.epoch, mode);
        let steps = rank.steps_from(sample_count, spec.start_cursor);
        Ok(StreamPlan {
            epoch: spec.epoch,
            steps,
            order,
            rank,
            start_cursor: spec.start_cursor,
            fields,
            slot_bytes: offset.max(FIELD_OFFSET_ALIGN_BYTES) as usize,
            slot_count: slot_count(
                spec.prefetch,
                offset.max(FIELD_OFFSET_ALIGN_BYTES) as usize,
                limits.ring_bytes,
                steps,
            ),
            on_corrupt: spec.on_corrupt,
            dataset,
        })
    }

    /// The global-order cursor once step `step` (counted from the stream's start) is consumed.
    pub fn cursor_after(&self, step: u64) -> u64 {
        (self.start_cursor + (step + 1) * self.rank.step_samples()).min(self.order.len())
    }

    /// The epoch step number of stream step `step`.
    pub fn epoch_step(&self, step: u64) -> u64 {
        self.start_cursor / self.rank.step_samples() + step
    }

    /// The samples of stream step `step` for this rank.
    pub fn batch_samples(&self, step: u64) -> impl Iterator<Item = u64> + '_ {
        self.rank
            .batch_positions(self.order.len(), self.start_cursor, step)
            .map(|position| self.order.sample_at(position))
    }

    /// Where every (sample, field) of stream step `step` lives, row by row (`fields.len()` entries
    /// per sample, in field order).
    pub fn placements(&self, step: u64) -> Vec<Placement> {
        let samples: Vec<u64> = self.batch_samples(step).collect();
        samples
            .iter()
            .flat_map(|&sample| self.fields.iter().map(move |field| (sample, field)))
            .map(|(sample, field)| {
                let (shard, start, end) = self.locate(sample, field.field_index);
                let blocks = self.blocks_for(shard, field.field_index, start, end);
                Placement {
                    shard,
                    start,
                    end,
                    blocks,
                }
            })
            .collect()
    }

    /// The rows of stream step `step` grouped into runs: consecutive rows whose samples are consecutive
    /// in one shard, at most `run_out_bytes_max` delivered bytes per field (at least one row). A run's
    /// bytes are contiguous in each field's stream and in the slot, so it is read, checked and gathered
    /// like one large sample. Without shuffling a batch is a few runs; fully shuffled, one run per row.
    pub fn placement_runs(&self, step: u64, run_out_bytes_max: usize) -> PlacementRuns {
        let widest = self
            .fields
            .iter()
            .map(|f| f.sample_bytes_out)
            .max()
            .unwrap_or(1)
            .max(1);
        let rows_max = (run_out_bytes_max / widest).max(1);
        let shards = &self.dataset.manifest.shards;
        // (first row, rows, first sample, shard)
        let mut spans: Vec<(usize, usize, u64, usize)> = Vec::new();
        for (row, sample) in self.batch_samples(step).enumerate() {
            if let Some(last) = spans.last_mut() {
                let shard = &shards[last.3];
                if sample == last.2 + last.1 as u64
                    && sample < shard.first_sample + shard.sample_count
                    && last.1 < rows_max
                {
                    last.1 += 1;
                    continue;
                }
            }
            let shard = shards.partition_point(|s| s.first_sample + s.sample_count <= sample);
            spans.push((row, 1, sample, shard));
        }
        let mut hints: Vec<(usize, u32)> = vec![(usize::MAX, 0); self.fields.len()];
        let mut placements = Vec::with_capacity(spans.len() * self.fields.len());
        for &(_, rows, sample, _) in &spans {
            for (field, hint) in self.fields.iter().zip(hints.iter_mut()) {
                let (shard, start, end) = self.locate(sample, field.field_index);
                let end = end + (rows as u64 - 1) * (end - start);
                let blocks = self.blocks_for_hinted(shard, field.field_index, start, end, hint);
                placements.push(Placement {
                    shard,
                    start,
                    end,
                    blocks,
                });
            }
        }
        PlacementRuns {
            runs: spans
                .iter()
                .map(|&(first, rows, ..)| (first, rows))
                .collect(),
            placements,
        }
    }

    /// As [`Self::blocks_for`], trying first the block where the previous range of the same field
    /// ended (`hint`: shard and block), which is where consecutive ranges usually start.
    fn blocks_for_hinted(
        &self,
        shard: usize,
        field: usize,
        start: u64,
        end: u64,
        hint: &mut (usize, u32),
    ) -> std::ops::Range<u32> {
        let blocks = self.dataset.shards[shard].metadata.field_blocks(field);
        let covers = |i: usize| {
            blocks
                .get(i)
                .is_some_and(|b| b.raw_offset <= start && start < b.raw_offset + b.raw_bytes as u64)
        };
        let first = if hint.0 == shard && covers(hint.1 as usize) {
            hint.1 as usize
        } else if hint.0 == shard && covers(hint.1 as usize + 1) {
            hint.1 as usize + 1
        } else {
            return {
                let range = self.blocks_for(shard, field, start, end);
                *hint = (shard, range.end.saturating_sub(1));
                range
            };
        };
        let mut last = first;
        while last < blocks.len() && blocks[last].raw_offset < end {
            last += 1;
        }
        *hint = (shard, (last.max(first + 1) - 1) as u32);
        first as u32..last as u32
    }

    /// Locates `sample` of dataset field `field`: the shard and the byte range within the field's
    /// stream in that shard.
    pub(crate) fn locate(&self, sample: u64, field: usize) -> (usize, u64, u64) {
        let shards = &self.dataset.manifest.shards;
        let shard = shards.partition_point(|s| s.first_sample + s.sample_count <= sample);
        let local = sample - shards[shard].first_sample;
        let sample_bytes = self.dataset.manifest.fields[field].sample_bytes();
        (shard, local * sample_bytes, (local + 1) * sample_bytes)
    }

    /// The blocks of `shard`/`field` overlapping raw bytes `start..end`, as indices within the field.
    pub(crate) fn blocks_for(
        &self,
        shard: usize,
        field: usize,
        start: u64,
        end: u64,
    ) -> std::ops::Range<u32> {
        let blocks = self.dataset.shards[shard].metadata.field_blocks(field);
        // Blocks of a field hold the same raw size but the last, so the first block is found by a
        // division: one look-up instead of a binary search whose steps miss the cache when rows are
        // shuffled over a large block table.
        if let Some(size) = blocks
            .first()
            .map(|b| b.raw_bytes as u64)
            .filter(|&s| s > 0)
        {
            let guess = (start / size) as usize;
            if blocks
                .get(guess)
                .is_some_and(|b| b.raw_offset <= start && start < b.raw_offset + b.raw_bytes as u64)
            {
                let mut last = guess + 1;
                while last < blocks.len() && blocks[last].raw_offset < end {
                    last += 1;
                }
                return guess as u32..last as u32;
            }
        }
        let first = blocks.partition_point(|b| b.raw_offset + b.raw_bytes as u64 <= start);
        let last = blocks.partition_point(|b| b.raw_offset < end);
        first as u32..last as u32
    }
}

/// A batch's rows grouped into runs (see [`StreamPlan::placement_runs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementRuns {
    /// First row and number of rows of each run, in row order.
    pub runs: Vec<(usize, usize)>,
    /// Per run, one placement per field (in field order) covering all of the run's rows.
    pub placements: Vec<Placement>,
}

/// Rows ahead of the one being converted whose in-place bytes the CPU backend prefetches.
const PREFETCH_ROWS_AHEAD: usize = 8;

/// A hint to start loading the cache line holding `byte` (nothing on targets without one).
#[inline(always)]
fn prefetch(byte: &u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; `byte` is a valid reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (byte as *const u8).cast(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = byte;
}

/// Where one field of one sample lives: its shard, its raw byte range in the field's stream there, and
/// the blocks (indices within the field) that hold the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Shard index.
    pub shard: usize,
    /// First raw byte of the sample in the field's stream.
    pub start: u64,
    /// One past the last raw byte.
    pub end: u64,
    /// The blocks overlapping `start..end`.
    pub blocks: std::ops::Range<u32>,
}

/// Identifies a block: shard, field and block index within the field (ordered by file position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct BlockKey {
    pub(crate) shard: u32,
    pub(crate) field: u32,
    pub(crate) block: u32,
}

/// What filling one slot produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillReport {
    /// Samples in the batch.
    pub samples: u32,
    /// Samples zero-filled because a block was corrupt.
    pub replaced: u32,
}

/// Why a block is unusable. Built only when a block is found bad, so the hot path carries none.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CorruptReason {
    /// The stored bytes do not hash to the checksum in the block table.
    #[error("checksum mismatch (table says {expected:016x}, payload hashes to {computed:016x})")]
    Checksum {
        /// Checksum from the block table.
        expected: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// The LZ4 kernel refused the payload (GPU backend).
    #[error("LZ4 block does not decode ({status} after {produced} bytes)")]
    Lz4Kernel {
        /// The kernel's status.
        status: Lz4Status,
        /// Bytes decoded before the fault.
        produced: u32,
    },
    /// The CPU LZ4 decoder refused the payload.
    #[error("corrupt LZ4 block: {0}")]
    Lz4(String),
    /// The payload decoded to fewer bytes than the table says.
    #[error("decoded to {produced} bytes, the table says {expected}")]
    Size {
        /// `raw_bytes` from the table.
        expected: u32,
        /// Bytes the decoder produced.
        produced: usize,
    },
    /// The payload could not be read; the read error's message.
    #[error("{0}")]
    Unreadable(String),
}

/// A block found unusable, and why.
#[derive(Clone, Debug)]
pub struct CorruptBlock {
    /// The block: shard, field and block index.
    pub block: BlockRef,
    /// What is wrong with it.
    pub reason: CorruptReason,
}

impl CorruptBlock {
    /// The error that ends a stream whose policy is to fail on this block.
    pub fn to_error(&self) -> FillError {
        FillError::Corrupt {
            block: self.block.clone(),
            reason: self.reason.clone(),
        }
    }
}

impl From<decode::BlockError> for CorruptBlock {
    fn from(error: decode::BlockError) -> CorruptBlock {
        let block = error.block().clone();
        let reason = match error {
            decode::BlockError::Checksum {
                expected, computed, ..
            } => CorruptReason::Checksum { expected, computed },
            decode::BlockError::Lz4 { reason, .. } => CorruptReason::Lz4(reason),
            decode::BlockError::Size {
                expected, produced, ..
            } => CorruptReason::Size { expected, produced },
            decode::BlockError::Io { source, .. } => {
                CorruptReason::Unreadable(format!("read failed: {source}"))
            }
        };
        CorruptBlock { block, reason }
    }
}

/// A batch could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// A block is corrupt and the policy is to fail.
    #[error("{block}: {reason}")]
    Corrupt {
        /// The block: shard, field and block index.
        block: BlockRef,
        /// What is wrong with it.
        reason: CorruptReason,
    },
    /// The storage engine failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// A device operation failed (GPU backend).
    #[error("{0}")]
    Device(#[from] DeviceError),
    /// The GPU reader failed as a whole (not one block).
    #[error("{0}")]
    Read(#[from] GpuReadError),
    /// One sample needs more device memory than a round of the GPU backend has.
    #[error(
        "sample {sample} of the batch needs more device memory than one round has (staging \
         {staging_bytes} bytes, scratch {scratch_bytes} bytes, {pieces_max} gather pieces, \
         {cache_entries} cache entries of {entry_bytes} bytes): raise the GPU stream limits"
    )]
    RoundTooSmall {
        /// The sample's position in the batch.
        sample: usize,
        /// Staging buffer of a round.
        staging_bytes: usize,
        /// Shuffle scratch.
        scratch_bytes: u64,
        /// Gather pieces of a round.
        pieces_max: usize,
        /// Entries of the block cache.
        cache_entries: u32,
        /// Bytes of one cache entry.
        entry_bytes: u64,
    },
    /// The gather kernel refused pieces of its table: a bug in the batch plan, not bad data.
    #[error("the gather kernel refused {pieces} pieces (last {last}): a bug in the batch plan")]
    GatherRefused {
        /// Pieces refused.
        pieces: u32,
        /// Index of the last piece refused.
        last: u32,
    },
    /// Copying a shard into device memory ahead of the rows that read it failed (a stream whose
    /// dataset is larger than the registration budget).
    #[error("copying {} into device memory: {source}", shard.display())]
    ShardCopy {
        /// The shard.
        shard: std::path::PathBuf,
        /// Why.
        source: std::sync::Arc<std::io::Error>,
    },
    /// A stream's rows need more shards on the device at once than its device shard memory holds.
    #[error(
        "a round of this stream reads {needed} shards but the stream's device shard memory holds          {slots}: raise --device-shard-memory"
    )]
    ShardSlotsTooFew {
        /// Shards one round reads.
        needed: usize,
        /// Slots the stream has.
        slots: usize,
    },
    /// The thread planning a resident stream's rows stopped before this step (it panicked).
    #[error("the planning thread stopped before step {step}: a bug in the batch plan")]
    PlannerStopped {
        /// The step that was not planned.
        step: u64,
    },
}

impl FillError {
    /// Whether the device ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, FillError::Device(DeviceError::Driver(error)) if error.is_out_of_memory())
    }
}

/// Fills slots on the CPU: reads blocks with the storage engine, decodes them with the CPU path and
/// gathers samples into the slot in the stream's order.
pub struct Assembler {
    plan: Arc<StreamPlan>,
    files: FileTable,
    engine: ReadEngine<AnyQueue>,
    /// Why io_uring is not used, when it is not.
    pub engine_note: Option<String>,
    /// The daemon's decoded-block cache, shared with its other host streams.
    cache: CacheHandle,
    /// The blocks the part of the batch being filled reads: taken from the cache or decoded for it,
    /// held until the part is gathered (so the cache cannot free them under it). Raw blocks read in
    /// place are absent.
    part: HashMap<BlockKey, CachedBlock>,
    /// Decoded bytes one part of a batch may read at most (one row's blocks at least): the working
    /// set the stream reserves beside its slots.
    working_set_bytes: u64,
    staging: AlignedBuffer,
    scratch: Vec<u8>,
    decode_threads: usize,
    sample: Vec<u8>,
    metrics: Arc<Metrics>,
    read_path: ReadPath,
    /// Read-only maps of the shards, made on first use, for raw blocks read in place, with the
    /// shard's residency map.
    maps: Vec<Option<(memmap2::Mmap, ResidencyMap)>>,
}

/// Share of a raw block's bytes below which the CPU backend copies a batch's rows straight from the
/// shard's page cache (a memory map) instead of reading and caching the whole block: shuffled orders
/// touch a few rows of many blocks, and reading each block whole per batch multiplies the bytes read.
/// Blocks a batch uses more of are read in place too when their pages are cached (copying from the
/// page cache beats reading the disk again with O_DIRECT); otherwise the read engine reads them.
const IN_PLACE_COVERAGE_MAX: f64 = 0.5;
/// Fraction of a dense block's pages that must be cached for it to be read in place.
const IN_PLACE_RESIDENT_MIN: f64 = 0.95;

/// Decoded bytes a host stream of `plan` reads at once at most, which it reserves beside its slots:
/// the blocks of one part of a batch (see [`Assembler::fill`]), at least the blocks one row may
/// touch in every field.
pub fn working_set_bytes(plan: &StreamPlan) -> u64 {
    let row: u64 = plan
        .fields
        .iter()
        .map(|field| {
            let block = plan
                .dataset
                .shards
                .iter()
                .filter_map(|s| s.metadata.field_blocks(field.field_index).first())
                .map(|b| u64::from(b.raw_bytes))
                .max()
                .unwrap_or(0);
            // A row spans its bytes' worth of blocks, plus one at each end.
            (field.sample_bytes_in as u64)
                .div_ceil(block.max(1))
                .saturating_add(2)
                * block
        })
        .sum();
    block_cache::working_set_bytes(row)
}

impl Assembler {
    /// Opens the dataset's shards and sets up the engine, with a decoded-block cache of the stream's
    /// own of `limits.cache_bytes_max` bytes (benchmarks and tools; the daemon shares one cache
    /// between its streams, [`Assembler::with_cache`]).
    pub fn new(
        plan: Arc<StreamPlan>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
    ) -> Result<Assembler, StorageError> {
        let cache = BlockCache::new(limits.cache_bytes_max as u64, Arc::clone(&metrics));
        Assembler::with_cache(plan, limits, metrics, &cache)
    }

    /// Opens the dataset's shards and sets up the engine; decoded blocks go to `cache`, shared with
    /// the other streams using it. The stream's working set ([`working_set_bytes`]) should be
    /// reserved in the cache's budget (the socket server reserves it with the slots).
    pub fn with_cache(
        plan: Arc<StreamPlan>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
        cache: &Arc<BlockCache>,
    ) -> Result<Assembler, StorageError> {
        let mut files = FileTable::new(plan.dataset.shards.len());
        for shard in &plan.dataset.shards {
            files.open(&shard.path, DirectIo::Prefer)?;
        }
        let plan_shards = plan.dataset.shards.len();
        let (queue, engine_note) = AnyQueue::best(limits.queue_depth);
        let read_path = match queue {
            AnyQueue::Uring(_) => ReadPath::Uring,
            AnyQueue::Pread(_) => ReadPath::Pread,
        };
        metrics.set_read_queue_depth(limits.queue_depth as u64);
        let engine = ReadEngine::new(queue, EngineLimits::node_defaults());
        let working_set_bytes = working_set_bytes(&plan);
        Ok(Assembler {
            cache: cache.open(&plan.dataset),
            part: HashMap::new(),
            working_set_bytes,
            plan,
            files,
            engine,
            engine_note,
            staging: AlignedBuffer::new(1 << 20),
            scratch: Vec::new(),
            decode_threads: limits.decode_threads,
            metrics,
            read_path,
            sample: Vec::new(),
            maps: (0..plan_shards).map(|_| None).collect(),
        })
    }

    /// Fills `slot` with stream step `step`.
    ///
    /// The batch is filled in parts, in row order: each part is as many rows as the blocks they read
    /// fit in the stream's working set (one row at least). A part's blocks are taken from the shared
    /// cache, or read and decoded once and offered to it, and held until the part is gathered; so a
    /// stream never holds more decoded bytes than its working set beyond what the cache keeps, however
    /// many blocks a shuffled batch touches.
    pub fn fill(&mut self, step: u64, slot: &mut [u8]) -> Result<FillReport, FillError> {
        assert!(slot.len() >= self.plan.slot_bytes);
        let plan = Arc::clone(&self.plan);
        // Where every (sample, field) of the batch lives, row by row, located once for both passes.
        let placements = plan.placements(step);
        let width = plan.fields.len();
        let sample_count = placements.len() / width;
        let mut replaced = 0u32;
        let mut part_blocks: HashMap<BlockKey, u64> = HashMap::new();
        let mut first = 0;
        while first < sample_count {
            // The part's rows, and the bytes of each raw block they use (for the in-place choice).
            part_blocks.clear();
            let mut part_bytes = 0u64;
            let mut end = first;
            while end < sample_count {
                let row = &placements[end * width..(end + 1) * width];
                let mut row_bytes = 0u64;
                for (placement, field) in row.iter().zip(&plan.fields) {
                    for block in placement.blocks.clone() {
                        let key = BlockKey {
                            shard: placement.shard as u32,
                            field: field.field_index as u32,
                            block,
                        };
                        if !part_blocks.contains_key(&key) {
                            row_bytes += u64::from(self.entry(&key).raw_bytes);
                        }
                    }
                }
                if end > first && part_bytes + row_bytes > self.working_set_bytes {
                    break;
                }
                part_bytes += row_bytes;
                for (placement, field) in row.iter().zip(&plan.fields) {
                    for block in placement.blocks.clone() {
                        let key = BlockKey {
                            shard: placement.shard as u32,
                            field: field.field_index as u32,
                            block,
                        };
                        let entry = self.entry(&key);
                        let block_end = entry.raw_offset + entry.raw_bytes as u64;
                        let used =
                            placement.end.min(block_end) - placement.start.max(entry.raw_offset);
                        *part_blocks.entry(key).or_default() += used;
                    }
                }
                end += 1;
            }
            self.prepare_part(&part_blocks)?;
            let filled = self.gather(&placements, first..end, slot);
            // The part's blocks are released whatever happened: the cache may evict them now.
            self.part.clear();
            replaced += filled?;
            first = end;
        }
        Ok(FillReport {
            samples: sample_count as u32,
            replaced,
        })
    }

    /// Takes the blocks of a part (with the raw bytes the part uses of each) from the cache, or reads
    /// them in place, or reads and decodes them, into `self.part`.
    fn prepare_part(&mut self, blocks: &HashMap<BlockKey, u64>) -> Result<(), StorageError> {
        let mut missing: Vec<BlockKey> = Vec::new();
        let mut sparse: Vec<(BlockKey, u64)> = Vec::new();
        for (&key, &used) in blocks {
            let entry = self.entry(&key);
            let shared = self.cache.key(key.shard, key.field, key.block);
            if entry.codec == Codec::Raw {
                // Raw blocks are mostly read in place: look the cache up without counting a miss.
                if let Some(cached) = self.cache.cache().peek(&shared) {
                    self.part.insert(key, cached);
                } else {
                    sparse.push((key, used));
                }
            } else if let Some(cached) = self.cache.cache().get(&shared) {
                self.part.insert(key, cached);
            } else {
                missing.push(key);
            }
        }
        for (key, used) in sparse {
            // A raw block the part uses little of is read in place (see IN_PLACE_COVERAGE_MAX).
            let dense = used as f64 >= self.entry(&key).raw_bytes as f64 * IN_PLACE_COVERAGE_MAX;
            if !self.map_in_place(&key, dense) {
                self.cache.cache().record(false);
                missing.push(key);
            }
        }
        missing.sort_unstable();
        self.load(&missing)
    }

    /// Gathers rows `rows` of the batch (`placements`: every row's, in row order) into `slot` from
    /// the part's blocks and the shards' maps; the samples replaced by zeros.
    fn gather(
        &mut self,
        placements: &[Placement],
        rows: std::ops::Range<usize>,
        slot: &mut [u8],
    ) -> Result<u32, FillError> {
        let plan = Arc::clone(&self.plan);
        let gather_started = std::time::Instant::now();
        let mut replaced = 0u32;
        let mut in_place_bytes = 0u64;
        let width = plan.fields.len();
        for row in rows {
            let row_placements = &placements[row * width..(row + 1) * width];
            let ahead = (row + PREFETCH_ROWS_AHEAD) * width;
            if let Some(ahead) = placements.get(ahead..ahead + width) {
                self.prefetch_in_place(ahead);
            }
            let mut corrupt: Option<Arc<CorruptBlock>> = None;
            for (field, placement) in plan.fields.iter().zip(row_placements) {
                let (shard, start, end) = (placement.shard, placement.start, placement.end);
                self.sample.clear();
                for block_index in placement.blocks.clone() {
                    let key = BlockKey {
                        shard: shard as u32,
                        field: field.field_index as u32,
                        block: block_index,
                    };
                    let entry = &self.plan.dataset.shards[shard]
                        .metadata
                        .field_blocks(field.field_index)[block_index as usize];
                    let from = start.max(entry.raw_offset) - entry.raw_offset;
                    let to = end.min(entry.raw_offset + entry.raw_bytes as u64) - entry.raw_offset;
                    match self.part.get(&key) {
                        Some(CachedBlock::Decoded(bytes)) => {
                            self.sample
                                .extend_from_slice(&bytes.bytes()[from as usize..to as usize]);
                        }
                        Some(CachedBlock::Corrupt(bad)) => corrupt = Some(Arc::clone(bad)),
                        None => {
                            // Read in place: a raw block (stored bytes are the raw bytes) whose
                            // checksum map_in_place verified.
                            let (map, _) =
                                self.maps[shard].as_ref().expect("mapped in map_in_place");
                            let at = entry.stored_offset as usize;
                            self.sample
                                .extend_from_slice(&map[at + from as usize..at + to as usize]);
                            in_place_bytes += to - from;
                        }
                    }
                }
                if corrupt.is_some() {
                    break;
                }
                let out = &mut slot[field.offset + row * field.sample_bytes_out..]
                    [..field.sample_bytes_out];
                decode::convert(field.stored, &self.sample, field.out, out)
                    .expect("conversions are validated when the stream is planned");
            }
            if let Some(bad) = corrupt {
                match plan.on_corrupt {
                    CorruptPolicy::Fail => return Err(bad.to_error()),
                    CorruptPolicy::Replace => {
                        // The substitute is an all-zero sample in every field: deterministic, the
                        // same on every rank, and counted so the trainer can see it.
                        for field in &plan.fields {
                            slot[field.offset + row * field.sample_bytes_out..]
                                [..field.sample_bytes_out]
                                .fill(0);
                        }
                        replaced += 1;
                    }
                }
            }
        }
        if in_place_bytes > 0 {
            self.metrics
                .add_read_bytes(ReadPath::PageCache, in_place_bytes);
        }
        self.metrics.add_gather_time(gather_started.elapsed());
        Ok(replaced)
    }

    /// Asks the CPU to start loading the first bytes each field of a later row reads in place from
    /// a shard's memory map. In a shuffled order every row lies in another page: its address
    /// translation and first cache line then load while earlier rows are converted, instead of one
    /// after another (on a VM, where a page walk is costly, shuffled epochs ran at half the rate of
    /// dataset order without it).
    fn prefetch_in_place(&self, row_placements: &[Placement]) {
        for (field, placement) in self.plan.fields.iter().zip(row_placements) {
            let Some((map, _)) = self.maps[placement.shard].as_ref() else {
                continue;
            };
            let block = placement.blocks.start;
            let blocks = self.plan.dataset.shards[placement.shard]
                .metadata
                .field_blocks(field.field_index);
            let Some(entry) = blocks.get(block as usize) else {
                continue;
            };
            let at = entry.stored_offset + placement.start.saturating_sub(entry.raw_offset);
            if let Some(byte) = map.get(at as usize) {
                prefetch(byte);
            }
        }
    }

    fn entry(&self, key: &BlockKey) -> crate::format::BlockEntry {
        self.plan.dataset.shards[key.shard as usize]
            .metadata
            .field_blocks(key.field as usize)[key.block as usize]
    }

    /// Prepares raw block `key` to be read in place from its shard's memory map (`dense`: the batch
    /// uses most of it, so only if its pages are cached): maps the shard if needed and verifies the block's checksum unless a reader of the dataset has (a corrupt block
    /// goes into the cache as such, for the rows that read it). False when the shard cannot be mapped:
    /// read the block whole instead, as when a dense block is not cached.
    fn map_in_place(&mut self, key: &BlockKey, dense: bool) -> bool {
        let shard = key.shard as usize;
        if self.maps[shard].is_none() {
            let file = self.files.get(FileId(key.shard)).file();
            // SAFETY: a read-only map of a shard, which gpufeed never modifies once its dataset
            // exists; datasets are replaced by renaming a new directory into place, never in place.
            let map = unsafe { memmap2::Mmap::map(file) };
            match (map, ResidencyMap::new(file)) {
                (Ok(map), Ok(residency)) => self.maps[shard] = Some((map, residency)),
                _ => return false,
            }
        }
        let entry = self.entry(key);
        if dense {
            let (_, residency) = self.maps[shard].as_ref().expect("mapped above");
            let cached = residency
                .resident_fraction(entry.stored_offset as usize, entry.stored_bytes as usize)
                .is_ok_and(|f| f >= IN_PLACE_RESIDENT_MIN);
            if !cached {
                return false;
            }
        }
        let verified = &self.plan.dataset.verified;
        if verified.contains(shard, key.field as usize, key.block) {
            return true;
        }
        let (map, _) = self.maps[shard].as_ref().expect("mapped above");
        let at = entry.stored_offset as usize;
        if at + entry.stored_bytes as usize > map.len() {
            return false;
        }
        let stored = &map[at..at + entry.stored_bytes as usize];
        let shard_ref = &self.plan.dataset.shards[shard];
        let checked = decode::check_block(stored, &entry, || BlockRef {
            shard: shard_ref.path.clone(),
            field: shard_ref.metadata.fields[key.field as usize].name.clone(),
            block: key.block,
            stored_offset: entry.stored_offset,
        });
        // Verifying reads the whole block, once per dataset.
        self.metrics
            .add_read_bytes(ReadPath::PageCache, entry.stored_bytes as u64);
        match checked {
            Ok(()) => {
                self.plan
                    .dataset
                    .verified
                    .insert(shard, key.field as usize, key.block);
            }
            Err(error) => {
                self.metrics.add_corrupt_blocks(1);
                let bad = CachedBlock::Corrupt(Arc::new(CorruptBlock::from(error)));
                self.offer(*key, bad);
            }
        }
        true
    }

    /// Reads and decodes `keys` into the cache.
    fn load(&mut self, keys: &[BlockKey]) -> Result<(), StorageError> {
        let align = IO_ALIGN_BYTES as usize;
        let mut start = 0;
        while start < keys.len() {
            // Read as many blocks as fit in the staging buffer at once, growing it to hold at least one.
            let mut extents = Vec::new();
            let mut dest = 0usize;
            let mut end = start;
            while end < keys.len() {
                let key = keys[end];
                let entry = &self.plan.dataset.shards[key.shard as usize]
                    .metadata
                    .field_blocks(key.field as usize)[key.block as usize];
                // Round reads up to whole pages: shards are padded to 4096, so this stays in the file
                // and lets the engine use O_DIRECT.
                let len = (entry.stored_bytes as usize).div_ceil(align) * align;
                if dest + len > self.staging.len() {
                    if end == start {
                        self.staging = AlignedBuffer::new(len);
                    } else {
                        break;
                    }
                }
                extents.push(Extent {
                    file: FileId(key.shard),
                    offset: entry.stored_offset,
                    len,
                    dest_offset: dest,
                });
                dest += len;
                end += 1;
            }
            let results = self
                .engine
                .read(&self.files, &extents, self.staging.as_mut_slice())?;
            let read_bytes: usize = extents
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_ok())
                .map(|(e, _)| e.len)
                .sum();
            self.metrics
                .add_read_bytes(self.read_path, read_bytes as u64);
            let decode_started = std::time::Instant::now();
            // Decode the blocks of this read on up to `decode_threads` threads: decoding, not
            // reading, is the CPU backend's bottleneck.
            let jobs: Vec<(BlockKey, &Extent, Result<(), crate::storage::ReadError>)> = keys
                [start..end]
                .iter()
                .copied()
                .zip(&extents)
                .zip(results)
                .map(|((key, extent), result)| (key, extent, result))
                .collect();
            let plan = &self.plan;
            let metrics = &self.metrics;
            let staging = self.staging.as_slice();
            let decode_one = |(key, extent, result): &(
                BlockKey,
                &Extent,
                Result<(), crate::storage::ReadError>,
            ),
                              scratch: &mut Vec<u8>| {
                let shard = &plan.dataset.shards[key.shard as usize];
                let field = &shard.metadata.fields[key.field as usize];
                let entry = shard.metadata.field_blocks(key.field as usize)[key.block as usize];
                let at = || BlockRef {
                    shard: shard.path.clone(),
                    field: field.name.clone(),
                    block: key.block,
                    stored_offset: entry.stored_offset,
                };
                match result {
                    Err(error) => CachedBlock::Corrupt(Arc::new(CorruptBlock {
                        block: at(),
                        reason: CorruptReason::Unreadable(error.to_string()),
                    })),
                    Ok(()) => {
                        let stored = &staging
                            [extent.dest_offset..extent.dest_offset + entry.stored_bytes as usize];
                        let mut raw = vec![0u8; entry.raw_bytes as usize];
                        match decode::decode_block(
                            stored,
                            &entry,
                            field.dtype.size_bytes(),
                            scratch,
                            &mut raw,
                            at,
                        ) {
                            Ok(()) => CachedBlock::Decoded(Arc::new(DecodedBlock::new(
                                raw,
                                Arc::clone(metrics),
                            ))),
                            Err(error) => CachedBlock::Corrupt(Arc::new(error.into())),
                        }
                    }
                }
            };
            // Spawning threads costs tens of microseconds: only worth it for several blocks each.
            const BLOCKS_PER_THREAD_MIN: usize = 4;
            let threads = self
                .decode_threads
                .min(jobs.len() / BLOCKS_PER_THREAD_MIN)
                .max(1);
            let decoded: Vec<CachedBlock> = if threads == 1 {
                jobs.iter()
                    .map(|job| decode_one(job, &mut self.scratch))
                    .collect()
            } else {
                let per_thread = jobs.len().div_ceil(threads);
                std::thread::scope(|scope| {
                    let handles: Vec<_> = jobs
                        .chunks(per_thread)
                        .map(|chunk| {
                            scope.spawn(move || {
                                let mut scratch = Vec::new();
                                chunk
                                    .iter()
                                    .map(|job| decode_one(job, &mut scratch))
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .flat_map(|h| h.join().expect("decoding does not panic"))
                        .collect()
                })
            };
            self.metrics.add_decode_time(decode_started.elapsed());
            let corrupt = decoded
                .iter()
                .filter(|c| matches!(c, CachedBlock::Corrupt(_)))
                .count();
            self.metrics.add_corrupt_blocks(corrupt as u64);
            let keys: Vec<BlockKey> = jobs.iter().map(|(key, _, _)| *key).collect();
            drop(jobs);
            for (key, cached) in keys.into_iter().zip(decoded) {
                self.offer(key, cached);
            }
            start = end;
        }
        Ok(())
    }

    /// Holds `block` for the part being filled and offers it to the shared cache.
    fn offer(&mut self, key: BlockKey, block: CachedBlock) {
        let shared = self.cache.key(key.shard, key.field, key.block);
        self.cache.cache().insert(shared, block.clone());
        self.part.insert(key, block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Consumers read these texts: they say what is wrong in words, not as Rust debug output.
    #[test]
    fn lz4_kernel_faults_are_told_in_words() {
        for status in [
            Lz4Status::InputOverrun,
            Lz4Status::OutputOverrun,
            Lz4Status::BadOffset,
            Lz4Status::SizeMismatch,
            Lz4Status::BadJob,
            Lz4Status::Unknown(9),
        ] {
            let text = CorruptReason::Lz4Kernel {
                status,
                produced: 7,
            }
            .to_string();
            assert!(!text.contains(&format!("{status:?}")), "{text}");
            assert!(text.contains("after 7 bytes"), "{text}");
        }
    }
}
