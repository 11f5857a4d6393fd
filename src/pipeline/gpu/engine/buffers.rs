//! The buffers of the round engine: the fixed device and pinned buffers of one round in flight
//! ([`RoundBuffers`], laid out by [`HostLayout`]), the pool that keeps them between streams
//! ([`RoundBufferPool`]), and the records of the rounds and batches queued and not completed yet
//! ([`PendingRound`], [`PendingBatch`]).

use std::ops::Range;
use std::sync::Arc;

use crate::device::{
    Device, DeviceBuffer, DeviceError, DeviceMemory, DeviceRegion, Event, PinnedBuffer, Stream,
};
use crate::kernels::{
    GATHER_OUTCOME_BYTES, GATHER_PIECE_BYTES, GATHER_REGION_BYTES, LZ4_JOB_BYTES,
    LZ4_OUTCOME_BYTES, XXH3_JOB_BYTES, XXH3_OUTCOME_BYTES,
};
use crate::pipeline::stream_plan::{BlockKey, FillError, PlacementRuns};
use crate::storage::windows::WindowId;

/// Most mapped page-cache windows one round reads in place (its region table, 64 KiB; 256 GiB of
/// 64 MiB windows).
pub(in crate::pipeline::gpu) const REGIONS_MAX: usize = 4096;

/// Offsets of the tables and outcomes in a round's pinned host buffer.
#[derive(Clone, Copy)]
pub(in crate::pipeline::gpu) struct HostLayout {
    pub(in crate::pipeline::gpu) xxh3_jobs: usize,
    pub(in crate::pipeline::gpu) lz4_jobs: usize,
    pub(in crate::pipeline::gpu) pieces: usize,
    pub(in crate::pipeline::gpu) xxh3_outcomes: usize,
    pub(in crate::pipeline::gpu) lz4_outcomes: usize,
    pub(in crate::pipeline::gpu) gather_outcome: usize,
    pub(in crate::pipeline::gpu) regions: usize,
    pub(in crate::pipeline::gpu) bytes: usize,
}

impl HostLayout {
    pub(in crate::pipeline::gpu) fn new(jobs_max: usize, pieces_max: usize) -> HostLayout {
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let start = at;
            at = (at + bytes).div_ceil(64) * 64;
            start
        };
        let xxh3_jobs = take(jobs_max * XXH3_JOB_BYTES);
        let lz4_jobs = take(jobs_max * LZ4_JOB_BYTES);
        let pieces = take(pieces_max * GATHER_PIECE_BYTES);
        let xxh3_outcomes = take(jobs_max * XXH3_OUTCOME_BYTES);
        let lz4_outcomes = take(jobs_max * LZ4_OUTCOME_BYTES);
        let gather_outcome = take(GATHER_OUTCOME_BYTES);
        let regions = take(REGIONS_MAX * GATHER_REGION_BYTES);
        HostLayout {
            xxh3_jobs,
            lz4_jobs,
            pieces,
            xxh3_outcomes,
            lz4_outcomes,
            gather_outcome,
            regions,
            bytes: at,
        }
    }
}

/// The buffers of one round in flight.
pub(in crate::pipeline::gpu) struct RoundBuffers {
    pub(in crate::pipeline::gpu) staging: DeviceBuffer,
    pub(in crate::pipeline::gpu) lz4_jobs: DeviceBuffer,
    pub(in crate::pipeline::gpu) lz4_outcomes: DeviceBuffer,
    pub(in crate::pipeline::gpu) xxh3_jobs: DeviceBuffer,
    pub(in crate::pipeline::gpu) xxh3_outcomes: DeviceBuffer,
    pub(in crate::pipeline::gpu) pieces: DeviceBuffer,
    pub(in crate::pipeline::gpu) gather_outcome: DeviceBuffer,
    /// The gather's region table.
    pub(in crate::pipeline::gpu) regions: DeviceBuffer,
    /// Tables are written here and uploaded; outcomes are downloaded here (see [`HostLayout`]).
    pub(in crate::pipeline::gpu) host: PinnedBuffer,
    /// Recorded after the round's last work (outcome downloads included); sleeps when waited on.
    pub(in crate::pipeline::gpu) done: Event,
}

