//! The staged assembler: each batch's rows are planned into rounds on the filler's thread, and a
//! round reads its blocks into its staging buffer (raw blocks, or rows read in place from mapped
//! page-cache windows) or decodes them into the block cache (LZ4 blocks), verifies them, and gathers
//! its rows into the slot. Planning is in [`super::plan`], queueing a round in [`super::queue`].

use std::sync::Arc;
use std::time::Instant;

use crate::device::{fill_async, DeviceMemory, DeviceRegion, Event, PinnedBuffer};
use crate::pipeline::gpu::engine::buffers::PendingBatch;
use crate::pipeline::gpu::engine::rounds::RoundEngine;
use crate::pipeline::gpu::limits::ZeroCopy;
use crate::pipeline::stream_plan::{FillError, PlacementRuns};
use crate::pipeline::varlen::{VariableForm, VariableRows};
use crate::storage::gpu::PathChoice;

/// Largest delivered bytes per field of a run of consecutive rows planned as one (see
/// [`crate::pipeline::StreamPlan::placement_runs`]).
const RUN_OUT_BYTES_MAX: usize = 1 << 20;

/// Fills device slots of a stream that reads its blocks round by round: reads, verifies and decodes
/// blocks on the device and gathers each batch.
pub struct StagedAssembler {
    pub(in crate::pipeline::gpu) engine: RoundEngine,
    pub(in crate::pipeline::gpu) choice: PathChoice,
    pub(in crate::pipeline::gpu) entry_bytes: u64,
    pub(in crate::pipeline::gpu) scratch_offset: u64,
    pub(in crate::pipeline::gpu) scratch_bytes: u64,
    pub(in crate::pipeline::gpu) jobs_max: usize,
    pub(in crate::pipeline::gpu) zero_copy: ZeroCopy,
    /// LZ4 blocks read ahead after a cache miss (see [`super::plan::cache_bytes`]); 0: none.
    pub(in crate::pipeline::gpu) lz4_read_ahead: u32,
    pub(in crate::pipeline::gpu) round_stamp: u64,
    /// Largest output of a gather piece merged from adjacent samples (see
    /// [`crate::pipeline::gpu::GpuStreamLimits::gather_piece_out_bytes`]).
    pub(in crate::pipeline::gpu) gather_piece_out_bytes: u64,
    /// The variable-length fields of the batch being submitted.
    pub(in crate::pipeline::gpu) variable: VariableBatch,
}

/// What the staged assembler keeps of a batch's variable-length fields while it queues the batch.
#[derive(Default)]
pub(in crate::pipeline::gpu) struct VariableBatch {
    /// Per field of the stream (`None` for fixed-shape ones), where the batch's rows go (shared
    /// with its [`PendingBatch`], for rows zeroed when it completes).
    pub(in crate::pipeline::gpu) rows: std::sync::Arc<Vec<Option<VariableRows>>>,
    /// Pinned memory the batches' index tensors are uploaded from: one entry per batch, for one
    /// more batch than the stream has round buffers (see [`StagedAssembler::queue_variable`]).
    host: Option<PinnedBuffer>,
}

impl StagedAssembler {
    /// Queues stream step `step` into `slot` (see [`crate::pipeline::GpuAssembler::submit`]):
    /// plans its rounds and queues each, then records `ready` after the batch's last work.
    pub(in crate::pipeline::gpu) fn submit(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
        ready: Option<&Event>,
    ) -> Result<(), FillError> {
        let planned = Instant::now();
        let placements = Arc::new(self.engine.plan.placement_runs(step, RUN_OUT_BYTES_MAX));
        self.engine.timings.plan_s += planned.elapsed().as_secs_f64();
        let rows = placements
            .runs
            .last()
            .map_or(0, |&(first, count)| first + count);
        let runs = placements.runs.len();
        self.engine.wait_released(released)?;
        self.engine
            .batches
            .push_back(PendingBatch::new(step, slot, rows));
        self.queue_variable(step, &placements, slot)?;
        let mut run = 0usize;
        while run < runs {
            // The round's buffers must be free: complete the round that used them last.
            if self.engine.rounds.len() == self.engine.buffers.len() {
                self.engine.complete_round()?;
            }
            let planned = Instant::now();
            let round = self.plan_round(&placements, run)?;
            self.engine.timings.plan_s += planned.elapsed().as_secs_f64();
            self.engine.timings.rounds += 1;
            run = round.runs.end;
            self.engine
                .batches
                .back_mut()
                .expect("just pushed")
                .rounds_left += 1;
            self.queue_round(step, &placements, round, slot)?;
        }
        if let Some(ready) = ready {
            ready.record(&self.engine.stream)?;
        }
        Ok(())
    }

