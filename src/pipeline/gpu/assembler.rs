//! The GPU backend's assembler: a stream is filled by the staged assembler or by the resident
//! assembler, chosen when the stream opens, both over one round engine.

use std::collections::VecDeque;
use std::sync::Arc;

use foldhash::{HashSet, HashSetExt};

use super::engine::buffers::{HostLayout, RoundBufferPool, RoundBuffers};
use super::engine::cache::BlockCache;
use super::engine::rounds::RoundEngine;
use super::limits::{
    GpuFillTimings, GpuStreamLimits, INLINE_GATHER_LAUNCHES_MAX, ROUNDS_IN_FLIGHT_MAX,
    WAIT_SPIN_MAX,
};
use super::resident::assembler::ResidentAssembler;
use super::resident::open::Resident;
use super::shard_pool::{KeptBuffer, ShardSlotPool};
use super::staged::assembler::StagedAssembler;
use super::staged::plan;
use crate::device::{DeviceRegion, Event, Stream};
use crate::kernels::Kernels;
use crate::metrics::{DeviceMetrics, Metrics};
use crate::pipeline::stream_plan::{FillError, FillReport, StreamPlan};
use crate::storage::gpu::{GpuReader, PathChoice};
use crate::storage::{DirectIo, FileTable, IO_ALIGN_BYTES};

/// Output bytes a group of small batches gathered by one round stays within: batches of at least
/// this much go one to a round.
const BATCH_GROUP_OUT_BYTES: usize = 4 << 20;
/// The same for a stream reading a dataset whole in the device's memory tier: its rounds read
/// HBM, so a round's fixed costs on the host (its launch, completion and hand-off) weigh on
/// batches four times larger. (64 MiB, four batches of 4096 rows of 1024 fp32 a round, was slower
/// with a consumer of 4 slots in run 119: 208 against 265 GB/s in a full shuffle.)
const BATCH_GROUP_OUT_BYTES_IN_TIER: usize = 16 << 20;

/// The most batches, and pieces, one round of a stream gathers together (see
/// `resident::group`), for slots of `slot_bytes`, at most `batch_group_max` batches, rounds that
/// pass at most `inline_pieces_max` pieces in a launch and hold `pieces_max` in their table.
fn batch_group_limits(
    resident: Option<&Resident>,
    slot_bytes: usize,
    batch_group_max: usize,
    inline_pieces_max: usize,
    pieces_max: usize,
) -> (usize, usize) {
    // Small batches of a resident stream are gathered several to a round: at 256 rows of 2 KiB a
    // round per batch left the pipeline bound by the host's launches and completions.
    // (Not when rows are copied into a round's staging: they are placed for one batch.)
    let in_tier = resident.is_some_and(|r| r.reads_tier_only());
    let group_out_bytes = if in_tier {
        BATCH_GROUP_OUT_BYTES_IN_TIER
    } else {
        BATCH_GROUP_OUT_BYTES
    };
    let group_batches_max = if resident.is_some_and(|r| !r.copies_rows()) {
        (group_out_bytes / slot_bytes.max(1)).clamp(1, batch_group_max.max(1))
    } else {
        1
    };
    // One launch's inline pieces, and never more than a round's piece table holds (a group whose
    // table cannot go inline goes through it). In the tier, groups of batches too large for one
    // launch's inline pieces share one uploaded table.
    let group_pieces_max = if inline_pieces_max > 0 && !in_tier {
        crate::kernels::GATHER_INLINE_PIECES_MAX.min(pieces_max)
    } else {
        pieces_max
    };
    (group_batches_max, group_pieces_max)
}

/// The resident view of a stream, if it has one: a dataset with compressed blocks is read decoded
/// from the device's memory tier when the tier holds it or has room for it; a raw one as
/// `Resident::open` decides. `None`: the stream stages its blocks.
#[allow(clippy::too_many_arguments)]
fn open_resident(
    plan: &StreamPlan,
    files: &FileTable,
    reader: &mut GpuReader,
    choice: PathChoice,
    kernels: &Kernels,
    limits: &GpuStreamLimits,
    device: &crate::device::Device,
    metrics: &DeviceMetrics,
    shard_pool: &Arc<ShardSlotPool>,
    tier: &Arc<super::tier::DeviceTier>,
) -> Result<Option<Resident>, FillError> {
    let decoded = Resident::open_decoded(
        plan,
        files,
        reader,
        choice,
        &kernels.lz4,
        limits,
        device,
        metrics,
        shard_pool,
        tier,
    )?;
    if decoded.is_some() {
        return Ok(decoded);
    }
    Resident::open(
        plan,
        files,
        reader.windows(),
        limits,
        reader.resident_fraction_min(),
        device,
        metrics,
        shard_pool,
        tier,
        kernels.gather.has_ordered() && !super::resident::ordered::turned_off(),
    )
}

