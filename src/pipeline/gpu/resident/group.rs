//! Groups of small batches of a resident stream gathered by one round ([`BatchGroup`]).

use super::planner::PlannedRows;
use crate::device::DeviceMemory;

/// Widest span of slot memory one group of batches may write (the slots of a ring lie in one
/// allocation, in order; the span also covers the slots between the group's, which its pieces do not
/// write).
const GROUP_SPAN_BYTES_MAX: u64 = 64 << 20;

/// Consecutive small batches of a resident stream, planned and waiting to be gathered by one round
/// (one launch and one completion event instead of one each): their piece tables joined, each
/// piece's destination moved from its slot's start to the group's first slot.
pub(super) struct BatchGroup {
    pub(super) steps: std::ops::Range<u64>,
    /// Device address of the first batch's slot.
    pub(super) base: u64,
    /// End of the last batch's slot.
    pub(super) end: u64,
    pub(super) table: Vec<u8>,
    pub(super) pieces: usize,
    pub(super) region_bytes: Vec<u64>,
}

impl BatchGroup {
    /// An empty group starting with step `step` in `slot`, for a stream of `region_count` regions.
    pub(super) fn new(step: u64, slot: &dyn DeviceMemory, region_count: usize) -> BatchGroup {
        BatchGroup {
            steps: step..step,
            base: slot.device_ptr(),
            end: slot.device_ptr(),
            table: Vec::new(),
            pieces: 0,
            region_bytes: vec![0; region_count],
        }
    }

    /// Whether step `step` is in the group.
    pub(super) fn contains(&self, step: u64) -> bool {
        self.steps.contains(&step)
    }

    /// Batches in the group.
    pub(super) fn len(&self) -> usize {
        (self.steps.end - self.steps.start) as usize
    }

    /// Whether step `step` in `slot`, of `pieces` pieces, may join: the next step, its slot after
    /// the group's within [`GROUP_SPAN_BYTES_MAX`], and at most `pieces_max` pieces in all.
    pub(super) fn accepts(
        &self,
        step: u64,
        slot: &dyn DeviceMemory,
        pieces: usize,
        pieces_max: usize,
    ) -> bool {
        step == self.steps.end
            && slot.device_ptr() >= self.end
            && slot.device_ptr() + slot.len() as u64 - self.base <= GROUP_SPAN_BYTES_MAX
            && self.pieces + pieces <= pieces_max
    }

    /// Adds step `step`'s planned rows, written into `slot` (accepted by [`Self::accepts`], or the
    /// group's first).
    pub(super) fn add(&mut self, step: u64, slot: &dyn DeviceMemory, rows: PlannedRows) {
        debug_assert_eq!(step, self.steps.end);
        let offset = slot.device_ptr() - self.base;
        let start = self.table.len();
        self.table.extend_from_slice(&rows.table);
        shift_destinations(&mut self.table[start..], offset);
        self.pieces += rows.pieces;
        for (sum, bytes) in self.region_bytes.iter_mut().zip(&rows.region_bytes) {
            *sum += bytes;
        }
        self.steps.end = step + 1;
        self.end = slot.device_ptr() + slot.len() as u64;
    }
}

/// Adds `offset` to the destination of every piece of an encoded piece table.
fn shift_destinations(table: &mut [u8], offset: u64) {
    if offset == 0 {
        return;
    }
    for piece in table.chunks_exact_mut(crate::kernels::GATHER_PIECE_BYTES) {
        let dst = &mut piece[GATHER_PIECE_DST_OFFSET..GATHER_PIECE_DST_OFFSET + 8];
        let moved = u64::from_le_bytes(dst.try_into().expect("8 bytes")) + offset;
        dst.copy_from_slice(&moved.to_le_bytes());
    }
}

