//! Resident streams: when every block of a stream's fields is stored raw and the whole dataset lies in
//! page cache that can be registered within the budget, every window of every shard is mapped for the
//! device when the stream opens and stays mapped (pinned) for the stream's life. Each row of a batch is
//! then one gather piece read in place over PCIe, planned by arithmetic (sample, shard, block, window)
//! with no per-round lookups, and the region table is uploaded once. The order of the rows does not
//! matter: a full shuffle costs what dataset order costs.
//!
//! A full shuffle of a dataset larger than the budget keeps the windows the budget has room for
//! mapped the same way, and the rows of the others are copied by host threads into each round's
//! staging (`row_copies`): the order still costs nothing, and no window is registered per round.
//!
//! Every raw block is verified once, when the stream opens, unless a stream of the dataset has done so
//! before (the dataset's record of verified blocks); blocks found corrupt then are known to every
//! batch, whose rows that read them are zeroed (policy `replace`) or end the stream (policy `fail`)
//! before their batch is handed off.

use std::sync::Arc;

use foldhash::{HashMap, HashMapExt};

use super::device_shards::{DeviceShards, ShardWindows};
use super::planner::{ColdStart, Planner, RowGeometry, RowStaging};
use super::row_copies::{
    row_copy_threads, row_staging_bytes_max, RowCopier, ROW_STAGING_BYTES_MAX,
};
use super::shard_checks::{check_in_map, ShardChecks};
use super::tier_fill::{decoded_bytes, fill_decoded, DecodedLayout};
use super::tier_read::TierRead;
use crate::format::Codec;
use crate::kernels::{GatherRegion, Lz4Decoder};
use crate::pipeline::cold_rows::{ColdRows, RowReads, COLD_QUEUE_DEPTH};
use crate::pipeline::gpu::engine::buffers::REGIONS_MAX;
use crate::pipeline::gpu::limits::{
    GpuStreamLimits, ZeroCopy, ROUNDS_IN_FLIGHT_MAX, ROUNDS_IN_FLIGHT_MIN,
};
use crate::pipeline::gpu::shard_pool::{KeptBuffer, ShardSlotPool};
use crate::pipeline::gpu::tier::{
    Acquired, DeviceTier, TierDataset, TierEntry, TierKey, TierPlace,
};
use crate::pipeline::order::ShuffleKind;
use crate::pipeline::stream_plan::{BlockKey, CorruptBlock, FillError, StreamPlan};
use crate::storage::gpu::{GpuReader, PathChoice};
use crate::storage::mapped::MappedFile;
use crate::storage::windows::{PageCacheWindows, WindowId};
use crate::storage::{FileId, FileTable};

/// Windows of the registration budget a full shuffle beyond it leaves to other readers (see
/// [`Resident::open_row_copies`]).
const WINDOWS_KEPT_FREE: u64 = 2;

/// Threads verifying a dataset's blocks when a resident stream opens.
const VERIFY_THREADS_MAX: usize = 8;

/// The mapped windows and region table of a resident stream.
pub(in crate::pipeline::gpu) struct Resident {
    /// The region table on the device (one region per window, shards in order).
    pub(super) regions: KeptBuffer,
    pub(super) region_count: u32,
    /// The same table on the host, for rounds that read some shards from their device copies.
    pub(super) host_regions: Vec<GatherRegion>,
    /// A round's region table (`host_regions`, redirected to the device copies it may read), kept
    /// for its capacity: no allocation per round.
    pub(super) round_regions: Vec<GatherRegion>,
    /// The round's region table encoded for the device, kept likewise.
    pub(super) round_regions_encoded: Vec<u8>,
    /// Shards copied ahead into device memory, in dataset order and window shuffles.
    pub(super) device_shards: Option<DeviceShards>,
    /// The dataset in the device's memory tier, whole or filling. (Declared before `windows`: it
    /// waits for the copies into the tier, which read those windows, before they are unpinned.)
    pub(super) tier: Option<TierRead>,
    /// Windows pinned for the stream's life.
    pub(super) windows: PinnedWindows,
    /// Where rows are read from, shared by the planning threads.
    pub(super) geometry: Arc<RowGeometry>,
    /// Plans the rows of the next steps on a thread of its own, ahead of the filler.
    pub(super) planner: Option<Planner>,
    /// A full shuffle beyond the registration budget: the threads and pinned buffers that copy
    /// the rows of windows not registered into each round's staging (see `row_copies`).
    pub(super) row_copies: Option<RowCopier>,
    /// A window shuffle beyond the daemon's memory: its first steps' rows, read from the disk into
    /// each round's staging through `row_copies` while the loader copies the first window.
    pub(super) cold_start: Option<ColdStart>,
}

