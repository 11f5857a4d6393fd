//! `/v1/status`, `/metrics` and `/healthz`.
//!
//! The status reports what this machine offers (devices, and each read path with the reason it is
//! or is not usable; [`Platform`]) separately from what this daemon serves with, because the two may
//! differ: a machine with GPUs and GDS may still serve from host memory (`--device cpu`, or `auto`
//! where CUDA cannot be used), and the payload says so rather than implying otherwise.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::datasets::dataset_view;
use super::datasets::DatasetStateName;
use super::error::blocking;
use super::error::ErrorBody;
pub use super::platform::{
    probe_mps, probe_platform, Availability, DeviceView, EngineView, MpsView, Platform,
};
use super::state::Control;
use crate::catalog::JobState;
use crate::config::InterruptCpus;
use crate::metrics::{self, Snapshot};

/// What the daemon serves with.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct Serving {
    /// `cpu`: batches live in host memory shared through memfd; `cuda:N`: streams asking for device
    /// N get exportable device memory (host-memory streams are served as well).
    pub backend: String,
    /// The configured `--device`.
    pub device: String,
    /// The configured `--engine`.
    pub engine: String,
    /// Why the backend is what it is.
    pub note: String,
    /// Most bytes of page cache kept registered (locked) for device reads; 0: the page-cache path
    /// is off. Data beyond it streams through registration ahead of the reads, or the cold path.
    pub registered_memory_max: u64,
    /// `configured` (flag, variable or file) or `derived` (half the RAM within RLIMIT_MEMLOCK).
    pub registered_memory_source: String,
    /// Size of one registered window.
    pub registered_window_bytes: u64,
    /// When GPUs read rows of raw blocks in place from registered page cache: `auto`, `always`,
    /// `off`.
    pub zero_copy: String,
    /// Device memory each GPU stream in dataset order or a window shuffle may fill with shards
    /// copied ahead of need (`--device-shard-memory`); 0: none.
    pub device_shard_memory: u64,
    /// Device memory each served GPU keeps for whole datasets (`--device-cache`); 0: off.
    pub device_cache: u64,
    /// Host memory, for all served GPUs together, for datasets with compressed blocks decoded whole
    /// when device memory does not take them (`--host-decoded-memory`); 0: none.
    #[serde(default)]
    pub host_decoded_memory: u64,
    /// Threads per GPU stream copying shards through pinned buffers beyond the registration budget
    /// (`--loader-copy-threads`; 0: windows registered for their copy).
    pub loader_copy_threads: u32,
    /// Rounds a GPU stream queues on the device at once (`--rounds-in-flight`).
    pub rounds_in_flight: u32,
    /// Microseconds a GPU stream's filler polls a round before it sleeps (`--filler-spin-us`).
    pub filler_spin_us: u64,
    /// Largest output of a gather piece of consecutive rows, in KiB (`--gather-piece-kib`).
    pub gather_piece_kib: u64,
    /// Gather launches a round read in place may take with its piece table in the launch
    /// parameters (`--inline-gather-tables`; 0: never).
    pub inline_gather_tables: u32,
    /// Most consecutive small batches one round gathers (`--batch-group-max`).
    pub batch_group_max: u32,
    /// Planning threads per GPU stream (`--plan-threads`; 0: 12 or the CPU count, the fewer).
    pub plan_threads: u32,
    /// Seconds idle device memory is kept between streams (`--device-pool-idle-s`).
    pub device_pool_idle_s: u64,
    /// Whether GPU streams' threads keep off their device's interrupt CPUs (`--avoid-irq-cpus`).
    pub avoid_irq_cpus: bool,
    /// The compiled-kernel cache (`--cache-dir`); `null`: none, kernels are compiled at start.
    pub kernel_cache_dir: Option<String>,
}

/// The settings of the socket server, the control API and pack jobs that `serving` and `pools` do
/// not show (the token never is).
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct ControlSettings {
    /// The consumers' Unix socket (`--socket`).
    pub socket: String,
    /// Uids allowed on the socket (`--allow-uid`).
    pub allowed_uids: Vec<u32>,
    /// Whether a token guards the API (`--api-token`; the token itself is not shown).
    pub api_token_set: bool,
    /// Largest request body (`--body-limit`).
    pub body_limit_bytes: u64,
    /// Most control API connections served at once, as configured (`--http-connections-max`; the
    /// daemon serves at most a quarter of its open descriptor limit).
    pub http_connections_max: u64,
    /// Seconds a connection may take to send a request's headers or body, or stay idle
    /// (`--http-idle-timeout`).
    pub http_idle_timeout_s: u64,
    /// Most job records kept (`--job-records-max`).
    pub job_records_max: u64,
    /// Threads compressing blocks in each pack job (`--pack-threads`).
    pub pack_threads: u64,
    /// Most raw bytes per second each pack job packs (`--pack-rate-max`); `null`: unlimited.
    pub pack_rate_max: Option<u64>,
}

