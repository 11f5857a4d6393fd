//! The CPU backend's look-ahead for shuffled orders: when a compressed block is decoded for a batch,
//! the rows of the next batches that lie in it are copied out at once and kept until their batch is
//! filled.
//!
//! # Why
//!
//! In a shuffled order, a compressed block of `k` rows is needed at `k` scattered points of the epoch.
//! A cache of decoded blocks keeps the whole block (all `k` rows) to serve the one row needed next, so
//! with a cache of a quarter of a dataset of 64 KiB blocks of eight 8 KiB rows, a full shuffle decoded
//! every block about six times an epoch (`docs/benchmarks/cpu-block-cache-2026-11-28.md`). The order
//! is known ahead: this module indexes the rows of the next steps by the block that holds them, and
//! when a block is decoded (or found in the cache) the indexed rows in it are copied out and kept, one
//! row each, which serves a row with an eighth of the memory a cached block spends on it. Batches are
//! still filled and handed on in step order; only their rows are taken out of blocks early.
//!
//! # Bounds
//!
//! - Rows kept: at most `rows_max` per field, in one arena per field, sized when the stream opens from
//!   the bytes the stream reserved for its look-ahead (`StreamLimits::lookahead_bytes_max`). When the
//!   arena is full, the row needed last gives way to one needed sooner (it goes back to the index, to
//!   be taken out of a later decode of its block, or decoded at its own step): what is kept is always
//!   the rows needed soonest of those seen, which is what an optimal cache of rows would keep.
//! - Horizon: the steps indexed ahead hold at most `horizon_rows_max` rows ([`HORIZON_PER_ROW_KEPT`]
//!   times `rows_max`, and no more than an index of a quarter of the arena's bytes: rows of a few
//!   bytes would otherwise index far more than they keep), or the next step's if it holds more, and
//!   their placements are kept to fill them; so the index is bounded too.
//!
//! Rows split over several blocks, rows of raw blocks (read in place from the page cache, a row at a
//! time) and rows of corrupt blocks are not kept: they take the assembler's usual path at their step,
//! which reports a corrupt block as it does without the look-ahead.

use foldhash::{HashMap, HashMapExt};
use std::collections::{BTreeMap, VecDeque};

use super::block_cache::CachedBlock;
use super::stream_plan::{BlockKey, Placement, StreamPlan};
use crate::format::Codec;

/// Rows indexed ahead per row the arena keeps. A horizon as long as the arena leaves it mostly empty
/// (a block decoded now holds few rows needed that soon); a longer one fills it, and the rows needed
/// last give way to sooner ones. Simulated on a full shuffle of 131072 rows with an arena of a
/// quarter of them: blocks of 2 rows are decoded 1.39 times an epoch with a horizon of twice the
/// arena, 1.25 with four times, 1.13 with the whole epoch; the index costs about 64 bytes a row.
pub const HORIZON_PER_ROW_KEPT: u64 = 4;

/// A row of a later step indexed by the block that holds it.
#[derive(Clone, Copy, Debug)]
struct Pending {
    step: u64,
    row: u32,
    /// The field's position in the stream (slot order).
    field: u32,
    /// The row's bytes within the block's decoded bytes.
    from: u32,
    to: u32,
}

/// The rows of one field kept ahead: a fixed arena of `rows_max` samples.
struct FieldRows {
    sample_bytes: usize,
    /// `rows_max * sample_bytes` bytes, allocated on first use (an arena the stream never fills costs
    /// nothing; one it fills was reserved when the stream opened).
    arena: Vec<u8>,
    free: Vec<u32>,
    /// Rows kept, by step and row (the last is needed last), with their arena index.
    held: BTreeMap<(u64, u32), u32>,
    /// Per arena index, where its row came from: to index it again if it gives way.
    origin: Vec<(BlockKey, Pending)>,
}

/// What the look-ahead did, for the stream's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LookaheadCounts {
    /// Rows copied out of a block ahead of their step.
    pub rows_kept: u64,
    /// Rows served from the look-ahead.
    pub rows_served: u64,
    /// Rows left indexed because the arena was full of rows needed sooner when their block was
    /// decoded, or given way to such rows (counted each time).
    pub rows_not_kept: u64,
}

/// A stream's look-ahead (see the module's documentation).
pub struct Lookahead {
    fields: Vec<FieldRows>,
    rows_max: usize,
    horizon_rows_max: u64,
    /// The step the next fill is expected for; another step resets the look-ahead.
    next_fill: u64,
    /// Steps below this one are indexed.
    indexed_end: u64,
    /// Placements of steps `next_fill..indexed_end`, in step order.
    placements: VecDeque<Vec<Placement>>,
    /// Rows of the steps in `placements`.
    indexed_rows: u64,
    pending: HashMap<BlockKey, Vec<Pending>>,
    counts: LookaheadCounts,
}

