//! The daemon's measurements and their Prometheus text rendering (`GET /metrics` of the control API).
//!
//! [`Metrics`] is a fixed set of atomics, allocated once at start and shared as an `Arc`: the read
//! path, the decoder and the socket server add to it without locks or allocation. Names follow the
//! Prometheus conventions with the unit last (`gpufeed_read_bytes_total`,
//! `gpufeed_handoff_latency_seconds`).
//!
//! [`Metrics`] is also the one ledger of what the socket server holds: sessions, streams, slots and
//! their bytes, slots by lease, batches served and samples replaced. Each serving event updates it
//! once, through one method ([`Metrics::open_session`], [`Metrics::stream_opened`],
//! [`Metrics::move_slot`], [`Metrics::batches_served`]...), and both the socket protocol's `Status` and
//! the control API's status and metrics read the same values ([`Metrics::serving`]).
//!
//! The socket server feeds that ledger and the hand-off latency (from a filled slot to its `Batch`
//! frame written to the consumer's socket); the assemblers feed bytes read per engine, decode and
//! gather time and corrupt blocks.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The storage paths whose bytes are counted separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPath {
    /// io_uring reads (into host memory or pinned bounce buffers).
    Uring,
    /// Positional reads where io_uring is unavailable.
    Pread,
    /// cuFile reads straight into device memory.
    CuFile,
    /// Copies from registered page-cache windows.
    PageCache,
}

impl ReadPath {
    const ALL: [ReadPath; 4] = [
        ReadPath::Uring,
        ReadPath::Pread,
        ReadPath::CuFile,
        ReadPath::PageCache,
    ];

    fn label(self) -> &'static str {
        match self {
            ReadPath::Uring => "io_uring",
            ReadPath::Pread => "pread",
            ReadPath::CuFile => "cufile",
            ReadPath::PageCache => "page_cache",
        }
    }
}

/// Upper bounds of the hand-off latency buckets, in microseconds: 10 µs to 1 s, roughly ×2.5.
pub const HANDOFF_BUCKETS_US: [u64; 12] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 50_000, 250_000, 1_000_000,
];

/// A histogram with fixed buckets (cumulative counts are computed when rendering).
pub struct Histogram {
    bounds_us: &'static [u64],
    buckets: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// A histogram with the given bucket upper bounds (ascending), plus the `+Inf` bucket.
    pub fn new(bounds_us: &'static [u64]) -> Histogram {
        assert!(
            bounds_us.windows(2).all(|w| w[0] < w[1]),
            "ascending bounds"
        );
        Histogram {
            bounds_us,
            buckets: (0..=bounds_us.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// The upper bound, in microseconds, of the bucket holding the `quantile` (0..=1) of the
    /// observations; `None` before any observation or when it lies past the last bound.
    pub fn quantile_upper_bound_us(&self, quantile: f64) -> Option<u64> {
        let count = self.count.load(Ordering::Relaxed);
        if count == 0 {
            return None;
        }
        let rank = ((quantile.clamp(0.0, 1.0) * count as f64).ceil() as u64).max(1);
        let mut cumulative = 0u64;
        for (index, bucket) in self.buckets.iter().enumerate() {
            cumulative += bucket.load(Ordering::Relaxed);
            if cumulative >= rank {
                return self.bounds_us.get(index).copied();
            }
        }
        None
    }

    /// Records `n` observations of `value` at once.
    pub fn observe_n(&self, value: Duration, n: u64) {
        let us = u64::try_from(value.as_micros()).unwrap_or(u64::MAX);
        let bucket = self.bounds_us.partition_point(|&bound| bound < us);
        self.buckets[bucket].fetch_add(n, Ordering::Relaxed);
        self.sum_us
            .fetch_add(us.saturating_mul(n), Ordering::Relaxed);
        self.count.fetch_add(n, Ordering::Relaxed);
    }
}

/// Counters and gauges fed by the daemon's parts; see the module documentation for which are fed.
pub struct Metrics {
    serving: ServingLedger,
    read_bytes: [AtomicU64; 4],
    decode_ns: AtomicU64,
    gather_ns: AtomicU64,
    read_queue_depth: AtomicU64,
    corrupt_blocks: AtomicU64,
    handoff_latency: Histogram,
    http_responses: [AtomicU64; 5],
    pack_raw_bytes: AtomicU64,
    round_buffers_idle_bytes: AtomicU64,
    shard_slots_idle_bytes: AtomicU64,
    /// Per CUDA device (by ordinal, below [`DEVICES_MAX`]).
    devices: [DeviceLedger; DEVICES_MAX],
    block_cache: BlockCacheCounters,
    object_cache: ObjectCacheCounters,
}

/// The cache of shard files fetched from object storage (`remote::cache`), as counters.
#[derive(Default)]
pub struct ObjectCacheCounters {
    /// Bytes of shard files kept or being fetched.
    pub bytes: AtomicU64,
    /// The budget (`--object-cache-max`).
    pub budget_bytes: AtomicU64,
    /// Shards a stream found in the cache.
    pub hits: AtomicU64,
    /// Shards a stream had to fetch.
    pub misses: AtomicU64,
    /// Shard files evicted to make room.
    pub evictions: AtomicU64,
    /// Requests to the store that failed (each try counts, retried or not).
    pub fetch_errors: AtomicU64,
    /// Bytes of shard files fetched and installed.
    pub fetched_bytes: AtomicU64,
    /// Fetched shards that did not verify (fetched again, or kept as the object's own corruption).
    pub corrupt_fetches: AtomicU64,
}

/// A snapshot of [`ObjectCacheCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ObjectCacheCounts {
    /// Bytes of shard files kept or being fetched.
    pub bytes: u64,
    /// The budget.
    pub budget_bytes: u64,
    /// Shards a stream found in the cache.
    pub hits: u64,
    /// Shards a stream had to fetch.
    pub misses: u64,
    /// Shard files evicted to make room.
    pub evictions: u64,
    /// Requests to the store that failed.
    pub fetch_errors: u64,
    /// Bytes of shard files fetched and installed.
    pub fetched_bytes: u64,
    /// Fetched shards that did not verify.
    pub corrupt_fetches: u64,
}

impl ObjectCacheCounters {
    /// The counters now.
    pub fn snapshot(&self) -> ObjectCacheCounts {
        let load = |atomic: &AtomicU64| atomic.load(Ordering::Relaxed);
        ObjectCacheCounts {
            bytes: load(&self.bytes),
            budget_bytes: load(&self.budget_bytes),
            hits: load(&self.hits),
            misses: load(&self.misses),
            evictions: load(&self.evictions),
            fetch_errors: load(&self.fetch_errors),
            fetched_bytes: load(&self.fetched_bytes),
            corrupt_fetches: load(&self.corrupt_fetches),
        }
    }
}

/// The CPU backend's shared decoded-block cache (`pipeline::block_cache`), as counters.
#[derive(Default)]
pub struct BlockCacheCounters {
    /// Bytes of decoded blocks alive: kept in the cache or used by a stream.
    pub held_bytes: AtomicU64,
    /// Bytes kept in the cache.
    pub kept_bytes: AtomicU64,
    /// Host memory for streams: slots, working sets and the cache (`--slot-memory-max`).
    pub budget_bytes: AtomicU64,
    /// Look-ups that found their block.
    pub hits: AtomicU64,
    /// Look-ups that did not.
    pub misses: AtomicU64,
    /// Blocks evicted to make room.
    pub evictions: AtomicU64,
    /// Decoded blocks not kept because every kept block was in use.
    pub refused: AtomicU64,
    /// Bytes the CPU backend decoded (blocks' raw bytes): with `needed_raw_bytes`, its decode
    /// amplification.
    pub decoded_bytes: AtomicU64,
    /// Raw bytes of the samples the CPU backend delivered, before conversion: what a stream needed.
    pub needed_raw_bytes: AtomicU64,
    /// The same samples' share of their blocks' stored bytes (a sample's raw bytes times its block's
    /// stored/raw ratio): with the bytes read over every path, the read amplification.
    pub needed_stored_bytes: AtomicU64,
    /// Rows copied out of a decoded block ahead of their batch (`pipeline::lookahead`).
    pub lookahead_rows_kept: AtomicU64,
    /// Rows served from the look-ahead instead of their block.
    pub lookahead_rows_served: AtomicU64,
}

/// A snapshot of [`BlockCacheCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlockCacheCounts {
    /// Bytes of decoded blocks alive: kept in the cache or used by a stream.
    pub held_bytes: u64,
    /// Bytes kept in the cache.
    pub kept_bytes: u64,
    /// Host memory for streams: slots, working sets and the cache.
    pub budget_bytes: u64,
    /// Look-ups that found their block.
    pub hits: u64,
    /// Look-ups that did not.
    pub misses: u64,
    /// Blocks evicted to make room.
    pub evictions: u64,
    /// Decoded blocks not kept because every kept block was in use.
    pub refused: u64,
    /// Bytes the CPU backend decoded.
    pub decoded_bytes: u64,
    /// Raw bytes of the samples the CPU backend delivered.
    pub needed_raw_bytes: u64,
    /// Those samples' share of their blocks' stored bytes.
    pub needed_stored_bytes: u64,
    /// Rows copied out of a decoded block ahead of their batch.
    pub lookahead_rows_kept: u64,
    /// Rows served from the look-ahead.
    pub lookahead_rows_served: u64,
}

impl BlockCacheCounters {
    /// `delta` bytes of decoded blocks came alive (or, negative, were freed).
    pub fn held_changed(&self, delta: i64) {
        add_signed(&self.held_bytes, delta);
    }

