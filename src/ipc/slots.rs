//! A stream's ring of slots and the lease on each slot. Slots are sealed memfds in host memory (the
//! CPU backend) or exportable device allocations with two interprocess events each (the GPU backend).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Mutex;

use gpufeed_proto::protocol::SlotEvents;

use crate::device::{Device, DeviceError, Event, ExportableBuffer};
use crate::pipeline::{DeviceSlot, SlotMemory};

use memmap2::MmapMut;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};

/// Who holds a slot. A slot belongs to exactly one side at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lease {
    /// Free, waiting for the filler.
    Free,
    /// The daemon is writing it.
    Filling,
    /// Handed to the consumer; only its release makes it free again.
    Consumer,
}

/// One host slot: a sealed memfd and the daemon's writable mapping of it.
struct HostSlot {
    file: File,
    map: MmapMut,
}

enum Slots {
    Host(Vec<HostSlot>),
    Device(Vec<DeviceSlot>),
}

/// A stream's slots and their leases.
pub struct SlotRing {
    slots: Slots,
    leases: Mutex<Vec<Lease>>,
    slot_bytes: usize,
}

// SAFETY: the mappings are only written through `slot_mut`, whose contract (the Filling lease) gives
// one thread exclusive access to a slot; the lease table is behind a mutex.
unsafe impl Sync for SlotRing {}

/// A lease transition that the protocol does not allow (a consumer releasing a slot it does not hold).
#[derive(Debug, thiserror::Error)]
#[error("slot {slot} {}, so the consumer cannot release it", describe(*.state))]
pub struct LeaseError {
    /// The slot.
    pub slot: u32,
    /// Its actual state.
    pub state: Option<Lease>,
}

/// A slot's state in words, for consumers reading the error.
fn describe(state: Option<Lease>) -> &'static str {
    match state {
        None => "does not exist in this stream",
        Some(Lease::Free) => "is free (not handed to the consumer, or released already)",
        Some(Lease::Filling) => "is being filled by the daemon (not handed to the consumer yet)",
        Some(Lease::Consumer) => "is held by the consumer",
    }
}

