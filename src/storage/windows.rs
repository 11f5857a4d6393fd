//! Registered page-cache windows of one device, shared by every reader of that device.
//!
//! The page-cache path copies shard bytes straight from a memory map of the shard that is registered
//! with the driver (`cuMemHostRegister`, read-only). Registering costs about 9 ms per 256 MiB window
//! (measured on the H100 box: 0.15 s for 4 GiB), which is as long as copying 500 MiB at the PCIe
//! limit, so registrations are kept across reads, across streams and across consumers: the windows of
//! a dataset read in one epoch are still registered when the next epoch (or the next consumer) reads
//! them. The registered bytes are bounded (they are locked in memory): least recently used windows are
//! unregistered first, and only once every copy that reads them has completed.
//!
//! A window keeps the mapping it lies in alive, so a shard removed from disk while registered keeps its
//! pages until the window is evicted (bounded like every other window). Registered pages are locked:
//! the kernel cannot reclaim them under memory pressure, and `echo 3 > /proc/sys/vm/drop_caches` does
//! not drop them (a cold-read measurement needs a fresh daemon). The bound
//! (`GpuReaderLimits::registered_bytes_max`, 8 GiB by default) is what the daemon may hold locked.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    /// Length of the window in bytes.
    pub window_bytes: u64,
    /// Offset of the range's first byte in the window.
    pub offset_in_window: u64,
}

/// Most blocks a window remembers as verified (a 256 MiB window holds 4096 blocks of 64 KiB).
const VERIFIED_PER_WINDOW_MAX: usize = 1 << 16;

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
    /// Keeps the registered pages mapped.
    _mapped: Arc<Mapped>,
}

struct Registry {
    maps: HashMap<FileKey, Arc<Mapped>>,
    windows: Vec<Window>,
    registered_bytes: usize,
    clock: u64,
    /// Files whose windows cannot be registered, with the reason (logged once).
    refused: HashMap<FileKey, DriverCallError>,
}

/// The registered page-cache windows of one device (see the module documentation).
pub struct PageCacheWindows {
    device: Device,
    window_bytes: usize,
    registered_bytes_max: usize,
    next_reader: AtomicU64,
    registry: Mutex<Registry>,
}

// SAFETY: the raw window pointers point into mappings the registry owns (through `Mapped`), and every
// access to them goes through the mutex.
unsafe impl Send for PageCacheWindows {}
// SAFETY: as above.
unsafe impl Sync for PageCacheWindows {}

/// What [`PageCacheWindows::copy`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowCopy {
    /// The copies are queued on the reader's stream.
    Queued,
    /// The file cannot be mapped or registered (the reason was logged): use another path.
    Unavailable,
}

