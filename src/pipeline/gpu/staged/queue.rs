//! Queueing a round of the staged assembler in four phases: read; verify and decode; gather; bring
//! the outcomes back (the engine's `RoundEngine::queue_downloads`). Completing it is the engine's
//! (`engine::complete`).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use foldhash::{HashMap, HashMapExt};

use super::assembler::StagedAssembler;
use crate::device::{DeviceMemory, DeviceRegion};
use crate::format::{BlockEntry, Codec};
use crate::kernels::{
    GatherOp, GatherPlan, GatherRegion, Lz4Job, Xxh3Job, GATHER_SOURCES_MAX, XXH3_JOB_BYTES,
    XXH3_OUTCOME_BYTES,
};
use crate::metrics::ReadPath as MetricsPath;
use crate::pipeline::gpu::engine::buffers::{upload_table, DeviceRange, PendingRound};
use crate::pipeline::stream_plan::{
    BlockKey, CorruptBlock, CorruptPolicy, CorruptReason, FillError, PlacementRuns,
};
use crate::storage::gpu::ReadPath;
use crate::storage::windows::WindowId;
use crate::storage::{Extent, FileId, IO_ALIGN_BYTES};

/// One piece of a gather before merging: source, source offset, slot offset, elements, conversion.
/// The planner (`super::plan`) makes them; the round merges them into its gather plan.
pub(in crate::pipeline::gpu) type GatherRun = (u16, u64, u64, u64, GatherOp);

/// Bytes a block takes in a round's staging buffer: its stored bytes rounded up to whole pages.
pub(in crate::pipeline::gpu) fn staged_bytes(entry: &BlockEntry) -> u64 {
    (entry.stored_bytes as u64).div_ceil(IO_ALIGN_BYTES) * IO_ALIGN_BYTES
}

