//! Batch assembly on the CPU backend: read the blocks a batch needs, decode them, gather and convert
//! each sample into the slot.
//!
//! The same plan ([`StreamPlan`]) drives the GPU backend (`pipeline::gpu`), where reads land in device
//! memory and the kernels decode and gather; only [`Assembler`] is CPU-specific.

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use super::block_cache::{self, BlockCache, CacheHandle, CachedBlock, DecodedBlock};
use super::cold_rows::{ColdRows, RowCopy, RowReads, COLD_QUEUE_DEPTH};
use super::lookahead::{self, Lookahead, LookaheadCounts};
use super::shard_gate::{ShardGate, ShardLookahead, StreamSteps};
use super::stream_plan::{
    BlockKey, CorruptBlock, CorruptPolicy, CorruptReason, FieldPlan, FillError, FillReport,
    Placement, StreamLimits, StreamPlan,
};
use super::varlen::{VariableForm, VariableRows};
use crate::decode::{self, BlockRef};
use crate::format::Codec;
use crate::metrics::{Metrics, ReadPath};
use crate::storage::mapped::MappedFile;
use crate::storage::residency::ResidencyMap;
use crate::storage::{
    AlignedBuffer, AnyQueue, DirectIo, EngineLimits, Extent, FileId, FileTable, ReadEngine,
    StorageError, IO_ALIGN_BYTES,
};

/// Shards, beyond a batch's own, that a stream whose shards arrive while it runs keeps ready for
/// its next batches; found scanning at most [`GATE_SCAN_SAMPLES_MAX`] samples of later steps per
/// batch.
const GATE_SHARDS_AHEAD: usize = 4;
const GATE_SCAN_SAMPLES_MAX: u64 = 1 << 16;

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
    /// shard's residency map. A shard truncated while mapped reads zeros instead of killing the
    /// daemon (see [`MappedFile`]); each part of a batch checks the maps it read before the slot is
    /// returned.
    maps: Vec<Option<(MappedFile, ResidencyMap)>>,
    /// The shards read in place by the part of the batch being filled, each once (`in_place_stamp`
    /// holds the part that last added a shard, `in_place_part` the part being filled).
    in_place_shards: Vec<u32>,
    in_place_stamp: Vec<u64>,
    in_place_part: u64,
    /// The shards opened for buffered reads, made on first use, with their residency maps: coded
    /// blocks whose pages are cached are copied from there instead of read with O_DIRECT.
    buffered: Vec<Option<(std::fs::File, ResidencyMap)>>,
    /// Rows of later batches taken out of the blocks decoded for the current one (shuffled orders
    /// over compressed blocks of several rows; see `pipeline::lookahead`).
    lookahead: Option<Lookahead>,
    /// The look-ahead's counts last added to the metrics.
    lookahead_published: LookaheadCounts,
    /// With a shard gate: the shards of the next batches.
    shard_lookahead: ShardLookahead,
    /// A full shuffle of a raw dataset larger than the daemon's memory reads its rows from the disk
    /// (see `pipeline::cold_rows`), into `cold_staging`, and converts them from there.
    cold: Option<ColdRows>,
    cold_staging: Vec<u8>,
}

/// Share of a raw block's bytes below which the CPU backend copies a batch's rows straight from the
/// shard's page cache (a memory map) instead of reading and caching the whole block: shuffled orders
/// touch a few rows of many blocks, and reading each block whole per batch multiplies the bytes read.
/// Blocks a batch uses more of are read in place too when their pages are cached (copying from the
/// page cache beats reading the disk again with O_DIRECT); otherwise the read engine reads them.
const IN_PLACE_COVERAGE_MAX: f64 = 0.5;
/// Fraction of a dense block's pages that must be cached for it to be read in place.
const IN_PLACE_RESIDENT_MIN: f64 = 0.95;

/// Alignment of each row's bytes in a stream's disk-read staging (see [`Assembler::fill_cold`]).
const COLD_STAGING_ALIGN: u64 = 16;