impl PageCacheWindows {
    /// An empty registry for `device`: windows of `window_bytes` (a multiple of the page size), at most
    /// `registered_bytes_max` registered at once.
    pub fn new(device: &Device, window_bytes: usize, registered_bytes_max: usize) -> Self {
        assert!(window_bytes > 0 && window_bytes % IO_ALIGN_BYTES as usize == 0);
        PageCacheWindows {
            device: device.clone(),
            window_bytes,
            registered_bytes_max,
            next_reader: AtomicU64::new(1),
            registry: Mutex::new(Registry {
                maps: HashMap::new(),
                windows: Vec::new(),
                registered_bytes: 0,
                clock: 0,
                refused: HashMap::new(),
            }),
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().expect("page-cache registry poisoned")
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
            // The mapping covers whole pages, so a window at the end of the file may be rounded up to
            // a page: cuMemHostRegister wants page-granular ranges.
            let window_len = window_bytes
                .min(file_len - window_start)
                .div_ceil(IO_ALIGN_BYTES as usize)
                * IO_ALIGN_BYTES as usize;
            let piece = (len - done).min(window_start + window_len - at);
            debug_assert!(piece > 0);
            let Some(slot) =
                self.window(&mut registry, key, &mapped, index, window_start, window_len)?
            else {
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
            let event = match window.copies_done.iter().position(|(r, _)| *r == reader) {
                Some(i) => &window.copies_done[i].1,
                None => {
                    let event = Event::new(&self.device, EventTiming::Disabled)?;
                    window.copies_done.push((reader, event));
                    &window.copies_done.last().expect("just pushed").1
                }
            };
            event.record(stream)?;
            done += piece;
        }
        Ok(WindowCopy::Queued)
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
        let Ok(key) = FileKey::of(file) else {
            return Ok(None);
        };
        let window_bytes = self.window_bytes;
        let index = offset / window_bytes as u64;
        let window_start = index as usize * window_bytes;
        if offset as usize + len > window_start + window_bytes || len == 0 {
            return Ok(None);
        }
        let mut registry = self.lock();
        if registry.refused.contains_key(&key) {
            return Ok(None);
        }
        let known = registry
            .windows
            .iter()
            .any(|w| w.file == key && w.index == index);
        let Some(mapped) = Self::mapped(&mut registry, key, file) else {
            return Ok(None);
        };
        let file_len = mapped.map.len();
        if offset as usize + len > file_len {
            return Ok(None);
        }
        let window_len = window_bytes
            .min(file_len - window_start)
            .div_ceil(IO_ALIGN_BYTES as usize)
            * IO_ALIGN_BYTES as usize;
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
        let Some(slot) =
            self.window(&mut registry, key, &mapped, index, window_start, window_len)?
        else {
            return Ok(None);
        };
        let window = &mut registry.windows[slot];
        window.pins += 1;
        Ok(Some(MappedRange {
            window: WindowId { file: key, index },
            window_device_ptr: window.device_ptr,
            window_bytes: window.bytes as u64,
            offset_in_window: offset - window_start as u64,
        }))
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
                unreachable!("a pinned window is never evicted");
            };
            window.pins -= 1;
            let event = match window.copies_done.iter().position(|(r, _)| *r == reader) {
                Some(i) => &window.copies_done[i].1,
                None => {
                    let event = Event::new(&self.device, EventTiming::Disabled)?;
                    window.copies_done.push((reader, event));
                    &window.copies_done.last().expect("just pushed").1
                }
            };
            event.record(stream)?;
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

    /// The registered window `index` of `key`, registering it (and evicting old ones) if needed.
    fn window(
        &self,
        registry: &mut Registry,
        key: FileKey,
        mapped: &Arc<Mapped>,
        index: u64,
        start: usize,
        bytes: usize,
    ) -> Result<Option<usize>, DeviceError> {
        registry.clock += 1;
        let clock = registry.clock;
        if let Some(slot) = registry
            .windows
            .iter()
            .position(|w| w.file == key && w.index == index)
        {
            registry.windows[slot].last_use = clock;
            return Ok(Some(slot));
        }
        while registry.registered_bytes + bytes > self.registered_bytes_max {
            // Pinned windows are read by queued kernels without a copy: never evicted.
            let Some(oldest) = registry
                .windows
                .iter()
                .enumerate()
                .filter(|(_, w)| w.pins == 0)
                .min_by_key(|(_, w)| w.last_use)
                .map(|(i, _)| i)
            else {
                return Ok(None);
            };
            let window = registry.windows.swap_remove(oldest);
            registry.registered_bytes -= window.bytes;
            Self::unregister(window)?;
        }
        // SAFETY: `start .. start + bytes` lies within the live mapping (page aligned, as windows start
        // at multiples of window_bytes, itself a multiple of the page size), which the window keeps
        // alive for as long as it is registered; the device's context is current (the caller's).
        let ptr = unsafe { mapped.map.as_ptr().add(start) };
        let device_ptr = match unsafe { mem_host_register_read_only(ptr, bytes) } {
            Ok(device_ptr) => device_ptr,
            Err(reason) => {
                tracing::warn!(
                    "page-cache path unavailable for a shard: {reason}; using the cold path"
                );
                registry.refused.insert(key, reason);
                return Ok(None);
            }
        };
        registry.registered_bytes += bytes;
        registry.windows.push(Window {
            file: key,
            index,
            ptr,
            device_ptr,
            bytes,
            last_use: clock,
            pins: 0,
            verified: std::collections::HashSet::new(),
            copies_done: Vec::new(),
            _mapped: Arc::clone(mapped),
        });
        Ok(Some(registry.windows.len() - 1))
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
            Self::unregister(window)?;
        }
        Ok(())
    }
}

impl Drop for PageCacheWindows {
    fn drop(&mut self) {
        let _ = self.clear();
    }
}
