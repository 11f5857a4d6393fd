//! Registered page-cache windows of one device, shared by every reader of that device.
//!
//! The page-cache path copies shard bytes straight from a memory map of the shard that is registered
//! with the driver (`cuMemHostRegister`, read-only). Registering costs 5 to 7.5 ms per 256 MiB window
//! and unregistering 2 to 2.5 ms, during which the driver also waits for the device's queued work
//! (measured on the H100 box with `examples/register_probe.rs`): together as long as copying 500 MiB
//! at the PCIe limit, so registrations are kept across reads, across streams and across consumers: the windows of
//! a dataset read in one epoch are still registered when the next epoch (or the next consumer) reads
//! them. The registered bytes are bounded (they are locked in memory): least recently used windows are
//! unregistered first, and only once every copy that reads them has completed.
//!
//! A window keeps the mapping it lies in alive, so a shard removed from disk while registered keeps its
//! pages until the window is evicted (bounded like every other window). Registered pages are locked:
//! the kernel cannot reclaim them under memory pressure, and `echo 3 > /proc/sys/vm/drop_caches` does
//! not drop them (a cold-read measurement needs a fresh daemon). The bound (the registry's
//! `registered_bytes_max`, the daemon's `--registered-memory-max`) is what the daemon may hold locked.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::Mmap;

use super::residency::ResidencyMap;
use super::IO_ALIGN_BYTES;
use crate::device::ffi::{mem_host_register_read_only, mem_host_unregister};
use crate::device::{Device, DeviceError, DriverCallError, Event, EventTiming, Stream};

/// Shard mappings kept for residency checks and registration before unused ones are dropped.
const MAPPED_FILES_MAX: usize = 1024;

/// A file's identity across file tables and readers: its device and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileKey {
    dev: u64,
    ino: u64,
}

impl FileKey {
    /// The identity of an open file.
    pub fn of(file: &File) -> std::io::Result<FileKey> {
        let metadata = file.metadata()?;
        Ok(FileKey {
            dev: metadata.dev(),
            ino: metadata.ino(),
        })
    }
}

/// A read-only mapping of a shard, and its residency map.
struct Mapped {
    map: Mmap,
    residency: ResidencyMap,
}

/// Names a registered window: the shard file and the window's index in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WindowId {
    file: FileKey,
    index: u64,
}

/// A range of a shard that a kernel may read straight from host memory (see
/// [`PageCacheWindows::map`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    /// The window the range lies in, pinned until [`PageCacheWindows::record_reads`].
    pub window: WindowId,
    /// Device address of the window's first byte.
    pub window_device_ptr: u64,
    /// Host address of the window's first byte (registered memory: a source for the copy engines
    /// while the window stays pinned).
    pub window_host_addr: usize,
    /// Length of the window in bytes.
    pub window_bytes: u64,
    /// Offset of the range's first byte in the window.
    pub offset_in_window: u64,
}

/// Most blocks a window remembers as verified (a 256 MiB window holds 4096 blocks of 64 KiB).
const VERIFIED_PER_WINDOW_MAX: usize = 1 << 16;

/// One page in this many bytes is asked about when a window is judged resident before it is
/// registered for a copy (`ResidencyMap::resident_fraction_sampled`): 64 pages of a 64 MiB window.
const RESIDENCY_SAMPLE_STRIDE: usize = 1 << 20;

/// One registered window of a shard mapping.
struct Window {
    file: FileKey,
    index: u64,
    ptr: *const u8,
    /// The window's address for kernels (registered with `DEVICEMAP`).
    device_ptr: u64,
    bytes: usize,
    last_use: u64,
    /// Rounds being planned or queued that read this window directly (see
    /// [`PageCacheWindows::map`]): a pinned window is never evicted.
    pins: u32,
    /// File offsets of blocks whose checksum a kernel verified while this window was registered.
    /// The pages are locked and shards are immutable, so the mark holds until the window goes; every
    /// stream on the device shares it.
    verified: std::collections::HashSet<u64>,
    /// Per reader, an event recorded on its stream after its last copy from this window.
    copies_done: Vec<(u64, Event)>,
    /// Registered for a loader's copy beyond the budget: unregistered when the last pin goes (see
    /// [`PageCacheWindows::map_for_copy`]).
    transient: bool,
    /// Keeps the registered pages mapped.
    _mapped: Arc<Mapped>,
}