/// Windows that [`PageCacheWindows::map`] pinned for a stream, unpinned when dropped: when the
/// stream is released, and on every error path of its opening (a pinned window is never evicted, so
/// a leaked pin would keep part of the registration budget from later streams).
pub(super) struct PinnedWindows {
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

/// What [`Resident::open_mapped`] made of a stream within the registration budget.
// Returned once per stream opening, at once taken apart.
#[allow(clippy::large_enum_variant)]
enum Mapping {
    /// The stream reads in place from windows mapped for its life (`Some`), or stages its blocks
    /// (`None`).
    Done(Option<Resident>),
    /// A window is not in the page cache in a shuffled order: the stream reads streamed.
    NotCached,
}

impl Resident {
    /// Maps every window of every shard of `plan` for the device, if the stream qualifies: every block
    /// of its fields raw, the policy not `off` (and `always`, or a shuffled order), and every window
    /// resident and within the budget. `None` otherwise (the windows mapped so far are released).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::pipeline::gpu) fn open(
        plan: &StreamPlan,
        files: &FileTable,
        windows: &Arc<PageCacheWindows>,
        limits: &GpuStreamLimits,
        fraction_min: f64,
        device: &crate::device::Device,
        metrics: &crate::metrics::DeviceMetrics,
        shard_pool: &Arc<ShardSlotPool>,
        tier: &Arc<DeviceTier>,
        device_order: bool,
    ) -> Result<Option<Resident>, FillError> {
        let shuffle = plan.order.shuffle_kind();
        if !fields_all_raw(plan) {
            return Ok(None);
        }
        // The device-memory tier: a dataset whole there is read there in every order, whatever
        // the zero-copy mode; one filling is filled further by this stream (if it reads in place
        // from registered windows, below). Datasets beyond the registration budget are filled by
        // `Resident::open_decoded` instead, never admitted here (they map no windows to fill from).
        let mut in_tier = None;
        let file_bytes = shard_file_bytes(plan, files)?;
        let in_budget = file_bytes.iter().sum::<u64>() <= windows.registered_bytes_max() as u64;
        if tier.is_enabled() && in_budget {
            let key = TierKey {
                dir: plan.dataset.dir.clone(),
                identity: plan.dataset.manifest_identity,
                decoded: false,
            };
            match tier.acquire(key, &file_bytes, windows.window_bytes())? {
                Acquired::Found(dataset) | Acquired::Admitted(dataset) => {
                    if dataset.is_complete() && dataset.usable() {
                        return Self::open_in_tier(
                            plan,
                            files,
                            windows,
                            limits,
                            device,
                            metrics,
                            &file_bytes,
                            shard_pool,
                            dataset,
                            tier,
                            None,
                            None,
                        )
                        .map(Some);
                    }
                    in_tier = Some(dataset);
                }
                Acquired::None => {}
            }
        }
        let total: u64 = file_bytes.iter().sum();
        let wanted = match limits.zero_copy {
            ZeroCopy::Off => false,
            ZeroCopy::Always => true,
            // In dataset order whole blocks are staged at the copy engines' rate, unless the
            // shards can be copied ahead into device memory (checked once the windows are mapped).
            // A dataset larger than the daemon's memory is staged in dataset order: its blocks are
            // read once, from the disk at a deep queue, and verified on the device as they arrive
            // (copying shards ahead verifies the whole dataset before the first batch, a second
            // read of every byte: 0.67x `dd` and a first batch after 7.7 s, against 1.37x and
            // 0.5 s staged, on the H200 test machine, 12 GiB in a 4 GiB memory cgroup).
            ZeroCopy::Auto => {
                let beyond_memory =
                    crate::storage::memory::memory_limit_bytes().is_some_and(|limit| total > limit);
                shuffle != ShuffleKind::None || (limits.device_shard_bytes > 0 && !beyond_memory)
            }
        };
        if !wanted {
            return Ok(None);
        }
        if total <= windows.registered_bytes_max() as u64 {
            let mapped = Self::open_mapped(
                plan,
                files,
                windows,
                limits,
                fraction_min,
                device,
                metrics,
                &file_bytes,
                shard_pool,
                in_tier.map(|dataset| (dataset, tier)),
                device_order,
            )?;
            if let Mapping::Done(resident) = mapped {
                return Ok(resident);
            }
        }
        // (A full shuffle within the budget whose windows are not all cached or registrable
        // stages its blocks, as before.)
        if shuffle == ShuffleKind::Full && total > windows.registered_bytes_max() as u64 {
            return Self::open_row_copies(
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
        Self::open_streamed(
            plan,
            files,
            windows,
            limits,
            fraction_min,
            device,
            metrics,
            &file_bytes,
            shard_pool,
        )
    }

    /// [`Self::open`] for a dataset within the registration budget: maps every window of every
    /// shard and keeps it mapped. [`Mapping::NotCached`] when a window is not in the page cache (or
    /// not registrable now) in a shuffled order, which the stream then reads streamed.
    #[allow(clippy::too_many_arguments)]
    fn open_mapped(
        plan: &StreamPlan,
        files: &FileTable,
        windows: &Arc<PageCacheWindows>,
        limits: &GpuStreamLimits,
        fraction_min: f64,
        device: &crate::device::Device,
        metrics: &crate::metrics::DeviceMetrics,
        file_bytes: &[u64],
        shard_pool: &Arc<ShardSlotPool>,
        in_tier: Option<(Arc<TierDataset>, &Arc<DeviceTier>)>,
        device_order: bool,
    ) -> Result<Mapping, FillError> {
        let shuffle = plan.order.shuffle_kind();
        if shuffle == ShuffleKind::Full {
            warm_for_full_shuffle(plan, files, windows, fraction_min, file_bytes, metrics);
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
                        if shuffle == ShuffleKind::None {
                            return Ok(Mapping::Done(None));
                        }
                        return Ok(Mapping::NotCached);
                    }
                }
                start += window_bytes;
            }
        }
        let map_s = started.elapsed().as_secs_f64();
        let shard_first_samples = plan.shard_first_samples();
        // Rounds that read device copies upload their own region table (at most REGIONS_MAX).
        let in_tier = in_tier.filter(|(dataset, _)| {
            table.len() <= REGIONS_MAX && dataset.window_count() == table.len()
        });
        // Filling the tier: every window is copied once, in the order the stream reads them, by
        // the tier's copies; the stream copies no shards ahead of its own.
        let tier_read = match in_tier {
            // SAFETY: `shard_windows` are windows `mapped` keeps pinned, and the `TierRead` waits
            // for the copies before they are unpinned (it is released, or dropped, first).
            Some((dataset, tier)) => Some(unsafe {
                fill_tier(plan, dataset, tier, &shard_windows, &shard_first_samples)
            }?),
            None => None,
        };
        // A window shuffle whose order the device can compute reads every window in place, as a
        // full shuffle does: at the link's rate, with no planning threads, instead of copying its
        // shards ahead on about four host cores of planning (see `ordered`).
        let in_place_ordered = device_order && shuffle == ShuffleKind::Window;
        let device_shards =
            if table.len() <= REGIONS_MAX && tier_read.is_none() && !in_place_ordered {
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
        if limits.zero_copy == ZeroCopy::Auto
            && shuffle == ShuffleKind::None
            && device_shards.is_none()
            && tier_read.is_none()
        {
            mapped.unpin();
            return Ok(Mapping::Done(None));
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
        Ok(Mapping::Done(Some(Resident {
            regions,
            region_count: table.len() as u32,
            host_regions: table,
            round_regions: Vec::new(),
            round_regions_encoded: Vec::new(),
            device_shards,
            tier: tier_read,
            windows: mapped,
            planner: None,
            row_copies: None,
            cold_start: None,
            geometry: Arc::new(RowGeometry::new(
                plan,
                first_region,
                shard_first_samples,
                table_len,
                window_bytes,
                corrupt,
                limits.gather_piece_out_bytes,
            )),
        })))
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
        let shard_first_samples = plan.shard_first_samples();
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
        // Beyond the daemon's memory the loader verifies each shard as it copies it (see
        // `shard_checks`) instead of the whole dataset being read before the first batch.
        let beyond_memory = crate::storage::memory::memory_limit_bytes()
            .is_some_and(|limit| file_bytes.iter().sum::<u64>() > limit);
        let checks = beyond_memory.then(|| {
            let fields = plan.fields.iter().map(|f| f.field_index).collect();
            Arc::new(ShardChecks::new(Arc::clone(&plan.dataset), fields))
        });
        device_shards.start_loader(
            device,
            windows,
            paths,
            fraction_min,
            limits.loader_copy_threads,
            checks.clone(),
        )?;
        let corrupt = match checks {
            Some(_) => HashMap::new(),
            None => verify_counted(plan, files, metrics)?,
        };
        let shard_regions = table.len();
        let cold = match beyond_memory && plan.order.shuffle_kind() == ShuffleKind::Window {
            true => window_cold_start(
                plan,
                file_bytes,
                window_bytes,
                needed,
                limits,
                device,
                &mut table,
            )?,
            false => None,
        };
        let regions = KeptBuffer::from_host(device, &GatherRegion::encode_all(&table), shard_pool)?;
        tracing::info!(
            "stream copies {} shards ({} windows) through the registration budget into device \
             memory ({} corrupt blocks)",
            plan.dataset.shards.len(),
            shard_regions,
            corrupt.len()
        );
        let table_len = table.len();
        let geometry = || {
            RowGeometry::new(
                plan,
                first_region.clone(),
                shard_first_samples.clone(),
                table_len,
                window_bytes,
                corrupt.clone(),
                limits.gather_piece_out_bytes,
            )
        };
        let (row_copies, cold_start) = match cold {
            Some((staging, steps_end, copier)) => (
                Some(copier),
                Some(ColdStart {
                    geometry: Arc::new(geometry().with_row_staging(staging)),
                    steps_end,
                }),
            ),
            None => (None, None),
        };
        Ok(Some(Resident {
            regions,
            region_count: table_len as u32,
            host_regions: table,
            round_regions: Vec::new(),
            round_regions_encoded: Vec::new(),
            device_shards: Some(device_shards),
            tier: None,
            windows: PinnedWindows::new(windows),
            planner: None,
            row_copies,
            cold_start,
            geometry: Arc::new(geometry()),
        }))
    }

    /// [`Self::open`] for a full shuffle of a dataset larger than the registration budget: the
    /// windows the budget has room for (less [`WINDOWS_KEPT_FREE`] for other readers) are mapped
    /// for the stream's life and their rows read in place; the rows of the others are copied by
    /// host threads into each round's staging (see `row_copies`). `None` (the stream stages blocks
    /// instead) when the region table or a round's staging cannot hold them.
    #[allow(clippy::too_many_arguments)]
    fn open_row_copies(
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
        let started = std::time::Instant::now();
        let window_bytes = windows.window_bytes();
        // A round's staging: the device staging buffer of each set of round buffers holds at
        // least `staging_bytes`.
        let capacity = limits.staging_bytes.min(ROW_STAGING_BYTES_MAX) as u64;
        let row_bytes_max = plan_row_bytes_max(plan, window_bytes);
        let windows_count: u64 = file_bytes.iter().map(|b| b.div_ceil(window_bytes)).sum();
        // One more region: the round's staging.
        if row_bytes_max > capacity || windows_count as usize + 1 > REGIONS_MAX {
            return Ok(None);
        }
        // Rows read from the disk (`cold_rows`) register no window: that would fault its pages in.
        let from_disk = rows_from_disk(file_bytes);
        if from_disk {
            tracing::info!(
                "full shuffle of a dataset larger than the daemon's memory ({} bytes): rows read \
                 from the disk at a queue depth of {}, blocks verified as first read",
                file_bytes.iter().sum::<u64>(),
                COLD_QUEUE_DEPTH
            );
        }
        let pinned_max = if from_disk {
            0
        } else {
            (windows.registered_bytes_max() as u64).saturating_sub(WINDOWS_KEPT_FREE * window_bytes)
        };
        let mut pinned_bytes = 0u64;
        let mut mapped = PinnedWindows::new(windows);
        let mut table: Vec<GatherRegion> = Vec::new();
        let mut copied: Vec<bool> = Vec::new();
        let mut first_region = Vec::with_capacity(file_bytes.len());
        for (index, &bytes) in file_bytes.iter().enumerate() {
            first_region.push(table.len() as u32);
            let file = files.get(FileId(index as u32)).file();
            let mut start = 0u64;
            while start < bytes {
                let len = window_bytes.min(bytes - start);
                let range = if pinned_bytes + len <= pinned_max {
                    windows.map(file, start, len as usize, fraction_min)?
                } else {
                    None
                };
                match range {
                    Some(range) => {
                        mapped.ids.push(range.window);
                        pinned_bytes += range.window_bytes;
                        table.push(GatherRegion {
                            ptr: range.window_device_ptr,
                            bytes: range.window_bytes,
                        });
                        copied.push(false);
                    }
                    None => {
                        // Never read by a kernel: the rows of this window are read from the
                        // round's staging.
                        table.push(GatherRegion { ptr: 0, bytes: len });
                        copied.push(true);
                    }
                }
                start += window_bytes;
            }
        }
        let staging_region = table.len();
        // Pointed at the round's staging by each round that reads it.
        table.push(GatherRegion {
            ptr: 0,
            bytes: capacity,
        });
        copied.push(false);
        let map_s = started.elapsed().as_secs_f64();
        let (corrupt, cold) = if from_disk {
            let cold = ColdRows::open(Arc::clone(&plan.dataset), plan.on_corrupt)?;
            (HashMap::new(), Some(cold))
        } else {
            (verify_counted(plan, files, metrics)?, None)
        };
        let regions = KeptBuffer::from_host(device, &GatherRegion::encode_all(&table), shard_pool)?;
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = if from_disk {
            1
        } else {
            row_copy_threads(limits.loader_copy_threads, cpus)
        };
        let rounds = limits
            .rounds_in_flight
            .clamp(ROUNDS_IN_FLIGHT_MIN, ROUNDS_IN_FLIGHT_MAX);
        let paths = plan.dataset.shards.iter().map(|s| s.path.clone()).collect();
        let copier = RowCopier::new(device, paths, rounds, capacity as usize, threads, cold)?;
        let windows_mapped = mapped.ids.len();
        tracing::info!(
            "full shuffle beyond the registration budget: rows of {} of {} windows read in place, \
             the others copied by {} host threads into {} staging buffers of {} KiB ({} corrupt \
             blocks); windows mapped in {:.1} ms, then verified in {:.1} ms",
            windows_mapped,
            windows_count,
            threads,
            rounds,
            capacity >> 10,
            corrupt.len(),
            map_s * 1e3,
            (started.elapsed().as_secs_f64() - map_s) * 1e3
        );
        let table_len = table.len();
        let geometry = RowGeometry::new(
            plan,
            first_region,
            plan.shard_first_samples(),
            table_len,
            window_bytes,
            corrupt,
            limits.gather_piece_out_bytes,
        )
        .with_row_staging(RowStaging {
            copied,
            region: staging_region,
            capacity,
            row_bytes_max,
        });
        Ok(Some(Resident {
            regions,
            region_count: table_len as u32,
            host_regions: table,
            round_regions: Vec::new(),
            round_regions_encoded: Vec::new(),
            device_shards: None,
            tier: None,
            windows: mapped,
            planner: None,
            geometry: Arc::new(geometry),
            row_copies: Some(copier),
            cold_start: None,
        }))
    }

    /// A stream over a dataset with compressed blocks (or a raw one larger than the registration
    /// budget), read whole from the device's memory tier, which holds the dataset decoded or admits
    /// it now: then this stream decodes (or copies) it there first, and streams of the dataset
    /// opening meanwhile wait for it (see `tier_fill`). `None` when the tier is off or has no room,
    /// or the fill failed: the stream is served as without the tier.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::pipeline::gpu) fn open_decoded(
        plan: &StreamPlan,
        files: &FileTable,
        reader: &mut GpuReader,
        choice: PathChoice,
        lz4: &Lz4Decoder,
        limits: &GpuStreamLimits,
        device: &crate::device::Device,
        metrics: &crate::metrics::DeviceMetrics,
        shard_pool: &Arc<ShardSlotPool>,
        tier: &Arc<DeviceTier>,
    ) -> Result<Option<Resident>, FillError> {
        if fields_all_raw(plan) {
            // A raw dataset inside the registration budget fills the tier from the windows it maps
            // (`Resident::open`); beyond it, it is filled here, its blocks copied.
            if !tier.is_enabled() {
                return Ok(None);
            }
            let stored: u64 = shard_file_bytes(plan, files)?.iter().sum();
            if stored <= reader.windows().registered_bytes_max() as u64 {
                return Ok(None);
            }
        }
        let decoded_bytes = decoded_bytes(&plan.dataset);
        let in_tier = tier.is_enabled() && decoded_bytes <= tier.bytes_max();
        let raw = fields_all_raw(plan);
        let held_max = tier.held_bytes_max().max(tier.host_held_bytes_max());
        if !in_tier && (raw || decoded_bytes > held_max) {
            if raw {
                return Ok(None);
            }
            // Compressed blocks are then read and decoded round by round, a block per row in a
            // shuffle: an order of magnitude below the link. Say what would avoid it.
            tracing::info!(
                "stream reads compressed blocks of {} round by round; a device-memory tier \
                 (--device-cache) or device shard memory (--device-shard-memory) of at least {} \
                 MiB would decode the dataset once and serve every order from device memory, and \
                 host decoded memory (--host-decoded-memory) that large from host memory",
                plan.dataset.dir.display(),
                decoded_bytes.div_ceil(1 << 20)
            );
            return Ok(None);
        }
        let layout = Arc::new(DecodedLayout::of(&plan.dataset));
        let key = TierKey {
            dir: plan.dataset.dir.clone(),
            identity: plan.dataset.manifest_identity,
            decoded: true,
        };
        let windows = Arc::clone(reader.windows());
        let window_bytes = windows.window_bytes();
        let mut acquired = Acquired::None;
        if in_tier {
            acquired = tier.acquire(key.clone(), &layout.shard_bytes, window_bytes)?;
        }
        // Not taken by the tier: decoded for the streams that read it now (see
        // `DeviceTier::acquire_held`).
        let mut held = false;
        if matches!(acquired, Acquired::None) && !raw {
            acquired = tier.acquire_held(key.clone(), &layout.shard_bytes, window_bytes)?;
            held = true;
        }
        let dataset = match acquired {
            Acquired::Found(dataset) | Acquired::Admitted(dataset) => dataset,
            Acquired::None => return Ok(None),
        };
        let mut verified = None;
        {
            let _fill = dataset.fill_lock();
            if !dataset.is_complete() && dataset.usable() {
                let started = std::time::Instant::now();
                // The blocks' checksums are verified on the host while the device decodes them.
                let (filled, checked) = std::thread::scope(|scope| {
                    let checking = scope.spawn(|| verify_blocks(plan, files));
                    let filled =
                        fill_decoded(plan, files, &layout, &dataset, reader, choice, lz4, device);
                    let checked = checking
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    (filled, checked)
                });
                verified = Some(checked);
                match filled {
                    Ok(summary) => {
                        let seconds = started.elapsed().as_secs_f64();
                        tracing::info!(
                            "decoded {} MiB of stored blocks ({} LZ4 blocks, {} not decodable) \
                             into {} MiB of {} in {:.3} s ({:.1} GB/s decoded)",
                            summary.stored_bytes >> 20,
                            summary.lz4_blocks,
                            summary.undecodable.len(),
                            dataset.bytes() >> 20,
                            match (held, dataset.place()) {
                                (false, _) => "the device-memory tier",
                                (true, TierPlace::Device) => {
                                    "device memory held while streams read it"
                                }
                                (true, TierPlace::Host) => {
                                    "page-locked host memory held while streams read it"
                                }
                            },
                            seconds,
                            dataset.bytes() as f64 / seconds.max(1e-9) / 1e9
                        );
                        dataset.finish_fill(true, summary.undecodable);
                    }
                    Err(error) => {
                        dataset.finish_fill(false, Vec::new());
                        match held {
                            true => tier.discard_held(&dataset),
                            false => tier.discard(&key),
                        }
                        tracing::warn!(
                            "decoding {} whole failed ({error}); the stream reads its blocks \
                             round by round",
                            plan.dataset.dir.display()
                        );
                        return Ok(None);
                    }
                }
            }
        }
        // A copy decoded for the streams reading it that this stream does not read after all is
        // freed when no stream reads it (as when a stream closes).
        let place = dataset.place();
        let not_read = |tier: &Arc<DeviceTier>| {
            if held {
                tier.stream_closed(&key, place);
            }
        };
        if !(dataset.is_complete() && dataset.usable()) {
            drop(dataset);
            not_read(tier);
            return Ok(None);
        }
        let opened = Self::open_in_tier(
            plan,
            files,
            &windows,
            limits,
            device,
            metrics,
            &layout.shard_bytes.clone(),
            shard_pool,
            dataset,
            tier,
            Some(Arc::clone(&layout)),
            verified,
        );
        if opened.is_err() {
            not_read(tier);
        }
        opened.map(Some)
    }

