//! Completing a round: wait for it, read its outcomes (checksums, LZ4 status, gather faults), mark
//! the blocks it found bad, and zero (or fail on) the rows gathered from them before their batch is
//! handed off.

use std::sync::Arc;
use std::time::Instant;

use foldhash::{HashMap, HashMapExt};

use super::buffers::{DeviceRange, PendingRound};
use super::rounds::RoundEngine;
use crate::format::Codec;
use crate::kernels::{
    GatherOutcome, Lz4Outcome, Lz4Status, Xxh3Outcome, Xxh3Status, GATHER_OUTCOME_BYTES,
    LZ4_OUTCOME_BYTES, XXH3_OUTCOME_BYTES,
};
use crate::pipeline::stream_plan::{
    BlockKey, CorruptBlock, CorruptPolicy, CorruptReason, FillError,
};

/// Time between two completion queries while the filler polls a round (see
/// [`crate::pipeline::gpu::GpuStreamLimits::wait_spin`]).
const WAIT_SPIN_QUERY_INTERVAL: std::time::Duration = std::time::Duration::from_micros(5);

impl RoundEngine {
    /// Waits for the oldest queued round and acts on its outcomes.
    pub(in crate::pipeline::gpu) fn complete_round(&mut self) -> Result<(), FillError> {
        let round = self.rounds.pop_front().expect("a round is queued");
        let waited = Instant::now();
        let done = &self.buffers[round.buffers].done;
        // Poll for a while before sleeping: a round of a stream the device keeps up with is often
        // done within microseconds, and a sleeping filler wakes tens of microseconds late.
        if !self.wait_spin.is_zero() {
            while waited.elapsed() < self.wait_spin && !done.is_complete()? {
                // A query every few microseconds, not back to back: polling with back-to-back
                // queries came with a slower first window in a window shuffle (so did spaced
                // queries once, so the cause is not known).
                let paused = Instant::now();
                while paused.elapsed() < WAIT_SPIN_QUERY_INTERVAL {
                    std::hint::spin_loop();
                }
            }
        }
        done.synchronize()?;
        self.timings.wait_s += waited.elapsed().as_secs_f64();
        let outcomes_started = Instant::now();
        let (xxh3, lz4) = self.read_outcomes(&round)?;
        let bad = self.bad_blocks(&round, &xxh3, &lz4);
        self.fix_up_rows(&round, &bad)?;
        for batch in self.batches.iter_mut() {
            if round.steps.contains(&batch.step) {
                batch.rounds_left -= 1;
            }
        }
        self.metrics.add_decode_time(outcomes_started.elapsed());
        self.timings.decode_s += outcomes_started.elapsed().as_secs_f64();
        Ok(())
    }

    /// The checksum and LZ4 outcomes of a completed round; an error if the gather refused pieces.
    fn read_outcomes(
        &self,
        round: &PendingRound,
    ) -> Result<(Vec<Xxh3Outcome>, Vec<Lz4Outcome>), FillError> {
        let layout = &self.layout;
        let host = self.buffers[round.buffers].host.as_slice();
        let xxh3 = Xxh3Outcome::decode_all(
            &host[layout.xxh3_outcomes
                ..layout.xxh3_outcomes + round.checks.len() * XXH3_OUTCOME_BYTES],
        );
        let lz4 = Lz4Outcome::decode_all(
            &host[layout.lz4_outcomes
                ..layout.lz4_outcomes + round.decoded.len() * LZ4_OUTCOME_BYTES],
        );
        if round.gathered {
            let outcome = GatherOutcome::decode(
                &host[layout.gather_outcome..layout.gather_outcome + GATHER_OUTCOME_BYTES],
            );
            if outcome.faulted_pieces > 0 {
                return Err(FillError::GatherRefused {
                    pieces: outcome.faulted_pieces,
                    last: outcome.last_faulted_plus_1 - 1,
                });
            }
        }
        Ok((xxh3, lz4))
    }