struct Registry {
    maps: HashMap<FileKey, Arc<Mapped>>,
    windows: Vec<Window>,
    /// Bytes of the registered windows and of those the worker is registering.
    registered_bytes: usize,
    /// Windows the worker is registering (ahead of the reads), by file and index.
    registering: std::collections::HashSet<(FileKey, u64)>,
    clock: u64,
    /// Files whose windows cannot be registered, with the reason (logged once).
    refused: HashMap<FileKey, DriverCallError>,
}

/// Windows registered ahead of a sequential scan, past the one it reads.
const WINDOWS_AHEAD: u64 = 2;
/// Registrations queued for the register-ahead worker at most.
const AHEAD_QUEUE_MAX: usize = 8;
/// Fraction of a window's pages that must be resident for it to be registered ahead (registering
/// faults the rest in from disk on the worker: a cold window is left to the cold path).
const AHEAD_RESIDENT_MIN: f64 = 0.95;

/// A window for the register-ahead worker.
struct Ahead {
    key: FileKey,
    mapped: Arc<Mapped>,
    index: u64,
    start: usize,
    bytes: usize,
}

/// What the readers and the register-ahead worker share.
struct Shared {
    device: Device,
    registered_bytes_max: usize,
    registry: Mutex<Registry>,
    /// Notified whenever the worker finishes (or gives up) a registration.
    registered: std::sync::Condvar,
}

// SAFETY: the raw window pointers point into mappings the registry owns (through `Mapped`), and every
// access to them goes through the mutex.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// The registered page-cache windows of one device (see the module documentation).
///
/// A sequential scan (the page-cache path in dataset order) would wait for each window's
/// registration (about 9 ms per 256 MiB) before copying from it; instead, a worker thread registers
/// the next [`WINDOWS_AHEAD`] windows of a file while the current one is read, evicting the least
/// recently used windows behind the reads, so that a dataset larger than the budget streams through
/// it without the filler registering anything itself.
pub struct PageCacheWindows {
    device: Device,
    window_bytes: usize,
    registered_bytes_max: usize,
    next_reader: AtomicU64,
    shared: Arc<Shared>,
    ahead: Mutex<Option<std::sync::mpsc::SyncSender<Ahead>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Where a loader copies a window from (see [`PageCacheWindows::map_for_copy`]): a pinned window.
pub struct CopySource {
    range: MappedRange,
    transient: bool,
}

impl CopySource {
    /// The host address of the requested range's first byte (registered memory).
    pub fn host_addr(&self) -> usize {
        self.range.window_host_addr + self.range.offset_in_window as usize
    }

    /// Whether the window was registered for this copy only (unregistered when released).
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

/// What [`PageCacheWindows::copy`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowCopy {
    /// The copies are queued on the reader's stream.
    Queued,
    /// The file cannot be mapped or registered (the reason was logged): use another path.
    Unavailable,
}

impl PageCacheWindows {
    /// Bytes registered for the window starting at `window_start` of a file of `file_len` bytes: the
    /// window, cut at the end of the file and rounded up to a page (the mapping covers whole pages,
    /// and `cuMemHostRegister` wants page-granular ranges).
    fn registered_len(&self, window_start: usize, file_len: usize) -> usize {
        self.window_bytes
            .min(file_len - window_start)
            .div_ceil(IO_ALIGN_BYTES as usize)
            * IO_ALIGN_BYTES as usize
    }