/// The blocks a round reads, and where each goes.
#[derive(Default)]
pub(in crate::pipeline::gpu) struct Round {
    /// Raw blocks read into staging this round, and where.
    pub(in crate::pipeline::gpu) staged: HashMap<BlockKey, u64>,
    /// Raw blocks the gather reads in place from mapped page-cache windows: region index in
    /// `regions`, and the block's offset in it.
    pub(in crate::pipeline::gpu) mapped: HashMap<BlockKey, (usize, u64)>,
    /// The mapped windows the round reads (the gather's region table), pinned until the round's
    /// kernels are queued.
    pub(in crate::pipeline::gpu) regions: Vec<GatherRegion>,
    pub(in crate::pipeline::gpu) region_windows: Vec<WindowId>,
    /// The region of each (shard, window index).
    pub(in crate::pipeline::gpu) region_of: HashMap<(u32, u64), usize>,
    /// LZ4 blocks to read and decode this round: key, staging offset, cache entry, scratch offset.
    pub(in crate::pipeline::gpu) decode: Vec<(BlockKey, u64, u32, Option<u64>)>,
    /// Cached blocks that rows of this round use (they must not be evicted by it).
    pub(in crate::pipeline::gpu) pinned: usize,
    /// Staging and shuffle scratch used, in bytes.
    pub(in crate::pipeline::gpu) staging_used: u64,
    pub(in crate::pipeline::gpu) scratch_used: u64,
    /// Gather pieces (a bound).
    pub(in crate::pipeline::gpu) pieces: usize,
    /// First run and one past the last run of the batch in this round.
    pub(in crate::pipeline::gpu) runs: Range<usize>,
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

impl StagedAssembler {
    /// Queues one round: reads, checks, decodes and gathers, then the outcome downloads.
    pub(in crate::pipeline::gpu) fn queue_round(
        &mut self,
        step: u64,
        placements: &Arc<PlacementRuns>,
        round: Round,
        slot: &DeviceRegion,
    ) -> Result<(), FillError> {
        let queued = self.queue_round_phases(step, placements, &round, slot);
        // The mapped windows stay registered until the stream has passed this point: after the
        // round's kernels if they were queued, harmlessly early if an error stopped them.
        let windows = self.engine.reader.windows();
        let released = windows.record_reads(
            self.engine.reader.reader_id(),
            &self.engine.stream,
            &round.region_windows,
        );
        let pending = queued?;
        released?;
        self.engine.rounds.push_back(PendingRound {
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
        let index = self.engine.next_buffers;
        self.engine.next_buffers = (self.engine.next_buffers + 1) % self.engine.buffers.len();
        let corrupt_marks = self.engine.block_cache.corrupt_marks;

        let read_started = Instant::now();
        let reads = self.read_round(index, round)?;
        self.engine.timings.read_s += read_started.elapsed().as_secs_f64();

        let decode_started = Instant::now();
        let (checks, check_windows) = self.queue_checks(index, round, &reads)?;
        let decoded = self.queue_decodes(index, round, &reads.unreadable)?;
        self.engine
            .metrics
            .add_decode_time(decode_started.elapsed());
        self.engine.timings.decode_s += decode_started.elapsed().as_secs_f64();

        let gather_started = Instant::now();
        let (replaced, gathered) =
            self.queue_gather(index, round, placements, &reads.unreadable, slot)?;
        self.engine
            .metrics
            .add_gather_time(gather_started.elapsed());
        self.engine.timings.gather_s += gather_started.elapsed().as_secs_f64();

        self.engine
            .queue_downloads(index, checks.len(), decoded.len(), gathered)?;
        if let Some(batch) = self.engine.batches.back_mut() {
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
        reads.sort_unstable_by_key(|&(key, at)| {
            (key.shard, self.engine.entry(&key).stored_offset, at)
        });
        let (extents, extent_of) = self.merge_extents(&reads);
        // SAFETY: the staging buffer of this round is only touched by this round's work on the compute
        // stream, which waits for the copies; the round that used it before has completed (the host
        // waited for it), and the buffer lives as long as the assembler, which drains its rounds
        // before it is dropped.
        let results = unsafe {
            self.engine.reader.read_async(
                &self.engine.files,
                &extents,
                &self.engine.buffers[index].staging,
                self.choice,
                &self.engine.stream,
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
                    self.engine
                        .metrics
                        .add_read_bytes(metrics_path, self.engine.entry(key).stored_bytes as u64);
                }
                Err(error) => {
                    if self.engine.entry(key).codec == Codec::Raw {
                        self.engine.metrics.add_corrupt_blocks(1);
                    }
                    let reason = CorruptReason::Unreadable(error.to_string());
                    unreadable.insert(*key, self.engine.corrupt_block(key, reason));
                }
            }
        }
        for &(key, _, entry_index, _) in &round.decode {
            if let Some(bad) = unreadable.get(&key) {
                self.engine.mark_corrupt(key, entry_index, Arc::clone(bad));
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
            let entry = self.engine.entry(&key);
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
            let entry = self.engine.entry(&key);
            let first_time = match entry.codec {
                Codec::Raw => !self.engine.verified.contains(&key),
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
        let buffers = &mut self.engine.buffers[index];
        let table = Xxh3Job::encode_all(&check_jobs);
        upload_table(
            &self.engine.stream,
            &mut buffers.host,
            self.engine.layout.xxh3_jobs,
            &buffers.xxh3_jobs,
            &table,
        )?;
        let buffers = &self.engine.buffers[index];
        if staged_jobs > 0 {
            // SAFETY: the tables and the staging buffer belong to this round and are not touched
            // until it completes.
            unsafe {
                self.engine.kernels.xxh3.verify_async(
                    &self.engine.stream,
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
                self.engine.kernels.xxh3.verify_async(
                    &self.engine.stream,
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
            .filter(|(key, _)| !self.engine.verified.contains(*key))
            .map(|(key, &(region, offset))| (region, offset, *key))
            .collect();
        in_place.sort_unstable_by_key(|&(region, offset, _)| (region, offset));
        let windows = Arc::clone(self.engine.reader.windows());
        let mut launches: Vec<(usize, usize, usize)> = Vec::new();
        for (region, offset, key) in in_place {
            let window = round.region_windows[region];
            let entry = *self.engine.entry(&key);
            if windows.is_verified(window, entry.stored_offset) {
                self.engine.verified.insert(key);
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
            self.engine
                .metrics
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
            let entry = *self.engine.entry(&key);
            let element_bytes = self.engine.plan.dataset.manifest.fields[key.field as usize]
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
        let buffers = &mut self.engine.buffers[index];
        let table = Lz4Job::encode_all(&jobs);
        upload_table(
            &self.engine.stream,
            &mut buffers.host,
            self.engine.layout.lz4_jobs,
            &buffers.lz4_jobs,
            &table,
        )?;
        // SAFETY: the tables and buffers belong to this round (the cache entries to its blocks, in
        // stream order) and are not touched until it completes; staging, scratch and cache are
        // different allocations.
        unsafe {
            self.engine.kernels.lz4.decode_async(
                &self.engine.stream,
                &buffers.lz4_jobs,
                jobs.len() as u32,
                &buffers.staging,
                &self.engine.cache,
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
        assert!(
            count <= self.engine.pieces_max,
            "plan_round bounds the pieces"
        );
        if count > 0 {
            let buffers = &mut self.engine.buffers[index];
            let table = plan.encode();
            upload_table(
                &self.engine.stream,
                &mut buffers.host,
                self.engine.layout.pieces,
                &buffers.pieces,
                &table,
            )?;
            if !round.regions.is_empty() {
                let regions = GatherRegion::encode_all(&round.regions);
                upload_table(
                    &self.engine.stream,
                    &mut buffers.host,
                    self.engine.layout.regions,
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
                self.engine.kernels.gather.gather_regions_async(
                    &self.engine.stream,
                    &buffers.pieces,
                    count as u32,
                    &[&self.engine.cache, &buffers.staging],
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
                self.engine
                    .metrics
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
        let fields = &self.engine.plan.fields;
        let (first_row, rows) = placements.runs[run];
        let run_placements = &placements.placements[run * fields.len()..(run + 1) * fields.len()];
        // Without an unreadable block this round and with no block ever found corrupt (every corrupt
        // entry counts in `corrupt_marks`), no row can be corrupt: skip the look-ups.
        let corrupt = if unreadable.is_empty() && self.engine.block_cache.corrupt_marks == 0 {
            Vec::new()
        } else {
            self.engine.corrupt_rows(run_placements, rows, |key| {
                match self.engine.entry(key).codec {
                    Codec::Raw => unreadable.get(key).cloned(),
                    Codec::Lz4 => self.engine.block_cache.corrupt(key).cloned(),
                }
            })
        };
        if let Some((_, bad)) = corrupt.first() {
            if self.engine.plan.on_corrupt == CorruptPolicy::Fail {
                return Err(bad.to_error());
            }
        }
        pieces.clear();
        for (at, (field, placement)) in fields.iter().zip(run_placements).enumerate() {
            if let Some(rows) = self.variable.rows.get(at).and_then(Option::as_ref) {
                // A variable-length field's run is one row, placed in the batch's form; a corrupt
                // row is left to be zeroed.
                if corrupt.is_empty() {
                    let out_at = field.row_place(rows, first_row).start as u64;
                    let range = placement.start..placement.end;
                    self.range_pieces(round, field, placement, range, out_at, pieces);
                }
                continue;
            }
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
                self.gather_piece_out_bytes,
            );
        }
        replaced.extend(corrupt.iter().map(|(i, _)| first_row + i));
        Ok(())
    }
}