/// Where a piece's destination offset lies in its encoding ([`crate::kernels::GatherPiece::encode`]).
const GATHER_PIECE_DST_OFFSET: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{GatherOp, GatherPlan, GATHER_PIECE_BYTES};
    use crate::pipeline::gpu::engine::buffers::DeviceRange;

    /// Planned rows of `pieces` pieces, piece `i` writing at `i * 4096` of its slot and reading
    /// region `i % 2` of two.
    fn rows(pieces: usize) -> PlannedRows {
        let mut plan = GatherPlan::new();
        for i in 0..pieces {
            let source = (crate::kernels::GATHER_SOURCES_MAX + i % 2) as u16;
            plan.push(
                source,
                i as u64 * 2048,
                i as u64 * 4096,
                1024,
                GatherOp::F16ToF32,
                1.0,
            );
        }
        let mut region_bytes = vec![0u64; 2];
        for piece in plan.pieces() {
            region_bytes[piece.source as usize - crate::kernels::GATHER_SOURCES_MAX] += 2048;
        }
        PlannedRows {
            table: plan.encode(),
            pieces,
            region_bytes,
            replaced: Vec::new(),
            copies: Vec::new(),
        }
    }

    fn dst(table: &[u8], piece: usize) -> u64 {
        let at = piece * GATHER_PIECE_BYTES + GATHER_PIECE_DST_OFFSET;
        u64::from_le_bytes(table[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn a_group_moves_each_batch_s_pieces_to_its_own_slot_and_sums_its_reads() {
        let stride = 1 << 20;
        let slot = |i: u64| DeviceRange {
            ptr: 0x7000_0000 + i * stride,
            bytes: 1 << 20,
        };
        let mut group = BatchGroup::new(10, &slot(3), 2);
        group.add(10, &slot(3), rows(4));
        assert!(group.accepts(11, &slot(4), 4, 16));
        group.add(11, &slot(4), rows(4));
        // Slot 6: a gap (slot 5 is held elsewhere) is allowed, the span covering it.
        assert!(group.accepts(12, &slot(6), 4, 16));
        group.add(12, &slot(6), rows(4));
        assert_eq!(group.len(), 3);
        assert_eq!(group.steps, 10..13);
        assert_eq!(group.pieces, 12);
        assert_eq!(group.table.len(), 12 * GATHER_PIECE_BYTES);
        assert_eq!(group.region_bytes, vec![6 * 2048, 6 * 2048]);
        assert_eq!(
            (group.base, group.end),
            (slot(3).ptr, slot(6).ptr + (1 << 20))
        );
        for piece in 0..4u64 {
            assert_eq!(dst(&group.table, piece as usize), piece * 4096);
            assert_eq!(dst(&group.table, 4 + piece as usize), stride + piece * 4096);
            assert_eq!(
                dst(&group.table, 8 + piece as usize),
                3 * stride + piece * 4096
            );
        }
        // Everything but the destination is the batch's own table.
        let own = rows(4).table;
        for piece in 0..4 {
            let (a, b) = (
                piece * GATHER_PIECE_BYTES,
                8 * GATHER_PIECE_BYTES + piece * GATHER_PIECE_BYTES,
            );
            assert_eq!(group.table[b..b + 8], own[a..a + 8]);
            assert_eq!(group.table[b + 16..b + 32], own[a + 16..a + 32]);
        }
    }

    #[test]
    fn a_group_refuses_a_step_out_of_turn_a_slot_behind_too_wide_a_span_or_too_many_pieces() {
        let slot = |ptr: u64| DeviceRange {
            ptr,
            bytes: 1 << 20,
        };
        let mut group = BatchGroup::new(5, &slot(1 << 30), 2);
        group.add(5, &slot(1 << 30), rows(8));
        assert!(group.accepts(6, &slot((1 << 30) + (1 << 20)), 8, 16));
        // Not the next step.
        assert!(!group.accepts(7, &slot((1 << 30) + (1 << 20)), 8, 16));
        // The ring wrapped: a slot before the group's.
        assert!(!group.accepts(6, &slot(1 << 29), 8, 16));
        // Overlapping the group's last slot.
        assert!(!group.accepts(6, &slot((1 << 30) + 4096), 8, 16));
        // A span wider than GROUP_SPAN_BYTES_MAX.
        assert!(!group.accepts(6, &slot((1 << 30) + GROUP_SPAN_BYTES_MAX), 8, 16));
        // More pieces than one launch takes.
        assert!(!group.accepts(6, &slot((1 << 30) + (1 << 20)), 9, 16));
    }
}
