//! Batch assembly on the GPU backend: blocks are read into device memory (page-cache DMA, the io_uring
//! bounce path or cuFile, per [`GpuReader`]), verified (xxh3 kernel), LZ4 blocks are decoded by the
//! LZ4 kernel into a device block cache, and the gather kernel converts every sample of the batch, in
//! the stream's order, into the slot, which is exportable device memory that the consumer maps.
//!
//! A batch is built in one or more *rounds*. A round reads the blocks its rows need into a staging
//! buffer (raw blocks) or decodes them into the block cache (LZ4 blocks, kept for later batches), then
//! gathers its rows into the slot. Rows join a round until the staging buffer, the cache, the shuffle
//! scratch or the gather table would overflow; the next rows go to the next round. So every size is
//! fixed at stream open, whatever the batch size or the order, and nothing is allocated on the device
//! per batch.
//!
//! Rounds are pipelined: [`GpuStreamLimits::rounds_in_flight`] sets of round buffers (staging, job and piece tables in
//! pinned host memory and on the device, outcomes) are used in turn, so the reads of the next round
//! are queued while the device still verifies, decodes and gathers the previous one, and the host
//! plans ahead instead of waiting. The host waits for a round (one event, sleeping, no spin) only
//! when its buffers are needed again or its batch is handed off. A round's outcomes (checksums, LZ4
//! status, gather faults) are read when it completes: a sample whose block turns out to be corrupt
//! then is zeroed (policy `replace`) or ends the stream (policy `fail`) before its batch is handed
//! off, so nothing corrupt is ever served.
//!
//! Ordering: all device work of a stream runs on its compute stream, which waits on the reader's
//! copy stream for each round's reads. The first write into a slot waits on the slot's `released`
//! event, which the consumer recorded on its own stream when it released the slot. Block cache
//! entries are reused in stream order, so a gather queued before a decode that overwrites its source
//! entry has read it first.

mod cache;
mod complete;
mod copy_helpers;
mod device_shards;
mod plan;
mod resident;
mod round;
mod shard_loader;
mod shard_pool;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use foldhash::{HashSet, HashSetExt};

use self::cache::BlockCache;
pub use self::round::RoundBufferPool;
use self::round::{HostLayout, PendingBatch, PendingRound, RoundBuffers, RoundShape};
use self::shard_pool::KeptBuffer;
pub use self::shard_pool::ShardSlotPool;
use super::stream_plan::{BlockKey, FillError, FillReport, StreamPlan};
use crate::decode::BlockRef;
use crate::device::{DeviceMemory, DeviceRegion, Event, Stream};
use crate::format::BlockEntry;
use crate::kernels::Kernels;
use crate::metrics::{DeviceMetrics, Metrics};
use crate::storage::gpu::{GpuReader, PathChoice};
use crate::storage::{DirectIo, FileTable, IO_ALIGN_BYTES};

/// Most sets of round buffers a stream may ask for (see [`GpuStreamLimits::rounds_in_flight`]).
pub const ROUNDS_IN_FLIGHT_MAX: usize = 8;

/// The default [`GpuStreamLimits::inline_gather_launches`]: a dataset-order round of up to 8 MiB out
/// in 16 KiB pieces.
pub const INLINE_GATHER_LAUNCHES_DEFAULT: usize = 2;
/// Most [`GpuStreamLimits::inline_gather_launches`].
pub const INLINE_GATHER_LAUNCHES_MAX: usize = 8;

/// Most batches one round of a resident stream gathers (see [`GpuStreamLimits::batch_group_max`]).
pub const BATCH_GROUP_MAX: usize = 16;

/// Output bytes a group of small batches gathered by one round stays within: batches of at least
/// this much go one to a round.
const BATCH_GROUP_OUT_BYTES: usize = 4 << 20;

/// Longest spin of [`GpuStreamLimits::wait_spin`].
pub const WAIT_SPIN_MAX: std::time::Duration = std::time::Duration::from_millis(1);