    /// An empty registry for `device`: windows of `window_bytes` (a multiple of the page size), at most
    /// `registered_bytes_max` registered at once.
    pub fn new(device: &Device, window_bytes: usize, registered_bytes_max: usize) -> Self {
        assert!(window_bytes > 0 && window_bytes % IO_ALIGN_BYTES as usize == 0);
        let shared = Arc::new(Shared {
            device: device.clone(),
            registered_bytes_max,
            registry: Mutex::new(Registry {
                maps: HashMap::new(),
                windows: Vec::new(),
                registered_bytes: 0,
                registering: std::collections::HashSet::new(),
                clock: 0,
                refused: HashMap::new(),
            }),
            registered: std::sync::Condvar::new(),
        });
        // Registering ahead needs room for the window being read, the ones ahead and one to spare.
        let (ahead, worker) = if registered_bytes_max >= (WINDOWS_AHEAD as usize + 2) * window_bytes
        {
            let (sender, receiver) = std::sync::mpsc::sync_channel(AHEAD_QUEUE_MAX);
            let worker_shared = Arc::clone(&shared);
            let worker = std::thread::Builder::new()
                .name("gpufeed-register-ahead".into())
                .spawn(move || register_ahead(&worker_shared, &receiver))
                .ok();
            (worker.is_some().then_some(sender), worker)
        } else {
            (None, None)
        };
        PageCacheWindows {
            device: device.clone(),
            window_bytes,
            registered_bytes_max,
            next_reader: AtomicU64::new(1),
            shared,
            ahead: Mutex::new(ahead),
            worker: Mutex::new(worker),
        }
    }

    /// A new reader identity, for [`Self::copy`] and [`Self::forget_reader`].
    pub fn reader_id(&self) -> u64 {
        self.next_reader.fetch_add(1, Ordering::Relaxed)
    }

    /// Bytes registered now.
    pub fn registered_bytes(&self) -> usize {
        self.lock().registered_bytes
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.shared.lock()
    }

    /// Whether `offset .. offset + len` of `file` is resident: covered by registered windows (whose
    /// pages are locked in memory), else at least `fraction_min` of its pages per `mincore`.
    pub fn resident(&self, file: &File, offset: u64, len: usize, fraction_min: f64) -> bool {
        let Ok(key) = FileKey::of(file) else {
            return false;
        };
        let window_bytes = self.window_bytes as u64;
        let first = offset / window_bytes;
        let last = (offset + len.max(1) as u64 - 1) / window_bytes;
        let mut registry = self.lock();
        if (first..=last).all(|index| {
            registry
                .windows
                .iter()
                .any(|w| w.file == key && w.index == index)
        }) {
            return true;
        }
        match Self::mapped(&mut registry, key, file) {
            Some(mapped) => mapped
                .residency
                .resident_fraction(offset as usize, len)
                .is_ok_and(|f| f >= fraction_min),
            None => false,
        }
    }

    fn mapped(registry: &mut Registry, key: FileKey, file: &File) -> Option<Arc<Mapped>> {
        if let Some(mapped) = registry.maps.get(&key) {
            return Some(Arc::clone(mapped));
        }
        // SAFETY: read-only mapping of a shard, which gpufeed never modifies after its manifest exists;
        // the mapping lives as long as the registry entry or a window that uses it.
        let map = unsafe { Mmap::map(file) }.ok()?;
        let residency = ResidencyMap::new(file).ok()?;
        let mapped = Arc::new(Mapped { map, residency });
        if registry.maps.len() >= MAPPED_FILES_MAX {
            // Mappings no window uses are only a cache of `mmap` calls: drop them, so that the files of
            // removed datasets are released.
            registry.maps.retain(|_, m| Arc::strong_count(m) > 1);
        }
        registry.maps.insert(key, Arc::clone(&mapped));
        Some(mapped)
    }

    /// Queues on `stream` (reader `reader`'s) copies of `len` bytes at `offset` of `file` to the device
    /// address `dest`, from registered windows (registering them, and evicting old ones, as needed).
    ///
    /// # Safety
    /// `dest .. dest + len` is device memory that nothing else writes or reads until the copies queued
    /// on `stream` have completed; the device's context is current.
    pub unsafe fn copy(
        &self,
        reader: u64,
        stream: &Stream,
        file: &File,
        offset: u64,
        len: usize,
        dest: u64,
    ) -> Result<WindowCopy, DeviceError> {
        let Ok(key) = FileKey::of(file) else {
            return Ok(WindowCopy::Unavailable);
        };
        let mut registry = self.lock();
        if registry.refused.contains_key(&key) {
            return Ok(WindowCopy::Unavailable);
        }
        let Some(mapped) = Self::mapped(&mut registry, key, file) else {
            return Ok(WindowCopy::Unavailable);
        };
        let file_len = mapped.map.len();
        if offset as usize + len > file_len {
            return Ok(WindowCopy::Unavailable);
        }
        let window_bytes = self.window_bytes;
        let mut done = 0usize;
        while done < len {
            let at = offset as usize + done;
            let index = (at / window_bytes) as u64;
            let window_start = index as usize * window_bytes;
            let window_len = self.registered_len(window_start, file_len);
            let piece = (len - done).min(window_start + window_len - at);
            debug_assert!(piece > 0);
            let (guard, slot) =
                self.window(registry, key, &mapped, index, window_start, window_len)?;
            registry = guard;
            let Some(slot) = slot else {
                return Ok(WindowCopy::Unavailable);
            };
            let window = &mut registry.windows[slot];
            // SAFETY: the source lies within the registered window, which stays registered until this
            // reader's `copies_done` event (recorded below) has completed; the caller vouches for the
            // destination.
            unsafe {
                crate::device::ffi::memcpy_htod_async(
                    dest + done as u64,
                    window.ptr.add(at - window_start),
                    piece,
                    stream.raw(),
                )
            }?;
            window.record_copy_done(reader, stream)?;
            done += piece;
        }
        Ok(WindowCopy::Queued)
    }

