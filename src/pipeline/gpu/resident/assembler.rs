//! The resident assembler: a stream whose blocks are all raw and whose shards are read in place
//! from registered page-cache windows or from device copies (see [`super::open`]). Each batch's rows
//! come planned from the planning threads ([`super::planner`]); small batches are gathered several
//! to a round ([`super::group`]).

use std::sync::Arc;

use super::device_shards::DeviceShards;
use super::group::BatchGroup;
use super::open::Resident;
use super::ordered::DeviceOrder;
use super::planner::{PlannedRows, PlannedStep, Planner};
use super::shard_checks::rows_reading;
use crate::device::{DeviceMemory, DeviceRegion, Event};
use crate::kernels::{resolve_inline, GatherRegion, GATHER_OUTCOME_BYTES};
use crate::pipeline::gpu::engine::buffers::{
    upload_table, DeviceRange, HostLayout, PendingBatch, PendingRound, RoundBuffers,
};
use crate::pipeline::gpu::engine::rounds::RoundEngine;
use crate::pipeline::stream_plan::{CorruptPolicy, FillError, FillReport, PlacementRuns};

/// Most pieces one row adds (a row of a field split across two blocks and two windows at worst, per
/// field, with GatherPlan's own split of long pieces).
const ROW_PIECES_MAX_PER_FIELD: usize = 4;

/// Fills device slots of a resident stream: every row gathered in place (see [`super::open`]).
pub struct ResidentAssembler {
    pub(in crate::pipeline::gpu) engine: RoundEngine,
    /// The stream's mapped windows, region table, device shard copies and planning threads.
    pub(in crate::pipeline::gpu) resident: Resident,
    /// Pieces a round may pass in its launches' parameters: see
    /// [`crate::pipeline::gpu::GpuStreamLimits::inline_gather_launches`] (0 where the gatherer
    /// cannot).
    inline_pieces_max: usize,
    /// A round's piece table with its regions resolved (kept for its capacity).
    inline_table: Vec<u8>,
    /// Small batches planned and not queued yet, gathered together by one round (see
    /// [`crate::pipeline::gpu::GpuStreamLimits::batch_group_max`]).
    group: Option<BatchGroup>,
    /// Most batches in `group` (1: no groups).
    pub(in crate::pipeline::gpu) group_batches_max: usize,
    /// Most pieces in `group`: one launch's.
    group_pieces_max: usize,
    /// Planning threads (see [`crate::pipeline::gpu::GpuStreamLimits::plan_threads`]).
    plan_threads: usize,
    /// The order computed on the device, for a stream that qualifies (see `super::ordered`): no
    /// rows planned on the host.
    ordered: Option<DeviceOrder>,
    /// Whether the stream can no longer switch to the device order when its dataset's fill into
    /// the device-memory tier completes (see [`Self::order_on_device_once_filled`]).
    tier_order_checked: bool,
}

impl ResidentAssembler {
    /// The assembler of a resident stream over `engine`: rounds pass at most `inline_pieces_max`
    /// pieces in their launch parameters, gather groups of at most `group_batches_max` batches and
    /// `group_pieces_max` pieces, and plan on `plan_threads` threads (0: as many as the planner
    /// chooses).
    pub(in crate::pipeline::gpu) fn new(
        engine: RoundEngine,
        resident: Resident,
        inline_pieces_max: usize,
        group_batches_max: usize,
        group_pieces_max: usize,
        plan_threads: usize,
    ) -> Result<ResidentAssembler, FillError> {
        let device = engine.stream.device().clone();
        let ordered = DeviceOrder::new(&engine.plan, &resident, &engine.kernels.gather, &device)?;
        Ok(ResidentAssembler {
            engine,
            resident,
            inline_pieces_max,
            inline_table: Vec::new(),
            group: None,
            group_batches_max,
            group_pieces_max,
            plan_threads,
            tier_order_checked: ordered.is_some(),
            ordered,
        })
    }
}

/// Puts a round's piece table where its gather kernel reads it: the round's pinned buffer when
/// shards are copied ahead (`copying`), device memory (uploaded on `stream`) otherwise.
fn place_piece_table(
    stream: &crate::device::Stream,
    buffers: &mut RoundBuffers,
    layout: HostLayout,
    table: &[u8],
    copying: bool,
) -> Result<(), FillError> {
    if copying {
        buffers.host.as_mut_slice()[layout.pieces..layout.pieces + table.len()]
            .copy_from_slice(table);
        return Ok(());
    }
    upload_table(
        stream,
        &mut buffers.host,
        layout.pieces,
        &buffers.pieces,
        table,
    )
}

