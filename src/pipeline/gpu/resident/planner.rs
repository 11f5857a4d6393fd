//! Planning a resident stream's rows: each row of a batch is one gather piece (or a few) read in
//! place, planned by arithmetic (sample, shard, block, window) on threads of their own ahead of the
//! filler ([`Planner`]).

use std::sync::Arc;

use foldhash::HashMap;

use super::row_copies::{staging_place, RowCopy};
use super::tier_fill::DecodedLayout;
use crate::format::Codec;
use crate::kernels::{GatherOp, GatherPlan, GatherRegion, GATHER_SOURCES_MAX};
use crate::pipeline::gpu::limits::PLAN_THREADS_MAX;
use crate::pipeline::order::ShuffleKind;
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock, CorruptPolicy, FillError, StreamPlan};

/// Threads planning a resident stream's steps ahead of the filler when its limits leave the choice
/// to it (at most the host's CPU count). A window shuffle of 4096 rows of 2 KiB keeps six threads
/// about half busy, and they can fall behind in its last window, when no copies pace the filler;
/// twelve kept up better.
const PLAN_WORKERS: usize = 12;

/// Planning threads per resident stream: `plan_threads` (see
/// [`crate::pipeline::gpu::GpuStreamLimits::plan_threads`]) if not 0, at most [`PLAN_THREADS_MAX`];
/// else [`PLAN_WORKERS`] or the CPU count, the fewer.
fn plan_workers(plan_threads: usize) -> usize {
    if plan_threads > 0 {
        return plan_threads.min(PLAN_THREADS_MAX);
    }
    // The host's CPU count, read once.
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    PLAN_WORKERS.min(cpus.max(2))
}

/// Steps each planning thread plans ahead of the filler: with 3, a window shuffle's filler waited
/// 27 to 119 ms an epoch (8 GiB, batch 4096) for plans on the H100 test machine, with 16 it waits 3 to
/// 6 ms (a planned step of 4096 rows holds about 100 KiB).
const STEPS_PLANNED_AHEAD: usize = 16;

/// The first steps of a stream planned over another geometry than the rest: a window shuffle beyond
/// the daemon's memory reads the rows of its first steps from the disk into each round's staging
/// (every row copied, see [`RowStaging`]) while its loader copies the first window's shards, then
/// reads every row from those copies.
#[derive(Clone)]
pub(super) struct ColdStart {
    /// The geometry of steps before `steps_end`.
    pub(super) geometry: Arc<RowGeometry>,
    /// The first step planned over the stream's own geometry.
    pub(super) steps_end: u64,
}

/// One step's rows, planned in rounds.
pub(super) struct PlannedStep {
    pub(super) step: u64,
    /// Global order position of the step's first row (where the shards to read ahead start).
    pub(super) first_position: Option<u64>,
    pub(super) rows: usize,
    pub(super) rounds: Result<Vec<PlannedRows>, FillError>,
}

/// Threads planning the rows of a resident stream's steps ahead of the filler, so that host
/// planning overlaps the device's work on earlier steps instead of adding to it. The steps go in
/// chunks of `chunk` consecutive steps (one for large batches; a group's worth for small ones, so
/// that the filler takes a message, and wakes a planning thread, once a group rather than once a
/// batch); worker `k` of `n` plans chunks `k`, `k + n`, ..., each on its own (threads are started
/// once per stream, not per batch: starting them per batch cost more than the planning).
pub(super) struct Planner {
    /// One channel per worker; chunk `c` (steps `first + c * chunk ..`) comes from
    /// `receivers[c % n]`.
    receivers: Vec<std::sync::mpsc::Receiver<Vec<PlannedStep>>>,
    first_step: u64,
    pub(super) next_step: u64,
    chunk: u64,
    /// The rest of the chunk being taken, in step order.
    pub(super) taken: std::collections::VecDeque<PlannedStep>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Nanoseconds spent planning, summed over the threads.
    busy_ns: Arc<std::sync::atomic::AtomicU64>,
}