/// Largest delivered bytes per field of a run of consecutive rows planned as one (see
/// [`StreamPlan::placement_runs`]).
const RUN_OUT_BYTES_MAX: usize = 1 << 20;

/// Default largest output of a gather piece made by merging adjacent samples (see
/// [`merged_piece_out_bytes`]).
const MERGED_PIECE_OUT_BYTES_DEFAULT: u64 = 16 << 10;

/// Largest output of a gather piece made by merging adjacent samples: small enough that a batch of
/// consecutive samples spreads over many thread blocks. A thread block converts one piece at a time,
/// and on the H100 a piece of 64 KiB took one block about 20 µs: a batch of 1024 rows of 2 KiB in
/// dataset order (64 such pieces, so 64 of the 132 multiprocessors busy) took 22 µs of gather, a
/// third of the round. 16 KiB by default; `GPUFEED_GATHER_PIECE_KIB` (4 to 1024) sets it.
pub(crate) fn merged_piece_out_bytes() -> u64 {
    static BYTES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        env_tuning("GPUFEED_GATHER_PIECE_KIB", 4, 1024)
            .map_or(MERGED_PIECE_OUT_BYTES_DEFAULT, |kib| kib << 10)
    })
}

/// Device memory of one GPU stream, all allocated when the stream opens.
#[derive(Clone, Copy, Debug)]
pub struct GpuStreamLimits {
    /// Stored blocks read in one round (one such buffer per round in flight).
    pub staging_bytes: usize,
    /// Decoded LZ4 blocks kept on the device (the block cache).
    pub cache_bytes: usize,
    /// Room for byte-shuffled blocks to be decoded before they are unshuffled, per round.
    pub scratch_bytes: usize,
    /// Gather pieces per round.
    pub pieces_max: usize,
    /// Rounds queued on the device at once (2 to [`ROUNDS_IN_FLIGHT_MAX`]), each with its own staging
    /// buffer and tables: the next rounds' reads are queued while the device runs the oldest.
    pub rounds_in_flight: usize,
    /// When raw blocks are read by the gather kernel straight from registered page-cache memory
    /// instead of being staged whole.
    pub zero_copy: ZeroCopy,
    /// Device memory a resident stream in dataset order or a window shuffle may fill with copies of
    /// the shards it reads next (see `device_shards`); streams use as many whole-shard slots as fit,
    /// and none when fewer than two do.
    pub device_shard_bytes: u64,
    /// Threads of a stream's loader that copy windows the registration budget has no room for
    /// through pinned buffers (see `copy_helpers`; about a host core each while they copy); 0:
    /// such windows are registered for their copy.
    pub loader_copy_threads: usize,
    /// How long the filler polls a round for completion before it sleeps until the device wakes it
    /// (at most [`WAIT_SPIN_MAX`]; zero: it sleeps at once). A sleeping filler wakes some tens of
    /// microseconds after the round is done; polling costs the host core it runs on.
    pub wait_spin: std::time::Duration,
    /// Resident rounds of at most this many launches of [`crate::kernels::GATHER_INLINE_PIECES_MAX`]
    /// pieces pass their piece table in the gather's launch parameters, every piece's region
    /// resolved on the host, instead of the kernel reading the piece and region tables from pinned
    /// memory (over a link the shard copies keep busy); needs a driver taking 32 KiB of parameters
    /// (CUDA 12.1). 0: never. `GPUFEED_INLINE_GATHER_TABLES` (0 to [`INLINE_GATHER_LAUNCHES_MAX`]).
    pub inline_gather_launches: usize,
    /// Most consecutive small batches of a resident stream one round gathers into their slots (one
    /// launch and one completion for the group instead of one each), within 4 MiB of output and one
    /// launch's inline pieces; 1: a round per batch. `GPUFEED_BATCH_GROUP_MAX` (1 to
    /// [`BATCH_GROUP_MAX`]).
    pub batch_group_max: usize,
}

