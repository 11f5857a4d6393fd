//! Resident streams: when every block of a stream's fields is stored raw and the whole dataset lies in
//! page cache that can be registered within the budget, every window of every shard is mapped for the
//! device when the stream opens and stays mapped (pinned) for the stream's life. Each row of a batch is
//! then one gather piece read in place over PCIe, planned by arithmetic (sample, shard, block, window)
//! with no per-round lookups, and the region table is uploaded once. The order of the rows does not
//! matter: a full shuffle costs what dataset order costs.
//!
//! Every raw block is verified once, when the stream opens, unless a stream of the dataset has done so
//! before (the dataset's record of verified blocks); blocks found corrupt then are known to every
//! batch, whose rows that read them are zeroed (policy `replace`) or end the stream (policy `fail`)
//! before their batch is handed off.

use std::sync::Arc;

use crate::pipeline::CorruptPolicy;
use foldhash::{HashMap, HashMapExt};
use memmap2::Mmap;

use super::device_shards::{DeviceShards, ShardWindows};
use super::round::{HostLayout, PendingBatch, PendingRound, RoundBuffers, REGIONS_MAX};
use super::shard_pool::{KeptBuffer, ShardSlotPool};
use super::{GpuAssembler, GpuStreamLimits, ZeroCopy};
use crate::decode::{self, BlockRef};
use crate::device::{DeviceMemory, DeviceRegion, Event};
use crate::format::Codec;
use crate::kernels::{
    resolve_inline, GatherOp, GatherPlan, GatherRegion, GATHER_OUTCOME_BYTES, GATHER_SOURCES_MAX,
};
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock, FillError, PlacementRuns, StreamPlan};
use crate::storage::windows::{PageCacheWindows, WindowId};
use crate::storage::{FileId, FileTable};

/// Most pieces one row adds (a row of a field split across two blocks and two windows at worst, per
/// field, with GatherPlan's own split of long pieces).
const ROW_PIECES_MAX_PER_FIELD: usize = 4;

/// Threads verifying a dataset's blocks when a resident stream opens.
const VERIFY_THREADS_MAX: usize = 8;

/// Threads planning a resident stream's steps ahead of the filler (at most the host's CPU count),
/// unless `GPUFEED_PLAN_THREADS` (1 to [`PLAN_WORKERS_MAX`]) says otherwise. A window shuffle of 4096
/// rows of 2 KiB keeps six threads about half busy (0.54 to 0.62 s of planning per 8 GiB epoch of
/// 0.19 s on the H100 test machine), and they can fall behind in its last window, when no copies
/// pace the filler: on one machine (read-path run 44) the window shuffle made 0.886x of the in-order
/// rate with 6 threads and 0.906x with 12.
const PLAN_WORKERS: usize = 12;

/// The most planning threads per stream.
const PLAN_WORKERS_MAX: usize = 32;

/// Planning threads per resident stream: `GPUFEED_PLAN_THREADS` if set to 1 to [`PLAN_WORKERS_MAX`],
/// else [`PLAN_WORKERS`] or the CPU count, the fewer.
fn plan_workers() -> usize {
    static WORKERS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WORKERS.get_or_init(|| {
        super::env_tuning("GPUFEED_PLAN_THREADS", 1, PLAN_WORKERS_MAX as u64).map_or_else(
            || {
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                PLAN_WORKERS.min(cpus.max(2))
            },
            |n| n as usize,
        )
    })
}

/// The mapped windows and region table of a resident stream.
pub(super) struct Resident {
    /// The region table on the device (one region per window, shards in order).
    regions: KeptBuffer,
    region_count: u32,
    /// The same table on the host, for rounds that read some shards from their device copies.
    host_regions: Vec<GatherRegion>,
    /// A round's region table (`host_regions`, redirected to the device copies it may read), kept
    /// for its capacity: no allocation per round.
    round_regions: Vec<GatherRegion>,
    /// The round's region table encoded for the device, kept likewise.
    round_regions_encoded: Vec<u8>,
    /// Shards copied ahead into device memory, in dataset order and window shuffles.
    device_shards: Option<DeviceShards>,
    /// Windows pinned for the stream's life.
    windows: PinnedWindows,
    /// Where rows are read from, shared by the planning threads.
    geometry: Arc<RowGeometry>,
    /// Plans the rows of the next steps on a thread of its own, ahead of the filler.
    planner: Option<Planner>,
}

/// Windows that [`PageCacheWindows::map`] pinned for a stream, unpinned when dropped: when the
/// stream is released, and on every error path of its opening (a pinned window is never evicted, so
/// a leaked pin would keep part of the registration budget from later streams).
struct PinnedWindows {
    registry: Arc<PageCacheWindows>,
    ids: Vec<WindowId>,
}

impl PinnedWindows {
    fn new(registry: &Arc<PageCacheWindows>) -> PinnedWindows {
        PinnedWindows {
            registry: Arc::clone(registry),
            ids: Vec::new(),
        }
    }

    /// Unpins the windows now (no queued work may read them any more).
    fn unpin(&mut self) {
        self.registry.unpin(&std::mem::take(&mut self.ids));
    }
}

impl Drop for PinnedWindows {
    fn drop(&mut self) {
        self.unpin();
    }
}

/// Steps each planning thread plans ahead of the filler: with 3, a window shuffle's filler waited
/// 27 to 119 ms an epoch (8 GiB, batch 4096) for plans on the H100 test machine, with 16 it waits 3 to
/// 6 ms (a planned step of 4096 rows holds about 100 KiB).
const STEPS_PLANNED_AHEAD: usize = 16;

/// One step's rows, planned in rounds.
struct PlannedStep {
    step: u64,
    /// Global order position of the step's first row (where the shards to read ahead start).
    first_position: Option<u64>,
    rows: usize,
    rounds: Result<Vec<PlannedRows>, FillError>,
}

/// Threads planning the rows of a resident stream's steps ahead of the filler, so that host
/// planning overlaps the device's work on earlier steps instead of adding to it. The steps go in
/// chunks of `chunk` consecutive steps (one for large batches; a group's worth for small ones, so
/// that the filler takes a message, and wakes a planning thread, once a group rather than once a
/// batch); worker `k` of `n` plans chunks `k`, `k + n`, ..., each on its own (threads are started
/// once per stream, not per batch: starting them per batch cost more than the planning).
struct Planner {
    /// One channel per worker; chunk `c` (steps `first + c * chunk ..`) comes from
    /// `receivers[c % n]`.
    receivers: Vec<std::sync::mpsc::Receiver<Vec<PlannedStep>>>,
    first_step: u64,
    next_step: u64,
    chunk: u64,
    /// The rest of the chunk being taken, in step order.
    taken: std::collections::VecDeque<PlannedStep>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Nanoseconds spent planning, summed over the threads.
    busy_ns: Arc<std::sync::atomic::AtomicU64>,
}

