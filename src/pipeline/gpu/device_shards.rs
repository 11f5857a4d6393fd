//! Shards copied whole into device memory ahead of the rows that read them, for resident streams in
//! dataset order or a window shuffle.
//!
//! A resident stream's gather kernel reads each row over PCIe from registered page-cache memory
//! (zero-copy). That costs the same in every order, but loads issued by the kernel reach less of the
//! link than the copy engines do with large copies. When the order says which shards the next
//! batches draw from (the rest of the dataset in order; the window's shards, then the next window's,
//! in a window shuffle), each of those shards is copied whole, window by window, by the copy engines
//! on a stream of its own into a slot of device memory, and the rows of later rounds read it there:
//! every stored byte crosses the link once per epoch, in large copies, ahead of need.
//!
//! A round only reads a shard's device copy once the copy is known to be complete (its event has
//! completed when the round is planned), so the compute stream never waits for a copy: a shard not
//! yet on the device is read in place as before. A slot is overwritten only after the copy stream
//! has waited for the last round that could read it. A full shuffle draws from every shard in every
//! batch and does not use the slots.

use std::ops::Range;

use crate::device::{Device, DeviceBuffer, DeviceError, DeviceMemory, Event, EventTiming, Stream};
use crate::kernels::GatherRegion;
use crate::pipeline::order::EpochOrder;

/// One slot of device memory holding (or receiving) a copy of one shard.
struct ShardSlot {
    buffer: DeviceBuffer,
    /// The shard it holds or receives.
    shard: Option<usize>,
    /// Recorded on the copy stream after the shard's last window was copied.
    copied: Event,
    /// Known complete: rounds may read the copy.
    ready: bool,
    /// Recorded on the compute stream after each round whose region table names this slot.
    last_read: Event,
    /// Whether `last_read` was recorded since the slot was last filled.
    read: bool,
}

/// Where a shard's bytes are in host memory: one registered window after another.
#[derive(Clone, Debug)]
pub(super) struct ShardWindows {
    /// (host address, bytes) of each window, in file order; windows after the first start at
    /// multiples of the window size.
    pub(super) windows: Vec<(usize, u64)>,
    /// Index of the shard's first window in the stream's region table.
    pub(super) first_region: usize,
}

/// The device copies of a resident stream's shards.
pub(super) struct DeviceShards {
    copy_stream: Stream,
    slots: Vec<ShardSlot>,
    /// Per shard, the slot holding or receiving it.
    holder: Vec<Option<usize>>,
    shards: Vec<ShardWindows>,
    /// First sample of each shard, and the sample count after the last: maps samples to shards.
    shard_first_samples: Vec<u64>,
    window_bytes: u64,
    /// Bytes copied to the device, for the read counters.
    pub(super) copied_bytes: u64,
}

impl DeviceShards {
    /// Slots for `slot_count` shards of at most `shard_bytes_max` bytes each, if `order` draws from a
    /// few shards at a time and the device has the memory; `None` otherwise (the stream reads in
    /// place only).
    pub(super) fn new(
        device: &Device,
        order: &EpochOrder,
        shards: Vec<ShardWindows>,
        shard_first_samples: Vec<u64>,
        window_bytes: u64,
        device_bytes_max: u64,
    ) -> Result<Option<DeviceShards>, DeviceError> {
        if order.samples_ahead(0, 1).is_none() || shards.len() < 2 {
            return Ok(None);
        }
        let shard_bytes_max = shards
            .iter()
            .map(|s| s.windows.iter().map(|&(_, bytes)| bytes).sum::<u64>())
            .max()
            .unwrap_or(0);
        if shard_bytes_max == 0 {
            return Ok(None);
        }
        let slot_count = ((device_bytes_max / shard_bytes_max) as usize).min(shards.len());
        if slot_count < 2 {
            return Ok(None);
        }
        let mut slots = Vec::with_capacity(slot_count);
        for _ in 0..slot_count {
            let buffer = match DeviceBuffer::new(device, shard_bytes_max as usize) {
                Ok(buffer) => buffer,
                // Less device memory than the budget: as many slots as fit, or none.
                Err(DeviceError::Driver(error)) if error.is_out_of_memory() => break,
                Err(error) => return Err(error),
            };
            slots.push(ShardSlot {
                buffer,
                shard: None,
                copied: Event::new(device, EventTiming::Disabled)?,
                ready: false,
                last_read: Event::new(device, EventTiming::Disabled)?,
                read: false,
            });
        }
        if slots.len() < 2 {
            return Ok(None);
        }
        tracing::info!(
            "stream copies shards ahead into {} device slots of {} MiB",
            slots.len(),
            shard_bytes_max >> 20
        );
        Ok(Some(DeviceShards {
            copy_stream: Stream::new(device)?,
            holder: vec![None; shards.len()],
            slots,
            shards,
            shard_first_samples,
            window_bytes,
            copied_bytes: 0,
        }))
    }