/// The shards a round reading `region_bytes` bytes of each region reads (each once, in order of
/// their first region), and the regions it reads; the round's staging (region `staging`), which
/// lies in no shard, is not among them.
fn shards_read(
    device_shards: &DeviceShards,
    region_bytes: &[u64],
    staging: Option<usize>,
) -> (Vec<usize>, Vec<usize>) {
    let mut needed: Vec<usize> = Vec::new();
    let mut regions_read: Vec<usize> = Vec::new();
    for (region, &bytes) in region_bytes.iter().enumerate() {
        if bytes == 0 || Some(region) == staging {
            continue;
        }
        regions_read.push(region);
        let shard = device_shards.shard_of_region(region);
        if !needed.contains(&shard) {
            needed.push(shard);
        }
    }
    (needed, regions_read)
}

/// The shards a round reading `planned` reads from shards copied ahead (none without copies),
/// made ready for it (see `DeviceShards::prepare_round`), the host's wait counted.
fn prepare_shard_copies(
    resident: &mut Resident,
    engine: &mut RoundEngine,
    planned: &PlannedRows,
) -> Result<Vec<usize>, FillError> {
    let staging = resident.staging_region();
    let Some(device_shards) = resident.device_shards.as_mut() else {
        return Ok(Vec::new());
    };
    let (needed, regions_read) = shards_read(device_shards, &planned.region_bytes, staging);
    engine.timings.copy_wait_s +=
        device_shards.prepare_round(&needed, &regions_read, &engine.stream)?;
    Ok(needed)
}

/// The rows of a round whose blocks the loader found corrupt when it checked the shards `needed`
/// before copying them (beyond the daemon's memory: see `shard_checks`): under the stream's
/// `replace` policy they are added to the round's `replaced` rows (zeroed after the gather, counted
/// in the batch's report), under `fail` the first such block ends the stream. (Such streams group no
/// batches: a round of several would be refused here too.)
fn replace_late_corrupt(
    resident: &Resident,
    plan: &crate::pipeline::stream_plan::StreamPlan,
    needed: &[usize],
    steps: &std::ops::Range<u64>,
    planned: &mut PlannedRows,
) -> Result<(), FillError> {
    let Some(checks) = resident
        .device_shards
        .as_ref()
        .and_then(|d| d.checks.as_ref())
    else {
        return Ok(());
    };
    let geometry = &resident.geometry;
    let shards = plan.dataset.shards.len();
    for &shard in needed {
        let bad = checks.corrupt_in(shard);
        if bad.is_empty() {
            continue;
        }
        let end = if shard + 1 < shards {
            geometry.first_region(shard + 1)
        } else {
            resident.region_count as usize
        };
        let rows = plan.rank.batch_size as usize;
        let found = rows_reading(
            &planned.table,
            geometry.first_region(shard)..end,
            geometry.window_bytes(),
            &bad,
            &plan.fields,
            rows,
        );
        if found.is_empty() {
            continue;
        }
        if plan.on_corrupt == CorruptPolicy::Fail || steps.end - steps.start != 1 {
            return Err(bad[0].bad.to_error());
        }
        for row in found {
            if !planned.replaced.contains(&row) {
                planned.replaced.push(row);
            }
        }
    }
    Ok(())
}

/// Whether copies into device memory may be queued on the copy engines while the stream's rounds
/// run: shards copied ahead, or the dataset's copies into the tier while it fills. A piece table
/// uploaded then would wait behind them (every round of a shuffle's first epoch waited for the whole
/// fill of the tier): such rounds read it from their pinned buffer instead.
fn copies_queued(resident: &Resident) -> bool {
    resident.device_shards.is_some()
        || resident
            .tier
            .as_ref()
            .is_some_and(|t| !t.is_whole_at_open() && !t.is_whole())
}

/// Points the regions of a round's table `table` at the device copies the round may read: shards
/// copied ahead, and the dataset in the device's memory tier while it fills (a dataset whole there
/// when the stream opened has the stream's own table pointed there). `region_bytes`: the bytes the
/// round reads of each region; `compute`: the stream it is queued on. Returns whether any region
/// points at a device copy.
fn redirect_to_device(
    resident: &mut Resident,
    table: &mut [GatherRegion],
    region_bytes: &[u64],
    compute: &crate::device::Stream,
) -> Result<bool, FillError> {
    let mut redirected = resident
        .device_shards
        .as_ref()
        .is_some_and(|d| d.redirect(table));
    if let Some(tier) = resident.tier.as_mut().filter(|t| !t.is_whole_at_open()) {
        redirected |= tier.redirect(table, region_bytes, compute)?;
    }
    Ok(redirected)
}