    /// The key of `file` and the index and first byte of the window that holds `len` bytes at
    /// `offset`; `None` when the file has no key, the range is empty or it crosses a window
    /// boundary (what [`Self::map`] and [`Self::map_for_copy`] then leave to staging).
    fn window_of(&self, file: &File, offset: u64, len: usize) -> Option<(FileKey, u64, usize)> {
        let key = FileKey::of(file).ok()?;
        let index = offset / self.window_bytes as u64;
        let start = index as usize * self.window_bytes;
        (len != 0 && offset as usize + len <= start + self.window_bytes)
            .then_some((key, index, start))
    }

    /// Maps `len` bytes at `offset` of `file` for a kernel to read straight from host memory: the
    /// range's window is registered (if its pages are resident, per `fraction_min` of `mincore`, or
    /// it is registered already) and pinned until [`Self::record_reads`] for `reader`. `None` when the
    /// range crosses a window boundary, the window is not resident, or every registered window is
    /// pinned and the budget is full: stage the bytes instead.
    pub fn map(
        &self,
        file: &File,
        offset: u64,
        len: usize,
        fraction_min: f64,
    ) -> Result<Option<MappedRange>, DeviceError> {
        let Some((key, index, window_start)) = self.window_of(file, offset, len) else {
            return Ok(None);
        };
        let mut registry = self.lock();
        if registry.refused.contains_key(&key) {
            return Ok(None);
        }
        let known = registry
            .windows
            .iter()
            .any(|w| w.file == key && w.index == index);
        // A range beyond the end of the mapping is staged instead, like any other refusal.
        let Some(mapped) = Self::mapped(&mut registry, key, file)
            .filter(|mapped| offset as usize + len <= mapped.map.len())
        else {
            return Ok(None);
        };
        let file_len = mapped.map.len();
        let window_len = self.registered_len(window_start, file_len);
        if !known
            && !mapped
                .residency
                .resident_fraction(window_start, window_len.min(file_len - window_start))
                .is_ok_and(|f| f >= fraction_min)
        {
            // Registering faults every page of the window in: a cold window is read by the cold
            // path, which reads only what is needed.
            return Ok(None);
        }
        let (mut registry, slot) =
            self.window(registry, key, &mapped, index, window_start, window_len)?;
        let Some(slot) = slot else {
            return Ok(None);
        };
        let window = &mut registry.windows[slot];
        window.pins += 1;
        Ok(Some(window.range(offset - window_start as u64)))
    }

    /// Records on `stream` (reader `reader`'s) that the kernels reading `windows` directly have been
    /// queued, and unpins them: each stays registered until that point of the stream has passed.
    /// Every window was pinned by one [`Self::map`] call.
    pub fn record_reads(
        &self,
        reader: u64,
        stream: &Stream,
        windows: &[WindowId],
    ) -> Result<(), DeviceError> {
        let mut registry = self.lock();
        for id in windows {
            let Some(window) = registry
                .windows
                .iter_mut()
                .find(|w| w.file == id.file && w.index == id.index)
            else {
                // Only dropping the registry removes a pinned window.
                continue;
            };
            window.pins -= 1;
            window.record_copy_done(reader, stream)?;
        }
        Ok(())
    }