    /// [`Self::open`] for a dataset whole in the device's memory tier: every region of the table
    /// points into the tier, no window is registered for the stream, and the table is uploaded
    /// once. Blocks are verified as without the tier (once per dataset), unless the caller did
    /// (`verified`: what [`verify_blocks`] returned, while the stream decoded the dataset).
    #[allow(clippy::too_many_arguments)]
    fn open_in_tier(
        plan: &StreamPlan,
        files: &FileTable,
        windows: &Arc<PageCacheWindows>,
        limits: &GpuStreamLimits,
        device: &crate::device::Device,
        metrics: &crate::metrics::DeviceMetrics,
        file_bytes: &[u64],
        shard_pool: &Arc<ShardSlotPool>,
        dataset: Arc<TierDataset>,
        tier: &Arc<DeviceTier>,
        decoded: Option<Arc<DecodedLayout>>,
        verified: Option<VerifiedBlocks>,
    ) -> Result<Resident, FillError> {
        let window_bytes = windows.window_bytes();
        let mut first_region = Vec::with_capacity(file_bytes.len());
        let mut regions = 0u32;
        for &bytes in file_bytes {
            first_region.push(regions);
            regions += bytes.div_ceil(window_bytes) as u32;
        }
        let table = dataset.regions();
        assert_eq!(
            table.len(),
            regions as usize,
            "the tier cut the same windows"
        );
        let (mut corrupt, verified_bytes) = match verified {
            Some(verified) => verified?,
            None => verify_blocks(plan, files)?,
        };
        metrics.add_read_bytes(crate::metrics::ReadPath::PageCache, verified_bytes);
        // Blocks that did not decode into the tier are corrupt for every stream (a checksum
        // mismatch found above says more, and is kept).
        for (key, bad) in dataset.undecodable() {
            corrupt.entry(key).or_insert(bad);
        }
        let regions = KeptBuffer::from_host(device, &GatherRegion::encode_all(&table), shard_pool)?;
        tracing::info!(
            "stream reads {} shards from {} ({} MiB{}, {} corrupt blocks)",
            plan.dataset.shards.len(),
            match dataset.place() {
                TierPlace::Device => "the device-memory tier",
                TierPlace::Host => "page-locked host memory mapped for the device",
            },
            dataset.bytes() >> 20,
            if decoded.is_some() { ", decoded" } else { "" },
            corrupt.len()
        );
        let table_len = table.len();
        let geometry = RowGeometry::new(
            plan,
            first_region,
            plan.shard_first_samples(),
            table_len,
            window_bytes,
            corrupt,
            limits.gather_piece_out_bytes,
        );
        let geometry = match decoded {
            Some(layout) => geometry.with_decoded(plan, layout),
            None => geometry,
        };
        Ok(Resident {
            regions,
            region_count: table_len as u32,
            host_regions: table,
            round_regions: Vec::new(),
            round_regions_encoded: Vec::new(),
            device_shards: None,
            tier: Some(TierRead::whole(dataset, tier)),
            windows: PinnedWindows::new(windows),
            planner: None,
            row_copies: None,
            cold_start: None,
            geometry: Arc::new(geometry),
        })
    }

