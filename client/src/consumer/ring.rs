//! The consumer's end of a stream's hand-off ring (layout and rules in `gpufeed_proto::ring`,
//! `docs/PROTOCOL.md`): the daemon publishes filled slots there, the consumer publishes releases.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use gpufeed_proto::ring::{Doorbell, RingView};
use memmap2::{MmapMut, MmapOptions};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use std::fs::File;

use super::error::ClientError;

/// The mapped ring and its doorbells.
#[derive(Debug)]
pub(super) struct ConsumerRing {
    // Keeps the mapping alive for `view`; never touched directly.
    _map: MmapMut,
    pub(super) view: RingView,
    /// The daemon rings it when it publishes a batch while this consumer sleeps.
    pub(super) consumer_bell: Doorbell,
    /// This consumer rings it when it publishes a release while the daemon sleeps.
    pub(super) daemon_bell: Doorbell,
}

impl ConsumerRing {
    /// Maps the ring's memfd (checked: a memory file sealed against shrinking, holding a ring header
    /// for `slot_count` slots) and takes the two doorbells, in `StreamOpened` order.
    pub(super) fn map(
        [memory, consumer_bell, daemon_bell]: [OwnedFd; 3],
        slot_count: u32,
    ) -> Result<ConsumerRing, ClientError> {
        let file = File::from(memory);
        let metadata = file.metadata()?;
        if !metadata.file_type().is_file() {
            return Err(ClientError::Protocol(
                "the hand-off ring's descriptor is not a memory file".to_string(),
            ));
        }
        let seals = fcntl(&file, FcntlArg::F_GET_SEALS).map_err(std::io::Error::from)?;
        if !SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
            return Err(ClientError::Protocol(
                "the hand-off ring is not sealed against shrinking (F_SEAL_SHRINK)".to_string(),
            ));
        }
        let bytes = usize::try_from(metadata.len())
            .ok()
            .filter(|&bytes| bytes <= 1 << 20)
            .ok_or_else(|| {
                ClientError::Protocol(format!(
                    "the hand-off ring is {} bytes (at most 1 MiB)",
                    metadata.len()
                ))
            })?;
        // SAFETY: a shared mapping of a memory file sealed against shrinking, so every page stays
        // backed; it is only accessed through the ring view's atomics, and outlives the view.
        let mut map = unsafe { MmapOptions::new().len(bytes).map_mut(&file) }.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("mapping the hand-off ring ({bytes} bytes): {e}"),
            )
        })?;
        let base = NonNull::new(map.as_mut_ptr()).expect("a mapping is never at address 0");
        // SAFETY: page-aligned, `bytes` long, kept alive in `_map` as long as the view.
        let view = unsafe { RingView::attach(base, bytes) }
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        if view.slot_count() != slot_count {
            return Err(ClientError::Protocol(format!(
                "the hand-off ring has {} slots, the layout {slot_count}",
                view.slot_count()
            )));
        }
        Ok(ConsumerRing {
            _map: map,
            view,
            consumer_bell: Doorbell::from_fd(consumer_bell)?,
            daemon_bell: Doorbell::from_fd(daemon_bell)?,
        })
    }
}