    /// Whether the block stored at `offset` of the file of `window` was verified while the window has
    /// been registered.
    pub fn is_verified(&self, window: WindowId, offset: u64) -> bool {
        self.lock()
            .windows
            .iter()
            .find(|w| w.file == window.file && w.index == window.index)
            .is_some_and(|w| w.verified.contains(&offset))
    }

    /// Marks the block stored at `offset` of the file of `window` as verified (a kernel found its
    /// checksum right), for every stream of the device, while the window stays registered.
    pub fn mark_verified(&self, window: WindowId, offset: u64) {
        let mut registry = self.lock();
        if let Some(w) = registry
            .windows
            .iter_mut()
            .find(|w| w.file == window.file && w.index == window.index)
        {
            if w.verified.len() < VERIFIED_PER_WINDOW_MAX {
                w.verified.insert(offset);
            }
        }
    }

    /// The most bytes this registry keeps registered.
    pub fn registered_bytes_max(&self) -> usize {
        self.registered_bytes_max
    }

    /// The size of a window: a range that [`Self::map`] maps lies within one.
    pub fn window_bytes(&self) -> u64 {
        self.window_bytes as u64
    }

    /// Where a loader copies `len` bytes at `offset` of `file` (within one window) from, for a copy
    /// by the copy engines (see `pipeline::gpu::shard_loader`): the window, pinned, registering it if
    /// needed. A window registered here stays in the registry when that leaves `keep_free` bytes of
    /// the budget free; otherwise it is transient (least recently used windows are evicted to make
    /// room for it) and is unregistered as soon as the last holder releases it. The caller hands it
    /// back to [`Self::release_copy_source`] once its copy is complete. Unlike [`Self::map`], nothing
    /// is registered ahead. `None` when the window is not resident (per `fraction_min`), the file
    /// cannot be registered, pinned windows fill the budget, or the window would be transient and
    /// `transient_ok` is false (the caller copies it another way).
    pub fn map_for_copy(
        &self,
        file: &File,
        offset: u64,
        len: usize,
        fraction_min: f64,
        keep_free: usize,
        transient_ok: bool,
    ) -> Result<Option<CopySource>, DeviceError> {
        let Some((key, index, start)) = self.window_of(file, offset, len) else {
            return Ok(None);
        };
        let mut registry = self.lock();
        // A range beyond the end of the mapping is staged instead, like any other refusal.
        let Some(mapped) = Self::mapped(&mut registry, key, file)
            .filter(|mapped| offset as usize + len <= mapped.map.len())
        else {
            return Ok(None);
        };
        let file_len = mapped.map.len();
        // Being registered by the register-ahead worker: wait for it.
        while registry.registering.contains(&(key, index)) {
            registry = self
                .shared
                .registered
                .wait(registry)
                .expect("page-cache registry poisoned");
        }
        if registry.refused.contains_key(&key) {
            return Ok(None);
        }
        registry.clock += 1;
        let clock = registry.clock;
        let bytes = self.registered_len(start, file_len);
        let known = registry
            .windows
            .iter()
            .position(|w| w.file == key && w.index == index);
        let slot = match known {
            Some(slot) => slot,
            None => {
                // The budget first: a loader with copy threads asks once per pinned buffer's worth
                // of a window the budget has no room for, and the residency of a whole window
                // (a `mincore` over it) costs milliseconds.
                let transient =
                    registry.registered_bytes + bytes + keep_free > self.registered_bytes_max;
                if transient && !transient_ok {
                    return Ok(None);
                }
                // Sampled: a whole count walks every page of the window, milliseconds per window
                // registered for one copy, on the loader's thread between its copies.
                let resident = mapped
                    .residency
                    .resident_fraction_sampled(
                        start,
                        bytes.min(file_len - start),
                        RESIDENCY_SAMPLE_STRIDE,
                    )
                    .is_ok_and(|f| f >= fraction_min);
                if !resident {
                    return Ok(None);
                }
                let registered =
                    self.register(&mut registry, key, &mapped, index, start, bytes, clock)?;
                let Some(slot) = registered else {
                    return Ok(None);
                };
                registry.windows[slot].transient = transient;
                slot
            }
        };
        let window = &mut registry.windows[slot];
        window.pins += 1;
        window.last_use = clock;
        Ok(Some(CopySource {
            range: window.range(offset - start as u64),
            transient: window.transient,
        }))
    }

