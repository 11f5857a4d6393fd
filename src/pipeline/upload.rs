//! Device slots filled on the host: a mixture stream on a CUDA device, and a device stream of a
//! dataset in object storage whose shards are not all in the node's cache yet.
//!
//! The GPU assembler plans its rounds over one dataset's shards, and its device order computes
//! rows from one dataset's order, so it cannot build a batch whose rows come from several
//! datasets; and it opens every shard file when the stream opens, so it cannot start before a
//! dataset in object storage is fetched whole. Such a stream on a device is instead assembled by
//! the CPU backend's assembler (the same [`HostAssembler`] a host stream of it uses: the same
//! order, the same rows, the same corrupt-block handling, byte for byte, the same shard gate) into
//! a pinned host buffer, then uploaded into the device slot with one copy on a stream of its own,
//! which first waits for the consumer's release of the slot and then records the slot's `ready`
//! event. The consumer sees a device batch like any other.
//!
//! Two pinned buffers are used in turn, so that the next batch is assembled while the last one
//! is uploaded. The rate is the CPU assembler's (one thread per stream, converting and decoding
//! LZ4 blocks on the host), not the GPU pipeline's: 1.1–1.6 GB/s of fp16 rows converted to fp32
//! on the H200 test host (`docs/benchmarks/mixture-2026-11-28.md`). It suits mixtures read at
//! that rate and a first epoch bound by the object store, not a stream that must run at the link.

use std::collections::VecDeque;

use super::cpu::HostAssembler;
use super::stream_plan::{FillError, FillReport, StreamPlan};
use crate::device::{Device, DeviceError, DeviceRegion, Event, EventTiming, PinnedBuffer, Stream};

/// Whether a stream on a CUDA device is assembled on the host and uploaded: a mixture, or a
/// dataset whose shards arrive while the stream runs (object storage, not all in the node's
/// cache: its plan has a shard gate, which only the host assembler follows).
pub fn assembled_on_host(plan: &StreamPlan) -> bool {
    plan.mixture.is_some() || plan.shard_gate.is_some()
}

/// Pinned buffers a stream assembles into and uploads from, in turn.
pub const UPLOAD_BUFFERS: usize = 2;

/// Host memory a host-assembled device stream holds besides its slots: its pinned buffers.
pub fn upload_bytes(slot_bytes: usize) -> u64 {
    (UPLOAD_BUFFERS * slot_bytes) as u64
}

/// One pinned buffer, the event recorded after its last upload, and whether one was queued.
struct Staging {
    buffer: PinnedBuffer,
    uploaded: Event,
    in_flight: bool,
}

/// A stream whose device slots are filled on the host (see the module documentation).
pub struct HostUpload {
    assembler: Box<HostAssembler>,
    stream: Stream,
    staging: Vec<Staging>,
    next: usize,
    slot_bytes: usize,
    /// Filled slots, oldest first: their uploads are queued before their `ready` events.
    done: VecDeque<(u32, u64, FillReport)>,
    /// Seconds assembling on the host and waiting for a buffer's upload to finish, for the log.
    fill_s: f64,
    wait_s: f64,
}

impl HostUpload {
    /// Sets up the pinned buffers and the upload stream of a stream of `slot_bytes` slots on
    /// `device`, filled by `assembler`.
    pub fn new(
        assembler: HostAssembler,
        device: &Device,
        slot_bytes: usize,
    ) -> Result<HostUpload, DeviceError> {
        let stream = Stream::new(device)?;
        let staging = (0..UPLOAD_BUFFERS)
            .map(|_| {
                Ok(Staging {
                    buffer: PinnedBuffer::new(device, slot_bytes)?,
                    uploaded: Event::new(device, EventTiming::Disabled)?,
                    in_flight: false,
                })
            })
            .collect::<Result<Vec<_>, DeviceError>>()?;
        Ok(HostUpload {
            assembler: Box::new(assembler),
            stream,
            staging,
            next: 0,
            slot_bytes,
            done: VecDeque::new(),
            fill_s: 0.0,
            wait_s: 0.0,
        })
    }

    /// Assembles stream step `step` on the host and queues its upload into slot `index` (its
    /// memory `slot`), after the consumer's release of it (`released`) and before its `ready`
    /// event.
    pub fn submit(
        &mut self,
        (index, step): (u32, u64),
        slot: &DeviceRegion,
        released: &Event,
        ready: &Event,
    ) -> Result<(), FillError> {
        let staging = &mut self.staging[self.next];
        self.next = (self.next + 1) % UPLOAD_BUFFERS;
        if staging.in_flight {
            let waiting = std::time::Instant::now();
            staging.uploaded.synchronize()?;
            staging.in_flight = false;
            self.wait_s += waiting.elapsed().as_secs_f64();
        }
        let filling = std::time::Instant::now();
        let report = self
            .assembler
            .fill(step, &mut staging.buffer.as_mut_slice()[..self.slot_bytes])?;
        self.fill_s += filling.elapsed().as_secs_f64();
        self.stream.wait(released)?;
        // SAFETY: the buffer is not written again before `uploaded` completes (waited for above
        // when it comes round again, and in `Drop`); the slot's region is the filler's until its
        // `ready` event, recorded after the copy on the same stream, and the copy waited for the
        // consumer's release of it.
        unsafe {
            staging
                .buffer
                .upload_async(&self.stream, 0, slot, 0, self.slot_bytes)?
        };
        staging.uploaded.record(&self.stream)?;
        staging.in_flight = true;
        ready.record(&self.stream)?;
        self.done.push_back((index, step, report));
        Ok(())
    }

    /// The oldest submitted batch: its slot, step and report (its upload is queued before its
    /// `ready` event, which the consumer waits on).
    pub fn complete(&mut self) -> Option<(u32, u64, FillReport)> {
        self.done.pop_front()
    }

    /// Batches submitted and not yet taken by [`Self::complete`].
    pub fn pending(&self) -> usize {
        self.done.len()
    }

    /// Seconds spent assembling on the host, and waiting for an upload before reusing its buffer.
    pub fn times(&self) -> (f64, f64) {
        (self.fill_s, self.wait_s)
    }

    /// Why io_uring is not used by the host assembler, when it is not.
    pub fn engine_note(&self) -> Option<&str> {
        self.assembler.engine_note()
    }
}

impl Drop for HostUpload {
    fn drop(&mut self) {
        // The pinned buffers go with this value: no upload from them may still be running.
        let _ = self.stream.synchronize();
    }
}
