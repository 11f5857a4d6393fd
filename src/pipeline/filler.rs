//! A stream's filler: the thread that assembles each step's batch into a free slot and hands it on,
//! and the switch between the CPU backend (host slots, [`HostAssembler`]) and the GPU backend (device
//! slots, [`GpuAssembler`]).
//!
//! The filler knows neither sockets nor frames. Its consumer side is a [`Handoff`] (free slots in,
//! filled slots out) and the slots it writes are a [`SlotMemory`]; the socket server implements both.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::thread;

use super::block_cache::BlockCache;
use super::cpu::HostAssembler;
use super::gpu::{GpuAssembler, GpuStreamLimits};
use super::stream_plan::{FillError, FillReport, StreamDevice, StreamLimits, StreamPlan};
use crate::device::{Device, DeviceRegion, Event};
use crate::kernels::Kernels;
use crate::metrics::Metrics;
use crate::storage::gpu::{GpuReadError, GpuReader, GpuReaderLimits, PathChoice};
use crate::storage::windows::PageCacheWindows;
use crate::storage::StorageError;

/// What the GPU backend needs to fill streams on its device; composed once by the daemon.
pub struct GpuBackend {
    /// The device; streams asking for `StreamDevice::Cuda(ordinal)` are served on it.
    pub device: Device,
    /// Its ordinal.
    pub ordinal: u32,
    /// The kernels, compiled once for the device.
    pub kernels: Arc<Kernels>,
    /// Bounds of each stream's reader.
    pub reader_limits: GpuReaderLimits,
    /// Which read path serves each read (from the engine mode).
    pub choice: PathChoice,
    /// Device memory of each stream besides its slots.
    pub stream_limits: GpuStreamLimits,
    /// Registered page-cache windows, shared by every stream on the device so that data read once
    /// stays registered for the next epoch and the next consumer.
    pub windows: Arc<PageCacheWindows>,
    /// Round buffers kept between the device's streams.
    pub round_pool: Arc<crate::pipeline::gpu::RoundBufferPool>,
    /// Device memory kept between the device's streams: shard slots, and closed streams' block
    /// caches and region tables.
    pub shard_pool: Arc<crate::pipeline::gpu::ShardSlotPool>,
    /// The device's memory tier: datasets kept whole in device memory for every stream.
    pub tier: Arc<crate::pipeline::gpu::DeviceTier>,
    /// The device's NUMA node and its CPUs, where the host has several: its streams' threads and
    /// pinned buffers are placed there.
    pub numa: Option<crate::device::numa::NumaPlacement>,
    /// Whether its streams' fillers (and the threads they start) keep off the CPUs that service the
    /// device's interrupts.
    pub interrupt_cpus: InterruptCpus,
}

/// The backend that fills one stream.
#[derive(Clone, Copy)]
pub enum StreamBackend<'a> {
    /// Host slots, filled by the CPU assembler.
    Cpu,
    /// Device slots, filled by the GPU assembler on this backend's device.
    Gpu(&'a GpuBackend),
}

impl<'a> StreamBackend<'a> {
    /// The backend for a stream whose slots live on `device`, where `gpu` is the daemon's GPU
    /// backend if it runs one. Host streams are served either way.
    pub fn select(
        device: StreamDevice,
        gpus: &'a [Arc<GpuBackend>],
    ) -> Result<StreamBackend<'a>, BackendError> {
        match device {
            StreamDevice::Host => Ok(StreamBackend::Cpu),
            StreamDevice::Cuda(asked) if gpus.is_empty() => Err(BackendError::NoDevice { asked }),
            StreamDevice::Cuda(asked) => match gpus.iter().find(|g| g.ordinal == asked) {
                Some(gpu) => Ok(StreamBackend::Gpu(gpu)),
                None => Err(BackendError::OtherDevice {
                    asked,
                    served: gpus
                        .iter()
                        .map(|g| format!("cuda:{}", g.ordinal))
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
            },
        }
    }
}

/// A stream asks for a device this daemon does not serve.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The daemon runs its GPU backend on another device.
    #[error("device cuda:{asked} is not served: this daemon serves {served}")]
    OtherDevice {
        /// The device asked for.
        asked: u32,
        /// The devices served (`cuda:0, cuda:1`).
        served: String,
    },
    /// The daemon runs the CPU backend only.
    #[error("device cuda:{asked} is not served: this daemon runs the CPU backend")]
    NoDevice {
        /// The device asked for.
        asked: u32,
    },
}