    /// The shards positions from `position` on draw from, soonest first, at most one per slot.
    fn wanted(&self, order: &EpochOrder, position: u64) -> Vec<usize> {
        let max = self.slots.len();
        let Some(ranges) = order.samples_ahead(position, max) else {
            return Vec::new();
        };
        let mut wanted: Vec<usize> = Vec::with_capacity(max);
        for range in ranges {
            for shard in self.shards_of(range) {
                if !wanted.contains(&shard) {
                    wanted.push(shard);
                }
                if wanted.len() == max {
                    return wanted;
                }
            }
        }
        wanted
    }

    /// The shards holding samples `range`, in order.
    fn shards_of(&self, range: Range<u64>) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        let starts = &self.shard_first_samples;
        let first = starts.partition_point(|&s| s <= range.start) - 1;
        let last = starts.partition_point(|&s| s < range.end) - 1;
        first..(last + 1).min(self.shards.len())
    }

    /// Queues copies of the shards the stream reads next, from `position` on, into free slots or
    /// slots holding shards not wanted soon, and notes which copies have completed.
    pub(super) fn read_ahead(
        &mut self,
        order: &EpochOrder,
        position: u64,
    ) -> Result<(), DeviceError> {
        for slot in self
            .slots
            .iter_mut()
            .filter(|s| s.shard.is_some() && !s.ready)
        {
            slot.ready = slot.copied.is_complete()?;
        }
        let wanted = self.wanted(order, position);
        for &shard in &wanted {
            if self.holder[shard].is_some() {
                continue;
            }
            let Some(victim) = self.slots.iter().position(|slot| match slot.shard {
                None => true,
                Some(held) => !wanted.contains(&held),
            }) else {
                break;
            };
            self.fill(victim, shard)?;
        }
        Ok(())
    }

    /// Queues the copy of `shard` into slot `index`, after the last round that could read the slot.
    fn fill(&mut self, index: usize, shard: usize) -> Result<(), DeviceError> {
        let slot = &mut self.slots[index];
        if let Some(previous) = slot.shard.take() {
            self.holder[previous] = None;
        }
        if slot.read {
            self.copy_stream.wait(&slot.last_read)?;
            slot.read = false;
        }
        let mut at = 0u64;
        for &(host_addr, bytes) in &self.shards[shard].windows {
            // SAFETY: the source is a window of registered page-cache memory that the stream keeps
            // pinned (mapped and registered) until `DeviceShards::synchronize` has returned; the
            // destination lies within the slot (it holds the largest shard), which no round reads
            // until the copy is known complete, and which the copy stream wrote only after the last
            // round that read it.
            unsafe {
                crate::device::ffi::memcpy_htod_async(
                    slot.buffer.device_ptr() + at,
                    host_addr as *const u8,
                    bytes as usize,
                    self.copy_stream.raw(),
                )
            }?;
            at += bytes;
        }
        slot.copied.record(&self.copy_stream)?;
        slot.ready = false;
        slot.shard = Some(shard);
        self.holder[shard] = Some(index);
        self.copied_bytes += at;
        Ok(())
    }

    /// Points the regions of the shards whose device copy is complete at that copy, in `table` (the
    /// stream's table of registered windows); returns whether any region changed.
    pub(super) fn redirect(&self, table: &mut [GatherRegion]) -> bool {
        let mut changed = false;
        for slot in self.slots.iter().filter(|s| s.ready) {
            let shard = &self.shards[slot.shard.expect("a ready slot holds a shard")];
            let mut at = 0u64;
            for (window, &(_, bytes)) in shard.windows.iter().enumerate() {
                table[shard.first_region + window] = GatherRegion {
                    ptr: slot.buffer.device_ptr() + at,
                    bytes: table[shard.first_region + window].bytes,
                };
                debug_assert!(at == window as u64 * self.window_bytes);
                at += bytes;
            }
            changed = true;
        }
        changed
    }

    /// Records, on the compute stream, that a round reading the ready slots was queued there.
    pub(super) fn record_reads(&mut self, compute: &Stream) -> Result<(), DeviceError> {
        for slot in self.slots.iter_mut().filter(|s| s.ready) {
            slot.last_read.record(compute)?;
            slot.read = true;
        }
        Ok(())
    }

    /// Waits for every queued copy: before the windows they read are unpinned, and before the slots
    /// are freed.
    pub(super) fn synchronize(&self) -> Result<(), DeviceError> {
        self.copy_stream.synchronize()
    }

    /// Device memory held by the slots.
    pub(super) fn device_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.buffer.len()).sum()
    }
}

impl Drop for DeviceShards {
    fn drop(&mut self) {
        let _ = self.copy_stream.synchronize();
    }
}
