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

use std::collections::{BTreeSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};

use super::assemble::{
    BlockKey, CorruptPolicy, FieldPlan, FillError, FillReport, Placement, PlacementRuns, StreamPlan,
};
use crate::decode::BlockRef;
use crate::device::{
    fill_async, DeviceBuffer, DeviceError, DeviceMemory, Event, ExportableBuffer, PinnedBuffer,
    Stream,
};
use crate::format::{BlockEntry, Codec, Filter};
use crate::kernels::{
    GatherOp, GatherOutcome, GatherPlan, Kernels, Lz4Job, Lz4Outcome, Lz4Status, Xxh3Job,
    Xxh3Outcome, Xxh3Status, GATHER_OUTCOME_BYTES, GATHER_PIECE_BYTES, LZ4_JOB_BYTES,
    LZ4_OUTCOME_BYTES, XXH3_JOB_BYTES, XXH3_OUTCOME_BYTES,
};
use crate::metrics::{Metrics, ReadPath as MetricsPath};
use crate::storage::gpu::{DeviceExtent, GpuReader, PathChoice, ReadPath};
use crate::storage::{DirectIo, FileId, FileTable, IO_ALIGN_BYTES};

/// Most sets of round buffers a stream may ask for (see [`GpuStreamLimits::rounds_in_flight`]).
pub const ROUNDS_IN_FLIGHT_MAX: usize = 4;

/// Largest delivered bytes per field of a run of consecutive rows planned as one (see
/// [`StreamPlan::placement_runs`]).
const RUN_OUT_BYTES_MAX: usize = 1 << 20;

/// Largest output of a gather piece made by merging adjacent samples: small enough that a batch of
/// consecutive samples still spreads over many thread blocks.
const MERGED_PIECE_OUT_BYTES_MAX: u64 = 64 << 10;

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
}

impl GpuStreamLimits {
    /// Defaults for a GPU node: 64 MiB staging per round in flight, a 256 MiB block cache, 64 MiB of
    /// shuffle scratch, 64 Ki gather pieces (2 MiB of table) per round, three rounds in flight.
    pub fn node_defaults() -> GpuStreamLimits {
        GpuStreamLimits {
            staging_bytes: 64 << 20,
            cache_bytes: 256 << 20,
            scratch_bytes: 64 << 20,
            pieces_max: 64 << 10,
            rounds_in_flight: 3,
        }
    }
}

/// Host time spent in each phase of filling slots. Device work is asynchronous: `wait_s` is the time
/// the host waited for it; the rest is the host's own work (planning, queueing reads and kernels,
/// reading outcomes).
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuFillTimings {
    /// Planning rounds on the host.
    pub plan_s: f64,
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
}

/// A decoded LZ4 block in the cache, or the reason a block is unusable.
#[derive(Clone)]
enum CacheEntry {
    /// In cache entry `index`; `stamp` is the round that last used it. Its decode may still be in
    /// flight (stream order makes it visible to later rounds) and its checks pending until the round
    /// that decoded it completes.
    Decoded { index: u32, stamp: u64 },
    /// Corrupt or unreadable; the message names shard, field and block.
    Corrupt(Arc<String>),
}

/// The blocks a round reads, and where each goes.
#[derive(Default)]
struct Round {
    /// Raw blocks read into staging this round, and where.
    staged: HashMap<BlockKey, u64>,
    /// LZ4 blocks to read and decode this round: key, staging offset, cache entry, scratch offset.
    decode: Vec<(BlockKey, u64, u32, Option<u64>)>,
    /// Cached blocks that rows of this round use (they must not be evicted by it).
    pinned: usize,
    staging_used: u64,
    scratch_used: u64,
    pieces: usize,
    /// First run and one past the last run of the batch in this round.
    runs: Range<usize>,
}

/// Offsets of the tables and outcomes in a round's pinned host buffer.
#[derive(Clone, Copy)]
struct HostLayout {
    xxh3_jobs: usize,
    lz4_jobs: usize,
    pieces: usize,
    xxh3_outcomes: usize,
    lz4_outcomes: usize,
    gather_outcome: usize,
    bytes: usize,
}

impl HostLayout {
    fn new(jobs_max: usize, pieces_max: usize) -> HostLayout {
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let start = at;
            at = (at + bytes).div_ceil(64) * 64;
            start
        };
        let xxh3_jobs = take(jobs_max * XXH3_JOB_BYTES);
        let lz4_jobs = take(jobs_max * LZ4_JOB_BYTES);
        let pieces = take(pieces_max * GATHER_PIECE_BYTES);
        let xxh3_outcomes = take(jobs_max * XXH3_OUTCOME_BYTES);
        let lz4_outcomes = take(jobs_max * LZ4_OUTCOME_BYTES);
        let gather_outcome = take(GATHER_OUTCOME_BYTES);
        HostLayout {
            xxh3_jobs,
            lz4_jobs,
            pieces,
            xxh3_outcomes,
            lz4_outcomes,
            gather_outcome,
            bytes: at,
        }
    }
}

/// The buffers of one round in flight.
struct RoundBuffers {
    staging: DeviceBuffer,
    lz4_jobs: DeviceBuffer,
    lz4_outcomes: DeviceBuffer,
    xxh3_jobs: DeviceBuffer,
    xxh3_outcomes: DeviceBuffer,
    pieces: DeviceBuffer,
    gather_outcome: DeviceBuffer,
    /// Tables are written here and uploaded; outcomes are downloaded here (see [`HostLayout`]).
    host: PinnedBuffer,
    /// Recorded after the round's last work (outcome downloads included); sleeps when waited on.
    done: Event,
}