/// When the gather kernel reads rows of raw blocks straight from page-cache memory registered and
/// mapped for the device (zero-copy, over PCIe, row by row) instead of staging whole blocks in device
/// memory first. Either way every byte is verified before its batch is handed off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroCopy {
    /// Always stage whole blocks.
    Off,
    /// Read a block's rows in place when a run uses less than half of it (shuffled orders), stage it
    /// when a run uses most of it (in order: the copy engines move whole blocks at the PCIe limit).
    Auto,
    /// Read every raw block in place when its window can be mapped.
    Always,
}

impl ZeroCopy {
    /// The name used in configuration and status.
    pub fn name(self) -> &'static str {
        match self {
            ZeroCopy::Off => "off",
            ZeroCopy::Auto => "auto",
            ZeroCopy::Always => "always",
        }
    }
}

impl std::str::FromStr for ZeroCopy {
    type Err = String;

    fn from_str(text: &str) -> Result<ZeroCopy, String> {
        match text {
            "off" => Ok(ZeroCopy::Off),
            "auto" => Ok(ZeroCopy::Auto),
            "always" => Ok(ZeroCopy::Always),
            other => Err(format!("{other:?} is not auto, always or off")),
        }
    }
}

/// Default [`GpuStreamLimits::device_shard_bytes`]: room for two windows of four shards of 512 MiB
/// (the window being served and the next) with their headers, 6 % of an 80 GiB GPU. With 4 GiB
/// (seven such slots) the next window's last shard could not be copied before its window began.
pub const DEVICE_SHARD_BYTES_DEFAULT: u64 = 5 << 30;

/// Default [`GpuStreamLimits::loader_copy_threads`]: none. Copy threads move more than registering
/// beyond the budget on the H100 test machine, but on several host cores against one (figures in
/// `copy_helpers`), and the host's cores belong to the training processes first.
pub const LOADER_COPY_THREADS_DEFAULT: usize = 0;

/// The most [`GpuStreamLimits::loader_copy_threads`].
pub const LOADER_COPY_THREADS_MAX: usize = copy_helpers::COPY_THREADS_MAX;

/// Share of a raw block's bytes below which [`ZeroCopy::Auto`] reads the rows in place.
const ZERO_COPY_COVERAGE_MAX: f64 = 0.5;

impl GpuStreamLimits {
    /// Defaults for a GPU node: 64 MiB staging per round in flight, a 256 MiB block cache, 64 MiB of
    /// shuffle scratch, 64 Ki gather pieces (2 MiB of table) per round, three rounds in flight.
    pub fn node_defaults() -> GpuStreamLimits {
        GpuStreamLimits {
            staging_bytes: 64 << 20,
            cache_bytes: 256 << 20,
            scratch_bytes: 64 << 20,
            pieces_max: 64 << 10,
            rounds_in_flight: env_tuning(
                "GPUFEED_ROUNDS_IN_FLIGHT",
                2,
                ROUNDS_IN_FLIGHT_MAX as u64,
            )
            .map_or(3, |n| n as usize),
            zero_copy: ZeroCopy::Auto,
            device_shard_bytes: DEVICE_SHARD_BYTES_DEFAULT,
            loader_copy_threads: LOADER_COPY_THREADS_DEFAULT,
            wait_spin: std::time::Duration::from_micros(
                env_tuning(
                    "GPUFEED_FILLER_SPIN_US",
                    0,
                    WAIT_SPIN_MAX.as_micros() as u64,
                )
                .unwrap_or(0),
            ),
            inline_gather_launches: env_tuning(
                "GPUFEED_INLINE_GATHER_TABLES",
                0,
                INLINE_GATHER_LAUNCHES_MAX as u64,
            )
            .map_or(INLINE_GATHER_LAUNCHES_DEFAULT, |n| n as usize),
            batch_group_max: env_tuning("GPUFEED_BATCH_GROUP_MAX", 1, BATCH_GROUP_MAX as u64)
                .map_or(BATCH_GROUP_MAX, |n| n as usize),
        }
    }
}