/// Whether a stream of `plan` gains from a look-ahead: a shuffled order over a field whose blocks are
/// compressed and hold more than one row.
pub fn worthwhile(plan: &StreamPlan) -> bool {
    // Rows of variable-length fields differ in size: not kept ahead (their batches are gathered
    // from the blocks, as in dataset order).
    !plan.order.is_identity()
        && !plan.has_variable()
        && plan.fields.iter().any(|field| {
            plan.dataset.shards.iter().any(|shard| {
                shard
                    .metadata
                    .field_blocks(field.field_index)
                    .first()
                    .is_some_and(|block| {
                        block.codec != Codec::Raw
                            && block.raw_bytes as usize >= 2 * field.sample_bytes_in.max(1)
                    })
            })
        })
}

/// Bytes of one row over the stream's fields, as stored (before conversion).
pub fn row_bytes(plan: &StreamPlan) -> u64 {
    plan.fields
        .iter()
        .map(|field| field.sample_bytes_in as u64)
        .sum()
}

impl Lookahead {
    /// A look-ahead for `plan` keeping at most `bytes_max` bytes of rows; none when the stream does
    /// not gain from one ([`worthwhile`]) or `bytes_max` holds less than one row.
    pub fn new(plan: &StreamPlan, bytes_max: u64) -> Option<Lookahead> {
        let row = row_bytes(plan).max(1);
        let rows_max = usize::try_from(bytes_max / row)
            .unwrap_or(usize::MAX)
            .min(u32::MAX as usize);
        if rows_max == 0 || !worthwhile(plan) {
            return None;
        }
        // An indexed row costs its placements and pending entries (and their maps' slots).
        let index_row_bytes = (plan.fields.len()
            * (std::mem::size_of::<Placement>() + std::mem::size_of::<Pending>() + 16))
            as u64;
        let horizon_rows_max = (HORIZON_PER_ROW_KEPT * rows_max as u64)
            .min(bytes_max / 4 / index_row_bytes.max(1))
            .max(1);
        Some(Lookahead {
            fields: plan
                .fields
                .iter()
                .map(|field| FieldRows {
                    sample_bytes: field.sample_bytes_in,
                    arena: Vec::new(),
                    free: Vec::new(),
                    held: BTreeMap::new(),
                    origin: Vec::new(),
                })
                .collect(),
            rows_max,
            horizon_rows_max,
            next_fill: 0,
            indexed_end: 0,
            placements: VecDeque::new(),
            indexed_rows: 0,
            pending: HashMap::new(),
            counts: LookaheadCounts::default(),
        })
    }

    /// What the look-ahead did so far.
    pub fn counts(&self) -> LookaheadCounts {
        self.counts
    }

    /// Rows kept now over all fields (for tests and figures).
    pub fn rows_held(&self) -> usize {
        self.fields.iter().map(|field| field.held.len()).sum()
    }

    /// Forgets everything: the next fill is of another step than the one expected.
    fn reset(&mut self, step: u64) {
        for field in &mut self.fields {
            while let Some((_, at)) = field.held.pop_first() {
                field.free.push(at);
            }
        }
        self.placements.clear();
        self.indexed_rows = 0;
        self.pending.clear();
        self.next_fill = step;
        self.indexed_end = step;
    }

    /// Starts filling step `step`: extends the indexed steps up to the horizon and returns the
    /// step's placements (as [`StreamPlan::placements`]).
    pub fn begin(&mut self, plan: &StreamPlan, step: u64) -> Vec<Placement> {
        if step != self.next_fill || self.placements.is_empty() && self.indexed_end != step {
            self.reset(step);
        }
        // The step being filled and the next one at least, whatever their size: the rows of the
        // next batch in the blocks at hand are the likeliest to be kept.
        while self.indexed_end < plan.steps
            && (self.indexed_end <= step + 1 || self.indexed_rows < self.horizon_rows_max)
        {
            let placements = plan.placements(self.indexed_end);
            self.index(plan, self.indexed_end, &placements);
            self.indexed_rows += (placements.len() / plan.fields.len().max(1)) as u64;
            self.placements.push_back(placements);
            self.indexed_end += 1;
        }
        let placements = self
            .placements
            .pop_front()
            .expect("the step being filled is indexed");
        self.indexed_rows -= (placements.len() / plan.fields.len().max(1)) as u64;
        self.next_fill = step + 1;
        placements
    }