impl Planner {
    /// Starts planning from `first_step`, `rows_per_round` rows a round, in chunks of `chunk`
    /// steps, on `plan_threads` threads (0: as many as [`plan_workers`] chooses); the steps before
    /// `cold.steps_end` over `cold.geometry`, the others over `geometry`.
    pub(super) fn start(
        plan: Arc<StreamPlan>,
        geometry: Arc<RowGeometry>,
        cold: Option<ColdStart>,
        first_step: u64,
        rows_per_round: usize,
        chunk: usize,
        plan_threads: usize,
    ) -> Planner {
        let chunk = chunk.max(1) as u64;
        let chunks = plan.steps.saturating_sub(first_step).div_ceil(chunk);
        let workers = plan_workers(plan_threads).min(chunks.max(1) as usize);
        let mut receivers = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers);
        let busy_ns = Arc::new(std::sync::atomic::AtomicU64::new(0));
        for worker in 0..workers {
            let (sender, receiver) =
                std::sync::mpsc::sync_channel((STEPS_PLANNED_AHEAD / chunk as usize).max(2));
            let (plan, geometry) = (Arc::clone(&plan), Arc::clone(&geometry));
            let cold = cold.clone();
            let busy_ns = Arc::clone(&busy_ns);
            let thread = std::thread::Builder::new()
                .name(format!("gpufeed-plan-{worker}"))
                .spawn(move || {
                    for index in (worker as u64..chunks).step_by(workers) {
                        let first = first_step + index * chunk;
                        let steps = first..(first + chunk).min(plan.steps);
                        let mut planned = Vec::with_capacity(chunk as usize);
                        let mut failed = false;
                        for step in steps {
                            let started = std::time::Instant::now();
                            let positions: Vec<u64> = plan
                                .rank
                                .batch_positions(plan.order.len(), plan.start_cursor, step)
                                .collect();
                            let geometry = match &cold {
                                Some(cold) if step < cold.steps_end => &cold.geometry,
                                _ => &geometry,
                            };
                            let rounds = plan_step(&plan, geometry, &positions, rows_per_round);
                            busy_ns.fetch_add(
                                started.elapsed().as_nanos() as u64,
                                std::sync::atomic::Ordering::Relaxed,
                            );
                            failed = rounds.is_err();
                            planned.push(PlannedStep {
                                step,
                                first_position: positions.first().copied(),
                                rows: positions.len(),
                                rounds,
                            });
                            if failed {
                                break;
                            }
                        }
                        // The filler stopped listening (the stream ended): stop planning.
                        if sender.send(planned).is_err() || failed {
                            break;
                        }
                    }
                })
                .expect("spawning a planning thread");
            receivers.push(receiver);
            threads.push(thread);
        }
        Planner {
            receivers,
            first_step,
            next_step: first_step,
            chunk,
            taken: std::collections::VecDeque::new(),
            threads,
            busy_ns,
        }
    }

    /// Seconds the planning threads spent planning, summed over the threads.
    pub(super) fn busy_s(&self) -> f64 {
        self.busy_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
    }

    /// The planned rows of the next step.
    pub(super) fn next(&mut self) -> Result<PlannedStep, FillError> {
        let step = self.next_step;
        if self.taken.is_empty() {
            let index = (step - self.first_step) / self.chunk;
            let worker = (index % self.receivers.len() as u64) as usize;
            self.taken = self.receivers[worker]
                .recv()
                .map_err(|_| FillError::PlannerStopped { step })?
                .into();
        }
        let planned = self
            .taken
            .pop_front()
            .ok_or(FillError::PlannerStopped { step })?;
        debug_assert_eq!(planned.step, step);
        self.next_step += 1;
        Ok(planned)
    }
}

/// Plans the rows `positions` of one step in rounds of `rows_per_round` rows.
fn plan_step(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    positions: &[u64],
    rows_per_round: usize,
) -> Result<Vec<PlannedRows>, FillError> {
    let mut rounds = Vec::new();
    let mut first = 0;
    while first < positions.len() {
        let end = (first + rows_per_round).min(positions.len());
        // A round whose rows are copied may end sooner: when its staging is full.
        let (rows, planned_end) = plan_chunk(plan, geometry, positions, first..end)?;
        rounds.push(rows);
        first = planned_end;
    }
    Ok(rounds)
}