    /// The budget the cache works within.
    pub fn set_budget(&self, bytes: u64) {
        self.budget_bytes.store(bytes, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> BlockCacheCounts {
        BlockCacheCounts {
            held_bytes: self.held_bytes.load(Ordering::Relaxed),
            kept_bytes: self.kept_bytes.load(Ordering::Relaxed),
            budget_bytes: self.budget_bytes.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            decoded_bytes: self.decoded_bytes.load(Ordering::Relaxed),
            needed_raw_bytes: self.needed_raw_bytes.load(Ordering::Relaxed),
            needed_stored_bytes: self.needed_stored_bytes.load(Ordering::Relaxed),
            lookahead_rows_kept: self.lookahead_rows_kept.load(Ordering::Relaxed),
            lookahead_rows_served: self.lookahead_rows_served.load(Ordering::Relaxed),
        }
    }
}

impl BlockCacheCounts {
    /// Bytes decoded per raw byte the CPU backend delivered (1.0: every block decoded once for rows
    /// that use all of it); `None` before anything was delivered.
    pub fn decode_amplification(&self) -> Option<f64> {
        (self.needed_raw_bytes > 0)
            .then(|| self.decoded_bytes as f64 / self.needed_raw_bytes as f64)
    }
}

/// CUDA devices the per-device figures cover (ordinals 0 to 15).
pub const DEVICES_MAX: usize = 16;

/// One CUDA device's counters and gauges.
#[derive(Default)]
struct DeviceLedger {
    served: std::sync::atomic::AtomicBool,
    streams: AtomicU64,
    stream_device_bytes: AtomicU64,
    batches: AtomicU64,
    samples: AtomicU64,
    read_bytes: AtomicU64,
    round_buffers_idle_bytes: AtomicU64,
    shard_slots_idle_bytes: AtomicU64,
    tier: Mutex<DeviceTierFigures>,
}

/// A device's memory tier's figures (see `pipeline::gpu::tier`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceTierFigures {
    /// Its budget (`--device-cache`; 0: off).
    pub bytes_max: u64,
    /// Device bytes it holds (datasets evicted while streams read them included).
    pub held_bytes: u64,
    /// Datasets it holds (resident or filling).
    pub datasets: u64,
    /// Streams that found their dataset complete in it when they opened.
    pub hits: u64,
    /// Streams that admitted their dataset and filled it.
    pub admissions: u64,
    /// Streams whose dataset fitted the budget but found no room or device memory.
    pub declined: u64,
    /// Datasets evicted.
    pub evictions: u64,
    /// Device bytes of datasets decoded for the streams reading them, outside the tier.
    pub decoded_device_bytes: u64,
    /// Host bytes of datasets decoded for the streams of the device into page-locked host memory.
    pub decoded_host_bytes: u64,
}

/// One served CUDA device's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// The device's ordinal (`cuda:N`).
    pub ordinal: u32,
    /// Streams open on it.
    pub streams: u64,
    /// Device memory its open streams' pipelines hold besides their slots (staging, cache, tables,
    /// shards copied ahead).
    pub stream_device_bytes: u64,
    /// Batches its streams filled and handed on.
    pub batches: u64,
    /// Samples in those batches.
    pub samples: u64,
    /// Bytes its streams read from shard files (every path).
    pub read_bytes: u64,
    /// Device memory of round buffers kept for its next stream.
    pub round_buffers_idle_bytes: u64,
    /// Device memory of shard slots and stream buffers kept for its next stream.
    pub shard_slots_idle_bytes: u64,
    /// Its memory tier.
    pub tier: DeviceTierFigures,
}

/// A CUDA device's view of [`Metrics`]: what its streams read is counted for the node and for the
/// device; everything else goes to the node's figures (through `Deref`).
#[derive(Clone)]
pub struct DeviceMetrics {
    metrics: std::sync::Arc<Metrics>,
    ordinal: u32,
}

impl DeviceMetrics {
    /// The view of device `ordinal`.
    pub fn new(metrics: std::sync::Arc<Metrics>, ordinal: u32) -> DeviceMetrics {
        DeviceMetrics { metrics, ordinal }
    }