/// A tuning variable of the environment, when it is set to a whole number from `min` to `max`
/// (anything else is ignored with a warning).
fn env_tuning(name: &str, min: u64, max: u64) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    match value.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Some(n),
        _ => {
            tracing::warn!("{name}={value:?} ignored: not a whole number from {min} to {max}");
            None
        }
    }
}

/// Host time spent in each phase of filling slots. Device work is asynchronous: `wait_s` is the time
/// the host waited for it; the rest is the host's own work (planning, queueing reads and kernels,
/// reading outcomes).
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuFillTimings {
    /// Planning rounds on the host (resident streams: waiting for the planning threads).
    pub plan_s: f64,
    /// Resident streams: seconds the planning threads spent planning, summed over the threads.
    pub planning_threads_s: f64,
    /// Queueing reads (host-side reads of the bounce path and cuFile included).
    pub read_s: f64,
    /// Queueing checksum verification and LZ4 decoding, and reading their outcomes.
    pub decode_s: f64,
    /// Building and queueing the gather.
    pub gather_s: f64,
    /// Waiting for the device to finish rounds.
    pub wait_s: f64,
    /// Rounds run.
    pub rounds: u64,
    /// Rounds of resident streams that read some shards from their device copies.
    pub rounds_from_device_copies: u64,
    /// Rounds of resident streams whose piece table went in the gather's launch parameters.
    pub rounds_inline: u64,
    /// Batches gathered by a round together with others (see [`GpuStreamLimits::batch_group_max`]).
    pub batches_grouped: u64,
    /// Waiting for the loader of a stream beyond the registration budget to queue the copy of a
    /// shard a round reads.
    pub copy_wait_s: f64,
}

