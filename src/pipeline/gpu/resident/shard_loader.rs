//! The loader of a stream whose dataset is larger than the registration budget (or, in a window
//! shuffle, not in the page cache).
//!
//! A resident stream within the budget keeps every window of its dataset registered for its life and
//! copies shards ahead from them (see `device_shards`). Beyond the budget that cannot be: instead,
//! a thread of the stream's own copies each shard it is given into its device slot, window by
//! window, on a stream of its own, from the device's shared [`PageCacheWindows`]: a window already
//! registered is copied at once; otherwise it is registered into the registry while that leaves room
//! for two more windows (so part of a dataset larger than the budget stays registered from one
//! epoch to the next), or else for its copy only (transient: unregistered once no one holds it).
//! Nothing here waits for another stream: a window that cannot be registered (not in the page cache,
//! pinned windows fill the budget, or the driver refuses the file) is copied from pageable memory
//! instead, the kernel asked to read it ahead in large reads, which is slower but needs no budget.
//!
//! Registering takes 5 to 7.5 ms per 256 MiB window on the H100 test machine, unregistering 2 to
//! 2.5 ms, and unregistering waits for the device's queued work. So a window registered for one copy
//! is registered while the previous window's copy runs, and the previous window is unregistered
//! once its copy is done and before this one's copy is queued (unregistering then waits for
//! nothing queued after it): about a third more, on one host core there, than unregistering windows
//! with copies in flight.
//!
//! With `loader_copy_threads` above 0, windows the budget has no room for are not registered for
//! their copy but copied through pinned buffers by this thread and copy threads beside it (see
//! `copy_helpers`), a group of the shards queued at a time, and the thread logs where its time
//! went when the stream ends.
//!
//! The filler learns that a shard's copies are queued when its generation is recorded; rounds that
//! read the shard then make the compute stream wait for the copy's event (no host wait on the
//! device).
//!
//! What is copied is the shard file as it is when copied: its blocks were verified when the stream
//! opened (or earlier, per the dataset's verified-block record; beyond the daemon's memory, by this
//! thread just before the copy: see `shard_checks`), and a shard is never modified while
//! its dataset is registered (a re-packed dataset is detected by its manifest identity), so the
//! copies are not hashed again. A shard found shorter than at open fails the stream.

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::storage::mapped::MappedFile;

use super::copy_helpers::{stop_all, Claims, CopyHelper, HelperStats, ShardCopy};
use super::shard_checks::ShardChecks;
use crate::device::{Device, DeviceError, Event, EventTiming, Stream};
use crate::pipeline::stream_plan::FillError;
use crate::storage::windows::{CopySource, PageCacheWindows};

/// Registered windows a loader keeps pinned for copies in flight.
const PINNED_WINDOWS_MAX: usize = 4;

/// Windows of the budget a loader leaves free when it registers windows into the registry, so that
/// windows registered for one copy always find room.
const WINDOWS_KEPT_FREE: usize = 2;

/// Most shards a loader with copy threads copies as one group (see `Worker::load`): a group's
/// slots are ready together, when its last copy is queued.
const GROUP_SHARDS_MAX: usize = 4;

/// How long a filler waits for a shard between checks that the loader is still alive.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// How often an idle loader with copies still in flight looks whether their windows can go back.
const IDLE_POLL: Duration = Duration::from_millis(2);

/// One shard to copy into a device slot.
pub(super) struct LoadJob {
    /// The slot, and which of its fills this is (the filler's count).
    pub slot: usize,
    pub generation: u64,
    pub shard: usize,
    /// The shard's size when the stream opened (the slot holds the largest): what is copied.
    pub bytes: u64,
    /// The slot's device address (it holds the largest shard).
    pub dst: u64,
    /// Recorded on the loader's stream after the shard's last copy.
    pub copied: Arc<Event>,
    /// What the copies wait for: the last round that read the slot's previous shard, or, when no
    /// round read it, the previous fill's own copies (its `copied`, recorded before this job is
    /// copied: a loader never groups two jobs of one slot).
    pub after: Option<Arc<Event>>,
}

