//! A stream's hand-off ring as the daemon owns it: the sealed memfd, the daemon's mapping of it, and
//! the two doorbells (layout and rules in `gpufeed_proto::ring`, `docs/PROTOCOL.md`).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;

use gpufeed_proto::ring::{ring_bytes, Doorbell, RingView};
use memmap2::MmapMut;

/// Bytes of a page; the ring's memfd is a whole number of them.
const PAGE_BYTES: usize = 4096;

/// The ring's memory and doorbells. Dropped once the stream's filler has stopped.
pub struct HandoffRing {
    file: File,
    // Keeps the mapping alive for `view`; never touched directly.
    _map: MmapMut,
    /// The ring's words.
    pub view: RingView,
    /// Rung by the daemon when it publishes a batch while the consumer sleeps.
    pub consumer_bell: Doorbell,
    /// Rung by the consumer when it publishes a release while the daemon sleeps, and by the session
    /// thread to wake the filler when the stream stops.
    pub daemon_bell: Doorbell,
}

impl HandoffRing {
    /// A fresh ring for `slot_count` slots in a new memfd, sealed against resizing (a consumer that
    /// truncated it would crash the daemon's reads with SIGBUS).
    pub fn new(slot_count: u32) -> std::io::Result<HandoffRing> {
        let bytes = ring_bytes(slot_count).div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let file = super::sealed_memfd(c"gpufeed-ring", bytes as u64)?;
        // SAFETY: the memfd is ours and sealed against resizing; the mapping lives as long as the
        // ring, and the view (the only user of the mapping) does not outlive it.
        let mut map = unsafe { MmapMut::map_mut(&file)? };
        let base = NonNull::new(map.as_mut_ptr()).expect("a mapping is never at address 0");
        // SAFETY: a page-aligned mapping of at least `ring_bytes(slot_count)` bytes, kept alive in
        // `_map` for as long as the view, and only accessed through the view's atomics.
        let view = unsafe { RingView::init(base, slot_count) };
        Ok(HandoffRing {
            file,
            _map: map,
            view,
            consumer_bell: Doorbell::new()?,
            daemon_bell: Doorbell::new()?,
        })
    }

    /// New descriptors for the consumer, in the order of `StreamOpened`: the ring's memfd, the
    /// consumer's doorbell, the daemon's doorbell.
    pub fn descriptors(&self) -> std::io::Result<[OwnedFd; 3]> {
        Ok([
            self.file.as_fd().try_clone_to_owned()?,
            self.consumer_bell.as_fd().try_clone_to_owned()?,
            self.daemon_bell.as_fd().try_clone_to_owned()?,
        ])
    }
}
