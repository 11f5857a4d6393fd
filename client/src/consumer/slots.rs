//! The memory of a stream's slots and the write half of its session, shared by the stream and
//! its batches: a batch stays readable, and releases its slot, after the stream is dropped.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use memmap2::Mmap;

use super::ring::ConsumerRing;

use crate::protocol::{Message, StreamLayout};
use crate::transport::{self, TransportError};

/// The mapped slots of a stream; shared by the stream and its batches so that a batch stays readable
/// after the stream is dropped.
#[derive(Debug)]
pub(super) struct SlotMemory {
    pub(super) layout: StreamLayout,
    pub(super) slots: Slots,
    /// The consumer's CUDA stream (a `CUstream`; 0 is the legacy default stream): batches are made
    /// ready on it and released from it.
    pub(super) cuda_stream: AtomicU64,
}

#[derive(Debug)]
pub(super) enum Slots {
    Host(HostSlots),
    Device(crate::cuda::DeviceSlots),
}

/// The host slots: one read-only mapping of the memory that holds them all, slot *i* at *i* ×
/// `stride`.
#[derive(Debug)]
pub(super) struct HostSlots {
    pub(super) map: Mmap,
    pub(super) stride: usize,
    pub(super) slot_bytes: usize,
}

impl HostSlots {
    /// The bytes of `slot` (checked against the layout when the batch was accepted).
    pub(super) fn slot(&self, slot: u32) -> &[u8] {
        let start = slot as usize * self.stride;
        &self.map[start..start + self.slot_bytes]
    }
}

impl SlotMemory {
    pub(super) fn cuda_stream(&self) -> crate::cuda::RawStream {
        self.cuda_stream.load(Ordering::SeqCst) as usize as crate::cuda::RawStream
    }
}

/// The write half of the session and the hand-off ring, shared by the stream and its batches.
#[derive(Debug)]
pub(super) struct Outbox {
    pub(super) inner: Mutex<OutboxInner>,
    pub(super) ring: ConsumerRing,
}

#[derive(Debug)]
pub(super) struct OutboxInner {
    pub(super) socket: UnixStream,
    /// Bit `s` is set while slot `s` belongs to the client: from the `Batch` frame's arrival until the
    /// `Batch` is dropped.
    pub(super) held_slots: u64,
    /// Releases published in the ring so far.
    pub(super) releases_published: u64,
}

impl Outbox {
    pub(super) fn lock(&self) -> MutexGuard<'_, OutboxInner> {
        // A panic while holding the lock cannot leave the mask or the socket half-updated in a way
        // that matters more than the panic itself; keep going.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn send(&self, message: &Message) -> Result<(), TransportError> {
        transport::send(&self.lock().socket, message, &[])
    }

    /// Marks `slot` as the client's; false if it already was.
    pub(super) fn take_slot(&self, slot: u32) -> bool {
        let mut inner = self.lock();
        let bit = 1u64 << slot;
        let free = inner.held_slots & bit == 0;
        inner.held_slots |= bit;
        free
    }

    /// Hands `slot` back through the ring, ringing the daemon's doorbell only if it sleeps. After the
    /// session ended this does no harm: the daemon reclaims every slot when the connection ends.
    pub(super) fn release(&self, slot: u32) {
        let mut inner = self.lock();
        inner.held_slots &= !(1u64 << slot);
        let index = inner.releases_published;
        inner.releases_published += 1;
        if self.ring.view.publish_release(index, slot) {
            self.ring.daemon_bell.ring();
        }
    }
}

impl Drop for Outbox {
    /// The stream and all its batches are gone: end the session.
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        let _ = transport::send(&inner.socket, &Message::Close, &[]);
    }
}
