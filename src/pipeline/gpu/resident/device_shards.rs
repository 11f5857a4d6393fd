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
//! Within the registration budget every window stays registered for the stream's life: a round
//! reads a window of a shard from its device copy once that window's copy is queued (the compute
//! stream waits for the event recorded after that window's copy, so the first batch of a stream in
//! dataset order waits for one window, not a whole shard; reading in place while the copy runs would
//! share the link with it), and reads a shard in no slot in place. Beyond the budget (a "streamed" stream) nothing stays
//! registered: a loader thread copies each shard through windows registered for the time of their
//! copies (see `shard_loader`), and rows are read only from device copies: before a round, every
//! shard it reads is in a slot, and the compute stream waits for its copy. A slot is overwritten
//! only after the copy stream has waited for the last round that could read it. A full shuffle
//! draws from every shard in every batch and does not use the slots.

use std::ops::Range;
use std::sync::Arc;

use super::shard_checks::ShardChecks;
use super::shard_loader::{LoadJob, ShardLoader};
use crate::device::{Device, DeviceBuffer, DeviceError, DeviceMemory, Event, EventTiming, Stream};
use crate::kernels::GatherRegion;
use crate::pipeline::gpu::shard_pool::ShardSlotPool;
use crate::pipeline::order::{EpochOrder, ShuffleKind};
use crate::pipeline::stream_plan::FillError;

/// One slot of device memory holding (or receiving) a copy of one shard.
struct ShardSlot {
    buffer: DeviceBuffer,
    /// The shard it holds or receives.
    shard: Option<usize>,
    /// Recorded on the copy stream after the shard's last window was copied.
    copied: Arc<Event>,
    /// Registered source: recorded on the copy stream after each window of the shard was copied,
    /// so that a round waits only for the windows it reads (the first batch of a stream in dataset
    /// order waits for one window's copy, not the whole shard's).
    window_copied: Vec<Event>,
    /// Registered source: per window, whether the compute stream waits for its copy (rounds queued
    /// from now on may read that window of the copy).
    window_waited: Vec<bool>,
    /// Known complete: rounds may read the copy.
    ready: bool,
    /// Streamed: the compute stream waits for the copy (rounds queued from now on may read it).
    waited: bool,
    /// Which fill of the slot this is (streamed: the loader reports fills by this count).
    generation: u64,
    /// Recorded on the compute stream after each round whose region table names this slot.
    last_read: Arc<Event>,
    /// Whether `last_read` was recorded since the slot was last filled.
    read: bool,
}

impl ShardSlot {
    /// Whether rounds may read the slot's copy of window `window` of its shard.
    fn window_usable(&self, window: usize) -> bool {
        self.shard.is_some()
            && (self.ready || self.waited || self.window_waited.get(window) == Some(&true))
    }

    /// Whether rounds may read any part of the slot's copy.
    fn any_usable(&self) -> bool {
        self.shard.is_some() && (self.ready || self.waited || self.window_waited.contains(&true))
    }
}

/// Where shard copies come from.
pub(super) enum ShardSource {
    /// Windows registered for the stream's life: copies are queued on the filler's thread, and rows
    /// of shards not yet on the device are read in place.
    Registered,
    /// The dataset is larger than the registration budget: a loader thread copies each shard, and
    /// rows are read from device copies only.
    Streamed(ShardLoader),
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
    source: ShardSource,
    /// The loader's checks of the shards it copies, when the stream did not verify them at open.
    pub(super) checks: Option<Arc<ShardChecks>>,
    copy_stream: Stream,
    /// Fills queued so far (the generation of the latest).
    fills: u64,
    slots: Vec<ShardSlot>,
    /// Per shard, the slot holding or receiving it.
    holder: Vec<Option<usize>>,
    shards: Vec<ShardWindows>,
    /// First sample of each shard, and the sample count after the last: maps samples to shards.
    shard_first_samples: Vec<u64>,
    window_bytes: u64,
    /// Bytes copied to the device, for the read counters.
    pub(super) copied_bytes: u64,
    /// Where the slots go when the stream closes, for the device's next stream.
    pool: Arc<ShardSlotPool>,
    /// A loader thread panicked: copies it queued into the slots are not known to be done, so the
    /// slots are freed, not pooled, when the stream closes.
    unconfirmed: bool,
}