/// A stream's filler could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum FillerError {
    /// The shards or the CPU read engine could not be opened.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The stream's device reader could not be set up (out of pinned or device memory).
    #[error("cannot set up device reads: {0}")]
    DeviceReads(GpuReadError),
    /// The GPU assembler's device buffers could not be set up.
    #[error(transparent)]
    Gpu(FillError),
}

impl GpuBackend {
    /// A stream's GPU pipeline for `plan` on this device: its device reader, and its assembler with
    /// buffers from the device's pools where they have them.
    pub fn open_assembler(
        &self,
        plan: Arc<StreamPlan>,
        metrics: Arc<Metrics>,
    ) -> Result<GpuAssembler, FillerError> {
        // The GPU backend plans rows of one dataset; the socket server refuses mixtures on a
        // device before they get here.
        assert!(
            plan.mixture.is_none(),
            "a mixture stream reached the GPU backend"
        );
        let reader =
            GpuReader::with_windows(&self.device, self.reader_limits, Arc::clone(&self.windows))
                .map_err(FillerError::DeviceReads)?;
        GpuAssembler::new(
            plan,
            Arc::clone(&self.kernels),
            reader,
            self.choice,
            &self.stream_limits,
            Arc::clone(&self.round_pool),
            &self.shard_pool,
            &self.tier,
            metrics,
        )
        .map_err(FillerError::Gpu)
    }
}

/// One device slot: its region of the ring's exportable allocation and its two interprocess events.
pub struct DeviceSlot {
    /// The slot's memory, mapped read-write for the daemon (kept alive by the ring that holds it).
    pub memory: DeviceRegion,
    /// Recorded by the daemon once the slot is filled; the consumer's stream waits on it.
    pub ready: Event,
    /// Recorded by the consumer on its stream when it releases the slot; the daemon's stream waits on
    /// it before writing the slot again. Never recorded before the first release, which makes the first
    /// wait a no-op.
    pub released: Event,
}

/// The slots a filler writes: host memory for the CPU backend, device slots for the GPU backend.
pub trait SlotMemory: Send + Sync + 'static {
    /// The memory of host slot `slot`, for writing. Panics on device slots.
    ///
    /// # Safety
    /// The caller holds the slot's filling lease (it got the slot from [`Handoff::take_free`] and has
    /// not delivered it yet), which makes this the only live reference to the slot's memory.
    #[allow(clippy::mut_from_ref)]
    unsafe fn host_slot(&self, slot: u32) -> &mut [u8];

    /// Device slot `slot`. Panics on host slots.
    fn device_slot(&self, slot: u32) -> &DeviceSlot;
}

/// A slot filled with stream step `step`, ready to be handed to the consumer.
#[derive(Clone, Copy, Debug)]
pub struct Filled {
    /// The slot.
    pub slot: u32,
    /// The stream step it holds.
    pub step: u64,
    /// What the fill found.
    pub report: FillReport,
}

/// Batches handed to the consumer by one [`Handoff::deliver`] at most: the filler delivers the
/// batches it finds complete together (a group's, gathered by one round) with one publication.
pub const DELIVER_AT_ONCE_MAX: usize = 16;

/// The stream is ending (its consumer left, or its session stops it): the filler stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended;

/// The consumer's side of a stream as the filler sees it: where free slots come from and where filled
/// ones go. The socket server implements it over the session's socket.
pub trait Handoff: Send + 'static {
    /// The filler thread started (before its first step).
    fn begin(&mut self) {}

    /// The next free slot, leased to the filler from now on. Waits for one when `wait`; otherwise
    /// `Ok(None)` when none is free now.
    fn take_free(&mut self, wait: bool) -> Result<Option<u32>, Ended>;

    /// Hands filled slots to the consumer, in stream order: one or several completed together (a
    /// group's batches), at most [`DELIVER_AT_ONCE_MAX`].
    fn deliver(&mut self, filled: &[Filled]) -> Result<(), Ended>;

    /// Ends the stream because a batch could not be filled.
    fn fail(&mut self, error: FillError);

    /// Every step was delivered.
    fn finish(&mut self);
}