    /// Hands back what [`Self::map_for_copy`] gave, once the copy from it has completed: the window
    /// is unpinned, and a transient window nothing else pins is unregistered (the driver waits for
    /// the device's queued work first, so the caller releases it before queueing more copies).
    pub fn release_copy_source(&self, source: CopySource) {
        let id = source.range.window;
        let mut registry = self.lock();
        let Some(slot) = registry
            .windows
            .iter()
            .position(|w| w.file == id.file && w.index == id.index)
        else {
            return;
        };
        let window = &mut registry.windows[slot];
        window.pins -= 1;
        if !(window.transient && window.pins == 0) {
            return;
        }
        let window = registry.windows.swap_remove(slot);
        registry.registered_bytes -= window.bytes;
        // Marked busy until the driver has unregistered it: a thread registering the same range in
        // between would be refused (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED); it waits instead.
        registry.registering.insert((id.file, id.index));
        drop(registry);
        if let Err(error) = unregister(window) {
            tracing::warn!("unregistering a page-cache window failed: {error}");
        }
        self.lock().registering.remove(&(id.file, id.index));
        self.shared.registered.notify_all();
    }

    /// Unpins windows that [`Self::map`] pinned for work that was never queued.
    pub fn unpin(&self, windows: &[WindowId]) {
        let mut registry = self.lock();
        for id in windows {
            if let Some(window) = registry
                .windows
                .iter_mut()
                .find(|w| w.file == id.file && w.index == id.index)
            {
                window.pins -= 1;
            }
        }
    }

    /// The registered window `index` of `key`, registering it (and evicting old ones) if needed, and
    /// waiting for it if the worker is registering it; queues the windows after it for the worker.
    /// `None` when it cannot be registered.
    #[allow(clippy::type_complexity)]
    fn window<'a>(
        &'a self,
        mut registry: MutexGuard<'a, Registry>,
        key: FileKey,
        mapped: &Arc<Mapped>,
        index: u64,
        start: usize,
        bytes: usize,
    ) -> Result<(MutexGuard<'a, Registry>, Option<usize>), DeviceError> {
        while registry.registering.contains(&(key, index)) {
            registry = self
                .shared
                .registered
                .wait(registry)
                .expect("page-cache registry poisoned");
        }
        registry.clock += 1;
        let clock = registry.clock;
        let found = registry
            .windows
            .iter()
            .position(|w| w.file == key && w.index == index);
        let slot = match found {
            Some(slot) => {
                registry.windows[slot].last_use = clock;
                Some(slot)
            }
            None => self.register(&mut registry, key, mapped, index, start, bytes, clock)?,
        };
        if slot.is_some() {
            self.queue_ahead(&mut registry, key, mapped, index);
        }
        Ok((registry, slot))
    }