impl DeviceShards {
    /// Slots for as many shards of at most `shard_bytes_max` bytes each as `device_bytes_max` holds
    /// (at least `slots_min`), if `order` draws from a few shards at a time and the device has the
    /// memory; `None` otherwise (the stream reads in place only). A streamed source is given its
    /// slot count by [`Self::start_loader`]. Slots come from `pool` where it has them (see
    /// `shard_pool`) and go back to it when the stream closes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        device: &Device,
        order: &EpochOrder,
        shards: Vec<ShardWindows>,
        shard_first_samples: Vec<u64>,
        window_bytes: u64,
        device_bytes_max: u64,
        slots_min: usize,
        pool: &Arc<ShardSlotPool>,
    ) -> Result<Option<DeviceShards>, DeviceError> {
        if order.shuffle_kind() == ShuffleKind::Full || shards.len() < 2 {
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
        let windows_max = shards.iter().map(|s| s.windows.len()).max().unwrap_or(0);
        let slot_count = ((device_bytes_max / shard_bytes_max) as usize).min(shards.len());
        if slot_count < slots_min.max(2) {
            return Ok(None);
        }
        let mut slots = Vec::with_capacity(slot_count);
        let mut kept = pool.take(shard_bytes_max as usize, slot_count);
        let kept_count = kept.len();
        for _ in 0..slot_count {
            let buffer = match kept.pop() {
                Some(buffer) => buffer,
                None => match new_slot(device, shard_bytes_max as usize, pool)? {
                    Some(buffer) => buffer,
                    // Less device memory than the budget: as many slots as fit, or none.
                    None => break,
                },
            };
            slots.push(ShardSlot {
                buffer,
                shard: None,
                copied: Arc::new(Event::new(device, EventTiming::Disabled)?),
                window_copied: (0..windows_max)
                    .map(|_| Event::new(device, EventTiming::Disabled))
                    .collect::<Result<_, _>>()?,
                window_waited: vec![false; windows_max],
                ready: false,
                waited: false,
                generation: 0,
                last_read: Arc::new(Event::new(device, EventTiming::Disabled)?),
                read: false,
            });
        }
        if slots.len() < slots_min.max(2) {
            // Short of device memory: the slots are freed, not kept, for the stream's other
            // allocations.
            return Ok(None);
        }
        tracing::info!(
            "stream copies shards ahead into {} device slots of {} MiB ({kept_count} kept from \
             earlier streams)",
            slots.len(),
            shard_bytes_max >> 20
        );
        Ok(Some(DeviceShards {
            source: ShardSource::Registered,
            checks: None,
            copy_stream: Stream::new(device)?,
            fills: 0,
            holder: vec![None; shards.len()],
            slots,
            shards,
            shard_first_samples,
            window_bytes,
            copied_bytes: 0,
            pool: Arc::clone(pool),
            unconfirmed: false,
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
                // A shard without samples is never read.
                let empty = self.shard_first_samples[shard + 1] == self.shard_first_samples[shard];
                if !empty && !wanted.contains(&shard) {
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
    ) -> Result<(), FillError> {
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if slot.shard.is_none() || slot.ready {
                continue;
            }
            let recorded = match &self.source {
                ShardSource::Registered => true,
                ShardSource::Streamed(loader) => loader.is_recorded(index, slot.generation),
            };
            slot.ready = recorded && slot.copied.is_complete()?;
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
    fn fill(&mut self, index: usize, shard: usize) -> Result<(), FillError> {
        self.fills += 1;
        let slot = &mut self.slots[index];
        let previous_fill = slot.shard.take();
        if let Some(previous) = previous_fill {
            self.holder[previous] = None;
        }
        slot.generation = self.fills;
        slot.waited = false;
        slot.window_waited.fill(false);
        if let ShardSource::Streamed(loader) = &self.source {
            // After the rounds that read the slot's previous shard; if none did, after that
            // shard's own copies, which may still be running (the loader records them before it
            // copies this fill: it never groups two fills of one slot).
            let after = if slot.read {
                Some(Arc::clone(&slot.last_read))
            } else if previous_fill.is_some() {
                Some(Arc::clone(&slot.copied))
            } else {
                None
            };
            slot.read = false;
            slot.ready = false;
            slot.shard = Some(shard);
            self.holder[shard] = Some(index);
            let bytes = self.shards[shard]
                .windows
                .iter()
                .map(|&(_, bytes)| bytes)
                .sum::<u64>();
            loader.send(LoadJob {
                slot: index,
                generation: slot.generation,
                shard,
                bytes,
                dst: slot.buffer.device_ptr(),
                copied: Arc::clone(&slot.copied),
                after,
            })?;
            self.copied_bytes += bytes;
            return Ok(());
        }
        if slot.read {
            self.copy_stream.wait(&slot.last_read)?;
            slot.read = false;
        }
        let mut at = 0u64;
        for (window, &(host_addr, bytes)) in self.shards[shard].windows.iter().enumerate() {
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
            }
            .map_err(DeviceError::from)?;
            slot.window_copied[window].record(&self.copy_stream)?;
            at += bytes;
        }
        slot.copied.record(&self.copy_stream)?;
        slot.ready = false;
        slot.shard = Some(shard);
        self.holder[shard] = Some(index);
        self.copied_bytes += at;
        Ok(())
    }

    /// Points the regions whose device copy rounds may read (complete, or waited for by the compute
    /// stream) at that copy, in `table` (the stream's table of registered windows); returns whether
    /// any region changed.
    pub(super) fn redirect(&self, table: &mut [GatherRegion]) -> bool {
        let mut changed = false;
        for slot in self.slots.iter().filter(|s| s.any_usable()) {
            let shard = &self.shards[slot.shard.expect("a usable slot holds a shard")];
            let mut at = 0u64;
            for (window, &(_, bytes)) in shard.windows.iter().enumerate() {
                debug_assert!(at == window as u64 * self.window_bytes);
                if slot.window_usable(window) {
                    table[shard.first_region + window] = GatherRegion {
                        ptr: slot.buffer.device_ptr() + at,
                        bytes: table[shard.first_region + window].bytes,
                    };
                    changed = true;
                }
                at += bytes;
            }
        }
        changed
    }

    /// Records, on the compute stream, that a round reading the shards `read` was queued there: the
    /// slots of those read from a device copy may not be overwritten before it completes. (Slots the
    /// round does not read keep their last record: a round per batch records one or two events, not
    /// one per slot.)
    pub(super) fn record_reads(
        &mut self,
        compute: &Stream,
        read: &[usize],
    ) -> Result<(), DeviceError> {
        for &shard in read {
            let Some(index) = self.holder[shard] else {
                continue;
            };
            let slot = &mut self.slots[index];
            if slot.any_usable() {
                slot.last_read.record(compute)?;
                slot.read = true;
            }
        }
        Ok(())
    }

    /// Waits for every queued copy: before the windows they read are unpinned, and before the slots
    /// are freed (a streamed source's loader is stopped, once its copies are done).
    pub(super) fn synchronize(&mut self) -> Result<(), DeviceError> {
        if let ShardSource::Streamed(loader) =
            std::mem::replace(&mut self.source, ShardSource::Registered)
        {
            self.unconfirmed |= !loader.finish();
        }
        self.copy_stream.synchronize()
    }

    /// Turns this into a streamed source: a loader thread copies the shard files `paths` (see
    /// `shard_loader`).
    pub(super) fn start_loader(
        &mut self,
        device: &Device,
        windows: &Arc<crate::storage::windows::PageCacheWindows>,
        paths: Vec<std::path::PathBuf>,
        fraction_min: f64,
        copy_threads: usize,
        checks: Option<Arc<ShardChecks>>,
    ) -> Result<(), FillError> {
        let loader = ShardLoader::start(
            device,
            windows,
            paths,
            fraction_min,
            self.slots.len(),
            copy_threads,
            checks.clone(),
        )?;
        self.source = ShardSource::Streamed(loader);
        self.checks = checks;
        Ok(())
    }

    /// Whether rows are read from device copies only (see [`ShardSource::Streamed`]).
    pub(super) fn is_streamed(&self) -> bool {
        matches!(self.source, ShardSource::Streamed(_))
    }

    /// Before a round reading the shards `needed` (the regions `regions` of the stream's table) is
    /// queued: makes the compute stream wait for the copies it reads whose copy is queued (reading
    /// a shard in place while its copy runs would share the link with the copy, and the copy
    /// engines move it faster). Within the budget it waits for the copies of the windows the round
    /// reads only; streamed, for whole shards, and it also makes sure each of them is in a slot,
    /// waiting on the host only for the loader to have queued a copy (never for the copy itself).
    /// Returns the seconds waited on the host.
    pub(super) fn prepare_round(
        &mut self,
        needed: &[usize],
        regions: &[usize],
        compute: &Stream,
    ) -> Result<f64, FillError> {
        if !self.is_streamed() {
            for &region in regions {
                let shard = self.shard_of_region(region);
                // A shard in no slot is read in place.
                let Some(index) = self.holder[shard] else {
                    continue;
                };
                let windows = self.shards[shard].windows.len();
                let window = region - self.shards[shard].first_region;
                let slot = &mut self.slots[index];
                if slot.ready || slot.waited || slot.window_waited[window] {
                    continue;
                }
                compute.wait(&slot.window_copied[window])?;
                slot.window_waited[window] = true;
                if slot.window_waited[..windows].iter().all(|&w| w) {
                    slot.waited = true;
                }
            }
            return Ok(0.0);
        }
        if needed.len() > self.slots.len() {
            return Err(FillError::ShardSlotsTooFew {
                needed: needed.len(),
                slots: self.slots.len(),
            });
        }
        for &shard in needed {
            if self.holder[shard].is_none() {
                // Not read ahead (the slots were too few for the order's look-ahead): a slot no
                // shard of this round needs, preferring one never filled.
                let victim = (0..self.slots.len())
                    .filter(|&i| self.slots[i].shard.is_none_or(|s| !needed.contains(&s)))
                    .min_by_key(|&i| self.slots[i].shard.is_some())
                    .expect("more slots than shards needed");
                self.fill(victim, shard)?;
            }
        }
        let mut waited_s = 0.0;
        for &shard in needed {
            let Some(index) = self.holder[shard] else {
                continue;
            };
            let slot = &self.slots[index];
            if slot.ready || slot.waited {
                continue;
            }
            if let ShardSource::Streamed(loader) = &self.source {
                let started = std::time::Instant::now();
                loader.wait_recorded(index, slot.generation, shard)?;
                waited_s += started.elapsed().as_secs_f64();
            }
            compute.wait(&slot.copied)?;
            self.slots[index].waited = true;
        }
        Ok(waited_s)
    }

    /// Whether one round may read the regions two sets of planned rows read (bytes per region,
    /// `a` and `b`): streamed, the shards they lie in must fit the slots at once.
    pub(super) fn fit_one_round(&self, a: &[u64], b: &[u64]) -> bool {
        if !self.is_streamed() {
            return true;
        }
        let mut shards: Vec<usize> = Vec::new();
        for (region, (x, y)) in a.iter().zip(b).enumerate() {
            if x + y == 0 {
                continue;
            }
            let shard = self.shard_of_region(region);
            if !shards.contains(&shard) {
                shards.push(shard);
                if shards.len() > self.slots.len() {
                    return false;
                }
            }
        }
        true
    }

    /// The shard holding region `region` of the stream's table.
    pub(super) fn shard_of_region(&self, region: usize) -> usize {
        self.shards
            .partition_point(|s| s.first_region <= region)
            .saturating_sub(1)
    }

    /// Device memory held by the slots.
    pub(super) fn device_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.buffer.len()).sum()
    }
}

/// A new slot of `bytes`; when the device is short of memory, what `pool` keeps idle is freed and
/// the allocation tried once more. `None`: still short.
fn new_slot(
    device: &Device,
    bytes: usize,
    pool: &ShardSlotPool,
) -> Result<Option<DeviceBuffer>, DeviceError> {
    for attempt in 0..2 {
        match DeviceBuffer::new(device, bytes) {
            Ok(buffer) => return Ok(Some(buffer)),
            Err(DeviceError::Driver(error)) if error.is_out_of_memory() => {
                if attempt > 0 || pool.release_all() == 0 {
                    return Ok(None);
                }
            }
            Err(error) => return Err(error),
        }
    }
    Ok(None)
}

impl Drop for DeviceShards {
    /// Waits for the copies, then hands the slots to the device's pool once nothing reads or writes
    /// them any more: the copies into them, and the rounds that read them (recorded on the compute
    /// stream). If the work on any slot cannot be confirmed done (a failed wait, or a loader thread
    /// that panicked), every slot is freed instead.
    fn drop(&mut self) {
        if self.synchronize().is_err() || self.unconfirmed {
            return;
        }
        let mut done = Vec::with_capacity(self.slots.len());
        for slot in self.slots.drain(..) {
            if slot.copied.synchronize().is_err() || slot.last_read.synchronize().is_err() {
                return;
            }
            done.push(slot.buffer);
        }
        self.pool.put(done);
    }
}