/// One CUDA device the daemon serves: what its streams hold and have done.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DeviceServing {
    /// `cuda:N`: the daemon's ordinal (a consumer's own `cuda:N` may be another GPU).
    pub device: String,
    /// The GPU's UUID (`GPU-…`, as `nvidia-smi -L` shows it): consumers are served on the GPU whose
    /// UUID matches their device's; `null` when the driver could not say.
    pub uuid: Option<String>,
    /// The GPU's PCI bus id (`dddd:bb:dd.0`); empty when unknown.
    pub pci_bus_id: String,
    /// Streams open on it.
    pub streams: u64,
    /// Device memory of those streams' pipelines (staging, block cache, tables, shards copied
    /// ahead), their batch slots excluded.
    pub stream_device_bytes: u64,
    /// Device memory of round buffers kept for its next stream.
    pub round_buffers_idle_bytes: u64,
    /// Device memory of shard slots (shards copied ahead) and of closed streams' block caches and
    /// region tables, kept for its next stream; freed after 30 s idle.
    pub shard_slots_idle_bytes: u64,
    /// Batches its streams filled and handed on since the daemon started.
    pub batches: u64,
    /// Samples in those batches.
    pub samples: u64,
    /// Bytes its streams read from shard files.
    pub read_bytes: u64,
    /// Its memory tier (`--device-cache`); `null` where the daemon attached none.
    pub device_cache: Option<super::device_cache::DeviceCacheView>,
}

/// Bounded pools and what is in use.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct Pools {
    /// Whether a socket server is attached and feeds the counts (when false, the in-use values are 0).
    pub socket_server: bool,
    /// Open consumer sessions.
    pub sessions: u64,
    /// Most consumer sessions.
    pub sessions_max: u64,
    /// Open streams.
    pub streams: u64,
    /// Slots allocated.
    pub slots_allocated: u64,
    /// Bytes of slots allocated.
    pub slot_bytes_allocated: u64,
    /// Most bytes of slots.
    pub slot_bytes_max: u64,
    /// Pack jobs running.
    pub jobs_running: u64,
    /// Most pack jobs running.
    pub jobs_running_max: u64,
    /// Pack jobs queued or running.
    pub jobs_active: u64,
    /// Most pack jobs queued or running.
    pub jobs_active_max: u64,
}

/// Host memory the daemon holds for streams, within one budget (`--slot-memory-max`): batch slots
/// and each host stream's working set first, the CPU backend's shared decoded-block cache in what
/// they leave.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct HostMemory {
    /// The memory the daemon takes it may use, bytes: the host's RAM, or its memory cgroup's limit
    /// where lower, or `GPUFEED_MEMORY_LIMIT`; it bounds the default budgets, and a shuffle that
    /// draws rows from more than it keeps cached reads them from the disk. Null where unknown.
    pub memory_limit_bytes: Option<u64>,
    /// Where that limit came from: `ram`, `cgroup` or `GPUFEED_MEMORY_LIMIT`.
    pub memory_limit_source: Option<String>,
    /// The budget, bytes.
    pub budget_bytes: u64,
    /// Bytes reserved by open streams: slots, and host streams' working sets.
    pub reserved_bytes: u64,
    /// Bytes of decoded blocks alive: kept in the cache, or used by a stream beyond it.
    pub block_cache_held_bytes: u64,
    /// Bytes of decoded blocks kept in the cache (at most the budget less the reserved bytes).
    pub block_cache_kept_bytes: u64,
    /// Look-ups of the cache that found their block.
    pub block_cache_hits: u64,
    /// Look-ups that did not (the block was read and decoded).
    pub block_cache_misses: u64,
    /// Blocks evicted to make room.
    pub block_cache_evictions: u64,
}

/// The node-local cache of shard files fetched from object storage (`--object-cache-dir`,
/// `--object-cache-max`); all zero until a dataset in object storage is registered.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct ObjectCacheView {
    /// Bytes of shard files kept, or being fetched.
    pub bytes: u64,
    /// The budget, bytes.
    pub budget_bytes: u64,
    /// Shards a stream found in the cache.
    pub hits: u64,
    /// Shards a stream had fetched.
    pub misses: u64,
    /// Shard files evicted to make room.
    pub evictions: u64,
    /// Requests to the store that failed, each try counted.
    pub fetch_errors: u64,
    /// Bytes of shard files fetched and installed.
    pub fetched_bytes: u64,
    /// Fetched shards that did not match their checksums.
    pub corrupt_fetches: u64,
}