    /// Registers window `index` of `key` on the calling thread, evicting least recently used
    /// unpinned windows to make room.
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        registry: &mut Registry,
        key: FileKey,
        mapped: &Arc<Mapped>,
        index: u64,
        start: usize,
        bytes: usize,
        clock: u64,
    ) -> Result<Option<usize>, DeviceError> {
        let Some(evicted) = make_room(registry, bytes, self.registered_bytes_max) else {
            return Ok(None);
        };
        for window in evicted {
            unregister(window)?;
        }
        // SAFETY: `start .. start + bytes` lies within the live mapping (page aligned, as windows start
        // at multiples of window_bytes, itself a multiple of the page size), which the window keeps
        // alive for as long as it is registered; the device's context is current (the caller's).
        let ptr = unsafe { mapped.map.as_ptr().add(start) };
        // SAFETY: as above.
        let device_ptr = match unsafe { mem_host_register_read_only(ptr, bytes) } {
            Ok(device_ptr) => device_ptr,
            Err(reason) if reason.is_already_registered() => {
                // Another registration of these pages (outside this registry) still holds them:
                // this window takes the other path this time, the file is not refused.
                tracing::debug!("page-cache window {index} already registered: {reason}");
                return Ok(None);
            }
            Err(reason) => {
                tracing::warn!(
                    "page-cache path unavailable for a shard: {reason}; using the cold path"
                );
                registry.refused.insert(key, reason);
                return Ok(None);
            }
        };
        registry.registered_bytes += bytes;
        registry.windows.push(Window::new(
            key, index, ptr, device_ptr, bytes, clock, mapped,
        ));
        Ok(Some(registry.windows.len() - 1))
    }

    /// Queues for the worker the windows after `index` of `key` that are not registered yet, if the
    /// window before `index` is registered (the file is being read in sequence).
    fn queue_ahead(&self, registry: &mut Registry, key: FileKey, mapped: &Arc<Mapped>, index: u64) {
        let scanning = index > 0
            && registry
                .windows
                .iter()
                .any(|w| w.file == key && w.index == index - 1);
        if !scanning {
            return;
        }
        let sender = self.ahead.lock().expect("register-ahead sender poisoned");
        let Some(sender) = sender.as_ref() else {
            return;
        };
        let file_len = mapped.map.len();
        for next in index + 1..=index + WINDOWS_AHEAD {
            let start = next as usize * self.window_bytes;
            if start >= file_len
                || registry.registering.contains(&(key, next))
                || registry
                    .windows
                    .iter()
                    .any(|w| w.file == key && w.index == next)
            {
                continue;
            }
            let bytes = self.registered_len(start, file_len);
            let job = Ahead {
                key,
                mapped: Arc::clone(mapped),
                index: next,
                start,
                bytes,
            };
            if sender.try_send(job).is_err() {
                return;
            }
            registry.registering.insert((key, next));
        }
    }

    /// Drops reader `reader`'s events (its stream must be drained first): called when a reader goes.
    pub fn forget_reader(&self, reader: u64) {
        let mut registry = self.lock();
        for window in &mut registry.windows {
            window.copies_done.retain(|(r, _)| *r != reader);
        }
    }

    /// Unregisters every window (after its copies) and forgets every mapping, e.g. when a dataset's
    /// shards are removed.
    pub fn clear(&self) -> Result<(), DeviceError> {
        self.device.bind()?;
        let mut registry = self.lock();
        registry.registered_bytes = 0;
        registry.maps.clear();
        for window in std::mem::take(&mut registry.windows) {
            unregister(window)?;
        }
        Ok(())
    }
}

impl Drop for PageCacheWindows {
    fn drop(&mut self) {
        // Stop the worker first: it must not register a window after the registry is cleared.
        drop(self.ahead.lock().map(|mut sender| sender.take()));
        if let Some(worker) = self.worker.lock().ok().and_then(|mut w| w.take()) {
            let _ = worker.join();
        }
        let _ = self.clear();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().expect("page-cache registry poisoned")
    }
}

impl Window {
    /// The range at `offset_in_window` of this window.
    fn range(&self, offset_in_window: u64) -> MappedRange {
        MappedRange {
            window: WindowId {
                file: self.file,
                index: self.index,
            },
            window_device_ptr: self.device_ptr,
            window_host_addr: self.ptr as usize,
            window_bytes: self.bytes as u64,
            offset_in_window,
        }
    }

    /// Records on `stream` that `reader`'s copies from this window so far are queued: its event,
    /// made on its first copy, is recorded again.
    fn record_copy_done(&mut self, reader: u64, stream: &Stream) -> Result<(), DeviceError> {
        let event = match self.copies_done.iter().position(|(r, _)| *r == reader) {
            Some(i) => &self.copies_done[i].1,
            None => {
                let event = Event::new(stream.device(), EventTiming::Disabled)?;
                self.copies_done.push((reader, event));
                &self.copies_done.last().expect("just pushed").1
            }
        };
        event.record(stream)
    }

    fn new(
        file: FileKey,
        index: u64,
        ptr: *const u8,
        device_ptr: u64,
        bytes: usize,
        last_use: u64,
        mapped: &Arc<Mapped>,
    ) -> Window {
        Window {
            file,
            index,
            ptr,
            device_ptr,
            bytes,
            last_use,
            pins: 0,
            verified: std::collections::HashSet::new(),
            copies_done: Vec::new(),
            transient: false,
            _mapped: Arc::clone(mapped),
        }
    }
}