impl SlotRing {
    /// Creates `count` slots of `slot_bytes` each as sealed memfds.
    ///
    /// The memfds are sealed against shrinking and growing so that a consumer holding the descriptor
    /// cannot truncate the memory under the daemon's mapping (which would crash the daemon with SIGBUS).
    pub fn new(count: u32, slot_bytes: usize) -> std::io::Result<SlotRing> {
        let mut slots = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let fd = memfd_create(
                c"gpufeed-slot",
                MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
            )
            .map_err(std::io::Error::from)?;
            let file = File::from(fd);
            file.set_len(slot_bytes as u64)?;
            fcntl(
                &file,
                FcntlArg::F_ADD_SEALS(
                    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
                ),
            )
            .map_err(std::io::Error::from)?;
            // SAFETY: the memfd is ours, sealed against resizing, and lives as long as the mapping.
            let map = unsafe { MmapMut::map_mut(&file)? };
            slots.push(HostSlot { file, map });
        }
        Ok(SlotRing {
            slots: Slots::Host(slots),
            leases: Mutex::new(vec![Lease::Free; count as usize]),
            slot_bytes,
        })
    }

    /// Creates `count` exportable slots of `slot_bytes` each on `device`, with their events.
    pub fn new_device(
        device: &Device,
        count: u32,
        slot_bytes: usize,
    ) -> Result<SlotRing, DeviceError> {
        let mut slots = Vec::with_capacity(count as usize);
        for _ in 0..count {
            slots.push(DeviceSlot {
                buffer: ExportableBuffer::new(device, slot_bytes)?,
                ready: Event::new_interprocess(device)?,
                released: Event::new_interprocess(device)?,
            });
        }
        Ok(SlotRing {
            slots: Slots::Device(slots),
            leases: Mutex::new(vec![Lease::Free; count as usize]),
            slot_bytes,
        })
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        match &self.slots {
            Slots::Host(slots) => slots.len(),
            Slots::Device(slots) => slots.len(),
        }
    }

    /// True when the ring has no slots.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of each slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes of memory the slots occupy (device slots are rounded up to the allocation granularity).
    pub fn allocated_bytes(&self) -> u64 {
        match &self.slots {
            Slots::Host(slots) => (slots.len() * self.slot_bytes) as u64,
            Slots::Device(slots) => slots.iter().map(|s| s.buffer.mapped_bytes() as u64).sum(),
        }
    }

    /// New descriptors to pass to the consumer, in slot order: duplicates of the memfds, or exports
    /// of the device allocations.
    pub fn descriptors(&self) -> Result<Vec<OwnedFd>, String> {
        match &self.slots {
            Slots::Host(slots) => slots
                .iter()
                .map(|s| s.file.try_clone().map(OwnedFd::from))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("duplicating a slot descriptor: {e}")),
            Slots::Device(slots) => slots
                .iter()
                .map(|s| s.buffer.export_fd())
                .collect::<Result<_, _>>()
                .map_err(|e| format!("exporting a device slot: {e}")),
        }
    }

    /// The interprocess event handles of device slots, in slot order; empty for host slots.
    pub fn slot_events(&self) -> Result<Vec<SlotEvents>, DeviceError> {
        match &self.slots {
            Slots::Host(_) => Ok(Vec::new()),
            Slots::Device(slots) => slots
                .iter()
                .map(|s| {
                    Ok(SlotEvents {
                        ready: s.ready.ipc_handle()?,
                        released: s.released.ipc_handle()?,
                    })
                })
                .collect(),
        }
    }

    /// A device slot. Panics on a host ring.
    pub fn device_slot(&self, slot: u32) -> &DeviceSlot {
        match &self.slots {
            Slots::Device(slots) => &slots[slot as usize],
            Slots::Host(_) => panic!("device_slot on a host slot ring"),
        }
    }

    /// Moves `slot` from `from` to `to`.
    pub fn transition(&self, slot: u32, from: Lease, to: Lease) -> Result<(), LeaseError> {
        let mut leases = self.leases.lock().expect("lease lock poisoned");
        match leases.get_mut(slot as usize) {
            Some(state) if *state == from => {
                *state = to;
                Ok(())
            }
            other => Err(LeaseError {
                slot,
                state: other.copied(),
            }),
        }
    }

    /// Number of slots in each state, for status.
    pub fn lease_counts(&self) -> (usize, usize, usize) {
        let leases = self.leases.lock().expect("lease lock poisoned");
        let count = |l| leases.iter().filter(|&&s| s == l).count();
        (
            count(Lease::Free),
            count(Lease::Filling),
            count(Lease::Consumer),
        )
    }

    /// The memory of `slot`, for writing.
    ///
    /// # Safety
    /// The caller holds the slot's `Filling` lease, and nobody else calls this for the same slot until
    /// the lease moves on: that makes this the only live reference to the slot's memory in this process.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, slot: u32) -> &mut [u8] {
        let Slots::Host(slots) = &self.slots else {
            panic!("slot_mut on a device slot ring");
        };
        let map = &slots[slot as usize].map;
        // SAFETY: exclusive by the caller's lease; the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(map.as_ptr() as *mut u8, map.len()) }
    }
}

impl SlotMemory for SlotRing {
    unsafe fn host_slot(&self, slot: u32) -> &mut [u8] {
        // SAFETY: the caller holds the slot's filling lease, as `slot_mut` requires.
        unsafe { self.slot_mut(slot) }
    }

    fn device_slot(&self, slot: u32) -> &DeviceSlot {
        SlotRing::device_slot(self, slot)
    }
}

#[cfg(test)]
mod tests {
    use super::{Lease, LeaseError};

    #[test]
    fn lease_errors_speak_of_the_slot_in_words() {
        let cases = [
            (None, "slot 6 does not exist in this stream"),
            (
                Some(Lease::Free),
                "slot 6 is free (not handed to the consumer",
            ),
            (Some(Lease::Filling), "slot 6 is being filled by the daemon"),
            (Some(Lease::Consumer), "slot 6 is held by the consumer"),
        ];
        for (state, expected) in cases {
            let text = LeaseError { slot: 6, state }.to_string();
            assert!(text.starts_with(expected), "{text}");
            assert!(
                text.ends_with("so the consumer cannot release it"),
                "{text}"
            );
            assert!(!text.contains("Some(") && !text.contains("None"), "{text}");
        }
    }
}
