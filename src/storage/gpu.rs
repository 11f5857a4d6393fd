//! Reading shard bytes into device memory, by three paths chosen per extent:
//!
//! - **Page cache**: the shard is memory-mapped and windows of the mapping are registered read-only
//!   with the driver (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_READ_ONLY`); the GPU's copy engine
//!   then reads cached pages directly, at the PCIe limit, with almost no host CPU. Registrations are
//!   bounded (locked memory is finite): an LRU of windows, a window unregistered only after the copies
//!   that use it have completed.
//! - **Bounce**: the read engine (io_uring, O_DIRECT where the file system allows) fills page-locked
//!   host buffers, each copied to the device asynchronously on a copy stream while the next is being
//!   read; a buffer is refilled only after its copy's event has completed.
//! - **cuFile** (GPUDirect Storage): `cuFileRead` straight into device memory, per file; a file whose
//!   registration fails falls back to the bounce path, with the reason logged once and counted.
//!
//! [`PathChoice::Auto`] sends extents whose pages are resident (per `mincore`) to the page-cache path
//! and the rest to the cold path: cuFile where real GDS (the nvidia-fs driver) is present, since
//! cuFile's compatibility mode is itself a POSIX bounce path; the bounce path otherwise.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::engine::{EngineLimits, ReadEngine};
use super::files::FileTable;
use super::queue::AnyQueue;
use super::windows::{PageCacheWindows, WindowCopy};
use super::{Extent, ReadError, IO_ALIGN_BYTES};
use crate::device::{Device, DeviceError, DeviceMemory, Event, EventTiming, PinnedBuffer, Stream};

/// A way of getting bytes from a file into device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReadPath {
    /// Copy engine reads a registered page-cache mapping.
    PageCache,
    /// io_uring into pinned bounce buffers, then asynchronous copies.
    Bounce,
    /// cuFile.
    CuFile,
}

impl ReadPath {
    /// Lowercase name for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            ReadPath::PageCache => "page_cache",
            ReadPath::Bounce => "bounce",
            ReadPath::CuFile => "cufile",
        }
    }
}

/// Which path a read takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathChoice {
    /// Per extent: resident pages through the page cache, the rest through the cold path.
    Auto,
    /// Always this path (cuFile falls back per file when a file cannot be registered).
    Force(ReadPath),
}

impl PathChoice {
    /// The choice an engine mode asks for: `auto` decides per extent; `cufile` forces cuFile (which
    /// fails with the reason if cuFile is unavailable, and falls back per file if a file cannot be
    /// registered); `uring` forces the io_uring bounce path.
    pub fn from_mode(mode: super::EngineMode) -> PathChoice {
        match mode {
            super::EngineMode::Auto => PathChoice::Auto,
            super::EngineMode::CuFile => PathChoice::Force(ReadPath::CuFile),
            super::EngineMode::Uring => PathChoice::Force(ReadPath::Bounce),
        }
    }
}

/// Bounds of a [`GpuReader`], all allocated or enforced at start.
#[derive(Clone, Copy, Debug)]
pub struct GpuReaderLimits {
    /// Size of each pinned bounce buffer.
    pub bounce_buffer_bytes: usize,
    /// Number of bounce buffers (at least 2, so reading and copying overlap).
    pub bounce_buffers: usize,
    /// Reads in flight in the io_uring engine.
    pub queue_depth: usize,
    /// Fraction of an extent's pages that must be resident for the page-cache path.
    pub resident_fraction_min: f64,
    /// Threads issuing cuFile reads for one extent.
    pub cufile_threads: usize,
}

impl GpuReaderLimits {
    /// Defaults for a GPU node: three 16 MiB bounce buffers, 8 cuFile threads. (The page-cache
    /// windows' size and registration budget are the [`PageCacheWindows`]' a reader is given.)
    pub fn node_defaults() -> GpuReaderLimits {
        GpuReaderLimits {
            bounce_buffer_bytes: 16 << 20,
            bounce_buffers: 3,
            queue_depth: 64,
            resident_fraction_min: 0.95,
            cufile_threads: super::cufile::CUFILE_THREADS_DEFAULT,
        }
    }
}