/// `GET /v1/status`.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct StatusView {
    /// The daemon's version.
    pub version: String,
    /// Seconds since the daemon started.
    pub uptime_seconds: f64,
    /// The canonical data root.
    pub data_root: String,
    /// What the daemon serves with.
    pub serving: Serving,
    /// The other settings.
    pub control: ControlSettings,
    /// What the machine offers.
    pub platform: Platform,
    /// Whether the daemon runs under CUDA MPS (read for each request: a control daemon may start
    /// or stop while the daemon runs).
    pub mps: MpsView,
    /// Pools and their use.
    pub pools: Pools,
    /// Host memory held for streams, within one budget: slots, and the CPU backend's shared
    /// decoded-block cache.
    pub host_memory: HostMemory,
    /// The cache of shards fetched from object storage.
    pub object_cache: ObjectCacheView,
    /// Per CUDA device served (empty on the CPU backend).
    pub devices: Vec<DeviceServing>,
    /// Datasets in the catalog.
    pub datasets: u64,
    /// Datasets in the catalog that are not served (missing or invalid).
    pub datasets_unavailable: u64,
}

/// `GET /healthz`.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
}

/// The host memory held for streams (`budget` and the bytes open streams `reserved`), with the
/// memory the daemon may use and where that figure came from.
fn host_memory(control: &Control, budget: u64, reserved: u64) -> HostMemory {
    let cache = control.metrics.block_cache().snapshot();
    let limit = crate::storage::memory::memory_limit();
    HostMemory {
        memory_limit_bytes: limit.map(|(bytes, _)| bytes),
        memory_limit_source: limit.map(|(_, source)| source.name().to_string()),
        budget_bytes: budget,
        reserved_bytes: reserved,
        block_cache_held_bytes: cache.held_bytes,
        block_cache_kept_bytes: cache.kept_bytes,
        block_cache_hits: cache.hits,
        block_cache_misses: cache.misses,
        block_cache_evictions: cache.evictions,
    }
}