impl RoundBuffers {
    fn device_bytes(&self) -> usize {
        self.staging.len()
            + self.lz4_jobs.len()
            + self.lz4_outcomes.len()
            + self.xxh3_jobs.len()
            + self.xxh3_outcomes.len()
            + self.pieces.len()
            + self.gather_outcome.len()
    }
}

/// A round queued on the device whose outcomes have not been read yet.
struct PendingRound {
    buffers: usize,
    /// The batch (stream step) it belongs to.
    step: u64,
    runs: Range<usize>,
    placements: Arc<PlacementRuns>,
    /// Blocks whose checksum the round verifies, with the checksum they must have.
    checks: Vec<(BlockKey, u64)>,
    /// LZ4 blocks the round decodes, and their cache entries.
    decoded: Vec<(BlockKey, u32)>,
    /// Rows already zeroed because their blocks were known to be corrupt when the round was queued.
    replaced: Vec<usize>,
    /// [`GpuAssembler::corrupt_marks`] when the round was planned: if it moved by completion, rows
    /// that used cached blocks found corrupt since are checked again.
    corrupt_marks: u64,
    /// Whether a gather ran (its outcome is to be checked).
    gathered: bool,
}

/// One piece of a gather before merging: source, source offset, slot offset, elements, conversion.
type GatherRun = (u16, u64, u64, u64, GatherOp);

/// A batch submitted and not yet completed.
struct PendingBatch {
    step: u64,
    /// The slot's device address and length, for zeroing samples found corrupt at completion.
    slot_ptr: u64,
    slot_bytes: usize,
    samples: u32,
    replaced: u32,
    /// Rounds of this batch not completed yet.
    rounds_left: usize,
    /// Whether work was queued on the slot after its ready event was recorded.
    fixed_up: bool,
}

/// A slot seen through its device address (the ring owns the allocation).
struct SlotRange {
    ptr: u64,
    bytes: usize,
}

impl DeviceMemory for SlotRange {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.bytes
    }
}

/// Fills device slots: reads, verifies and decodes blocks on the device and gathers each batch.
pub struct GpuAssembler {
    plan: Arc<StreamPlan>,
    kernels: Arc<Kernels>,
    reader: GpuReader,
    choice: PathChoice,
    files: FileTable,
    stream: Stream,
    /// The block cache (`cache_entries` entries of `entry_bytes`), then the shuffle scratch.
    cache: DeviceBuffer,
    entry_bytes: u64,
    cache_entries: u32,
    scratch_offset: u64,
    scratch_bytes: u64,
    jobs_max: usize,
    pieces_max: usize,
    layout: HostLayout,
    buffers: Vec<RoundBuffers>,
    /// Rounds queued, oldest first (at most one per set of round buffers).
    rounds: VecDeque<PendingRound>,
    /// Batches submitted, oldest first.
    batches: VecDeque<PendingBatch>,
    next_buffers: usize,
    /// Raw blocks whose checksum this stream has verified (LZ4 blocks are verified when they are
    /// decoded into the cache, which keeps them).
    verified: HashSet<BlockKey>,
    /// Where the fill time went, for benchmarks.
    pub timings: GpuFillTimings,
    blocks: HashMap<BlockKey, CacheEntry>,
    /// The decoded blocks by (last round used, key): the least recently used first.
    lru: BTreeSet<(u64, BlockKey)>,
    free_entries: Vec<u32>,
    round_stamp: u64,
    /// Count of cached blocks found corrupt so far.
    corrupt_marks: u64,
    metrics: Arc<Metrics>,
}

/// Largest staged size of any block of the stream's fields (stored bytes rounded up to whole pages)
/// and largest decoded size, over the whole dataset.
fn block_sizes_max(plan: &StreamPlan) -> (u64, u64) {
    let align = IO_ALIGN_BYTES;
    let mut staged = align;
    let mut raw = align;
    for shard in &plan.dataset.shards {
        for field in &plan.fields {
            for block in shard.metadata.field_blocks(field.field_index) {
                staged = staged.max((block.stored_bytes as u64).div_ceil(align) * align);
                raw = raw.max(block.raw_bytes as u64);
            }
        }
    }
    (staged, raw.div_ceil(16) * 16)
}

fn device_error(error: DeviceError) -> FillError {
    FillError::Device(error.to_string())
}

/// Copies `table` into a round's pinned buffer at `host_offset` and queues its upload to `device` on
/// `stream`.
fn upload_table(
    stream: &Stream,
    host: &mut PinnedBuffer,
    host_offset: usize,
    device: &DeviceBuffer,
    table: &[u8],
) -> Result<(), FillError> {
    host.as_mut_slice()[host_offset..host_offset + table.len()].copy_from_slice(table);
    // SAFETY: a round's pinned tables are written again only after the host waited for the round, and
    // its device tables are read only by its kernels, queued after the upload on the same stream.
    unsafe { host.upload_async(stream, host_offset, device, 0, table.len()) }.map_err(device_error)
}

fn staged_bytes(entry: &BlockEntry) -> u64 {
    (entry.stored_bytes as u64).div_ceil(IO_ALIGN_BYTES) * IO_ALIGN_BYTES
}