    fn index(&mut self, plan: &StreamPlan, step: u64, placements: &[Placement]) {
        let width = plan.fields.len();
        for (at, placement) in placements.iter().enumerate() {
            if placement.blocks.len() != 1 {
                continue;
            }
            let (row, field_at) = (at / width, at % width);
            let field = &plan.fields[field_at];
            let block = placement.blocks.start;
            let entry = plan.dataset.shards[placement.shard]
                .metadata
                .field_blocks(field.field_index)[block as usize];
            if entry.codec == Codec::Raw || entry.raw_bytes as usize <= field.sample_bytes_in {
                continue;
            }
            let key = BlockKey {
                shard: placement.shard as u32,
                field: field.field_index as u32,
                block,
            };
            self.pending.entry(key).or_default().push(Pending {
                step,
                row: row as u32,
                field: field_at as u32,
                from: (placement.start - entry.raw_offset) as u32,
                to: (placement.end - entry.raw_offset) as u32,
            });
        }
    }

    /// Whether row `row` of step `step` has field `field` (its position in the stream) kept.
    pub fn holds(&self, step: u64, row: u32, field: usize) -> bool {
        self.fields[field].held.contains_key(&(step, row))
    }

    /// Hands the kept bytes of field `field` of row `row` of step `step` to `use_bytes` and frees
    /// them; `None` when they are not kept.
    pub fn take<R>(
        &mut self,
        step: u64,
        row: u32,
        field: usize,
        use_bytes: impl FnOnce(&[u8]) -> R,
    ) -> Option<R> {
        let rows = &mut self.fields[field];
        let at = rows.held.remove(&(step, row))?;
        let start = at as usize * rows.sample_bytes;
        let result = use_bytes(&rows.arena[start..start + rows.sample_bytes]);
        rows.free.push(at);
        self.counts.rows_served += 1;
        Some(result)
    }

    /// Frees whatever is kept of row `row` of step `step` (a row replaced because another of its
    /// fields is corrupt).
    pub fn discard(&mut self, step: u64, row: u32) {
        for rows in &mut self.fields {
            if let Some(at) = rows.held.remove(&(step, row)) {
                rows.free.push(at);
            }
        }
    }

    /// Block `key` is at hand while step `step` fills rows up to `rows_end`: keeps the indexed rows in
    /// it that come later (later steps, and later parts of this step), forgets those served now.
    pub(crate) fn offer(&mut self, key: BlockKey, block: &CachedBlock, step: u64, rows_end: usize) {
        let Some(pending) = self.pending.remove(&key) else {
            return;
        };
        let CachedBlock::Decoded(decoded) = block else {
            // A corrupt block: its rows take the usual path at their step, which reports it.
            return;
        };
        let bytes = decoded.bytes();
        let rows_max = self.rows_max;
        // Rows left indexed: under this block, and under others (rows that gave way).
        let mut left: Vec<Pending> = Vec::new();
        let mut gave_way: Vec<(BlockKey, Pending)> = Vec::new();
        for row in pending {
            let later = row.step > step || row.step == step && row.row as usize >= rows_end;
            if !later {
                continue;
            }
            let rows = &mut self.fields[row.field as usize];
            let position = (row.step, row.row);
            if rows.held.contains_key(&position) {
                continue;
            }
            if rows.arena.is_empty() {
                rows.arena = vec![0u8; rows_max * rows.sample_bytes];
                rows.free = (0..rows_max as u32).rev().collect();
                rows.origin = vec![(key, row); rows_max];
            }
            let at = match rows.free.pop() {
                Some(at) => at,
                None => {
                    // Full: the row needed last gives way if it is needed after this one.
                    let last = rows.held.last_key_value().map(|(&p, &at)| (p, at));
                    match last {
                        Some((last, at)) if last > position => {
                            rows.held.remove(&last);
                            gave_way.push(rows.origin[at as usize]);
                            self.counts.rows_not_kept += 1;
                            at
                        }
                        _ => {
                            self.counts.rows_not_kept += 1;
                            left.push(row);
                            continue;
                        }
                    }
                }
            };
            let start = at as usize * rows.sample_bytes;
            rows.arena[start..start + rows.sample_bytes]
                .copy_from_slice(&bytes[row.from as usize..row.to as usize]);
            rows.held.insert(position, at);
            rows.origin[at as usize] = (key, row);
            self.counts.rows_kept += 1;
        }
        if !left.is_empty() {
            self.pending.insert(key, left);
        }
        for (key, row) in gave_way {
            self.pending.entry(key).or_default().push(row);
        }
    }
}