/// Bytes moved per path and fallbacks taken, for metrics.
#[derive(Debug, Default)]
pub struct GpuReadStats {
    /// Bytes read through the page-cache path.
    pub page_cache_bytes: AtomicU64,
    /// Bytes read through the bounce path.
    pub bounce_bytes: AtomicU64,
    /// Bytes read through cuFile.
    pub cufile_bytes: AtomicU64,
    /// Extents the page-cache path could not serve (registration failed) and sent to the bounce path.
    pub page_cache_fallbacks: AtomicU64,
    /// Files cuFile could not register, served by the bounce path instead.
    pub cufile_file_fallbacks: AtomicU64,
}

/// The GPU read path failed as a whole (as opposed to one extent failing).
#[derive(Debug, thiserror::Error)]
pub enum GpuReadError {
    /// A device call failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The read engine's queue failed.
    #[error(transparent)]
    Storage(#[from] super::StorageError),
    /// A forced path is not available.
    #[error("read path {path} is unavailable: {reason}")]
    Unavailable {
        /// The path.
        path: &'static str,
        /// Why.
        reason: String,
    },
}

/// Reads extents into device memory by the page-cache, bounce and cuFile paths.
pub struct GpuReader {
    device: Device,
    stream: Stream,
    /// Recorded after a synchronous read's copies; sleeps when waited on, so that waiting for copies
    /// costs no host CPU (the default spin-wait costs a whole core for as long as the copies run).
    done: Event,
    limits: GpuReaderLimits,
    /// The bounce path, made when it is first needed: a stream that reads everything from registered
    /// page-cache windows (or from device copies of them) never pins bounce buffers, and opens
    /// tens of milliseconds sooner.
    bounce: Option<Bounce>,
    windows: Arc<PageCacheWindows>,
    /// This reader's identity in `windows`.
    reader_id: u64,
    /// Recorded after the copies of a [`GpuReader::read_async`].
    copies_done: Event,
    cufile: Option<super::cufile::CuFileReader>,
    /// Why the cold path is the bounce path rather than cuFile.
    pub cold_path_reason: String,
    /// Bytes and fallbacks per path.
    pub stats: GpuReadStats,
}

// SAFETY: the pinned buffers and the engine are only used through &mut self.
unsafe impl Send for GpuReader {}

/// The bounce path's pinned buffers, their events, and the io_uring engine that reads into them.
struct Bounce {
    /// Declared first: dropped before the buffers it may have registered.
    engine: ReadEngine<AnyQueue>,
    /// Whether the buffers are io_uring fixed buffers (index = position in `buffers`).
    fixed_buffers: bool,
    buffers: Vec<(PinnedBuffer, Event)>,
    next: usize,
}

impl Bounce {
    /// Allocates `limits.bounce_buffers` pinned buffers, each with an event recorded on `stream` (so
    /// that the first wait on it returns at once), and an engine with the buffers registered.
    fn new(
        device: &Device,
        stream: &Stream,
        limits: &GpuReaderLimits,
    ) -> Result<Bounce, GpuReadError> {
        let mut buffers = Vec::with_capacity(limits.bounce_buffers);
        for _ in 0..limits.bounce_buffers {
            let buffer = PinnedBuffer::new(device, limits.bounce_buffer_bytes)?;
            let event = Event::new(device, EventTiming::Disabled)?;
            event.record(stream)?;
            buffers.push((buffer, event));
        }
        let (queue, note) = AnyQueue::best(limits.queue_depth);
        if let Some(note) = note {
            tracing::warn!("{note}");
        }
        let mut engine = ReadEngine::new(queue, EngineLimits::node_defaults());
        let iovecs: Vec<libc::iovec> = buffers
            .iter_mut()
            .map(|(buffer, _): &mut (PinnedBuffer, Event)| libc::iovec {
                iov_base: buffer.as_mut_slice().as_mut_ptr().cast(),
                iov_len: buffer.len(),
            })
            .collect();
        // SAFETY: the pinned buffers live as long as the engine, which is dropped first (declared
        // first in `Bounce`).
        let fixed_buffers = match unsafe { engine.queue_mut().register_buffers(&iovecs) } {
            Ok(registered) => registered,
            Err(error) => {
                tracing::warn!("bounce buffers not registered with io_uring: {error}");
                false
            }
        };
        Ok(Bounce {
            engine,
            fixed_buffers,
            buffers,
            next: 0,
        })
    }
}

impl GpuReader {
    /// Sets up the paths for `device`: creates the copy stream and probes cuFile (used for cold reads
    /// only where the nvidia-fs driver is present, unless `cufile` is forced by the caller's
    /// [`PathChoice`]); the bounce buffers, their events and the io_uring engine are made by the first
    /// read that needs them. Page-cache reads go through `windows`, shared with the device's other
    /// readers: their geometry and registration budget are the registry's.
    pub fn with_windows(
        device: &Device,
        limits: GpuReaderLimits,
        windows: Arc<PageCacheWindows>,
    ) -> Result<GpuReader, GpuReadError> {
        assert!(limits.bounce_buffers >= 2, "at least two bounce buffers");
        assert!(limits.bounce_buffer_bytes % IO_ALIGN_BYTES as usize == 0);
        let stream = Stream::new(device)?;
        let done = Event::new_blocking(device)?;
        let opened = super::cufile::CuFileReader::open(device).map(|mut reader| {
            reader.threads = limits.cufile_threads.max(1);
            reader
        });
        let (cufile, cold_path_reason) = match opened {
            Ok(reader) if reader.nvidia_fs_present() => {
                (Some(reader), "cuFile: the nvidia-fs driver is loaded (real GDS)".to_string())
            }
            Ok(reader) => (
                Some(reader),
                "bounce: cuFile would run in compatibility mode (no nvidia-fs driver), which is itself a POSIX bounce path".to_string(),
            ),
            Err(reason) => (None, format!("bounce: cuFile unavailable ({reason})")),
        };
        tracing::info!("cold reads: {cold_path_reason}");
        Ok(GpuReader {
            device: device.clone(),
            stream,
            done,
            limits,
            bounce: None,
            reader_id: windows.reader_id(),
            windows,
            copies_done: Event::new(device, EventTiming::Disabled)?,
            cufile,
            cold_path_reason,
            stats: GpuReadStats::default(),
        })
    }