/// Bytes of `region_bytes` a round reads in place from host memory: those of the regions its table
/// `table` still points at their registered windows (the stream's `host_regions`), not at a device
/// copy; none when the stream's own table points into the device's memory tier.
fn bytes_read_in_place(region_bytes: &[u64], table: &[GatherRegion], resident: &Resident) -> u64 {
    if resident.tier.as_ref().is_some_and(|t| t.is_whole_at_open()) {
        return 0;
    }
    let host_regions = &resident.host_regions;
    region_bytes
        .iter()
        .enumerate()
        .filter(|&(region, _)| table[region].ptr == host_regions[region].ptr)
        .map(|(_, bytes)| bytes)
        .sum()
}

/// Copies the rows `planned` places in the round's staging (if any) into the pinned row buffer of
/// round buffers `index` on the copy threads, queues their upload into the round's staging on the
/// compute stream, and points the staging region of the round's region table `table` at it.
/// Returns the bytes copied, or `None` when the round copies no rows.
fn stage_copied_rows(
    resident: &mut Resident,
    engine: &mut RoundEngine,
    index: usize,
    planned: &mut PlannedRows,
    table: &mut [GatherRegion],
) -> Result<Option<u64>, FillError> {
    if planned.copies.is_empty() {
        return Ok(None);
    }
    let staging_region = resident
        .staging_region()
        .expect("a stream with row copies has a staging region");
    let copier = resident
        .row_copies
        .as_mut()
        .expect("rows planned into a round's staging have a reader");
    let used = planned
        .copies
        .iter()
        .map(|c| c.staging_offset + c.bytes as u64)
        .max()
        .unwrap_or(0);
    let staging = &engine.buffers[index].staging;
    assert!(
        table[staging_region].bytes <= staging.len() as u64,
        "a round's row staging lies within its staging buffer"
    );
    // The round that used round buffers `index` last (its pinned row buffer and its staging) has
    // completed: the host waited for its `done` event, recorded on the compute stream after its
    // upload and its gather, before these buffers were taken again.
    let copy_started = std::time::Instant::now();
    let (copied, replaced) = copier.copy_round(index, std::mem::take(&mut planned.copies))?;
    engine.timings.read_s += copy_started.elapsed().as_secs_f64();
    // Rows whose blocks a disk read found corrupt are zeroed and counted like those the planner
    // knew of (queued after the gather).
    for row in replaced {
        if !planned.replaced.contains(&row) {
            planned.replaced.push(row);
        }
    }
    let source = copier.buffer(index);
    // SAFETY: the source is this round's pinned row buffer, complete (every copy thread's part is
    // done) and written again only after the host has waited for this round's `done` event, which
    // is recorded on the same stream after this upload; `used` lies within it (the planner placed
    // every row within the staging capacity, which the pinned buffer has). The destination is this
    // round's staging buffer (checked above to hold the capacity), which no other work reads or
    // writes until this round is done, and which this round's gather, queued after the upload on
    // the same stream, reads.
    unsafe {
        crate::device::ffi::memcpy_htod_async(
            staging.device_ptr(),
            source.as_slice().as_ptr(),
            used as usize,
            engine.stream.raw(),
        )
    }
    .map_err(crate::device::DeviceError::from)?;
    table[staging_region].ptr = staging.device_ptr();
    Ok(Some(copied))
}