    /// Counts bytes read from shard files by `path`, for the node and the device.
    pub fn add_read_bytes(&self, path: ReadPath, bytes: u64) {
        self.metrics.add_read_bytes(path, bytes);
        if let Some(device) = self.metrics.device(self.ordinal) {
            device.read_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

impl std::ops::Deref for DeviceMetrics {
    type Target = Metrics;

    fn deref(&self) -> &Metrics {
        &self.metrics
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

/// What the socket server holds and has served, as one set of atomics.
#[derive(Default)]
struct ServingLedger {
    sessions: AtomicU64,
    streams: AtomicU64,
    slots: AtomicU64,
    slot_bytes: AtomicU64,
    slots_by_lease: [AtomicU64; 3],
    batches: AtomicU64,
    replaced: AtomicU64,
}

/// A snapshot of the serving ledger: what `Status` on the socket and the control API report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServingCounts {
    /// Open consumer sessions.
    pub sessions: u64,
    /// Open streams.
    pub streams: u64,
    /// Slots allocated over all streams.
    pub slots_allocated: u64,
    /// Bytes of slot memory reserved over all streams.
    pub slot_bytes_allocated: u64,
    /// Batches handed to consumers.
    pub batches_served: u64,
    /// Samples replaced under the corrupt-block policy.
    pub samples_replaced: u64,
}

/// A slot's lease, for the occupancy gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotLease {
    /// Waiting for the filler.
    Free,
    /// Being filled.
    Filling,
    /// Handed to a consumer.
    Consumer,
}

impl Metrics {
    /// All zero.
    pub fn new() -> Metrics {
        Metrics {
            serving: ServingLedger::default(),
            read_bytes: Default::default(),
            decode_ns: AtomicU64::new(0),
            gather_ns: AtomicU64::new(0),
            read_queue_depth: AtomicU64::new(0),
            corrupt_blocks: AtomicU64::new(0),
            handoff_latency: Histogram::new(&HANDOFF_BUCKETS_US),
            http_responses: Default::default(),
            pack_raw_bytes: AtomicU64::new(0),
            round_buffers_idle_bytes: AtomicU64::new(0),
            shard_slots_idle_bytes: AtomicU64::new(0),
            devices: Default::default(),
            block_cache: BlockCacheCounters::default(),
            object_cache: ObjectCacheCounters::default(),
        }
    }

    /// The object storage cache's counters.
    pub fn object_cache(&self) -> &ObjectCacheCounters {
        &self.object_cache
    }

    /// The CPU backend's decoded-block cache counters.
    pub fn block_cache(&self) -> &BlockCacheCounters {
        &self.block_cache
    }

    fn device(&self, ordinal: u32) -> Option<&DeviceLedger> {
        self.devices.get(ordinal as usize)
    }

    /// Notes that the daemon serves device `ordinal` (its figures are reported from now on).
    pub fn serve_device(&self, ordinal: u32) {
        if let Some(device) = self.device(ordinal) {
            device.served.store(true, Ordering::Relaxed);
        }
    }

    /// A stream opened on device `ordinal`, its pipeline holding `device_bytes` of device memory.
    pub fn device_stream_opened(&self, ordinal: u32, device_bytes: u64) {
        self.device_streams_change(ordinal, 1, device_bytes as i64);
    }

    /// A stream of device `ordinal` whose pipeline held `device_bytes` closed.
    pub fn device_stream_closed(&self, ordinal: u32, device_bytes: u64) {
        self.device_streams_change(ordinal, -1, -(device_bytes as i64));
    }

    fn device_streams_change(&self, ordinal: u32, streams: i64, device_bytes: i64) {
        if let Some(device) = self.device(ordinal) {
            add_signed(&device.streams, streams);
            add_signed(&device.stream_device_bytes, device_bytes);
        }
    }

    /// `batches` batches of `samples` samples in all were delivered on device `ordinal`.
    pub fn device_batches(&self, ordinal: u32, batches: u64, samples: u64) {
        if let Some(device) = self.device(ordinal) {
            device.batches.fetch_add(batches, Ordering::Relaxed);
            device.samples.fetch_add(samples, Ordering::Relaxed);
        }
    }

    /// The figures of every served device, by ordinal.
    pub fn devices(&self) -> Vec<DeviceCounts> {
        self.devices
            .iter()
            .enumerate()
            .filter(|(_, d)| d.served.load(Ordering::Relaxed))
            .map(|(ordinal, d)| DeviceCounts {
                ordinal: ordinal as u32,
                streams: d.streams.load(Ordering::Relaxed),
                stream_device_bytes: d.stream_device_bytes.load(Ordering::Relaxed),
                batches: d.batches.load(Ordering::Relaxed),
                samples: d.samples.load(Ordering::Relaxed),
                read_bytes: d.read_bytes.load(Ordering::Relaxed),
                round_buffers_idle_bytes: d.round_buffers_idle_bytes.load(Ordering::Relaxed),
                shard_slots_idle_bytes: d.shard_slots_idle_bytes.load(Ordering::Relaxed),
                tier: *d.tier.lock().unwrap_or_else(|e| e.into_inner()),
            })
            .collect()
    }

    /// Sets device `ordinal`'s memory tier figures.
    pub fn set_device_tier(&self, ordinal: u32, figures: DeviceTierFigures) {
        if let Some(device) = self.device(ordinal) {
            *device.tier.lock().unwrap_or_else(|e| e.into_inner()) = figures;
        }
    }

    /// Adds to (or, negative, subtracts from) the device bytes of round buffers kept idle for the
    /// next GPU stream on device `ordinal`.
    pub fn add_round_buffers_idle_bytes(&self, ordinal: u32, bytes: i64) {
        add_signed(&self.round_buffers_idle_bytes, bytes);
        if let Some(device) = self.device(ordinal) {
            add_signed(&device.round_buffers_idle_bytes, bytes);
        }
    }

    /// Device bytes of round buffers kept idle for the next GPU stream, over all devices.
    pub fn round_buffers_idle_bytes(&self) -> u64 {
        self.round_buffers_idle_bytes.load(Ordering::Relaxed)
    }

    /// Adds to (or, negative, subtracts from) the device bytes of shard slots and stream buffers
    /// kept idle for the next GPU stream on device `ordinal`.
    pub fn add_shard_slots_idle_bytes(&self, ordinal: u32, bytes: i64) {
        add_signed(&self.shard_slots_idle_bytes, bytes);
        if let Some(device) = self.device(ordinal) {
            add_signed(&device.shard_slots_idle_bytes, bytes);
        }
    }

    /// Device bytes of shard slots and stream buffers kept idle for the next GPU stream, over all
    /// devices.
    pub fn shard_slots_idle_bytes(&self) -> u64 {
        self.shard_slots_idle_bytes.load(Ordering::Relaxed)
    }

    /// Counts bytes read from shard files by `path`.
    pub fn add_read_bytes(&self, path: ReadPath, bytes: u64) {
        self.read_bytes[path as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes read by `path`.
    pub fn read_bytes_of(&self, path: ReadPath) -> u64 {
        self.read_bytes[path as usize].load(Ordering::Relaxed)
    }

    /// Bytes read so far over every path (for read amplification: bytes read per byte stored).
    pub fn read_bytes_total(&self) -> u64 {
        self.read_bytes
            .iter()
            .map(|bytes| bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Seconds spent decoding blocks so far.
    pub fn decode_seconds(&self) -> f64 {
        self.decode_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Adds time spent decoding blocks.
    pub fn add_decode_time(&self, time: Duration) {
        self.decode_ns.fetch_add(nanos(time), Ordering::Relaxed);
    }

    /// Adds time spent gathering and converting samples into slots.
    pub fn add_gather_time(&self, time: Duration) {
        self.gather_ns.fetch_add(nanos(time), Ordering::Relaxed);
    }

    /// Sets the reads in flight over all storage queues.
    pub fn set_read_queue_depth(&self, depth: u64) {
        self.read_queue_depth.store(depth, Ordering::Relaxed);
    }

    /// Counts blocks found corrupt while serving.
    pub fn add_corrupt_blocks(&self, blocks: u64) {
        self.corrupt_blocks.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Admits one more consumer session unless `sessions_max` are open; the session is counted until
    /// [`Metrics::close_session`].
    pub fn open_session(&self, sessions_max: u32) -> bool {
        self.serving
            .sessions
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |open| {
                (open < u64::from(sessions_max)).then_some(open + 1)
            })
            .is_ok()
    }

    /// A session admitted by [`Metrics::open_session`] ended.
    pub fn close_session(&self) {
        self.serving.sessions.fetch_sub(1, Ordering::SeqCst);
    }

    /// Reserves `bytes` of slot memory for a stream being opened unless that would exceed
    /// `slot_bytes_max`; the bytes stay reserved until [`Metrics::unreserve_slot_bytes`] (the stream
    /// could not open) or [`Metrics::stream_closed`].
    pub fn reserve_slot_bytes(&self, bytes: u64, slot_bytes_max: u64) -> bool {
        self.serving
            .slot_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |reserved| {
                reserved
                    .checked_add(bytes)
                    .filter(|&total| total <= slot_bytes_max)
            })
            .is_ok()
    }

    /// Gives back slot memory reserved for a stream that did not open.
    pub fn unreserve_slot_bytes(&self, bytes: u64) {
        self.serving.slot_bytes.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// A stream opened with `slots` slots, all free (its slot bytes are already reserved).
    pub fn stream_opened(&self, slots: u32) {
        let serving = &self.serving;
        serving.streams.fetch_add(1, Ordering::SeqCst);
        serving.slots.fetch_add(u64::from(slots), Ordering::SeqCst);
        serving.slots_by_lease[SlotLease::Free as usize]
            .fetch_add(u64::from(slots), Ordering::Relaxed);
    }

    /// A stream closed: its slots (`by_lease`: how many were free, filling and held by the consumer)
    /// and its `slot_bytes` are freed.
    pub fn stream_closed(&self, by_lease: [u64; 3], slot_bytes: u64) {
        let serving = &self.serving;
        for (gauge, count) in serving.slots_by_lease.iter().zip(by_lease) {
            gauge.fetch_sub(count, Ordering::Relaxed);
        }
        serving
            .slots
            .fetch_sub(by_lease.iter().sum(), Ordering::SeqCst);
        serving.slot_bytes.fetch_sub(slot_bytes, Ordering::SeqCst);
        serving.streams.fetch_sub(1, Ordering::SeqCst);
    }

    /// One slot's lease moved from `from` to `to`.
    pub fn move_slot(&self, from: SlotLease, to: SlotLease) {
        self.move_slots(from, to, 1);
    }

    /// `n` slots moved from lease `from` to lease `to`.
    pub fn move_slots(&self, from: SlotLease, to: SlotLease, n: u64) {
        let gauges = &self.serving.slots_by_lease;
        gauges[from as usize].fetch_sub(n, Ordering::Relaxed);
        gauges[to as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// `batches` batches were handed to their consumer at once, `latency` after their slots were
    /// filled, with `replaced` samples zeroed among them under the corrupt-block policy.
    pub fn batches_served(&self, batches: u64, replaced: u64, latency: Duration) {
        self.handoff_latency.observe_n(latency, batches);
        self.serving.batches.fetch_add(batches, Ordering::SeqCst);
        self.serving.replaced.fetch_add(replaced, Ordering::SeqCst);
    }

    /// The serving ledger now.
    pub fn serving(&self) -> ServingCounts {
        let serving = &self.serving;
        ServingCounts {
            sessions: serving.sessions.load(Ordering::SeqCst),
            streams: serving.streams.load(Ordering::SeqCst),
            slots_allocated: serving.slots.load(Ordering::SeqCst),
            slot_bytes_allocated: serving.slot_bytes.load(Ordering::SeqCst),
            batches_served: serving.batches.load(Ordering::SeqCst),
            samples_replaced: serving.replaced.load(Ordering::SeqCst),
        }
    }

    /// The upper bound, in microseconds, of the bucket holding the `quantile` (0..=1) of the hand-off
    /// latencies observed so far; `None` before any observation or when it lies past the last bound.
    pub fn handoff_quantile_us(&self, quantile: f64) -> Option<u64> {
        self.handoff_latency.quantile_upper_bound_us(quantile)
    }

    /// Counts one HTTP response by status class.
    pub fn count_http_response(&self, status: u16) {
        let class = usize::from((status / 100).clamp(1, 5)) - 1;
        self.http_responses[class].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts raw bytes packed by pack jobs.
    pub fn add_pack_raw_bytes(&self, bytes: u64) {
        self.pack_raw_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

fn nanos(time: Duration) -> u64 {
    u64::try_from(time.as_nanos()).unwrap_or(u64::MAX)
}

/// The values `GET /metrics` reports besides [`Metrics`]: read from the configuration, the session
/// directory, the catalog and the job table when the page is rendered.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Seconds since the daemon started.
    pub uptime_seconds: f64,
    /// Whether a socket server feeds the serving ledger.
    pub socket_server: bool,
    /// Most sessions.
    pub sessions_max: u64,
    /// Most slot bytes.
    pub slot_bytes_max: u64,
    /// Datasets by state name.
    pub datasets: Vec<(&'static str, u64)>,
    /// Job records by state name.
    pub jobs: Vec<(&'static str, u64)>,
}

/// Adds `delta` to a gauge (subtracts, when negative).
fn add_signed(gauge: &AtomicU64, delta: i64) {
    if delta >= 0 {
        gauge.fetch_add(delta as u64, Ordering::Relaxed);
    } else {
        gauge.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
    }
}

/// A per-device series: name, type, help, and its value for one device.
type DeviceFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&DeviceCounts) -> u64,
);

/// Renders the Prometheus text exposition format, version 0.0.4.
pub fn render(metrics: &Metrics, snapshot: &Snapshot) -> String {
    let mut out = String::with_capacity(8192);
    let mut family = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    let one = |value: u64| vec![(String::new(), value.to_string())];
    let load = |atomic: &AtomicU64| atomic.load(Ordering::Relaxed);
    let serving = metrics.serving();
    let counters_note = if snapshot.socket_server {
        ""
    } else {
        " (no socket server connected: 0)"
    };

    family(
        "gpufeed_build_info",
        "gauge",
        "Always 1; the version label names the build",
        &[(
            format!("{{version=\"{}\"}}", env!("CARGO_PKG_VERSION")),
            "1".to_string(),
        )],
    );
    family(
        "gpufeed_uptime_seconds",
        "gauge",
        "Seconds since the daemon started",
        &[(String::new(), format!("{:.3}", snapshot.uptime_seconds))],
    );
    family(
        "gpufeed_sessions",
        "gauge",
        &format!("Open consumer sessions{counters_note}"),
        &one(serving.sessions),
    );
    family(
        "gpufeed_sessions_max",
        "gauge",
        "Most concurrent consumer sessions",
        &one(snapshot.sessions_max),
    );
    family(
        "gpufeed_streams",
        "gauge",
        &format!("Open streams{counters_note}"),
        &one(serving.streams),
    );
    family(
        "gpufeed_slots_allocated",
        "gauge",
        &format!("Batch slots allocated over all streams{counters_note}"),
        &one(serving.slots_allocated),
    );
    family(
        "gpufeed_slot_bytes_allocated",
        "gauge",
        &format!("Bytes of batch slots allocated over all streams{counters_note}"),
        &one(serving.slot_bytes_allocated),
    );
    let devices = metrics.devices();
    let per_device = |value: fn(&DeviceCounts) -> u64| -> Vec<(String, String)> {
        devices
            .iter()
            .map(|d| {
                (
                    format!("{{device=\"cuda:{}\"}}", d.ordinal),
                    value(d).to_string(),
                )
            })
            .collect()
    };
    let device_families: [DeviceFamily; 16] = [
        (
            "gpufeed_device_streams",
            "gauge",
            "Open streams per served CUDA device",
            |d| d.streams,
        ),
        (
            "gpufeed_device_stream_bytes",
            "gauge",
            "Device memory of the open streams' pipelines per served CUDA device, slots excluded",
            |d| d.stream_device_bytes,
        ),
        (
            "gpufeed_device_batches_total",
            "counter",
            "Batches filled and handed on per served CUDA device",
            |d| d.batches,
        ),
        (
            "gpufeed_device_samples_total",
            "counter",
            "Samples in those batches per served CUDA device",
            |d| d.samples,
        ),
        (
            "gpufeed_device_read_bytes_total",
            "counter",
            "Bytes read from shard files by the streams of each served CUDA device",
            |d| d.read_bytes,
        ),
        (
            "gpufeed_device_round_buffers_idle_bytes",
            "gauge",
            "Device bytes of GPU round buffers kept for the next stream, per served CUDA device",
            |d| d.round_buffers_idle_bytes,
        ),
        (
            "gpufeed_device_shard_slots_idle_bytes",
            "gauge",
            "Device bytes of shard slots and stream buffers (block cache, region table) kept for the next stream, per served CUDA device",
            |d| d.shard_slots_idle_bytes,
        ),
        (
            "gpufeed_device_cache_max_bytes",
            "gauge",
            "Budget of the device-memory tier (--device-cache), per served CUDA device",
            |d| d.tier.bytes_max,
        ),
        (
            "gpufeed_device_cache_bytes",
            "gauge",
            "Device bytes the device-memory tier holds, per served CUDA device",
            |d| d.tier.held_bytes,
        ),
        (
            "gpufeed_device_cache_datasets",
            "gauge",
            "Datasets the device-memory tier holds (resident or filling), per served CUDA device",
            |d| d.tier.datasets,
        ),
        (
            "gpufeed_device_cache_hits_total",
            "counter",
            "Streams that found their dataset whole in the device-memory tier, per served CUDA device",
            |d| d.tier.hits,
        ),
        (
            "gpufeed_device_cache_admissions_total",
            "counter",
            "Streams that admitted their dataset to the device-memory tier and filled it, per served CUDA device",
            |d| d.tier.admissions,
        ),
        (
            "gpufeed_device_cache_declined_total",
            "counter",
            "Streams whose dataset fitted the device-memory tier's budget but found no room, per served CUDA device",
            |d| d.tier.declined,
        ),
        (
            "gpufeed_device_cache_evictions_total",
            "counter",
            "Datasets evicted from the device-memory tier, per served CUDA device",
            |d| d.tier.evictions,
        ),
        (
            "gpufeed_device_decoded_copies_bytes",
            "gauge",
            "Device bytes of compressed datasets decoded whole for the streams reading them (outside the device-memory tier), per served CUDA device",
            |d| d.tier.decoded_device_bytes,
        ),
        (
            "gpufeed_device_decoded_host_copies_bytes",
            "gauge",
            "Page-locked host bytes of compressed datasets decoded whole for the streams of a served CUDA device (--host-decoded-memory), per device",
            |d| d.tier.decoded_host_bytes,
        ),
    ];
    for (name, kind, help, value) in device_families {
        family(name, kind, help, &per_device(value));
    }
    family(
        "gpufeed_round_buffers_idle_bytes",
        "gauge",
        "Device bytes of GPU round buffers (staging and tables) kept for the next stream",
        &one(metrics.round_buffers_idle_bytes()),
    );
    family(
        "gpufeed_shard_slots_idle_bytes",
        "gauge",
        "Device bytes of shard slots (shards copied ahead) and stream buffers (block cache, region table) kept for the next stream",
        &one(metrics.shard_slots_idle_bytes()),
    );
    let cache = metrics.block_cache().snapshot();
    let cache_families: [(&str, &str, &str, u64); 12] = [
        (
            "gpufeed_block_cache_held_bytes",
            "gauge",
            "Bytes of decoded blocks alive on the CPU backend: kept in the shared cache or used by a stream",
            cache.held_bytes,
        ),
        (
            "gpufeed_block_cache_kept_bytes",
            "gauge",
            "Bytes of decoded blocks kept in the CPU backend's shared cache",
            cache.kept_bytes,
        ),
        (
            "gpufeed_host_stream_memory_budget_bytes",
            "gauge",
            "Host memory for streams: slots, working sets and the decoded-block cache",
            snapshot.slot_bytes_max,
        ),
        (
            "gpufeed_block_cache_hits_total",
            "counter",
            "Decoded-block cache look-ups that found their block",
            cache.hits,
        ),
        (
            "gpufeed_block_cache_misses_total",
            "counter",
            "Decoded-block cache look-ups that did not",
            cache.misses,
        ),
        (
            "gpufeed_block_cache_evictions_total",
            "counter",
            "Decoded blocks evicted from the cache to make room",
            cache.evictions,
        ),
        (
            "gpufeed_block_cache_refused_total",
            "counter",
            "Decoded blocks not kept because every kept block was in use",
            cache.refused,
        ),
        (
            "gpufeed_host_decoded_bytes_total",
            "counter",
            "Bytes the CPU backend decoded; over gpufeed_host_needed_raw_bytes_total, its decode amplification",
            cache.decoded_bytes,
        ),
        (
            "gpufeed_host_needed_raw_bytes_total",
            "counter",
            "Raw bytes of the samples the CPU backend delivered (before conversion)",
            cache.needed_raw_bytes,
        ),
        (
            "gpufeed_host_needed_stored_bytes_total",
            "counter",
            "Those samples' share of their blocks' stored bytes; bytes read over it is the read amplification",
            cache.needed_stored_bytes,
        ),
        (
            "gpufeed_host_lookahead_rows_kept_total",
            "counter",
            "Rows the CPU backend copied out of a decoded block ahead of their batch",
            cache.lookahead_rows_kept,
        ),
        (
            "gpufeed_host_lookahead_rows_served_total",
            "counter",
            "Rows the CPU backend served from its look-ahead instead of their block",
            cache.lookahead_rows_served,
        ),
    ];
    for (name, kind, help, value) in cache_families {
        family(name, kind, help, &one(value));
    }
    let object = metrics.object_cache().snapshot();
    let object_families: [(&str, &str, &str, u64); 8] = [
        (
            "gpufeed_object_cache_bytes",
            "gauge",
            "Bytes of shard files fetched from object storage kept in the node-local cache, or being fetched",
            object.bytes,
        ),
        (
            "gpufeed_object_cache_budget_bytes",
            "gauge",
            "The object cache's byte budget (--object-cache-max; 0 until the cache opens)",
            object.budget_bytes,
        ),
        (
            "gpufeed_object_cache_hits_total",
            "counter",
            "Shards a stream found in the object cache",
            object.hits,
        ),
        (
            "gpufeed_object_cache_misses_total",
            "counter",
            "Shards a stream had fetched from object storage",
            object.misses,
        ),
        (
            "gpufeed_object_cache_evictions_total",
            "counter",
            "Shard files evicted from the object cache to make room",
            object.evictions,
        ),
        (
            "gpufeed_object_fetch_errors_total",
            "counter",
            "Requests to object storage that failed, each try counted",
            object.fetch_errors,
        ),
        (
            "gpufeed_object_fetched_bytes_total",
            "counter",
            "Bytes of shard files fetched from object storage and installed in the cache",
            object.fetched_bytes,
        ),
        (
            "gpufeed_object_corrupt_fetches_total",
            "counter",
            "Shards fetched from object storage that did not match their checksums",
            object.corrupt_fetches,
        ),
    ];
    for (name, kind, help, value) in object_families {
        family(name, kind, help, &one(value));
    }
    family(
        "gpufeed_slot_bytes_max",
        "gauge",
        "Most bytes of batch slots over all streams",
        &one(snapshot.slot_bytes_max),
    );
    family(
        "gpufeed_slots",
        "gauge",
        "Batch slots by lease (free, filling, consumer)",
        &[SlotLease::Free, SlotLease::Filling, SlotLease::Consumer]
            .iter()
            .map(|&lease| {
                let name = match lease {
                    SlotLease::Free => "free",
                    SlotLease::Filling => "filling",
                    SlotLease::Consumer => "consumer",
                };
                (
                    format!("{{lease=\"{name}\"}}"),
                    load(&metrics.serving.slots_by_lease[lease as usize]).to_string(),
                )
            })
            .collect::<Vec<_>>(),
    );
    family(
        "gpufeed_batches_served_total",
        "counter",
        &format!("Batches handed to consumers{counters_note}"),
        &one(serving.batches_served),
    );
    family(
        "gpufeed_samples_replaced_total",
        "counter",
        &format!("Samples replaced because their block was corrupt{counters_note}"),
        &one(serving.samples_replaced),
    );
    family(
        "gpufeed_corrupt_blocks_total",
        "counter",
        "Blocks found corrupt while serving",
        &one(load(&metrics.corrupt_blocks)),
    );
    family(
        "gpufeed_read_bytes_total",
        "counter",
        "Bytes read from shard files, by storage path",
        &ReadPath::ALL
            .iter()
            .map(|&path| {
                (
                    format!("{{engine=\"{}\"}}", path.label()),
                    load(&metrics.read_bytes[path as usize]).to_string(),
                )
            })
            .collect::<Vec<_>>(),
    );
    family(
        "gpufeed_read_queue_depth",
        "gauge",
        "Queue depth of the serving read engines (most reads in flight per stream)",
        &one(load(&metrics.read_queue_depth)),
    );
    family(
        "gpufeed_decode_seconds_total",
        "counter",
        "Time spent decoding blocks",
        &[(String::new(), seconds(load(&metrics.decode_ns)))],
    );
    family(
        "gpufeed_gather_seconds_total",
        "counter",
        "Time spent gathering samples into slots",
        &[(String::new(), seconds(load(&metrics.gather_ns)))],
    );
    let histogram = &metrics.handoff_latency;
    let mut cumulative = 0u64;
    let mut samples = Vec::with_capacity(histogram.buckets.len() + 2);
    for (index, bucket) in histogram.buckets.iter().enumerate() {
        cumulative += load(bucket);
        let bound = match histogram.bounds_us.get(index) {
            Some(&us) => format!("{}", us as f64 / 1e6),
            None => "+Inf".to_string(),
        };
        samples.push((format!("_bucket{{le=\"{bound}\"}}"), cumulative.to_string()));
    }
    samples.push((
        "_sum".to_string(),
        format!("{}", load(&histogram.sum_us) as f64 / 1e6),
    ));
    samples.push(("_count".to_string(), load(&histogram.count).to_string()));
    family(
        "gpufeed_handoff_latency_seconds",
        "histogram",
        "Time from a filled slot to the consumer being told about it",
        &samples,
    );
    family(
        "gpufeed_datasets",
        "gauge",
        "Datasets in the catalog, by state",
        &snapshot
            .datasets
            .iter()
            .map(|(state, n)| (format!("{{state=\"{state}\"}}"), n.to_string()))
            .collect::<Vec<_>>(),
    );
    family(
        "gpufeed_jobs",
        "gauge",
        "Pack job records, by state",
        &snapshot
            .jobs
            .iter()
            .map(|(state, n)| (format!("{{state=\"{state}\"}}"), n.to_string()))
            .collect::<Vec<_>>(),
    );
    family(
        "gpufeed_pack_raw_bytes_total",
        "counter",
        "Raw bytes packed by pack jobs",
        &one(load(&metrics.pack_raw_bytes)),
    );
    family(
        "gpufeed_http_responses_total",
        "counter",
        "Control API responses, by status class",
        &["1xx", "2xx", "3xx", "4xx", "5xx"]
            .iter()
            .enumerate()
            .map(|(i, class)| {
                (
                    format!("{{class=\"{class}\"}}"),
                    load(&metrics.http_responses[i]).to_string(),
                )
            })
            .collect::<Vec<_>>(),
    );
    out
}

fn seconds(ns: u64) -> String {
    format!("{}", ns as f64 / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn histogram_buckets_are_cumulative_in_the_rendering() {
        let metrics = Metrics::new();
        for latency_us in [5, 10, 30, 5_000_000] {
            metrics.batches_served(1, 0, Duration::from_micros(latency_us));
        }
        let text = render(&metrics, &Snapshot::default());
        assert!(text.contains("gpufeed_handoff_latency_seconds_bucket{le=\"0.00001\"} 2\n"));
        assert!(text.contains("gpufeed_handoff_latency_seconds_bucket{le=\"0.00005\"} 3\n"));
        assert!(text.contains("gpufeed_handoff_latency_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(text.contains("gpufeed_handoff_latency_seconds_count 4\n"));
    }

    #[test]
    fn the_serving_ledger_returns_to_zero_when_sessions_and_streams_end() {
        let metrics = Metrics::new();
        assert!(metrics.open_session(2));
        assert!(metrics.open_session(2));
        assert!(!metrics.open_session(2), "a third session is refused");
        assert!(metrics.reserve_slot_bytes(600, 1000));
        assert!(
            !metrics.reserve_slot_bytes(600, 1000),
            "over the slot memory bound"
        );
        assert!(metrics.reserve_slot_bytes(400, 1000));
        metrics.unreserve_slot_bytes(400);
        metrics.stream_opened(3);
        metrics.move_slot(SlotLease::Free, SlotLease::Filling);
        metrics.move_slot(SlotLease::Filling, SlotLease::Consumer);
        metrics.batches_served(1, 2, Duration::from_micros(40));
        assert_eq!(
            metrics.serving(),
            ServingCounts {
                sessions: 2,
                streams: 1,
                slots_allocated: 3,
                slot_bytes_allocated: 600,
                batches_served: 1,
                samples_replaced: 2,
            }
        );
        metrics.stream_closed([2, 0, 1], 600);
        metrics.close_session();
        metrics.close_session();
        assert_eq!(
            metrics.serving(),
            ServingCounts {
                batches_served: 1,
                samples_replaced: 2,
                ..ServingCounts::default()
            }
        );
        let text = render(&metrics, &Snapshot::default());
        for lease in ["free", "filling", "consumer"] {
            assert!(text.contains(&format!("gpufeed_slots{{lease=\"{lease}\"}} 0\n")));
        }
    }

    #[test]
    fn per_device_figures_cover_served_devices_and_return_to_zero() {
        let metrics = Arc::new(Metrics::new());
        // Nothing served: no per-device samples, and out-of-range ordinals are ignored.
        metrics.device_stream_opened(DEVICES_MAX as u32, 1);
        assert!(metrics.devices().is_empty());
        metrics.serve_device(0);
        metrics.serve_device(3);
        metrics.device_stream_opened(3, 1 << 20);
        metrics.device_batches(3, 1, 96);
        metrics.device_batches(3, 1, 4);
        metrics.add_round_buffers_idle_bytes(3, 4096);
        metrics.add_shard_slots_idle_bytes(3, 1 << 29);
        let view = DeviceMetrics::new(Arc::clone(&metrics), 3);
        view.add_read_bytes(ReadPath::PageCache, 2048);
        assert_eq!(metrics.read_bytes_total(), 2048, "counted for the node too");
        let text = render(&metrics, &Snapshot::default());
        assert!(
            text.contains("gpufeed_device_streams{device=\"cuda:3\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("gpufeed_device_streams{device=\"cuda:0\"} 0\n"));
        assert!(text.contains("gpufeed_device_samples_total{device=\"cuda:3\"} 100\n"));
        assert!(text.contains("gpufeed_device_read_bytes_total{device=\"cuda:3\"} 2048\n"));
        assert!(text.contains("gpufeed_device_round_buffers_idle_bytes{device=\"cuda:3\"} 4096\n"));
        assert!(text.contains("gpufeed_round_buffers_idle_bytes 4096\n"));
        assert!(
            text.contains("gpufeed_device_shard_slots_idle_bytes{device=\"cuda:3\"} 536870912\n")
        );
        assert!(text.contains("gpufeed_shard_slots_idle_bytes 536870912\n"));
        metrics.device_stream_closed(3, 1 << 20);
        metrics.add_round_buffers_idle_bytes(3, -4096);
        metrics.add_shard_slots_idle_bytes(3, -(1 << 29));
        let tier = DeviceTierFigures {
            bytes_max: 8 << 30,
            held_bytes: 1 << 30,
            datasets: 1,
            hits: 2,
            admissions: 1,
            declined: 0,
            evictions: 0,
            decoded_device_bytes: 0,
            decoded_host_bytes: 4 << 30,
        };
        metrics.set_device_tier(3, tier);
        let text = render(&metrics, &Snapshot::default());
        assert!(text
            .contains("gpufeed_device_decoded_host_copies_bytes{device=\"cuda:3\"} 4294967296\n"));
        assert!(text.contains("gpufeed_device_decoded_copies_bytes{device=\"cuda:3\"} 0\n"));
        assert!(text.contains("gpufeed_device_cache_bytes{device=\"cuda:3\"} 1073741824\n"));
        assert!(text.contains("gpufeed_device_cache_hits_total{device=\"cuda:3\"} 2\n"));
        let devices = metrics.devices();
        assert_eq!(devices.len(), 2);
        assert_eq!(
            devices[1],
            DeviceCounts {
                ordinal: 3,
                streams: 0,
                stream_device_bytes: 0,
                batches: 2,
                samples: 100,
                read_bytes: 2048,
                round_buffers_idle_bytes: 0,
                shard_slots_idle_bytes: 0,
                tier,
            }
        );
    }

    #[test]
    fn every_family_has_help_and_type() {
        let metrics = Metrics::new();
        metrics.add_read_bytes(ReadPath::Pread, 4096);
        metrics.stream_opened(3);
        metrics.move_slot(SlotLease::Free, SlotLease::Filling);
        metrics.move_slot(SlotLease::Filling, SlotLease::Consumer);
        let text = render(&metrics, &Snapshot::default());
        assert!(text.contains("gpufeed_read_bytes_total{engine=\"pread\"} 4096\n"));
        assert!(text.contains("gpufeed_slots{lease=\"consumer\"} 1\n"));
        assert!(text.contains("gpufeed_slots{lease=\"free\"} 2\n"));
        assert!(text.contains("gpufeed_slots_allocated 3\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{line} has no TYPE"
            );
        }
    }
}