/// Fills device slots: reads, verifies and decodes blocks on the device and gathers each batch.
pub struct GpuAssembler {
    plan: Arc<StreamPlan>,
    kernels: Arc<Kernels>,
    reader: GpuReader,
    choice: PathChoice,
    files: FileTable,
    stream: Stream,
    /// The block cache (`block_cache.entries` entries of `entry_bytes`), then the shuffle scratch.
    cache: KeptBuffer,
    entry_bytes: u64,
    scratch_offset: u64,
    scratch_bytes: u64,
    jobs_max: usize,
    pieces_max: usize,
    zero_copy: ZeroCopy,
    /// LZ4 blocks read ahead after a cache miss (see [`plan::cache_bytes`]); 0: none.
    lz4_read_ahead: u32,
    /// Set when the whole dataset is read in place (see [`resident`]).
    resident: Option<resident::Resident>,
    layout: HostLayout,
    buffers: Vec<RoundBuffers>,
    /// Where the round buffers go back when the stream closes, and what they were made for.
    pool: Arc<RoundBufferPool>,
    round_shape: RoundShape,
    /// Rounds queued, oldest first (at most one per set of round buffers).
    rounds: VecDeque<PendingRound>,
    /// See [`GpuStreamLimits::wait_spin`].
    wait_spin: std::time::Duration,
    /// Pieces a resident round may pass in its launches' parameters: see
    /// [`GpuStreamLimits::inline_gather_launches`] (0 where the gatherer cannot).
    inline_pieces_max: usize,
    /// A resident round's piece table with its regions resolved (kept for its capacity).
    inline_table: Vec<u8>,
    /// Small batches of a resident stream planned and not queued yet, gathered together by one
    /// round (see [`GpuStreamLimits::batch_group_max`]).
    group: Option<resident::BatchGroup>,
    /// Most batches in `group` (1: no groups).
    group_batches_max: usize,
    /// Most pieces in `group`: one launch's.
    group_pieces_max: usize,
    /// Batches submitted, oldest first.
    batches: VecDeque<PendingBatch>,
    next_buffers: usize,
    /// Raw blocks whose checksum this stream has verified (LZ4 blocks are verified when they are
    /// decoded into the cache, which keeps them).
    verified: HashSet<BlockKey>,
    /// Where the fill time went, for benchmarks.
    pub timings: GpuFillTimings,
    /// Which block each cache entry holds, and which blocks are known to be corrupt.
    block_cache: BlockCache,
    round_stamp: u64,
    metrics: DeviceMetrics,
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
        let resident = resident::Resident::open(
            &plan,
            &files,
            reader.windows(),
            limits,
            reader.resident_fraction_min(),
            &device,
            &metrics,
            shard_pool,
        )?;
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
        // Small batches of a resident stream are gathered several to a round: at 256 rows of 2 KiB a
        // round per batch left the pipeline bound by the host's launches and completions.
        let group_batches_max = if resident.is_some() {
            (BATCH_GROUP_OUT_BYTES / plan.slot_bytes.max(1)).clamp(1, limits.batch_group_max.max(1))
        } else {
            1
        };
        // One launch's inline pieces, and never more than a round's piece table holds (a group
        // whose table cannot go inline goes through it).
        let group_pieces_max = if inline_pieces_max > 0 {
            crate::kernels::GATHER_INLINE_PIECES_MAX.min(pieces_max)
        } else {
            pieces_max
        };
        Ok(GpuAssembler {
            kernels,
            reader,
            choice,
            files,
            stream,
            cache,
            entry_bytes: raw_max,
            scratch_offset,
            scratch_bytes,
            jobs_max,
            pieces_max,
            zero_copy: limits.zero_copy,
            lz4_read_ahead,
            resident,
            layout,
            buffers,
            pool,
            round_shape,
            rounds: VecDeque::with_capacity(rounds_in_flight),
            wait_spin: limits.wait_spin.min(WAIT_SPIN_MAX),
            inline_pieces_max,
            inline_table: Vec::new(),
            group: None,
            group_batches_max,
            group_pieces_max,
            batches: VecDeque::new(),
            next_buffers: 0,
            verified: HashSet::new(),
            timings: GpuFillTimings::default(),
            block_cache: BlockCache::new(cache_entries),
            round_stamp: 0,
            metrics,
            plan,
        })
    }

    /// The stream the batch work runs on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Why cold reads take the path they take (for the log).
    pub fn cold_path_reason(&self) -> &str {
        &self.reader.cold_path_reason
    }

    /// Device memory this stream holds besides its slots, in bytes.
    pub fn device_bytes(&self) -> u64 {
        (self.cache.len()
            + self.buffers.iter().map(|b| b.device_bytes()).sum::<usize>()
            + self.resident.as_ref().map_or(0, |r| r.device_bytes())) as u64
    }

    /// Rounds queued on the device at once: submitting more batches than this ahead of completing
    /// them only makes `submit` wait.
    pub fn rounds_in_flight(&self) -> usize {
        self.buffers.len()
    }

    /// Batches to submit ahead of completing them: as many as the rounds in flight gather.
    pub fn batches_ahead(&self) -> usize {
        self.buffers.len() * self.group_batches_max
    }

    /// Whether the oldest batch submitted is complete already: all its rounds were waited for, and
    /// it is in no group still waiting to be queued. [`Self::complete`] then returns it at once.
    pub fn oldest_complete(&self) -> bool {
        self.batches.front().is_some_and(|b| {
            b.rounds_left == 0 && !self.group.as_ref().is_some_and(|g| g.contains(b.step))
        })
    }

    /// Batches submitted and not completed yet.
    pub fn pending_batches(&self) -> usize {
        self.batches.len()
    }

    fn entry(&self, key: &BlockKey) -> &BlockEntry {
        &self.plan.dataset.shards[key.shard as usize]
            .metadata
            .field_blocks(key.field as usize)[key.block as usize]
    }

    fn block_ref(&self, key: &BlockKey) -> BlockRef {
        let shard = &self.plan.dataset.shards[key.shard as usize];
        BlockRef {
            shard: shard.path.clone(),
            field: shard.metadata.fields[key.field as usize].name.clone(),
            block: key.block,
            stored_offset: self.entry(key).stored_offset,
        }
    }

    /// Fills `slot` with stream step `step` and waits for it: [`Self::submit`] then
    /// [`Self::complete`]. Batches submitted before must have been completed.
    pub fn fill(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
    ) -> Result<FillReport, FillError> {
        assert!(self.batches.is_empty(), "complete submitted batches first");
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
        assert!(slot.len() >= self.plan.slot_bytes);
        if self.resident.is_some() {
            return self.submit_resident(step, slot, released, ready);
        }
        let planned = Instant::now();
        let placements = Arc::new(self.plan.placement_runs(step, RUN_OUT_BYTES_MAX));
        self.timings.plan_s += planned.elapsed().as_secs_f64();
        let rows = placements
            .runs
            .last()
            .map_or(0, |&(first, count)| first + count);
        let runs = placements.runs.len();
        self.wait_released(released)?;
        self.batches.push_back(PendingBatch::new(step, slot, rows));
        let mut run = 0usize;
        while run < runs {
            // The round's buffers must be free: complete the round that used them last.
            if self.rounds.len() == self.buffers.len() {
                self.complete_round()?;
            }
            let planned = Instant::now();
            let round = self.plan_round(&placements, run)?;
            self.timings.plan_s += planned.elapsed().as_secs_f64();
            self.timings.rounds += 1;
            run = round.runs.end;
            self.batches.back_mut().expect("just pushed").rounds_left += 1;
            self.queue_round(step, &placements, round, slot)?;
        }
        if let Some(ready) = ready {
            ready.record(&self.stream)?;
        }
        Ok(())
    }

    /// Waits for the oldest submitted batch, checks what its rounds found, zeroes (or fails on) samples
    /// whose blocks turned out to be corrupt, and returns its step and report. `ready` is the batch's
    /// ready event, recorded again if work was queued on the slot after it.
    pub fn complete(&mut self, ready: Option<&Event>) -> Result<(u64, FillReport), FillError> {
        let oldest = self.batches.front().expect("a batch was submitted").step;
        // The group of batches waiting for more is queued now if the oldest batch is in it. (Not
        // otherwise: a filler completing a batch for each one it submits would queue every group
        // with one batch.)
        if self.group.as_ref().is_some_and(|g| g.contains(oldest)) {
            self.flush_group()?;
        }
        while self.batches.front().is_some_and(|b| b.rounds_left > 0) {
            self.complete_round()?;
        }
        let batch = self.batches.pop_front().expect("checked above");
        debug_assert_eq!(batch.step, oldest);
        if batch.fixed_up {
            if let Some(ready) = ready {
                ready.record(&self.stream)?;
            }
        }
        Ok((
            batch.step,
            FillReport {
                samples: batch.samples,
                replaced: batch.replaced,
            },
        ))
    }
}

