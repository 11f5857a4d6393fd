//! Rounds on the device: what a round reads, the buffers of a round in flight, and queueing a round
//! in four phases (read; verify and decode; gather; bring the outcomes back). Completing it is in
//! [`super::complete`].

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::pipeline::CorruptPolicy;
use foldhash::{HashMap, HashMapExt};

use super::{merged_piece_out_bytes, GpuAssembler};
use crate::device::{
    fill_async, Device, DeviceBuffer, DeviceError, DeviceMemory, DeviceRegion, Event, PinnedBuffer,
    Stream,
};
use crate::format::{BlockEntry, Codec};
use crate::kernels::{
    GatherOp, GatherPlan, GatherRegion, Lz4Job, Xxh3Job, GATHER_OUTCOME_BYTES, GATHER_PIECE_BYTES,
    GATHER_REGION_BYTES, GATHER_SOURCES_MAX, LZ4_JOB_BYTES, LZ4_OUTCOME_BYTES, XXH3_JOB_BYTES,
    XXH3_OUTCOME_BYTES,
};
use crate::metrics::ReadPath as MetricsPath;
use crate::pipeline::stream_plan::{
    BlockKey, CorruptBlock, CorruptReason, FillError, PlacementRuns,
};
use crate::storage::gpu::ReadPath;
use crate::storage::windows::WindowId;
use crate::storage::{Extent, FileId, IO_ALIGN_BYTES};

/// Most mapped page-cache windows one round reads in place (its region table, 64 KiB; 256 GiB of
/// 64 MiB windows).
pub(super) const REGIONS_MAX: usize = 4096;

/// One piece of a gather before merging: source, source offset, slot offset, elements, conversion.
/// The planner (`super::plan`) makes them; the round merges them into its gather plan.
pub(super) type GatherRun = (u16, u64, u64, u64, GatherOp);

/// Bytes a block takes in a round's staging buffer: its stored bytes rounded up to whole pages.
pub(super) fn staged_bytes(entry: &BlockEntry) -> u64 {
    (entry.stored_bytes as u64).div_ceil(IO_ALIGN_BYTES) * IO_ALIGN_BYTES
}

/// The blocks a round reads, and where each goes.
#[derive(Default)]
pub(super) struct Round {
    /// Raw blocks read into staging this round, and where.
    pub(super) staged: HashMap<BlockKey, u64>,
    /// Raw blocks the gather reads in place from mapped page-cache windows: region index in
    /// `regions`, and the block's offset in it.
    pub(super) mapped: HashMap<BlockKey, (usize, u64)>,
    /// The mapped windows the round reads (the gather's region table), pinned until the round's
    /// kernels are queued.
    pub(super) regions: Vec<GatherRegion>,
    pub(super) region_windows: Vec<WindowId>,
    /// The region of each (shard, window index).
    pub(super) region_of: HashMap<(u32, u64), usize>,
    /// LZ4 blocks to read and decode this round: key, staging offset, cache entry, scratch offset.
    pub(super) decode: Vec<(BlockKey, u64, u32, Option<u64>)>,
    /// Cached blocks that rows of this round use (they must not be evicted by it).
    pub(super) pinned: usize,
    /// Staging and shuffle scratch used, in bytes.
    pub(super) staging_used: u64,
    pub(super) scratch_used: u64,
    /// Gather pieces (a bound).
    pub(super) pieces: usize,
    /// First run and one past the last run of the batch in this round.
    pub(super) runs: Range<usize>,
}

/// Offsets of the tables and outcomes in a round's pinned host buffer.
#[derive(Clone, Copy)]
pub(super) struct HostLayout {
    pub(super) xxh3_jobs: usize,
    pub(super) lz4_jobs: usize,
    pub(super) pieces: usize,
    pub(super) xxh3_outcomes: usize,
    pub(super) lz4_outcomes: usize,
    pub(super) gather_outcome: usize,
    pub(super) regions: usize,
    pub(super) bytes: usize,
}

