//! Device slots filled on the host: a mixture stream on a CUDA device, and a device stream of a
//! dataset in object storage whose shards are not all in the node's cache yet.
//!
//! The GPU assembler plans its rounds over one dataset's shards, and its device order computes
//! rows from one dataset's order, so it cannot build a batch whose rows come from several
//! datasets; and it opens every shard file when the stream opens, so it cannot start before a
//! dataset in object storage is fetched whole. Such a stream on a device is instead assembled by
//! the CPU backend's assembler (the same [`HostAssembler`] a host stream of it uses: the same
//! order, the same rows, the same corrupt-block handling, byte for byte, the same shard gate) into
//! a pinned host buffer, then uploaded into the device slot with one copy on a stream of its own,
//! which first waits for the consumer's release of the slot and then records the slot's `ready`
//! event. The consumer sees a device batch like any other.
//!
//! The batches are assembled ahead on fill threads, each with an assembler of its own (the same
//! plan, so the same bytes), step `s` on thread `s mod n`, each into one of two pinned buffers of
//! its own; the filler thread uploads them in step order as their slots come free, so that the
//! host's assembly, which bounds these streams, runs on several cores (batches of 4096 fp16 rows
//! of 2 KiB converted to fp32: 1.1–1.6 GB/s of input on one thread, 3.8–5.1 on four, on the H200
//! test host, `docs/benchmarks/mixture-2026-11-28.md`). A stream with a shard gate (object storage) fills on
//! one thread: the gate holds and releases shards batch by batch, in order. The rate is the host's,
//! not the GPU pipeline's: it suits mixtures read at a few GB/s and a first epoch bound by the object
//! store, not a stream that must run at the PCIe link.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, SyncSender};

use super::cpu::HostAssembler;
use super::stream_plan::{FillError, FillReport, StreamPlan};
use crate::device::{Device, DeviceError, DeviceRegion, Event, EventTiming, PinnedBuffer, Stream};

/// Whether a stream on a CUDA device is assembled on the host and uploaded: a mixture, or a
/// dataset whose shards arrive while the stream runs (object storage, not all in the node's
/// cache: its plan has a shard gate, which only the host assembler follows).
pub fn assembled_on_host(plan: &StreamPlan) -> bool {
    plan.mixture.is_some() || plan.shard_gate.is_some()
}

/// Fill threads of a host-assembled device stream at most (never more than half the host's CPUs:
/// its cores belong to the training processes first).
pub const UPLOAD_FILL_THREADS_MAX: usize = 4;

/// Pinned buffers of each fill thread, used in turn.
const BUFFERS_PER_THREAD: usize = 2;