/// Fills device slots: reads, verifies and decodes blocks on the device and gathers each batch.
// One per stream, which its filler keeps boxed: the variants' sizes cost nothing.
#[allow(clippy::large_enum_variant)]
pub enum GpuAssembler {
    /// Blocks read round by round into staging (or in place from mapped windows) and decoded into
    /// the block cache.
    Staged(StagedAssembler),
    /// Every block raw and every row read in place from windows mapped for the stream's life, or
    /// from shards copied ahead into device memory (see `resident::open`).
    Resident(ResidentAssembler),
}

impl GpuAssembler {
    /// Opens the dataset's shards and allocates the stream's device memory on `reader`'s device,
    /// taking round buffers from `pool` and shard slots from `shard_pool` where they have them.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        plan: Arc<StreamPlan>,
        kernels: Arc<Kernels>,
        reader: GpuReader,
        choice: PathChoice,
        limits: &GpuStreamLimits,
        pool: Arc<RoundBufferPool>,
        shard_pool: &Arc<ShardSlotPool>,
        tier: &Arc<super::tier::DeviceTier>,
        metrics: Arc<Metrics>,
    ) -> Result<GpuAssembler, FillError> {
        let started = std::time::Instant::now();
        let device = reader.stream().device().clone();
        let metrics = DeviceMetrics::new(metrics, device.properties().ordinal as u32);
        let mut files = FileTable::new(plan.dataset.shards.len());
        for shard in &plan.dataset.shards {
            files.open(&shard.path, DirectIo::Prefer)?;
        }
        let (staged_max, raw_max) = plan::block_sizes_max(&plan);
        let staging_bytes = (limits.staging_bytes as u64).max(staged_max);
        let (cache_bytes, lz4_read_ahead) =
            plan::cache_bytes(&plan, limits.cache_bytes as u64, limits.device_shard_bytes);
        let cache_entries = (cache_bytes / raw_max).clamp(1, u32::MAX as u64) as u32;
        let scratch_bytes = (limits.scratch_bytes as u64).max(raw_max);
        // The shuffle scratch follows the cache entries in the same buffer (the decoder writes both).
        // One scratch serves every round: rounds run one after the other on the compute stream.
        let scratch_offset = cache_entries as u64 * raw_max;
        let stream = Stream::new(&device)?;
        let opened_s = started.elapsed().as_secs_f64();
        let mut reader = reader;
        // Variable-length fields are gathered by the staged assembler only: the resident one
        // places rows of one size.
        let resident = if plan.has_variable() {
            None
        } else {
            open_resident(
                &plan,
                &files,
                &mut reader,
                choice,
                &kernels,
                limits,
                &device,
                &metrics,
                shard_pool,
                tier,
            )?
        };
        let resident_s = started.elapsed().as_secs_f64() - opened_s;
        let cache = KeptBuffer::new(
            &device,
            (scratch_offset + scratch_bytes) as usize,
            shard_pool,
        )?;
        let cache_s = started.elapsed().as_secs_f64() - opened_s - resident_s;
        // At most one job per staged page: a bound on the jobs of one round.
        let jobs_max = (staging_bytes / IO_ALIGN_BYTES) as usize;
        let pieces_max = limits.pieces_max.max(1);
        let layout = HostLayout::new(jobs_max, pieces_max);
        let rounds_in_flight = limits.rounds_in_flight.clamp(2, ROUNDS_IN_FLIGHT_MAX);
        let round_shape = (staging_bytes as usize, jobs_max, pieces_max, layout.bytes);
        let mut buffers = Vec::with_capacity(rounds_in_flight);
        let mut pooled = 0;
        for _ in 0..rounds_in_flight {
            let round = match pool.take(round_shape) {
                Some(round) => {
                    pooled += 1;
                    round
                }
                None => RoundBuffers::new(
                    &device,
                    staging_bytes as usize,
                    jobs_max,
                    pieces_max,
                    &layout,
                )?,
            };
            buffers.push(round);
        }
        tracing::info!(
            "stream pipeline set up in {:.1} ms: files and stream {:.1} ms, resident {:.1} ms, \
             block cache {:.1} ms, {} round buffers ({} kept from earlier streams) {:.1} ms",
            started.elapsed().as_secs_f64() * 1e3,
            opened_s * 1e3,
            resident_s * 1e3,
            cache_s * 1e3,
            buffers.len(),
            pooled,
            (started.elapsed().as_secs_f64() - opened_s - resident_s - cache_s) * 1e3
        );
        let inline_pieces_max = if kernels.gather.has_inline() {
            limits
                .inline_gather_launches
                .min(INLINE_GATHER_LAUNCHES_MAX)
                * crate::kernels::GATHER_INLINE_PIECES_MAX
        } else {
            0
        };
        let (group_batches_max, group_pieces_max) = batch_group_limits(
            resident.as_ref(),
            plan.slot_bytes,
            limits.batch_group_max,
            inline_pieces_max,
            pieces_max,
        );
        let engine = RoundEngine {
            kernels,
            reader,
            files,
            stream,
            cache,
            pieces_max,
            layout,
            buffers,
            pool,
            round_shape,
            rounds: VecDeque::with_capacity(rounds_in_flight),
            wait_spin: limits.wait_spin.min(WAIT_SPIN_MAX),
            batches: VecDeque::new(),
            next_buffers: 0,
            verified: HashSet::new(),
            timings: GpuFillTimings::default(),
            block_cache: BlockCache::new(cache_entries),
            metrics,
            plan,
        };
        Ok(match resident {
            Some(resident) => GpuAssembler::Resident(ResidentAssembler::new(
                engine,
                resident,
                inline_pieces_max,
                group_batches_max,
                group_pieces_max,
                limits.plan_threads,
            )?),
            None => GpuAssembler::Staged(StagedAssembler {
                engine,
                choice,
                entry_bytes: raw_max,
                scratch_offset,
                scratch_bytes,
                jobs_max,
                zero_copy: limits.zero_copy,
                lz4_read_ahead,
                round_stamp: 0,
                gather_piece_out_bytes: limits.gather_piece_out_bytes,
                variable: super::staged::assembler::VariableBatch::default(),
            }),
        })
    }

    fn engine(&self) -> &RoundEngine {
        match self {
            GpuAssembler::Staged(staged) => &staged.engine,
            GpuAssembler::Resident(resident) => &resident.engine,
        }
    }

    /// Where the fill time went, for benchmarks.
    pub fn timings(&self) -> GpuFillTimings {
        self.engine().timings
    }

    /// The stream the batch work runs on.
    pub fn stream(&self) -> &Stream {
        &self.engine().stream
    }

    /// Why cold reads take the path they take (for the log).
    pub fn cold_path_reason(&self) -> &str {
        &self.engine().reader.cold_path_reason
    }

    /// Device memory this stream holds besides its slots, in bytes.
    pub fn device_bytes(&self) -> u64 {
        (match self {
            GpuAssembler::Staged(staged) => staged.engine.device_bytes(),
            GpuAssembler::Resident(resident) => resident.device_bytes(),
        }) as u64
    }

    /// Rounds queued on the device at once: submitting more batches than this ahead of completing
    /// them only makes `submit` wait.
    pub fn rounds_in_flight(&self) -> usize {
        self.engine().buffers.len()
    }

    /// Batches to submit ahead of completing them: as many as the rounds in flight gather.
    pub fn batches_ahead(&self) -> usize {
        match self {
            GpuAssembler::Staged(staged) => staged.engine.buffers.len(),
            GpuAssembler::Resident(resident) => {
                resident.engine.buffers.len() * resident.group_batches_max
            }
        }
    }

    /// Whether the oldest batch submitted is complete already: all its rounds were waited for, and
    /// it is in no group still waiting to be queued. [`Self::complete`] then returns it at once.
    pub fn oldest_complete(&self) -> bool {
        match self {
            GpuAssembler::Staged(staged) => staged.oldest_complete(),
            GpuAssembler::Resident(resident) => resident.oldest_complete(),
        }
    }

    /// Whether the batches submitted before step `step` should be delivered before it is submitted:
    /// its submission may wait long for the disk (the first step after a window shuffle's cold
    /// start waits for the loader's copies of the window's shards), and the batches before it are
    /// ready or nearly so.
    pub fn delivers_before(&self, step: u64) -> bool {
        match self {
            GpuAssembler::Staged(_) => false,
            GpuAssembler::Resident(resident) => resident.delivers_before(step),
        }
    }

    /// Batches submitted and not completed yet.
    pub fn pending_batches(&self) -> usize {
        self.engine().batches.len()
    }

    /// Fills `slot` with stream step `step` and waits for it: [`Self::submit`] then
    /// [`Self::complete`]. Batches submitted before must have been completed.
    pub fn fill(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
    ) -> Result<FillReport, FillError> {
        assert!(
            self.engine().batches.is_empty(),
            "complete submitted batches first"
        );
        self.submit(step, slot, released, None)?;
        let (_, report) = self.complete(None)?;
        Ok(report)
    }

    /// Queues stream step `step` into `slot`. The slot's previous contents may still be read by the
    /// consumer until `released` completes: the first write waits for it on the device. `ready` (if
    /// any) is recorded on the stream after the batch's last work, except on a resident stream,
    /// whose batches are complete on the device when [`Self::complete`] returns them (it records
    /// `ready` after a fix-up). The batch is not to be handed off before [`Self::complete`] has
    /// returned it: only then are its blocks known to be sound.
    ///
    /// The slot must stay allocated until the batch is completed.
    pub fn submit(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
        ready: Option<&Event>,
    ) -> Result<(), FillError> {
        match self {
            GpuAssembler::Staged(staged) => staged.submit(step, slot, released, ready),
            GpuAssembler::Resident(resident) => resident.submit(step, slot, released, ready),
        }
    }

    /// Waits for the oldest submitted batch, checks what its rounds found, zeroes (or fails on) samples
    /// whose blocks turned out to be corrupt, and returns its step and report. `ready` is the batch's
    /// ready event, recorded again if work was queued on the slot after it.
    pub fn complete(&mut self, ready: Option<&Event>) -> Result<(u64, FillReport), FillError> {
        match self {
            GpuAssembler::Staged(staged) => staged.engine.complete(ready),
            GpuAssembler::Resident(resident) => resident.complete(ready),
        }
    }
}
