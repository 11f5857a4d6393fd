//! The staged assembler: each batch's rows are planned into rounds on the filler's thread, and a
//! round reads its blocks into its staging buffer (raw blocks, or rows read in place from mapped
//! page-cache windows) or decodes them into the block cache (LZ4 blocks), verifies them, and gathers
//! its rows into the slot. Planning is in [`super::plan`], queueing a round in [`super::queue`].

use std::sync::Arc;
use std::time::Instant;

use crate::device::{DeviceRegion, Event};
use crate::pipeline::gpu::engine::buffers::PendingBatch;
use crate::pipeline::gpu::engine::rounds::RoundEngine;
use crate::pipeline::gpu::limits::ZeroCopy;
use crate::pipeline::stream_plan::FillError;
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