    /// For a stream with variable-length fields, before the batch of `step` is gathered into
    /// `slot`: works out where its rows go (into [`VariableBatch::rows`], for the gathers), zeroes
    /// a padded field's values (what the rows leave is padding) and uploads each field's index
    /// tensor, all on the stream ahead of the gathers.
    fn queue_variable(
        &mut self,
        step: u64,
        placements: &PlacementRuns,
        slot: &DeviceRegion,
    ) -> Result<(), FillError> {
        let plan = std::sync::Arc::clone(&self.engine.plan);
        if !plan.has_variable() {
            return Ok(());
        }
        let width = plan.fields.len();
        // With a variable-length field, a run is one row (`StreamPlan::placement_runs`).
        let samples = placements.runs.len();
        let rows = plan.variable_rows(samples, |at, row| &placements.placements[row * width + at]);
        let entry_bytes: usize = plan
            .fields
            .iter()
            .filter_map(|f| f.variable.as_ref())
            .map(|v| 4 * v.index_elements(plan.rank.batch_size as usize))
            .sum();
        let entries = self.engine.buffers.len() + 1;
        if self.variable.host.is_none() {
            self.variable.host = Some(PinnedBuffer::new(
                self.engine.stream.device(),
                entry_bytes * entries,
            )?);
        }
        let host = self.variable.host.as_mut().expect("allocated above");
        let mut at = (step % entries as u64) as usize * entry_bytes;
        for (field, rows) in plan.fields.iter().zip(&rows) {
            let (Some(rows), Some(variable)) = (rows, &field.variable) else {
                continue;
            };
            if variable.form == VariableForm::Padded {
                // SAFETY: the range lies in the slot (bounded by the plan's length bound); the slot
                // is this filler's (its release was waited for), and the gathers that write its rows
                // are queued after this on the same stream.
                unsafe {
                    fill_async(
                        &self.engine.stream,
                        slot,
                        field.offset,
                        rows.values_bytes(field.sample_bytes_out),
                        0,
                    )
                }?;
            }
            host.as_mut_slice()[at..at + rows.index.len()].copy_from_slice(&rows.index);
            // SAFETY: the entry written is not written again before this copy completes: it is
            // reused `entries` batches later, and by then this batch's rounds, queued after the
            // copy on the same stream, have been waited for (no more rounds are in flight than
            // the stream has round buffers, one less than `entries`). The index lies in the slot.
            unsafe {
                host.upload_async(
                    &self.engine.stream,
                    at,
                    slot,
                    variable.index_offset,
                    rows.index.len(),
                )
            }?;
            at += rows.index.len();
        }
        let rows = std::sync::Arc::new(rows);
        self.engine
            .batches
            .back_mut()
            .expect("the batch was pushed before its variable-length fields are queued")
            .variable = std::sync::Arc::clone(&rows);
        self.variable.rows = rows;
        Ok(())
    }

    /// Zeroes row `row` of the batch being queued in `slot` in every field (a corrupt sample
    /// replaced, as on the CPU backend): a variable-length field's row where the batch places it.
    pub(in crate::pipeline::gpu) fn zero_row(
        &self,
        slot: &dyn DeviceMemory,
        row: usize,
    ) -> Result<(), FillError> {
        self.engine.zero_row(slot, row, &self.variable.rows)
    }

    /// Whether the oldest batch submitted is complete already: all its rounds were waited for.
    pub(in crate::pipeline::gpu) fn oldest_complete(&self) -> bool {
        self.engine
            .batches
            .front()
            .is_some_and(|b| b.rounds_left == 0)
    }
}

impl Drop for StagedAssembler {
    fn drop(&mut self) {
        self.engine.close(|| {});
    }
}