/// The disk reader of a stream whose rows are read from the disk: a shuffle of fixed-shape fields
/// stored raw, over a local dataset, whose rows are drawn from more than the memory the daemon may
/// use can keep cached (or as `GPUFEED_ROW_READS` says): in a full shuffle the whole dataset, in a
/// window shuffle twice its largest window (the window read and the next). `None` otherwise, or
/// when the reader cannot be set up (then said in the log, and the stream reads as any other).
fn cold_rows_for(plan: &Arc<StreamPlan>, files: &FileTable) -> Option<ColdRows> {
    let shuffle = plan.order.shuffle_kind();
    let eligible = shuffle != super::ShuffleKind::None
        && plan.shard_gate.is_none()
        && plan.mixture.is_none()
        && plan.fields.iter().all(|field| field.variable.is_none())
        && plan.dataset.shards.iter().all(|shard| {
            plan.fields.iter().all(|field| {
                shard
                    .metadata
                    .field_blocks(field.field_index)
                    .iter()
                    .all(|block| block.codec == Codec::Raw)
            })
        });
    if !eligible {
        return None;
    }
    let file_bytes: Vec<u64> = (0..files.len())
        .map(|i| files.get(FileId(i as u32)).len)
        .collect();
    let dataset_bytes: u64 = file_bytes.iter().sum();
    let drawn_bytes = if shuffle == super::ShuffleKind::Window {
        let firsts = plan.shard_first_samples();
        let window_shards = plan.order.shards_per_span_max(1, &firsts).unwrap_or(1) as u64;
        let largest = file_bytes.iter().copied().max().unwrap_or(0);
        (2 * window_shards * largest).min(dataset_bytes)
    } else {
        dataset_bytes
    };
    let limit = crate::storage::memory::memory_limit_bytes();
    if !RowReads::from_env().reads_disk(drawn_bytes, limit) {
        return None;
    }
    match ColdRows::open(Arc::clone(&plan.dataset), plan.on_corrupt) {
        Ok(cold) => {
            tracing::info!(
                "host stream: a {:?} shuffle draws rows from more than the daemon's memory keeps \
                 ({} bytes, limit {}): rows read from the disk at a queue depth of {}",
                shuffle,
                drawn_bytes,
                limit.map_or("unknown".to_string(), |l| format!("{l} bytes")),
                COLD_QUEUE_DEPTH
            );
            Some(cold)
        }
        Err(error) => {
            tracing::warn!("rows not read from the disk: {error}");
            None
        }
    }
}

/// Decoded bytes a host stream of `plan` reads at once at most, which it reserves beside its slots:
/// the blocks of one part of a batch (see [`Assembler::fill`]), at least the blocks one row may
/// touch in every field.
///
/// A mixture's is the sum of its sources': each source's assembler holds a part of its own.
pub fn working_set_bytes(plan: &StreamPlan) -> u64 {
    if let Some(mixture) = &plan.mixture {
        return mixture
            .sources
            .iter()
            .map(|source| working_set_bytes(source))
            .sum();
    }
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
            field
                .sample_bytes_in_max()
                .div_ceil(block.max(1))
                .saturating_add(2)
                * block
        })
        .sum();
    block_cache::working_set_bytes(row)
}

/// What a sample at `placement` needs, whichever way it is served: its raw bytes, and their share of
/// their blocks' stored bytes (`blocks`: its field's blocks in its shard).
fn needed_bytes(blocks: &[crate::format::BlockEntry], placement: &Placement) -> (u64, u64) {
    let (mut raw, mut stored) = (0u64, 0u64);
    for block_index in placement.blocks.clone() {
        let entry = &blocks[block_index as usize];
        let from = placement.start.max(entry.raw_offset);
        let to = placement.end.min(entry.raw_offset + entry.raw_bytes as u64);
        raw += to - from;
        stored += (to - from) * u64::from(entry.stored_bytes) / u64::from(entry.raw_bytes.max(1));
    }
    (raw, stored)
}

/// For each field of `plan` (`None` for fixed-shape ones), where the rows of the batch located by
/// `placements` go, in the field's batch form; writes each variable-length field's index tensor
/// (lengths, or cumulative offsets from 0) into `slot`, and zeroes a padded field's values so that
/// what its rows leave is padding.
pub(crate) fn variable_rows(
    plan: &StreamPlan,
    placements: &[Placement],
    slot: &mut [u8],
) -> Vec<Option<VariableRows>> {
    let width = plan.fields.len();
    let samples = placements.len() / width.max(1);
    let rows = plan.variable_rows(samples, |at, row| &placements[row * width + at]);
    for (field, rows) in plan.fields.iter().zip(&rows) {
        let (Some(rows), Some(variable)) = (rows, &field.variable) else {
            continue;
        };
        slot[variable.index_offset..][..rows.index.len()].copy_from_slice(&rows.index);
        if variable.form == VariableForm::Padded {
            slot[field.offset..][..rows.values_bytes(field.sample_bytes_out)].fill(0);
        }
    }
    rows
}