impl Planner {
    /// Starts planning from `first_step`, `rows_per_round` rows a round, in chunks of `chunk`
    /// steps.
    fn start(
        plan: Arc<StreamPlan>,
        geometry: Arc<RowGeometry>,
        first_step: u64,
        rows_per_round: usize,
        chunk: usize,
    ) -> Planner {
        let chunk = chunk.max(1) as u64;
        let chunks = plan.steps.saturating_sub(first_step).div_ceil(chunk);
        let workers = plan_workers().min(chunks.max(1) as usize);
        let mut receivers = Vec::with_capacity(workers);
        let mut threads = Vec::with_capacity(workers);
        let busy_ns = Arc::new(std::sync::atomic::AtomicU64::new(0));
        for worker in 0..workers {
            let (sender, receiver) =
                std::sync::mpsc::sync_channel((STEPS_PLANNED_AHEAD / chunk as usize).max(2));
            let (plan, geometry) = (Arc::clone(&plan), Arc::clone(&geometry));
            let busy_ns = Arc::clone(&busy_ns);
            let thread = std::thread::Builder::new()
                .name(format!("gpufeed-plan-{worker}"))
                .spawn(move || {
                    for index in (worker as u64..chunks).step_by(workers) {
                        let first = first_step + index * chunk;
                        let steps = first..(first + chunk).min(plan.steps);
                        let mut planned = Vec::with_capacity(chunk as usize);
                        let mut failed = false;
                        for step in steps {
                            let started = std::time::Instant::now();
                            let positions: Vec<u64> = plan
                                .rank
                                .batch_positions(plan.order.len(), plan.start_cursor, step)
                                .collect();
                            let rounds = plan_step(&plan, &geometry, &positions, rows_per_round);
                            busy_ns.fetch_add(
                                started.elapsed().as_nanos() as u64,
                                std::sync::atomic::Ordering::Relaxed,
                            );
                            failed = rounds.is_err();
                            planned.push(PlannedStep {
                                step,
                                first_position: positions.first().copied(),
                                rows: positions.len(),
                                rounds,
                            });
                            if failed {
                                break;
                            }
                        }
                        // The filler stopped listening (the stream ended): stop planning.
                        if sender.send(planned).is_err() || failed {
                            break;
                        }
                    }
                })
                .expect("spawning a planning thread");
            receivers.push(receiver);
            threads.push(thread);
        }
        Planner {
            receivers,
            first_step,
            next_step: first_step,
            chunk,
            taken: std::collections::VecDeque::new(),
            threads,
            busy_ns,
        }
    }

    /// Seconds the planning threads spent planning, summed over the threads.
    fn busy_s(&self) -> f64 {
        self.busy_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
    }

    /// The planned rows of the next step.
    fn next(&mut self) -> Result<PlannedStep, FillError> {
        let step = self.next_step;
        if self.taken.is_empty() {
            let index = (step - self.first_step) / self.chunk;
            let worker = (index % self.receivers.len() as u64) as usize;
            self.taken = self.receivers[worker]
                .recv()
                .map_err(|_| FillError::PlannerStopped { step })?
                .into();
        }
        let planned = self
            .taken
            .pop_front()
            .ok_or(FillError::PlannerStopped { step })?;
        debug_assert_eq!(planned.step, step);
        self.next_step += 1;
        Ok(planned)
    }
}

/// Plans the rows `positions` of one step in rounds of `rows_per_round` rows.
fn plan_step(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    positions: &[u64],
    rows_per_round: usize,
) -> Result<Vec<PlannedRows>, FillError> {
    let mut rounds = Vec::new();
    let mut first = 0;
    while first < positions.len() {
        let end = (first + rows_per_round).min(positions.len());
        rounds.push(plan_chunk(plan, geometry, positions, first..end)?);
        first = end;
    }
    Ok(rounds)
}