impl HostLayout {
    pub(super) fn new(jobs_max: usize, pieces_max: usize) -> HostLayout {
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
        let regions = take(REGIONS_MAX * GATHER_REGION_BYTES);
        HostLayout {
            xxh3_jobs,
            lz4_jobs,
            pieces,
            xxh3_outcomes,
            lz4_outcomes,
            gather_outcome,
            regions,
            bytes: at,
        }
    }
}

/// The buffers of one round in flight.
pub(super) struct RoundBuffers {
    pub(super) staging: DeviceBuffer,
    pub(super) lz4_jobs: DeviceBuffer,
    pub(super) lz4_outcomes: DeviceBuffer,
    pub(super) xxh3_jobs: DeviceBuffer,
    pub(super) xxh3_outcomes: DeviceBuffer,
    pub(super) pieces: DeviceBuffer,
    pub(super) gather_outcome: DeviceBuffer,
    /// The gather's region table.
    pub(super) regions: DeviceBuffer,
    /// Tables are written here and uploaded; outcomes are downloaded here (see [`HostLayout`]).
    pub(super) host: PinnedBuffer,
    /// Recorded after the round's last work (outcome downloads included); sleeps when waited on.
    pub(super) done: Event,
}

impl RoundBuffers {
    /// Allocates the buffers of a round on `device`.
    pub(super) fn new(
        device: &Device,
        staging_bytes: usize,
        jobs_max: usize,
        pieces_max: usize,
        layout: &HostLayout,
    ) -> Result<RoundBuffers, DeviceError> {
        let new = |bytes: usize| DeviceBuffer::new(device, bytes);
        Ok(RoundBuffers {
            staging: new(staging_bytes)?,
            lz4_jobs: new(jobs_max * LZ4_JOB_BYTES)?,
            lz4_outcomes: new(jobs_max * LZ4_OUTCOME_BYTES)?,
            xxh3_jobs: new(jobs_max * XXH3_JOB_BYTES)?,
            xxh3_outcomes: new(jobs_max * XXH3_OUTCOME_BYTES)?,
            pieces: new(pieces_max * GATHER_PIECE_BYTES)?,
            gather_outcome: new(GATHER_OUTCOME_BYTES)?,
            regions: new(REGIONS_MAX * GATHER_REGION_BYTES)?,
            host: PinnedBuffer::new(device, layout.bytes)?,
            done: Event::new_blocking(device)?,
        })
    }

    pub(super) fn device_bytes(&self) -> usize {
        self.staging.len()
            + self.lz4_jobs.len()
            + self.lz4_outcomes.len()
            + self.xxh3_jobs.len()
            + self.xxh3_outcomes.len()
            + self.pieces.len()
            + self.gather_outcome.len()
            + self.regions.len()
    }
}

/// What a set of round buffers was made for: staging bytes, jobs, pieces and host bytes.
pub(super) type RoundShape = (usize, usize, usize, usize);

/// Round buffers kept between streams on one device, so that a stream opened after another
/// finished takes its round buffers (a few device allocations of tens of MiB and a pinned host
/// buffer each, 2 to 3 ms a set) from here instead of allocating them: the set-up shows in the
/// first batch of every stream. A stream hands its sets back when it closes, after its work on the
/// device is done; at most `sets_max` sets are kept (more are freed; sets of another shape, left by
/// another dataset's streams, give way to the current ones), and their device bytes are the
/// `gpufeed_round_buffers_idle_bytes` gauge.
pub struct RoundBufferPool {
    sets: std::sync::Mutex<Vec<(RoundShape, RoundBuffers)>>,
    sets_max: usize,
    /// The device's ordinal, for its per-device figures.
    ordinal: u32,
    /// Where the idle bytes are reported, once the daemon's metrics exist.
    metrics: std::sync::OnceLock<Arc<crate::metrics::Metrics>>,
}

impl RoundBufferPool {
    /// An empty pool of device `ordinal` keeping at most `sets_max` sets.
    pub fn new(sets_max: usize, ordinal: u32) -> RoundBufferPool {
        RoundBufferPool {
            sets: std::sync::Mutex::new(Vec::new()),
            sets_max,
            ordinal,
            metrics: std::sync::OnceLock::new(),
        }
    }