/// Replaces row `row` of the batch in `slot` by an all-zero sample in every field (of a
/// variable-length field, zeros of the row's length): deterministic, the same on every rank, and
/// counted so the trainer can see it.
fn zero_row(
    plan: &StreamPlan,
    variable_rows: &[Option<VariableRows>],
    row: usize,
    slot: &mut [u8],
) {
    for (field, rows) in plan.fields.iter().zip(variable_rows) {
        slot[row_range(field, rows, row)].fill(0);
    }
}

/// Where row `row` of `field` lies in a slot: where `rows` place it for a variable-length field,
/// at the field's fixed stride otherwise.
fn row_range(field: &FieldPlan, rows: &Option<VariableRows>, row: usize) -> std::ops::Range<usize> {
    match rows {
        Some(rows) => field.row_place(rows, row),
        None => {
            let start = field.offset + row * field.sample_bytes_out;
            start..start + field.sample_bytes_out
        }
    }
}

/// Bytes a host stream of `plan` keeps ahead in its look-ahead (`pipeline::lookahead`), which it
/// reserves beside its slots and working set: `limits.lookahead_bytes_max`, or the stream's own rows
/// if fewer, in shuffled orders over compressed blocks of several rows; nothing otherwise.
///
/// A mixture keeps nothing ahead: the look-ahead indexes the rows of a single dataset's steps.
pub fn lookahead_bytes(plan: &StreamPlan, limits: &StreamLimits) -> u64 {
    if plan.mixture.is_some() || plan.source_of.is_some() || !lookahead::worthwhile(plan) {
        return 0;
    }
    let row = lookahead::row_bytes(plan).max(1);
    let stream_rows = plan.steps.saturating_mul(u64::from(plan.rank.batch_size));
    let bytes = limits
        .lookahead_bytes_max
        .min(stream_rows.saturating_mul(row));
    bytes / row * row
}

impl Assembler {
    /// Opens the dataset's shards and sets up the engine, with a decoded-block cache of the stream's
    /// own of `limits.cache_bytes_max` bytes (benchmarks and tools; the daemon shares one cache
    /// between its streams, [`Assembler::with_cache`]). The stream's look-ahead
    /// ([`lookahead_bytes`]) is reserved in that budget, as the daemon reserves it in its own: the
    /// cache keeps what the look-ahead leaves, and a look-ahead the budget cannot hold is not used.
    pub fn new(
        plan: Arc<StreamPlan>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
    ) -> Result<Assembler, StorageError> {
        let budget = limits.cache_bytes_max as u64;
        let cache = BlockCache::new(budget, Arc::clone(&metrics));
        let mut limits = *limits;
        let lookahead = lookahead_bytes(&plan, &limits);
        if lookahead > 0 && !metrics.reserve_slot_bytes(lookahead, budget) {
            limits.lookahead_bytes_max = 0;
        }
        Assembler::with_cache(plan, &limits, metrics, &cache)
    }

