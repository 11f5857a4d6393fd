//! The device-memory tier: datasets kept whole in device memory, shared by every stream of the
//! device and every epoch, so that rows are gathered from HBM instead of crossing PCIe again.
//!
//! Each served device has one tier with a byte budget (`--device-cache`, 0 by default: the training
//! processes on the device need its memory, and only the operator knows how much they leave). A
//! stream whose fields are all stored raw, over a dataset whose shard files fit the budget whole,
//! *admits* the dataset: one device allocation of the shard files' size is made (evicting datasets
//! no stream reads and no one pinned, least recently used first, until it fits; if it still does
//! not fit, the stream is served as without the tier). The stream that admitted it, and any stream
//! of the dataset that opens before it is complete, fills it: every window of every shard is copied
//! once by the copy engines from the registered page-cache windows the stream reads anyway, in the
//! order the stream needs them, on the dataset's own copy stream, each window's copy followed by an
//! event. A stream reads a window from the tier once its copy is complete (a shuffle, whose batches
//! draw from many windows at once, reads the others in place meanwhile) or, in dataset order, once
//! the compute stream waits for that copy (the copies run just ahead of the rows that read them). Every later stream of the dataset on the device, from any
//! process, finds it complete when it opens: its region table points every window at the tier, no
//! window is registered for it, and the same gather kernel reads HBM.
//!
//! A dataset with compressed blocks is kept decoded instead (`resident::tier_fill`): the stream
//! that admits it decodes it whole into its allocation before its first batch, and streams of the
//! dataset that open meanwhile wait for that; its tier key says it is decoded.
//!
//! What is kept of a raw dataset is the shard files' bytes, as stored (fp16 stays fp16): blocks are verified once
//! per dataset when the first stream opens (as without the tier), and the copies are of the same
//! page-cache bytes. A dataset is keyed by its directory and its manifest's identity: re-packed in
//! place, it is another dataset, and the old copy is evicted.
//!
//! Policy when datasets compete: pinned datasets (the HTTP API pins a dataset to a device's tier)
//! are never evicted to make room; the others go least recently used first, and only when no stream
//! holds them. An eviction asked for through the API while streams read the dataset takes it out of
//! the tier at once (new streams do not find it) and frees its memory when the last of those
//! streams closes: eviction never breaks a stream in flight. Memory of such retiring datasets still
//! counts against the budget until it is freed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

use crate::device::{
    Device, DeviceBuffer, DeviceError, DeviceMemory, Event, EventTiming, HostMappedBuffer, Stream,
};
use crate::format::FileIdentity;
use crate::metrics::{DeviceTierFigures, Metrics};
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock};

/// Most datasets one device's tier holds at once (resident, filling or retiring): a bound on its
/// bookkeeping, far above what a device's memory holds in practice.
pub const TIER_DATASETS_MAX: usize = 256;

/// What identifies a dataset in the tier: its directory and its manifest file's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierKey {
    /// The dataset directory.
    pub dir: PathBuf,
    /// The manifest file as it was when the dataset was opened.
    pub identity: FileIdentity,
    /// Whether the tier holds the dataset decoded (its compressed blocks decoded once, see
    /// `resident::tier_fill`) rather than its shard files as stored.
    pub decoded: bool,
}

/// What the tier's bookkeeping needs of an entry (a trait, so that the policy is tested without a
/// device).
pub trait TierEntry: Send + Sync + 'static {
    /// The entry's key.
    fn key(&self) -> &TierKey;
    /// Device bytes it holds.
    fn bytes(&self) -> u64;
    /// Whether every window of it is known copied.
    fn is_complete(&self) -> bool;
}

/// A dataset the tier holds or held, for status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierDatasetReport {
    /// The dataset directory.
    pub dir: PathBuf,
    /// Whether it is held decoded (compressed blocks decoded once) or as stored.
    pub decoded: bool,
    /// Device bytes it holds.
    pub bytes: u64,
    /// `resident` (every window copied), `filling`, or `retiring` (evicted, freed when the streams
    /// reading it close).
    pub state: &'static str,
    /// Whether the API pinned it.
    pub pinned: bool,
    /// Streams reading it now.
    pub streams: u64,
}

/// A device's tier, for status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierReport {
    /// The budget (0: the tier is off).
    pub bytes_max: u64,
    /// Device bytes held (retiring datasets included).
    pub held_bytes: u64,
    /// The datasets it holds.
    pub datasets: Vec<TierDatasetReport>,
    /// Streams that found their dataset complete in the tier when they opened.
    pub hits: u64,
    /// Streams that admitted their dataset (and filled it).
    pub admissions: u64,
    /// Streams whose dataset fitted the budget but found no room (every other dataset pinned or
    /// read), or the device short of memory: served without the tier.
    pub declined: u64,
    /// Datasets evicted (for room, by the API, or re-packed).
    pub evictions: u64,
}

impl TierReport {
    /// Its figures, for the metrics.
    pub fn figures(&self) -> DeviceTierFigures {
        DeviceTierFigures {
            bytes_max: self.bytes_max,
            held_bytes: self.held_bytes,
            datasets: self.datasets.iter().filter(|d| d.bytes > 0).count() as u64,
            hits: self.hits,
            admissions: self.admissions,
            declined: self.declined,
            evictions: self.evictions,
            decoded_device_bytes: 0,
            decoded_host_bytes: 0,
        }
    }
}

/// Why an eviction asked for by the API did nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierError {
    /// The dataset is not in the tier.
    #[error("dataset {0} is not in the device's memory tier")]
    NotResident(PathBuf),
    /// Pins are bounded like the tier.
    #[error("at most {TIER_DATASETS_MAX} datasets may be pinned to a device's memory tier")]
    TooManyPins,
}

/// The tier's bookkeeping: its entries, pins and counters, under one lock (taken once per stream
/// opening and per API call, never per batch).
pub struct TierBook<E: TierEntry> {
    bytes_max: u64,
    state: Mutex<BookState<E>>,
    /// Signalled when an admission's allocation ends (see [`TierBook::acquire`]).
    admitted: Condvar,
    hits: AtomicU64,
    admissions: AtomicU64,
    declined: AtomicU64,
    evictions: AtomicU64,
}

struct BookState<E> {
    /// Resident or filling, least recently used first.
    entries: Vec<Arc<E>>,
    /// Evicted while streams read them: their memory is freed when the last stream closes.
    retiring: Vec<Weak<E>>,
    /// Dataset directories pinned by the API (a pin may precede the dataset's first stream).
    pinned: Vec<PathBuf>,
    /// Datasets being admitted, with their bytes: room is kept for them while their memory is
    /// allocated outside the lock.
    reserved: Vec<(TierKey, u64)>,
}