/// The daemon's devices, read paths, pools, version and uptime.
#[utoipa::path(
    get, path = "/v1/status", tag = "daemon", operation_id = "get_status",
    responses(
        (status = 200, description = "The status", body = StatusView),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn status(State(control): State<Arc<Control>>) -> Json<StatusView> {
    let platform = control
        .platform
        .get_or_init(|| async {
            blocking(probe_platform)
                .await
                .unwrap_or_else(|error| Platform {
                    cuda: Availability {
                        available: false,
                        reason: format!("the probe failed: {}", error.message),
                    },
                    devices: Vec::new(),
                    engines: Vec::new(),
                })
        })
        .await
        .clone();
    let snapshot = snapshot(&control);
    let counts = control.metrics.serving();
    let limits = control.jobs.limits();
    let options = &control.options;
    let gpu = &options.gpu;
    let tiers = super::device_cache::views(&control);
    let devices: Vec<DeviceServing> = control
        .metrics
        .devices()
        .into_iter()
        .map(|d| {
            let device = format!("cuda:{}", d.ordinal);
            // The probe opened the same ordinals in this process: its view names the device.
            let probed = platform.devices.iter().find(|p| p.device == device);
            let device_cache = tiers.iter().find(|t| t.device == device).cloned();
            DeviceServing {
                uuid: probed.and_then(|p| p.uuid.clone()),
                pci_bus_id: probed.map(|p| p.pci_address.clone()).unwrap_or_default(),
                device,
                streams: d.streams,
                stream_device_bytes: d.stream_device_bytes,
                round_buffers_idle_bytes: d.round_buffers_idle_bytes,
                shard_slots_idle_bytes: d.shard_slots_idle_bytes,
                batches: d.batches,
                samples: d.samples,
                read_bytes: d.read_bytes,
                device_cache,
            }
        })
        .collect();
    Json(StatusView {
        version: env!("CARGO_PKG_VERSION").to_string(),
        uptime_seconds: snapshot.uptime_seconds,
        data_root: control.data_root().display().to_string(),
        serving: {
            let (backend, note) = control.backend().cloned().unwrap_or_else(|| {
                (
                    "cpu".to_string(),
                    "no socket server is attached: nothing is served".to_string(),
                )
            });
            Serving {
                backend,
                device: options.device.clone(),
                engine: options.engine.to_string(),
                note,
                registered_memory_max: gpu.registered.bytes_max,
                registered_memory_source: gpu.registered.source.name().to_string(),
                registered_window_bytes: gpu.registered.window_bytes,
                zero_copy: gpu.zero_copy.name().to_string(),
                device_shard_memory: gpu.device_shard_bytes,
                device_cache: gpu.device_cache_bytes,
                host_decoded_memory: gpu.host_decoded_bytes,
                loader_copy_threads: gpu.loader_copy_threads as u32,
                rounds_in_flight: gpu.rounds_in_flight as u32,
                filler_spin_us: gpu.filler_spin.as_micros() as u64,
                gather_piece_kib: gpu.gather_piece_bytes >> 10,
                inline_gather_tables: gpu.inline_gather_tables as u32,
                batch_group_max: gpu.batch_group_max as u32,
                plan_threads: gpu.plan_threads as u32,
                device_pool_idle_s: gpu.device_pool_idle_release.as_secs(),
                avoid_irq_cpus: gpu.interrupt_cpus == InterruptCpus::Avoid,
                kernel_cache_dir: gpu
                    .kernel_cache_dir
                    .as_ref()
                    .map(|dir| dir.display().to_string()),
            }
        },
        control: ControlSettings {
            socket: options.socket_path.display().to_string(),
            allowed_uids: options.allowed_uids.clone(),
            api_token_set: options.auth.token.is_some(),
            body_limit_bytes: options.body_bytes_max as u64,
            http_connections_max: options.http_connections.connections_max as u64,
            http_idle_timeout_s: options.http_connections.idle_timeout.as_secs(),
            job_records_max: u64::from(limits.records_max),
            pack_threads: options.pack_threads as u64,
            pack_rate_max: options.pack_bytes_per_s_max,
        },
        mps: probe_mps(
            std::env::var_os("CUDA_MPS_PIPE_DIRECTORY"),
            &platform.devices,
        ),
        platform,
        pools: Pools {
            socket_server: snapshot.socket_server,
            sessions: counts.sessions,
            sessions_max: snapshot.sessions_max,
            streams: counts.streams,
            slots_allocated: counts.slots_allocated,
            slot_bytes_allocated: counts.slot_bytes_allocated,
            slot_bytes_max: snapshot.slot_bytes_max,
            jobs_running: u64::from(control.jobs.running_count()),
            jobs_running_max: u64::from(limits.running_max),
            jobs_active: u64::from(control.jobs.active_count()),
            jobs_active_max: u64::from(limits.running_max + limits.queued_max),
        },
        host_memory: host_memory(
            &control,
            snapshot.slot_bytes_max,
            counts.slot_bytes_allocated,
        ),
        object_cache: {
            let object = control.metrics.object_cache().snapshot();
            ObjectCacheView {
                bytes: object.bytes,
                budget_bytes: object.budget_bytes,
                hits: object.hits,
                misses: object.misses,
                evictions: object.evictions,
                fetch_errors: object.fetch_errors,
                fetched_bytes: object.fetched_bytes,
                corrupt_fetches: object.corrupt_fetches,
            }
        },
        devices,
        datasets: snapshot.datasets.iter().map(|(_, n)| n).sum(),
        datasets_unavailable: snapshot
            .datasets
            .iter()
            .filter(|(state, _)| *state != "ready")
            .map(|(_, n)| n)
            .sum(),
    })
}

fn snapshot(control: &Control) -> Snapshot {
    let records = control.catalog.snapshot();
    let mut ready = 0;
    let mut missing = 0;
    let mut invalid = 0;
    for (name, record) in &records.datasets {
        match dataset_view(control, name, record).state {
            DatasetStateName::Ready => ready += 1,
            DatasetStateName::Missing => missing += 1,
            DatasetStateName::Invalid | DatasetStateName::Unreadable => invalid += 1,
        }
    }
    let jobs = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ]
    .iter()
    .map(|&state| {
        (
            state.name(),
            records.jobs.values().filter(|j| j.state == state).count() as u64,
        )
    })
    .collect();
    Snapshot {
        uptime_seconds: control.started.elapsed().as_secs_f64(),
        socket_server: control.registry.sessions().is_attached(),
        sessions_max: u64::from(control.options.sessions_max),
        slot_bytes_max: control.options.slot_memory_bytes_max,
        datasets: vec![("ready", ready), ("missing", missing), ("invalid", invalid)],
        jobs,
    }
}

/// The daemon's measurements in the Prometheus text format (version 0.0.4).
#[utoipa::path(
    get, path = "/metrics", tag = "daemon", operation_id = "get_metrics",
    responses(
        (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn metrics(State(control): State<Arc<Control>>) -> impl IntoResponse {
    let text = metrics::render(&control.metrics, &snapshot(&control));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
}

/// Answers while the daemon serves.
#[utoipa::path(
    get, path = "/healthz", tag = "daemon", operation_id = "get_health",
    responses(
        (status = 200, description = "Serving", body = Health),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".to_string(),
    })
}