    /// Reports the pool's idle device bytes to `metrics` from now on (the first call wins).
    pub fn report_to(&self, metrics: &Arc<crate::metrics::Metrics>) {
        let sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        if self.metrics.set(Arc::clone(metrics)).is_ok() {
            let bytes: usize = sets.iter().map(|(_, b)| b.device_bytes()).sum();
            metrics.add_round_buffers_idle_bytes(self.ordinal, bytes as i64);
        }
    }

    fn count(&self, bytes: i64) {
        if let Some(metrics) = self.metrics.get() {
            metrics.add_round_buffers_idle_bytes(self.ordinal, bytes);
        }
    }

    /// A kept set of this shape, if any. When there is none, the sets of other shapes (another
    /// dataset's) are freed: the stream about to allocate its own needs the memory more.
    pub(super) fn take(&self, shape: RoundShape) -> Option<RoundBuffers> {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        match sets.iter().position(|(s, _)| *s == shape) {
            Some(index) => {
                let (_, buffers) = sets.swap_remove(index);
                self.count(-(buffers.device_bytes() as i64));
                Some(buffers)
            }
            None => {
                let freed: usize = sets.drain(..).map(|(_, b)| b.device_bytes()).sum();
                self.count(-(freed as i64));
                None
            }
        }
    }

    /// Keeps `buffers` (whose queued work is done) for a later stream. When the pool is full, the
    /// oldest set of another shape makes room; if all are of this shape, `buffers` are freed.
    pub(super) fn put(&self, shape: RoundShape, buffers: RoundBuffers) {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        if sets.len() >= self.sets_max {
            let Some(other) = sets.iter().position(|(s, _)| *s != shape) else {
                return;
            };
            let (_, evicted) = sets.remove(other);
            self.count(-(evicted.device_bytes() as i64));
        }
        self.count(buffers.device_bytes() as i64);
        sets.push((shape, buffers));
    }
}

impl Drop for RoundBufferPool {
    fn drop(&mut self) {
        let bytes: usize = self
            .sets
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .map(|(_, b)| b.device_bytes())
            .sum();
        self.count(-(bytes as i64));
    }
}

/// A round queued on the device whose outcomes have not been read yet.
pub(super) struct PendingRound {
    pub(super) buffers: usize,
    /// The batches (stream steps) it belongs to: one, or a group of consecutive small batches.
    pub(super) steps: Range<u64>,
    pub(super) runs: Range<usize>,
    pub(super) placements: Arc<PlacementRuns>,
    /// Blocks whose checksum the round verifies, with the checksum they must have.
    pub(super) checks: Vec<(BlockKey, u64)>,
    /// For each check, the mapped window the block was verified in place in (the mark is shared
    /// by every stream of the device), if it was.
    pub(super) check_windows: Vec<Option<WindowId>>,
    /// LZ4 blocks the round decodes, and their cache entries.
    pub(super) decoded: Vec<(BlockKey, u32)>,
    /// Rows already zeroed because their blocks were known to be corrupt when the round was queued.
    pub(super) replaced: Vec<usize>,
    /// [`super::cache::BlockCache::corrupt_marks`] when the round was planned: if it moved by
    /// completion, rows that used cached blocks found corrupt since are checked again.
    pub(super) corrupt_marks: u64,
    /// Whether a gather ran (its outcome is to be checked).
    pub(super) gathered: bool,
}

/// A batch submitted and not yet completed.
pub(super) struct PendingBatch {
    pub(super) step: u64,
    /// The slot's device address and length, for zeroing samples found corrupt at completion.
    pub(super) slot_ptr: u64,
    pub(super) slot_bytes: usize,
    pub(super) samples: u32,
    pub(super) replaced: u32,
    /// Rounds of this batch not completed yet.
    pub(super) rounds_left: usize,
    /// Whether work was queued on the slot after its ready event was recorded.
    pub(super) fixed_up: bool,
}