/// For the filler's log: seconds waiting for a free slot, delivering, and in the loop's other calls
/// (taking free slots, submitting, completing); when each quarter of the steps was delivered (a
/// window shuffle of four windows shows each window's pace); and the GPU timings and the hand-off's
/// time when three quarters were delivered, for the last quarter's own figures (a window shuffle's
/// last window is served with no copy left).
#[derive(Default)]
struct LoopTimes {
    free_wait_s: f64,
    deliver_s: f64,
    take_s: f64,
    submit_s: f64,
    complete_s: f64,
    quarters: [f64; 4],
    three_quarters: Option<(crate::pipeline::gpu::GpuFillTimings, f64, f64)>,
}

/// What fills a stream's slots, on the backend the stream asked for.
pub struct Filler {
    steps: u64,
    backend: Backend,
    /// The device's NUMA node, which the filler thread is bound to (GPU streams on a host with
    /// several nodes).
    numa: Option<crate::device::numa::NumaPlacement>,
    /// GPU streams: the device's PCI address, to keep the filler thread off the CPUs that service
    /// its interrupts.
    pci_address: Option<String>,
    /// Whether the filler thread keeps off those CPUs (GPU streams).
    interrupt_cpus: InterruptCpus,
    /// GPU streams: the device's ordinal and the device bytes the pipeline holds, for the
    /// per-device figures.
    device: Option<(u32, u64)>,
    metrics: Arc<Metrics>,
}

impl Drop for Filler {
    fn drop(&mut self) {
        if let Some((ordinal, bytes)) = self.device {
            self.metrics.device_stream_closed(ordinal, bytes);
        }
    }
}

/// The CPU assembler into host slots, or the GPU assembler into device slots.
enum Backend {
    /// Fills each slot before `submit` returns; `done` holds the filled slots and steps.
    Cpu {
        assembler: Box<HostAssembler>,
        done: VecDeque<(u32, u64, FillReport)>,
    },
    /// Queues batches on the device; `slots` holds the submitted slots, oldest first.
    Gpu {
        assembler: Box<GpuAssembler>,
        slots: VecDeque<u32>,
    },
    /// Device slots filled by the CPU assembler through pinned buffers (a mixture on a device:
    /// see `pipeline::upload`).
    Upload(Box<super::upload::HostUpload>),
}