    /// The copy stream: work that consumes the read bytes waits on it (or on [`GpuReader::read`]'s
    /// return, which synchronises it).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device's registered page-cache windows, which this reader shares.
    pub fn windows(&self) -> &Arc<PageCacheWindows> {
        &self.windows
    }

    /// This reader's identity in [`Self::windows`].
    pub fn reader_id(&self) -> u64 {
        self.reader_id
    }

    /// Fraction of a range's pages that must be resident for the page-cache path.
    pub fn resident_fraction_min(&self) -> f64 {
        self.limits.resident_fraction_min
    }

    /// Whether a cuFile driver could be opened at all.
    pub fn cufile_available(&self) -> bool {
        self.cufile.is_some()
    }

    fn cold_path(&self) -> ReadPath {
        match &self.cufile {
            Some(reader) if reader.nvidia_fs_present() => ReadPath::CuFile,
            _ => ReadPath::Bounce,
        }
    }

    /// Reads every extent into `dest` and reports, per extent, the path that served it or the error.
    /// All copies have landed in device memory when this returns.
    pub fn read(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        dest: &dyn DeviceMemory,
        choice: PathChoice,
    ) -> Result<Vec<Result<ReadPath, ReadError>>, GpuReadError> {
        let results = self.queue_reads(files, extents, dest, choice)?;
        self.done.record(&self.stream)?;
        self.done.synchronize()?;
        Ok(results)
    }