impl RoundBuffers {
    /// Allocates the buffers of a round on `device`.
    pub(in crate::pipeline::gpu) fn new(
        device: &Device,
        staging_bytes: usize,
        jobs_max: usize,
        pieces_max: usize,
        layout: &HostLayout,
    ) -> Result<RoundBuffers, DeviceError> {
        let new = |bytes: usize| DeviceBuffer::new(device, bytes);
        Ok(RoundBuffers {
            staging: new(staging_bytes)?,
            lz4_jobs: new(jobs_max * LZ4_JOB_BYTES)?,
            lz4_outcomes: new(jobs_max * LZ4_OUTCOME_BYTES)?,
            xxh3_jobs: new(jobs_max * XXH3_JOB_BYTES)?,
            xxh3_outcomes: new(jobs_max * XXH3_OUTCOME_BYTES)?,
            pieces: new(pieces_max * GATHER_PIECE_BYTES)?,
            gather_outcome: new(GATHER_OUTCOME_BYTES)?,
            regions: new(REGIONS_MAX * GATHER_REGION_BYTES)?,
            host: PinnedBuffer::new(device, layout.bytes)?,
            done: Event::new_blocking(device)?,
        })
    }

    pub(in crate::pipeline::gpu) fn device_bytes(&self) -> usize {
        self.staging.len()
            + self.lz4_jobs.len()
            + self.lz4_outcomes.len()
            + self.xxh3_jobs.len()
            + self.xxh3_outcomes.len()
            + self.pieces.len()
            + self.gather_outcome.len()
            + self.regions.len()
    }
}

/// What a set of round buffers was made for: staging bytes, jobs, pieces and host bytes.
pub(in crate::pipeline::gpu) type RoundShape = (usize, usize, usize, usize);

/// Round buffers kept between streams on one device, so that a stream opened after another
/// finished takes its round buffers (a few device allocations of tens of MiB and a pinned host
/// buffer each, 2 to 3 ms a set) from here instead of allocating them: the set-up shows in the
/// first batch of every stream. A stream hands its sets back when it closes, after its work on the
/// device is done; at most `sets_max` sets are kept (more are freed; sets of another shape, left by
/// another dataset's streams, give way to the current ones), and their device bytes are the
/// `gpufeed_round_buffers_idle_bytes` gauge.
pub struct RoundBufferPool {
    sets: std::sync::Mutex<Vec<(RoundShape, RoundBuffers)>>,
    sets_max: usize,
    /// The device's ordinal, for its per-device figures.
    ordinal: u32,
    /// Where the idle bytes are reported, once the daemon's metrics exist.
    metrics: std::sync::OnceLock<Arc<crate::metrics::Metrics>>,
}

impl RoundBufferPool {
    /// An empty pool of device `ordinal` keeping at most `sets_max` sets.
    pub fn new(sets_max: usize, ordinal: u32) -> RoundBufferPool {
        RoundBufferPool {
            sets: std::sync::Mutex::new(Vec::new()),
            sets_max,
            ordinal,
            metrics: std::sync::OnceLock::new(),
        }
    }

    /// Reports the pool's idle device bytes to `metrics` from now on (the first call wins).
    pub fn report_to(&self, metrics: &Arc<crate::metrics::Metrics>) {
        let sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        if self.metrics.set(Arc::clone(metrics)).is_ok() {
            let bytes: usize = sets.iter().map(|(_, b)| b.device_bytes()).sum();
            metrics.add_round_buffers_idle_bytes(self.ordinal, bytes as i64);
        }
    }

    fn count(&self, bytes: i64) {
        if let Some(metrics) = self.metrics.get() {
            metrics.add_round_buffers_idle_bytes(self.ordinal, bytes);
        }
    }

    /// A kept set of this shape, if any. When there is none, the sets of other shapes (another
    /// dataset's) are freed: the stream about to allocate its own needs the memory more.
    pub(in crate::pipeline::gpu) fn take(&self, shape: RoundShape) -> Option<RoundBuffers> {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        match sets.iter().position(|(s, _)| *s == shape) {
            Some(index) => {
                let (_, buffers) = sets.swap_remove(index);
                self.count(-(buffers.device_bytes() as i64));
                Some(buffers)
            }
            None => {
                let freed: usize = sets.drain(..).map(|(_, b)| b.device_bytes()).sum();
                self.count(-(freed as i64));
                None
            }
        }
    }

    /// Keeps `buffers` (whose queued work is done) for a later stream. When the pool is full, the
    /// oldest set of another shape makes room; if all are of this shape, `buffers` are freed.
    pub(in crate::pipeline::gpu) fn put(&self, shape: RoundShape, buffers: RoundBuffers) {
        let mut sets = self.sets.lock().unwrap_or_else(|e| e.into_inner());
        if sets.len() >= self.sets_max {
            let Some(other) = sets.iter().position(|(s, _)| *s != shape) else {
                return;
            };
            let (_, evicted) = sets.remove(other);
            self.count(-(evicted.device_bytes() as i64));
        }
        self.count(buffers.device_bytes() as i64);
        sets.push((shape, buffers));
    }
}