impl ResidentAssembler {
    /// Queues stream step `step` into `slot` (see [`crate::pipeline::GpuAssembler::submit`]): every
    /// row gathered in place, planned by arithmetic on the planning threads ahead of the filler, in
    /// rounds of at most `pieces_max` pieces.
    pub(in crate::pipeline::gpu) fn submit(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
        ready: Option<&Event>,
    ) -> Result<(), FillError> {
        if self.ordered.is_none() && !self.tier_order_checked {
            self.order_on_device_once_filled(step)?;
        }
        if self.ordered.is_some() {
            return self.submit_ordered(step, slot, released);
        }
        let planned = self.planned_step(step)?;
        self.engine
            .batches
            .push_back(PendingBatch::new(step, slot, planned.rows));
        let mut rounds = planned.rounds?;
        // A small batch of one round with no rows to zero joins the group of batches waiting to be
        // gathered together, if it can; a batch that cannot queues the group first.
        // (Rows copied into a round's staging are placed for that round alone, and rows of blocks
        // the shard loader may find corrupt are zeroed per batch.)
        let late_checks = self
            .resident
            .device_shards
            .as_ref()
            .is_some_and(|d| d.checks.is_some());
        let joins = self.group_batches_max > 1
            && rounds.len() == 1
            && rounds[0].replaced.is_empty()
            && rounds[0].copies.is_empty()
            && rounds[0].pieces > 0
            && !late_checks;
        let device_shards = self.resident.device_shards.as_ref();
        if self.group.as_ref().is_some_and(|group| {
            !joins
                || !group.accepts(step, slot, rounds[0].pieces, self.group_pieces_max)
                || device_shards
                    .is_some_and(|d| !d.fit_one_round(&group.region_bytes, &rounds[0].region_bytes))
        }) {
            self.flush_group()?;
        }
        // The slot's last use by the consumer, waited for before the batch's first write is queued
        // (after the group it did not join, which does not write this slot).
        self.engine.wait_released(released)?;
        // Shards are read ahead from the first batch of a group on: a later batch's read-ahead
        // could give the slots of shards the group reads to shards further on before the group's
        // round records its reads. A cold step reads its rows from the disk first, alone: the
        // loader's copies would share the disk with them (see `ColdStart`).
        let cold = self.cold_step(step);
        // After a cold start its reader and pinned buffers go, once no round may still upload from
        // them (the filler delivers every cold batch before it submits the first step after them).
        if self.delivers_before(step) && self.engine.rounds.is_empty() {
            self.resident.row_copies = None;
        }
        if self.group.is_none() && !cold {
            if let (Some(device_shards), Some(first)) =
                (self.resident.device_shards.as_mut(), planned.first_position)
            {
                device_shards.read_ahead(&self.engine.plan.order, first)?;
            }
        }
        if joins {
            let rows = rounds.pop().expect("one round");
            let region_count = rows.region_bytes.len();
            let group = self
                .group
                .get_or_insert_with(|| BatchGroup::new(step, slot, region_count));
            group.add(step, slot, rows);
            if group.len() == self.group_batches_max
                || group.pieces * (group.len() + 1) > self.group_pieces_max * group.len()
            {
                self.flush_group()?;
            }
            return Ok(());
        }
        for rows in rounds {
            self.queue_resident_round(step..step + 1, rows, slot)?;
        }
        if let (true, Some(device_shards), Some(first)) = (
            cold,
            self.resident.device_shards.as_mut(),
            planned.first_position,
        ) {
            device_shards.read_ahead(&self.engine.plan.order, first)?;
        }
        // No record of `ready` here: every write to the slot is queued before the completion event
        // of its batch's last round, which [`Self::complete`] waits for on the host before the batch
        // is handed out, so a consumer's query of `ready` (an earlier record, complete) is right.
        // Work queued on the slot after that (zeroing rows of blocks found corrupt) records `ready`
        // again there. One driver call less per batch: at 256 rows, a batch every 20 µs.
        let _ = ready;
        Ok(())
    }

    /// For a stream that opened while its dataset filled the device-memory tier: once the fill is
    /// done, computes the order on the device from step `step` on (see
    /// `DeviceOrder::over_filled_tier`), reading every row in the tier, instead of planning rows on
    /// the host and redirecting each round's regions. The rest of a first epoch then runs at the
    /// rate of later ones (the fill itself takes the link: in a shuffle the epoch's first batches
    /// wait for it), and so does an epoch whose stream was opened ahead while the first filled.
    fn order_on_device_once_filled(&mut self, step: u64) -> Result<(), FillError> {
        if !self
            .resident
            .tier
            .as_ref()
            .is_some_and(|t| t.filled_since_open())
        {
            // (Also a stream that opened with its dataset whole in the tier, or not in it.)
            self.tier_order_checked = self
                .resident
                .tier
                .as_ref()
                .is_none_or(|t| t.is_whole_at_open() || !t.dataset.usable());
            return Ok(());
        }
        self.tier_order_checked = true;
        let device = self.engine.stream.device().clone();
        let Some(ordered) = DeviceOrder::over_filled_tier(
            &self.engine.plan,
            &self.resident,
            &self.engine.kernels.gather,
            &device,
        )?
        else {
            return Ok(());
        };
        // The batches planned on the host and not queued yet are queued first; the planning
        // threads stop.
        self.flush_group()?;
        self.resident.planner = None;
        self.ordered = Some(ordered);
        tracing::info!("stream reads the device-memory tier whole from step {step} on");
        Ok(())
    }

