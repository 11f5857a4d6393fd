//! The loader of a stream whose dataset is larger than the registration budget.
//!
//! A resident stream within the budget keeps every window of its dataset registered for its life and
//! copies shards ahead from them (see `device_shards`). Beyond the budget that cannot be: instead,
//! a thread of the stream's own registers each window of the shard it loads through the device's
//! shared [`PageCacheWindows`] (which evicts least recently used windows to stay within the
//! budget), queues the window's copy into the shard's device slot on a stream of its own, and unpins
//! the window once that copy is complete, so that only the few windows whose copies are in flight
//! are pinned at a time. Registering and unregistering take the host's time (about 5 and 2 to 6 ms
//! per 256 MiB on the H100 test machine, serialised by the driver), so this thread does that work
//! off the filler's critical path, shards ahead of need. A window that cannot be registered (the
//! budget is pinned by other streams, or the driver refuses the file) is copied from pageable memory
//! instead, which is slower but needs no budget.
//!
//! The filler learns that a shard's copies are queued when its generation is recorded; rounds that
//! read the shard then make the compute stream wait for the copy's event (no host wait on the
//! device).

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use memmap2::Mmap;

use crate::device::{Device, DeviceError, Event, EventTiming, Stream};
use crate::pipeline::assemble::FillError;
use crate::storage::windows::{PageCacheWindows, WindowId};

/// Windows a loader keeps pinned for copies in flight: enough to keep the copy engines busy while
/// the next window is registered, few enough to leave the budget to others.
const PINNED_WINDOWS_MAX: usize = 4;

/// How long a filler waits for a shard between checks that the loader is still alive.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// One shard to copy into a device slot.
pub(super) struct LoadJob {
    /// The slot, and which of its fills this is (the filler's count).
    pub slot: usize,
    pub generation: u64,
    pub shard: usize,
    /// The slot's device address (it holds the largest shard).
    pub dst: u64,
    /// Recorded on the loader's stream after the shard's last copy.
    pub copied: Arc<Event>,
    /// The last round that read the slot's previous shard: the copies wait for it.
    pub after: Option<Arc<Event>>,
}

#[derive(Default)]
struct State {
    /// Per slot, the last generation whose copies are queued and whose `copied` event is recorded.
    recorded: Vec<u64>,
    /// Why the loader stopped, if it failed.
    failed: Option<(usize, Arc<std::io::Error>)>,
    /// The thread has ended.
    stopped: bool,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

/// A stream's loader thread (see the module documentation).
pub(super) struct ShardLoader {
    jobs: Option<SyncSender<LoadJob>>,
    shared: Shared,
    paths: Vec<PathBuf>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ShardLoader {
    /// Starts the loader of a stream reading the shard files `paths` with `slots` device slots.
    pub(super) fn start(
        device: &Device,
        windows: &Arc<PageCacheWindows>,
        paths: Vec<PathBuf>,
        fraction_min: f64,
        slots: usize,
    ) -> Result<ShardLoader, FillError> {
        let mut files = Vec::with_capacity(paths.len());
        for path in &paths {
            let file = File::open(path).map_err(|source| {
                FillError::Storage(crate::storage::StorageError::Open {
                    path: path.clone(),
                    source,
                })
            })?;
            files.push(file);
        }
        let shared: Shared = Arc::new((
            Mutex::new(State {
                recorded: vec![0; slots],
                ..State::default()
            }),
            Condvar::new(),
        ));
        // One job per slot at most is pending in practice; the bound keeps a runaway filler finite.
        let (jobs, receiver) = std::sync::mpsc::sync_channel(slots.max(1) * 2);
        let worker = Worker {
            device: device.clone(),
            windows: Arc::clone(windows),
            files,
            maps: Vec::new(),
            fraction_min,
            pinned: VecDeque::new(),
            spare_events: Vec::new(),
        };
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("gpufeed-shard-load".into())
            .spawn(move || worker.run(&receiver, &thread_shared))
            .map_err(|source| {
                FillError::Device(DeviceError::Os {
                    what: "starting a shard loader thread",
                    source,
                })
            })?;
        Ok(ShardLoader {
            jobs: Some(jobs),
            shared,
            paths,
            thread: Some(thread),
        })
    }

    /// Queues `job`.
    pub(super) fn send(&self, job: LoadJob) -> Result<(), FillError> {
        let shard = job.shard;
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(job).is_ok());
        if sent {
            Ok(())
        } else {
            Err(self.failure(shard))
        }
    }