    /// Opens the dataset's shards and sets up the engine; decoded blocks go to `cache`, shared with
    /// the other streams using it. The stream's working set ([`working_set_bytes`]) and look-ahead
    /// ([`lookahead_bytes`] of `limits`) should be reserved in the cache's budget (the socket server
    /// reserves them with the slots).
    pub fn with_cache(
        plan: Arc<StreamPlan>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
        cache: &Arc<BlockCache>,
    ) -> Result<Assembler, StorageError> {
        let mut files = FileTable::new(plan.dataset.shards.len());
        // Shards behind a gate are opened batch by batch, once the gate holds them.
        if plan.shard_gate.is_none() {
            for shard in &plan.dataset.shards {
                files.open(&shard.path, DirectIo::Prefer)?;
            }
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
        let cold = cold_rows_for(&plan, &files);
        let lookahead = if cold.is_some() {
            None
        } else {
            Lookahead::new(&plan, lookahead_bytes(&plan, limits))
        };
        Ok(Assembler {
            lookahead,
            lookahead_published: LookaheadCounts::default(),
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
            in_place_shards: Vec::new(),
            in_place_stamp: vec![0; plan_shards],
            in_place_part: 0,
            buffered: (0..plan_shards).map(|_| None).collect(),
            shard_lookahead: ShardLookahead::default(),
            cold,
            cold_staging: Vec::new(),
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
        if self.cold.is_some() {
            return self.fill_cold(&plan, step, slot);
        }
        // Where every (sample, field) of the batch lives, row by row, located once for both passes
        // (by the look-ahead, which located it when it indexed the step).
        let placements = match &mut self.lookahead {
            Some(lookahead) => lookahead.begin(&plan, step),
            None => plan.placements(step),
        };
        if let Some(gate) = &plan.shard_gate {
            self.follow_gate(gate.as_ref(), step, &placements)?;
        }
        let width = plan.fields.len();
        let sample_count = placements.len() / width;
        // A mixture source's rows go to the slot rows that draw from it.
        let slot_rows = plan.slot_rows(step);
        let variable_rows = variable_rows(&plan, &placements, slot);
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
                for (at, (placement, field)) in row.iter().zip(&plan.fields).enumerate() {
                    if self.kept_ahead(step, end, at) {
                        continue;
                    }
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
                for (at, (placement, field)) in row.iter().zip(&plan.fields).enumerate() {
                    if self.kept_ahead(step, end, at) {
                        continue;
                    }
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
            if let Some(lookahead) = &mut self.lookahead {
                // The rows of later parts and later steps in the blocks at hand are taken now.
                for (&key, block) in &self.part {
                    lookahead.offer(key, block, step, end);
                }
            }
            let filled = self.gather(
                step,
                &placements,
                &variable_rows,
                first..end,
                slot_rows.as_deref(),
                slot,
            );
            // The part's blocks are released whatever happened: the cache may evict them now.
            self.part.clear();
            replaced += filled?;
            first = end;
        }
        self.publish_lookahead();
        Ok(FillReport {
            samples: sample_count as u32,
            replaced,
        })
    }

    /// [`Self::fill`] for a stream whose rows are read from the disk: every row's bytes (one copy
    /// per block a row spans) read into the staging buffer at once, then converted into the slot;
    /// rows of blocks found corrupt are zeroed and counted (or the error, under `fail`).
    fn fill_cold(
        &mut self,
        plan: &StreamPlan,
        step: u64,
        slot: &mut [u8],
    ) -> Result<FillReport, FillError> {
        let placements = plan.placements(step);
        let width = plan.fields.len();
        let rows = placements.len() / width;
        let mut copies: Vec<RowCopy> = Vec::with_capacity(placements.len());
        // Per (row, field), its copies' range in `copies`.
        let mut spans: Vec<std::ops::Range<usize>> = Vec::with_capacity(placements.len());
        let mut used = 0u64;
        for (at, placement) in placements.iter().enumerate() {
            let field = &plan.fields[at % width];
            let blocks = plan.dataset.shards[placement.shard]
                .metadata
                .field_blocks(field.field_index);
            let first = copies.len();
            for block in placement.blocks.clone() {
                let entry = &blocks[block as usize];
                let from = placement.start.max(entry.raw_offset);
                let to = placement.end.min(entry.raw_offset + entry.raw_bytes as u64);
                let staging_offset = used.div_ceil(COLD_STAGING_ALIGN) * COLD_STAGING_ALIGN;
                used = staging_offset + (to - from);
                copies.push(RowCopy {
                    shard: placement.shard as u32,
                    file_offset: entry.stored_offset + (from - entry.raw_offset),
                    bytes: (to - from) as u32,
                    staging_offset,
                    field: field.field_index as u32,
                    row: (at / width) as u32,
                });
            }
            spans.push(first..copies.len());
        }
        self.cold_staging.resize(used as usize, 0);
        let cold = self
            .cold
            .as_mut()
            .expect("a stream reading rows from the disk");
        let read_before = cold.stats().read_bytes;
        let bad = cold.read_round(&copies, &mut self.cold_staging)?;
        self.metrics
            .add_read_bytes(self.read_path, cold.stats().read_bytes - read_before);
        for (at, span) in spans.into_iter().enumerate() {
            let (row, field) = (at / width, &plan.fields[at % width]);
            if bad.binary_search(&row).is_ok() {
                continue;
            }
            let bytes: &[u8] = if let [one] = &copies[span.clone()] {
                &self.cold_staging[one.staging_offset as usize..][..one.bytes as usize]
            } else {
                self.sample.clear();
                for piece in &copies[span] {
                    let start = piece.staging_offset as usize;
                    self.sample
                        .extend_from_slice(&self.cold_staging[start..start + piece.bytes as usize]);
                }
                &self.sample
            };
            let out = &mut slot[row_range(field, &None, row)];
            decode::convert(field.stored, bytes, field.out, out)
                .expect("conversions are validated when the stream is planned");
        }
        let no_variable: Vec<Option<VariableRows>> = vec![None; width];
        for &row in &bad {
            zero_row(plan, &no_variable, row, slot);
        }
        Ok(FillReport {
            samples: rows as u32,
            replaced: bad.len() as u32,
        })
    }

    /// Whether field `field` (its position in the stream) of row `row` of step `step` is kept in the
    /// look-ahead.
    fn kept_ahead(&self, step: u64, row: usize, field: usize) -> bool {
        self.lookahead
            .as_ref()
            .is_some_and(|lookahead| lookahead.holds(step, row as u32, field))
    }

    /// Adds what the look-ahead did since the last call to the metrics.
    fn publish_lookahead(&mut self) {
        let Some(lookahead) = &self.lookahead else {
            return;
        };
        let now = lookahead.counts();
        let counters = self.metrics.block_cache();
        counters.lookahead_rows_kept.fetch_add(
            now.rows_kept - self.lookahead_published.rows_kept,
            std::sync::atomic::Ordering::Relaxed,
        );
        counters.lookahead_rows_served.fetch_add(
            now.rows_served - self.lookahead_published.rows_served,
            std::sync::atomic::Ordering::Relaxed,
        );
        self.lookahead_published = now;
    }

    /// Before step `step` of a stream whose shards arrive while it runs: holds and opens the shards
    /// the batch reads, names those of the next batches to the gate, and closes and releases the
    /// shards neither reads (their maps and descriptors first, so the cache may evict them).
    fn follow_gate(
        &mut self,
        gate: &dyn ShardGate,
        step: u64,
        placements: &[Placement],
    ) -> Result<(), FillError> {
        let mut needed: Vec<usize> = placements.iter().map(|p| p.shard).collect();
        needed.sort_unstable();
        needed.dedup();
        gate.hold(&needed).map_err(FillError::ShardsUnavailable)?;
        for &shard in &needed {
            let id = FileId(shard as u32);
            if !self.files.is_open(id) {
                let path = &self.plan.dataset.shards[shard].path;
                self.files.open_at(id, path, DirectIo::Prefer)?;
            }
        }
        let plan = Arc::clone(&self.plan);
        let step_shards = |s: u64| plan.step_shards(s);
        let steps = StreamSteps {
            count: plan.steps,
            batch: u64::from(plan.rank.batch_size),
            shards: &step_shards,
        };
        let ahead = self.shard_lookahead.ahead(
            steps,
            step,
            &needed,
            GATE_SHARDS_AHEAD,
            GATE_SCAN_SAMPLES_MAX,
        );
        gate.ahead(&ahead);
        let released: Vec<usize> = (0..self.plan.dataset.shards.len())
            .filter(|&shard| self.files.is_open(FileId(shard as u32)))
            .filter(|shard| needed.binary_search(shard).is_err() && !ahead.contains(shard))
            .collect();
        for &shard in &released {
            self.maps[shard] = None;
            self.buffered[shard] = None;
            self.files.close(FileId(shard as u32));
        }
        if !released.is_empty() {
            gate.release(&released);
        }
        Ok(())
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
        self.in_place_shards.clear();
        self.in_place_part += 1;
        for (key, used) in sparse {
            // A raw block the part uses little of is read in place (see IN_PLACE_COVERAGE_MAX).
            let dense = used as f64 >= self.entry(&key).raw_bytes as f64 * IN_PLACE_COVERAGE_MAX;
            if !self.map_in_place(&key, dense)? {
                self.cache.cache().record(false);
                missing.push(key);
            }
        }
        missing.sort_unstable();
        self.load(&missing)
    }

    /// Gathers rows `rows` of the batch (`placements`: every row's, in row order) into `slot` from
    /// the part's blocks and the shards' maps, row `i` into slot row `slot_rows[i]` when given (a
    /// mixture source's), into slot row `i` otherwise; the samples replaced by zeros.
    fn gather(
        &mut self,
        step: u64,
        placements: &[Placement],
        variable_rows: &[Option<VariableRows>],
        rows: std::ops::Range<usize>,
        slot_rows: Option<&[usize]>,
        slot: &mut [u8],
    ) -> Result<u32, FillError> {
        let plan = Arc::clone(&self.plan);
        let gather_started = std::time::Instant::now();
        let mut replaced = 0u32;
        let mut in_place_bytes = 0u64;
        let (mut needed_raw, mut needed_stored) = (0u64, 0u64);
        let width = plan.fields.len();
        // A mixture serves fixed-shape fields only (`StreamPlan::mixture`): variable-length rows,
        // placed by the whole batch's lengths, are never a mixture source's.
        debug_assert!(slot_rows.is_none() || variable_rows.iter().all(Option::is_none));
        for row in rows {
            let slot_row = slot_rows.map_or(row, |rows| rows[row]);
            let row_placements = &placements[row * width..(row + 1) * width];
            let ahead = (row + PREFETCH_ROWS_AHEAD) * width;
            if let Some(ahead) = placements.get(ahead..ahead + width) {
                self.prefetch_in_place(ahead);
            }
            let mut corrupt: Option<Arc<CorruptBlock>> = None;
            for (field_at, (field, placement)) in plan.fields.iter().zip(row_placements).enumerate()
            {
                let (shard, start, end) = (placement.shard, placement.start, placement.end);
                self.sample.clear();
                let blocks = &self.plan.dataset.shards[shard]
                    .metadata
                    .field_blocks(field.field_index);
                let (raw, stored) = needed_bytes(blocks, placement);
                needed_raw += raw;
                needed_stored += stored;
                let out = &mut slot[row_range(field, &variable_rows[field_at], slot_row)];
                let convert = |bytes: &[u8], out: &mut [u8]| {
                    decode::convert(field.stored, bytes, field.out, out)
                        .expect("conversions are validated when the stream is planned")
                };
                // Kept ahead: converted straight from the look-ahead.
                if let Some(lookahead) = &mut self.lookahead {
                    if lookahead
                        .take(step, row as u32, field_at, |bytes| convert(bytes, out))
                        .is_some()
                    {
                        continue;
                    }
                }
                // In one block (the usual case: samples fit in blocks): converted straight from it.
                if placement.blocks.len() == 1 {
                    let block_index = placement.blocks.start;
                    let key = BlockKey {
                        shard: shard as u32,
                        field: field.field_index as u32,
                        block: block_index,
                    };
                    let entry = &blocks[block_index as usize];
                    let from = (start - entry.raw_offset) as usize;
                    let to = (end - entry.raw_offset) as usize;
                    match self.part.get(&key) {
                        Some(CachedBlock::Decoded(bytes)) => convert(&bytes.bytes()[from..to], out),
                        Some(CachedBlock::Corrupt(bad)) => {
                            corrupt = Some(Arc::clone(bad));
                            break;
                        }
                        None => {
                            // Read in place: a raw block whose checksum map_in_place verified.
                            let (map, _) =
                                self.maps[shard].as_ref().expect("mapped in map_in_place");
                            let at = entry.stored_offset as usize;
                            convert(&map.bytes()[at + from..at + to], out);
                            in_place_bytes += (to - from) as u64;
                        }
                    }
                    continue;
                }
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
                            self.sample.extend_from_slice(
                                &map.bytes()[at + from as usize..at + to as usize],
                            );
                            in_place_bytes += to - from;
                        }
                    }
                }
                if corrupt.is_some() {
                    break;
                }
                convert(&self.sample, out);
            }
            if let Some(bad) = corrupt {
                if let Some(lookahead) = &mut self.lookahead {
                    // The row's other fields kept ahead go with it.
                    lookahead.discard(step, row as u32);
                }
                match plan.on_corrupt {
                    CorruptPolicy::Fail => return Err(bad.to_error()),
                    CorruptPolicy::Replace => {
                        zero_row(&plan, variable_rows, slot_row, slot);
                        replaced += 1;
                    }
                }
            }
        }
        // Before the slot is handed on: if a shard read in place was truncated or rewritten
        // meanwhile, rows of this batch may hold zeros or another file's bytes.
        for index in 0..self.in_place_shards.len() {
            self.check_in_place(self.in_place_shards[index] as usize)?;
        }
        if in_place_bytes > 0 {
            self.metrics
                .add_read_bytes(ReadPath::PageCache, in_place_bytes);
        }
        let counters = self.metrics.block_cache();
        counters
            .needed_raw_bytes
            .fetch_add(needed_raw, std::sync::atomic::Ordering::Relaxed);
        counters
            .needed_stored_bytes
            .fetch_add(needed_stored, std::sync::atomic::Ordering::Relaxed);
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
            if let Some(byte) = map.bytes().get(at as usize) {
                prefetch(byte);
            }
        }
    }