/// What [`TierBook::acquire`] found or did.
pub enum Acquired<E> {
    /// The dataset is in the tier (complete or still filling).
    Found(Arc<E>),
    /// The dataset was admitted: the caller fills it.
    Admitted(Arc<E>),
    /// Not in the tier, and not admitted (too large, no room, or the tier is off).
    None,
}

impl<E: TierEntry> TierBook<E> {
    /// An empty tier of `bytes_max` bytes (0: off).
    pub fn new(bytes_max: u64) -> TierBook<E> {
        TierBook {
            bytes_max,
            state: Mutex::new(BookState {
                entries: Vec::new(),
                retiring: Vec::new(),
                pinned: Vec::new(),
                reserved: Vec::new(),
            }),
            admitted: Condvar::new(),
            hits: AtomicU64::new(0),
            admissions: AtomicU64::new(0),
            declined: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The budget.
    pub fn bytes_max(&self) -> u64 {
        self.bytes_max
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BookState<E>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The dataset `key` of `bytes` bytes for a stream: found in the tier (moved to the most
    /// recently used end), or admitted with the memory `allocate` returns (`None`: the device is
    /// short of it) after evicting what must go, or neither. The memory is allocated with the
    /// book unlocked (page-locking host memory takes seconds for tens of GiB), its bytes reserved
    /// meanwhile; a stream acquiring the same dataset then waits for that admission to end.
    pub fn acquire(
        &self,
        key: &TierKey,
        bytes: u64,
        allocate: impl FnOnce() -> Result<Option<E>, DeviceError>,
    ) -> Result<Acquired<E>, DeviceError> {
        if self.bytes_max == 0 || bytes > self.bytes_max {
            return Ok(Acquired::None);
        }
        let mut state = self.lock();
        while state.reserved.iter().any(|(k, _)| k == key) {
            state = self.admitted.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.retiring.retain(|w| w.strong_count() > 0);
        // The same directory under another manifest identity: re-packed, the old copy goes.
        let stale: Vec<usize> = (0..state.entries.len())
            .filter(|&i| {
                let other = state.entries[i].key();
                other.dir == key.dir && other.identity != key.identity
            })
            .collect();
        for index in stale.into_iter().rev() {
            let entry = state.entries.remove(index);
            self.retire(&mut state, entry);
        }
        if let Some(index) = state.entries.iter().position(|e| e.key() == key) {
            let entry = state.entries.remove(index);
            state.entries.push(Arc::clone(&entry));
            if entry.is_complete() {
                self.hits.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(Acquired::Found(entry));
        }
        // Room: evict unpinned datasets no stream holds, least recently used first.
        loop {
            let held = held_bytes(&state) + state.reserved.iter().map(|(_, b)| b).sum::<u64>();
            if held + bytes <= self.bytes_max
                && state.entries.len() + state.retiring.len() + state.reserved.len()
                    < TIER_DATASETS_MAX
            {
                break;
            }
            let victim = state.entries.iter().position(|e| {
                Arc::strong_count(e) == 1 && !state.pinned.iter().any(|p| *p == e.key().dir)
            });
            let Some(victim) = victim else {
                self.declined.fetch_add(1, Ordering::Relaxed);
                return Ok(Acquired::None);
            };
            let entry = state.entries.remove(victim);
            self.retire(&mut state, entry);
            state.retiring.retain(|w| w.strong_count() > 0);
        }
        // Allocated with the book unlocked, the bytes reserved: two streams of one dataset
        // opening at once admit it once (the second waits above).
        state.reserved.push((key.clone(), bytes));
        drop(state);
        let reservation = Reservation { book: self, key };
        let Some(entry) = allocate()? else {
            self.declined.fetch_add(1, Ordering::Relaxed);
            return Ok(Acquired::None);
        };
        let entry = Arc::new(entry);
        // The entry goes in and the reservation out under one lock: a stream waiting for this
        // admission finds the entry.
        let mut state = self.lock();
        state.entries.push(Arc::clone(&entry));
        reservation.release(&mut state);
        drop(state);
        self.admissions.fetch_add(1, Ordering::Relaxed);
        Ok(Acquired::Admitted(entry))
    }

    /// Takes the dataset `key` out of the tier (a fill that failed): freed when no stream holds it.
    pub fn discard(&self, key: &TierKey) {
        let mut state = self.lock();
        while let Some(at) = state.entries.iter().position(|e| e.key() == key) {
            let entry = state.entries.remove(at);
            self.retire(&mut state, entry);
        }
        state.retiring.retain(|w| w.strong_count() > 0);
    }

    /// Whether the tier holds the dataset `key`.
    pub fn contains(&self, key: &TierKey) -> bool {
        self.lock().entries.iter().any(|e| e.key() == key)
    }

    /// Takes the dataset `key` out of the tier when at most `readers` streams hold it (references
    /// about to be dropped), and returns the tier's reference, for the caller to drop once the
    /// book is unlocked (freeing device memory may wait for the device).
    pub fn release_unread(&self, key: &TierKey, readers: usize) -> Option<Arc<E>> {
        let mut state = self.lock();
        let at = state.entries.iter().position(|e| e.key() == key)?;
        // The book's own reference and the readers'.
        if Arc::strong_count(&state.entries[at]) > 1 + readers {
            return None;
        }
        self.evictions.fetch_add(1, Ordering::Relaxed);
        let entry = state.entries.remove(at);
        if readers > 0 {
            state.retiring.push(Arc::downgrade(&entry));
        }
        Some(entry)
    }

    /// Takes `entry` out of the tier: freed now if no stream holds it, else when the last one
    /// closes.
    fn retire(&self, state: &mut BookState<E>, entry: Arc<E>) {
        self.evictions.fetch_add(1, Ordering::Relaxed);
        state.retiring.push(Arc::downgrade(&entry));
    }

    /// Pins the dataset directory `dir` (never evicted to make room), or unpins it.
    pub fn set_pinned(&self, dir: &Path, pinned: bool) -> Result<(), TierError> {
        let mut state = self.lock();
        let at = state.pinned.iter().position(|p| p == dir);
        match (pinned, at) {
            (true, None) => {
                if state.pinned.len() >= TIER_DATASETS_MAX {
                    return Err(TierError::TooManyPins);
                }
                state.pinned.push(dir.to_path_buf());
            }
            (false, Some(at)) => {
                state.pinned.remove(at);
            }
            _ => {}
        }
        Ok(())
    }

    /// Evicts every copy of the dataset directory `dir` and unpins it (see the module
    /// documentation: memory that streams read is freed when they close).
    pub fn evict(&self, dir: &Path) -> Result<(), TierError> {
        let mut state = self.lock();
        let was_pinned = state.pinned.iter().any(|p| p == dir);
        state.pinned.retain(|p| p != dir);
        let mut found = false;
        while let Some(at) = state.entries.iter().position(|e| e.key().dir == dir) {
            let entry = state.entries.remove(at);
            self.retire(&mut state, entry);
            found = true;
        }
        state.retiring.retain(|w| w.strong_count() > 0);
        if found || was_pinned {
            Ok(())
        } else {
            Err(TierError::NotResident(dir.to_path_buf()))
        }
    }

    /// What the tier holds now.
    pub fn report(&self) -> TierReport {
        let mut state = self.lock();
        state.retiring.retain(|w| w.strong_count() > 0);
        let mut datasets: Vec<TierDatasetReport> = state
            .entries
            .iter()
            .map(|e| TierDatasetReport {
                dir: e.key().dir.clone(),
                decoded: e.key().decoded,
                bytes: e.bytes(),
                state: if e.is_complete() {
                    "resident"
                } else {
                    "filling"
                },
                pinned: state.pinned.iter().any(|p| *p == e.key().dir),
                // The tier's own reference is not a stream.
                streams: Arc::strong_count(e) as u64 - 1,
            })
            .collect();
        datasets.extend(state.retiring.iter().filter_map(Weak::upgrade).map(|e| {
            TierDatasetReport {
                dir: e.key().dir.clone(),
                decoded: e.key().decoded,
                bytes: e.bytes(),
                state: "retiring",
                pinned: false,
                // This report's own reference is not a stream.
                streams: Arc::strong_count(&e) as u64 - 1,
            }
        }));
        // Pinned datasets not in the tier yet.
        for dir in &state.pinned {
            if !datasets.iter().any(|d| d.dir == *dir) {
                datasets.push(TierDatasetReport {
                    dir: dir.clone(),
                    decoded: false,
                    bytes: 0,
                    state: "pinned",
                    pinned: true,
                    streams: 0,
                });
            }
        }
        TierReport {
            bytes_max: self.bytes_max,
            held_bytes: held_bytes(&state),
            datasets,
            hits: self.hits.load(Ordering::Relaxed),
            admissions: self.admissions.load(Ordering::Relaxed),
            declined: self.declined.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }
}

/// An admission's reserved bytes, given back however the allocation ends (a panic included).
struct Reservation<'a, E: TierEntry> {
    book: &'a TierBook<E>,
    key: &'a TierKey,
}

impl<E: TierEntry> Reservation<'_, E> {
    /// Gives the reservation back under `state` (the book's lock, held by the caller).
    fn release(self, state: &mut BookState<E>) {
        Self::remove(self.book, self.key, state);
        std::mem::forget(self);
    }

    fn remove(book: &TierBook<E>, key: &TierKey, state: &mut BookState<E>) {
        if let Some(at) = state.reserved.iter().position(|(k, _)| k == key) {
            state.reserved.remove(at);
        }
        book.admitted.notify_all();
    }
}

impl<E: TierEntry> Drop for Reservation<'_, E> {
    fn drop(&mut self) {
        let mut state = self.book.lock();
        Self::remove(self.book, self.key, &mut state);
    }
}

/// Bytes held by the entries and by the retiring datasets still read.
fn held_bytes<E: TierEntry>(state: &BookState<E>) -> u64 {
    state.entries.iter().map(|e| e.bytes()).sum::<u64>()
        + state
            .retiring
            .iter()
            .filter_map(Weak::upgrade)
            .map(|e| e.bytes())
            .sum::<u64>()
}

/// A window's copy into the tier: not queued yet, queued (its event recorded), or known complete.
const WINDOW_EMPTY: u8 = 0;
const WINDOW_QUEUED: u8 = 1;
const WINDOW_COMPLETE: u8 = 2;

/// One window of a dataset in the tier.
struct TierWindow {
    state: AtomicU8,
    /// Recorded on the dataset's copy stream after the window's copy.
    copied: Event,
    /// Where the window starts in the dataset's allocation.
    offset: u64,
    bytes: u64,
}

/// Host memory a copy in host memory leaves available at least: 1 GiB, or an eighth of what is
/// available where that is more.
const HOST_COPY_HEADROOM_MIN: u64 = 1 << 30;

/// Whether a host copy of `bytes` may be faulted in with `available` bytes available on the host
/// (`None`: unknown, as on hosts without `/proc/meminfo`).
fn host_memory_fits(bytes: u64, available: Option<u64>) -> bool {
    available.is_none_or(|available| {
        let headroom = HOST_COPY_HEADROOM_MIN.max(available / 8);
        bytes.saturating_add(headroom) <= available
    })
}

/// Where a dataset's copy lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierPlace {
    /// Device memory.
    Device,
    /// Page-locked host memory mapped for the device: a decoded copy too large for the device
    /// memory such copies may take; kernels read it across PCIe, as they read registered page cache.
    Host,
}

/// A dataset's memory.
enum TierMemory {
    Device(DeviceBuffer),
    Host(HostMappedBuffer),
}

impl TierMemory {
    fn device_ptr(&self) -> u64 {
        match self {
            TierMemory::Device(buffer) => buffer.device_ptr(),
            TierMemory::Host(buffer) => buffer.device_ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            TierMemory::Device(buffer) => buffer.len(),
            TierMemory::Host(buffer) => buffer.len(),
        }
    }
}

/// A dataset in a device's tier: its shard files, one after another, in one allocation.
pub struct TierDataset {
    key: TierKey,
    buffer: TierMemory,
    /// Per window of every shard (the stream's region table's order): its copy.
    windows: Vec<TierWindow>,
    /// Copies into the tier, in the order streams queued them.
    copy_stream: Stream,
    /// Held while a stream queues copies: each window is queued once.
    queueing: Mutex<()>,
    /// Whether every window is known copied (kept so that a complete dataset costs one load).
    complete: AtomicBool,
    /// A copy could not be confirmed done: rounds must not read the tier any more.
    failed: AtomicBool,
    /// Blocks of a decoded dataset that did not decode (their checksum matched): every stream of
    /// the dataset treats them as corrupt.
    undecodable: Mutex<Vec<(BlockKey, Arc<CorruptBlock>)>>,
}

impl TierEntry for TierDataset {
    fn key(&self) -> &TierKey {
        &self.key
    }

    fn bytes(&self) -> u64 {
        self.buffer.len() as u64
    }

    fn is_complete(&self) -> bool {
        self.complete.load(Ordering::Acquire) || self.poll_complete()
    }
}

impl TierDataset {
    /// A dataset of shard files of `file_bytes` bytes, cut in windows of `window_bytes`, with its
    /// memory on `device` or in host memory mapped for it (`place`); `None` when the device (or
    /// the host) is short of memory.
    fn new(
        device: &Device,
        key: TierKey,
        file_bytes: &[u64],
        window_bytes: u64,
        place: TierPlace,
    ) -> Result<Option<TierDataset>, DeviceError> {
        let total: u64 = file_bytes.iter().sum();
        let buffer = match place {
            TierPlace::Device => match DeviceBuffer::new(device, total as usize) {
                Ok(buffer) => TierMemory::Device(buffer),
                Err(DeviceError::Driver(error)) if error.is_out_of_memory() => return Ok(None),
                Err(error) => return Err(error),
            },
            TierPlace::Host => {
                // Faulting in more than the host has free would not fail: the kernel's
                // out-of-memory killer would end a process, maybe the daemon. Declined instead.
                let available = crate::storage::residency::available_memory_bytes();
                if !host_memory_fits(total, available) {
                    tracing::warn!(
                        "{} MiB of host memory for a decoded copy declined: the host has {} MiB \
                         available",
                        total >> 20,
                        available.unwrap_or(0) >> 20
                    );
                    return Ok(None);
                }
                match HostMappedBuffer::new(device, total as usize)? {
                    Some(buffer) => TierMemory::Host(buffer),
                    None => return Ok(None),
                }
            }
        };
        let mut windows = Vec::new();
        let mut offset = 0u64;
        for &bytes in file_bytes {
            let mut start = 0u64;
            while start < bytes {
                let len = window_bytes.min(bytes - start);
                windows.push(TierWindow {
                    state: AtomicU8::new(WINDOW_EMPTY),
                    copied: Event::new(device, EventTiming::Disabled)?,
                    offset: offset + start,
                    bytes: len,
                });
                start += window_bytes;
            }
            offset += bytes;
        }
        Ok(Some(TierDataset {
            key,
            buffer,
            windows,
            copy_stream: Stream::new(device)?,
            queueing: Mutex::new(()),
            complete: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            undecodable: Mutex::new(Vec::new()),
        }))
    }

    /// Whether every window's copy is complete now (one event query per window not known complete;
    /// called when a stream opens and for status, never per batch).
    fn poll_complete(&self) -> bool {
        if self.failed.load(Ordering::Acquire) {
            return false;
        }
        for window in &self.windows {
            match window.state.load(Ordering::Acquire) {
                WINDOW_COMPLETE => {}
                WINDOW_QUEUED if window.copied.is_complete().unwrap_or(false) => {
                    window.state.store(WINDOW_COMPLETE, Ordering::Release);
                }
                _ => return false,
            }
        }
        self.complete.store(true, Ordering::Release);
        true
    }

    /// Windows (the stream's regions).
    pub fn window_count(&self) -> usize {
        self.windows.len()
    }

    /// The device address of window `window`.
    pub fn window_ptr(&self, window: usize) -> u64 {
        self.buffer.device_ptr() + self.windows[window].offset
    }

    /// The dataset's allocation: its device address and length.
    pub fn extent(&self) -> (u64, u64) {
        (self.buffer.device_ptr(), self.buffer.len() as u64)
    }

    /// Bytes of window `window`.
    pub fn window_bytes(&self, window: usize) -> u64 {
        self.windows[window].bytes
    }

    /// A region table with every window of the dataset, in order, pointing into the tier.
    pub fn regions(&self) -> Vec<crate::kernels::GatherRegion> {
        (0..self.windows.len())
            .map(|window| crate::kernels::GatherRegion {
                ptr: self.window_ptr(window),
                bytes: self.window_bytes(window),
            })
            .collect()
    }

    /// Queues the copies of the windows not queued yet, from `sources` (the host address of each
    /// window, registered and pinned by the caller), in the order `order` (window indices). Returns
    /// how many this call queued.
    ///
    /// # Safety
    /// Every source address must stay valid and registered until [`Self::synchronize`] returned
    /// (the copies read it until then).
    pub unsafe fn queue_fill(
        &self,
        sources: &[usize],
        order: impl Iterator<Item = usize>,
    ) -> Result<usize, DeviceError> {
        debug_assert_eq!(sources.len(), self.windows.len());
        assert_eq!(
            self.place(),
            TierPlace::Device,
            "only datasets in device memory are filled from page-cache windows"
        );
        let _queueing = self.queueing.lock().unwrap_or_else(|e| e.into_inner());
        let mut queued = 0;
        for index in order {
            let window = &self.windows[index];
            if window.state.load(Ordering::Acquire) != WINDOW_EMPTY {
                continue;
            }
            // SAFETY: the destination lies within the allocation (the windows were cut from it);
            // no round reads a window before its copy completed or the compute stream waited for
            // it; the source stays valid until `synchronize` (the caller's contract).
            unsafe {
                crate::device::ffi::memcpy_htod_async(
                    self.buffer.device_ptr() + window.offset,
                    sources[index] as *const u8,
                    window.bytes as usize,
                    self.copy_stream.raw(),
                )
            }
            .map_err(DeviceError::from)?;
            window.copied.record(&self.copy_stream)?;
            // Released after the event is recorded: a reader that sees QUEUED waits on this copy.
            window.state.store(WINDOW_QUEUED, Ordering::Release);
            queued += 1;
        }
        Ok(queued)
    }

    /// Held by the stream that fills a decoded dataset, for the whole fill: another stream of the
    /// dataset that opens meanwhile takes it, and so waits for the fill to end.
    pub fn fill_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.queueing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where the dataset's copy lives.
    pub fn place(&self) -> TierPlace {
        match self.buffer {
            TierMemory::Device(_) => TierPlace::Device,
            TierMemory::Host(_) => TierPlace::Host,
        }
    }

    /// Queues, on the dataset's copy stream, a copy of `bytes` bytes of device memory at `src`
    /// into the dataset's allocation at `offset`, for a fill that writes it whole (see
    /// `resident::tier_fill`).
    ///
    /// # Safety
    /// `src .. src + bytes` is device memory that stays allocated and unwritten until the copy
    /// completed on the copy stream.
    pub(in crate::pipeline::gpu) unsafe fn queue_fill_write(
        &self,
        offset: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        if offset
            .checked_add(bytes as u64)
            .is_none_or(|end| end > self.buffer.len() as u64)
        {
            return Err(DeviceError::OutOfBounds {
                what: "a fill of a decoded copy",
                offset,
                bytes: bytes as u64,
                capacity: self.buffer.len() as u64,
            });
        }
        let stream = self.copy_stream.raw();
        match &self.buffer {
            // SAFETY: the destination lies within the allocation (checked above), which outlives
            // the copy (its drop synchronises the copy stream); the source is the caller's contract.
            TierMemory::Device(buffer) => unsafe {
                crate::device::ffi::memcpy_dtod_async(
                    buffer.device_ptr() + offset,
                    src,
                    bytes,
                    stream,
                )
            },
            // SAFETY: as above; the host range is registered, and no reader of it runs before the
            // fill is complete.
            TierMemory::Host(buffer) => unsafe {
                crate::device::ffi::memcpy_dtoh_async(
                    buffer.host_ptr(offset as usize),
                    src,
                    bytes,
                    stream,
                )
            },
        }
        .map_err(DeviceError::from)
    }

    /// The stream the dataset's fill is queued on (its drop waits for it).
    pub(in crate::pipeline::gpu) fn copy_stream(&self) -> &Stream {
        &self.copy_stream
    }

    /// Records a whole fill as done (the filler synchronised every copy and decode of it first),
    /// with the blocks that did not decode, or as failed (`ok` false: never read from the tier).
    pub(in crate::pipeline::gpu) fn finish_fill(
        &self,
        ok: bool,
        undecodable: Vec<(BlockKey, Arc<CorruptBlock>)>,
    ) {
        if !ok {
            self.failed.store(true, Ordering::Release);
            return;
        }
        *self.undecodable.lock().unwrap_or_else(|e| e.into_inner()) = undecodable;
        for window in &self.windows {
            window.state.store(WINDOW_COMPLETE, Ordering::Release);
        }
        self.complete.store(true, Ordering::Release);
    }

    /// Blocks of a decoded dataset whose checksum matched but which did not decode.
    pub(crate) fn undecodable(&self) -> Vec<(BlockKey, Arc<CorruptBlock>)> {
        self.undecodable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether rounds may read window `window` without waiting: its copy completed.
    pub fn window_complete(&self, window: usize) -> Result<bool, DeviceError> {
        if self.failed.load(Ordering::Acquire) {
            return Ok(false);
        }
        let w = &self.windows[window];
        match w.state.load(Ordering::Acquire) {
            WINDOW_COMPLETE => Ok(true),
            WINDOW_QUEUED if w.copied.is_complete()? => {
                w.state.store(WINDOW_COMPLETE, Ordering::Release);
                if self
                    .windows
                    .iter()
                    .all(|w| w.state.load(Ordering::Acquire) == WINDOW_COMPLETE)
                {
                    self.complete.store(true, Ordering::Release);
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Makes `compute` wait for the copy of window `window` if it is queued; returns whether it
    /// was (rounds queued on `compute` from now on may read the window in the tier).
    pub fn wait_for_window(&self, window: usize, compute: &Stream) -> Result<bool, DeviceError> {
        if self.failed.load(Ordering::Acquire) {
            return Ok(false);
        }
        let w = &self.windows[window];
        match w.state.load(Ordering::Acquire) {
            WINDOW_COMPLETE => Ok(true),
            WINDOW_QUEUED => {
                compute.wait(&w.copied)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Whether the dataset may be read from the tier at all (no copy into it failed).
    pub fn usable(&self) -> bool {
        !self.failed.load(Ordering::Acquire)
    }

    /// Waits for every copy queued into the dataset (before the sources are unpinned). A failed
    /// wait leaves the copies unknown: the dataset is not read from the tier any more.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let result = self.copy_stream.synchronize();
        match result {
            Err(_) => self.failed.store(true, Ordering::Release),
            // Every copy queued is done: the dataset is complete if every window was queued.
            Ok(()) => {
                self.poll_complete();
            }
        }
        result
    }
}

impl Drop for TierDataset {
    fn drop(&mut self) {
        // No copy may still write the allocation when it is freed.
        let _ = self.copy_stream.synchronize();
    }
}

/// Datasets decoded for their streams whose last stream closed, each with when it is due to be
/// freed (if no stream reads it then): one entry per dataset, the later time kept.
#[derive(Default)]
struct ClosedHeld {
    entries: Vec<(TierKey, std::time::Instant)>,
}

impl ClosedHeld {
    /// The last stream reading `key` closed: it is due at `due`.
    fn closed(&mut self, key: &TierKey, due: std::time::Instant) {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = entry.1.max(due),
            None => self.entries.push((key.clone(), due)),
        }
    }

    fn forget(&mut self, key: &TierKey) {
        self.entries.retain(|(k, _)| k != key);
    }

    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Takes out the datasets due at `now`; returns them and when the next one is due.
    fn take_due(&mut self, now: std::time::Instant) -> (Vec<TierKey>, Option<std::time::Instant>) {
        let due = self
            .entries
            .iter()
            .filter(|(_, at)| *at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        self.entries.retain(|(_, at)| *at > now);
        (due, self.entries.iter().map(|(_, at)| *at).min())
    }
}

/// How long a dataset decoded for the streams reading it stays after the last of them closed
/// (see [`DeviceTier::stream_closed`]).
pub const HELD_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A device's memory tier (see the module documentation).
pub struct DeviceTier {
    device: Device,
    ordinal: u32,
    book: TierBook<TierDataset>,
    /// Datasets with compressed blocks that the tier does not take, decoded whole for the streams
    /// that read them now and freed when the last of them closes (see [`Self::acquire_held`]).
    held: TierBook<TierDataset>,
    /// As `held`, in page-locked host memory mapped for the device: datasets whose decoded size
    /// does not fit `held` (or find no room there), within the host memory set aside for them.
    held_host: TierBook<TierDataset>,
    /// Datasets decoded for their streams whose last stream closed, and when they are freed if no
    /// stream reads them then (at most one entry per dataset the book holds).
    held_closed: Mutex<ClosedHeld>,
    /// Held while a stream looks for or admits a dataset decoded for its streams, in either book:
    /// two streams of one dataset opening at once never admit it into both.
    held_admission: Mutex<()>,
    /// Whether the thread freeing them runs.
    held_reaper: AtomicBool,
    metrics: std::sync::OnceLock<Arc<Metrics>>,
}

impl DeviceTier {
    /// The tier of `device` (`cuda:ordinal`) with a budget of `bytes_max` (0: off), `held_max`
    /// bytes of device memory for datasets decoded for the streams reading them (0: none), and
    /// `host_held_max` bytes of host memory for those that do not fit there (0: none).
    pub fn new(
        device: &Device,
        ordinal: u32,
        bytes_max: u64,
        held_max: u64,
        host_held_max: u64,
    ) -> DeviceTier {
        DeviceTier {
            device: device.clone(),
            ordinal,
            book: TierBook::new(bytes_max),
            held: TierBook::new(held_max),
            held_host: TierBook::new(host_held_max),
            held_closed: Mutex::new(ClosedHeld::default()),
            held_admission: Mutex::new(()),
            held_reaper: AtomicBool::new(false),
            metrics: std::sync::OnceLock::new(),
        }
    }

    /// Device bytes for datasets decoded for the streams reading them (0: none).
    pub fn held_bytes_max(&self) -> u64 {
        self.held.bytes_max()
    }

    /// Host bytes for datasets decoded for the streams reading them that device memory does not
    /// take (0: none).
    pub fn host_held_bytes_max(&self) -> u64 {
        self.held_host.bytes_max()
    }

    /// As [`Self::acquire`], from the memory for datasets decoded for the streams that read them
    /// now: a dataset with compressed blocks that the tier does not take (off, too small, or full)
    /// is decoded whole into device memory once for the streams of the device that read it at the
    /// same time (a consumer's next epoch, opened ahead, finds it), and freed when the last of them
    /// closes ([`Self::stream_closed`]). Unlike the tier's, such a copy is not kept for later
    /// streams. A dataset that device memory does not take (larger than its share, or no room) is
    /// decoded into page-locked host memory mapped for the device instead, within
    /// [`Self::host_held_bytes_max`]: its rows then cross PCIe decoded, as a raw dataset's do.
    pub fn acquire_held(
        &self,
        key: TierKey,
        file_bytes: &[u64],
        window_bytes: u64,
    ) -> Result<Acquired<TierDataset>, DeviceError> {
        let _admission = self
            .held_admission
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // A copy already decoded into host memory is shared rather than decoded again.
        if !self.held_host.contains(&key) {
            let acquired = self.acquire_in(
                &self.held,
                key.clone(),
                file_bytes,
                window_bytes,
                TierPlace::Device,
            )?;
            if !matches!(acquired, Acquired::None) {
                self.publish();
                return Ok(acquired);
            }
        }
        let acquired = self.acquire_in(
            &self.held_host,
            key,
            file_bytes,
            window_bytes,
            TierPlace::Host,
        );
        self.publish();
        acquired
    }

    /// The dataset `key` from `book`, allocated in `place` when admitted.
    fn acquire_in(
        &self,
        book: &TierBook<TierDataset>,
        key: TierKey,
        file_bytes: &[u64],
        window_bytes: u64,
        place: TierPlace,
    ) -> Result<Acquired<TierDataset>, DeviceError> {
        let total: u64 = file_bytes.iter().sum();
        book.acquire(&key, total, || {
            TierDataset::new(&self.device, key.clone(), file_bytes, window_bytes, place)
        })
    }

    /// The book of datasets decoded for their streams that holds copies in `place`.
    fn held_book(&self, place: TierPlace) -> &TierBook<TierDataset> {
        match place {
            TierPlace::Device => &self.held,
            TierPlace::Host => &self.held_host,
        }
    }

    /// Takes `dataset` out of the memory for datasets decoded for their streams (a fill that
    /// failed).
    pub fn discard_held(&self, dataset: &TierDataset) {
        self.held_book(dataset.place()).discard(dataset.key());
    }

    /// What the device memory for datasets decoded for their streams holds now.
    pub fn held_report(&self) -> TierReport {
        self.held.report()
    }

    /// What the host memory for datasets decoded for their streams holds now.
    pub fn host_held_report(&self) -> TierReport {
        self.held_host.report()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The tier's budget in bytes (0: off).
    pub fn bytes_max(&self) -> u64 {
        self.book.bytes_max()
    }

    /// Whether the tier has a budget.
    pub fn is_enabled(&self) -> bool {
        self.book.bytes_max() > 0
    }

    /// Reports the tier's figures to `metrics` from now on.
    pub fn report_to(&self, metrics: &Arc<Metrics>) {
        let _ = self.metrics.set(Arc::clone(metrics));
        self.publish();
    }

    fn publish(&self) {
        if let Some(metrics) = self.metrics.get() {
            metrics.set_device_tier(self.ordinal, self.figures(&self.book.report()));
        }
    }

    /// The figures for the metrics: `report`'s (the tier's), with the decoded copies' bytes.
    fn figures(&self, report: &TierReport) -> DeviceTierFigures {
        DeviceTierFigures {
            decoded_device_bytes: self.held.report().held_bytes,
            decoded_host_bytes: self.held_host.report().held_bytes,
            ..report.figures()
        }
    }

    /// The dataset `key`, whose shard files are `file_bytes` bytes cut in windows of
    /// `window_bytes`, for a stream (see [`TierBook::acquire`]).
    pub fn acquire(
        &self,
        key: TierKey,
        file_bytes: &[u64],
        window_bytes: u64,
    ) -> Result<Acquired<TierDataset>, DeviceError> {
        let acquired =
            self.acquire_in(&self.book, key, file_bytes, window_bytes, TierPlace::Device);
        self.publish();
        acquired
    }

    /// See [`TierBook::set_pinned`].
    pub fn set_pinned(&self, dir: &Path, pinned: bool) -> Result<(), TierError> {
        let result = self.book.set_pinned(dir, pinned);
        self.publish();
        result
    }

    /// See [`TierBook::discard`].
    pub fn discard(&self, key: &TierKey) {
        self.book.discard(key);
        self.publish();
    }

    /// See [`TierBook::evict`].
    pub fn evict(&self, dir: &Path) -> Result<(), TierError> {
        let result = self.book.evict(dir);
        self.publish();
        result
    }

    /// What the tier holds now.
    pub fn report(&self) -> TierReport {
        let report = self.book.report();
        if let Some(metrics) = self.metrics.get() {
            metrics.set_device_tier(self.ordinal, self.figures(&report));
        }
        report
    }

    /// A stream reading the dataset `key` closes (its reference is dropped after this call): a
    /// dataset decoded for the streams reading it is freed when no stream has read it for
    /// [`HELD_GRACE`] (a consumer that opens its next epoch only when the last one closed finds
    /// it still there); the tier's figures are published (its memory may have been freed). `place`
    /// is where the dataset's copy lives (which book holds it).
    pub fn stream_closed(self: &Arc<Self>, key: &TierKey, place: TierPlace) {
        let book = self.held_book(place);
        if book.contains(key) {
            let mut closed = self.held_closed.lock().unwrap_or_else(|e| e.into_inner());
            closed.closed(key, std::time::Instant::now() + HELD_GRACE);
            // One thread per device frees them when they are due, started when none runs.
            if !self.held_reaper.swap(true, Ordering::AcqRel) {
                let tier = Arc::clone(self);
                let spawned = std::thread::Builder::new()
                    .name("gpufeed-held-free".into())
                    .spawn(move || tier.free_held_when_due());
                if spawned.is_err() {
                    // No thread: freed now if this was the last reader.
                    self.held_reaper.store(false, Ordering::Release);
                    closed.forget(key);
                    if let Some(entry) = book.release_unread(key, 1) {
                        drop(entry);
                        self.held_freed(key);
                    }
                }
            }
        }
        self.publish();
    }

    /// The thread of [`Self::stream_closed`]: frees each dataset decoded for its streams that no
    /// stream read for [`HELD_GRACE`], and ends when none is waiting.
    fn free_held_when_due(&self) {
        /// Says the thread ended however it ends (a panic included), so that the next close starts
        /// another.
        struct Ended<'a>(&'a AtomicBool);
        impl Drop for Ended<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _ended = Ended(&self.held_reaper);
        // Memory is freed on this thread: the device's context current here.
        let _ = self.device.bind();
        loop {
            let now = std::time::Instant::now();
            let (due, next) = {
                let mut closed = self.held_closed.lock().unwrap_or_else(|e| e.into_inner());
                if closed.is_empty() {
                    self.held_reaper.store(false, Ordering::Release);
                    return;
                }
                closed.take_due(now)
            };
            for key in due {
                for book in [&self.held, &self.held_host] {
                    if let Some(entry) = book.release_unread(&key, 0) {
                        drop(entry);
                        self.held_freed(&key);
                    }
                }
            }
            self.publish();
            if let Some(next) = next {
                std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
            }
        }
    }

    fn held_freed(&self, key: &TierKey) {
        tracing::info!(
            "cuda:{}: the decoded copy of {} is freed: no stream read it for {} s",
            self.ordinal,
            key.dir.display(),
            HELD_GRACE.as_secs()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake {
        key: TierKey,
        bytes: u64,
        complete: AtomicBool,
    }

    impl TierEntry for Fake {
        fn key(&self) -> &TierKey {
            &self.key
        }
        fn bytes(&self) -> u64 {
            self.bytes
        }
        fn is_complete(&self) -> bool {
            self.complete.load(Ordering::Relaxed)
        }
    }

    fn key(dir: &str, inode: u64) -> TierKey {
        TierKey {
            dir: PathBuf::from(dir),
            identity: FileIdentity::for_tests(inode),
            decoded: false,
        }
    }

    fn acquire(book: &TierBook<Fake>, k: &TierKey, bytes: u64) -> Acquired<Fake> {
        book.acquire(k, bytes, || {
            Ok(Some(Fake {
                key: k.clone(),
                bytes,
                complete: AtomicBool::new(false),
            }))
        })
        .unwrap()
    }

    fn fake(k: &TierKey, bytes: u64) -> Fake {
        Fake {
            key: k.clone(),
            bytes,
            complete: AtomicBool::new(false),
        }
    }

    #[test]
    fn an_admission_allocates_with_the_book_unlocked_and_a_second_stream_waits_for_it() {
        let book = Arc::new(TierBook::<Fake>::new(100));
        let k = key("/a", 1);
        let (entered, entered_rx) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let first = {
            let (book, k) = (Arc::clone(&book), k.clone());
            std::thread::spawn(move || {
                let acquired = book.acquire(&k, 60, || {
                    entered.send(()).unwrap();
                    go_rx.recv().unwrap();
                    Ok(Some(fake(&k, 60)))
                });
                matches!(acquired.unwrap(), Acquired::Admitted(_))
            })
        };
        entered_rx.recv().unwrap();
        // The book answers while the memory is allocated, its bytes reserved: another dataset of
        // 50 bytes does not fit beside the 60 reserved.
        assert!(!book.contains(&k));
        assert!(book.report().datasets.is_empty());
        assert!(matches!(acquire(&book, &key("/b", 2), 50), Acquired::None));
        // A second stream of the dataset waits for the admission, then finds the dataset.
        let second = {
            let (book, k) = (Arc::clone(&book), k.clone());
            std::thread::spawn(move || matches!(acquire(&book, &k, 60), Acquired::Found(_)))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!second.is_finished(), "the second stream did not wait");
        go.send(()).unwrap();
        assert!(first.join().unwrap());
        assert!(second.join().unwrap());
        assert_eq!(book.report().admissions, 1);
    }

    #[test]
    fn an_allocation_that_fails_or_panics_gives_its_reservation_back() {
        let book: TierBook<Fake> = TierBook::new(100);
        let k = key("/a", 1);
        assert!(matches!(
            book.acquire(&k, 60, || Ok(None)).unwrap(),
            Acquired::None
        ));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = book.acquire(&k, 60, || panic!("allocation panicked"));
        }));
        assert!(panicked.is_err());
        // Nothing reserved is left: the whole budget is free, and the dataset is admitted.
        assert!(matches!(
            acquire(&book, &key("/b", 2), 100),
            Acquired::Admitted(_)
        ));
    }

    #[test]
    fn host_copies_leave_headroom_on_the_host() {
        const GIB: u64 = 1 << 30;
        // An eighth of what is available, or 1 GiB where that is more, stays free.
        assert!(host_memory_fits(28 * GIB, Some(32 * GIB)));
        assert!(!host_memory_fits(29 * GIB, Some(32 * GIB)));
        assert!(host_memory_fits(GIB, Some(2 * GIB)));
        assert!(!host_memory_fits(GIB + 1, Some(2 * GIB)));
        assert!(!host_memory_fits(u64::MAX, Some(64 * GIB)));
        // Unknown: not refused here (mapping or page-locking may still fail, and is handled).
        assert!(host_memory_fits(64 * GIB, None));
    }

    #[test]
    fn off_and_too_large_are_not_admitted() {
        let off: TierBook<Fake> = TierBook::new(0);
        assert!(matches!(acquire(&off, &key("/a", 1), 10), Acquired::None));
        let small: TierBook<Fake> = TierBook::new(100);
        assert!(matches!(
            acquire(&small, &key("/a", 1), 101),
            Acquired::None
        ));
        assert_eq!(small.report().held_bytes, 0);
        // Too large is not a decline for room: nothing was competing.
        assert_eq!(small.report().declined, 0);
    }

    #[test]
    fn admitted_once_then_found_and_hits_counted_when_complete() {
        let book: TierBook<Fake> = TierBook::new(100);
        let a = key("/a", 1);
        let Acquired::Admitted(first) = acquire(&book, &a, 60) else {
            panic!("admitted")
        };
        let Acquired::Found(second) = acquire(&book, &a, 60) else {
            panic!("found")
        };
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(book.report().hits, 0, "filling: not a hit");
        first.complete.store(true, Ordering::Relaxed);
        assert!(matches!(acquire(&book, &a, 60), Acquired::Found(_)));
        let report = book.report();
        assert_eq!((report.hits, report.admissions), (1, 1));
        assert_eq!(report.datasets[0].state, "resident");
        assert_eq!(report.datasets[0].streams, 2);
    }

    #[test]
    fn least_recently_used_unread_unpinned_dataset_makes_room() {
        let book: TierBook<Fake> = TierBook::new(100);
        let (a, b, c) = (key("/a", 1), key("/b", 2), key("/c", 3));
        drop(acquire(&book, &a, 40));
        drop(acquire(&book, &b, 40));
        // `a` used again: `b` is now the least recently used.
        drop(acquire(&book, &a, 40));
        assert!(matches!(acquire(&book, &c, 40), Acquired::Admitted(_)));
        let report = book.report();
        let dirs: Vec<_> = report.datasets.iter().map(|d| d.dir.clone()).collect();
        assert_eq!(dirs, vec![PathBuf::from("/a"), PathBuf::from("/c")]);
        assert_eq!(report.evictions, 1);
        assert_eq!(report.held_bytes, 80);
    }

    #[test]
    fn pinned_and_read_datasets_are_not_evicted_for_room() {
        let book: TierBook<Fake> = TierBook::new(100);
        let (a, b, c) = (key("/a", 1), key("/b", 2), key("/c", 3));
        book.set_pinned(Path::new("/a"), true).unwrap();
        drop(acquire(&book, &a, 50));
        let Acquired::Admitted(read) = acquire(&book, &b, 50) else {
            panic!("admitted")
        };
        // `a` pinned, `b` read by a stream: no room for `c`, which is served without the tier.
        assert!(matches!(acquire(&book, &c, 50), Acquired::None));
        assert_eq!(book.report().declined, 1);
        drop(read);
        assert!(matches!(acquire(&book, &c, 50), Acquired::Admitted(_)));
        let report = book.report();
        assert!(report
            .datasets
            .iter()
            .any(|d| d.dir == Path::new("/a") && d.pinned));
        assert!(!report.datasets.iter().any(|d| d.dir == Path::new("/b")));
    }

    #[test]
    fn eviction_while_read_retires_until_the_stream_closes() {
        let book: TierBook<Fake> = TierBook::new(100);
        let (a, b) = (key("/a", 1), key("/b", 2));
        let Acquired::Admitted(stream) = acquire(&book, &a, 70) else {
            panic!("admitted")
        };
        book.evict(Path::new("/a")).unwrap();
        let report = book.report();
        assert_eq!(report.datasets[0].state, "retiring");
        assert_eq!(report.held_bytes, 70, "still read: still held");
        // New streams do not find it, and its bytes still count against the budget.
        assert!(matches!(acquire(&book, &b, 70), Acquired::None));
        drop(stream);
        assert_eq!(book.report().held_bytes, 0);
        assert!(matches!(acquire(&book, &b, 70), Acquired::Admitted(_)));
        assert_eq!(
            book.evict(Path::new("/nothing")),
            Err(TierError::NotResident(PathBuf::from("/nothing")))
        );
    }

    /// A dataset is released only when no more streams than said hold it: the tier's reference is
    /// handed back (the caller frees it after the book's lock), and the dataset is gone from the
    /// book; while a reader it did not count holds it, it stays.
    #[test]
    fn a_dataset_is_released_only_when_unread() {
        let book: TierBook<Fake> = TierBook::new(100);
        let a = key("/a", 1);
        assert!(book.release_unread(&a, 0).is_none(), "not in the book");
        let Acquired::Admitted(first) = acquire(&book, &a, 60) else {
            panic!("admitted")
        };
        let Acquired::Found(second) = acquire(&book, &a, 60) else {
            panic!("found")
        };
        assert!(book.contains(&a));
        // Two readers: not released for one, nor for none.
        assert!(book.release_unread(&a, 1).is_none());
        assert!(book.release_unread(&a, 0).is_none());
        drop(second);
        // One reader left, about to close: released, reported retiring until it does.
        let released = book.release_unread(&a, 1).expect("released");
        assert!(!book.contains(&a));
        assert_eq!(book.report().datasets[0].state, "retiring");
        drop(released);
        drop(first);
        assert_eq!(book.report().held_bytes, 0);
        // No reader: released outright, nothing retiring.
        let Acquired::Admitted(again) = acquire(&book, &a, 60) else {
            panic!("admitted again")
        };
        drop(again);
        let released = book.release_unread(&a, 0).expect("released");
        assert!(book.report().datasets.is_empty());
        assert_eq!(Arc::strong_count(&released), 1, "the last reference");
    }

    #[test]
    fn a_repacked_dataset_replaces_its_old_copy() {
        let book: TierBook<Fake> = TierBook::new(100);
        drop(acquire(&book, &key("/a", 1), 60));
        assert!(matches!(
            acquire(&book, &key("/a", 2), 60),
            Acquired::Admitted(_)
        ));
        let report = book.report();
        assert_eq!(report.datasets.len(), 1);
        assert_eq!(report.evictions, 1);
    }

    /// Closed datasets are due once each, the later time kept, and taken out when due.
    #[test]
    fn closed_held_datasets_are_due_once_each() {
        let start = std::time::Instant::now();
        let second = std::time::Duration::from_secs(1);
        let (a, b) = (key("/a", 1), key("/b", 2));
        let mut closed = ClosedHeld::default();
        assert!(closed.is_empty());
        closed.closed(&a, start + 2 * second);
        closed.closed(&b, start + 3 * second);
        // Closed again later: due later, still one entry.
        closed.closed(&a, start + 4 * second);
        closed.closed(&a, start + second);
        assert_eq!(closed.take_due(start), (vec![], Some(start + 3 * second)));
        assert_eq!(
            closed.take_due(start + 3 * second),
            (vec![b.clone()], Some(start + 4 * second))
        );
        assert_eq!(closed.take_due(start + 5 * second), (vec![a.clone()], None));
        assert!(closed.is_empty());
        closed.closed(&b, start);
        closed.forget(&b);
        assert!(closed.is_empty());
    }

    #[test]
    fn a_pin_before_the_first_stream_is_reported() {
        let book: TierBook<Fake> = TierBook::new(100);
        book.set_pinned(Path::new("/a"), true).unwrap();
        let report = book.report();
        assert_eq!(report.datasets[0].state, "pinned");
        book.evict(Path::new("/a")).unwrap();
        assert!(book.report().datasets.is_empty());
    }
}