impl Drop for Planner {
    fn drop(&mut self) {
        // Closing the channels ends each thread after the step it is planning.
        self.receivers.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// What planning a row needs besides the stream plan.
struct RowGeometry {
    /// Region index of each shard's first window.
    first_region: Vec<u32>,
    /// First sample of each shard, and the sample count after the last.
    shard_first_samples: Vec<u64>,
    /// Regions in the stream's table.
    region_count: usize,
    window_bytes: u64,
    /// Raw blocks found corrupt when the stream opened.
    corrupt: HashMap<BlockKey, Arc<CorruptBlock>>,
    /// Per shard, per stream field (in plan order): where the field's raw bytes start in the shard
    /// file, and its blocks' raw size, when its blocks lie back to back in raw order (the packer's
    /// layout for raw blocks of a page-multiple size), so that a row's file offset is one addition.
    linear: Vec<Vec<Option<(u64, u64)>>>,
}

/// The linear layout of one field in one shard (see [`RowGeometry::linear`]), if it has one.
fn linear_layout(blocks: &[crate::format::BlockEntry]) -> Option<(u64, u64)> {
    let first = blocks.first()?;
    let size = first.raw_bytes as u64;
    let base = first.stored_offset;
    let linear = blocks.iter().enumerate().all(|(i, b)| {
        let last = i + 1 == blocks.len();
        b.codec == Codec::Raw
            && b.raw_offset == i as u64 * size
            && b.stored_offset == base + i as u64 * size
            && b.stored_bytes == b.raw_bytes
            && (last || b.raw_bytes as u64 == size)
    });
    (linear && first.raw_offset == 0 && size > 0).then_some((base, size))
}

impl Resident {
    /// Maps every window of every shard of `plan` for the device, if the stream qualifies: every block
    /// of its fields raw, the policy not `off` (and `always`, or a shuffled order), and every window
    /// resident and within the budget. `None` otherwise (the windows mapped so far are released).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        plan: &StreamPlan,
        files: &FileTable,
        windows: &Arc<PageCacheWindows>,
        limits: &GpuStreamLimits,
        fraction_min: f64,
        device: &crate::device::Device,
        metrics: &crate::metrics::DeviceMetrics,
        shard_pool: &Arc<ShardSlotPool>,
    ) -> Result<Option<Resident>, FillError> {
        let wanted = match limits.zero_copy {
            ZeroCopy::Off => false,
            ZeroCopy::Always => true,
            // In dataset order whole blocks are staged at the copy engines' rate, unless the
            // shards can be copied ahead into device memory (checked once the windows are mapped).
            ZeroCopy::Auto => !plan.order.is_identity() || limits.device_shard_bytes > 0,
        };
        if !wanted || !fields_all_raw(plan) {
            return Ok(None);
        }
        let file_bytes = shard_file_bytes(plan, files)?;
        let total: u64 = file_bytes.iter().sum();
        if total > windows.registered_bytes_max() as u64 {
            return Self::open_streamed(
                plan,
                files,
                windows,
                limits,
                fraction_min,
                device,
                metrics,
                &file_bytes,
                shard_pool,
            );
        }
        if plan.order.samples_ahead(0, 1).is_none() {
            warm_for_full_shuffle(plan, files, windows, fraction_min, &file_bytes, metrics);
        }
        let started = std::time::Instant::now();
        let window_bytes = windows.window_bytes();
        let mut mapped = PinnedWindows::new(windows);
        let mut table: Vec<GatherRegion> = Vec::new();
        let mut first_region = Vec::with_capacity(plan.dataset.shards.len());
        let mut shard_windows = Vec::with_capacity(plan.dataset.shards.len());
        for (index, &bytes) in file_bytes.iter().enumerate() {
            first_region.push(table.len() as u32);
            shard_windows.push(ShardWindows {
                windows: Vec::new(),
                first_region: table.len(),
            });
            let file = files.get(FileId(index as u32)).file();
            let mut start = 0u64;
            while start < bytes {
                let len = window_bytes.min(bytes - start);
                match windows.map(file, start, len as usize, fraction_min)? {
                    Some(range) => {
                        mapped.ids.push(range.window);
                        shard_windows[index]
                            .windows
                            .push((range.window_host_addr, range.window_bytes));
                        table.push(GatherRegion {
                            ptr: range.window_device_ptr,
                            bytes: range.window_bytes,
                        });
                    }
                    None => {
                        mapped.unpin();
                        // A window not in the page cache (or not registrable now): a window shuffle
                        // still reads each shard whole, in sequence, into device memory (the
                        // loader reads what is not cached from the file); dataset order stages
                        // blocks at the disk's pace instead.
                        if plan.order.is_identity() {
                            return Ok(None);
                        }
                        return Self::open_streamed(
                            plan,
                            files,
                            windows,
                            limits,
                            fraction_min,
                            device,
                            metrics,
                            &file_bytes,
                            shard_pool,
                        );
                    }
                }
                start += window_bytes;
            }
        }
        let map_s = started.elapsed().as_secs_f64();
        let shard_first_samples = shard_first_samples(plan);
        // Rounds that read device copies upload their own region table (at most REGIONS_MAX).
        let device_shards = if table.len() <= REGIONS_MAX {
            DeviceShards::new(
                device,
                &plan.order,
                shard_windows,
                shard_first_samples.clone(),
                window_bytes,
                limits.device_shard_bytes,
                2,
                shard_pool,
            )?
        } else {
            None
        };
        if limits.zero_copy == ZeroCopy::Auto && plan.order.is_identity() && device_shards.is_none()
        {
            mapped.unpin();
            return Ok(None);
        }
        let slots_s = started.elapsed().as_secs_f64() - map_s;
        let (corrupt, verified_bytes) = verify_blocks(plan, files)?;
        // Verifying reads each block whole once per dataset: counted as read, like any other read.
        metrics.add_read_bytes(crate::metrics::ReadPath::PageCache, verified_bytes);
        // Written synchronously, before any kernel of the stream can read it.
        let regions = KeptBuffer::from_host(device, &GatherRegion::encode_all(&table), shard_pool)?;
        let table_len = table.len();
        tracing::info!(
            "stream reads {} shards in place from {} registered windows ({} corrupt blocks); \
             windows mapped in {:.1} ms, device shard slots {:.1} ms, then verified in {:.1} ms",
            plan.dataset.shards.len(),
            table.len(),
            corrupt.len(),
            map_s * 1e3,
            slots_s * 1e3,
            (started.elapsed().as_secs_f64() - map_s - slots_s) * 1e3
        );
        Ok(Some(Resident {
            regions,
            region_count: table.len() as u32,
            host_regions: table,
            round_regions: Vec::new(),
            round_regions_encoded: Vec::new(),
            device_shards,
            windows: mapped,
            planner: None,
            geometry: Arc::new(RowGeometry::new(
                plan,
                first_region,
                shard_first_samples,
                table_len,
                window_bytes,
                corrupt,
            )),
        }))
    }

    /// [`Self::open`] for a dataset larger than the registration budget (or, in a window shuffle, not
    /// in the page cache): no window stays registered;
    /// in dataset order or a window shuffle, a loader thread copies the shards the stream reads next
    /// into device slots through windows registered only for their copies, and every row is read
    /// from a device copy. `None` (the stream stages blocks instead) in a full shuffle, with more
    /// windows than a round's region table holds, or when the device shard memory cannot hold the
    /// shards one batch draws from and one more.
    #[allow(clippy::too_many_arguments)]
    fn open_streamed(
        plan: &StreamPlan,
        files: &FileTable,
        windows: &Arc<PageCacheWindows>,
        limits: &GpuStreamLimits,
        fraction_min: f64,
        device: &crate::device::Device,
        metrics: &crate::metrics::DeviceMetrics,
        file_bytes: &[u64],
        shard_pool: &Arc<ShardSlotPool>,
    ) -> Result<Option<Resident>, FillError> {
        let window_bytes = windows.window_bytes();
        let mut table: Vec<GatherRegion> = Vec::new();
        let mut first_region = Vec::with_capacity(file_bytes.len());
        let mut shard_windows = Vec::with_capacity(file_bytes.len());
        for &bytes in file_bytes {
            first_region.push(table.len() as u32);
            let mut shard = ShardWindows {
                windows: Vec::new(),
                first_region: table.len(),
            };
            let mut start = 0u64;
            while start < bytes {
                let len = window_bytes.min(bytes - start);
                shard.windows.push((0, len));
                // Pointed at the shard's device slot by each round that reads it.
                table.push(GatherRegion { ptr: 0, bytes: len });
                start += window_bytes;
            }
            shard_windows.push(shard);
        }
        let shard_first_samples = shard_first_samples(plan);
        let Some(needed) = plan
            .order
            .shards_per_span_max(plan.rank.batch_size as u64, &shard_first_samples)
        else {
            return Ok(None);
        };
        if table.len() > REGIONS_MAX {
            return Ok(None);
        }
        let slots_min = (needed + 1).min(file_bytes.len());
        let Some(mut device_shards) = DeviceShards::new(
            device,
            &plan.order,
            shard_windows,
            shard_first_samples.clone(),
            window_bytes,
            limits.device_shard_bytes,
            slots_min,
            shard_pool,
        )?
        else {
            return Ok(None);
        };
        let paths = plan.dataset.shards.iter().map(|s| s.path.clone()).collect();
        device_shards.start_loader(
            device,
            windows,
            paths,
            fraction_min,
            limits.loader_copy_threads,
        )?;
        let (corrupt, verified_bytes) = verify_blocks(plan, files)?;
        metrics.add_read_bytes(crate::metrics::ReadPath::PageCache, verified_bytes);
        let regions = KeptBuffer::from_host(device, &GatherRegion::encode_all(&table), shard_pool)?;
        tracing::info!(
            "stream copies {} shards ({} windows) through the registration budget into device \
             memory ({} corrupt blocks)",
            plan.dataset.shards.len(),
            table.len(),
            corrupt.len()
        );
        let table_len = table.len();
        Ok(Some(Resident {
            regions,
            region_count: table_len as u32,
            host_regions: table,
            round_regions: Vec::new(),
            round_regions_encoded: Vec::new(),
            device_shards: Some(device_shards),
            windows: PinnedWindows::new(windows),
            planner: None,
            geometry: Arc::new(RowGeometry::new(
                plan,
                first_region,
                shard_first_samples,
                table_len,
                window_bytes,
                corrupt,
            )),
        }))
    }

    /// Unpins the windows once the stream's work is done (the caller synchronised its compute
    /// stream; the copies ahead are waited for here).
    pub(super) fn release(&mut self) {
        if let Some(device_shards) = &mut self.device_shards {
            let _ = device_shards.synchronize();
        }
        self.windows.unpin();
    }

    /// Frees the stream's region table when it is dropped instead of keeping it for the next
    /// stream: for when the stream's work on the device could not be confirmed done.
    pub(super) fn discard_buffers(&mut self) {
        self.regions.discard();
    }

    /// Device memory held for shard copies.
    pub(super) fn device_bytes(&self) -> usize {
        self.device_shards.as_ref().map_or(0, |d| d.device_bytes())
    }
}

/// Whether every block of the plan's fields is stored raw.
fn fields_all_raw(plan: &StreamPlan) -> bool {
    plan.dataset.shards.iter().all(|shard| {
        plan.fields.iter().all(|field| {
            shard
                .metadata
                .field_blocks(field.field_index)
                .iter()
                .all(|b| b.codec == Codec::Raw)
        })
    })
}

/// The size of each shard file of the plan's dataset.
fn shard_file_bytes(plan: &StreamPlan, files: &FileTable) -> Result<Vec<u64>, FillError> {
    let mut file_bytes = Vec::with_capacity(plan.dataset.shards.len());
    for (index, shard) in plan.dataset.shards.iter().enumerate() {
        let file = files.get(FileId(index as u32)).file();
        let bytes = file.metadata().map_err(|source| {
            FillError::Storage(crate::storage::StorageError::Open {
                path: shard.path.clone(),
                source,
            })
        })?;
        file_bytes.push(bytes.len());
    }
    Ok(file_bytes)
}

/// Threads reading shards into the page cache before a full shuffle (see [`warm_for_full_shuffle`]).
const WARM_THREADS_MAX: usize = 8;

/// Before a full shuffle of a dataset within the registration budget that is not in the page cache:
/// reads its shards whole, in sequence, on a few threads, so that the stream then reads every row
/// in place from the cache. A full shuffle draws every batch from anywhere in the dataset: read row
/// by row from the disk it would go at the disk's random-read pace (on the H100 test machine 0.18
/// GB/s of 4 KiB reads at queue depth 64, against 1.7 GB/s read in sequence), and staging a block
/// per row reads 40 bytes per byte. Skipped when the dataset would not fit in half the memory the
/// host has available (it would not stay cached). The bytes read count as read.
fn warm_for_full_shuffle(
    plan: &StreamPlan,
    files: &FileTable,
    windows: &PageCacheWindows,
    fraction_min: f64,
    file_bytes: &[u64],
    metrics: &crate::metrics::DeviceMetrics,
) {
    let cold: Vec<usize> = (0..file_bytes.len())
        .filter(|&i| {
            let file = files.get(FileId(i as u32)).file();
            !windows.resident(file, 0, file_bytes[i] as usize, fraction_min)
        })
        .collect();
    if cold.is_empty() {
        return;
    }
    let cold_bytes: u64 = cold.iter().map(|&i| file_bytes[i]).sum();
    if cold_bytes > crate::storage::residency::available_memory_bytes().unwrap_or(0) / 2 {
        return;
    }
    let started = std::time::Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = cold.len().min(WARM_THREADS_MAX);
    let read: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut read = 0u64;
                    let mut buffer = vec![0u8; 8 << 20];
                    loop {
                        let at = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&shard) = cold.get(at) else {
                            return read;
                        };
                        // A plain open: the table's handles may bypass the page cache (O_DIRECT).
                        let Ok(mut file) = std::fs::File::open(&plan.dataset.shards[shard].path)
                        else {
                            continue;
                        };
                        while let Ok(n) = std::io::Read::read(&mut file, &mut buffer) {
                            if n == 0 {
                                break;
                            }
                            read += n as u64;
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a page-cache warming thread panicked"))
            .sum()
    });
    metrics.add_read_bytes(crate::metrics::ReadPath::PageCache, read);
    tracing::info!(
        "full shuffle: read {} shards ({} bytes) into the page cache first, in {:.2} s",
        cold.len(),
        read,
        started.elapsed().as_secs_f64()
    );
}