impl PendingBatch {
    /// A batch of `samples` rows for stream step `step`, about to be queued into `slot`.
    pub(super) fn new(step: u64, slot: &DeviceRegion, samples: usize) -> PendingBatch {
        PendingBatch {
            step,
            slot_ptr: slot.device_ptr(),
            slot_bytes: slot.len(),
            samples: samples as u32,
            replaced: 0,
            rounds_left: 0,
            fixed_up: false,
        }
    }
}

/// What phase 1 of a round read: each block with its staging offset, and the blocks that could not
/// be read.
struct RoundReads {
    reads: Vec<(BlockKey, u64)>,
    unreadable: HashMap<BlockKey, Arc<CorruptBlock>>,
}

/// The gather of a round being planned.
struct RoundGather {
    plan: GatherPlan,
    /// Scratch: the pieces of one run before they are merged into `plan`.
    pieces: Vec<GatherRun>,
    /// Rows zeroed because a block they read is known to be corrupt.
    replaced: Vec<usize>,
}

/// The checks a round queued: each block with the checksum it must have, and the mapped window of
/// each in-place check.
type RoundChecks = (Vec<(BlockKey, u64)>, Vec<Option<WindowId>>);

/// A range of device-addressable memory another owner keeps alive (a slot, a mapped window, part of a
/// table).
pub(super) struct DeviceRange {
    pub(super) ptr: u64,
    pub(super) bytes: usize,
}

impl DeviceMemory for DeviceRange {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.bytes
    }
}

/// Copies `table` into a round's pinned buffer at `host_offset` and queues its upload to `device` on
/// `stream`.
pub(super) fn upload_table(
    stream: &Stream,
    host: &mut PinnedBuffer,
    host_offset: usize,
    device: &DeviceBuffer,
    table: &[u8],
) -> Result<(), FillError> {
    host.as_mut_slice()[host_offset..host_offset + table.len()].copy_from_slice(table);
    // SAFETY: a round's pinned tables are written again only after the host waited for the round, and
    // its device tables are read only by its kernels, queued after the upload on the same stream.
    unsafe { host.upload_async(stream, host_offset, device, 0, table.len()) }?;
    Ok(())
}

impl GpuAssembler {
    /// Queues one round: reads, checks, decodes and gathers, then the outcome downloads.
    pub(super) fn queue_round(
        &mut self,
        step: u64,
        placements: &Arc<PlacementRuns>,
        round: Round,
        slot: &DeviceRegion,
    ) -> Result<(), FillError> {
        let queued = self.queue_round_phases(step, placements, &round, slot);
        // The mapped windows stay registered until the stream has passed this point: after the
        // round's kernels if they were queued, harmlessly early if an error stopped them.
        let windows = self.reader.windows();
        let released =
            windows.record_reads(self.reader.reader_id(), &self.stream, &round.region_windows);
        let pending = queued?;
        released?;
        self.rounds.push_back(PendingRound {
            runs: round.runs,
            ..pending
        });
        Ok(())
    }

    /// The phases of [`Self::queue_round`]; returns the pending round (its runs filled in by the
    /// caller).
    fn queue_round_phases(
        &mut self,
        step: u64,
        placements: &Arc<PlacementRuns>,
        round: &Round,
        slot: &DeviceRegion,
    ) -> Result<PendingRound, FillError> {
        let index = self.next_buffers;
        self.next_buffers = (self.next_buffers + 1) % self.buffers.len();
        let corrupt_marks = self.block_cache.corrupt_marks;

        let read_started = Instant::now();
        let reads = self.read_round(index, round)?;
        self.timings.read_s += read_started.elapsed().as_secs_f64();

        let decode_started = Instant::now();
        let (checks, check_windows) = self.queue_checks(index, round, &reads)?;
        let decoded = self.queue_decodes(index, round, &reads.unreadable)?;
        self.metrics.add_decode_time(decode_started.elapsed());
        self.timings.decode_s += decode_started.elapsed().as_secs_f64();

        let gather_started = Instant::now();
        let (replaced, gathered) =
            self.queue_gather(index, round, placements, &reads.unreadable, slot)?;
        self.metrics.add_gather_time(gather_started.elapsed());
        self.timings.gather_s += gather_started.elapsed().as_secs_f64();

        self.queue_downloads(index, checks.len(), decoded.len(), gathered)?;
        if let Some(batch) = self.batches.back_mut() {
            batch.replaced += replaced.len() as u32;
        }
        Ok(PendingRound {
            buffers: index,
            steps: step..step + 1,
            runs: 0..0,
            placements: Arc::clone(placements),
            checks,
            check_windows,
            decoded,
            replaced,
            corrupt_marks,
            gathered,
        })
    }