    /// As [`GpuReader::read`], without waiting for the copies on the host: `consumer` waits for them
    /// on the device instead, so work queued on it afterwards sees the bytes. Errors of the host-side
    /// reads (io_uring, cuFile) are known when this returns.
    ///
    /// # Safety
    /// Nothing may read or write `dest`'s extents other than through `consumer` (after this call)
    /// until the copies have completed, and `dest` must stay allocated until then.
    pub unsafe fn read_async(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        dest: &dyn DeviceMemory,
        choice: PathChoice,
        consumer: &Stream,
    ) -> Result<Vec<Result<ReadPath, ReadError>>, GpuReadError> {
        let results = self.queue_reads(files, extents, dest, choice)?;
        self.copies_done.record(&self.stream)?;
        consumer.wait(&self.copies_done)?;
        Ok(results)
    }

    fn queue_reads(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        dest: &dyn DeviceMemory,
        choice: PathChoice,
    ) -> Result<Vec<Result<ReadPath, ReadError>>, GpuReadError> {
        for (index, extent) in extents.iter().enumerate() {
            assert!(
                extent.dest_offset.checked_add(extent.len) <= Some(dest.len()),
                "extent {index} runs past the destination"
            );
        }
        self.device.bind()?;
        let mut paths = Vec::with_capacity(extents.len());
        for extent in extents {
            let path = match choice {
                PathChoice::Force(path) => path,
                PathChoice::Auto => {
                    if self.resident(files, extent) {
                        ReadPath::PageCache
                    } else {
                        self.cold_path()
                    }
                }
            };
            paths.push(path);
        }
        if paths.contains(&ReadPath::CuFile) && self.cufile.is_none() {
            return Err(GpuReadError::Unavailable {
                path: "cufile",
                reason: self.cold_path_reason.clone(),
            });
        }
        let mut results: Vec<Result<ReadPath, ReadError>> = paths.iter().map(|&p| Ok(p)).collect();

        // Page cache first: it only queues copies, which then overlap with the reads below.
        for (index, extent) in extents.iter().enumerate() {
            if paths[index] != ReadPath::PageCache {
                continue;
            }
            // SAFETY: the caller's contract (see `read` and `read_async`) keeps `dest` untouched until
            // the copies on this reader's stream have completed; the extent was checked against it.
            let copied = unsafe {
                self.windows.copy(
                    self.reader_id,
                    &self.stream,
                    files.get(extent.file).file(),
                    extent.offset,
                    extent.len,
                    dest.device_ptr() + extent.dest_offset as u64,
                )
            }?;
            match copied == WindowCopy::Queued {
                true => {
                    self.stats
                        .page_cache_bytes
                        .fetch_add(extent.len as u64, Ordering::Relaxed);
                }
                false => {
                    self.stats
                        .page_cache_fallbacks
                        .fetch_add(1, Ordering::Relaxed);
                    paths[index] = ReadPath::Bounce;
                    results[index] = Ok(ReadPath::Bounce);
                }
            }
        }
        // cuFile: a file it cannot register goes to the bounce path.
        if let Some(reader) = self.cufile.as_mut() {
            for (index, extent) in extents.iter().enumerate() {
                if paths[index] != ReadPath::CuFile {
                    continue;
                }
                match reader.read(files, extent, dest) {
                    Ok(super::cufile::CuFileOutcome::Read) => {
                        self.stats
                            .cufile_bytes
                            .fetch_add(extent.len as u64, Ordering::Relaxed);
                    }
                    Ok(super::cufile::CuFileOutcome::FileNotRegistered) => {
                        paths[index] = ReadPath::Bounce;
                        results[index] = Ok(ReadPath::Bounce);
                    }
                    Err(error) => results[index] = Err(error),
                }
            }
            self.stats
                .cufile_file_fallbacks
                .store(reader.file_fallbacks(), Ordering::Relaxed);
        }
        let bounce: Vec<usize> = (0..extents.len())
            .filter(|&i| paths[i] == ReadPath::Bounce && results[i].is_ok())
            .collect();
        self.read_bounced(files, extents, &bounce, dest, &mut results)?;
        Ok(results)
    }