/// The first sample of each shard of the plan's dataset, and the sample count after the last.
fn shard_first_samples(plan: &StreamPlan) -> Vec<u64> {
    let mut first_sample = 0u64;
    let mut firsts: Vec<u64> = plan
        .dataset
        .manifest
        .shards
        .iter()
        .map(|shard| {
            let first = first_sample;
            first_sample += shard.sample_count;
            first
        })
        .collect();
    firsts.push(first_sample);
    firsts
}

impl RowGeometry {
    fn new(
        plan: &StreamPlan,
        first_region: Vec<u32>,
        shard_first_samples: Vec<u64>,
        region_count: usize,
        window_bytes: u64,
        corrupt: HashMap<BlockKey, Arc<CorruptBlock>>,
    ) -> RowGeometry {
        RowGeometry {
            first_region,
            shard_first_samples,
            region_count,
            window_bytes,
            corrupt,
            linear: plan
                .dataset
                .shards
                .iter()
                .map(|shard| {
                    plan.fields
                        .iter()
                        .map(|f| linear_layout(shard.metadata.field_blocks(f.field_index)))
                        .collect()
                })
                .collect(),
        }
    }
}

/// Verifies the checksum of every block of the stream's fields that no reader of the dataset has
/// verified yet, from the page cache, on several threads; returns the corrupt ones and the bytes
/// read.
#[allow(clippy::type_complexity)]
fn verify_blocks(
    plan: &StreamPlan,
    files: &FileTable,
) -> Result<(HashMap<BlockKey, Arc<CorruptBlock>>, u64), FillError> {
    let verified = &plan.dataset.verified;
    let mut work: Vec<(usize, usize, u32)> = Vec::new();
    for (shard_index, shard) in plan.dataset.shards.iter().enumerate() {
        for field in &plan.fields {
            let blocks = shard.metadata.field_blocks(field.field_index);
            for block in 0..blocks.len() as u32 {
                if !verified.contains(shard_index, field.field_index, block) {
                    work.push((shard_index, field.field_index, block));
                }
            }
        }
    }
    if work.is_empty() {
        return Ok((HashMap::new(), 0));
    }
    let bytes: u64 = work
        .iter()
        .map(|&(shard, field, block)| {
            plan.dataset.shards[shard].metadata.field_blocks(field)[block as usize].stored_bytes
                as u64
        })
        .sum();
    let mut maps: Vec<Option<Mmap>> = Vec::with_capacity(plan.dataset.shards.len());
    for index in 0..plan.dataset.shards.len() {
        let file = files.get(FileId(index as u32)).file();
        // SAFETY: a read-only map of a shard, which gpufeed never modifies once its dataset exists.
        maps.push(unsafe { Mmap::map(file) }.ok());
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, VERIFY_THREADS_MAX);
    let chunk = work.len().div_ceil(threads);
    let found: Vec<(BlockKey, Arc<CorruptBlock>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .chunks(chunk)
            .map(|part| {
                let maps = &maps;
                scope.spawn(move || {
                    let mut bad = Vec::new();
                    for &(shard, field, block) in part {
                        let key = BlockKey {
                            shard: shard as u32,
                            field: field as u32,
                            block,
                        };
                        match check_in_map(plan, maps, key) {
                            Ok(()) => verified.insert(shard, field, block),
                            Err(corrupt) => bad.push((key, corrupt)),
                        }
                    }
                    bad
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a verify thread panicked"))
            .collect()
    });
    Ok((found.into_iter().collect(), bytes))
}

/// Checks one block's stored bytes in its shard's map against its table checksum.
fn check_in_map(
    plan: &StreamPlan,
    maps: &[Option<Mmap>],
    key: BlockKey,
) -> Result<(), Arc<CorruptBlock>> {
    let shard = &plan.dataset.shards[key.shard as usize];
    let entry = shard.metadata.field_blocks(key.field as usize)[key.block as usize];
    let at = || BlockRef {
        shard: shard.path.clone(),
        field: shard.metadata.fields[key.field as usize].name.clone(),
        block: key.block,
        stored_offset: entry.stored_offset,
    };
    let start = entry.stored_offset as usize;
    let end = start + entry.stored_bytes as usize;
    let stored = maps[key.shard as usize]
        .as_ref()
        .and_then(|map| map.get(start..end));
    let Some(stored) = stored else {
        let error = decode::BlockError::Io {
            at: at(),
            source: std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the block lies beyond the end of its shard file",
            ),
        };
        return Err(Arc::new(CorruptBlock::from(error)));
    };
    decode::check_block(stored, &entry, at).map_err(|e| Arc::new(CorruptBlock::from(e)))
}

/// The largest output of a piece merged from consecutive rows of a field whose rows deliver
/// `sample_bytes_out` each: [`super::merged_piece_out_bytes`], but never less than one row, so that
/// rows merged never make more pieces than the same rows one by one (the round's table is sized for
/// that).
fn merged_out_bytes_max(sample_bytes_out: usize) -> u64 {
    super::merged_piece_out_bytes().max(sample_bytes_out as u64)
}

/// Adds pieces reading file bytes `span` of shard `shard` in place to slot offset `out_at`, split
/// at window edges (windows are registered separately, so their device addresses are not
/// contiguous) and merged with the previous piece up to `merged_out_bytes_max`; returns the slot
/// offset after them.
fn push_in_place(
    gather: &mut GatherPlan,
    resident: &RowGeometry,
    shard: usize,
    span: std::ops::Range<u64>,
    mut out_at: u64,
    op: GatherOp,
    merged_out_bytes_max: u64,
) -> u64 {
    let (mut at, stop) = (span.start, span.end);
    while at < stop {
        let window = at / resident.window_bytes;
        let piece_end = stop.min((window + 1) * resident.window_bytes);
        let region = resident.first_region[shard] as usize + window as usize;
        let elements = (piece_end - at) / op.in_bytes();
        gather.push_merged(
            GatherRegion::source_index(region),
            at - window * resident.window_bytes,
            out_at,
            elements,
            op,
            1.0,
            merged_out_bytes_max,
        );
        out_at += elements * op.out_bytes();
        at = piece_end;
    }
    out_at
}

/// The rows of one round, planned: the encoded piece table, its piece count, the bytes the pieces
/// read, and the rows to zero.
#[derive(Default)]
struct PlannedRows {
    table: Vec<u8>,
    pieces: usize,
    /// Bytes the pieces read, per region of the stream's table.
    region_bytes: Vec<u64>,
    replaced: Vec<usize>,
}

/// Widest span of slot memory one group of batches may write (the slots of a ring lie in one
/// allocation, in order; the span also covers the slots between the group's, which its pieces do not
/// write).
const GROUP_SPAN_BYTES_MAX: u64 = 64 << 20;

/// Consecutive small batches of a resident stream, planned and waiting to be gathered by one round
/// (one launch and one completion event instead of one each): their piece tables joined, each
/// piece's destination moved from its slot's start to the group's first slot.
pub(super) struct BatchGroup {
    steps: std::ops::Range<u64>,
    /// Device address of the first batch's slot.
    base: u64,
    /// End of the last batch's slot.
    end: u64,
    table: Vec<u8>,
    pieces: usize,
    region_bytes: Vec<u64>,
}

impl BatchGroup {
    /// An empty group starting with step `step` in `slot`, for a stream of `region_count` regions.
    fn new(step: u64, slot: &dyn DeviceMemory, region_count: usize) -> BatchGroup {
        BatchGroup {
            steps: step..step,
            base: slot.device_ptr(),
            end: slot.device_ptr(),
            table: Vec::new(),
            pieces: 0,
            region_bytes: vec![0; region_count],
        }
    }

    /// Whether step `step` is in the group.
    pub(super) fn contains(&self, step: u64) -> bool {
        self.steps.contains(&step)
    }

    /// Batches in the group.
    fn len(&self) -> usize {
        (self.steps.end - self.steps.start) as usize
    }

    /// Whether step `step` in `slot`, of `pieces` pieces, may join: the next step, its slot after
    /// the group's within [`GROUP_SPAN_BYTES_MAX`], and at most `pieces_max` pieces in all.
    fn accepts(
        &self,
        step: u64,
        slot: &dyn DeviceMemory,
        pieces: usize,
        pieces_max: usize,
    ) -> bool {
        step == self.steps.end
            && slot.device_ptr() >= self.end
            && slot.device_ptr() + slot.len() as u64 - self.base <= GROUP_SPAN_BYTES_MAX
            && self.pieces + pieces <= pieces_max
    }

    /// Adds step `step`'s planned rows, written into `slot` (accepted by [`Self::accepts`], or the
    /// group's first).
    fn add(&mut self, step: u64, slot: &dyn DeviceMemory, rows: PlannedRows) {
        debug_assert_eq!(step, self.steps.end);
        let offset = slot.device_ptr() - self.base;
        let start = self.table.len();
        self.table.extend_from_slice(&rows.table);
        shift_destinations(&mut self.table[start..], offset);
        self.pieces += rows.pieces;
        for (sum, bytes) in self.region_bytes.iter_mut().zip(&rows.region_bytes) {
            *sum += bytes;
        }
        self.steps.end = step + 1;
        self.end = slot.device_ptr() + slot.len() as u64;
    }
}

/// Adds `offset` to the destination of every piece of an encoded piece table.
fn shift_destinations(table: &mut [u8], offset: u64) {
    if offset == 0 {
        return;
    }
    for piece in table.chunks_exact_mut(crate::kernels::GATHER_PIECE_BYTES) {
        let dst = &mut piece[GATHER_PIECE_DST_OFFSET..GATHER_PIECE_DST_OFFSET + 8];
        let moved = u64::from_le_bytes(dst.try_into().expect("8 bytes")) + offset;
        dst.copy_from_slice(&moved.to_le_bytes());
    }
}

/// Where a piece's destination offset lies in its encoding ([`crate::kernels::GatherPiece::encode`]).
const GATHER_PIECE_DST_OFFSET: usize = 8;

/// Plans rows `rows` on the calling thread.
fn plan_chunk(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    positions: &[u64],
    rows: std::ops::Range<usize>,
) -> Result<PlannedRows, FillError> {
    let mut gather = GatherPlan::with_capacity(rows.len() * plan.fields.len());
    let mut replaced = Vec::new();
    let mut row = rows.start;
    while row < rows.end {
        let sample = plan.order.sample_at(positions[row]);
        let run = consecutive_rows(plan, geometry, positions, row, rows.end, sample);
        if run > 1 && run_pieces(plan, geometry, sample, run, row, &mut gather) {
            row += run;
            continue;
        }
        if let Some(bad) = row_pieces(plan, geometry, sample, row, &mut gather) {
            if plan.on_corrupt == CorruptPolicy::Fail {
                return Err(bad.to_error());
            }
            replaced.push(row);
        }
        row += 1;
    }
    let mut region_bytes = vec![0u64; geometry.region_count];
    for piece in gather.pieces() {
        let region = piece.source as usize - GATHER_SOURCES_MAX;
        region_bytes[region] += piece.elements as u64 * piece.op.in_bytes();
    }
    Ok(PlannedRows {
        table: gather.encode(),
        pieces: gather.pieces().len(),
        region_bytes,
        replaced,
    })
}

/// How many rows from `row` (sample `sample`) on read consecutive samples of one shard: in dataset
/// order, most of a batch; otherwise 1 (shuffled orders are planned row by row).
fn consecutive_rows(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    positions: &[u64],
    row: usize,
    end: usize,
    sample: u64,
) -> usize {
    if !plan.order.is_identity() {
        return 1;
    }
    let starts = &geometry.shard_first_samples;
    let shard = starts.partition_point(|&s| s <= sample) - 1;
    let shard_end = starts[shard + 1];
    let mut run = 1;
    while row + run < end
        && positions[row + run] == positions[row] + run as u64
        && sample + (run as u64) < shard_end
    {
        run += 1;
    }
    run
}

/// Adds the pieces of `rows` rows from `row` on, reading samples `sample..sample + rows` of one
/// shard, when every field lies back to back in the shard (see [`RowGeometry::linear`]) and no
/// block they read is corrupt; returns false, having added nothing, otherwise (the rows are then
/// planned one by one).
fn run_pieces(
    plan: &StreamPlan,
    geometry: &RowGeometry,
    sample: u64,
    rows: usize,
    row: usize,
    gather: &mut GatherPlan,
) -> bool {
    let mut spans = Vec::with_capacity(plan.fields.len());
    for (index, field) in plan.fields.iter().enumerate() {
        let (shard, start, end) = plan.locate(sample, field.field_index);
        let Some((base, size)) = geometry.linear[shard][index] else {
            return false;
        };
        let stop = start + (end - start) * rows as u64;
        if !geometry.corrupt.is_empty() {
            for block in (start / size)..=((stop - 1) / size) {
                let key = BlockKey {
                    shard: shard as u32,
                    field: field.field_index as u32,
                    block: block as u32,
                };
                if geometry.corrupt.contains_key(&key) {
                    return false;
                }
            }
        }
        spans.push((shard, base + start, base + stop));
    }
    for (field, (shard, at, stop)) in plan.fields.iter().zip(spans) {
        let op = GatherOp::for_dtypes(field.stored, field.out)
            .expect("conversions are validated when the stream is planned");
        let out_at = (field.offset + row * field.sample_bytes_out) as u64;
        // Pieces as merging rows one by one would make them, so that a batch spreads over many
        // thread blocks.
        let merged_max = merged_out_bytes_max(field.sample_bytes_out);
        let chunk = (merged_max / op.out_bytes()).max(1) * op.in_bytes();
        let (mut at, mut out_at) = (at, out_at);
        while at < stop {
            let piece_stop = stop.min(at + chunk);
            out_at = push_in_place(
                gather,
                geometry,
                shard,
                at..piece_stop,
                out_at,
                op,
                merged_max,
            );
            at = piece_stop;
        }
    }
    true
}

/// Adds the pieces of one row (sample `sample` at row `row` of the slot) to `gather`; returns the
/// corrupt block it reads, if any (then it adds nothing).
fn row_pieces(
    plan: &StreamPlan,
    resident: &RowGeometry,
    sample: u64,
    row: usize,
    gather: &mut GatherPlan,
) -> Option<Arc<CorruptBlock>> {
    for (index, field) in plan.fields.iter().enumerate() {
        let (shard, start, end) = plan.locate(sample, field.field_index);
        let op = GatherOp::for_dtypes(field.stored, field.out)
            .expect("conversions are validated when the stream is planned");
        let mut out_at = (field.offset + row * field.sample_bytes_out) as u64;
        let merged_max = merged_out_bytes_max(field.sample_bytes_out);
        if let Some((base, size)) = resident.linear[shard][index] {
            if !resident.corrupt.is_empty() {
                for block in (start / size)..=((end - 1) / size) {
                    let key = BlockKey {
                        shard: shard as u32,
                        field: field.field_index as u32,
                        block: block as u32,
                    };
                    if let Some(bad) = resident.corrupt.get(&key) {
                        return Some(Arc::clone(bad));
                    }
                }
            }
            push_in_place(
                gather,
                resident,
                shard,
                base + start..base + end,
                out_at,
                op,
                merged_max,
            );
            continue;
        }
        let blocks = plan.dataset.shards[shard]
            .metadata
            .field_blocks(field.field_index);
        for block in plan.blocks_for(shard, field.field_index, start, end) {
            let key = BlockKey {
                shard: shard as u32,
                field: field.field_index as u32,
                block,
            };
            if !resident.corrupt.is_empty() {
                if let Some(bad) = resident.corrupt.get(&key) {
                    // Pieces already added for the row are overwritten by its zeros, which are
                    // queued after the gather.
                    return Some(Arc::clone(bad));
                }
            }
            let entry = &blocks[block as usize];
            let from = start.max(entry.raw_offset) - entry.raw_offset;
            let to = end.min(entry.raw_offset + entry.raw_bytes as u64) - entry.raw_offset;
            // Raw blocks store the raw bytes.
            let (at, stop) = (entry.stored_offset + from, entry.stored_offset + to);
            out_at = push_in_place(gather, resident, shard, at..stop, out_at, op, merged_max);
        }
    }
    None
}

/// Puts a round's piece table where its gather kernel reads it: the round's pinned buffer when
/// shards are copied ahead (`copying`), device memory (uploaded on `stream`) otherwise.
fn place_piece_table(
    stream: &crate::device::Stream,
    buffers: &mut RoundBuffers,
    layout: HostLayout,
    table: &[u8],
    copying: bool,
) -> Result<(), FillError> {
    if copying {
        buffers.host.as_mut_slice()[layout.pieces..layout.pieces + table.len()]
            .copy_from_slice(table);
        return Ok(());
    }
    super::round::upload_table(
        stream,
        &mut buffers.host,
        layout.pieces,
        &buffers.pieces,
        table,
    )
}

/// The shards a round reading `region_bytes` bytes of each region reads (each once, in order of
/// their first region), and the regions it reads.
fn shards_read(device_shards: &DeviceShards, region_bytes: &[u64]) -> (Vec<usize>, Vec<usize>) {
    let mut needed: Vec<usize> = Vec::new();
    let mut regions_read: Vec<usize> = Vec::new();
    for (region, &bytes) in region_bytes.iter().enumerate() {
        if bytes == 0 {
            continue;
        }
        regions_read.push(region);
        let shard = device_shards.shard_of_region(region);
        if !needed.contains(&shard) {
            needed.push(shard);
        }
    }
    (needed, regions_read)
}

/// Bytes of `region_bytes` a round reads in place from host memory: those of the regions its table
/// `table` still points at their registered windows (`host_regions`), not at a device copy.
fn bytes_read_in_place(
    region_bytes: &[u64],
    table: &[GatherRegion],
    host_regions: &[GatherRegion],
) -> u64 {
    region_bytes
        .iter()
        .enumerate()
        .filter(|&(region, _)| table[region].ptr == host_regions[region].ptr)
        .map(|(_, bytes)| bytes)
        .sum()
}

impl GpuAssembler {
    /// [`Self::submit`] for a resident stream: every row gathered in place, planned by arithmetic on
    /// [`plan_workers`] planning threads ahead of the filler, in rounds of at most `pieces_max` pieces.
    pub(super) fn submit_resident(
        &mut self,
        step: u64,
        slot: &DeviceRegion,
        released: &Event,
        ready: Option<&Event>,
    ) -> Result<(), FillError> {
        let planned = self.planned_step(step)?;
        self.batches
            .push_back(PendingBatch::new(step, slot, planned.rows));
        let mut rounds = planned.rounds?;
        // A small batch of one round with no rows to zero joins the group of batches waiting to be
        // gathered together, if it can; a batch that cannot queues the group first.
        let joins = self.group_batches_max > 1
            && rounds.len() == 1
            && rounds[0].replaced.is_empty()
            && rounds[0].pieces > 0;
        let device_shards = self
            .resident
            .as_ref()
            .and_then(|r| r.device_shards.as_ref());
        if self.group.as_ref().is_some_and(|group| {
            !joins
                || !group.accepts(step, slot, rounds[0].pieces, self.group_pieces_max)
                || device_shards
                    .is_some_and(|d| !d.fit_one_round(&group.region_bytes, &rounds[0].region_bytes))
        }) {
            self.flush_group()?;
        }
        // The slot's last use by the consumer, waited for before the batch's first write is queued
        // (after the group it did not join, which does not write this slot).
        self.wait_released(released)?;
        // Shards are read ahead from the first batch of a group on: a later batch's read-ahead
        // could give the slots of shards the group reads to shards further on before the group's
        // round records its reads.
        if self.group.is_none() {
            if let (Some(device_shards), Some(first)) = (
                self.resident
                    .as_mut()
                    .and_then(|r| r.device_shards.as_mut()),
                planned.first_position,
            ) {
                device_shards.read_ahead(&self.plan.order, first)?;
            }
        }
        if joins {
            let rows = rounds.pop().expect("one round");
            let region_count = rows.region_bytes.len();
            let group = self
                .group
                .get_or_insert_with(|| BatchGroup::new(step, slot, region_count));
            group.add(step, slot, rows);
            if group.len() == self.group_batches_max
                || group.pieces * (group.len() + 1) > self.group_pieces_max * group.len()
            {
                self.flush_group()?;
            }
            return Ok(());
        }
        for rows in rounds {
            self.queue_resident_round(step..step + 1, rows, slot)?;
        }
        // No record of `ready` here: every write to the slot is queued before the completion event
        // of its batch's last round, which [`Self::complete`] waits for on the host before the batch
        // is handed out, so a consumer's query of `ready` (an earlier record, complete) is right.
        // Work queued on the slot after that (zeroing rows of blocks found corrupt) records `ready`
        // again there. One driver call less per batch: at 256 rows, a batch every 20 µs.
        let _ = ready;
        Ok(())
    }

    /// The planned rows of `step`, from the planning thread (started, or started again, at `step`
    /// when it is not the step planned next).
    fn planned_step(&mut self, step: u64) -> Result<PlannedStep, FillError> {
        let rows_per_round =
            (self.pieces_max / (self.plan.fields.len() * ROW_PIECES_MAX_PER_FIELD)).max(1);
        let resident = self.resident.as_mut().expect("a resident stream");
        if resident
            .planner
            .as_ref()
            .is_none_or(|p| p.next_step != step)
        {
            resident.planner = Some(Planner::start(
                Arc::clone(&self.plan),
                Arc::clone(&resident.geometry),
                step,
                rows_per_round,
                self.group_batches_max,
            ));
        }
        let planner = resident.planner.as_mut().expect("started above");
        // Timed (and the planning threads' figure read) only when a chunk of plans is received:
        // the other steps of a chunk are taken from memory, and the clock reads and the read of the
        // threads' shared counter would cost more than taking them.
        if !planner.taken.is_empty() {
            return planner.next();
        }
        let waited = std::time::Instant::now();
        let planned = planner.next();
        self.timings.plan_s += waited.elapsed().as_secs_f64();
        self.timings.planning_threads_s = planner.busy_s();
        planned
    }

    /// Counts a round just queued on its batches (`steps`), and its `replaced` rows on the first.
    fn count_round(&mut self, steps: &std::ops::Range<u64>, replaced: usize) {
        // The round's batches: the last submitted, or all but the last (a group queued as the
        // batch that could not join it was submitted).
        for batch in self
            .batches
            .iter_mut()
            .rev()
            .take((steps.end - steps.start) as usize + 1)
        {
            if !steps.contains(&batch.step) {
                continue;
            }
            batch.rounds_left += 1;
            if batch.step == steps.start {
                batch.replaced += replaced as u32;
            }
        }
    }

    /// Queues the group of small batches waiting to be gathered, if any, as one round.
    pub(super) fn flush_group(&mut self) -> Result<(), FillError> {
        let Some(group) = self.group.take() else {
            return Ok(());
        };
        if group.len() > 1 {
            self.timings.batches_grouped += group.len() as u64;
        }
        // The slots lie in ascending order in the ring's one allocation; the round writes the span
        // from the first to the end of the last, each piece into its own batch's slot.
        let span = super::round::DeviceRange {
            ptr: group.base,
            bytes: (group.end - group.base) as usize,
        };
        let rows = PlannedRows {
            table: group.table,
            pieces: group.pieces,
            region_bytes: group.region_bytes,
            replaced: Vec::new(),
        };
        self.queue_resident_round(group.steps, rows, &span)
    }

    /// Queues one round of a resident stream, for one batch or a group of consecutive ones
    /// (`steps`) whose slots `slot` spans: its pieces, the zeroing of its corrupt rows (a batch's
    /// own round only), and the gather outcome's download.
    fn queue_resident_round(
        &mut self,
        steps: std::ops::Range<u64>,
        planned: PlannedRows,
        slot: &dyn DeviceMemory,
    ) -> Result<(), FillError> {
        if self.rounds.len() == self.buffers.len() {
            self.complete_round()?;
        }
        let index = self.next_buffers;
        self.next_buffers = (self.next_buffers + 1) % self.buffers.len();
        let queued = std::time::Instant::now();
        let count = planned.pieces;
        if count > 0 {
            let resident = self.resident.as_mut().expect("a resident stream");
            // The shards the round reads.
            let mut needed: Vec<usize> = Vec::new();
            if let Some(device_shards) = resident.device_shards.as_mut() {
                let regions_read;
                (needed, regions_read) = shards_read(device_shards, &planned.region_bytes);
                self.timings.copy_wait_s +=
                    device_shards.prepare_round(&needed, &regions_read, &self.stream)?;
            }
            // The region table, pointed at the device copies the round may read. Small piece
            // tables go in the launch's parameters with every piece's region resolved from it.
            // Otherwise, when shards are copied ahead, the piece table (and the region table,
            // when some shards are read from their device copies) are written to the round's
            // pinned buffer and read by the kernel from there: an upload could wait behind the
            // shard copies on the copy engines. Without copies the piece table is uploaded.
            let mut table = std::mem::take(&mut resident.round_regions);
            table.clone_from(&resident.host_regions);
            let copying = resident.device_shards.is_some();
            let on_device = resident
                .device_shards
                .as_ref()
                .is_some_and(|d| d.redirect(&mut table));
            let inline = count <= self.inline_pieces_max
                && resolve_inline(&planned.table, &table, &mut self.inline_table);
            let layout = self.layout;
            let buffers = &mut self.buffers[index];
            // The region table's encoding, for the kernel that reads it (inline pieces carry
            // addresses).
            let mut encoded_regions = std::mem::take(&mut resident.round_regions_encoded);
            encoded_regions.clear();
            if !inline {
                place_piece_table(&self.stream, buffers, layout, &planned.table, copying)?;
                GatherRegion::encode_into(&table, &mut encoded_regions);
            }
            // The gather writes its outcome straight into the round's pinned buffer (mapped for
            // the device), zeroed here: no memset before the launch and no download after it,
            // two fewer operations on the stream per round.
            buffers.host.as_mut_slice()
                [layout.gather_outcome..layout.gather_outcome + GATHER_OUTCOME_BYTES]
                .fill(0);
            if on_device && !inline {
                buffers.host.as_mut_slice()[layout.regions..layout.regions + encoded_regions.len()]
                    .copy_from_slice(&encoded_regions);
            }
            self.timings.rounds_from_device_copies += u64::from(on_device);
            self.timings.rounds_inline += u64::from(inline);
            let buffers = &self.buffers[index];
            let mapped_pieces = buffers.host.mapped(layout.pieces, planned.table.len());
            let pieces: &dyn DeviceMemory = if copying {
                &mapped_pieces
            } else {
                &buffers.pieces
            };
            let mapped_regions = buffers.host.mapped(layout.regions, encoded_regions.len());
            let mapped_outcome = buffers
                .host
                .mapped(layout.gather_outcome, GATHER_OUTCOME_BYTES);
            let regions: &dyn DeviceMemory = if on_device {
                &mapped_regions
            } else {
                &resident.regions
            };
            // SAFETY: the piece table, region table and outcome (zeroed above) belong to this
            // round (its pinned buffer is written again only after the host waited for the round);
            // the windows the regions name stay mapped and pinned for the stream's life, and the
            // device copies they name are complete and are not overwritten before this round is
            // done (the copy stream waits for the event recorded below); the slot is this filler's
            // (its release event was waited on) and overlaps no source.
            //
            // Inline, the pieces address the same windows and device copies (resolve_inline checked
            // each extent against its region).
            unsafe {
                if inline {
                    self.kernels.gather.gather_inline_async(
                        &self.stream,
                        &self.inline_table,
                        slot,
                        (&mapped_outcome, true),
                    )
                } else {
                    self.kernels.gather.gather_regions_async(
                        &self.stream,
                        pieces,
                        count as u32,
                        &[&self.cache, &buffers.staging],
                        Some((regions, resident.region_count)),
                        slot,
                        (&mapped_outcome, true),
                    )
                }
            }?;
            let mut host_bytes =
                bytes_read_in_place(&planned.region_bytes, &table, &resident.host_regions);
            if let Some(device_shards) = resident.device_shards.as_mut() {
                device_shards.record_reads(&self.stream, &needed)?;
                // Bytes copied ahead are read bytes when they are queued.
                host_bytes += std::mem::take(&mut device_shards.copied_bytes);
            }
            self.metrics
                .add_read_bytes(crate::metrics::ReadPath::PageCache, host_bytes);
            resident.round_regions = table;
            resident.round_regions_encoded = encoded_regions;
        }
        for &row in &planned.replaced {
            self.zero_row(slot, row)?;
        }
        // Nothing to download: the gather's outcome is in the pinned buffer already.
        self.queue_downloads(index, 0, 0, false)?;
        self.timings.gather_s += queued.elapsed().as_secs_f64();
        self.timings.rounds += 1;
        self.count_round(&steps, planned.replaced.len());
        self.rounds.push_back(PendingRound {
            buffers: index,
            steps,
            runs: 0..0,
            placements: Arc::new(PlacementRuns {
                runs: Vec::new(),
                placements: Vec::new(),
            }),
            checks: Vec::new(),
            check_windows: Vec::new(),
            decoded: Vec::new(),
            replaced: planned.replaced,
            corrupt_marks: self.block_cache.corrupt_marks,
            gathered: count > 0,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{GatherOp, GatherPlan, GATHER_PIECE_BYTES};
    use crate::pipeline::gpu::round::DeviceRange;

    /// Planned rows of `pieces` pieces, piece `i` writing at `i * 4096` of its slot and reading
    /// region `i % 2` of two.
    fn rows(pieces: usize) -> PlannedRows {
        let mut plan = GatherPlan::new();
        for i in 0..pieces {
            let source = (crate::kernels::GATHER_SOURCES_MAX + i % 2) as u16;
            plan.push(
                source,
                i as u64 * 2048,
                i as u64 * 4096,
                1024,
                GatherOp::F16ToF32,
                1.0,
            );
        }
        let mut region_bytes = vec![0u64; 2];
        for piece in plan.pieces() {
            region_bytes[piece.source as usize - crate::kernels::GATHER_SOURCES_MAX] += 2048;
        }
        PlannedRows {
            table: plan.encode(),
            pieces,
            region_bytes,
            replaced: Vec::new(),
        }
    }

    fn dst(table: &[u8], piece: usize) -> u64 {
        let at = piece * GATHER_PIECE_BYTES + GATHER_PIECE_DST_OFFSET;
        u64::from_le_bytes(table[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn a_group_moves_each_batch_s_pieces_to_its_own_slot_and_sums_its_reads() {
        let stride = 1 << 20;
        let slot = |i: u64| DeviceRange {
            ptr: 0x7000_0000 + i * stride,
            bytes: 1 << 20,
        };
        let mut group = BatchGroup::new(10, &slot(3), 2);
        group.add(10, &slot(3), rows(4));
        assert!(group.accepts(11, &slot(4), 4, 16));
        group.add(11, &slot(4), rows(4));
        // Slot 6: a gap (slot 5 is held elsewhere) is allowed, the span covering it.
        assert!(group.accepts(12, &slot(6), 4, 16));
        group.add(12, &slot(6), rows(4));
        assert_eq!(group.len(), 3);
        assert_eq!(group.steps, 10..13);
        assert_eq!(group.pieces, 12);
        assert_eq!(group.table.len(), 12 * GATHER_PIECE_BYTES);
        assert_eq!(group.region_bytes, vec![6 * 2048, 6 * 2048]);
        assert_eq!(
            (group.base, group.end),
            (slot(3).ptr, slot(6).ptr + (1 << 20))
        );
        for piece in 0..4u64 {
            assert_eq!(dst(&group.table, piece as usize), piece * 4096);
            assert_eq!(dst(&group.table, 4 + piece as usize), stride + piece * 4096);
            assert_eq!(
                dst(&group.table, 8 + piece as usize),
                3 * stride + piece * 4096
            );
        }
        // Everything but the destination is the batch's own table.
        let own = rows(4).table;
        for piece in 0..4 {
            let (a, b) = (
                piece * GATHER_PIECE_BYTES,
                8 * GATHER_PIECE_BYTES + piece * GATHER_PIECE_BYTES,
            );
            assert_eq!(group.table[b..b + 8], own[a..a + 8]);
            assert_eq!(group.table[b + 16..b + 32], own[a + 16..a + 32]);
        }
    }

    #[test]
    fn a_group_refuses_a_step_out_of_turn_a_slot_behind_too_wide_a_span_or_too_many_pieces() {
        let slot = |ptr: u64| DeviceRange {
            ptr,
            bytes: 1 << 20,
        };
        let mut group = BatchGroup::new(5, &slot(1 << 30), 2);
        group.add(5, &slot(1 << 30), rows(8));
        assert!(group.accepts(6, &slot((1 << 30) + (1 << 20)), 8, 16));
        // Not the next step.
        assert!(!group.accepts(7, &slot((1 << 30) + (1 << 20)), 8, 16));
        // The ring wrapped: a slot before the group's.
        assert!(!group.accepts(6, &slot(1 << 29), 8, 16));
        // Overlapping the group's last slot.
        assert!(!group.accepts(6, &slot((1 << 30) + 4096), 8, 16));
        // A span wider than GROUP_SPAN_BYTES_MAX.
        assert!(!group.accepts(6, &slot((1 << 30) + GROUP_SPAN_BYTES_MAX), 8, 16));
        // More pieces than one launch takes.
        assert!(!group.accepts(6, &slot((1 << 30) + (1 << 20)), 9, 16));
    }
}