    /// Phase 1: reads every block of the round into the staging of round buffers `index`, merging
    /// blocks adjacent in a file. An LZ4 block that could not be read is corrupt for good: later
    /// rounds skip it.
    fn read_round(&mut self, index: usize, round: &Round) -> Result<RoundReads, FillError> {
        let mut reads: Vec<(BlockKey, u64)> =
            round.staged.iter().map(|(k, &at)| (*k, at)).collect();
        reads.extend(round.decode.iter().map(|&(key, at, ..)| (key, at)));
        reads.sort_unstable_by_key(|&(key, at)| (key.shard, self.entry(&key).stored_offset, at));
        let (extents, extent_of) = self.merge_extents(&reads);
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
        }?;
        let mut unreadable: HashMap<BlockKey, Arc<CorruptBlock>> = HashMap::new();
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
                    let reason = CorruptReason::Unreadable(error.to_string());
                    unreadable.insert(*key, self.corrupt_block(key, reason));
                }
            }
        }
        for &(key, _, entry_index, _) in &round.decode {
            if let Some(bad) = unreadable.get(&key) {
                self.mark_corrupt(key, entry_index, Arc::clone(bad));
            }
        }
        Ok(RoundReads { reads, unreadable })
    }

    /// The extents that read `reads` (sorted by file position), blocks adjacent in both the file and
    /// staging merged, and the extent of each read.
    fn merge_extents(&self, reads: &[(BlockKey, u64)]) -> (Vec<Extent>, Vec<usize>) {
        let mut extents: Vec<Extent> = Vec::with_capacity(reads.len());
        let mut extent_of: Vec<usize> = Vec::with_capacity(reads.len());
        for &(key, at) in reads {
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
                _ => extents.push(Extent {
                    file: FileId(key.shard),
                    offset: entry.stored_offset,
                    len,
                    dest_offset: at as usize,
                }),
            }
            extent_of.push(extents.len() - 1);
        }
        (extents, extent_of)
    }

    /// Phase 2a: queues the checksum verification of the blocks read for the first time: raw blocks
    /// once per stream (and, for blocks read in place, once per device while their window stays
    /// registered), LZ4 blocks whenever they are decoded. Staged blocks are checked in staging, blocks
    /// read in place in their mapped window, one launch per window. Returns the blocks checked, with
    /// the checksum each must have, and the window of each in-place check; the outcomes are read when
    /// the round completes.
    fn queue_checks(
        &mut self,
        index: usize,
        round: &Round,
        reads: &RoundReads,
    ) -> Result<RoundChecks, FillError> {
        let mut checks: Vec<(BlockKey, u64)> = Vec::new();
        let mut check_windows: Vec<Option<WindowId>> = Vec::new();
        let mut check_jobs: Vec<Xxh3Job> = Vec::new();
        for &(key, at) in &reads.reads {
            let entry = self.entry(&key);
            let first_time = match entry.codec {
                Codec::Raw => !self.verified.contains(&key),
                Codec::Lz4 => true,
            };
            if first_time && !reads.unreadable.contains_key(&key) {
                check_jobs.push(Xxh3Job::for_block(entry, at));
                checks.push((key, entry.checksum));
                check_windows.push(None);
            }
        }
        let staged_jobs = check_jobs.len();
        let launches =
            self.in_place_checks(round, &mut check_jobs, &mut checks, &mut check_windows);
        if check_jobs.is_empty() {
            return Ok((checks, check_windows));
        }
        let buffers = &mut self.buffers[index];
        let table = Xxh3Job::encode_all(&check_jobs);
        upload_table(
            &self.stream,
            &mut buffers.host,
            self.layout.xxh3_jobs,
            &buffers.xxh3_jobs,
            &table,
        )?;
        let buffers = &self.buffers[index];
        if staged_jobs > 0 {
            // SAFETY: the tables and the staging buffer belong to this round and are not touched
            // until it completes.
            unsafe {
                self.kernels.xxh3.verify_async(
                    &self.stream,
                    &buffers.xxh3_jobs,
                    staged_jobs as u32,
                    &buffers.staging,
                    &buffers.xxh3_outcomes,
                )
            }?;
        }
        for (region, first, count) in launches {
            let jobs = DeviceRange {
                ptr: buffers.xxh3_jobs.device_ptr() + (first * XXH3_JOB_BYTES) as u64,
                bytes: count * XXH3_JOB_BYTES,
            };
            let outcomes = DeviceRange {
                ptr: buffers.xxh3_outcomes.device_ptr() + (first * XXH3_OUTCOME_BYTES) as u64,
                bytes: count * XXH3_OUTCOME_BYTES,
            };
            let window = DeviceRange {
                ptr: round.regions[region].ptr,
                bytes: round.regions[region].bytes as usize,
            };
            // SAFETY: the job and outcome ranges belong to this round; the window is registered,
            // mapped and pinned until the round's kernels are queued, and stays registered until
            // the stream passes the event recorded after them.
            unsafe {
                self.kernels.xxh3.verify_async(
                    &self.stream,
                    &jobs,
                    count as u32,
                    &window,
                    &outcomes,
                )
            }?;
        }
        Ok((checks, check_windows))
    }

    /// Adds checksum jobs for the round's blocks read in place that no stream of the device has
    /// verified in their window yet, grouped by window; returns the launches as (region, first job,
    /// job count).
    fn in_place_checks(
        &mut self,
        round: &Round,
        jobs: &mut Vec<Xxh3Job>,
        checks: &mut Vec<(BlockKey, u64)>,
        check_windows: &mut Vec<Option<WindowId>>,
    ) -> Vec<(usize, usize, usize)> {
        let mut in_place: Vec<(usize, u64, BlockKey)> = round
            .mapped
            .iter()
            .filter(|(key, _)| !self.verified.contains(*key))
            .map(|(key, &(region, offset))| (region, offset, *key))
            .collect();
        in_place.sort_unstable_by_key(|&(region, offset, _)| (region, offset));
        let windows = Arc::clone(self.reader.windows());
        let mut launches: Vec<(usize, usize, usize)> = Vec::new();
        for (region, offset, key) in in_place {
            let window = round.region_windows[region];
            let entry = *self.entry(&key);
            if windows.is_verified(window, entry.stored_offset) {
                self.verified.insert(key);
                continue;
            }
            match launches.last_mut() {
                Some(last) if last.0 == region => last.2 += 1,
                _ => launches.push((region, jobs.len(), 1)),
            }
            jobs.push(Xxh3Job::for_block(&entry, offset));
            checks.push((key, entry.checksum));
            check_windows.push(Some(window));
            // Verifying in place reads the whole block over PCIe.
            self.metrics
                .add_read_bytes(MetricsPath::PageCache, entry.stored_bytes as u64);
        }
        launches
    }

    /// Phase 2b: queues the decoding of the round's readable LZ4 blocks into their cache entries.
    /// Returns the blocks decoded and their entries; the outcomes are read when the round completes.
    fn queue_decodes(
        &mut self,
        index: usize,
        round: &Round,
        unreadable: &HashMap<BlockKey, Arc<CorruptBlock>>,
    ) -> Result<Vec<(BlockKey, u32)>, FillError> {
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
        if jobs.is_empty() {
            return Ok(decoded);
        }
        let buffers = &mut self.buffers[index];
        let table = Lz4Job::encode_all(&jobs);
        upload_table(
            &self.stream,
            &mut buffers.host,
            self.layout.lz4_jobs,
            &buffers.lz4_jobs,
            &table,
        )?;
        // SAFETY: the tables and buffers belong to this round (the cache entries to its blocks, in
        // stream order) and are not touched until it completes; staging, scratch and cache are
        // different allocations.
        unsafe {
            self.kernels.lz4.decode_async(
                &self.stream,
                &buffers.lz4_jobs,
                jobs.len() as u32,
                &buffers.staging,
                &self.cache,
                &buffers.lz4_outcomes,
            )
        }?;
        Ok(decoded)
    }

    /// Phase 3: gathers the round's rows into the slot. Rows whose blocks are known to be corrupt
    /// are zeroed (or fail the stream) now; rows whose blocks this round checks are gathered and
    /// checked when the round completes. Returns the rows zeroed and whether a gather was queued.
    fn queue_gather(
        &mut self,
        index: usize,
        round: &Round,
        placements: &PlacementRuns,
        unreadable: &HashMap<BlockKey, Arc<CorruptBlock>>,
        slot: &DeviceRegion,
    ) -> Result<(Vec<usize>, bool), FillError> {
        let mut gather = RoundGather {
            plan: GatherPlan::new(),
            pieces: Vec::new(),
            replaced: Vec::new(),
        };
        for run in round.runs.clone() {
            self.plan_run_gather(round, placements, run, unreadable, &mut gather)?;
        }
        let RoundGather { plan, replaced, .. } = gather;
        let count = plan.pieces().len();
        assert!(count <= self.pieces_max, "plan_round bounds the pieces");
        if count > 0 {
            let buffers = &mut self.buffers[index];
            let table = plan.encode();
            upload_table(
                &self.stream,
                &mut buffers.host,
                self.layout.pieces,
                &buffers.pieces,
                &table,
            )?;
            if !round.regions.is_empty() {
                let regions = GatherRegion::encode_all(&round.regions);
                upload_table(
                    &self.stream,
                    &mut buffers.host,
                    self.layout.regions,
                    &buffers.regions,
                    &regions,
                )?;
            }
            let regions: Option<(&dyn DeviceMemory, u32)> =
                (!round.regions.is_empty()).then_some((
                    &buffers.regions as &dyn DeviceMemory,
                    round.regions.len() as u32,
                ));
            // SAFETY: the tables, the sources and the outcome belong to this round and are not
            // rewritten before it completes; the regions are registered, mapped windows pinned until
            // the round is queued and registered until the stream passes it; the slot is this
            // filler's (its lease is Filling and the consumer's release event was waited on); the
            // sources do not overlap the slot.
            unsafe {
                self.kernels.gather.gather_regions_async(
                    &self.stream,
                    &buffers.pieces,
                    count as u32,
                    &[&self.cache, &buffers.staging],
                    regions,
                    slot,
                    (&buffers.gather_outcome, false),
                )
            }?;
            let in_place: u64 = plan
                .pieces()
                .iter()
                .filter(|p| p.source as usize >= GATHER_SOURCES_MAX)
                .map(|p| p.elements as u64 * p.op.in_bytes())
                .sum();
            if in_place > 0 {
                self.metrics
                    .add_read_bytes(MetricsPath::PageCache, in_place);
            }
        }
        // The substitute for a corrupt sample is all zeros in every field, as on the CPU backend.
        for &row in &replaced {
            self.zero_row(slot, row)?;
        }
        Ok((replaced, count > 0))
    }

    /// Adds the gather pieces of run `run` to `gather.plan`. The run is gathered whole, unless a block
    /// it reads is known to be corrupt: then its rows are gathered one by one and those that read the
    /// corrupt block are added to `gather.replaced` (or fail the stream).
    fn plan_run_gather(
        &self,
        round: &Round,
        placements: &PlacementRuns,
        run: usize,
        unreadable: &HashMap<BlockKey, Arc<CorruptBlock>>,
        gather: &mut RoundGather,
    ) -> Result<(), FillError> {
        let RoundGather {
            plan,
            pieces,
            replaced,
        } = gather;
        let fields = &self.plan.fields;
        let (first_row, rows) = placements.runs[run];
        let run_placements = &placements.placements[run * fields.len()..(run + 1) * fields.len()];
        // Without an unreadable block this round and with no block ever found corrupt (every corrupt
        // entry counts in `corrupt_marks`), no row can be corrupt: skip the look-ups.
        let corrupt = if unreadable.is_empty() && self.block_cache.corrupt_marks == 0 {
            Vec::new()
        } else {
            self.corrupt_rows(run_placements, rows, |key| match self.entry(key).codec {
                Codec::Raw => unreadable.get(key).cloned(),
                Codec::Lz4 => self.block_cache.corrupt(key).cloned(),
            })
        };
        if let Some((_, bad)) = corrupt.first() {
            if self.plan.on_corrupt == CorruptPolicy::Fail {
                return Err(bad.to_error());
            }
        }
        pieces.clear();
        for (field, placement) in fields.iter().zip(run_placements) {
            let out_at = (field.offset + first_row * field.sample_bytes_out) as u64;
            if corrupt.is_empty() {
                let range = placement.start..placement.end;
                self.range_pieces(round, field, placement, range, out_at, pieces);
                continue;
            }
            let width = field.sample_bytes_in as u64;
            for i in 0..rows {
                if corrupt.iter().any(|(bad, _)| *bad == i) {
                    continue;
                }
                let start = placement.start + i as u64 * width;
                let row_out_at = out_at + (i * field.sample_bytes_out) as u64;
                self.range_pieces(
                    round,
                    field,
                    placement,
                    start..start + width,
                    row_out_at,
                    pieces,
                );
            }
        }
        for &(source, src_offset, dst_offset, elements, op) in pieces.iter() {
            plan.push_merged(
                source,
                src_offset,
                dst_offset,
                elements,
                op,
                1.0,
                merged_piece_out_bytes(),
            );
        }
        replaced.extend(corrupt.iter().map(|(i, _)| first_row + i));
        Ok(())
    }

    /// Phase 4: brings the outcomes back to pinned memory and marks the round's end.
    pub(super) fn queue_downloads(
        &self,
        index: usize,
        checks: usize,
        decoded: usize,
        gathered: bool,
    ) -> Result<(), FillError> {
        let buffers = &self.buffers[index];
        let layout = &self.layout;
        // SAFETY: the pinned outcome areas are only read by the host after `done` has completed.
        unsafe {
            buffers.host.download_async(
                &self.stream,
                &buffers.xxh3_outcomes,
                0,
                layout.xxh3_outcomes,
                checks * XXH3_OUTCOME_BYTES,
            )?;
            buffers.host.download_async(
                &self.stream,
                &buffers.lz4_outcomes,
                0,
                layout.lz4_outcomes,
                decoded * LZ4_OUTCOME_BYTES,
            )?;
            if gathered {
                buffers.host.download_async(
                    &self.stream,
                    &buffers.gather_outcome,
                    0,
                    layout.gather_outcome,
                    GATHER_OUTCOME_BYTES,
                )?;
            }
        }
        buffers.done.record(&self.stream)?;
        Ok(())
    }

    /// Queues zeros over every field of `row` in `slot`.
    pub(super) fn zero_row(&self, slot: &dyn DeviceMemory, row: usize) -> Result<(), FillError> {
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
            }?;
        }
        Ok(())
    }

    /// Records that an LZ4 block is unusable. Its cache entry is released if it still holds the block.
    pub(super) fn mark_corrupt(&mut self, key: BlockKey, entry_index: u32, bad: Arc<CorruptBlock>) {
        if self.block_cache.mark_corrupt(key, entry_index, bad) {
            self.metrics.add_corrupt_blocks(1);
        }
    }

    /// A block found unusable, named for error messages. Called only when a block is found bad.
    pub(super) fn corrupt_block(&self, key: &BlockKey, reason: CorruptReason) -> Arc<CorruptBlock> {
        Arc::new(CorruptBlock {
            block: self.block_ref(key),
            reason,
        })
    }
}