#[derive(Default)]
struct State {
    /// Per slot, the last generation whose copies are queued and whose `copied` event is recorded.
    recorded: Vec<u64>,
    /// Why the loader stopped, if it failed.
    failed: Option<(usize, Arc<std::io::Error>)>,
    /// The thread has ended (or panicked).
    stopped: bool,
    /// The stream is closing: jobs still queued are dropped, not copied.
    closing: bool,
}

/// Marks the loader stopped when its thread ends, also by a panic, so that a filler waiting for a
/// shard fails instead of waiting forever.
struct StopOnExit(Shared);

impl Drop for StopOnExit {
    fn drop(&mut self) {
        let (lock, ready) = &*self.0;
        let mut state = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.stopped = true;
        ready.notify_all();
    }
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
        copy_threads: usize,
        checks: Option<Arc<ShardChecks>>,
    ) -> Result<ShardLoader, FillError> {
        let mut files = Vec::with_capacity(paths.len());
        for path in &paths {
            let file = File::open(path).map_err(|source| {
                FillError::Storage(crate::storage::StorageError::Open {
                    path: path.clone(),
                    source,
                })
            })?;
            files.push(Arc::new(file));
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
            checks,
            maps: Vec::new(),
            fraction_min,
            pinned: VecDeque::new(),
            spare_events: Vec::new(),
            copy_threads,
            own: None,
            helpers: Vec::new(),
            shards_loaded: 0,
            load_s: 0.0,
            idle_s: 0.0,
            registered_bytes: 0,
            pageable_bytes: 0,
            phase_s: [0.0; 3],
        };
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("gpufeed-shard-load".into())
            .spawn(move || {
                let _stop = StopOnExit(Arc::clone(&thread_shared));
                worker.run(&receiver, &thread_shared)
            })
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

impl ShardLoader {
    /// Stops the loader: jobs still queued are dropped, and the thread ends once the copies it
    /// queued are done and their windows handed back. Returns false if the thread panicked: copies
    /// it queued may then still be running, and nothing that they write may be reused.
    pub(super) fn finish(mut self) -> bool {
        self.stop()
    }

    fn stop(&mut self) -> bool {
        self.shared
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .closing = true;
        // Closing the channel ends the thread's wait for jobs.
        self.jobs = None;
        self.thread
            .take()
            .is_none_or(|thread| thread.join().is_ok())
    }
}

impl Drop for ShardLoader {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A group of jobs to copy together: `first`, then the jobs `next` yields while the group has fewer
/// than `max`, up to the first job for a slot already in the group, which is returned to start the
/// next group: a fill's copies must come after those of its slot's earlier fill (its `after`, see
/// [`LoadJob`]), whose event is recorded when that fill's group ends.
fn take_group<J>(
    first: J,
    max: usize,
    slot_of: impl Fn(&J) -> usize,
    mut next: impl FnMut() -> Option<J>,
) -> (Vec<J>, Option<J>) {
    let mut group = vec![first];
    while group.len() < max {
        let Some(job) = next() else {
            break;
        };
        if group.iter().any(|queued| slot_of(queued) == slot_of(&job)) {
            return (group, Some(job));
        }
        group.push(job);
    }
    (group, None)
}

/// What the loader thread owns.
struct Worker {
    device: Device,
    windows: Arc<PageCacheWindows>,
    files: Vec<Arc<File>>,
    /// Verifies each shard before its copy, where the stream did not verify them all at open.
    checks: Option<Arc<ShardChecks>>,
    /// Per shard, a read-only map for copies from pageable memory (made when first needed).
    maps: Vec<Option<MappedFile>>,
    fraction_min: f64,
    /// Windows held for copies in flight, oldest first, with the event recorded after each copy.
    pinned: VecDeque<(Event, CopySource)>,
    spare_events: Vec<Event>,
    /// Threads copying windows the budget has no room for through pinned buffers (see
    /// `copy_helpers`), this one among them; 0: such windows are registered for their copy. The
    /// helpers are made when first needed: `own` for this thread, `helpers` for the others.
    copy_threads: usize,
    own: Option<CopyHelper>,
    helpers: Vec<CopyHelper>,
    /// Shards loaded, seconds loading them and idle waiting for jobs, bytes copied straight from
    /// registered windows and from pageable memory: for the log at the end.
    shards_loaded: u64,
    load_s: f64,
    idle_s: f64,
    registered_bytes: u64,
    pageable_bytes: u64,
    /// Seconds starting the copy threads, copying from the front, waiting for the threads.
    phase_s: [f64; 3],
}

impl Worker {
    fn run(mut self, jobs: &Receiver<LoadJob>, shared: &Shared) {
        let outcome = Stream::new(&self.device)
            .map_err(|e| (0, e))
            .and_then(|stream| {
                let mut result = Ok(());
                // A job taken while a group formed that had to start the next group.
                let mut held: Option<LoadJob> = None;
                loop {
                    let job = match held.take().map_or_else(|| jobs.try_recv(), Ok) {
                        Ok(job) => job,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
                        Err(std::sync::mpsc::TryRecvError::Empty) => {
                            let started = std::time::Instant::now();
                            let job = self.idle(jobs);
                            self.idle_s += started.elapsed().as_secs_f64();
                            match job {
                                Some(job) => job,
                                None => break,
                            }
                        }
                    };
                    if shared
                        .0
                        .lock()
                        .expect("shard loader state poisoned")
                        .closing
                    {
                        break;
                    }
                    // The loader's first shard alone (a stream's first batch waits for it); later
                    // ones grouped with those already queued when there are copy threads.
                    let max = if self.copy_threads > 0 && self.shards_loaded > 0 {
                        GROUP_SHARDS_MAX
                    } else {
                        1
                    };
                    let (group, next) = take_group(
                        job,
                        max,
                        |job| job.slot,
                        || {
                            let closing = shared
                                .0
                                .lock()
                                .expect("shard loader state poisoned")
                                .closing;
                            if closing {
                                None
                            } else {
                                jobs.try_recv().ok()
                            }
                        },
                    );
                    held = next;
                    let started = std::time::Instant::now();
                    if let Some(checks) = &self.checks {
                        // The next job, if the filler has sent it, has its shard read ahead
                        // while this group is checked and copied: the disk stays busy.
                        if held.is_none() {
                            held = jobs.try_recv().ok();
                        }
                        for job in &group {
                            checks.check_shard(job.shard, &self.files[job.shard]);
                        }
                        if let Some(next) = &held {
                            checks.prefetch(next.shard, &self.files[next.shard]);
                        }
                    }
                    if let Err(error) = self.load(&stream, &group) {
                        result = Err(error);
                        break;
                    }
                    self.load_s += started.elapsed().as_secs_f64();
                    self.shards_loaded += group.len() as u64;
                    let (lock, ready) = &**shared;
                    let mut state = lock.lock().expect("shard loader state poisoned");
                    for job in &group {
                        state.recorded[job.slot] = state.recorded[job.slot].max(job.generation);
                    }
                    ready.notify_all();
                }
                // Every copy done before its windows are unpinned and the thread ends.
                let drained = stream.synchronize().and(
                    self.helpers
                        .iter()
                        .chain(&self.own)
                        .try_for_each(|helper| helper.synchronize()),
                );
                self.unpin_done(true);
                self.log_stats();
                result.and(drained.map_err(|e| (0, e)))
            });
        if let Err((shard, error)) = outcome {
            tracing::error!("copying shards into device memory failed: {error}");
            let mut state = shared.0.lock().expect("shard loader state poisoned");
            state.failed = Some((shard, Arc::new(std::io::Error::other(error))));
        }
        // `StopOnExit` marks the thread stopped and wakes the filler.
    }

    /// Logs where the loader's time went.
    fn log_stats(&self) {
        if self.shards_loaded == 0 {
            return;
        }
        let mut helpers = HelperStats::default();
        for helper in self.helpers.iter().chain(&self.own) {
            helpers += helper.stats;
        }
        tracing::info!(
            "shard loader: {} shards in {:.3} s ({:.3} s idle); bytes from registered windows {}, \
             pageable {}, through {} copy threads' pinned buffers {} (reading {:.3} s, waiting \
             for uploads {:.3} s, in the threads {:.3} s, summed over the threads); starting the \
             threads {:.3} s, copying from the front {:.3} s, waiting for the threads {:.3} s",
            self.shards_loaded,
            self.load_s,
            self.idle_s,
            self.registered_bytes,
            self.pageable_bytes,
            self.copy_threads,
            helpers.bytes,
            helpers.read_s,
            helpers.wait_s,
            helpers.busy_s,
            self.phase_s[0],
            self.phase_s[1],
            self.phase_s[2],
        );
    }

    /// Waits for the next job while idle, handing back each window as its copy completes, so that
    /// an idle stream holds none of the budget; `None` once the channel is closed.
    fn idle(&mut self, jobs: &Receiver<LoadJob>) -> Option<LoadJob> {
        loop {
            self.unpin_done(false);
            if self.pinned.is_empty() {
                return jobs.recv().ok();
            }
            match jobs.recv_timeout(IDLE_POLL) {
                Ok(job) => return Some(job),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Queues the copies of a group of shards into their slots, then records each slot's event.
    /// With copy threads, a group is every job already queued, up to [`GROUP_SHARDS_MAX`]: the
    /// threads take pinned buffers' worth from the back of the group's first shard with bytes left,
    /// while this thread takes windows from the front, shard after shard, so that the copy engines
    /// move one shard from registered windows while the threads read the next through their
    /// buffers, and nobody waits for the others until the group ends. On a failure, the shard at
    /// fault (or the group's first) is returned with the error.
    fn load(&mut self, stream: &Stream, jobs: &[LoadJob]) -> Result<(), (usize, DeviceError)> {
        let first_shard = jobs.first().map_or(0, |job| job.shard);
        let window_bytes = self.windows.window_bytes();
        let mut claims = Vec::with_capacity(jobs.len());
        let mut windows = 0;
        for job in jobs {
            let bytes = self.shard_bytes(job).map_err(|error| (job.shard, error))?;
            windows += bytes.div_ceil(window_bytes);
            claims.push(Claims::new(bytes, window_bytes));
        }
        let files: Vec<Arc<File>> = jobs
            .iter()
            .map(|job| Arc::clone(&self.files[job.shard]))
            .collect();
        let copies: Vec<ShardCopy<'_>> = jobs
            .iter()
            .zip(&files)
            .zip(&claims)
            .map(|((job, file), claims)| ShardCopy {
                file,
                dst: job.dst,
                after: job.after.as_deref(),
                claims,
            })
            .collect();
        let others = if windows < 2 {
            0
        } else {
            self.copy_threads.saturating_sub(1)
        };
        self.make_helpers(others)
            .map_err(|error| (first_shard, error))?;
        if let Some(own) = &mut self.own {
            own.begin_group();
        }
        let mut helpers = std::mem::take(&mut self.helpers);
        let spawning = std::time::Instant::now();
        let (mine, theirs) = std::thread::scope(|scope| {
            let threads: Vec<_> = helpers[..others]
                .iter_mut()
                .map(|helper| scope.spawn(|| helper.copy_shards(&copies)))
                .collect();
            self.phase_s[0] += spawning.elapsed().as_secs_f64();
            let front = std::time::Instant::now();
            let mut mine = Ok(());
            'jobs: for (job, copy) in jobs.iter().zip(&copies) {
                if let Some(after) = &job.after {
                    if let Err(error) = stream.wait(after) {
                        mine = Err((job.shard, error));
                        stop_all(&copies);
                        break;
                    }
                }
                if let Some(own) = &mut self.own {
                    own.begin();
                }
                while let Some((start, end)) = copy.claims.take_front() {
                    match self.copy_range(stream, job, copy, start, end) {
                        Ok(copied_to) if copied_to < end => {
                            copy.claims.give_back_front(copied_to, end)
                        }
                        Ok(_) => {}
                        Err(error) => {
                            mine = Err((job.shard, error));
                            stop_all(&copies);
                            break 'jobs;
                        }
                    }
                }
            }
            self.phase_s[1] += front.elapsed().as_secs_f64();
            let joining = std::time::Instant::now();
            let theirs: Vec<_> = threads
                .into_iter()
                .map(|thread| match thread.join() {
                    Ok(outcome) => outcome,
                    Err(_) => Err((
                        0,
                        DeviceError::Os {
                            what: "copying a shard",
                            source: std::io::Error::other("a copy thread panicked"),
                        },
                    )),
                })
                .collect();
            self.phase_s[2] += joining.elapsed().as_secs_f64();
            (mine, theirs)
        });
        self.helpers = helpers;
        let mut outcome = mine;
        let own = self
            .own
            .as_mut()
            .map(|own| (own.finish().map_err(|error| (0, error)), &*own));
        let finished = theirs.into_iter().zip(self.helpers.iter()).chain(own);
        for (copied, helper) in finished {
            match copied {
                // The slots' events wait for the helper's uploads too.
                Ok(true) => {
                    outcome = outcome
                        .and_then(|()| stream.wait(helper.done()).map_err(|e| (first_shard, e)))
                }
                Ok(false) => {}
                // The shard the helper was copying when it failed.
                Err((index, error)) => {
                    let shard = jobs.get(index).map_or(first_shard, |job| job.shard);
                    outcome = outcome.and(Err((shard, error)));
                }
            }
        }
        outcome?;
        for job in jobs {
            job.copied
                .record(stream)
                .map_err(|error| (job.shard, error))?;
        }
        Ok(())
    }

    /// Makes this thread's copy helper and `others` for the copy threads, those not made yet.
    fn make_helpers(&mut self, others: usize) -> Result<(), DeviceError> {
        if self.copy_threads > 0 && self.own.is_none() {
            self.own = Some(CopyHelper::new(&self.device)?);
        }
        while self.helpers.len() < others {
            self.helpers.push(CopyHelper::new(&self.device)?);
        }
        Ok(())
    }

    /// The bytes of `job`'s shard to copy: its size when the stream opened; an error if the file
    /// is shorter now.
    fn shard_bytes(&self, job: &LoadJob) -> Result<u64, DeviceError> {
        let file_len = self.files[job.shard]
            .metadata()
            .map_err(|source| DeviceError::Os {
                what: "reading the size of a shard",
                source,
            })?
            .len();
        if file_len < job.bytes {
            return Err(DeviceError::Os {
                what: "copying a shard",
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the shard is {file_len} bytes, shorter than the {} it had when the \
                         stream opened",
                        job.bytes
                    ),
                ),
            });
        }
        // Never more than the slot was sized for, whatever the file has become.
        Ok(job.bytes)
    }

    /// Queues the copy of bytes `at..end` (within one window) of the job's shard: on the loader's
    /// stream from the window registered (pinned, or for this copy only when there are no copy
    /// threads), else from pageable memory, or with copy threads, one unit of it through the
    /// loader's own pinned buffers (so that the loader does not hold up the end of a shard with a
    /// window the threads could have shared). Returns where the bytes copied end.
    fn copy_range(
        &mut self,
        stream: &Stream,
        job: &LoadJob,
        copy: &ShardCopy<'_>,
        at: u64,
        end: u64,
    ) -> Result<u64, DeviceError> {
        let window_bytes = self.windows.window_bytes();
        let keep_free = WINDOWS_KEPT_FREE * window_bytes as usize;
        let bytes = (end - at) as usize;
        let source = self.windows.map_for_copy(
            copy.file,
            at,
            bytes,
            self.fraction_min,
            keep_free,
            self.own.is_none(),
        )?;
        let Some(source) = source else {
            return match &mut self.own {
                Some(own) => {
                    let to = end.min(at + copy.claims.unit_bytes());
                    own.copy_range(copy, at, to).map(|()| to)
                }
                None => {
                    self.pageable_bytes += bytes as u64;
                    self.copy_pageable(stream, job, at, bytes).map(|()| end)
                }
            };
        };
        self.registered_bytes += bytes as u64;
        if let Err(error) = self.make_room_for(&source) {
            // Nothing is queued from `source` yet.
            self.windows.release_copy_source(source);
            return Err(error);
        }
        // SAFETY: the source is registered memory held (pinned, or registered for this copy)
        // until the event recorded just after the copy has completed (`unpin_done`,
        // `retire_oldest`); the destination lies within the slot, which holds the largest
        // shard, which no round reads until the filler saw this job recorded and made the
        // compute stream wait for `copied`, and which the rounds reading its previous shard are
        // done with (the stream waited for `after`).
        let copied = unsafe {
            crate::device::ffi::memcpy_htod_async(
                job.dst + at,
                source.host_addr() as *const u8,
                bytes,
                stream.raw(),
            )
        };
        let event = match copied {
            Ok(()) => match self.spare_events.pop() {
                Some(event) => Ok(event),
                None => Event::new(&self.device, EventTiming::Disabled),
            },
            Err(error) => Err(error.into()),
        };
        let event = match event.and_then(|event| event.record(stream).map(|()| event)) {
            Ok(event) => event,
            Err(error) => {
                // Nothing of this window is in flight that the failed calls did not queue:
                // wait for the stream before handing it back.
                let _ = stream.synchronize();
                self.windows.release_copy_source(source);
                return Err(error);
            }
        };
        self.pinned.push_back((event, source));
        Ok(end)
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
            // A shard truncated while it is copied reads zeros there, and the copy then fails
            // (see `MappedFile`).
            let map =
                MappedFile::map(&self.files[job.shard]).map_err(|source| DeviceError::Os {
                    what: "mapping a shard",
                    source,
                })?;
            self.maps[job.shard] = Some(map);
        }
        let map = self.maps[job.shard].as_ref().expect("mapped above");
        // Not in the page cache, most likely: ask the kernel to read this window and the next one
        // ahead in large reads rather than fault them in page by page during the copy.
        let ahead = (map.len() - at as usize).min(2 * bytes);
        map.advise_will_need(at as usize, ahead);
        let source = map
            .bytes()
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
        // The driver read the source during the call: if the shard was cut or rewritten meanwhile,
        // the copy holds zeros or other bytes, and the rounds must not read it.
        map.check(&self.files[job.shard])
            .map_err(|reason| DeviceError::Os {
                what: "copying a shard",
                source: std::io::Error::other(reason.to_string()),
            })?;
        Ok(())
    }

    /// Hands back the windows whose copies are complete (every one when `all`, after the caller
    /// synchronised the stream).
    fn unpin_done(&mut self, all: bool) {
        while let Some((event, _)) = self.pinned.front() {
            if !all && !event.is_complete().unwrap_or(false) {
                break;
            }
            let (event, source) = self.pinned.pop_front().expect("checked above");
            self.windows.release_copy_source(source);
            self.spare_events.push(event);
        }
    }

    /// Before a copy from `source` is queued: hands back the windows of earlier copies as needed.
    fn make_room_for(&mut self, source: &CopySource) -> Result<(), DeviceError> {
        if source.is_transient() {
            // Registered while the earlier copies ran: wait for them and hand their windows back
            // before this copy is queued, as unregistering waits for queued work.
            while !self.pinned.is_empty() {
                self.retire_oldest()?;
            }
        } else {
            self.unpin_done(false);
            while self.pinned.len() >= PINNED_WINDOWS_MAX {
                self.retire_oldest()?;
            }
        }
        Ok(())
    }

    /// Waits for the oldest held window's copy, then hands it back (with any others done).
    fn retire_oldest(&mut self) -> Result<(), DeviceError> {
        if let Some((event, _)) = self.pinned.front() {
            event.synchronize()?;
        }
        self.unpin_done(false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::take_group;

    /// Jobs as (slot, id); `next` yields the queued ones in order.
    fn group_of(
        first: (usize, u32),
        queued: &[(usize, u32)],
        max: usize,
    ) -> (Vec<u32>, Option<u32>, usize) {
        let mut queue = queued.iter().copied();
        let mut taken = 0;
        let (group, held) = take_group(
            first,
            max,
            |job| job.0,
            || {
                let job = queue.next();
                taken += job.is_some() as usize;
                job
            },
        );
        (
            group.iter().map(|job| job.1).collect(),
            held.map(|job| job.1),
            taken,
        )
    }

    #[test]
    fn a_group_takes_queued_jobs_up_to_its_size_and_a_slot_once() {
        // Up to `max`, never more taken from the queue than the group holds.
        assert_eq!(
            group_of((0, 1), &[(1, 2), (2, 3), (3, 4), (4, 5)], 4),
            (vec![1, 2, 3, 4], None, 3)
        );
        assert_eq!(group_of((0, 1), &[(1, 2)], 4), (vec![1, 2], None, 1));
        // Size one: nothing taken from the queue.
        assert_eq!(group_of((0, 1), &[(1, 2)], 1), (vec![1], None, 0));
        // A second fill of slot 1 closes the group and starts the next one.
        assert_eq!(
            group_of((0, 1), &[(1, 2), (1, 3), (2, 4)], 4),
            (vec![1, 2], Some(3), 2)
        );
        assert_eq!(group_of((5, 1), &[(5, 2)], 4), (vec![1], Some(2), 1));
    }
}