    /// The planned rows of `step`, from the planning thread (started, or started again, at `step`
    /// when it is not the step planned next).
    fn planned_step(&mut self, step: u64) -> Result<PlannedStep, FillError> {
        let rows_per_round = (self.engine.pieces_max
            / (self.engine.plan.fields.len() * ROW_PIECES_MAX_PER_FIELD))
            .max(1);
        let resident = &mut self.resident;
        if resident
            .planner
            .as_ref()
            .is_none_or(|p| p.next_step != step)
        {
            resident.planner = Some(Planner::start(
                Arc::clone(&self.engine.plan),
                Arc::clone(&resident.geometry),
                resident.cold_start.clone(),
                step,
                rows_per_round,
                self.group_batches_max,
                self.plan_threads,
            ));
        }
        let planner = resident.planner.as_mut().expect("started above");
        // Timed (and the planning threads' figure read) only when a chunk of plans is received:
        // the other steps of a chunk are taken from memory, and the clock reads and the read of the
        // threads' shared counter would cost more than taking them.
        if !planner.taken.is_empty() {
            return planner.next();
        }
        let waited = std::time::Instant::now();
        let planned = planner.next();
        self.engine.timings.plan_s += waited.elapsed().as_secs_f64();
        self.engine.timings.planning_threads_s = planner.busy_s();
        planned
    }

    /// Counts a round just queued on its batches (`steps`), and its `replaced` rows on the first.
    fn count_round(&mut self, steps: &std::ops::Range<u64>, replaced: usize) {
        // The round's batches: the last submitted, or all but the last (a group queued as the
        // batch that could not join it was submitted).
        for batch in self
            .engine
            .batches
            .iter_mut()
            .rev()
            .take((steps.end - steps.start) as usize + 1)
        {
            if !steps.contains(&batch.step) {
                continue;
            }
            batch.rounds_left += 1;
            if batch.step == steps.start {
                batch.replaced += replaced as u32;
            }
        }
    }

    /// Queues the group of small batches waiting to be gathered, if any, as one round.
    fn flush_group(&mut self) -> Result<(), FillError> {
        let Some(group) = self.group.take() else {
            return Ok(());
        };
        if group.len() > 1 {
            self.engine.timings.batches_grouped += group.len() as u64;
        }
        // The slots lie in ascending order in the ring's one allocation; the round writes the span
        // from the first to the end of the last, each piece into its own batch's slot.
        let span = DeviceRange {
            ptr: group.base,
            bytes: (group.end - group.base) as usize,
        };
        let rows = PlannedRows {
            table: group.table,
            pieces: group.pieces,
            region_bytes: group.region_bytes,
            replaced: Vec::new(),
            copies: Vec::new(),
        };
        self.queue_resident_round(group.steps, rows, &span)
    }

    /// The round buffers the next round takes, once the round that used them last is complete
    /// (the host waited for its `done` event): the oldest round in flight when every set is in use.
    fn next_round_buffers(&mut self) -> Result<usize, FillError> {
        if self.engine.rounds.len() == self.engine.buffers.len() {
            self.engine.complete_round()?;
        }
        let index = self.engine.next_buffers;
        self.engine.next_buffers = (self.engine.next_buffers + 1) % self.engine.buffers.len();
        Ok(index)
    }