impl GpuAssembler {
    /// Makes the stream wait for the consumer's last use of a slot (its `released` event) before
    /// the slot is written again, unless that use is known done on the host: a consumer that
    /// recorded nothing, or whose work completed, costs the device no wait. (The consumer records
    /// the event before it publishes the release, so the query sees that record; a wait queued on
    /// the device would wait for the same one. Skipping the wait gave a consumer 2-5 % at batches of
    /// 256 and 1024 rows: `docs/benchmarks/handoff-2026-11-24.md`, run 25.)
    fn wait_released(&mut self, released: &Event) -> Result<(), FillError> {
        if !released.is_complete()? {
            self.stream.wait(released)?;
        }
        Ok(())
    }
}

impl Drop for GpuAssembler {
    fn drop(&mut self) {
        // Queued rounds read the staging buffers and write slots: let them finish first.
        let synchronized = self.stream.synchronize();
        if let Some(resident) = &mut self.resident {
            resident.release();
        }
        // Round buffers whose work is known done (the rounds', and the reads into their staging
        // on the reader's copy stream) go back for the next stream on the device, and so do the
        // block cache and the region table; otherwise they are freed.
        if synchronized.is_ok() && self.reader.stream().synchronize().is_ok() {
            for buffers in self.buffers.drain(..) {
                self.pool.put(self.round_shape, buffers);
            }
        } else {
            self.cache.discard();
            if let Some(resident) = &mut self.resident {
                resident.discard_buffers();
            }
        }
    }
}
