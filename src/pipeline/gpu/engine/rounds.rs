//! The round engine both GPU assemblers run on: the stream's device buffers and round buffers, the
//! rounds queued (at most one per set of round buffers) and the batches submitted, completing
//! them in order, and what a round's completion needs to know (the block cache's marks, the raw
//! blocks verified).
//!
//! How a round's work is planned and queued is the assembler's: the staged assembler
//! (`gpu::staged`) reads, verifies, decodes and gathers blocks; the resident assembler
//! (`gpu::resident`) gathers rows in place. Both end a round with [`RoundEngine::queue_downloads`],
//! and both complete rounds and batches here.

use std::collections::VecDeque;
use std::sync::Arc;

use foldhash::HashSet;

use super::buffers::{
    HostLayout, PendingBatch, PendingRound, RoundBufferPool, RoundBuffers, RoundShape,
};
use super::cache::BlockCache;
use crate::decode::BlockRef;
use crate::device::{fill_async, DeviceMemory, Event, Stream};
use crate::format::BlockEntry;
use crate::kernels::{Kernels, GATHER_OUTCOME_BYTES, LZ4_OUTCOME_BYTES, XXH3_OUTCOME_BYTES};
use crate::metrics::DeviceMetrics;
use crate::pipeline::gpu::limits::GpuFillTimings;
use crate::pipeline::gpu::shard_pool::KeptBuffer;
use crate::pipeline::stream_plan::{
    BlockKey, CorruptBlock, CorruptReason, FieldPlan, FillError, FillReport, Placement, StreamPlan,
};
use crate::storage::gpu::GpuReader;
use crate::storage::FileTable;

/// What both assemblers of a GPU stream share: its plan, device, buffers, rounds in flight and
/// batches submitted.
pub(in crate::pipeline::gpu) struct RoundEngine {
    pub(in crate::pipeline::gpu) plan: Arc<StreamPlan>,
    pub(in crate::pipeline::gpu) kernels: Arc<Kernels>,
    pub(in crate::pipeline::gpu) reader: GpuReader,
    pub(in crate::pipeline::gpu) files: FileTable,
    pub(in crate::pipeline::gpu) stream: Stream,
    /// The block cache (`block_cache.entries` entries of the staged assembler's `entry_bytes`), then
    /// the shuffle scratch.
    pub(in crate::pipeline::gpu) cache: KeptBuffer,
    pub(in crate::pipeline::gpu) pieces_max: usize,
    pub(in crate::pipeline::gpu) layout: HostLayout,
    pub(in crate::pipeline::gpu) buffers: Vec<RoundBuffers>,
    /// Where the round buffers go back when the stream closes, and what they were made for.
    pub(in crate::pipeline::gpu) pool: Arc<RoundBufferPool>,
    pub(in crate::pipeline::gpu) round_shape: RoundShape,
    /// Rounds queued, oldest first (at most one per set of round buffers).
    pub(in crate::pipeline::gpu) rounds: VecDeque<PendingRound>,
    /// See [`crate::pipeline::gpu::GpuStreamLimits::wait_spin`].
    pub(in crate::pipeline::gpu) wait_spin: std::time::Duration,
    /// Batches submitted, oldest first.
    pub(in crate::pipeline::gpu) batches: VecDeque<PendingBatch>,
    pub(in crate::pipeline::gpu) next_buffers: usize,
    /// Raw blocks whose checksum this stream has verified (LZ4 blocks are verified when they are
    /// decoded into the cache, which keeps them).
    pub(in crate::pipeline::gpu) verified: HashSet<BlockKey>,
    /// Where the fill time went, for benchmarks.
    pub(in crate::pipeline::gpu) timings: GpuFillTimings,
    /// Which block each cache entry holds, and which blocks are known to be corrupt.
    pub(in crate::pipeline::gpu) block_cache: BlockCache,
    pub(in crate::pipeline::gpu) metrics: DeviceMetrics,
}

impl RoundEngine {
    /// Device memory of the block cache and the round buffers, in bytes.
    pub(in crate::pipeline::gpu) fn device_bytes(&self) -> usize {
        self.cache.len() + self.buffers.iter().map(|b| b.device_bytes()).sum::<usize>()
    }

    pub(in crate::pipeline::gpu) fn entry(&self, key: &BlockKey) -> &BlockEntry {
        &self.plan.dataset.shards[key.shard as usize]
            .metadata
            .field_blocks(key.field as usize)[key.block as usize]
    }

    pub(in crate::pipeline::gpu) fn block_ref(&self, key: &BlockKey) -> BlockRef {
        let shard = &self.plan.dataset.shards[key.shard as usize];
        BlockRef {
            shard: shard.path.clone(),
            field: shard.metadata.fields[key.field as usize].name.clone(),
            block: key.block,
            stored_offset: self.entry(key).stored_offset,
        }
    }