/// The fill threads of a host-assembled device stream of `plan` (see the module documentation).
pub fn fill_threads(plan: &StreamPlan) -> usize {
    if plan.shard_gate.is_some() || plan.steps < 2 {
        return 1;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    UPLOAD_FILL_THREADS_MAX.min(cpus / 2).max(1)
}

/// Host memory a host-assembled device stream of `plan` holds besides its slots and its
/// assemblers' working sets: its pinned buffers.
pub fn upload_bytes(plan: &StreamPlan) -> u64 {
    (fill_threads(plan) * BUFFERS_PER_THREAD * plan.slot_bytes) as u64
}

/// A pinned buffer and the event recorded after its last upload.
struct Staging {
    buffer: PinnedBuffer,
    uploaded: Event,
}

/// A step for a fill thread, and the buffer to fill.
struct Job {
    step: u64,
    staging: Staging,
}

/// What a fill thread sends back: the step, its buffer, the fill's outcome and its seconds.
struct Filled {
    step: u64,
    staging: Staging,
    outcome: Result<FillReport, FillError>,
    seconds: f64,
}

/// One fill thread: its jobs in, its filled buffers out (in the order of its jobs), and its free
/// buffers and those being uploaded (oldest first) on the filler's side.
struct FillThread {
    jobs: Option<SyncSender<Job>>,
    filled: Receiver<Filled>,
    thread: Option<std::thread::JoinHandle<()>>,
    free: Vec<Staging>,
    uploading: VecDeque<Staging>,
}

/// A stream whose device slots are filled on the host (see the module documentation).
pub struct HostUpload {
    stream: Stream,
    slot_bytes: usize,
    steps: u64,
    threads: Vec<FillThread>,
    /// The next step to hand to a fill thread, and the next to upload.
    next_job: u64,
    next_upload: u64,
    /// Filled slots, oldest first: their uploads are queued before their `ready` events.
    done: VecDeque<(u32, u64, FillReport)>,
    /// Seconds assembling (summed over the threads) and waiting for a batch's assembly or for a
    /// buffer's upload on the filler's side, for the log.
    fill_s: f64,
    wait_s: f64,
    /// Why io_uring is not used by the assemblers, when it is not.
    engine_note: Option<String>,
}

impl HostUpload {
    /// Starts the fill threads of a stream of `steps` steps whose slots hold `slot_bytes` on
    /// `device`, one per assembler of `assemblers` (each of the stream's whole plan), with their
    /// pinned buffers and the upload stream.
    pub fn new(
        assemblers: Vec<HostAssembler>,
        device: &Device,
        slot_bytes: usize,
        steps: u64,
    ) -> Result<HostUpload, DeviceError> {
        let stream = Stream::new(device)?;
        let engine_note = assemblers
            .first()
            .and_then(|a| a.engine_note().map(str::to_string));
        let mut threads = Vec::with_capacity(assemblers.len());
        for (index, assembler) in assemblers.into_iter().enumerate() {
            let free = (0..BUFFERS_PER_THREAD)
                .map(|_| {
                    Ok(Staging {
                        buffer: PinnedBuffer::new(device, slot_bytes)?,
                        uploaded: Event::new(device, EventTiming::Disabled)?,
                    })
                })
                .collect::<Result<Vec<_>, DeviceError>>()?;
            let (jobs, job_receiver) = std::sync::mpsc::sync_channel::<Job>(BUFFERS_PER_THREAD);
            let (filled_sender, filled) = std::sync::mpsc::sync_channel(BUFFERS_PER_THREAD);
            let thread = std::thread::Builder::new()
                .name(format!("gpufeed-upload-fill-{index}"))
                .spawn(move || fill(assembler, slot_bytes, &job_receiver, &filled_sender))
                .map_err(|source| DeviceError::Os {
                    what: "starting a fill thread",
                    source,
                })?;
            threads.push(FillThread {
                jobs: Some(jobs),
                filled,
                thread: Some(thread),
                free,
                uploading: VecDeque::new(),
            });
        }
        Ok(HostUpload {
            stream,
            slot_bytes,
            steps,
            threads,
            next_job: 0,
            next_upload: 0,
            done: VecDeque::new(),
            fill_s: 0.0,
            wait_s: 0.0,
            engine_note,
        })
    }

    /// Hands steps to the fill threads while their buffers allow, without waiting; and, when
    /// `step` has not been handed yet, waits for its thread's oldest upload to free a buffer.
    fn hand_out(&mut self, step: u64) -> Result<(), FillError> {
        let n = self.threads.len() as u64;
        while self.next_job < self.steps {
            let thread = &mut self.threads[(self.next_job % n) as usize];
            while let Some(oldest) = thread.uploading.front() {
                let done = if self.next_job <= step && thread.free.is_empty() {
                    let waiting = std::time::Instant::now();
                    oldest.uploaded.synchronize()?;
                    self.wait_s += waiting.elapsed().as_secs_f64();
                    true
                } else {
                    oldest.uploaded.is_complete()?
                };
                if !done {
                    break;
                }
                let staging = thread.uploading.pop_front().expect("looked at above");
                thread.free.push(staging);
            }
            let Some(staging) = thread.free.pop() else {
                break;
            };
            let job = Job {
                step: self.next_job,
                staging,
            };
            if thread
                .jobs
                .as_ref()
                .is_none_or(|jobs| jobs.send(job).is_err())
            {
                return Err(stopped());
            }
            self.next_job += 1;
        }
        Ok(())
    }

    /// Uploads stream step `step` (assembled on a fill thread) into slot `index` (its memory
    /// `slot`), after the consumer's release of it (`released`) and before its `ready` event.
    /// Steps come in order, from 0.
    pub fn submit(
        &mut self,
        (index, step): (u32, u64),
        slot: &DeviceRegion,
        released: &Event,
        ready: &Event,
    ) -> Result<(), FillError> {
        debug_assert_eq!(step, self.next_upload, "steps are submitted in order");
        self.hand_out(step)?;
        let n = self.threads.len() as u64;
        let thread = &mut self.threads[(step % n) as usize];
        let waiting = std::time::Instant::now();
        let filled = thread.filled.recv().map_err(|_| stopped())?;
        self.wait_s += waiting.elapsed().as_secs_f64();
        self.fill_s += filled.seconds;
        debug_assert_eq!(
            filled.step, step,
            "a fill thread's steps come back in order"
        );
        let report = match filled.outcome {
            Ok(report) => report,
            Err(error) => {
                thread.free.push(filled.staging);
                return Err(error);
            }
        };
        let staging = filled.staging;
        self.stream.wait(released)?;
        // SAFETY: the buffer is not handed to its fill thread again before `uploaded` completes
        // (`hand_out`), nor freed before (`Drop` synchronises the stream); the slot's region is the
        // filler's until its `ready` event, recorded after the copy on the same stream, and the
        // copy waited for the consumer's release of it.
        unsafe {
            staging
                .buffer
                .upload_async(&self.stream, 0, slot, 0, self.slot_bytes)?
        };
        staging.uploaded.record(&self.stream)?;
        thread.uploading.push_back(staging);
        ready.record(&self.stream)?;
        self.next_upload += 1;
        self.done.push_back((index, step, report));
        // The steps after this one go to the threads now, not at the next call.
        self.hand_out(self.next_upload)?;
        Ok(())
    }

    /// The oldest submitted batch: its slot, step and report (its upload is queued before its
    /// `ready` event, which the consumer waits on).
    pub fn complete(&mut self) -> Option<(u32, u64, FillReport)> {
        self.done.pop_front()
    }

    /// Batches submitted and not yet taken by [`Self::complete`].
    pub fn pending(&self) -> usize {
        self.done.len()
    }

    /// Seconds spent assembling (summed over the fill threads), and waiting for an assembly or an
    /// upload on the filler's side.
    pub fn times(&self) -> (f64, f64) {
        (self.fill_s, self.wait_s)
    }

    /// Fill threads.
    pub fn thread_count(&self) -> usize {
        self.threads.len()
    }

    /// Why io_uring is not used by the host assemblers, when it is not.
    pub fn engine_note(&self) -> Option<&str> {
        self.engine_note.as_deref()
    }
}

/// The error of a stream whose fill thread ended.
fn stopped() -> FillError {
    FillError::Device(DeviceError::Os {
        what: "assembling a batch on the host",
        source: std::io::Error::other("a fill thread stopped"),
    })
}

/// A fill thread: fills each job's step into its buffer with `assembler` and sends it back, until
/// the jobs end or the filler goes.
fn fill(
    mut assembler: HostAssembler,
    slot_bytes: usize,
    jobs: &Receiver<Job>,
    filled: &SyncSender<Filled>,
) {
    while let Ok(Job { step, mut staging }) = jobs.recv() {
        let started = std::time::Instant::now();
        let outcome = assembler.fill(step, &mut staging.buffer.as_mut_slice()[..slot_bytes]);
        let failed = outcome.is_err();
        let seconds = started.elapsed().as_secs_f64();
        let sent = filled.send(Filled {
            step,
            staging,
            outcome,
            seconds,
        });
        if sent.is_err() || failed {
            return;
        }
    }
}

impl Drop for HostUpload {
    fn drop(&mut self) {
        // The fill threads end once their jobs are closed (a thread blocked sending a filled
        // buffer is released when its receiver goes with `threads`, below).
        for thread in &mut self.threads {
            thread.jobs = None;
        }
        // No upload from a pinned buffer may still be running when the buffers go.
        let _ = self.stream.synchronize();
        for mut thread in self.threads.drain(..) {
            let handle = thread.thread.take();
            drop(thread);
            if let Some(handle) = handle {
                let _ = handle.join();
            }
        }
    }
}