    /// Queues one round of a resident stream, for one batch or a group of consecutive ones
    /// (`steps`) whose slots `slot` spans: its pieces, the zeroing of its corrupt rows (a batch's
    /// own round only), and the gather outcome's download.
    fn queue_resident_round(
        &mut self,
        steps: std::ops::Range<u64>,
        mut planned: PlannedRows,
        slot: &dyn DeviceMemory,
    ) -> Result<(), FillError> {
        let index = self.next_round_buffers()?;
        let queued = std::time::Instant::now();
        let count = planned.pieces;
        if count > 0 {
            let resident = &mut self.resident;
            let needed = prepare_shard_copies(resident, &mut self.engine, &planned)?;
            replace_late_corrupt(resident, &self.engine.plan, &needed, &steps, &mut planned)?;
            // The region table, pointed at the device copies the round may read. Small piece
            // tables go in the launch's parameters with every piece's region resolved from it.
            // Otherwise, when shards are copied ahead, the piece table (and the region table,
            // when some shards are read from their device copies, or rows from the round's
            // staging: its region is the round's) are written to the round's pinned buffer and
            // read by the kernel from there: an upload could wait behind the shard copies on the
            // copy engines. Without copies the piece table is uploaded.
            let mut table = std::mem::take(&mut resident.round_regions);
            table.clone_from(&resident.host_regions);
            let copying = copies_queued(resident);
            let redirected = redirect_to_device(
                resident,
                &mut table,
                &planned.region_bytes,
                &self.engine.stream,
            )?;
            let staged =
                stage_copied_rows(resident, &mut self.engine, index, &mut planned, &mut table)?;
            let on_device = redirected || staged.is_some();
            let inline = count <= self.inline_pieces_max
                && resolve_inline(&planned.table, &table, &mut self.inline_table);
            let layout = self.engine.layout;
            let buffers = &mut self.engine.buffers[index];
            // The region table's encoding, for the kernel that reads it (inline pieces carry
            // addresses).
            let mut encoded_regions = std::mem::take(&mut resident.round_regions_encoded);
            encoded_regions.clear();
            if !inline {
                place_piece_table(
                    &self.engine.stream,
                    buffers,
                    layout,
                    &planned.table,
                    copying,
                )?;
                GatherRegion::encode_into(&table, &mut encoded_regions);
            }
            // The gather writes its outcome straight into the round's pinned buffer (mapped for
            // the device), zeroed here: no memset before the launch and no download after it,
            // two fewer operations on the stream per round.
            buffers.host.as_mut_slice()
                [layout.gather_outcome..layout.gather_outcome + GATHER_OUTCOME_BYTES]
                .fill(0);
            if on_device && !inline {
                buffers.host.as_mut_slice()[layout.regions..layout.regions + encoded_regions.len()]
                    .copy_from_slice(&encoded_regions);
            }
            self.engine.timings.rounds_from_device_copies += u64::from(on_device);
            self.engine.timings.rounds_inline += u64::from(inline);
            let buffers = &self.engine.buffers[index];
            let mapped_pieces = buffers.host.mapped(layout.pieces, planned.table.len());
            let pieces: &dyn DeviceMemory = if copying {
                &mapped_pieces
            } else {
                &buffers.pieces
            };
            let mapped_regions = buffers.host.mapped(layout.regions, encoded_regions.len());
            let mapped_outcome = buffers
                .host
                .mapped(layout.gather_outcome, GATHER_OUTCOME_BYTES);
            let regions: &dyn DeviceMemory = if on_device {
                &mapped_regions
            } else {
                &resident.regions
            };
            // SAFETY: the piece table, region table and outcome (zeroed above) belong to this
            // round (its pinned buffer is written again only after the host waited for the round);
            // the windows the regions name stay mapped and pinned for the stream's life, and the
            // device copies they name are complete and are not overwritten before this round is
            // done (the copy stream waits for the event recorded below); the slot is this filler's
            // (its release event was waited on) and overlaps no source.
            //
            // Inline, the pieces address the same windows and device copies (resolve_inline checked
            // each extent against its region).
            unsafe {
                if inline {
                    self.engine.kernels.gather.gather_inline_async(
                        &self.engine.stream,
                        &self.inline_table,
                        slot,
                        (&mapped_outcome, true),
                    )
                } else {
                    self.engine.kernels.gather.gather_regions_async(
                        &self.engine.stream,
                        pieces,
                        count as u32,
                        &[&self.engine.cache, &buffers.staging],
                        Some((regions, resident.region_count)),
                        slot,
                        (&mapped_outcome, true),
                    )
                }
            }?;
            // Bytes copied by host threads are read bytes too (from the page cache).
            let mut host_bytes =
                bytes_read_in_place(&planned.region_bytes, &table, resident) + staged.unwrap_or(0);
            if let Some(device_shards) = resident.device_shards.as_mut() {
                device_shards.record_reads(&self.engine.stream, &needed)?;
                // Bytes copied ahead are read bytes when they are queued.
                host_bytes += std::mem::take(&mut device_shards.copied_bytes);
            }
            self.engine
                .metrics
                .add_read_bytes(crate::metrics::ReadPath::PageCache, host_bytes);
            resident.round_regions = table;
            resident.round_regions_encoded = encoded_regions;
        }
        for &row in &planned.replaced {
            self.engine.zero_row(slot, row, &[])?;
        }
        // Nothing to download: the gather's outcome is in the pinned buffer already.
        self.engine.queue_downloads(index, 0, 0, false)?;
        self.engine.timings.gather_s += queued.elapsed().as_secs_f64();
        self.engine.timings.rounds += 1;
        self.count_round(&steps, planned.replaced.len());
        self.engine.rounds.push_back(PendingRound {
            buffers: index,
            steps,
            runs: 0..0,
            placements: Arc::new(PlacementRuns {
                runs: Vec::new(),
                placements: Vec::new(),
            }),
            checks: Vec::new(),
            check_windows: Vec::new(),
            decoded: Vec::new(),
            replaced: planned.replaced,
            corrupt_marks: self.engine.block_cache.corrupt_marks,
            gathered: count > 0,
        });
        Ok(())
    }