    /// Waits for the oldest submitted batch, checks what its rounds found, zeroes (or fails on) samples
    /// whose blocks turned out to be corrupt, and returns its step and report. `ready` is the batch's
    /// ready event, recorded again if work was queued on the slot after it.
    pub(in crate::pipeline::gpu) fn complete(
        &mut self,
        ready: Option<&Event>,
    ) -> Result<(u64, FillReport), FillError> {
        let oldest = self.batches.front().expect("a batch was submitted").step;
        while self.batches.front().is_some_and(|b| b.rounds_left > 0) {
            self.complete_round()?;
        }
        let batch = self.batches.pop_front().expect("checked above");
        debug_assert_eq!(batch.step, oldest);
        if batch.fixed_up {
            if let Some(ready) = ready {
                ready.record(&self.stream)?;
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

    /// Makes the stream wait for the consumer's last use of a slot (its `released` event) before
    /// the slot is written again, unless that use is known done on the host: a consumer that
    /// recorded nothing, or whose work completed, costs the device no wait. (The consumer records
    /// the event before it publishes the release, so the query sees that record; a wait queued on
    /// the device would wait for the same one. Skipping the wait gave a consumer a few percent at
    /// batches of 256 and 1024 rows.)
    pub(in crate::pipeline::gpu) fn wait_released(
        &mut self,
        released: &Event,
    ) -> Result<(), FillError> {
        if !released.is_complete()? {
            self.stream.wait(released)?;
        }
        Ok(())
    }

    /// Waits for the stream's queued work when its assembler is dropped, runs `release` (the
    /// resident assembler unpins its windows there), and gives the round buffers back to the pool
    /// when that work (the rounds', and the reads into their staging on the reader's copy stream)
    /// is known done; otherwise frees the block cache on drop instead of keeping it. Returns whether
    /// the work is known done.
    pub(in crate::pipeline::gpu) fn close(&mut self, release: impl FnOnce()) -> bool {
        // Queued rounds read the staging buffers and write slots: let them finish first.
        let synchronized = self.stream.synchronize();
        release();
        // Round buffers whose work is known done (the rounds', and the reads into their staging
        // on the reader's copy stream) go back for the next stream on the device, and so do the
        // block cache and the region table; otherwise they are freed.
        if synchronized.is_ok() && self.reader.stream().synchronize().is_ok() {
            for buffers in self.buffers.drain(..) {
                self.pool.put(self.round_shape, buffers);
            }
            true
        } else {
            self.cache.discard();
            false
        }
    }

    /// Phase 4: brings the outcomes back to pinned memory and marks the round's end.
    pub(in crate::pipeline::gpu) fn queue_downloads(
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
    pub(in crate::pipeline::gpu) fn zero_row(
        &self,
        slot: &dyn DeviceMemory,
        row: usize,
        variable: &[Option<crate::pipeline::varlen::VariableRows>],
    ) -> Result<(), FillError> {
        for (at, field) in self.plan.fields.iter().enumerate() {
            // A variable-length field's row is where its batch places it.
            let range = match variable.get(at).and_then(Option::as_ref) {
                Some(rows) => field.row_place(rows, row),
                None => {
                    let start = field.offset + row * field.sample_bytes_out;
                    start..start + field.sample_bytes_out
                }
            };
            // SAFETY: the range lies in the slot (validated plan); the slot is this filler's until
            // its batch is handed off, and the zeros are queued on the stream after the gather.
            unsafe { fill_async(&self.stream, slot, range.start, range.len(), 0) }?;
        }
        Ok(())
    }

    /// Records that an LZ4 block is unusable. Its cache entry is released if it still holds the block.
    pub(in crate::pipeline::gpu) fn mark_corrupt(
        &mut self,
        key: BlockKey,
        entry_index: u32,
        bad: Arc<CorruptBlock>,
    ) {
        if self.block_cache.mark_corrupt(key, entry_index, bad) {
            self.metrics.add_corrupt_blocks(1);
        }
    }

    /// A block found unusable, named for error messages. Called only when a block is found bad.
    pub(in crate::pipeline::gpu) fn corrupt_block(
        &self,
        key: &BlockKey,
        reason: CorruptReason,
    ) -> Arc<CorruptBlock> {
        Arc::new(CorruptBlock {
            block: self.block_ref(key),
            reason,
        })
    }

    /// The rows of a run (`rows` rows, `placements` one per field) that read a block `corrupt_of`
    /// names, as (row within the run, what is wrong), in row order.
    pub(in crate::pipeline::gpu) fn corrupt_rows(
        &self,
        placements: &[Placement],
        rows: usize,
        corrupt_of: impl Fn(&BlockKey) -> Option<Arc<CorruptBlock>>,
    ) -> Vec<(usize, Arc<CorruptBlock>)> {
        let mut found: Vec<(usize, Arc<CorruptBlock>)> = Vec::new();
        for (field, placement) in self.plan.fields.iter().zip(placements) {
            // A run of a stream with a variable-length field is one row, whatever its bytes.
            let width = if field.variable.is_some() {
                u64::MAX
            } else {
                field.sample_bytes_in as u64
            };
            for block in placement.blocks.clone() {
                let key = block_key(placement, field, block);
                let Some(bad) = corrupt_of(&key) else {
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
                        found.push((i, Arc::clone(&bad)));
                    }
                }
            }
        }
        found.sort_unstable_by_key(|(row, _)| *row);
        found
    }
}

/// The key of block `block` of `field` in the shard of `placement`.
pub(in crate::pipeline::gpu) fn block_key(
    placement: &Placement,
    field: &FieldPlan,
    block: u32,
) -> BlockKey {
    BlockKey {
        shard: placement.shard as u32,
        field: field.field_index as u32,
        block,
    }
}