/// Takes out of `registry` the least recently used unpinned windows until `bytes` more fit under
/// `bytes_max` (their bytes no longer counted), for the caller to unregister; `None` (nothing taken)
/// when pinned windows leave no room.
fn make_room(registry: &mut Registry, bytes: usize, bytes_max: usize) -> Option<Vec<Window>> {
    let mut evicted = Vec::new();
    while registry.registered_bytes + bytes > bytes_max {
        // Pinned windows are read by queued kernels without a copy: never evicted.
        let oldest = registry
            .windows
            .iter()
            .enumerate()
            .filter(|(_, w)| w.pins == 0)
            .min_by_key(|(_, w)| w.last_use)
            .map(|(i, _)| i);
        let Some(oldest) = oldest else {
            for window in evicted.drain(..) {
                let window: Window = window;
                registry.registered_bytes += window.bytes;
                registry.windows.push(window);
            }
            return None;
        };
        let window = registry.windows.swap_remove(oldest);
        registry.registered_bytes -= window.bytes;
        evicted.push(window);
    }
    Some(evicted)
}

/// Unregisters `window` once every copy from it has completed.
fn unregister(window: Window) -> Result<(), DeviceError> {
    for (_, event) in &window.copies_done {
        event.synchronize()?;
    }
    // SAFETY: registered by this registry, and no copy from it is in flight any more.
    if let Err(reason) = unsafe { mem_host_unregister(window.ptr) } {
        tracing::warn!("unregistering a page-cache window failed: {reason}");
    }
    Ok(())
}

/// The register-ahead worker: registers the windows queued by [`PageCacheWindows::queue_ahead`],
/// evicting behind the reads, until the queue's sender is dropped.
fn register_ahead(shared: &Shared, jobs: &std::sync::mpsc::Receiver<Ahead>) {
    let bound = shared.device.bind();
    for job in jobs {
        let registered = bound.is_ok() && register_one(shared, &job);
        let mut registry = shared.lock();
        registry.registering.remove(&(job.key, job.index));
        if !registered {
            registry.registered_bytes -= job.bytes;
        }
        drop(registry);
        shared.registered.notify_all();
    }
}

/// Registers one window for the worker. Its bytes are counted (reserved) while it registers; the
/// caller un-counts them if this returns false.
fn register_one(shared: &Shared, job: &Ahead) -> bool {
    let resident = job
        .mapped
        .residency
        .resident_fraction(job.start, job.bytes.min(job.mapped.map.len() - job.start))
        .is_ok_and(|f| f >= AHEAD_RESIDENT_MIN);
    let mut registry = shared.lock();
    if !resident || registry.refused.contains_key(&job.key) {
        registry.registered_bytes += job.bytes;
        return false;
    }
    let Some(evicted) = make_room(&mut registry, job.bytes, shared.registered_bytes_max) else {
        registry.registered_bytes += job.bytes;
        return false;
    };
    registry.registered_bytes += job.bytes;
    // The evicted windows are marked busy until unregistered (see `release_copy_source`).
    let busy: Vec<(FileKey, u64)> = evicted.iter().map(|w| (w.file, w.index)).collect();
    registry.registering.extend(busy.iter().copied());
    drop(registry);
    let mut unregistered = true;
    for window in evicted {
        unregistered &= unregister(window).is_ok();
    }
    let mut registry = shared.lock();
    for id in &busy {
        registry.registering.remove(id);
    }
    drop(registry);
    shared.registered.notify_all();
    if !unregistered {
        return false;
    }
    // SAFETY: `job.start .. job.start + job.bytes` lies within the live mapping `job.mapped` (page
    // aligned), kept alive by the window for as long as it is registered; this thread's context is
    // the device's (bound above); no other thread registers this window (it is in `registering`).
    let ptr = unsafe { job.mapped.map.as_ptr().add(job.start) };
    // SAFETY: as above.
    let device_ptr = match unsafe { mem_host_register_read_only(ptr, job.bytes) } {
        Ok(device_ptr) => device_ptr,
        Err(reason) => {
            tracing::debug!(
                "registering page-cache window {} ahead failed: {reason}",
                job.index
            );
            return false;
        }
    };
    let mut registry = shared.lock();
    registry.clock += 1;
    let clock = registry.clock;
    let window = Window::new(
        job.key,
        job.index,
        ptr,
        device_ptr,
        job.bytes,
        clock,
        &job.mapped,
    );
    registry.windows.push(window);
    true
}
