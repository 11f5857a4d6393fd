//! Planning rounds: which runs of a batch join a round before its fixed buffers (staging, shuffle
//! scratch, gather table, job tables, cache entries) would overflow, where each of their blocks goes,
//! and which gather pieces copy a range of samples from those blocks.

use std::ops::Range;
use std::sync::Arc;

use super::assembler::StagedAssembler;
use super::queue::{staged_bytes, GatherRun, Round};
use crate::device::DeviceMemory;
use crate::format::{BlockEntry, Codec, Filter};
use crate::kernels::{GatherOp, GatherRegion};
use crate::pipeline::gpu::engine::buffers::REGIONS_MAX;
use crate::pipeline::gpu::engine::cache::CacheEntry;
use crate::pipeline::gpu::engine::rounds::block_key;
use crate::pipeline::gpu::limits::ZeroCopy;
use crate::pipeline::order::ShuffleKind;
use crate::pipeline::stream_plan::{
    BlockKey, FieldPlan, FillError, Placement, PlacementRuns, StreamPlan,
};
use crate::storage::windows::MappedRange;
use crate::storage::IO_ALIGN_BYTES;

/// What one run would add to a round, worked out before anything is committed.
#[derive(Default)]
struct RunDemand {
    /// Raw blocks new to the round, and their staging offsets.
    staged: Vec<(BlockKey, u64)>,
    /// LZ4 blocks to decode, their staging offsets and scratch offsets.
    decoded: Vec<(BlockKey, u64, Option<u64>)>,
    /// Cached blocks the run uses, with the round that used them last.
    pins: Vec<(BlockKey, u64)>,
    /// Raw blocks new to the round that the gather reads in place: region index and offset in it.
    mapped: Vec<(BlockKey, usize, u64)>,
    /// Windows the run maps that the round does not have yet (pinned by the mapping), keyed by
    /// (shard, window index); their regions follow the round's.
    regions: Vec<((u32, u64), MappedRange)>,
    /// Staging and scratch used by the round with the run.
    staging: u64,
    scratch: u64,
    /// Gather pieces of the run (a bound).
    pieces: usize,
}