    /// Whether step `step` is one of a window shuffle's cold start (see `ColdStart`).
    fn cold_step(&self, step: u64) -> bool {
        self.resident
            .cold_start
            .as_ref()
            .is_some_and(|cold| step < cold.steps_end)
    }

    /// See [`crate::pipeline::GpuAssembler::delivers_before`]: the first step after a cold start.
    pub(in crate::pipeline::gpu) fn delivers_before(&self, step: u64) -> bool {
        self.resident
            .cold_start
            .as_ref()
            .is_some_and(|cold| step == cold.steps_end)
    }

    /// Waits for the oldest submitted batch and returns its step and report (see
    /// [`crate::pipeline::GpuAssembler::complete`]).
    pub(in crate::pipeline::gpu) fn complete(
        &mut self,
        ready: Option<&Event>,
    ) -> Result<(u64, FillReport), FillError> {
        let oldest = self
            .engine
            .batches
            .front()
            .expect("a batch was submitted")
            .step;
        // The group of batches waiting for more is queued now if the oldest batch is in it. (Not
        // otherwise: a filler completing a batch for each one it submits would queue every group
        // with one batch.)
        if self.group.as_ref().is_some_and(|g| g.contains(oldest)) {
            self.flush_group()?;
        }
        if self
            .ordered
            .as_ref()
            .and_then(|o| o.group.as_ref())
            .is_some_and(|g| g.contains(oldest))
        {
            self.flush_ordered()?;
        }
        self.engine.complete(ready)
    }

    /// Whether the oldest batch submitted is complete already: all its rounds were waited for, and
    /// it is in no group still waiting to be queued.
    pub(in crate::pipeline::gpu) fn oldest_complete(&self) -> bool {
        self.engine.batches.front().is_some_and(|b| {
            b.rounds_left == 0
                && !self.group.as_ref().is_some_and(|g| g.contains(b.step))
                && !self
                    .ordered
                    .as_ref()
                    .and_then(|o| o.group.as_ref())
                    .is_some_and(|g| g.contains(b.step))
        })
    }

    /// [`Self::submit`] for a stream whose order is computed on the device: the batch joins the
    /// group of consecutive batches waiting (queued as one launch when full, or first when the
    /// batch cannot join it).
    fn submit_ordered(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
    ) -> Result<(), FillError> {
        let rows = self.engine.plan.rank.batch_size as usize;
        self.engine
            .batches
            .push_back(PendingBatch::new(step, slot, rows));
        let (ptr, bytes) = (slot.device_ptr(), slot.len() as u64);
        let ordered = self.ordered.as_ref().expect("an ordered stream");
        if ordered.group.is_some() && !ordered.joins(step, ptr, bytes, self.group_batches_max) {
            self.flush_ordered()?;
        }
        // The slot's last use by the consumer, waited for before the batch's first write is queued.
        self.engine.wait_released(released)?;
        let ordered = self.ordered.as_mut().expect("an ordered stream");
        // Shards are read ahead from the first batch of a group on (as for planned rounds).
        if ordered.group.is_none() {
            if let Some(device_shards) = self.resident.device_shards.as_mut() {
                let plan = &self.engine.plan;
                let samples = plan.order.len().max(1);
                let first = (plan.start_cursor
                    + step * plan.rank.step_samples()
                    + plan.rank.rank as u64 * plan.rank.batch_size as u64)
                    % samples;
                device_shards.read_ahead(&plan.order, first)?;
            }
        }
        if ordered.add(step, ptr, bytes) >= self.group_batches_max {
            self.flush_ordered()?;
        }
        Ok(())
    }