impl Filler {
    /// Sets up the assembler of `plan` on `backend`; a host stream's decoded blocks go to
    /// `block_cache`, shared by the daemon's host streams.
    pub fn new(
        plan: Arc<StreamPlan>,
        backend: StreamBackend<'_>,
        limits: &StreamLimits,
        metrics: Arc<Metrics>,
        block_cache: &Arc<BlockCache>,
    ) -> Result<Filler, FillerError> {
        let steps = plan.steps;
        let (numa, ordinal, pci_address, interrupt_cpus) = match backend {
            StreamBackend::Gpu(gpu) => (
                gpu.numa.clone(),
                Some(gpu.ordinal),
                Some(gpu.device.properties().pci_address.clone()).filter(|a| !a.is_empty()),
                gpu.interrupt_cpus,
            ),
            StreamBackend::Cpu => (None, None, None, INTERRUPT_CPUS_DEFAULT),
        };
        let backend = match backend {
            StreamBackend::Cpu => {
                let assembler =
                    HostAssembler::with_cache(plan, limits, Arc::clone(&metrics), block_cache)?;
                if let Some(note) = assembler.engine_note() {
                    tracing::warn!("{note}");
                }
                Backend::Cpu {
                    assembler: Box::new(assembler),
                    done: VecDeque::new(),
                }
            }
            StreamBackend::Gpu(gpu) if super::upload::assembled_on_host(&plan) => {
                let (slot_bytes, steps) = (plan.slot_bytes, plan.steps);
                // One assembler per fill thread, each of the whole plan.
                let assemblers = (0..super::upload::fill_threads(&plan))
                    .map(|_| {
                        let plan = Arc::clone(&plan);
                        HostAssembler::with_cache(plan, limits, Arc::clone(&metrics), block_cache)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let _bound = crate::device::numa::BoundForNow::new(gpu.numa.as_ref());
                let upload =
                    super::upload::HostUpload::new(assemblers, &gpu.device, slot_bytes, steps)
                        .map_err(|error| FillerError::Gpu(error.into()))?;
                if let Some(note) = upload.engine_note() {
                    tracing::warn!("{note}");
                }
                Backend::Upload(Box::new(upload))
            }
            StreamBackend::Gpu(gpu) => {
                // The stream's pinned buffers, and the loader and verification threads it starts,
                // belong on the device's node.
                // Off the CPUs that service the device's interrupts too, like the filler thread.
                let avoid = match &pci_address {
                    Some(address) if interrupt_cpus == InterruptCpus::Avoid => {
                        gpufeed_proto::affinity::interrupt_cpus(address)
                    }
                    _ => Vec::new(),
                };
                let _bound =
                    crate::device::numa::BoundForNow::new(gpu.numa.as_ref()).avoiding(&avoid);
                let open = |plan: Arc<StreamPlan>| gpu.open_assembler(plan, Arc::clone(&metrics));
                // Device memory that closed streams left for the device's next ones.
                let kept_before = gpu.shard_pool.idle_bytes();
                let assembler = match open(Arc::clone(&plan)) {
                    // Short of device memory while the pool held some: all that the pool keeps is
                    // freed, and the stream opens once more.
                    Err(FillerError::Gpu(error)) if error.is_out_of_memory() && kept_before > 0 => {
                        let freed = gpu.shard_pool.release_all();
                        tracing::info!(
                            "stream ran short of device memory ({error}); {freed} bytes kept for \
                             later streams freed, opening again"
                        );
                        open(plan)?
                    }
                    opened => opened?,
                };
                Backend::Gpu {
                    assembler: Box::new(assembler),
                    slots: VecDeque::new(),
                }
            }
        };
        let device = match (&backend, ordinal) {
            (Backend::Gpu { assembler, .. }, Some(ordinal)) => {
                let bytes = assembler.device_bytes();
                metrics.device_stream_opened(ordinal, bytes);
                Some((ordinal, bytes))
            }
            (Backend::Upload(_), Some(ordinal)) => {
                metrics.device_stream_opened(ordinal, 0);
                Some((ordinal, 0))
            }
            _ => None,
        };
        Ok(Filler {
            steps,
            backend,
            numa,
            pci_address,
            interrupt_cpus,
            device,
            metrics,
        })
    }

    /// Starts the filler thread: it fills every step of the stream into `slots`, as `handoff` frees
    /// them, and hands each batch on in step order.
    pub fn spawn<M: SlotMemory, H: Handoff>(
        self,
        slots: Arc<M>,
        handoff: H,
    ) -> io::Result<thread::JoinHandle<()>> {
        thread::Builder::new()
            .name("gpufeed-filler".into())
            .spawn(move || {
                // The planning threads it starts inherit the binding.
                if let Some(numa) = &self.numa {
                    if let Err(error) = crate::device::numa::bind_current_thread(&numa.cpus) {
                        tracing::warn!("filler: binding to NUMA node {}: {error}", numa.node);
                    }
                }
                if let Some(address) = self
                    .pci_address
                    .as_deref()
                    .filter(|_| self.interrupt_cpus == InterruptCpus::Avoid)
                {
                    // Read again: the stream's set-up may have taken a while, and a CPU's share
                    // may have changed (irqbalance).
                    let avoid = gpufeed_proto::affinity::interrupt_cpus(address);
                    match gpufeed_proto::affinity::keep_thread_off(&avoid) {
                        Ok(Some(cpus)) => tracing::debug!(
                            "filler: off CPUs {avoid:?}, which service {address}'s interrupts; on \
                             {} others",
                            cpus.len()
                        ),
                        Ok(None) => {}
                        Err(error) => tracing::warn!("filler: avoiding CPUs {avoid:?}: {error}"),
                    }
                }
                let mut handoff = handoff;
                handoff.begin();
                self.run(&*slots, handoff)
            })
    }

    /// The filler thread's loop.
    ///
    /// Batches are submitted up to the filler's depth ahead of the hand-off. The filler never blocks
    /// on a free slot while it holds a batch the consumer has not got: the consumer may be waiting for
    /// exactly that batch before it releases anything.
    fn run<H: Handoff>(self, slots: &dyn SlotMemory, mut handoff: H) {
        // `self` is consumed here, so the assembler (and its queued device work, drained on drop) goes
        // before the caller's reference to the slots it writes.
        let mut filler = self;
        let started = std::time::Instant::now();
        let usage_at_start = thread_usage();
        let depth = filler.depth();
        let mut next = 0u64;
        let mut times = LoopTimes::default();
        let mut delivered = 0u64;
        let mut done: Vec<Filled> = Vec::with_capacity(DELIVER_AT_ONCE_MAX);
        // The end of the loop's last phase: each phase reads the clock once, when it ends.
        let mut mark = std::time::Instant::now();
        loop {
            let pending = filler.pending();
            if next == filler.steps && pending == 0 {
                break;
            }
            if next < filler.steps
                && pending < depth
                && !(pending > 0 && filler.delivers_before(next))
            {
                let taken = handoff.take_free(pending == 0);
                let submitting = std::time::Instant::now();
                let took = (submitting - mark).as_secs_f64();
                mark = submitting;
                times.take_s += took;
                if pending == 0 {
                    times.free_wait_s += took;
                }
                match taken {
                    Ok(Some(slot)) => {
                        if let Err(error) = filler.submit(slots, slot, next) {
                            return handoff.fail(error);
                        }
                        let submitted = std::time::Instant::now();
                        times.submit_s += (submitted - mark).as_secs_f64();
                        mark = submitted;
                        next += 1;
                        continue;
                    }
                    Ok(None) => {}
                    Err(Ended) => return,
                }
            }
            // The oldest batch, waited for, and those after it already complete with it (a group's
            // batches complete with their round): delivered together.
            let completing = mark;
            done.clear();
            loop {
                match filler.complete(slots) {
                    Ok((slot, step, report)) => done.push(Filled { slot, step, report }),
                    Err(error) => {
                        // The batches completed before the failing one are sound: delivered first.
                        if !done.is_empty() && handoff.deliver(&done).is_err() {
                            return;
                        }
                        return handoff.fail(error);
                    }
                }
                if done.len() == DELIVER_AT_ONCE_MAX || !filler.oldest_complete() {
                    break;
                }
            }
            let delivering = std::time::Instant::now();
            times.complete_s += (delivering - completing).as_secs_f64();
            if handoff.deliver(&done).is_err() {
                return;
            }
            if let Some((ordinal, _)) = filler.device {
                let samples = done.iter().map(|d| u64::from(d.report.samples)).sum();
                filler
                    .metrics
                    .device_batches(ordinal, done.len() as u64, samples);
            }
            let delivered_at = std::time::Instant::now();
            times.deliver_s += (delivered_at - delivering).as_secs_f64();
            mark = delivered_at;
            let before = delivered;
            delivered += done.len() as u64;
            for (quarter, at) in times.quarters.iter_mut().enumerate() {
                let due = (filler.steps * (quarter as u64 + 1)).div_ceil(4);
                if before < due && due <= delivered {
                    *at = started.elapsed().as_secs_f64();
                    if quarter == 2 {
                        if let Backend::Gpu { assembler, .. } = &filler.backend {
                            times.three_quarters =
                                Some((assembler.timings(), times.free_wait_s, times.deliver_s));
                        }
                    }
                }
            }
        }
        filler.log_gpu_stream(started, &usage_at_start, &times);
        handoff.finish();
    }

    /// The GPU stream's log lines when it is done: the filler thread's CPU time, the last quarter's
    /// figures and the whole stream's.
    fn log_gpu_stream(
        &self,
        started: std::time::Instant,
        usage_at_start: &ThreadUsage,
        times: &LoopTimes,
    ) {
        if let Backend::Upload(upload) = &self.backend {
            let (fill_s, wait_s) = upload.times();
            tracing::info!(
                "device stream filled on the host done: {} steps, {:.3} s; assembling {:.3} s on \
                 {} threads, waiting for assemblies and uploads {:.3} s, for a free slot {:.3} s, \
                 delivering {:.3} s",
                self.steps,
                started.elapsed().as_secs_f64(),
                fill_s,
                upload.thread_count(),
                wait_s,
                times.free_wait_s,
                times.deliver_s
            );
        }
        if let Backend::Gpu { assembler, .. } = &self.backend {
            let t = assembler.timings();
            // The filler thread's own CPU time and involuntary context switches over the stream:
            // whether a slow stream's host work was slow on the core or kept off it.
            let usage = thread_usage().since(usage_at_start);
            tracing::info!(
                "GPU stream's filler thread: {:.3} s of CPU over {:.3} s, {} involuntary and {} \
                 voluntary context switches, last on CPU {}",
                usage.cpu_s,
                started.elapsed().as_secs_f64(),
                usage.involuntary_switches,
                usage.voluntary_switches,
                // SAFETY: sched_getcpu takes no arguments.
                unsafe { libc::sched_getcpu() }
            );
            if let Some((at, free_at, deliver_at)) = times.three_quarters {
                tracing::info!(
                    "GPU stream's last quarter: {:.3} s, of which host plan {:.3} s, gather {:.3} s, \
                     waiting for the device {:.3} s, for a free slot {:.3} s, delivering {:.3} s; \
                     {} rounds",
                    times.quarters[3] - times.quarters[2],
                    t.plan_s - at.plan_s,
                    t.gather_s - at.gather_s,
                    t.wait_s - at.wait_s,
                    times.free_wait_s - free_at,
                    times.deliver_s - deliver_at,
                    t.rounds - at.rounds
                );
            }
            tracing::info!(
                "GPU stream done: {} steps in {} rounds, {:.3} s; host plan {:.3} s (planning \
                 threads busy {:.3} s), read {:.3} s, decode {:.3} s, gather {:.3} s, waiting for \
                 the device {:.3} s, for a free slot {:.3} s, delivering {:.3} s; quarters of the \
                 steps delivered at {:.3}/{:.3}/{:.3}/{:.3} s; {} rounds read device copies of shards, \
                 {} passed their piece tables in the launch; {} batches gathered in groups; the loop \
                 took slots for {:.3} s, submitted for {:.3} s, \
                 completed for {:.3} s",
                self.steps,
                t.rounds,
                started.elapsed().as_secs_f64(),
                t.plan_s,
                t.planning_threads_s,
                t.read_s,
                t.decode_s,
                t.gather_s,
                t.wait_s,
                times.free_wait_s,
                times.deliver_s,
                times.quarters[0],
                times.quarters[1],
                times.quarters[2],
                times.quarters[3],
                t.rounds_from_device_copies,
                t.rounds_inline,
                t.batches_grouped,
                times.take_s,
                times.submit_s,
                times.complete_s
            );
        }
    }

    /// Batches submitted ahead of the hand-off at most.
    fn depth(&self) -> usize {
        match &self.backend {
            Backend::Cpu { .. } | Backend::Upload(_) => 1,
            Backend::Gpu { assembler, .. } => assembler.batches_ahead(),
        }
    }

    /// Whether the oldest batch submitted is complete already, so that [`Self::complete`] would
    /// return it without waiting for the device.
    fn oldest_complete(&self) -> bool {
        match &self.backend {
            Backend::Cpu { done, .. } => !done.is_empty(),
            Backend::Upload(upload) => upload.pending() > 0,
            Backend::Gpu { assembler, .. } => assembler.oldest_complete(),
        }
    }

    /// Whether the batches submitted are delivered before step `step` is submitted (see
    /// [`crate::pipeline::GpuAssembler::delivers_before`]).
    fn delivers_before(&self, step: u64) -> bool {
        match &self.backend {
            Backend::Gpu { assembler, .. } => assembler.delivers_before(step),
            _ => false,
        }
    }

    /// Batches submitted and not completed.
    fn pending(&self) -> usize {
        match &self.backend {
            Backend::Cpu { done, .. } => done.len(),
            Backend::Upload(upload) => upload.pending(),
            Backend::Gpu { slots, .. } => slots.len(),
        }
    }

    /// Starts filling `slot` with stream step `step` (the filler thread holds its filling lease).
    fn submit(&mut self, memory: &dyn SlotMemory, slot: u32, step: u64) -> Result<(), FillError> {
        match &mut self.backend {
            Backend::Cpu { assembler, done } => {
                // SAFETY: the filler thread holds the slot's filling lease: it took the slot from
                // `Handoff::take_free` and delivers it only after this fill.
                let memory = unsafe { memory.host_slot(slot) };
                let report = assembler.fill(step, memory)?;
                done.push_back((slot, step, report));
                Ok(())
            }
            Backend::Upload(upload) => {
                let device_slot = memory.device_slot(slot);
                upload.submit(
                    (slot, step),
                    &device_slot.memory,
                    &device_slot.released,
                    &device_slot.ready,
                )
            }
            Backend::Gpu { assembler, slots } => {
                let device_slot = memory.device_slot(slot);
                assembler.submit(
                    step,
                    &device_slot.memory,
                    &device_slot.released,
                    Some(&device_slot.ready),
                )?;
                slots.push_back(slot);
                Ok(())
            }
        }
    }

    /// The oldest submitted batch once it is complete and sound: its slot, step and report. On the
    /// GPU its work is done (or, for samples zeroed at the last moment, queued before the slot's ready
    /// event, which the consumer waits on).
    fn complete(&mut self, memory: &dyn SlotMemory) -> Result<(u32, u64, FillReport), FillError> {
        match &mut self.backend {
            Backend::Cpu { done, .. } => Ok(done.pop_front().expect("a batch was submitted")),
            Backend::Upload(upload) => Ok(upload.complete().expect("a batch was submitted")),
            Backend::Gpu { assembler, slots } => {
                let slot = *slots.front().expect("a batch was submitted");
                let (step, report) = assembler.complete(Some(&memory.device_slot(slot).ready))?;
                slots.pop_front();
                Ok((slot, step, report))
            }
        }
    }
}

/// Whether GPU fillers (and the planning threads they start) keep off the CPUs that service their
/// device's interrupts (`gpufeed_proto::affinity`). On the H100 test machine a filler on the
/// interrupt CPU ran an epoch three times slower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterruptCpus {
    /// Keep off them (the default, [`INTERRUPT_CPUS_DEFAULT`]).
    Avoid,
    /// Run anywhere the process may.
    Allow,
}

/// The default [`GpuBackend::interrupt_cpus`].
pub const INTERRUPT_CPUS_DEFAULT: InterruptCpus = InterruptCpus::Avoid;

impl InterruptCpus {
    /// The name used in configuration and status.
    pub fn name(self) -> &'static str {
        match self {
            InterruptCpus::Avoid => "avoid",
            InterruptCpus::Allow => "allow",
        }
    }
}