/// Largest staged size of any block of the stream's fields (stored bytes rounded up to whole pages)
/// and largest decoded size, over the whole dataset.
pub(in crate::pipeline::gpu) fn block_sizes_max(plan: &StreamPlan) -> (u64, u64) {
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

/// Bytes of the decoded-block cache for `plan`: `cache_bytes`, or, in a window shuffle over fields with
/// LZ4 blocks, room for every block of the largest window's shards decoded (within
/// `device_shard_bytes`, the device memory a stream may spend on a window's shards). A window shuffle
/// draws each batch's rows from blocks all over its window, each block several times over the
/// window's batches: a cache that holds the window decodes each block once, where a smaller one reads
/// and decodes blocks again and again.
/// The second value is the blocks to read ahead after an LZ4 block the cache misses: when the cache
/// holds the window, every block of the window's shards is decoded once during the window, so the
/// blocks after a miss are read with it (one read instead of one per block) and decoded in the same
/// launch.
pub(in crate::pipeline::gpu) fn cache_bytes(
    plan: &StreamPlan,
    cache_bytes: u64,
    device_shard_bytes: u64,
) -> (u64, u32) {
    let windowed = plan.order.shuffle_kind() == ShuffleKind::Window;
    let lz4 = plan.dataset.shards.iter().any(|shard| {
        plan.fields.iter().any(|field| {
            shard
                .metadata
                .field_blocks(field.field_index)
                .iter()
                .any(|b| b.codec != Codec::Raw)
        })
    });
    if !windowed || !lz4 {
        return (cache_bytes, 0);
    }
    let mut firsts: Vec<u64> = Vec::with_capacity(plan.dataset.shards.len() + 1);
    let mut first = 0u64;
    for shard in &plan.dataset.manifest.shards {
        firsts.push(first);
        first += shard.sample_count;
    }
    firsts.push(first);
    let shards_per_window = plan.order.shards_per_span_max(1, &firsts).unwrap_or(1) as u64;
    let decoded_max = plan
        .dataset
        .shards
        .iter()
        .map(|shard| {
            plan.fields
                .iter()
                .flat_map(|field| shard.metadata.field_blocks(field.field_index))
                .map(|b| b.raw_bytes as u64)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let window_bytes = shards_per_window * decoded_max;
    let held = window_bytes <= device_shard_bytes;
    (
        cache_bytes.max(window_bytes.min(device_shard_bytes)),
        if held { LZ4_READ_AHEAD_BLOCKS } else { 0 },
    )
}

/// Share of a raw block's bytes below which [`ZeroCopy::Auto`] reads the rows in place.
const ZERO_COPY_COVERAGE_MAX: f64 = 0.5;

/// LZ4 blocks read ahead after a block the cache misses, when the cache holds the window (see
/// [`cache_bytes`]): 16 blocks of 64 KiB decoded, 1 MiB, a few hundred KiB read.
const LZ4_READ_AHEAD_BLOCKS: u32 = 16;

impl StagedAssembler {
    /// Chooses the runs of the next round, starting at run `first`, and where their blocks go. LZ4
    /// blocks get their cache entries here (the entry is known to later rounds at once).
    pub(in crate::pipeline::gpu) fn plan_round(
        &mut self,
        batch: &PlacementRuns,
        first: usize,
    ) -> Result<Round, FillError> {
        self.round_stamp += 1;
        let stamp = self.round_stamp;
        let plan = Arc::clone(&self.engine.plan);
        let fields = &plan.fields;
        let mut round = Round {
            runs: first..first,
            ..Round::default()
        };
        let mut demand = RunDemand::default();
        // Consecutive runs mostly share a block: the last block committed needs no lookup.
        let mut last_committed: Option<BlockKey> = None;
        for run in first..batch.runs.len() {
            let rows = batch.runs[run].1;
            let placements = &batch.placements[run * fields.len()..(run + 1) * fields.len()];
            self.run_demand(&round, placements, rows, last_committed, stamp, &mut demand);
            if !self.fits(&round, &demand) {
                self.unpin_demand(&demand);
                if round.runs.is_empty() {
                    return Err(self.round_too_small(batch.runs[run].0));
                }
                break;
            }
            self.commit_run(&mut round, &demand, stamp);
            if fields.len() == 1 {
                // With several fields the runs alternate between them: only a single-field run's
                // last block is sure to be the next run's first.
                let placement = &placements[0];
                last_committed = placement
                    .blocks
                    .clone()
                    .next_back()
                    .map(|block| block_key(placement, &fields[0], block));
            }
            round.runs.end = run + 1;
        }
        Ok(round)
    }

    /// Works out what a run of `rows` rows (`placements`, one per field) adds to `round`.
    fn run_demand(
        &self,
        round: &Round,
        placements: &[Placement],
        rows: usize,
        last_committed: Option<BlockKey>,
        stamp: u64,
        demand: &mut RunDemand,
    ) {
        demand.staged.clear();
        demand.decoded.clear();
        demand.pins.clear();
        demand.mapped.clear();
        demand.regions.clear();
        demand.staging = round.staging_used;
        demand.scratch = round.scratch_used;
        demand.pieces = 0;
        for (field, placement) in self.engine.plan.fields.iter().zip(placements) {
            // GatherPlan::push splits a piece at GATHER_PIECE_OUT_BYTES_MAX output bytes, so a run
            // gathered whole takes at most one piece per block plus one per such span; if its rows
            // are gathered one by one (a corrupt block), each row takes one piece per block it
            // overlaps (at most the run's blocks plus its rows, over all rows) plus one per such
            // span of the row.
            // A variable-length field's run is one row of the placement's length.
            let row_out_bytes = match field.variable {
                Some(_) => {
                    (placement.end - placement.start) / field.sample_bytes_in as u64
                        * field.sample_bytes_out as u64
                }
                None => field.sample_bytes_out as u64,
            };
            demand.pieces += placement.blocks.len()
                + rows
                    * (1 + row_out_bytes.div_ceil(crate::kernels::GATHER_PIECE_OUT_BYTES_MAX)
                        as usize);
            for block in placement.blocks.clone() {
                let key = block_key(placement, field, block);
                if last_committed != Some(key) {
                    self.block_demand(round, field, placement, key, stamp, demand);
                }
            }
        }
        if self.lz4_read_ahead > 0 && !demand.decoded.is_empty() && self.fits(round, demand) {
            self.read_ahead(round, demand);
        }
    }

    /// Adds to `demand` the LZ4 blocks that follow each block it decodes, up to
    /// `lz4_read_ahead` of them, stopping at a block already cached or read, and as soon as one more
    /// would not fit the round: the run's own blocks come first, then what the round has room for.
    fn read_ahead(&self, round: &Round, demand: &mut RunDemand) {
        let misses: Vec<BlockKey> = demand.decoded.iter().map(|&(key, ..)| key).collect();
        for miss in misses {
            let Some(field) = self
                .engine
                .plan
                .fields
                .iter()
                .find(|f| f.field_index as u32 == miss.field)
            else {
                continue;
            };
            let blocks = self.engine.plan.dataset.shards[miss.shard as usize]
                .metadata
                .field_blocks(field.field_index)
                .len() as u32;
            let last = miss
                .block
                .saturating_add(self.lz4_read_ahead)
                .min(blocks - 1);
            for block in miss.block + 1..=last {
                let key = BlockKey { block, ..miss };
                let entry = *self.engine.entry(&key);
                if entry.codec != Codec::Lz4
                    || self.engine.block_cache.get(&key).is_some()
                    || demand.decoded.iter().any(|(k, ..)| *k == key)
                {
                    break;
                }
                let (staging, scratch) = (demand.staging, demand.scratch);
                self.decode_demand(field, key, &entry, demand);
                if !self.fits(round, demand) {
                    demand.decoded.pop();
                    demand.staging = staging;
                    demand.scratch = scratch;
                    return;
                }
            }
        }
    }

    /// Adds LZ4 block `key` (`entry`) of `field` to the blocks `demand` decodes.
    fn decode_demand(
        &self,
        field: &FieldPlan,
        key: BlockKey,
        entry: &BlockEntry,
        demand: &mut RunDemand,
    ) {
        let shuffled = entry.filter == Filter::ByteShuffle && field.stored.size_bytes() > 1;
        let scratch_at = shuffled.then(|| {
            let at = self.scratch_offset + demand.scratch;
            demand.scratch += (entry.raw_bytes as u64).div_ceil(16) * 16;
            at
        });
        demand.decoded.push((key, demand.staging, scratch_at));
        demand.staging += staged_bytes(entry);
    }

    /// Adds what block `key` of `field` needs, if `round` and the run so far do not provide it.
    fn block_demand(
        &self,
        round: &Round,
        field: &FieldPlan,
        placement: &Placement,
        key: BlockKey,
        stamp: u64,
        demand: &mut RunDemand,
    ) {
        let entry = *self.engine.entry(&key);
        match (entry.codec, self.engine.block_cache.get(&key)) {
            (Codec::Raw, _) => {
                if round.staged.contains_key(&key)
                    || round.mapped.contains_key(&key)
                    || demand.staged.iter().any(|(k, _)| *k == key)
                    || demand.mapped.iter().any(|(k, ..)| *k == key)
                {
                    return;
                }
                if self.reads_in_place(&entry, placement) {
                    if let Some((region, offset)) = self.map_block(round, &key, &entry, demand) {
                        demand.mapped.push((key, region, offset));
                        return;
                    }
                }
                demand.staged.push((key, demand.staging));
                demand.staging += staged_bytes(&entry);
            }
            (Codec::Lz4, Some(CacheEntry::Decoded { stamp: used, .. })) => {
                if *used != stamp && !demand.pins.iter().any(|(k, _)| *k == key) {
                    demand.pins.push((key, *used));
                }
            }
            (Codec::Lz4, Some(CacheEntry::Corrupt(_))) => {}
            (Codec::Lz4, None) => {
                if !demand.decoded.iter().any(|(k, ..)| *k == key) {
                    self.decode_demand(field, key, &entry, demand);
                }
            }
        }
    }

    /// Whether the zero-copy policy wants raw block `entry` read in place for a run whose rows cover
    /// `placement`'s range.
    fn reads_in_place(&self, entry: &BlockEntry, placement: &Placement) -> bool {
        match self.zero_copy {
            ZeroCopy::Off => false,
            ZeroCopy::Always => true,
            ZeroCopy::Auto => {
                let block_end = entry.raw_offset + entry.raw_bytes as u64;
                let used = placement.end.min(block_end) - placement.start.max(entry.raw_offset);
                (used as f64) < entry.raw_bytes as f64 * ZERO_COPY_COVERAGE_MAX
            }
        }
    }

    /// Where the gather reads raw block `key` in place: the round's region for the block's window
    /// (mapping and pinning the window if the round has none yet) and the block's offset in it.
    /// `None` when the window cannot be mapped (not resident, crossing a window boundary, budget full
    /// of pinned windows) or the round has no room for another region: the block is staged instead.
    fn map_block(
        &self,
        round: &Round,
        key: &BlockKey,
        entry: &BlockEntry,
        demand: &mut RunDemand,
    ) -> Option<(usize, u64)> {
        let windows = self.engine.reader.windows();
        let window_bytes = windows.window_bytes();
        let index = entry.stored_offset / window_bytes;
        let offset = entry.stored_offset - index * window_bytes;
        if offset + entry.stored_bytes as u64 > window_bytes {
            return None;
        }
        let window_key = (key.shard, index);
        if let Some(&region) = round.region_of.get(&window_key) {
            return Some((region, offset));
        }
        if let Some(i) = demand.regions.iter().position(|(k, _)| *k == window_key) {
            return Some((round.regions.len() + i, offset));
        }
        if round.regions.len() + demand.regions.len() >= REGIONS_MAX {
            return None;
        }
        let file = self
            .engine
            .files
            .get(crate::storage::FileId(key.shard))
            .file();
        let fraction = self.engine.reader.resident_fraction_min();
        // A device error here leaves the block to the staging path, which reports it if it persists.
        let mapped = windows
            .map(
                file,
                entry.stored_offset,
                entry.stored_bytes as usize,
                fraction,
            )
            .ok()
            .flatten()?;
        debug_assert_eq!(mapped.offset_in_window, offset);
        demand.regions.push((window_key, mapped));
        Some((round.regions.len() + demand.regions.len() - 1, offset))
    }

    /// Releases the windows a run mapped but the round did not take.
    fn unpin_demand(&self, demand: &RunDemand) {
        if demand.regions.is_empty() {
            return;
        }
        let windows: Vec<_> = demand.regions.iter().map(|(_, m)| m.window).collect();
        self.engine.reader.windows().unpin(&windows);
    }

    /// Whether `round` still fits its buffers with the run of `demand` added.
    fn fits(&self, round: &Round, demand: &RunDemand) -> bool {
        let entries_needed =
            round.decode.len() + demand.decoded.len() + round.pinned + demand.pins.len();
        // Every block read in place may need a checksum job.
        let jobs_needed = round.staged.len()
            + demand.staged.len()
            + round.decode.len()
            + demand.decoded.len()
            + round.mapped.len()
            + demand.mapped.len();
        demand.staging <= self.engine.buffers[0].staging.len() as u64
            && demand.scratch <= self.scratch_bytes
            && round.pieces + demand.pieces <= self.engine.pieces_max
            && jobs_needed <= self.jobs_max
            && entries_needed <= self.engine.block_cache.entries as usize
    }

    /// The error for a batch whose sample at `sample` alone overflows a round.
    fn round_too_small(&self, sample: usize) -> FillError {
        FillError::RoundTooSmall {
            sample,
            staging_bytes: self.engine.buffers[0].staging.len(),
            scratch_bytes: self.scratch_bytes,
            pieces_max: self.engine.pieces_max,
            cache_entries: self.engine.block_cache.entries,
            entry_bytes: self.entry_bytes,
        }
    }

    /// Adds the run of `demand` to `round`: its cached blocks become the round's (not evictable by
    /// it) and its new LZ4 blocks get cache entries.
    fn commit_run(&mut self, round: &mut Round, demand: &RunDemand, stamp: u64) {
        for &(key, _) in &demand.pins {
            self.engine.block_cache.pin(key, stamp);
            round.pinned += 1;
        }
        for &(key, at) in &demand.staged {
            round.staged.insert(key, at);
        }
        for &(window_key, mapped) in &demand.regions {
            round.region_of.insert(window_key, round.regions.len());
            round.regions.push(GatherRegion {
                ptr: mapped.window_device_ptr,
                bytes: mapped.window_bytes,
            });
            round.region_windows.push(mapped.window);
        }
        for &(key, region, offset) in &demand.mapped {
            round.mapped.insert(key, (region, offset));
        }
        for &(key, at, scratch_at) in &demand.decoded {
            let index = self.engine.block_cache.insert(key, stamp);
            round.pinned += 1;
            round.decode.push((key, at, index, scratch_at));
        }
        round.staging_used = demand.staging;
        round.scratch_used = demand.scratch;
        round.pieces += demand.pieces;
    }

    /// Appends the pieces that copy raw bytes `range` of `field` (a run's, or one of its rows') from
    /// the blocks of `placement` that overlap it to slot offset `out_at`. Every block is usable: raw
    /// blocks are in this round's staging, LZ4 blocks decoded in the cache.
    pub(in crate::pipeline::gpu) fn range_pieces(
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
            let key = block_key(placement, field, block);
            let entry = self.engine.entry(&key);
            let block_end = entry.raw_offset + entry.raw_bytes as u64;
            if block_end <= range.start || entry.raw_offset >= range.end {
                continue;
            }
            let (source, base) = match entry.codec {
                Codec::Raw => match round.mapped.get(&key) {
                    Some(&(region, offset)) => (GatherRegion::source_index(region), offset),
                    None => (1u16, round.staged[&key]),
                },
                Codec::Lz4 => match self.engine.block_cache.get(&key) {
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
}