    /// Unpins the windows once the stream's work is done (the caller synchronised its compute
    /// stream; the copies ahead are waited for here).
    pub(in crate::pipeline::gpu) fn release(&mut self) {
        if let Some(device_shards) = &mut self.device_shards {
            let _ = device_shards.synchronize();
        }
        if let Some(tier) = &self.tier {
            tier.synchronize();
        }
        self.windows.unpin();
    }

    /// Frees the stream's region table when it is dropped instead of keeping it for the next
    /// stream: for when the stream's work on the device could not be confirmed done.
    pub(in crate::pipeline::gpu) fn discard_buffers(&mut self) {
        self.regions.discard();
    }

    /// Whether every row of the stream is read from its dataset whole in the device's memory tier.
    pub(in crate::pipeline::gpu) fn reads_tier_only(&self) -> bool {
        self.tier.as_ref().is_some_and(|t| t.is_whole_at_open())
    }

    /// Whether rows of the stream are copied by host threads into each round's staging (a full
    /// shuffle beyond the registration budget): such rounds serve one batch each.
    /// The region of a round's staging in the stream's table, when some rows are copied into it
    /// (a full shuffle beyond the registration budget, or a window shuffle's cold start).
    pub(super) fn staging_region(&self) -> Option<usize> {
        self.geometry.staging_region().or_else(|| {
            self.cold_start
                .as_ref()
                .and_then(|cold| cold.geometry.staging_region())
        })
    }