impl std::str::FromStr for InterruptCpus {
    type Err = String;

    fn from_str(text: &str) -> Result<InterruptCpus, String> {
        match text {
            "avoid" => Ok(InterruptCpus::Avoid),
            "allow" => Ok(InterruptCpus::Allow),
            other => Err(format!("{other:?} is not avoid or allow")),
        }
    }
}

/// CPU time and context switches of the calling thread so far (`getrusage(RUSAGE_THREAD)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadUsage {
    /// User and system CPU seconds.
    pub cpu_s: f64,
    /// Times the thread was taken off its CPU while it could run.
    pub involuntary_switches: i64,
    /// Times the thread gave up its CPU to wait.
    pub voluntary_switches: i64,
}

impl ThreadUsage {
    /// What was used between `earlier` and `self`.
    pub fn since(&self, earlier: &ThreadUsage) -> ThreadUsage {
        ThreadUsage {
            cpu_s: self.cpu_s - earlier.cpu_s,
            involuntary_switches: self.involuntary_switches - earlier.involuntary_switches,
            voluntary_switches: self.voluntary_switches - earlier.voluntary_switches,
        }
    }
}

/// The calling thread's [`ThreadUsage`] (zeros if the kernel refuses).
pub fn thread_usage() -> ThreadUsage {
    // SAFETY: getrusage writes one rusage struct into a live, zeroed local.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } != 0 {
        return ThreadUsage::default();
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    ThreadUsage {
        cpu_s: seconds(usage.ru_utime) + seconds(usage.ru_stime),
        involuntary_switches: usage.ru_nivcsw,
        voluntary_switches: usage.ru_nvcsw,
    }
}

#[cfg(test)]
mod thread_usage_tests {
    use super::*;

    #[test]
    fn a_thread_that_spins_sees_its_own_cpu_time_grow() {
        let start = thread_usage();
        assert!(start.cpu_s >= 0.0);
        // Spin until this thread's CPU time has grown by 10 ms: the count must move (a loaded
        // machine only makes that take longer; the wall-clock bound catches a counter that is stuck).
        let began = std::time::Instant::now();
        let mut x = 0u64;
        let used = loop {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            let used = thread_usage().since(&start);
            if used.cpu_s >= 0.010 {
                break used;
            }
            assert!(
                began.elapsed() < std::time::Duration::from_secs(60),
                "the thread's CPU time did not grow: {used:?}"
            );
        };
        assert!(used.involuntary_switches >= 0 && used.voluntary_switches >= 0);
    }
}