impl Drop for RoundBufferPool {
    fn drop(&mut self) {
        let bytes: usize = self
            .sets
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .map(|(_, b)| b.device_bytes())
            .sum();
        self.count(-(bytes as i64));
    }
}

/// A round queued on the device whose outcomes have not been read yet.
pub(in crate::pipeline::gpu) struct PendingRound {
    pub(in crate::pipeline::gpu) buffers: usize,
    /// The batches (stream steps) it belongs to: one, or a group of consecutive small batches.
    pub(in crate::pipeline::gpu) steps: Range<u64>,
    pub(in crate::pipeline::gpu) runs: Range<usize>,
    pub(in crate::pipeline::gpu) placements: Arc<PlacementRuns>,
    /// Blocks whose checksum the round verifies, with the checksum they must have.
    pub(in crate::pipeline::gpu) checks: Vec<(BlockKey, u64)>,
    /// For each check, the mapped window the block was verified in place in (the mark is shared
    /// by every stream of the device), if it was.
    pub(in crate::pipeline::gpu) check_windows: Vec<Option<WindowId>>,
    /// LZ4 blocks the round decodes, and their cache entries.
    pub(in crate::pipeline::gpu) decoded: Vec<(BlockKey, u32)>,
    /// Rows already zeroed because their blocks were known to be corrupt when the round was queued.
    pub(in crate::pipeline::gpu) replaced: Vec<usize>,
    /// [`super::cache::BlockCache::corrupt_marks`] when the round was planned: if it moved by
    /// completion, rows that used cached blocks found corrupt since are checked again.
    pub(in crate::pipeline::gpu) corrupt_marks: u64,
    /// Whether a gather ran (its outcome is to be checked).
    pub(in crate::pipeline::gpu) gathered: bool,
}

/// A batch submitted and not yet completed.
pub(in crate::pipeline::gpu) struct PendingBatch {
    pub(in crate::pipeline::gpu) step: u64,
    /// The slot's device address and length, for zeroing samples found corrupt at completion.
    pub(in crate::pipeline::gpu) slot_ptr: u64,
    pub(in crate::pipeline::gpu) slot_bytes: usize,
    pub(in crate::pipeline::gpu) samples: u32,
    pub(in crate::pipeline::gpu) replaced: u32,
    /// Rounds of this batch not completed yet.
    pub(in crate::pipeline::gpu) rounds_left: usize,
    /// Whether work was queued on the slot after its ready event was recorded.
    pub(in crate::pipeline::gpu) fixed_up: bool,
    /// Where the rows of the batch's variable-length fields go (empty without such fields), for
    /// zeroing them.
    pub(in crate::pipeline::gpu) variable:
        std::sync::Arc<Vec<Option<crate::pipeline::varlen::VariableRows>>>,
}

impl PendingBatch {
    /// A batch of `samples` rows for stream step `step`, about to be queued into `slot`.
    pub(in crate::pipeline::gpu) fn new(
        step: u64,
        slot: &DeviceRegion,
        samples: usize,
    ) -> PendingBatch {
        PendingBatch {
            step,
            slot_ptr: slot.device_ptr(),
            slot_bytes: slot.len(),
            samples: samples as u32,
            replaced: 0,
            rounds_left: 0,
            fixed_up: false,
            variable: std::sync::Arc::default(),
        }
    }
}

/// A range of device-addressable memory another owner keeps alive (a slot, a mapped window, part of a
/// table).
pub(in crate::pipeline::gpu) struct DeviceRange {
    pub(in crate::pipeline::gpu) ptr: u64,
    pub(in crate::pipeline::gpu) bytes: usize,
}

impl DeviceMemory for DeviceRange {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.bytes
    }
}

/// Copies `table` into a round's pinned buffer at `host_offset` and queues its upload to `device` on
/// `stream`.
pub(in crate::pipeline::gpu) fn upload_table(
    stream: &Stream,
    host: &mut PinnedBuffer,
    host_offset: usize,
    device: &DeviceBuffer,
    table: &[u8],
) -> Result<(), FillError> {
    host.as_mut_slice()[host_offset..host_offset + table.len()].copy_from_slice(table);
    // SAFETY: a round's pinned tables are written again only after the host waited for the round, and
    // its device tables are read only by its kernels, queued after the upload on the same stream.
    unsafe { host.upload_async(stream, host_offset, device, 0, table.len()) }?;
    Ok(())
}
