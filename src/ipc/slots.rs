//! A stream's ring of slots and the lease on each slot. The slots live in one sealed memfd in host
//! memory (the CPU backend) or one exportable device allocation, with two interprocess events per slot
//! (the GPU backend).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Mutex;

use gpufeed_proto::protocol::{slot_stride, SlotEvents};

use crate::device::{Device, DeviceError, Event, ExportableBuffer};
use crate::pipeline::{DeviceSlot, SlotMemory};

use memmap2::MmapRaw;

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

/// The host slots: one sealed memfd holding every slot, and the daemon's writable mapping of it (a raw
/// mapping: slots are written through its pointer, never through a reference to the whole ring).
struct HostSlots {
    file: File,
    map: MmapRaw,
}

enum Slots {
    Host(HostSlots),
    /// One exportable allocation holding every slot, and each slot's region of it and events. The
    /// regions are declared first so that they go before the allocation they point into.
    Device {
        slots: Vec<DeviceSlot>,
        memory: ExportableBuffer,
    },
}

/// A stream's slots and their leases.
///
/// All the slots of a ring live in one memory object (one memfd, or one exportable device
/// allocation), slot *i* at *i* × `slot_stride`: one descriptor for the consumer to map instead of one
/// per slot, and on a device one allocation rounded up to the allocation granularity (2 MiB on the
/// H100) instead of one per slot. Each device allocation, its access grant, its export and the
/// consumer's import cost tens of microseconds: a ring of 64 slots spent about 9 ms of every
/// stream's opening on them.
pub struct SlotRing {
    slots: Slots,
    leases: Mutex<Vec<Lease>>,
    count: u32,
    slot_bytes: usize,
    slot_stride: usize,
}

// SAFETY: the mappings are only written through `slot_mut`, whose contract (the Filling lease) gives
// one thread exclusive access to a slot, and slots do not overlap; the lease table is behind a mutex.
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

/// The stride and total bytes of `count` slots of `slot_bytes`, or an error naming the overflow.
fn ring_bytes(count: u32, slot_bytes: usize) -> std::io::Result<(usize, usize)> {
    let stride = usize::try_from(slot_stride(slot_bytes as u64)).ok();
    match stride.and_then(|stride| Some((stride, stride.checked_mul(count as usize)?))) {
        Some((stride, total)) if total > 0 => Ok((stride, total)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{count} slots of {slot_bytes} bytes do not fit in memory"),
        )),
    }
}

impl SlotRing {
    /// Creates `count` slots of `slot_bytes` each in one sealed memfd.
    ///
    /// The memfd is sealed against shrinking and growing so that a consumer holding the descriptor
    /// cannot truncate the memory under the daemon's mapping (which would crash the daemon with SIGBUS).
    pub fn new(count: u32, slot_bytes: usize) -> std::io::Result<SlotRing> {
        let (stride, total) = ring_bytes(count, slot_bytes)?;
        let file = super::sealed_memfd(c"gpufeed-slots", total as u64)?;
        let map = MmapRaw::map_raw(&file)?;
        Ok(SlotRing {
            slots: Slots::Host(HostSlots { file, map }),
            leases: Mutex::new(vec![Lease::Free; count as usize]),
            count,
            slot_bytes,
            slot_stride: stride,
        })
    }

    /// Creates `count` slots of `slot_bytes` each in one exportable allocation on `device`, with
    /// each slot's events.
    pub fn new_device(
        device: &Device,
        count: u32,
        slot_bytes: usize,
    ) -> Result<SlotRing, DeviceError> {
        let (stride, total) =
            ring_bytes(count, slot_bytes).map_err(|e| DeviceError::Unavailable {
                reason: e.to_string(),
            })?;
        let memory = ExportableBuffer::new(device, total)?;
        let mut slots = Vec::with_capacity(count as usize);
        for slot in 0..count as usize {
            slots.push(DeviceSlot {
                // SAFETY: the region is kept beside `memory` in the ring, dropped before it, and
                // the ring outlives the work its filler queues on the slots (the filler drains its
                // device work before the ring goes).
                memory: unsafe { memory.region(slot * stride, slot_bytes) }?,
                ready: Event::new_interprocess(device)?,
                released: Event::new_interprocess(device)?,
            });
        }
        Ok(SlotRing {
            slots: Slots::Device { slots, memory },
            leases: Mutex::new(vec![Lease::Free; count as usize]),
            count,
            slot_bytes,
            slot_stride: stride,
        })
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    /// True when the ring has no slots.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of each slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes from one slot's start to the next one's in the ring's memory.
    pub fn slot_stride(&self) -> usize {
        self.slot_stride
    }

    /// Bytes of memory the slots occupy (a device ring is rounded up to the allocation granularity).
    pub fn allocated_bytes(&self) -> u64 {
        match &self.slots {
            Slots::Host(host) => host.map.len() as u64,
            Slots::Device { memory, .. } => memory.mapped_bytes() as u64,
        }
    }

    /// The one descriptor of the slots' memory to pass to the consumer: a duplicate of the memfd, or
    /// an export of the device allocation.
    pub fn descriptor(&self) -> Result<OwnedFd, String> {
        match &self.slots {
            Slots::Host(host) => host
                .file
                .try_clone()
                .map(OwnedFd::from)
                .map_err(|e| format!("duplicating the slots' descriptor: {e}")),
            Slots::Device { memory, .. } => memory
                .export_fd()
                .map_err(|e| format!("exporting the device slots: {e}")),
        }
    }

    /// The interprocess event handles of device slots, in slot order; empty for host slots.
    pub fn slot_events(&self) -> Result<Vec<SlotEvents>, DeviceError> {
        match &self.slots {
            Slots::Host(_) => Ok(Vec::new()),
            Slots::Device { slots, .. } => slots
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
            Slots::Device { slots, .. } => &slots[slot as usize],
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
        let Slots::Host(host) = &self.slots else {
            panic!("slot_mut on a device slot ring");
        };
        assert!(slot < self.count, "slot {slot} is not in the ring");
        // In bounds: the mapping holds `count` slots `slot_stride` apart, each `slot_bytes` long.
        let start = slot as usize * self.slot_stride;
        // SAFETY: exclusive by the caller's lease, and slots do not overlap; in bounds (above); the
        // mapping lives as long as `self`, and no reference to the rest of it is made.
        unsafe { std::slice::from_raw_parts_mut(host.map.as_mut_ptr().add(start), self.slot_bytes) }
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