impl Drop for Planner {
    fn drop(&mut self) {
        // Closing the channels ends each thread after the step it is planning.
        self.receivers.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// What planning a row needs besides the stream plan.
pub(super) struct RowGeometry {
    /// Region index of each shard's first window.
    first_region: Vec<u32>,
    /// First sample of each shard, and the sample count after the last.
    shard_first_samples: Vec<u64>,
    /// Regions in the stream's table.
    region_count: usize,
    window_bytes: u64,
    /// Raw blocks found corrupt when the stream opened.
    corrupt: HashMap<BlockKey, Arc<CorruptBlock>>,
    /// Per shard, per stream field (in plan order): where the field's raw bytes start in the shard
    /// file, and its blocks' raw size, when its blocks lie back to back in raw order (the packer's
    /// layout for raw blocks of a page-multiple size), so that a row's file offset is one addition.
    linear: Vec<Vec<Option<(u64, u64)>>>,
    /// Largest output of a piece merged from consecutive rows (see
    /// [`crate::pipeline::gpu::GpuStreamLimits::gather_piece_out_bytes`]).
    gather_piece_out_bytes: u64,
    /// A full shuffle beyond the registration budget: the regions whose rows are copied by host
    /// threads into the round's staging (see `row_copies`).
    row_staging: Option<RowStaging>,
    /// A dataset decoded in the device's memory tier: where its blocks lie there (instead of
    /// their stored offsets in the shard files).
    decoded: Option<Arc<DecodedLayout>>,
}

/// Which rows of a stream are copied into a round's staging, and where it is (see `row_copies`).
#[derive(Clone, Debug)]
pub(super) struct RowStaging {
    /// Per region of the stream's table: whether its rows are copied (no window registered).
    pub(super) copied: Vec<bool>,
    /// The region a round's staging is in the stream's table (its address set per round).
    pub(super) region: usize,
    /// Bytes of a round's staging.
    pub(super) capacity: u64,
    /// The most staging bytes one row takes (see `row_copies::row_staging_bytes_max`).
    pub(super) row_bytes_max: u64,
}

/// The rows a round being planned copies, and the staging bytes they use.
#[derive(Default)]
struct RoundCopies {
    copies: Vec<RowCopy>,
    used: u64,
    /// The row and field whose pieces are being planned (what a copy records).
    row: u32,
    field: u32,
}

/// The linear layout of one field in one shard (see [`RowGeometry::linear`]), if it has one.
fn linear_layout(blocks: &[crate::format::BlockEntry]) -> Option<(u64, u64)> {
    let first = blocks.first()?;
    let size = first.raw_bytes as u64;
    let base = first.stored_offset;
    let linear = blocks.iter().enumerate().all(|(i, b)| {
        let last = i + 1 == blocks.len();
        b.codec == Codec::Raw
            && b.raw_offset == i as u64 * size
            && b.stored_offset == base + i as u64 * size
            && b.stored_bytes == b.raw_bytes
            && (last || b.raw_bytes as u64 == size)
    });
    (linear && first.raw_offset == 0 && size > 0).then_some((base, size))
}

impl RowGeometry {
    pub(super) fn new(
        plan: &StreamPlan,
        first_region: Vec<u32>,
        shard_first_samples: Vec<u64>,
        region_count: usize,
        window_bytes: u64,
        corrupt: HashMap<BlockKey, Arc<CorruptBlock>>,
        gather_piece_out_bytes: u64,
    ) -> RowGeometry {
        RowGeometry {
            first_region,
            shard_first_samples,
            region_count,
            window_bytes,
            corrupt,
            gather_piece_out_bytes,
            row_staging: None,
            decoded: None,
            linear: plan
                .dataset
                .shards
                .iter()
                .map(|shard| {
                    plan.fields
                        .iter()
                        .map(|f| linear_layout(shard.metadata.field_blocks(f.field_index)))
                        .collect()
                })
                .collect(),
        }
    }

    /// The same geometry over the dataset decoded in the device's memory tier as `layout` says.
    pub(super) fn with_decoded(
        mut self,
        plan: &StreamPlan,
        layout: Arc<DecodedLayout>,
    ) -> RowGeometry {
        self.linear = (0..plan.dataset.shards.len())
            .map(|shard| {
                plan.fields
                    .iter()
                    .map(|f| layout.linear(&plan.dataset, shard, f.field_index))
                    .collect()
            })
            .collect();
        self.decoded = Some(layout);
        self
    }

    /// Per shard, per stream field: where the field's bytes start in its shard (the file, or the
    /// shard's decoded bytes in the tier), when every field of every shard lies back to back, no
    /// block the stream reads was found corrupt and no row is copied into staging: then a row's
    /// address is its shard's base plus one multiplication, and the order may be computed on the
    /// device (`ordered`). `None` otherwise.
    pub(super) fn linear_bases(&self) -> Option<Vec<Vec<u64>>> {
        if !self.corrupt.is_empty() || self.row_staging.is_some() {
            return None;
        }
        self.linear
            .iter()
            .map(|fields| fields.iter().map(|l| l.map(|(base, _)| base)).collect())
            .collect()
    }

    /// The first sample of each shard, and the sample count after the last.
    pub(super) fn shard_first_samples(&self) -> &[u64] {
        &self.shard_first_samples
    }

    /// Bytes of each shard's windows (regions) in the stream's table.
    pub(super) fn window_bytes(&self) -> u64 {
        self.window_bytes
    }

    /// The region of shard `shard`'s first window in the stream's table.
    pub(super) fn first_region(&self, shard: usize) -> usize {
        self.first_region[shard] as usize
    }

    /// The region of a round's staging, when rows are copied into it (see [`RowStaging`]).
    pub(super) fn staging_region(&self) -> Option<usize> {
        self.row_staging.as_ref().map(|staging| staging.region)
    }

    /// The same geometry with the rows of the regions `staging.copied` names copied into a
    /// round's staging.
    pub(super) fn with_row_staging(mut self, staging: RowStaging) -> RowGeometry {
        assert_eq!(staging.copied.len(), self.region_count);
        assert!(staging.row_bytes_max <= staging.capacity);
        self.row_staging = Some(staging);
        self
    }
}

/// The largest output of a piece merged from consecutive rows of a field whose rows deliver
/// `sample_bytes_out` each: the geometry's `gather_piece_out_bytes`, but never less than one row, so
/// that rows merged never make more pieces than the same rows one by one (the round's table is sized
/// for that).
fn merged_out_bytes_max(geometry: &RowGeometry, sample_bytes_out: usize) -> u64 {
    geometry.gather_piece_out_bytes.max(sample_bytes_out as u64)
}

/// Adds pieces reading file bytes `span` of shard `shard` in place to slot offset `out_at`, split
/// at window edges (windows are registered separately, so their device addresses are not
/// contiguous) and merged with the previous piece up to `merged_out_bytes_max`; returns the slot
/// offset after them. A piece of a window whose rows are copied (see [`RowStaging`]) reads the
/// round's staging instead, where its bytes are placed after the round's last copy.
#[allow(clippy::too_many_arguments)]
fn push_in_place(
    gather: &mut GatherPlan,
    resident: &RowGeometry,
    copies: &mut RoundCopies,
    shard: usize,
    span: std::ops::Range<u64>,
    mut out_at: u64,
    op: GatherOp,
    merged_out_bytes_max: u64,
) -> u64 {
    let (mut at, stop) = (span.start, span.end);
    while at < stop {
        let window = at / resident.window_bytes;
        let piece_end = stop.min((window + 1) * resident.window_bytes);
        let region = resident.first_region[shard] as usize + window as usize;
        let elements = (piece_end - at) / op.in_bytes();
        let (source, offset) = match &resident.row_staging {
            Some(staging) if staging.copied[region] => {
                let bytes = elements * op.in_bytes();
                let placed = staging_place(copies.used, bytes, staging.capacity)
                    .expect("plan_chunk ends a round before its staging cannot hold a row");
                copies.copies.push(RowCopy {
                    shard: shard as u32,
                    file_offset: at,
                    bytes: bytes as u32,
                    staging_offset: placed,
                    field: copies.field,
                    row: copies.row,
                });
                copies.used = placed + bytes;
                (staging.region, placed)
            }
            _ => (region, at - window * resident.window_bytes),
        };
        gather.push_merged(
            GatherRegion::source_index(source),
            offset,
            out_at,
            elements,
            op,
            1.0,
            merged_out_bytes_max,
        );
        out_at += elements * op.out_bytes();
        at = piece_end;
    }
    out_at
}

/// The rows of one round, planned: the encoded piece table, its piece count, the bytes the pieces
/// read, the rows to zero, and the rows' bytes to copy into the round's staging first.
#[derive(Default)]
pub(super) struct PlannedRows {
    pub(super) table: Vec<u8>,
    pub(super) pieces: usize,
    /// Bytes the pieces read, per region of the stream's table.
    pub(super) region_bytes: Vec<u64>,
    pub(super) replaced: Vec<usize>,
    /// Bytes of rows copied into the round's staging by host threads (see `row_copies`).
    pub(super) copies: Vec<RowCopy>,
}

/// Plans rows `rows` on the calling thread, or the first of them whose copies the round's
/// staging holds (at least one row); returns them and the row after the last planned.
fn plan_chunk(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    positions: &[u64],
    rows: std::ops::Range<usize>,
) -> Result<(PlannedRows, usize), FillError> {
    let mut gather = GatherPlan::with_capacity(rows.len() * plan.fields.len());
    let mut replaced = Vec::new();
    let mut copies = RoundCopies::default();
    let mut row = rows.start;
    while row < rows.end {
        if let Some(staging) = &geometry.row_staging {
            // Room for this row's copies at worst, or the round ends here.
            if row > rows.start && copies.used + staging.row_bytes_max > staging.capacity {
                break;
            }
        }
        let sample = plan.order.sample_at(positions[row]);
        let run = consecutive_rows(plan, geometry, positions, row, rows.end, sample);
        if run > 1
            && geometry.row_staging.is_none()
            && run_pieces(plan, geometry, sample, run, row, &mut gather, &mut copies)
        {
            row += run;
            continue;
        }
        if let Some(bad) = row_pieces(plan, geometry, sample, row, &mut gather, &mut copies) {
            if plan.on_corrupt == CorruptPolicy::Fail {
                return Err(bad.to_error());
            }
            replaced.push(row);
        }
        row += 1;
    }
    let mut region_bytes = vec![0u64; geometry.region_count];
    for piece in gather.pieces() {
        let region = piece.source as usize - GATHER_SOURCES_MAX;
        region_bytes[region] += piece.elements as u64 * piece.op.in_bytes();
    }
    Ok((
        PlannedRows {
            table: gather.encode(),
            pieces: gather.pieces().len(),
            region_bytes,
            replaced,
            copies: copies.copies,
        },
        row,
    ))
}

/// How many rows from `row` (sample `sample`) on read consecutive samples of one shard: in dataset
/// order, most of a batch; otherwise 1 (shuffled orders are planned row by row).
fn consecutive_rows(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    positions: &[u64],
    row: usize,
    end: usize,
    sample: u64,
) -> usize {
    if plan.order.shuffle_kind() != ShuffleKind::None {
        return 1;
    }
    let starts = &geometry.shard_first_samples;
    let shard = starts.partition_point(|&s| s <= sample) - 1;
    let shard_end = starts[shard + 1];
    let mut run = 1;
    while row + run < end
        && positions[row + run] == positions[row] + run as u64
        && sample + (run as u64) < shard_end
    {
        run += 1;
    }
    run
}

/// Adds the pieces of `rows` rows from `row` on, reading samples `sample..sample + rows` of one
/// shard, when every field lies back to back in the shard (see [`RowGeometry::linear`]) and no
/// block they read is corrupt; returns false, having added nothing, otherwise (the rows are then
/// planned one by one).
fn run_pieces(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    sample: u64,
    rows: usize,
    row: usize,
    gather: &mut GatherPlan,
    copies: &mut RoundCopies,
) -> bool {
    let mut spans = Vec::with_capacity(plan.fields.len());
    for (index, field) in plan.fields.iter().enumerate() {
        let (shard, start, end) = plan.locate(sample, field.field_index);
        let Some((base, size)) = geometry.linear[shard][index] else {
            return false;
        };
        let stop = start + (end - start) * rows as u64;
        if !geometry.corrupt.is_empty() {
            for block in (start / size)..=((stop - 1) / size) {
                let key = BlockKey {
                    shard: shard as u32,
                    field: field.field_index as u32,
                    block: block as u32,
                };
                if geometry.corrupt.contains_key(&key) {
                    return false;
                }
            }
        }
        spans.push((shard, base + start, base + stop));
    }
    for (field, (shard, at, stop)) in plan.fields.iter().zip(spans) {
        // (Never with row copies: runs are planned only without them.)
        (copies.row, copies.field) = (row as u32, field.field_index as u32);
        let op = GatherOp::for_dtypes(field.stored, field.out)
            .expect("conversions are validated when the stream is planned");
        let out_at = (field.offset + row * field.sample_bytes_out) as u64;
        // Pieces as merging rows one by one would make them, so that a batch spreads over many
        // thread blocks.
        let merged_max = merged_out_bytes_max(geometry, field.sample_bytes_out);
        let chunk = (merged_max / op.out_bytes()).max(1) * op.in_bytes();
        let (mut at, mut out_at) = (at, out_at);
        while at < stop {
            let piece_stop = stop.min(at + chunk);
            out_at = push_in_place(
                gather,
                geometry,
                copies,
                shard,
                at..piece_stop,
                out_at,
                op,
                merged_max,
            );
            at = piece_stop;
        }
    }
    true
}

/// Adds the pieces of one row (sample `sample` at row `row` of the slot) to `gather`; returns the
/// corrupt block it reads, if any (then it adds nothing).
fn row_pieces(
    plan: &StreamPlan,
    resident: &RowGeometry,
    sample: u64,
    row: usize,
    gather: &mut GatherPlan,
    copies: &mut RoundCopies,
) -> Option<Arc<CorruptBlock>> {
    for (index, field) in plan.fields.iter().enumerate() {
        (copies.row, copies.field) = (row as u32, field.field_index as u32);
        let (shard, start, end) = plan.locate(sample, field.field_index);
        let op = GatherOp::for_dtypes(field.stored, field.out)
            .expect("conversions are validated when the stream is planned");
        let mut out_at = (field.offset + row * field.sample_bytes_out) as u64;
        let merged_max = merged_out_bytes_max(resident, field.sample_bytes_out);
        if let Some((base, size)) = resident.linear[shard][index] {
            if !resident.corrupt.is_empty() {
                for block in (start / size)..=((end - 1) / size) {
                    let key = BlockKey {
                        shard: shard as u32,
                        field: field.field_index as u32,
                        block: block as u32,
                    };
                    if let Some(bad) = resident.corrupt.get(&key) {
                        return Some(Arc::clone(bad));
                    }
                }
            }
            push_in_place(
                gather,
                resident,
                copies,
                shard,
                base + start..base + end,
                out_at,
                op,
                merged_max,
            );
            continue;
        }
        let blocks = plan.dataset.shards[shard]
            .metadata
            .field_blocks(field.field_index);
        for block in plan.blocks_for(shard, field.field_index, start, end) {
            let key = BlockKey {
                shard: shard as u32,
                field: field.field_index as u32,
                block,
            };
            if !resident.corrupt.is_empty() {
                if let Some(bad) = resident.corrupt.get(&key) {
                    // Pieces already added for the row are overwritten by its zeros, which are
                    // queued after the gather.
                    return Some(Arc::clone(bad));
                }
            }
            let entry = &blocks[block as usize];
            let from = start.max(entry.raw_offset) - entry.raw_offset;
            let to = end.min(entry.raw_offset + entry.raw_bytes as u64) - entry.raw_offset;
            // Raw blocks store the raw bytes; a decoded dataset has them where its layout says.
            let base = resident.decoded.as_ref().map_or(entry.stored_offset, |d| {
                d.block_offset(shard, field.field_index, block)
            });
            let (at, stop) = (base + from, base + to);
            out_at = push_in_place(
                gather,
                resident,
                copies,
                shard,
                at..stop,
                out_at,
                op,
                merged_max,
            );
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's `plan_threads` is taken as given up to the bound; 0 leaves the count to the
    /// host: twelve at most, and at least two.
    #[test]
    fn plan_threads_are_the_limit_s_or_the_host_s_choice() {
        assert_eq!(plan_workers(1), 1);
        assert_eq!(plan_workers(20), 20);
        assert_eq!(plan_workers(PLAN_THREADS_MAX + 5), PLAN_THREADS_MAX);
        assert!((2..=PLAN_WORKERS).contains(&plan_workers(0)));
    }

    /// A packed raw dataset of `samples` fp16 rows of 37 elements (74 bytes: rows straddle blocks
    /// of 4096 and windows of 8192), 120 rows a shard; returns the dataset, the rows' bytes, and a
    /// full-shuffle plan delivering them as fp32 in batches of 64.
    fn full_shuffle_plan(dir: &std::path::Path, samples: usize) -> (StreamPlan, Vec<u8>) {
        use crate::pipeline::order::{ShuffleMode, Tail};
        use crate::pipeline::stream_plan::{FieldSelection, StreamDevice, StreamRequest};
        use gpufeed_proto::DType;
        let bytes = crate::synth::random_bytes(samples * 74, 11);
        let field = crate::input::FieldSource::from_bytes("a", DType::F16, vec![37], bytes.clone())
            .unwrap();
        let out = dir.join("rows");
        let options = crate::pack::PackOptions {
            name: "rows".into(),
            block_bytes: 4096,
            samples_per_shard: Some(120),
            codec: crate::pack::CodecChoice::Raw,
            shuffle: crate::pack::ShuffleChoice::Auto,
            on_existing: crate::pack::OnExisting::Refuse,
            threads: 1,
        };
        crate::pack::pack(&out, &[field], &options, &crate::pack::Quiet).unwrap();
        let dataset = Arc::new(crate::format::Dataset::open(&out).unwrap());
        let request = StreamRequest {
            fields: vec![FieldSelection {
                name: "a".into(),
                dtype: Some(DType::F32),
            }],
            batch_size: 64,
            world_size: 1,
            rank: 0,
            seed: 3,
            epoch: 0,
            start_cursor: 0,
            shuffle: ShuffleMode::Full,
            tail: Tail::Drop,
            prefetch: 2,
            on_corrupt: CorruptPolicy::Fail,
            device: StreamDevice::Cuda(0),
            variable: Vec::new(),
        };
        let limits = crate::pipeline::StreamLimits::node_defaults();
        let plan = StreamPlan::new(dataset, &request, &limits).unwrap();
        (plan, bytes)
    }

    /// The shard files of `plan`, each shard's first region, and its windows of `window_bytes`
    /// as (shard, start, bytes), shards in order.
    #[allow(clippy::type_complexity)]
    fn shard_windows(
        plan: &StreamPlan,
        window_bytes: u64,
    ) -> (Vec<Vec<u8>>, Vec<u32>, Vec<(usize, u64, u64)>) {
        let files: Vec<Vec<u8>> = plan
            .dataset
            .shards
            .iter()
            .map(|shard| std::fs::read(&shard.path).unwrap())
            .collect();
        let mut first_region = Vec::new();
        let mut windows = Vec::new();
        for (shard, file) in files.iter().enumerate() {
            first_region.push(windows.len() as u32);
            let mut start = 0u64;
            while start < file.len() as u64 {
                windows.push((shard, start, window_bytes.min(file.len() as u64 - start)));
                start += window_bytes;
            }
        }
        (files, first_region, windows)
    }

    /// The geometry of `plan` over `regions` regions (windows of `window_bytes`, each shard's first
    /// at `first_region`), no corrupt block, pieces merged up to 16 KiB.
    fn test_geometry(
        plan: &StreamPlan,
        first_region: &[u32],
        regions: usize,
        window_bytes: u64,
    ) -> RowGeometry {
        RowGeometry::new(
            plan,
            first_region.to_vec(),
            plan.shard_first_samples(),
            regions,
            window_bytes,
            HashMap::default(),
            16 << 10,
        )
    }

    /// What the gather kernel makes of `rounds` (a host model: each piece converted by the CPU
    /// reference from its region: a window of its shard file, or the round's staging, filled from
    /// the shard files by the round's copies); a piece reading a window `copied` fails the test.
    fn gather_on_host(
        rounds: &[PlannedRows],
        files: &[Vec<u8>],
        windows: &[(usize, u64, u64)],
        copied: &[bool],
        staging_region: usize,
        slot_bytes: usize,
    ) -> Vec<u8> {
        let mut slot = vec![0xEEu8; slot_bytes];
        for round in rounds {
            let mut staging = vec![0u8; 1 << 16];
            for copy in &round.copies {
                let from = &files[copy.shard as usize][copy.file_offset as usize..];
                let at = copy.staging_offset as usize;
                assert_eq!(at as u64 % super::super::row_copies::ROW_STAGING_ALIGN, 0);
                staging[at..at + copy.bytes as usize].copy_from_slice(&from[..copy.bytes as usize]);
            }
            for piece in round.table.chunks_exact(crate::kernels::GATHER_PIECE_BYTES) {
                let word = |at: usize, n: usize| {
                    let mut b = [0u8; 8];
                    b[..n].copy_from_slice(&piece[at..at + n]);
                    u64::from_le_bytes(b)
                };
                let region = word(20, 2) as usize - GATHER_SOURCES_MAX;
                let source: &[u8] = if region == staging_region {
                    &staging
                } else {
                    assert!(
                        !copied[region],
                        "a piece reads window {region}, whose rows are copied"
                    );
                    let (shard, start, bytes) = windows[region];
                    &files[shard][start as usize..(start + bytes) as usize]
                };
                let piece = crate::kernels::GatherPiece {
                    source: 0,
                    src_offset: word(0, 8),
                    dst_offset: word(8, 8),
                    elements: word(16, 4) as u32,
                    op: GatherOp::ALL[piece[22] as usize],
                    scale: f32::from_le_bytes(piece[24..28].try_into().unwrap()),
                };
                let outcome =
                    crate::kernels::reference::gather_reference(&[piece], &[source], &mut slot);
                assert_eq!(outcome.faulted_pieces, 0);
            }
        }
        slot
    }

    /// A full shuffle whose rows of every other window are copied into a round's staging (a
    /// staging of 1000 bytes: a batch of 64 rows of 74 bytes takes several rounds) gathers, row for
    /// row, what reading every row in place gathers, and what the CPU converts from the rows.
    #[test]
    fn rows_copied_into_staging_gather_what_rows_read_in_place_gather() {
        let dir = tempfile::tempdir().unwrap();
        let samples = 700;
        let (plan, rows) = full_shuffle_plan(dir.path(), samples);
        let window_bytes = 8192u64;
        let (files, first_region, windows) = shard_windows(&plan, window_bytes);
        let staging_region = windows.len();
        let mut copied: Vec<bool> = (0..windows.len()).map(|w| w % 2 == 0).collect();
        copied.push(false);
        let geometry = || test_geometry(&plan, &first_region, windows.len() + 1, window_bytes);
        let in_place = geometry();
        let row_bytes_max = super::super::row_copies::row_staging_bytes_max(
            [(74usize, 4096u64)].into_iter(),
            window_bytes,
        );
        let staged = geometry().with_row_staging(RowStaging {
            copied: copied.clone(),
            region: staging_region,
            capacity: 1000,
            row_bytes_max,
        });
        let mut several_rounds = false;
        let mut copies = 0usize;
        for step in 0..plan.steps {
            let positions: Vec<u64> = plan
                .rank
                .batch_positions(plan.order.len(), plan.start_cursor, step)
                .collect();
            let expected_rounds = plan_step(&plan, &in_place, &positions, 1 << 20).unwrap();
            let staged_rounds = plan_step(&plan, &staged, &positions, 1 << 20).unwrap();
            several_rounds |= staged_rounds.len() > 1;
            copies += staged_rounds.iter().map(|r| r.copies.len()).sum::<usize>();
            for round in &staged_rounds {
                let used = round
                    .copies
                    .iter()
                    .map(|c| c.staging_offset + c.bytes as u64)
                    .max()
                    .unwrap_or(0);
                assert!(used <= 1000, "a round's copies fit its staging");
                assert_eq!(
                    round.region_bytes[staging_region],
                    round.copies.iter().map(|c| c.bytes as u64).sum::<u64>()
                );
            }
            let no_copies = vec![false; windows.len() + 1];
            let slot = plan.slot_bytes;
            let read_in_place = gather_on_host(
                &expected_rounds,
                &files,
                &windows,
                &no_copies,
                usize::MAX,
                slot,
            );
            let with_copies = gather_on_host(
                &staged_rounds,
                &files,
                &windows,
                &copied,
                staging_region,
                slot,
            );
            let mut expected = vec![0u8; positions.len() * 148];
            for (row, &position) in positions.iter().enumerate() {
                let sample = plan.order.sample_at(position) as usize;
                crate::decode::convert(
                    gpufeed_proto::DType::F16,
                    &rows[sample * 74..(sample + 1) * 74],
                    gpufeed_proto::DType::F32,
                    &mut expected[row * 148..(row + 1) * 148],
                )
                .unwrap();
            }
            let delivered = positions.len() * 148;
            assert!(
                read_in_place[..delivered] == expected[..],
                "step {step} in place"
            );
            assert!(
                with_copies[..delivered] == expected[..],
                "step {step} copied"
            );
        }
        assert!(several_rounds, "the staging cut a batch into rounds");
        // About half the rows lie in windows whose rows are copied.
        assert!(copies > samples / 4, "{copies} rows copied");
    }

    /// A cold start: the planning threads plan the steps before `steps_end` over the cold geometry
    /// (every row copied into the round's staging, nothing read from the shards' regions) and the
    /// later ones over the stream's own (nothing copied); both gather what the CPU converts.
    #[test]
    fn a_cold_start_plans_its_first_steps_from_staging_and_the_rest_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let samples = 500;
        let (plan, rows) = full_shuffle_plan(dir.path(), samples);
        let plan = Arc::new(plan);
        let window_bytes = 8192u64;
        let (files, first_region, windows) = shard_windows(&plan, window_bytes);
        let staging_region = windows.len();
        let geometry = || test_geometry(&plan, &first_region, windows.len() + 1, window_bytes);
        let mut copied = vec![true; windows.len()];
        copied.push(false);
        let row_bytes_max = super::super::row_copies::row_staging_bytes_max(
            [(74usize, 4096u64)].into_iter(),
            window_bytes,
        );
        let cold = ColdStart {
            geometry: Arc::new(geometry().with_row_staging(RowStaging {
                copied: copied.clone(),
                region: staging_region,
                capacity: 1 << 16,
                row_bytes_max,
            })),
            steps_end: 3,
        };
        let mut planner = Planner::start(
            Arc::clone(&plan),
            Arc::new(geometry()),
            Some(cold),
            1,
            1 << 20,
            2,
            3,
        );
        assert!(plan.steps > 4, "steps past the cold start");
        for step in 1..plan.steps {
            let planned = planner.next().unwrap();
            assert_eq!(planned.step, step);
            let rounds = planned.rounds.unwrap();
            let copies: usize = rounds.iter().map(|r| r.copies.len()).sum();
            let staged: u64 = rounds.iter().map(|r| r.region_bytes[staging_region]).sum();
            let in_place: u64 = rounds
                .iter()
                .flat_map(|r| r.region_bytes[..staging_region].iter())
                .sum();
            if step < 3 {
                assert_eq!(copies, planned.rows, "step {step}: every row copied");
                assert_eq!(in_place, 0, "step {step}: no row read from a shard");
                assert_eq!(staged, planned.rows as u64 * 74);
            } else {
                assert_eq!(copies + staged as usize, 0, "step {step}: nothing copied");
                assert_eq!(in_place, planned.rows as u64 * 74);
            }
            let mask = if step < 3 {
                copied.clone()
            } else {
                vec![false; windows.len() + 1]
            };
            let slot = gather_on_host(
                &rounds,
                &files,
                &windows,
                &mask,
                staging_region,
                plan.slot_bytes,
            );
            let positions: Vec<u64> = plan
                .rank
                .batch_positions(plan.order.len(), plan.start_cursor, step)
                .collect();
            for (row, &position) in positions.iter().enumerate() {
                let sample = plan.order.sample_at(position) as usize;
                let mut expected = [0u8; 148];
                crate::decode::convert(
                    gpufeed_proto::DType::F16,
                    &rows[sample * 74..(sample + 1) * 74],
                    gpufeed_proto::DType::F32,
                    &mut expected,
                )
                .unwrap();
                assert!(
                    slot[row * 148..(row + 1) * 148] == expected[..],
                    "step {step} row {row}"
                );
            }
        }
    }
}