    fn entry(&self, key: &BlockKey) -> crate::format::BlockEntry {
        self.plan.dataset.shards[key.shard as usize]
            .metadata
            .field_blocks(key.field as usize)[key.block as usize]
    }

    /// Fails, naming the shard, if shard `shard`'s map was read beyond the end of the file or the
    /// file's length or modification time changed since it was mapped (`cp` or `rsync --inplace` over
    /// a served dataset): what was read from it may be zeros or another version's bytes.
    fn check_in_place(&self, shard: usize) -> Result<(), StorageError> {
        let Some((map, _)) = self.maps[shard].as_ref() else {
            return Ok(());
        };
        map.check(self.files.get(FileId(shard as u32)).file())
            .map_err(|reason| StorageError::Changed {
                path: self.plan.dataset.shards[shard].path.clone(),
                reason,
            })
    }

    /// Prepares raw block `key` to be read in place from its shard's memory map (`dense`: the batch
    /// uses most of it, so only if its pages are cached): maps the shard if needed and verifies the
    /// block's checksum unless a reader of the dataset has (a corrupt block goes into the cache as
    /// such, for the rows that read it). False when the shard cannot be mapped: read the block whole
    /// instead, as when a dense block is not cached. Fails if the shard changed under its map.
    fn map_in_place(&mut self, key: &BlockKey, dense: bool) -> Result<bool, StorageError> {
        let shard = key.shard as usize;
        if self.maps[shard].is_none() {
            let file = self.files.get(FileId(key.shard)).file();
            match (MappedFile::map(file), ResidencyMap::new(file)) {
                (Ok(map), Ok(residency)) => self.maps[shard] = Some((map, residency)),
                _ => return Ok(false),
            }
        }
        if self.in_place_stamp[shard] != self.in_place_part {
            self.in_place_stamp[shard] = self.in_place_part;
            self.in_place_shards.push(key.shard);
        }
        let entry = self.entry(key);
        if dense {
            let (_, residency) = self.maps[shard].as_ref().expect("mapped above");
            let cached = residency
                .resident_fraction(entry.stored_offset as usize, entry.stored_bytes as usize)
                .is_ok_and(|f| f >= IN_PLACE_RESIDENT_MIN);
            if !cached {
                return Ok(false);
            }
        }
        let verified = &self.plan.dataset.verified;
        if verified.contains(shard, key.field as usize, key.block) {
            return Ok(true);
        }
        let (map, _) = self.maps[shard].as_ref().expect("mapped above");
        let at = entry.stored_offset as usize;
        if at + entry.stored_bytes as usize > map.len() {
            return Ok(false);
        }
        let stored = &map.bytes()[at..at + entry.stored_bytes as usize];
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
                // A block that reads wrong because its shard was cut under the map is not corrupt
                // on disk: say what happened instead.
                self.check_in_place(shard)?;
                self.metrics.add_corrupt_blocks(1);
                let bad = CachedBlock::Corrupt(Arc::new(CorruptBlock::from(error)));
                self.offer(*key, bad);
            }
        }
        Ok(true)
    }

    /// Copies `extent` into the staging buffer from the page cache when all its pages are cached (a
    /// buffered read of the shard, so that a shard cut short under it is a read error, not a fault):
    /// the bytes copied, or none to read it with the engine.
    fn read_cached(&mut self, extent: &Extent) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let shard = extent.file.0 as usize;
        if self.buffered[shard].is_none() {
            let file = std::fs::File::open(&self.plan.dataset.shards[shard].path).ok()?;
            let residency = ResidencyMap::new(&file).ok()?;
            self.buffered[shard] = Some((file, residency));
        }
        let (file, residency) = self.buffered[shard].as_ref()?;
        let resident = residency
            .resident_fraction(extent.offset as usize, extent.len)
            .ok()?;
        if resident < 1.0 {
            return None;
        }
        let dest = &mut self.staging.as_mut_slice()[extent.dest_offset..][..extent.len];
        file.read_exact_at(dest, extent.offset).ok()?;
        Some(extent.len as u64)
    }

    /// Reads `extents` into the staging buffer: from the page cache where all their pages are cached,
    /// with the engine otherwise. One result per extent.
    fn read_extents(
        &mut self,
        extents: &[Extent],
    ) -> Result<Vec<Result<(), crate::storage::ReadError>>, StorageError> {
        // Blocks whose pages are cached are copied from the page cache (a buffered read): the
        // engine would read them from the disk again with O_DIRECT, once per miss of the block
        // cache, where a shuffled order over a dataset larger than the cache misses often.
        let mut results: Vec<Option<Result<(), crate::storage::ReadError>>> =
            (0..extents.len()).map(|_| None).collect();
        let mut page_cache_bytes = 0u64;
        for (extent, result) in extents.iter().zip(results.iter_mut()) {
            if let Some(bytes) = self.read_cached(extent) {
                *result = Some(Ok(()));
                page_cache_bytes += bytes;
            }
        }
        let cold: Vec<Extent> = extents
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_none())
            .map(|(e, _)| *e)
            .collect();
        if !cold.is_empty() {
            let cold_results = self
                .engine
                .read(&self.files, &cold, self.staging.as_mut_slice())?;
            let read_bytes: usize = cold
                .iter()
                .zip(&cold_results)
                .filter(|(_, r)| r.is_ok())
                .map(|(e, _)| e.len)
                .sum();
            self.metrics
                .add_read_bytes(self.read_path, read_bytes as u64);
            let mut cold_results = cold_results.into_iter();
            for result in results.iter_mut().filter(|r| r.is_none()) {
                *result = cold_results.next();
            }
        }
        if page_cache_bytes > 0 {
            self.metrics
                .add_read_bytes(ReadPath::PageCache, page_cache_bytes);
        }
        Ok(results
            .into_iter()
            .map(|r| r.expect("every extent read one way or the other"))
            .collect())
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
            let results = self.read_extents(&extents)?;
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
            let decoded_bytes: u64 = decoded
                .iter()
                .map(|block| match block {
                    CachedBlock::Decoded(bytes) => bytes.bytes().len() as u64,
                    CachedBlock::Corrupt(_) => 0,
                })
                .sum();
            self.metrics
                .block_cache()
                .decoded_bytes
                .fetch_add(decoded_bytes, std::sync::atomic::Ordering::Relaxed);
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