    fn resident(&mut self, files: &FileTable, extent: &Extent) -> bool {
        self.windows.resident(
            files.get(extent.file).file(),
            extent.offset,
            extent.len,
            self.limits.resident_fraction_min,
        )
    }

    /// Reads the selected extents through the bounce buffers: fill buffer k with io_uring while the
    /// copy of buffer k-1 runs, reuse a buffer only after its copy's event has completed.
    fn read_bounced(
        &mut self,
        files: &FileTable,
        extents: &[Extent],
        selected: &[usize],
        dest: &dyn DeviceMemory,
        results: &mut [Result<ReadPath, ReadError>],
    ) -> Result<(), GpuReadError> {
        let buffer_bytes = self.limits.bounce_buffer_bytes;
        let align = IO_ALIGN_BYTES as usize;
        // Cut the work into pieces that fit a buffer; pieces start page-aligned in the buffer so the
        // engine can use O_DIRECT where the file offset allows.
        struct Piece {
            extent: usize,
            offset: u64,
            len: usize,
            dest_offset: usize,
        }
        let mut pieces = Vec::new();
        for &index in selected {
            let extent = &extents[index];
            let mut done = 0usize;
            while done < extent.len {
                let len = (extent.len - done).min(buffer_bytes);
                pieces.push(Piece {
                    extent: index,
                    offset: extent.offset + done as u64,
                    len,
                    dest_offset: extent.dest_offset + done,
                });
                done += len;
            }
        }
        if self.bounce.is_none() {
            self.bounce = Some(Bounce::new(&self.device, &self.stream, &self.limits)?);
        }
        let bounce = self.bounce.as_mut().expect("made above");
        let mut start = 0;
        while start < pieces.len() {
            let mut used = 0usize;
            let mut end = start;
            while end < pieces.len() && used + pieces[end].len <= buffer_bytes {
                used = (used + pieces[end].len).div_ceil(align) * align;
                end += 1;
            }
            let slot = bounce.next;
            bounce.next = (bounce.next + 1) % bounce.buffers.len();
            let (buffer, event) = &mut bounce.buffers[slot];
            // The buffer's previous copy must be done before the kernel writes into it again.
            event.synchronize()?;
            let mut engine_extents = Vec::with_capacity(end - start);
            let mut at = 0usize;
            for piece in &pieces[start..end] {
                engine_extents.push(Extent {
                    file: extents[piece.extent].file,
                    offset: piece.offset,
                    len: piece.len,
                    dest_offset: at,
                });
                at = (at + piece.len).div_ceil(align) * align;
            }
            let fixed = bounce.fixed_buffers.then_some(slot as u16);
            let read =
                bounce
                    .engine
                    .read_with(files, &engine_extents, buffer.as_mut_slice(), fixed)?;
            for ((piece, engine_extent), result) in
                pieces[start..end].iter().zip(&engine_extents).zip(read)
            {
                if let Err(error) = result {
                    results[piece.extent] = Err(error);
                    continue;
                }
                // SAFETY: the source lies within the pinned buffer, which is not written again until
                // `event` (recorded after these copies) has completed; the destination range was
                // checked against `dest`.
                unsafe {
                    crate::device::ffi::memcpy_htod_async(
                        dest.device_ptr() + piece.dest_offset as u64,
                        buffer.as_slice().as_ptr().add(engine_extent.dest_offset),
                        piece.len,
                        self.stream.raw(),
                    )
                }
                .map_err(DeviceError::from)?;
                self.stats
                    .bounce_bytes
                    .fetch_add(piece.len as u64, Ordering::Relaxed);
            }
            event.record(&self.stream)?;
            start = end;
        }
        Ok(())
    }
}

impl Drop for GpuReader {
    fn drop(&mut self) {
        let _ = self.device.bind();
        let _ = self.stream.synchronize();
        self.windows.forget_reader(self.reader_id);
    }
}