impl GpuAssembler {
    /// Opens the dataset's shards and allocates the stream's device memory on `reader`'s device.
    pub fn new(
        plan: Arc<StreamPlan>,
        kernels: Arc<Kernels>,
        reader: GpuReader,
        choice: PathChoice,
        limits: &GpuStreamLimits,
        metrics: Arc<Metrics>,
    ) -> Result<GpuAssembler, FillError> {
        let device = reader.stream().device().clone();
        let mut files = FileTable::new(plan.dataset.shards.len());
        for shard in &plan.dataset.shards {
            files.open(&shard.path, DirectIo::Prefer)?;
        }
        let (staged_max, raw_max) = block_sizes_max(&plan);
        let staging_bytes = (limits.staging_bytes as u64).max(staged_max);
        let cache_entries = (limits.cache_bytes as u64 / raw_max).clamp(1, u32::MAX as u64) as u32;
        let scratch_bytes = (limits.scratch_bytes as u64).max(raw_max);
        // The shuffle scratch follows the cache entries in the same buffer (the decoder writes both).
        // One scratch serves every round: rounds run one after the other on the compute stream.
        let scratch_offset = cache_entries as u64 * raw_max;
        let stream = Stream::new(&device).map_err(device_error)?;
        let cache = DeviceBuffer::new(&device, (scratch_offset + scratch_bytes) as usize)
            .map_err(device_error)?;
        // At most one job per staged page: a bound on the jobs of one round.
        let jobs_max = (staging_bytes / IO_ALIGN_BYTES) as usize;
        let pieces_max = limits.pieces_max.max(1);
        let layout = HostLayout::new(jobs_max, pieces_max);
        let rounds_in_flight = limits.rounds_in_flight.clamp(2, ROUNDS_IN_FLIGHT_MAX);
        let mut buffers = Vec::with_capacity(rounds_in_flight);
        for _ in 0..rounds_in_flight {
            let new = |bytes: usize| DeviceBuffer::new(&device, bytes).map_err(device_error);
            buffers.push(RoundBuffers {
                staging: new(staging_bytes as usize)?,
                lz4_jobs: new(jobs_max * LZ4_JOB_BYTES)?,
                lz4_outcomes: new(jobs_max * LZ4_OUTCOME_BYTES)?,
                xxh3_jobs: new(jobs_max * XXH3_JOB_BYTES)?,
                xxh3_outcomes: new(jobs_max * XXH3_OUTCOME_BYTES)?,
                pieces: new(pieces_max * GATHER_PIECE_BYTES)?,
                gather_outcome: new(GATHER_OUTCOME_BYTES)?,
                host: PinnedBuffer::new(&device, layout.bytes).map_err(device_error)?,
                done: Event::new_blocking(&device).map_err(device_error)?,
            });
        }
        Ok(GpuAssembler {
            kernels,
            reader,
            choice,
            files,
            stream,
            cache,
            entry_bytes: raw_max,
            cache_entries,
            scratch_offset,
            scratch_bytes,
            jobs_max,
            pieces_max,
            layout,
            buffers,
            rounds: VecDeque::with_capacity(rounds_in_flight),
            batches: VecDeque::new(),
            next_buffers: 0,
            verified: HashSet::new(),
            timings: GpuFillTimings::default(),
            blocks: HashMap::new(),
            lru: BTreeSet::new(),
            free_entries: (0..cache_entries).rev().collect(),
            round_stamp: 0,
            corrupt_marks: 0,
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
        (self.cache.len() + self.buffers.iter().map(|b| b.device_bytes()).sum::<usize>()) as u64
    }

    /// Rounds queued on the device at once: submitting more batches than this ahead of completing
    /// them only makes `submit` wait.
    pub fn rounds_in_flight(&self) -> usize {
        self.buffers.len()
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
        slot: &ExportableBuffer,
        released: &Event,
    ) -> Result<FillReport, FillError> {
        assert!(self.batches.is_empty(), "complete submitted batches first");
        self.submit(step, slot, released, None)?;
        let (_, report) = self.complete(None)?;
        Ok(report)
    }

    /// Queues stream step `step` into `slot`. The slot's previous contents may still be read by the
    /// consumer until `released` completes: the first write waits for it on the device. `ready` (if
    /// any) is recorded on the stream after the batch's last work. The batch is not to be handed off
    /// before [`Self::complete`] has returned it: only then are its blocks known to be sound.
    ///
    /// The slot must stay allocated until the batch is completed.
    pub fn submit(
        &mut self,
        step: u64,
        slot: &ExportableBuffer,
        released: &Event,
        ready: Option<&Event>,
    ) -> Result<(), FillError> {
        assert!(slot.len() >= self.plan.slot_bytes);
        let planned = Instant::now();
        let placements = Arc::new(self.plan.placement_runs(step, RUN_OUT_BYTES_MAX));
        self.timings.plan_s += planned.elapsed().as_secs_f64();
        let rows = placements
            .runs
            .last()
            .map_or(0, |&(first, count)| first + count);
        let runs = placements.runs.len();
        self.stream.wait(released).map_err(device_error)?;
        self.batches.push_back(PendingBatch {
            step,
            slot_ptr: slot.device_ptr(),
            slot_bytes: slot.len(),
            samples: rows as u32,
            replaced: 0,
            rounds_left: 0,
            fixed_up: false,
        });
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
            ready.record(&self.stream).map_err(device_error)?;
        }
        Ok(())
    }

    /// Waits for the oldest submitted batch, checks what its rounds found, zeroes (or fails on) samples
    /// whose blocks turned out to be corrupt, and returns its step and report. `ready` is the batch's
    /// ready event, recorded again if work was queued on the slot after it.
    pub fn complete(&mut self, ready: Option<&Event>) -> Result<(u64, FillReport), FillError> {
        let oldest = self.batches.front().expect("a batch was submitted").step;
        while self.batches.front().is_some_and(|b| b.rounds_left > 0) {
            self.complete_round()?;
        }
        let batch = self.batches.pop_front().expect("checked above");
        debug_assert_eq!(batch.step, oldest);
        if batch.fixed_up {
            if let Some(ready) = ready {
                ready.record(&self.stream).map_err(device_error)?;
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

    /// Chooses the runs of the next round, starting at run `first`, and where their blocks go. LZ4
    /// blocks get their cache entries here (the entry is known to later rounds at once).
    fn plan_round(&mut self, batch: &PlacementRuns, first: usize) -> Result<Round, FillError> {
        self.round_stamp += 1;
        let stamp = self.round_stamp;
        let plan = Arc::clone(&self.plan);
        let fields = &plan.fields;
        let mut round = Round {
            runs: first..first,
            ..Round::default()
        };
        // What the current run adds to the round, checked before anything is committed.
        let mut new_staged: Vec<(BlockKey, u64)> = Vec::new();
        let mut new_decoded: Vec<(BlockKey, u64, Option<u64>)> = Vec::new();
        let mut new_pins: Vec<(BlockKey, u64)> = Vec::new();
        // Consecutive runs mostly share a block: the last block committed needs no lookup.
        let mut last_committed: Option<BlockKey> = None;
        for run in first..batch.runs.len() {
            let rows = batch.runs[run].1;
            let placements = &batch.placements[run * fields.len()..(run + 1) * fields.len()];
            new_staged.clear();
            new_decoded.clear();
            new_pins.clear();
            let mut staging = round.staging_used;
            let mut scratch = round.scratch_used;
            let mut pieces = 0usize;
            for (field, placement) in fields.iter().zip(placements) {
                // GatherPlan::push splits a piece at GATHER_PIECE_OUT_BYTES_MAX output bytes, so a
                // run gathered whole takes at most one piece per block plus one per such span; if
                // its rows are gathered one by one (a corrupt block), each row takes one piece per
                // block it overlaps (at most the run's blocks plus its rows, over all rows) plus one
                // per such span of the row.
                pieces += placement.blocks.len()
                    + rows
                        * (1 + (field.sample_bytes_out as u64)
                            .div_ceil(crate::kernels::GATHER_PIECE_OUT_BYTES_MAX)
                            as usize);
                for block in placement.blocks.clone() {
                    let key = BlockKey {
                        shard: placement.shard as u32,
                        field: field.field_index as u32,
                        block,
                    };
                    if last_committed == Some(key) {
                        continue;
                    }
                    let entry = *self.entry(&key);
                    match (entry.codec, self.blocks.get(&key)) {
                        (Codec::Raw, _) => {
                            if !round.staged.contains_key(&key)
                                && !new_staged.iter().any(|(k, _)| *k == key)
                            {
                                new_staged.push((key, staging));
                                staging += staged_bytes(&entry);
                            }
                        }
                        (Codec::Lz4, Some(CacheEntry::Decoded { stamp: used, .. })) => {
                            if *used != stamp && !new_pins.iter().any(|(k, _)| *k == key) {
                                new_pins.push((key, *used));
                            }
                        }
                        (Codec::Lz4, Some(CacheEntry::Corrupt(_))) => {}
                        (Codec::Lz4, None) => {
                            if !new_decoded.iter().any(|(k, ..)| *k == key) {
                                let shuffled = entry.filter == Filter::ByteShuffle
                                    && field.stored.size_bytes() > 1;
                                let scratch_at = shuffled.then(|| {
                                    let at = self.scratch_offset + scratch;
                                    scratch += (entry.raw_bytes as u64).div_ceil(16) * 16;
                                    at
                                });
                                new_decoded.push((key, staging, scratch_at));
                                staging += staged_bytes(&entry);
                            }
                        }
                    }
                }
            }
            let entries_needed =
                round.decode.len() + new_decoded.len() + round.pinned + new_pins.len();
            let jobs_needed =
                round.staged.len() + new_staged.len() + round.decode.len() + new_decoded.len();
            let fits = staging <= self.buffers[0].staging.len() as u64
                && scratch <= self.scratch_bytes
                && round.pieces + pieces <= self.pieces_max
                && jobs_needed <= self.jobs_max
                && entries_needed <= self.cache_entries as usize;
            if !fits {
                if round.runs.is_empty() {
                    return Err(FillError::Device(format!(
                        "sample {} of the batch needs more device memory than one round has \
                         (staging {} bytes, scratch {} bytes, {} gather pieces, {} cache entries of \
                         {} bytes): raise the GPU stream limits",
                        batch.runs[run].0,
                        self.buffers[0].staging.len(),
                        self.scratch_bytes,
                        self.pieces_max,
                        self.cache_entries,
                        self.entry_bytes
                    )));
                }
                break;
            }
            // Commit the row: its cached blocks become the round's (not evictable by it).
            for &(key, used) in &new_pins {
                self.lru.remove(&(used, key));
                self.lru.insert((stamp, key));
                if let Some(CacheEntry::Decoded { stamp: s, .. }) = self.blocks.get_mut(&key) {
                    *s = stamp;
                }
                round.pinned += 1;
            }
            for &(key, at) in &new_staged {
                round.staged.insert(key, at);
            }
            for &(key, at, scratch_at) in &new_decoded {
                let index = self.take_entry(stamp);
                self.blocks
                    .insert(key, CacheEntry::Decoded { index, stamp });
                self.lru.insert((stamp, key));
                round.pinned += 1;
                round.decode.push((key, at, index, scratch_at));
            }
            if fields.len() == 1 {
                // With several fields the runs alternate between them: only a single-field run's
                // last block is sure to be the next run's first.
                let placement = &placements[0];
                last_committed = placement.blocks.clone().next_back().map(|block| BlockKey {
                    shard: placement.shard as u32,
                    field: fields[0].field_index as u32,
                    block,
                });
            }
            round.staging_used = staging;
            round.scratch_used = scratch;
            round.pieces += pieces;
            round.runs.end = run + 1;
        }
        Ok(round)
    }

    /// A cache entry for a new block of round `stamp`: a free one, else the least recently used one
    /// that the round does not use. An entry whose old block is still read by a queued round is safe
    /// to reuse: the decode into it is queued after that round's gather, on the same stream.
    fn take_entry(&mut self, stamp: u64) -> u32 {
        if let Some(index) = self.free_entries.pop() {
            return index;
        }
        let &(used, key) = self
            .lru
            .first()
            .expect("plan_round checked that an entry can be evicted");
        assert!(
            used != stamp,
            "plan_round checked that an entry can be evicted"
        );
        self.lru.remove(&(used, key));
        match self.blocks.remove(&key) {
            Some(CacheEntry::Decoded { index, .. }) => index,
            _ => unreachable!("the LRU lists decoded blocks only"),
        }
    }

    /// Queues one round: reads, checks, decodes and gathers, then the outcome downloads.
    fn queue_round(
        &mut self,
        step: u64,
        placements: &Arc<PlacementRuns>,
        round: Round,
        slot: &ExportableBuffer,
    ) -> Result<(), FillError> {
        let index = self.next_buffers;
        self.next_buffers = (self.next_buffers + 1) % self.buffers.len();
        let layout = self.layout;
        let corrupt_marks = self.corrupt_marks;

        // 1. Read every block of the round into staging, merging blocks adjacent in a file.
        let read_started = Instant::now();
        let mut reads: Vec<(BlockKey, u64)> =
            round.staged.iter().map(|(k, &at)| (*k, at)).collect();
        reads.extend(round.decode.iter().map(|&(key, at, ..)| (key, at)));
        reads.sort_unstable_by_key(|&(key, at)| (key.shard, self.entry(&key).stored_offset, at));
        let mut extents: Vec<DeviceExtent> = Vec::with_capacity(reads.len());
        let mut extent_of: Vec<usize> = Vec::with_capacity(reads.len());
        for &(key, at) in &reads {
            let entry = self.entry(&key);
            let len = staged_bytes(entry) as usize;
            match extents.last_mut() {
                Some(last)
                    if last.file == FileId(key.shard)
                        && last.offset + last.len as u64 == entry.stored_offset
                        && last.dest_offset + last.len == at as usize =>
                {
                    last.len += len;
                }
                _ => extents.push(DeviceExtent {
                    file: FileId(key.shard),
                    offset: entry.stored_offset,
                    len,
                    dest_offset: at as usize,
                }),
            }
            extent_of.push(extents.len() - 1);
        }
        // SAFETY: the staging buffer of this round is only touched by this round's work on the compute
        // stream, which waits for the copies; the round that used it before has completed (the host
        // waited for it), and the buffer lives as long as the assembler, which drains its rounds
        // before it is dropped.
        let results = unsafe {
            self.reader.read_async(
                &self.files,
                &extents,
                &self.buffers[index].staging,
                self.choice,
                &self.stream,
            )
        }
        .map_err(|e| FillError::Device(e.to_string()))?;
        let mut unreadable: HashMap<BlockKey, String> = HashMap::new();
        for ((key, _), &extent) in reads.iter().zip(&extent_of) {
            match &results[extent] {
                Ok(path) => {
                    let metrics_path = match path {
                        ReadPath::PageCache => MetricsPath::PageCache,
                        ReadPath::Bounce => MetricsPath::Uring,
                        ReadPath::CuFile => MetricsPath::CuFile,
                    };
                    self.metrics
                        .add_read_bytes(metrics_path, self.entry(key).stored_bytes as u64);
                }
                Err(error) => {
                    if self.entry(key).codec == Codec::Raw {
                        self.metrics.add_corrupt_blocks(1);
                    }
                    unreadable.insert(*key, format!("{}: {error}", self.block_ref(key)));
                }
            }
        }
        // An LZ4 block that could not be read is corrupt for good: later rounds skip it.
        for &(key, _, entry_index, _) in &round.decode {
            if let Some(message) = unreadable.get(&key) {
                self.mark_corrupt(key, entry_index, message.clone());
            }
        }
        self.timings.read_s += read_started.elapsed().as_secs_f64();

        // 2. Verify the checksums of the blocks read for the first time, and decode the LZ4 blocks
        //    into their cache entries; the outcomes are read when the round completes.
        let decode_started = Instant::now();
        let mut checks: Vec<(BlockKey, u64)> = Vec::new();
        let mut check_jobs: Vec<Xxh3Job> = Vec::new();
        for &(key, at) in &reads {
            let entry = self.entry(&key);
            let first_time = match entry.codec {
                Codec::Raw => !self.verified.contains(&key),
                Codec::Lz4 => true,
            };
            if first_time && !unreadable.contains_key(&key) {
                check_jobs.push(Xxh3Job::for_block(entry, at));
                checks.push((key, entry.checksum));
            }
        }
        let mut jobs: Vec<Lz4Job> = Vec::with_capacity(round.decode.len());
        let mut decoded: Vec<(BlockKey, u32)> = Vec::with_capacity(round.decode.len());
        for &(key, at, entry_index, scratch_at) in &round.decode {
            if unreadable.contains_key(&key) {
                continue;
            }
            let entry = *self.entry(&key);
            let element_bytes = self.plan.dataset.manifest.fields[key.field as usize]
                .dtype
                .size_bytes() as u32;
            let job = Lz4Job::for_block(
                &entry,
                element_bytes,
                at,
                entry_index as u64 * self.entry_bytes,
                scratch_at.unwrap_or(0),
            )
            .expect("only LZ4 blocks are decoded");
            jobs.push(job);
            decoded.push((key, entry_index));
        }
        let buffers = &mut self.buffers[index];
        if !check_jobs.is_empty() {
            let table = Xxh3Job::encode_all(&check_jobs);
            upload_table(
                &self.stream,
                &mut buffers.host,
                layout.xxh3_jobs,
                &buffers.xxh3_jobs,
                &table,
            )?;
            // SAFETY: the tables and the staging buffer belong to this round and are not touched
            // until it completes.
            unsafe {
                self.kernels.xxh3.verify_async(
                    &self.stream,
                    &buffers.xxh3_jobs,
                    check_jobs.len() as u32,
                    &buffers.staging,
                    &buffers.xxh3_outcomes,
                )
            }
            .map_err(device_error)?;
        }
        if !jobs.is_empty() {
            let table = Lz4Job::encode_all(&jobs);
            upload_table(
                &self.stream,
                &mut buffers.host,
                layout.lz4_jobs,
                &buffers.lz4_jobs,
                &table,
            )?;
            // SAFETY: the tables and buffers belong to this round (the cache entries to its blocks,
            // in stream order) and are not touched until it completes; staging, scratch and cache
            // are different allocations.
            unsafe {
                self.kernels.lz4.decode_async(
                    &self.stream,
                    &buffers.lz4_jobs,
                    jobs.len() as u32,
                    &buffers.staging,
                    &self.cache,
                    &buffers.lz4_outcomes,
                )
            }
            .map_err(device_error)?;
        }
        self.metrics.add_decode_time(decode_started.elapsed());
        self.timings.decode_s += decode_started.elapsed().as_secs_f64();

        // 3. Gather the round's rows into the slot. Rows whose blocks are known to be corrupt are
        //    zeroed (or fail the stream) now; rows whose blocks this round checks are gathered and
        //    checked when the round completes.
        let gather_started = Instant::now();
        let stream_plan = Arc::clone(&self.plan);
        let fields = &stream_plan.fields;
        let mut plan = GatherPlan::new();
        let mut replaced: Vec<usize> = Vec::new();
        // Each run is gathered whole, unless a block it reads is known to be corrupt: then its rows
        // are gathered one by one and those that read the corrupt block are zeroed (or fail).
        let mut pieces: Vec<GatherRun> = Vec::new();
        for run in round.runs.clone() {
            let (first_row, rows) = placements.runs[run];
            let run_placements =
                &placements.placements[run * fields.len()..(run + 1) * fields.len()];
            // Without an unreadable block this round and with no block ever found corrupt (every
            // corrupt entry counts in `corrupt_marks`), no row can be corrupt: skip the look-ups.
            let corrupt = if unreadable.is_empty() && self.corrupt_marks == 0 {
                Vec::new()
            } else {
                self.corrupt_rows(run_placements, rows, |key| match self.entry(key).codec {
                    Codec::Raw => unreadable.get(key).cloned(),
                    Codec::Lz4 => match self.blocks.get(key) {
                        Some(CacheEntry::Corrupt(message)) => Some(message.to_string()),
                        _ => None,
                    },
                })
            };
            if let Some((_, message)) = corrupt.first() {
                if self.plan.on_corrupt == CorruptPolicy::Fail {
                    return Err(FillError::Corrupt(message.clone()));
                }
            }
            pieces.clear();
            for (field, placement) in fields.iter().zip(run_placements) {
                let out_at = (field.offset + first_row * field.sample_bytes_out) as u64;
                if corrupt.is_empty() {
                    self.range_pieces(
                        &round,
                        field,
                        placement,
                        placement.start..placement.end,
                        out_at,
                        &mut pieces,
                    );
                    continue;
                }
                let width = field.sample_bytes_in as u64;
                for i in 0..rows {
                    if corrupt.iter().any(|(bad, _)| *bad == i) {
                        continue;
                    }
                    let start = placement.start + i as u64 * width;
                    self.range_pieces(
                        &round,
                        field,
                        placement,
                        start..start + width,
                        out_at + (i * field.sample_bytes_out) as u64,
                        &mut pieces,
                    );
                }
            }
            for &(source, src_offset, dst_offset, elements, op) in &pieces {
                plan.push_merged(
                    source,
                    src_offset,
                    dst_offset,
                    elements,
                    op,
                    1.0,
                    MERGED_PIECE_OUT_BYTES_MAX,
                );
            }
            replaced.extend(corrupt.iter().map(|(i, _)| first_row + i));
        }
        let count = plan.pieces().len();
        assert!(count <= self.pieces_max, "plan_round bounds the pieces");
        let buffers = &mut self.buffers[index];
        if count > 0 {
            let table = plan.encode();
            upload_table(
                &self.stream,
                &mut buffers.host,
                layout.pieces,
                &buffers.pieces,
                &table,
            )?;
            // SAFETY: the table, the sources and the outcome belong to this round and are not
            // rewritten before it completes; the slot is this filler's (its lease is Filling and the
            // consumer's release event was waited on); the sources do not overlap the slot.
            unsafe {
                self.kernels.gather.gather_async(
                    &self.stream,
                    &buffers.pieces,
                    count as u32,
                    &[&self.cache, &buffers.staging],
                    slot,
                    &buffers.gather_outcome,
                )
            }
            .map_err(device_error)?;
        }
        // The substitute for a corrupt sample is all zeros in every field, as on the CPU backend.
        for &row in &replaced {
            self.zero_row(slot, row)?;
        }
        self.metrics.add_gather_time(gather_started.elapsed());
        self.timings.gather_s += gather_started.elapsed().as_secs_f64();

        // 4. Bring the outcomes back to pinned memory and mark the round's end.
        let buffers = &self.buffers[index];
        // SAFETY: the pinned outcome areas are only read by the host after `done` has completed.
        unsafe {
            buffers
                .host
                .download_async(
                    &self.stream,
                    &buffers.xxh3_outcomes,
                    0,
                    layout.xxh3_outcomes,
                    checks.len() * XXH3_OUTCOME_BYTES,
                )
                .map_err(device_error)?;
            buffers
                .host
                .download_async(
                    &self.stream,
                    &buffers.lz4_outcomes,
                    0,
                    layout.lz4_outcomes,
                    decoded.len() * LZ4_OUTCOME_BYTES,
                )
                .map_err(device_error)?;
            if count > 0 {
                buffers
                    .host
                    .download_async(
                        &self.stream,
                        &buffers.gather_outcome,
                        0,
                        layout.gather_outcome,
                        GATHER_OUTCOME_BYTES,
                    )
                    .map_err(device_error)?;
            }
        }
        buffers.done.record(&self.stream).map_err(device_error)?;
        if let Some(batch) = self.batches.back_mut() {
            batch.replaced += replaced.len() as u32;
        }
        self.rounds.push_back(PendingRound {
            buffers: index,
            step,
            runs: round.runs,
            placements: Arc::clone(placements),
            checks,
            decoded,
            replaced,
            corrupt_marks,
            gathered: count > 0,
        });
        Ok(())
    }

    /// Appends the pieces that copy raw bytes `range` of `field` (a run's, or one of its rows') from
    /// the blocks of `placement` that overlap it to slot offset `out_at`. Every block is usable: raw
    /// blocks are in this round's staging, LZ4 blocks decoded in the cache.
    fn range_pieces(
        &self,
        round: &Round,
        field: &FieldPlan,
        placement: &Placement,
        range: Range<u64>,
        out_at: u64,
        pieces: &mut Vec<GatherRun>,
    ) {
        let op = GatherOp::for_dtypes(field.stored, field.out)
            .expect("conversions are validated when the stream is planned");
        let mut out_at = out_at;
        for block in placement.blocks.clone() {
            let key = BlockKey {
                shard: placement.shard as u32,
                field: field.field_index as u32,
                block,
            };
            let entry = self.entry(&key);
            let block_end = entry.raw_offset + entry.raw_bytes as u64;
            if block_end <= range.start || entry.raw_offset >= range.end {
                continue;
            }
            let (source, base) = match entry.codec {
                Codec::Raw => (1u16, round.staged[&key]),
                Codec::Lz4 => match self.blocks.get(&key) {
                    Some(CacheEntry::Decoded { index, .. }) => {
                        (0u16, *index as u64 * self.entry_bytes)
                    }
                    _ => unreachable!("the caller checked that every block is usable"),
                },
            };
            let from = range.start.max(entry.raw_offset) - entry.raw_offset;
            let to = range.end.min(block_end) - entry.raw_offset;
            let elements = (to - from) / op.in_bytes();
            pieces.push((source, base + from, out_at, elements, op));
            out_at += elements * op.out_bytes();
        }
    }

    /// The rows of a run (`rows` rows, `placements` one per field) that read a block `corrupt_of`
    /// names, as (row within the run, message), in row order.
    fn corrupt_rows(
        &self,
        placements: &[Placement],
        rows: usize,
        corrupt_of: impl Fn(&BlockKey) -> Option<String>,
    ) -> Vec<(usize, String)> {
        let mut found: Vec<(usize, String)> = Vec::new();
        for (field, placement) in self.plan.fields.iter().zip(placements) {
            let width = field.sample_bytes_in as u64;
            for block in placement.blocks.clone() {
                let key = BlockKey {
                    shard: placement.shard as u32,
                    field: field.field_index as u32,
                    block,
                };
                let Some(message) = corrupt_of(&key) else {
                    continue;
                };
                let entry = self.entry(&key);
                let from = placement.start.max(entry.raw_offset) - placement.start;
                let to =
                    placement.end.min(entry.raw_offset + entry.raw_bytes as u64) - placement.start;
                if to <= from {
                    continue;
                }
                for i in (from / width) as usize..=((to - 1) / width) as usize {
                    if i < rows && !found.iter().any(|(row, _)| *row == i) {
                        found.push((i, message.clone()));
                    }
                }
            }
        }
        found.sort_unstable_by_key(|(row, _)| *row);
        found
    }

    /// Queues zeros over every field of `row` in `slot`.
    fn zero_row(&self, slot: &dyn DeviceMemory, row: usize) -> Result<(), FillError> {
        for field in &self.plan.fields {
            // SAFETY: the range lies in the slot (validated plan); the slot is this filler's until
            // its batch is handed off, and the zeros are queued on the stream after the gather.
            unsafe {
                fill_async(
                    &self.stream,
                    slot,
                    field.offset + row * field.sample_bytes_out,
                    field.sample_bytes_out,
                    0,
                )
            }
            .map_err(device_error)?;
        }
        Ok(())
    }

    /// Records that an LZ4 block is unusable. Its cache entry is released if it still holds the block.
    fn mark_corrupt(&mut self, key: BlockKey, entry_index: u32, message: String) {
        if let Some(CacheEntry::Decoded { index, stamp }) = self.blocks.get(&key) {
            if *index != entry_index {
                // The block was evicted and decoded again since: that round reports on its own copy.
                return;
            }
            self.lru.remove(&(*stamp, key));
            self.free_entries.push(entry_index);
        }
        self.blocks
            .insert(key, CacheEntry::Corrupt(Arc::new(message)));
        self.corrupt_marks += 1;
        self.metrics.add_corrupt_blocks(1);
    }

    /// Waits for the oldest queued round and acts on its outcomes.
    fn complete_round(&mut self) -> Result<(), FillError> {
        let round = self.rounds.pop_front().expect("a round is queued");
        let layout = self.layout;
        let waited = Instant::now();
        self.buffers[round.buffers]
            .done
            .synchronize()
            .map_err(device_error)?;
        self.timings.wait_s += waited.elapsed().as_secs_f64();
        let outcomes_started = Instant::now();
        let host = self.buffers[round.buffers].host.as_slice();
        let xxh3 = Xxh3Outcome::decode_all(
            &host[layout.xxh3_outcomes
                ..layout.xxh3_outcomes + round.checks.len() * XXH3_OUTCOME_BYTES],
        );
        let lz4 = Lz4Outcome::decode_all(
            &host[layout.lz4_outcomes
                ..layout.lz4_outcomes + round.decoded.len() * LZ4_OUTCOME_BYTES],
        );
        let gather = round.gathered.then(|| {
            GatherOutcome::decode(
                &host[layout.gather_outcome..layout.gather_outcome + GATHER_OUTCOME_BYTES],
            )
        });
        if let Some(outcome) = gather {
            if outcome.faulted_pieces > 0 {
                return Err(FillError::Device(format!(
                    "the gather kernel refused {} pieces (last {}): a bug in the batch plan",
                    outcome.faulted_pieces,
                    outcome.last_faulted_plus_1 - 1
                )));
            }
        }
        // Blocks this round found bad, with the reason.
        let mut bad: HashMap<BlockKey, String> = HashMap::new();
        for (&(key, expected), outcome) in round.checks.iter().zip(&xxh3) {
            if outcome.status == Xxh3Status::Ok {
                if self.entry(&key).codec == Codec::Raw {
                    self.verified.insert(key);
                }
            } else {
                if self.entry(&key).codec == Codec::Raw {
                    self.metrics.add_corrupt_blocks(1);
                }
                bad.insert(
                    key,
                    format!(
                        "{}: checksum mismatch (table says {expected:016x}, payload hashes to {:016x})",
                        self.block_ref(&key),
                        outcome.hash
                    ),
                );
            }
        }
        for (&(key, entry_index), outcome) in round.decoded.iter().zip(&lz4) {
            let message = match bad.get(&key) {
                Some(message) => message.clone(),
                None if outcome.status != Lz4Status::Ok => {
                    let message = format!(
                        "{}: LZ4 block does not decode ({:?} after {} bytes)",
                        self.block_ref(&key),
                        outcome.status,
                        outcome.produced
                    );
                    bad.insert(key, message.clone());
                    message
                }
                None => continue,
            };
            self.mark_corrupt(key, entry_index, message);
        }
        // Rows gathered from a block found bad by this round, or (if blocks were marked corrupt since
        // the round was planned) from a cached block that is now known to be corrupt.
        let recheck_cache = self.corrupt_marks != round.corrupt_marks;
        if !bad.is_empty() || recheck_cache {
            let plan = Arc::clone(&self.plan);
            let fields = &plan.fields;
            let mut fixes: Vec<usize> = Vec::new();
            for run in round.runs.clone() {
                let (first_row, rows) = round.placements.runs[run];
                let run_placements =
                    &round.placements.placements[run * fields.len()..(run + 1) * fields.len()];
                let corrupt = self.corrupt_rows(run_placements, rows, |key| {
                    bad.get(key)
                        .cloned()
                        .or_else(|| match self.blocks.get(key) {
                            Some(CacheEntry::Corrupt(message)) if recheck_cache => {
                                Some(message.to_string())
                            }
                            _ => None,
                        })
                });
                for (i, message) in corrupt {
                    let row = first_row + i;
                    if round.replaced.contains(&row) {
                        continue;
                    }
                    match plan.on_corrupt {
                        CorruptPolicy::Fail => return Err(FillError::Corrupt(message)),
                        CorruptPolicy::Replace => fixes.push(row),
                    }
                }
            }
            if !fixes.is_empty() {
                let batch = self
                    .batches
                    .iter_mut()
                    .find(|b| b.step == round.step)
                    .expect("a queued round's batch is pending");
                batch.replaced += fixes.len() as u32;
                batch.fixed_up = true;
                let slot = SlotRange {
                    ptr: batch.slot_ptr,
                    bytes: batch.slot_bytes,
                };
                for row in fixes {
                    self.zero_row(&slot, row)?;
                }
            }
        }
        if let Some(batch) = self.batches.iter_mut().find(|b| b.step == round.step) {
            batch.rounds_left -= 1;
        }
        self.metrics.add_decode_time(outcomes_started.elapsed());
        self.timings.decode_s += outcomes_started.elapsed().as_secs_f64();
        Ok(())
    }
}

impl Drop for GpuAssembler {
    fn drop(&mut self) {
        // Queued rounds read the staging buffers and write slots: let them finish first.
        let _ = self.stream.synchronize();
    }
}