    /// Whether fill `generation` of `slot` has its copies queued and its event recorded.
    pub(super) fn is_recorded(&self, slot: usize, generation: u64) -> bool {
        let state = self.shared.0.lock().expect("shard loader state poisoned");
        state.recorded[slot] >= generation
    }

    /// Waits until fill `generation` of `slot` (of `shard`) has its copies queued and its event
    /// recorded; fails if the loader failed or stopped first.
    pub(super) fn wait_recorded(
        &self,
        slot: usize,
        generation: u64,
        shard: usize,
    ) -> Result<(), FillError> {
        let (lock, ready) = &*self.shared;
        let mut state = lock.lock().expect("shard loader state poisoned");
        loop {
            if state.recorded[slot] >= generation {
                return Ok(());
            }
            if state.failed.is_some() || state.stopped {
                drop(state);
                return Err(self.failure(shard));
            }
            state = ready
                .wait_timeout(state, WAIT_SLICE)
                .expect("shard loader state poisoned")
                .0;
        }
    }

    /// The error to report for `shard` once the loader has failed or stopped.
    fn failure(&self, shard: usize) -> FillError {
        let state = self.shared.0.lock().expect("shard loader state poisoned");
        let (shard, source) = match &state.failed {
            Some((failed_shard, source)) => (*failed_shard, Arc::clone(source)),
            None => (
                shard,
                Arc::new(std::io::Error::other("the shard loader thread stopped")),
            ),
        };
        FillError::ShardCopy {
            shard: self.paths[shard].clone(),
            source,
        }
    }
}

impl Drop for ShardLoader {
    fn drop(&mut self) {
        // Closing the channel ends the thread once its queued copies are done and unpinned.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the loader thread owns.
struct Worker {
    device: Device,
    windows: Arc<PageCacheWindows>,
    files: Vec<File>,
    /// Per shard, a read-only map for copies from pageable memory (made when first needed).
    maps: Vec<Option<Mmap>>,
    fraction_min: f64,
    /// Windows pinned for copies in flight, oldest first, with the event recorded after each copy.
    pinned: VecDeque<(Event, WindowId)>,
    spare_events: Vec<Event>,
}

impl Worker {
    fn run(mut self, jobs: &Receiver<LoadJob>, shared: &Shared) {
        let outcome = Stream::new(&self.device)
            .map_err(|e| (0, e))
            .and_then(|stream| {
                let mut result = Ok(());
                while let Ok(job) = jobs.recv() {
                    let (slot, generation, shard) = (job.slot, job.generation, job.shard);
                    if let Err(error) = self.load(&stream, &job) {
                        result = Err((shard, error));
                        break;
                    }
                    let (lock, ready) = &**shared;
                    let mut state = lock.lock().expect("shard loader state poisoned");
                    state.recorded[slot] = state.recorded[slot].max(generation);
                    ready.notify_all();
                }
                // Every copy done before its windows are unpinned and the thread ends.
                let drained = stream.synchronize();
                self.unpin_done(true);
                result.and(drained.map_err(|e| (0, e)))
            });
        let (lock, ready) = &**shared;
        let mut state = lock.lock().expect("shard loader state poisoned");
        if let Err((shard, error)) = outcome {
            tracing::error!("copying shards into device memory failed: {error}");
            state.failed = Some((shard, Arc::new(std::io::Error::other(error))));
        }
        state.stopped = true;
        ready.notify_all();
    }

    /// Queues the copies of one shard into its slot, then records the slot's event.
    fn load(&mut self, stream: &Stream, job: &LoadJob) -> Result<(), DeviceError> {
        if let Some(after) = &job.after {
            stream.wait(after)?;
        }
        let file_bytes = self.files[job.shard]
            .metadata()
            .map_err(|source| DeviceError::Os {
                what: "reading the size of a shard",
                source,
            })?
            .len();
        let window_bytes = self.windows.window_bytes();
        let mut at = 0u64;
        while at < file_bytes {
            let bytes = window_bytes.min(file_bytes - at) as usize;
            self.unpin_done(false);
            while self.pinned.len() >= PINNED_WINDOWS_MAX {
                self.retire_oldest()?;
            }
            let file = &self.files[job.shard];
            match self.windows.map(file, at, bytes, self.fraction_min)? {
                Some(range) => {
                    // SAFETY: the source is a registered window pinned until the event recorded
                    // just after the copy has completed (`unpin_done`, `retire_oldest`); the
                    // destination lies within the slot, which holds the largest shard, and which no
                    // round reads until the filler saw this job recorded and made the compute
                    // stream wait for `copied`, and which the rounds reading its previous shard are
                    // done with (the stream waited for `after`).
                    unsafe {
                        crate::device::ffi::memcpy_htod_async(
                            job.dst + at,
                            (range.window_host_addr as u64 + range.offset_in_window) as *const u8,
                            bytes,
                            stream.raw(),
                        )
                    }?;
                    let event = match self.spare_events.pop() {
                        Some(event) => event,
                        None => Event::new(&self.device, EventTiming::Disabled)?,
                    };
                    event.record(stream)?;
                    self.pinned.push_back((event, range.window));
                }
                None => self.copy_pageable(stream, job, at, bytes)?,
            }
            at += bytes as u64;
        }
        job.copied.record(stream)
    }

    /// Copies `bytes` at `at` of the job's shard from a pageable map of the file (the window could
    /// not be registered). The driver stages the bytes before the call returns.
    fn copy_pageable(
        &mut self,
        stream: &Stream,
        job: &LoadJob,
        at: u64,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        if self.maps.len() < self.files.len() {
            self.maps.resize_with(self.files.len(), || None);
        }
        if self.maps[job.shard].is_none() {
            // SAFETY: a read-only map of a shard, which gpufeed never modifies once its dataset
            // exists.
            let map =
                unsafe { Mmap::map(&self.files[job.shard]) }.map_err(|source| DeviceError::Os {
                    what: "mapping a shard",
                    source,
                })?;
            self.maps[job.shard] = Some(map);
        }
        let map = self.maps[job.shard].as_ref().expect("mapped above");
        let source = map
            .get(at as usize..at as usize + bytes)
            .ok_or_else(|| DeviceError::Os {
                what: "copying a shard",
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the shard is shorter than when it was opened",
                ),
            })?;
        // SAFETY: the destination lies within the slot (as in `load`); a copy from pageable memory
        // has read its source when the call returns.
        unsafe {
            crate::device::ffi::memcpy_htod_async(
                job.dst + at,
                source.as_ptr(),
                bytes,
                stream.raw(),
            )
        }?;
        Ok(())
    }

    /// Unpins the windows whose copies are complete (every pinned window when `all`, after the
    /// caller synchronised the stream).
    fn unpin_done(&mut self, all: bool) {
        while let Some((event, _)) = self.pinned.front() {
            if !all && !event.is_complete().unwrap_or(false) {
                break;
            }
            let (event, window) = self.pinned.pop_front().expect("checked above");
            self.windows.unpin(&[window]);
            self.spare_events.push(event);
        }
    }

    /// Waits for the oldest pinned window's copy, then unpins it.
    fn retire_oldest(&mut self) -> Result<(), DeviceError> {
        if let Some((event, _)) = self.pinned.front() {
            event.synchronize()?;
        }
        self.unpin_done(false);
        Ok(())
    }
}