    pub(in crate::pipeline::gpu) fn copies_rows(&self) -> bool {
        self.row_copies.is_some()
    }

    /// Device memory held for shard copies.
    pub(in crate::pipeline::gpu) fn device_bytes(&self) -> usize {
        self.device_shards.as_ref().map_or(0, |d| d.device_bytes())
    }
}

/// Queues the copies of the windows of `dataset` not queued yet into the device's memory tier, from
/// the stream's registered windows `shard_windows`, in the order the stream reads them (see
/// [`tier_fill_order`]); returns how the stream reads the dataset while it fills.
///
/// # Safety
/// The windows must stay pinned until the returned `TierRead` has waited for the copies.
unsafe fn fill_tier(
    plan: &StreamPlan,
    dataset: Arc<TierDataset>,
    tier: &Arc<DeviceTier>,
    shard_windows: &[ShardWindows],
    shard_first_samples: &[u64],
) -> Result<TierRead, FillError> {
    let sources: Vec<usize> = shard_windows
        .iter()
        .flat_map(|s| s.windows.iter().map(|&(host_addr, _)| host_addr))
        .collect();
    let fill_order = tier_fill_order(plan, shard_windows, shard_first_samples);
    // SAFETY: the caller keeps the sources pinned until the `TierRead` waited for the copies (or,
    // when queueing fails half-way, until the copies queued are waited for here).
    let queued = match unsafe { dataset.queue_fill(&sources, fill_order.iter().copied()) } {
        Ok(queued) => queued,
        Err(error) => {
            // Copies queued before the failure read the windows, which are unpinned once this
            // returns: wait for them (a failed wait marks the dataset unusable).
            let _ = dataset.synchronize();
            return Err(error.into());
        }
    };
    tracing::info!(
        "stream fills the device-memory tier with {} MiB of the dataset ({queued} of {} windows \
         queued by it)",
        dataset.bytes() >> 20,
        fill_order.len()
    );
    // In dataset order the copies run just ahead of the rows that read them. A window shuffle's
    // batches read the windows of its current shards, copied first: waiting for those copies
    // (tens of milliseconds for the first window) moves each byte across the link once, where
    // reading in place meanwhile had the rows and the copies share it (0.86x the first epoch
    // without the tier in run 108). A full shuffle's first batch reads the whole dataset, so it
    // waits for every copy (the link's time for the dataset), then the rest of the epoch reads
    // HBM with the order on the device: reading in place meanwhile shared the link with the
    // copies and made both slower (0.81x the first epoch without the tier in run 115, against
    // about 1.0x for the fill's time and one epoch from the tier).
    Ok(TierRead::filling(dataset, tier, fill_order))
}