    /// The blocks a completed round found bad, with the reason. Raw blocks that passed are verified
    /// for the rest of the stream; LZ4 blocks that failed are marked corrupt in the cache.
    fn bad_blocks(
        &mut self,
        round: &PendingRound,
        xxh3: &[Xxh3Outcome],
        lz4: &[Lz4Outcome],
    ) -> HashMap<BlockKey, Arc<CorruptBlock>> {
        let mut bad: HashMap<BlockKey, Arc<CorruptBlock>> = HashMap::new();
        let checks = round.checks.iter().zip(&round.check_windows);
        for ((&(key, expected), window), outcome) in checks.zip(xxh3) {
            let raw = self.entry(&key).codec == Codec::Raw;
            if outcome.status == Xxh3Status::Ok {
                if raw {
                    self.verified.insert(key);
                }
                if let Some(window) = window {
                    let offset = self.entry(&key).stored_offset;
                    self.reader.windows().mark_verified(*window, offset);
                }
                continue;
            }
            if raw {
                self.metrics.add_corrupt_blocks(1);
            }
            let reason = CorruptReason::Checksum {
                expected,
                computed: outcome.hash,
            };
            bad.insert(key, self.corrupt_block(&key, reason));
        }
        for (&(key, entry_index), outcome) in round.decoded.iter().zip(lz4) {
            let found = match bad.get(&key) {
                Some(found) => Arc::clone(found),
                None if outcome.status != Lz4Status::Ok => {
                    let reason = CorruptReason::Lz4Kernel {
                        status: outcome.status,
                        produced: outcome.produced,
                    };
                    let found = self.corrupt_block(&key, reason);
                    bad.insert(key, Arc::clone(&found));
                    found
                }
                None => continue,
            };
            self.mark_corrupt(key, entry_index, found);
        }
        bad
    }

    /// Zeroes (or fails on) the rows of a completed round gathered from a block found `bad` by it,
    /// or (if blocks were marked corrupt since the round was planned) from a cached block that is now
    /// known to be corrupt.
    fn fix_up_rows(
        &mut self,
        round: &PendingRound,
        bad: &HashMap<BlockKey, Arc<CorruptBlock>>,
    ) -> Result<(), FillError> {
        let recheck_cache = self.block_cache.corrupt_marks != round.corrupt_marks;
        if bad.is_empty() && !recheck_cache {
            return Ok(());
        }
        let plan = Arc::clone(&self.plan);
        let fields = &plan.fields;
        let mut fixes: Vec<usize> = Vec::new();
        for run in round.runs.clone() {
            let (first_row, rows) = round.placements.runs[run];
            let run_placements =
                &round.placements.placements[run * fields.len()..(run + 1) * fields.len()];
            let corrupt = self.corrupt_rows(run_placements, rows, |key| {
                bad.get(key).cloned().or_else(|| {
                    recheck_cache
                        .then(|| self.block_cache.corrupt(key).cloned())
                        .flatten()
                })
            });
            for (i, found) in corrupt {
                let row = first_row + i;
                if round.replaced.contains(&row) {
                    continue;
                }
                match plan.on_corrupt {
                    CorruptPolicy::Fail => return Err(found.to_error()),
                    CorruptPolicy::Replace => fixes.push(row),
                }
            }
        }
        if fixes.is_empty() {
            return Ok(());
        }
        let batch = self
            .batches
            .iter_mut()
            .find(|b| b.step == round.steps.start)
            .expect("a queued round's batch is pending");
        // Only a batch's own round checks blocks: a group's rounds read verified rows alone.
        debug_assert_eq!(round.steps.end - round.steps.start, 1);
        batch.replaced += fixes.len() as u32;
        batch.fixed_up = true;
        let slot = DeviceRange {
            ptr: batch.slot_ptr,
            bytes: batch.slot_bytes,
        };
        let variable = std::sync::Arc::clone(&batch.variable);
        for row in fixes {
            self.zero_row(&slot, row, &variable)?;
        }
        Ok(())
    }
}