/// The CPU backend's assembler of a stream: a dataset's, or a mixture's, which fills each batch
/// source by source with an [`Assembler`] per source (each reading its own dataset's blocks,
/// through the shared cache, into the slot rows that draw from it).
pub enum HostAssembler {
    /// A stream of one dataset.
    Dataset(Box<Assembler>),
    /// A mixture stream: one assembler per source, in the plan's order.
    Mixture(Vec<Assembler>),
}

impl HostAssembler {
    /// Sets up the assembler of `plan` (see [`Assembler::with_cache`]): one per source for a
    /// mixture.
    pub fn with_cache(
        plan: Arc<StreamPlan>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
        cache: &Arc<BlockCache>,
    ) -> Result<HostAssembler, StorageError> {
        match &plan.mixture {
            None => Assembler::with_cache(plan, limits, metrics, cache)
                .map(|assembler| HostAssembler::Dataset(Box::new(assembler))),
            Some(mixture) => mixture
                .sources
                .iter()
                .map(|source| {
                    Assembler::with_cache(Arc::clone(source), limits, Arc::clone(&metrics), cache)
                })
                .collect::<Result<Vec<_>, _>>()
                .map(HostAssembler::Mixture),
        }
    }

    /// Why io_uring is not used, when it is not.
    pub fn engine_note(&self) -> Option<&str> {
        match self {
            HostAssembler::Dataset(assembler) => assembler.engine_note.as_deref(),
            HostAssembler::Mixture(sources) => {
                sources.iter().find_map(|a| a.engine_note.as_deref())
            }
        }
    }

    /// Fills `slot` with stream step `step`: a mixture's sources each fill their rows.
    pub fn fill(&mut self, step: u64, slot: &mut [u8]) -> Result<FillReport, FillError> {
        match self {
            HostAssembler::Dataset(assembler) => assembler.fill(step, slot),
            HostAssembler::Mixture(sources) => {
                let mut report = FillReport {
                    samples: 0,
                    replaced: 0,
                };
                for source in sources {
                    let filled = source.fill(step, slot)?;
                    report.samples += filled.samples;
                    report.replaced += filled.replaced;
                }
                Ok(report)
            }
        }
    }
}