/// The order in which a stream filling the device-memory tier queues the copies of its windows
/// (region indices): the shards in the order the stream first reads them (the rest of the dataset
/// in order; a window shuffle's windows one after another), then any not read ahead; file order in
/// a full shuffle, which reads every shard in every batch.
fn tier_fill_order(
    plan: &StreamPlan,
    shard_windows: &[ShardWindows],
    shard_first_samples: &[u64],
) -> Vec<usize> {
    let shard_count = shard_windows.len();
    let mut shards: Vec<usize> = Vec::with_capacity(shard_count);
    let mut seen = vec![false; shard_count];
    if let Some(ranges) = plan.order.samples_ahead(0, usize::MAX) {
        for range in ranges {
            if range.is_empty() {
                continue;
            }
            let first = shard_first_samples.partition_point(|&s| s <= range.start) - 1;
            let last = shard_first_samples.partition_point(|&s| s < range.end) - 1;
            let last = last.min(shard_count - 1);
            for (shard, seen) in seen.iter_mut().enumerate().take(last + 1).skip(first) {
                if !*seen {
                    *seen = true;
                    shards.push(shard);
                }
            }
        }
    }
    shards.extend((0..shard_count).filter(|&s| !seen[s]));
    shards
        .into_iter()
        .flat_map(|s| {
            let first = shard_windows[s].first_region;
            first..first + shard_windows[s].windows.len()
        })
        .collect()
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
/// by row from the disk it would go at the disk's random-read pace (on the H100 test machine a tenth
/// of its sequential rate, with 4 KiB reads at queue depth 64), and staging a block per row reads 40
/// bytes per byte. Skipped when the dataset would not fit in half the memory the
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

/// Whether a full shuffle beyond the registration budget reads its rows from the disk (see
/// `cold_rows`): `GPUFEED_ROW_READS`, by default when the dataset (`file_bytes`) is larger than the
/// memory the daemon may use. Said in the log when it does.
fn rows_from_disk(file_bytes: &[u64]) -> bool {
    let dataset_bytes: u64 = file_bytes.iter().sum();
    let memory_limit = crate::storage::memory::memory_limit_bytes();
    RowReads::from_env().reads_disk(dataset_bytes, memory_limit)
}

/// The most staging bytes one row of `plan` takes in a round's staging (see
/// `row_copies::row_staging_bytes_max`), windows of `window_bytes`.
fn plan_row_bytes_max(plan: &StreamPlan, window_bytes: u64) -> u64 {
    row_staging_bytes_max(
        plan.fields.iter().map(|field| {
            let block_bytes_min = plan
                .dataset
                .shards
                .iter()
                .flat_map(|shard| shard.metadata.field_blocks(field.field_index))
                .map(|block| block.raw_bytes as u64)
                .filter(|&bytes| bytes > 0)
                .min()
                .unwrap_or(1);
            (field.sample_bytes_in, block_bytes_min)
        }),
        window_bytes,
    )
}

/// Steps of a window shuffle beyond the daemon's memory that read their rows from the disk before
/// it reads from the shards its loader copies (see [`window_cold_start`]), unless
/// `GPUFEED_COLD_START_STEPS` says otherwise.
const COLD_START_STEPS_DEFAULT: u64 = 1;

/// The cold start of a window shuffle of a dataset larger than the daemon's memory (see
/// [`ColdStart`]). Its first batch draws rows from every shard of its window, so it would wait for
/// the loader to copy the whole window (4 shards of 512 MiB take 1.5 s at 1.4 GB/s). Instead its
/// first steps (`GPUFEED_COLD_START_STEPS`, 1 by default; 0: none) read their rows from the disk at
/// a deep queue (`cold_rows`), each round's into its staging, whose region is added to `table`,
/// before the loader starts on the window. A row of a block not verified yet reads its whole block
/// (verified then), so a cold step reads up to a block per row: the default cold start is taken
/// only when that is at most half of what the window's copy reads (`window_shards` shards). Returns the
/// staging, the first step after the cold ones, and the reader; `None` when the rows come from the
/// page cache (`GPUFEED_ROW_READS`), the cold start would read too much, or a round's staging or
/// the region table cannot hold it.
#[allow(clippy::too_many_arguments)]
fn window_cold_start(
    plan: &StreamPlan,
    file_bytes: &[u64],
    window_bytes: u64,
    window_shards: usize,
    limits: &GpuStreamLimits,
    device: &crate::device::Device,
    table: &mut Vec<GatherRegion>,
) -> Result<Option<(RowStaging, u64, RowCopier)>, FillError> {
    // Given in the environment, the count is taken as given (the size check below is skipped).
    let given = std::env::var("GPUFEED_COLD_START_STEPS")
        .ok()
        .and_then(|text| match text.trim().parse::<u64>() {
            Ok(steps) => Some(steps),
            Err(_) => {
                tracing::warn!("GPUFEED_COLD_START_STEPS={text:?} is ignored: not a step count");
                None
            }
        });
    let steps = given.unwrap_or(COLD_START_STEPS_DEFAULT);
    let block_bytes_max = plan
        .fields
        .iter()
        .flat_map(|field| {
            plan.dataset
                .shards
                .iter()
                .flat_map(|shard| shard.metadata.field_blocks(field.field_index))
        })
        .map(|block| block.stored_bytes as u64)
        .max()
        .unwrap_or(0);
    let shard_bytes = file_bytes.iter().sum::<u64>() / file_bytes.len().max(1) as u64;
    let cold_read_bytes = steps * plan.rank.batch_size as u64 * block_bytes_max;
    let window_read_bytes = window_shards as u64 * shard_bytes;
    let capacity = limits.staging_bytes.min(ROW_STAGING_BYTES_MAX) as u64;
    let row_bytes_max = plan_row_bytes_max(plan, window_bytes);
    if steps == 0
        || (given.is_none() && cold_read_bytes > window_read_bytes / 2)
        || !rows_from_disk(file_bytes)
        || row_bytes_max > capacity
        || table.len() + 1 > REGIONS_MAX
    {
        return Ok(None);
    }
    let steps_end = steps.min(plan.steps);
    let mut copied = vec![true; table.len()];
    copied.push(false);
    let region = table.len();
    // Pointed at the round's staging by each round that reads it; read by the cold steps only.
    table.push(GatherRegion {
        ptr: 0,
        bytes: capacity,
    });
    let cold = ColdRows::open(Arc::clone(&plan.dataset), plan.on_corrupt)?;
    let rounds = limits
        .rounds_in_flight
        .clamp(ROUNDS_IN_FLIGHT_MIN, ROUNDS_IN_FLIGHT_MAX);
    let paths = plan.dataset.shards.iter().map(|s| s.path.clone()).collect();
    let copier = RowCopier::new(device, paths, rounds, capacity as usize, 1, Some(cold))?;
    tracing::info!(
        "window shuffle of a dataset larger than the daemon's memory ({} bytes): its first steps \
         (until step {}) read their rows from the disk at a queue depth of {} (blocks verified \
         as first read) while the loader copies the first window's shards",
        file_bytes.iter().sum::<u64>(),
        steps_end,
        COLD_QUEUE_DEPTH
    );
    let staging = RowStaging {
        copied,
        region,
        capacity,
        row_bytes_max,
    };
    Ok(Some((staging, steps_end, copier)))
}

/// [`verify_blocks`], the bytes it read counted in the device's metrics; returns the corrupt
/// blocks.
fn verify_counted(
    plan: &StreamPlan,
    files: &FileTable,
    metrics: &crate::metrics::DeviceMetrics,
) -> Result<HashMap<BlockKey, Arc<CorruptBlock>>, FillError> {
    let (corrupt, verified_bytes) = verify_blocks(plan, files)?;
    metrics.add_read_bytes(crate::metrics::ReadPath::PageCache, verified_bytes);
    Ok(corrupt)
}

/// Verifies the checksum of every block of the stream's fields that no reader of the dataset has
/// verified yet, from the page cache, on several threads; returns the corrupt ones and the bytes
/// read.
#[allow(clippy::type_complexity)]
/// What [`verify_blocks`] found: the corrupt blocks and the bytes it read.
type VerifiedBlocks = Result<(HashMap<BlockKey, Arc<CorruptBlock>>, u64), FillError>;

fn verify_blocks(plan: &StreamPlan, files: &FileTable) -> VerifiedBlocks {
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
    let mut maps: Vec<Option<MappedFile>> = Vec::with_capacity(plan.dataset.shards.len());
    for index in 0..plan.dataset.shards.len() {
        let file = files.get(FileId(index as u32)).file();
        // A shard truncated while it is verified reads zeros there (see `MappedFile`).
        maps.push(MappedFile::map(file).ok());
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
                        match check_in_map(&plan.dataset, maps[shard].as_ref(), key) {
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