    /// Queues the group of batches of an ordered stream waiting, if any, as one round: one launch
    /// of the ordered gather.
    fn flush_ordered(&mut self) -> Result<(), FillError> {
        let Some(group) = self.ordered.as_mut().and_then(|o| o.group.take()) else {
            return Ok(());
        };
        let index = self.next_round_buffers()?;
        let queued = std::time::Instant::now();
        let ordered = self.ordered.as_ref().expect("an ordered stream");
        let mut launch = ordered.launch(&self.engine.plan, &group);
        let (tables, device_tables) = ordered.tables();
        let layout = self.engine.layout;
        // Shards copied ahead (dataset order inside the budget): the round's regions point at the
        // device copies it may read, in a table in the round's pinned buffer (as planned rounds
        // do), and the copies are waited for and the reads recorded as for planned rounds.
        let mut copies = None;
        if let Some(device_shards) = self.resident.device_shards.as_mut() {
            let geometry = &self.resident.geometry;
            let region_bytes =
                ordered.region_bytes(&self.engine.plan, &group, |s| geometry.first_region(s));
            let (needed, regions_read) = shards_read(device_shards, &region_bytes, None);
            self.engine.timings.copy_wait_s +=
                device_shards.prepare_round(&needed, &regions_read, &self.engine.stream)?;
            let mut table = std::mem::take(&mut self.resident.round_regions);
            table.clone_from(&self.resident.host_regions);
            device_shards.redirect(&mut table);
            let mut encoded = std::mem::take(&mut self.resident.round_regions_encoded);
            encoded.clear();
            GatherRegion::encode_into(&table, &mut encoded);
            self.engine.buffers[index].host.as_mut_slice()
                [layout.regions..layout.regions + encoded.len()]
                .copy_from_slice(&encoded);
            let in_place = bytes_read_in_place(&region_bytes, &table, &self.resident);
            self.resident.round_regions = table;
            copies = Some((needed, in_place, encoded.len()));
            self.resident.round_regions_encoded = encoded;
        }
        let buffers = &mut self.engine.buffers[index];
        // The outcome goes straight into the round's pinned buffer (mapped), zeroed here.
        buffers.host.as_mut_slice()
            [layout.gather_outcome..layout.gather_outcome + GATHER_OUTCOME_BYTES]
            .fill(0);
        let buffers = &self.engine.buffers[index];
        let mapped_outcome = buffers
            .host
            .mapped(layout.gather_outcome, GATHER_OUTCOME_BYTES);
        if let Some((_, _, encoded_bytes)) = &copies {
            launch.regions = buffers
                .host
                .mapped(layout.regions, *encoded_bytes)
                .device_ptr();
        }
        // SAFETY: the tables are this stream's, on the device for its life; every row lies in the
        // tier's allocation of the dataset, which the stream holds (its `TierRead`) until its work
        // is done; the slots are this filler's (their release events were waited on) and overlap
        // no source; the outcome belongs to this round.
        unsafe {
            self.engine.kernels.gather.gather_ordered_async(
                &self.engine.stream,
                device_tables,
                tables,
                launch,
                &group,
                (&mapped_outcome, true),
            )
        }?;
        let in_place = match copies {
            Some((needed, in_place, _)) => {
                let device_shards = self
                    .resident
                    .device_shards
                    .as_mut()
                    .expect("copies ahead were prepared");
                device_shards.record_reads(&self.engine.stream, &needed)?;
                // Bytes copied ahead are read bytes when they are queued.
                in_place + std::mem::take(&mut device_shards.copied_bytes)
            }
            None => ordered.bytes_read_in_place(launch.batches as u64, launch.batch_rows as u64),
        };
        self.engine
            .metrics
            .add_read_bytes(crate::metrics::ReadPath::PageCache, in_place);
        self.engine.queue_downloads(index, 0, 0, false)?;
        let batches = launch.batches as u64;
        if batches > 1 {
            self.engine.timings.batches_grouped += batches;
        }
        self.engine.timings.gather_s += queued.elapsed().as_secs_f64();
        self.engine.timings.rounds += 1;
        self.engine.timings.rounds_from_device_copies += u64::from(in_place == 0);
        self.count_round(&group.steps, 0);
        self.engine.rounds.push_back(PendingRound {
            buffers: index,
            steps: group.steps.clone(),
            runs: 0..0,
            placements: Arc::new(PlacementRuns {
                runs: Vec::new(),
                placements: Vec::new(),
            }),
            checks: Vec::new(),
            check_windows: Vec::new(),
            decoded: Vec::new(),
            replaced: Vec::new(),
            corrupt_marks: self.engine.block_cache.corrupt_marks,
            gathered: true,
        });
        Ok(())
    }

    /// Device memory this stream holds besides its slots, in bytes.
    pub(in crate::pipeline::gpu) fn device_bytes(&self) -> usize {
        self.engine.device_bytes() + self.resident.device_bytes()
    }
}

impl Drop for ResidentAssembler {
    fn drop(&mut self) {
        let resident = &mut self.resident;
        if !self.engine.close(|| resident.release()) {
            resident.discard_buffers();
        }
    }
}
