//! The daemon: composes the catalog and registry, the socket server and the HTTP control API that
//! `gpufeed serve` runs.
//!
//! The socket server is blocking (one thread per session) and runs on a thread of its own; the
//! control API runs on a small tokio runtime on the main thread, which also waits for SIGTERM and
//! SIGINT. On either signal the daemon shuts down cleanly: the API stops accepting connections and
//! finishes the requests in flight, running pack jobs are stopped (their staging directories
//! removed, their end recorded), the sessions the socket server lists are closed, the catalog is
//! written once more, the socket file is removed, and the process exits 0.

use std::fmt;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::api::{self, ApiOptions, Control, Metrics, StartupError};
use crate::config::{GpuSettings, HttpListen, RegistrationBudget, Settings, ZeroCopyMode};
use crate::device::probe::portable_registration_works;
use crate::device::{CacheDir, Device, DeviceError};
use crate::ipc::{Server, ServerConfig};
use crate::kernels::Kernels;
use crate::notify::{next_watchdog_tick, ServiceNotifier};
use crate::pipeline::gpu::{
    DeviceTier, RoundBufferPool, ShardSlotPool, ZeroCopy, ROUNDS_IN_FLIGHT_MAX,
};
use crate::pipeline::{GpuBackend, GpuStreamLimits, StreamLimits};
use crate::registry::Registry;
use crate::storage::gpu::{GpuReaderLimits, PathChoice};
use crate::storage::windows::PageCacheWindows;
use crate::storage::EngineMode;

/// Longest the API waits for requests in flight once shutdown begins.
const HTTP_DRAIN: Duration = Duration::from_secs(10);
/// Longest shutdown waits for pack jobs to stop (each stops at its next step, within a second or so).
const JOBS_DRAIN: Duration = Duration::from_secs(30);

/// Why the daemon could not start, or stopped other than on a signal. Each names what it was doing;
/// the cause, where there is one, is its source.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// `--device` is not `auto`, `cpu` or `cuda:N`.
    #[error("--device {given}: {expected}")]
    DeviceFlag {
        /// What was given.
        given: String,
        /// What is expected.
        expected: String,
    },
    /// The device asked for cannot serve.
    #[error("--device {request}")]
    Gpu {
        /// The request.
        request: DeviceRequest,
        /// Why.
        source: DeviceError,
    },
    /// A dataset in object storage given with `--dataset` could not be registered.
    #[error("--dataset {name}: {reason}")]
    ObjectDataset {
        /// Its name.
        name: String,
        /// Why (naming the URL).
        reason: String,
    },
    /// `--engine cufile` on the CPU backend.
    #[error(
        "--engine cufile: the cuFile engine serves only the GPU backend, and this daemon runs the \
         CPU backend"
    )]
    CuFileWithoutGpu,
    /// The control API's runtime, a signal handler or a thread could not be started.
    #[error("{what}")]
    Start {
        /// What was being started.
        what: &'static str,
        /// Why it failed.
        source: io::Error,
    },
    /// The catalog's opening task failed.
    #[error("opening the catalog")]
    CatalogTask(#[source] tokio::task::JoinError),
    /// The data root or its catalog could not be opened.
    #[error("opening the data root {path}")]
    DataRoot {
        /// The data root.
        path: PathBuf,
        /// Why.
        source: StartupError,
    },
    /// The socket could not be bound.
    #[error("binding {path}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The control API's address could not be bound.
    #[error("binding the control API to {address}{flag}")]
    Http {
        /// The address.
        address: SocketAddr,
        /// ` (--http)` when the address was asked for.
        flag: &'static str,
        /// Why.
        source: io::Error,
    },
    /// The readiness line could not be written, or the bound address read.
    #[error("announcing readiness")]
    Announce(#[source] io::Error),
    /// The socket server's accept loop ended on its own.
    #[error("the socket listener stopped")]
    SocketStopped,
    /// The socket server's accept loop failed.
    #[error("the socket listener failed")]
    SocketFailed(#[source] io::Error),
    /// The socket server's thread ended without a result.
    #[error("the socket server's thread ended")]
    SocketThreadEnded,
    /// The service manager's variables (`NOTIFY_SOCKET`, `WATCHDOG_USEC`) could not be used.
    #[error("the service manager's notification socket")]
    Notify(#[from] crate::notify::NotifyError),
    /// Shutdown could not write the catalog or stop the jobs.
    #[error("shutting down: {0}")]
    Shutdown(String),
}

/// Starts the daemon and serves until SIGTERM or SIGINT (then returns `Ok`) or until the socket
/// listener fails (then returns the error).
///
/// Prints `gpufeed: serving N dataset(s) on SOCKET` on stdout once it accepts connections, so that
/// supervisors and tests can wait for readiness without polling, then `gpufeed: http on ADDR` (the
/// bound address, so port 0 can be used) once the control API listens.
///
/// Under a service manager (`$NOTIFY_SOCKET` set) it also sends `READY=1` once both listen,
/// `STOPPING=1` when shutdown begins and, with `$WATCHDOG_USEC`, watchdog pings (see
/// [`crate::notify`]).
pub fn run(settings: Settings) -> Result<(), DaemonError> {
    let notifier = crate::notify::ServiceNotifier::from_environment()?;
    let gpus = open_backends(&settings)?;
    if gpus.is_empty() && settings.engine == EngineMode::CuFile {
        return Err(DaemonError::CuFileWithoutGpu);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("gpufeed-api")
        .enable_all()
        .build()
        .map_err(|source| DaemonError::Start {
            what: "starting the control API's runtime",
            source,
        })?;
    let result = runtime.block_on(serve(settings, gpus, &notifier));
    // Blocking tasks still running (a verification) must not hold the exit up.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// What `--device` asks for (of `gpufeed serve` and `gpufeed demo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRequest {
    /// The GPU backend on CUDA device 0 where it can be used, else the CPU backend.
    Auto,
    /// The CPU backend: batches in host memory.
    Cpu,
    /// The GPU backend on this CUDA device, or an error saying why it cannot be used.
    Cuda(u32),
}

impl FromStr for DeviceRequest {
    type Err = String;

    fn from_str(text: &str) -> Result<DeviceRequest, String> {
        match text {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            other => match other.strip_prefix("cuda:").map(str::parse::<u32>) {
                Some(Ok(ordinal)) => Ok(DeviceRequest::Cuda(ordinal)),
                _ => Err("expected auto, cpu or cuda:N".to_string()),
            },
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRequest::Auto => f.write_str("auto"),
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// The GPU backends `--device` asks for: one per device of a list (`cuda:0,cuda:1`) or of `all` (every
/// CUDA device), each with an equal share of the registration budget; otherwise what
/// [`open_backend`] opens (one device, or none).
pub fn open_backends(settings: &Settings) -> Result<Vec<Arc<GpuBackend>>, DaemonError> {
    let text = settings.device.trim();
    let ordinals: Vec<u32> = if text == "all" {
        let count = crate::device::Device::count().map_err(|source| DaemonError::Gpu {
            request: DeviceRequest::Cuda(0),
            source,
        })?;
        (0..count as u32).collect()
    } else if text.contains(',') {
        let mut ordinals = Vec::new();
        for part in text.split(',') {
            match part.trim().parse::<DeviceRequest>() {
                Ok(DeviceRequest::Cuda(ordinal)) if !ordinals.contains(&ordinal) => {
                    ordinals.push(ordinal)
                }
                _ => {
                    return Err(DaemonError::DeviceFlag {
                        given: settings.device.clone(),
                        expected: "auto, cpu, all, cuda:N, or a list of distinct cuda:N separated \
                                   by commas"
                            .to_string(),
                    })
                }
            }
        }
        ordinals
    } else {
        return Ok(open_backend(settings)?.into_iter().collect());
    };
    if ordinals.is_empty() {
        return Err(DaemonError::Gpu {
            request: DeviceRequest::Cuda(0),
            source: crate::device::DeviceError::Unavailable {
                reason: "--device all: no CUDA device".to_string(),
            },
        });
    }
    let mut backends = Vec::with_capacity(ordinals.len());
    // The host memory for decoded datasets is the node's: each device takes an even share.
    let per_device = GpuSettings {
        host_decoded_bytes: settings.gpu.host_decoded_bytes / ordinals.len() as u64,
        ..settings.gpu.clone()
    };
    for ordinal in ordinals {
        let gpu = open_gpu_backend(ordinal, settings.engine, &per_device).map_err(|source| {
            DaemonError::Gpu {
                request: DeviceRequest::Cuda(ordinal),
                source,
            }
        })?;
        tracing::info!(
            "GPU backend on cuda:{ordinal} ({}); read path choice {:?}",
            gpu.device.properties().name,
            gpu.choice
        );
        backends.push(gpu);
    }
    share_registrations(&mut backends, settings.gpu.registered);
    Ok(backends.into_iter().map(Arc::new).collect())
}

/// Opens the cuFile driver on a thread of its own while the daemon starts. Every stream's reader
/// probes cuFile; the driver is opened once per process (about 0.4 s on the H200 test machine, paid
/// by the first stream before its first batch otherwise). A stream that opens meanwhile waits for
/// the same opening; a machine without cuFile costs a failed library lookup.
fn warm_cufile(device: &Device) {
    let device = device.clone();
    let spawned = std::thread::Builder::new()
        .name("gpufeed-cufile-open".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            match crate::storage::cufile::CuFileReader::open(&device) {
                Ok(_) => tracing::info!(
                    "cuFile driver opened in {:.1} ms",
                    started.elapsed().as_secs_f64() * 1e3
                ),
                Err(reason) => tracing::debug!("cuFile not opened: {reason}"),
            }
        });
    if let Err(error) = spawned {
        tracing::warn!("opening the cuFile driver ahead failed to start a thread: {error}");
    }
}

/// Makes the devices of `backends` share their page-cache registrations. Registrations are portable
/// (every context maps them): where every device reads registered memory at its host address, one
/// registry serves them all within the whole `registered` budget, so a page registered for one
/// device's stream is read by the others without being locked again. Otherwise each device keeps its
/// own registry, with an equal share of the budget.
fn share_registrations(backends: &mut [GpuBackend], registered: RegistrationBudget) {
    let names: Vec<String> = backends
        .iter()
        .map(|b| format!("cuda:{}", b.ordinal))
        .collect();
    let Some((first, rest)) = backends.split_first_mut() else {
        return;
    };
    if rest.is_empty() {
        return;
    }
    let devices: Vec<&Device> = std::iter::once(&first.device)
        .chain(rest.iter().map(|b| &b.device))
        .collect();
    let shareable = portable_registration_works(&devices);
    if let Ok(()) = shareable {
        for backend in rest.iter_mut() {
            backend.windows = Arc::clone(&first.windows);
        }
        tracing::info!(
            "page-cache registrations shared by {} (portable, one budget of {} bytes)",
            names.join(", "),
            registered.bytes_max
        );
        return;
    }
    let count = backends.len() as u64;
    let share = registered.bytes_max / count / registered.window_bytes * registered.window_bytes;
    for backend in backends.iter_mut() {
        backend.windows = Arc::new(PageCacheWindows::new(
            &backend.device,
            registered.window_bytes as usize,
            share as usize,
        ));
    }
    tracing::info!(
        "page-cache registrations per device ({}): {}; each registers within {share} bytes",
        names.join(", "),
        shareable.err().unwrap_or_default()
    );
}

/// The GPU backend `--device` asks for: none for `cpu`; device N for `cuda:N` (or an error saying
/// why it cannot be used); device 0 for `auto` where CUDA works, else none, with the reason logged.
pub fn open_backend(settings: &Settings) -> Result<Option<Arc<GpuBackend>>, DaemonError> {
    let request: DeviceRequest =
        settings
            .device
            .parse()
            .map_err(|expected| DaemonError::DeviceFlag {
                given: settings.device.clone(),
                expected,
            })?;
    let ordinal = match request {
        DeviceRequest::Cpu => return Ok(None),
        DeviceRequest::Auto => 0,
        DeviceRequest::Cuda(ordinal) => ordinal,
    };
    match open_gpu_backend(ordinal, settings.engine, &settings.gpu) {
        Ok(gpu) => {
            tracing::info!(
                "GPU backend on cuda:{ordinal} ({}); read path choice {:?}",
                gpu.device.properties().name,
                gpu.choice
            );
            Ok(Some(Arc::new(gpu)))
        }
        Err(error) if request == DeviceRequest::Auto => {
            tracing::info!("device auto: {error}; serving from host memory (CPU backend)");
            Ok(None)
        }
        Err(source) => Err(DaemonError::Gpu { request, source }),
    }
}

/// Composes the GPU backend on CUDA device `ordinal` with the configured `gpu` settings: opens the
/// device, loads (compiling if needed, cached in `gpu.kernel_cache_dir`) the kernels, and sets up
/// the page-cache windows shared by every stream within the `gpu.registered` budget, with node
/// defaults for the bounds that are not settings. Fails with [`DeviceError::Unavailable`] where
/// CUDA cannot be used, on which a caller asking for `auto` falls back to the CPU backend.
pub fn open_gpu_backend(
    ordinal: u32,
    engine: EngineMode,
    gpu: &GpuSettings,
) -> Result<GpuBackend, DeviceError> {
    let device = Device::open(ordinal as usize)?;
    let cache = gpu
        .kernel_cache_dir
        .clone()
        .map_or(CacheDir::Disabled, CacheDir::At);
    let kernels = Kernels::load(&device, cache)?;
    for (kernel, origin) in &kernels.origins {
        tracing::info!("kernel {kernel}: {origin:?}");
    }
    let registered = gpu.registered;
    tracing::info!(
        "page-cache registration budget {} bytes ({}), windows of {} bytes, zero-copy {}",
        registered.bytes_max,
        registered.source.name(),
        registered.window_bytes,
        gpu.zero_copy.name()
    );
    // The one registration budget: the windows' registry holds it, and every reader of the
    // device reads through that registry.
    let windows = Arc::new(PageCacheWindows::new(
        &device,
        registered.window_bytes as usize,
        registered.bytes_max as usize,
    ));
    let numa = device.numa_placement();
    match &numa {
        Some(numa) => tracing::info!(
            "cuda:{ordinal} ({}) is on NUMA node {}: its streams' threads and pinned buffers are \
             placed on that node's {} CPUs",
            device.properties().pci_address,
            numa.node,
            numa.cpus.len()
        ),
        None => tracing::info!(
            "cuda:{ordinal}: one NUMA node (or the device's is unknown): threads are not bound"
        ),
    }
    let stream_limits = stream_limits(gpu);
    // Datasets with compressed blocks that the tier does not take are decoded whole for the
    // streams reading them, within one stream's device shard memory (`GPUFEED_DECODE_WHOLE=off`:
    // read round by round instead, for comparisons).
    let decode_whole = std::env::var("GPUFEED_DECODE_WHOLE").map_or(true, |v| v != "off");
    // Those larger than that are decoded into page-locked host memory mapped for the device,
    // within this device's share of `--host-decoded-memory`.
    let (held_max, host_held_max) = match decode_whole {
        true => (gpu.device_shard_bytes, gpu.host_decoded_bytes),
        false => (0, 0),
    };
    let tier = Arc::new(DeviceTier::new(
        &device,
        ordinal,
        gpu.device_cache_bytes,
        held_max,
        host_held_max,
    ));
    if gpu.device_cache_bytes > 0 {
        tracing::info!(
            "cuda:{ordinal}: device-memory tier of {} bytes: datasets stored raw that fit are kept \
             in device memory for every stream",
            gpu.device_cache_bytes
        );
    }
    warm_cufile(&device);
    Ok(GpuBackend {
        numa,
        interrupt_cpus: interrupt_cpus(gpu.interrupt_cpus),
        windows,
        device,
        ordinal,
        kernels: Arc::new(kernels),
        // The sets one stream uses, and one more for a stream that opens as another closes.
        round_pool: Arc::new(RoundBufferPool::new(
            (stream_limits.rounds_in_flight + 1).min(ROUNDS_IN_FLIGHT_MAX),
            ordinal,
        )),
        // One stream's shard slots (and a few stream buffers): a consumer's next epoch, opened while
        // the current one runs, and the current one then alternate through them.
        shard_pool: Arc::new(ShardSlotPool::new(
            stream_limits.device_shard_bytes as usize,
            ordinal,
            gpu.device_pool_idle_release,
        )),
        tier,
        reader_limits: GpuReaderLimits::node_defaults(),
        choice: PathChoice::from_mode(engine),
        stream_limits,
    })
}

/// Whether the fillers keep off the device's interrupt CPUs, as configured.
fn interrupt_cpus(setting: crate::config::InterruptCpus) -> crate::pipeline::InterruptCpus {
    match setting {
        crate::config::InterruptCpus::Avoid => crate::pipeline::InterruptCpus::Avoid,
        crate::config::InterruptCpus::Share => crate::pipeline::InterruptCpus::Allow,
    }
}

/// The pipeline's limits of a GPU stream under the configured `gpu` settings, over its node
/// defaults for the bounds that are not settings. (`gpu.device_pool_idle_release` and
/// `gpu.interrupt_cpus` are the device's, not a stream's: [`open_gpu_backend`] passes them.)
pub fn stream_limits(gpu: &GpuSettings) -> GpuStreamLimits {
    GpuStreamLimits {
        zero_copy: match gpu.zero_copy {
            ZeroCopyMode::Off => ZeroCopy::Off,
            ZeroCopyMode::Auto => ZeroCopy::Auto,
            ZeroCopyMode::Always => ZeroCopy::Always,
        },
        device_shard_bytes: gpu.device_shard_bytes,
        loader_copy_threads: gpu.loader_copy_threads,
        rounds_in_flight: gpu.rounds_in_flight,
        wait_spin: gpu.filler_spin,
        inline_gather_launches: gpu.inline_gather_tables,
        batch_group_max: gpu.batch_group_max,
        gather_piece_out_bytes: gpu.gather_piece_bytes,
        plan_threads: gpu.plan_threads,
        ..GpuStreamLimits::node_defaults()
    }
}

async fn serve(
    settings: Settings,
    gpus: Vec<Arc<GpuBackend>>,
    notifier: &ServiceNotifier,
) -> Result<(), DaemonError> {
    // Installed before anything is announced, so that a signal sent as soon as the readiness line
    // is read already finds the handlers.
    let mut signals = Signals::install()?;
    let open_files_max = raise_open_files_limit();
    let registry = Arc::new(Registry::new());
    let metrics = Arc::new(Metrics::new());
    registry.configure_object_cache(
        crate::remote::ObjectCacheSettings {
            dir: settings.object.cache_dir.clone(),
            bytes_max: settings.object.cache_bytes_max,
            requests_in_flight: crate::remote::cache::REQUESTS_IN_FLIGHT_DEFAULT,
        },
        Arc::clone(&metrics),
    );
    for gpu in &gpus {
        metrics.serve_device(gpu.ordinal);
        gpu.round_pool.report_to(&metrics);
        gpu.shard_pool.report_to(&metrics);
        gpu.tier.report_to(&metrics);
    }
    let (control, mut names) = open_control(&settings, &registry, &metrics).await?;
    if !settings.object.datasets.is_empty() {
        names = register_object_datasets(&settings, &registry).await?;
    }
    let server = start_socket_server(&settings, &registry, &metrics, gpus, &control)?;
    let listener = match bind_http(settings.http).await {
        Ok(listener) => listener,
        Err(error) => {
            let _ = std::fs::remove_file(&settings.socket_path);
            return Err(error);
        }
    };

    let (socket_failed, socket_failure) = tokio::sync::oneshot::channel();
    let socket_stopper = server.stopper();
    let socket_thread = std::thread::Builder::new()
        .name("gpufeed-socket".into())
        .spawn(move || {
            let result = server.run();
            let _ = socket_failed.send(result);
        })
        .map_err(|source| DaemonError::Start {
            what: "starting the socket server's thread",
            source,
        })?;

    println!(
        "gpufeed: serving {} dataset(s) on {}",
        names.len(),
        settings.socket_path.display()
    );
    io::stdout().flush().map_err(DaemonError::Announce)?;

    let (stop_http, http_stopped) = tokio::sync::watch::channel(false);
    let http_task = match listener {
        Some(listener) => Some(start_http(
            listener,
            &control,
            http_connections_within(settings.http_connections, open_files_max),
            http_stopped,
        )?),
        None => None,
    };

    notifier.ready(&format!(
        "serving {} dataset(s) on {}",
        names.len(),
        settings.socket_path.display()
    ));
    let outcome = wait_for_stop(
        &mut signals,
        socket_failure,
        &socket_thread,
        http_task.as_ref(),
        notifier,
    )
    .await;
    match &outcome {
        Ok(signal) => {
            tracing::info!("{signal}: shutting down");
            notifier.stopping(&format!("{signal}: shutting down"));
        }
        Err(error) => notifier.stopping(&format!("{error}: shutting down")),
    }

    let _ = stop_http.send(true);
    if let Some(task) = http_task {
        drain_http(task).await;
    }
    // No new consumer sessions from here on; the ones running are closed by the API's shutdown.
    socket_stopper.stop();
    if outcome.is_ok() {
        // Bounded: if the wake-up connection could not be made (the socket file was removed from
        // under us), the accept thread stays blocked and the process exits around it.
        let joined = tokio::task::spawn_blocking(move || socket_thread.join());
        if tokio::time::timeout(Duration::from_secs(2), joined)
            .await
            .is_err()
        {
            tracing::warn!("the socket server's accept loop did not stop; exiting around it");
        }
    }
    let report = api::shutdown(&control, JOBS_DRAIN).await;
    if let Err(error) = std::fs::remove_file(&settings.socket_path) {
        if error.kind() != io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {error}", settings.socket_path.display());
        }
    }
    match report {
        Ok(report) => tracing::info!(
            "stopped {} pack job(s), closed {} session(s), catalog written",
            report.jobs_stopped,
            report.sessions_closed
        ),
        Err(error) => {
            tracing::error!("{error}");
            if outcome.is_ok() {
                return Err(DaemonError::Shutdown(error.message));
            }
        }
    }
    outcome.map(|_| ())
}

/// Waits for SIGTERM or SIGINT (returns its name) or for the socket server to stop (returns why),
/// pinging the service manager's watchdog meanwhile. The pings come from this task, the one that
/// would notice the socket server's end, and only while the socket server's thread and the control
/// API's task run: a daemon whose loops died, or whose runtime is stuck, stops pinging and the
/// manager restarts it.
async fn wait_for_stop(
    signals: &mut Signals,
    mut socket_failure: tokio::sync::oneshot::Receiver<std::io::Result<()>>,
    socket_thread: &std::thread::JoinHandle<()>,
    http_task: Option<&tokio::task::JoinHandle<()>>,
    notifier: &ServiceNotifier,
) -> Result<&'static str, DaemonError> {
    let mut watchdog = notifier.watchdog_interval().map(tokio::time::interval);
    loop {
        tokio::select! {
            signal = signals.recv() => return Ok(signal),
            failed = &mut socket_failure => return Err(match failed {
                Ok(Ok(())) => DaemonError::SocketStopped,
                Ok(Err(error)) => DaemonError::SocketFailed(error),
                Err(_) => DaemonError::SocketThreadEnded,
            }),
            () = next_watchdog_tick(&mut watchdog) => {
                let http_alive = http_task.is_none_or(|task| !task.is_finished());
                if http_alive && !socket_thread.is_finished() {
                    notifier.watchdog();
                }
            }
        }
    }
}

/// Raises the soft limit on open descriptors to the hard one: every consumer session holds its socket
/// and its slots' descriptors, and the control API's connections (bounded by
/// `--http-connections-max`) must leave them room. Returns the limit in force, if it could be read.
fn raise_open_files_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::info!("open descriptor limit raised from {soft} to {hard}");
                Some(hard)
            }
            Err(error) => {
                tracing::warn!("cannot raise the open descriptor limit ({soft}): {error}");
                Some(soft)
            }
        },
        Ok((soft, _)) => {
            tracing::info!("open descriptor limit {soft}");
            Some(soft)
        }
        Err(error) => {
            tracing::warn!("cannot read the open descriptor limit: {error}");
            None
        }
    }
}

/// The control API's connections may hold at most this fraction (1/N) of the open descriptor
/// limit, each connection one descriptor: the rest stays for consumer sessions (a socket, a ring,
/// its doorbells and slot memory each), dataset files and the daemon's own.
const HTTP_DESCRIPTOR_SHARE_DIVISOR: u64 = 4;

/// `limits` with the connection limit lowered, if need be, to a quarter of the open descriptor
/// limit `open_files_max`, so that idle HTTP connections can never take the descriptors consumer
/// serving needs (at least one connection is always served).
fn http_connections_within(
    limits: crate::config::HttpConnections,
    open_files_max: Option<u64>,
) -> crate::config::HttpConnections {
    let Some(open_files_max) = open_files_max else {
        return limits;
    };
    let share = usize::try_from(open_files_max / HTTP_DESCRIPTOR_SHARE_DIVISOR)
        .unwrap_or(usize::MAX)
        .max(1);
    if limits.connections_max <= share {
        return limits;
    }
    tracing::warn!(
        "serving at most {share} control API connections, not {} (--http-connections-max): a \
         quarter of the open descriptor limit ({open_files_max}), so that the rest stays for \
         consumer sessions",
        limits.connections_max
    );
    crate::config::HttpConnections {
        connections_max: share,
        ..limits
    }
}

/// Opens the data root's catalog (registering its datasets) off the async threads; returns the
/// control API's state and the registered names.
async fn open_control(
    settings: &Settings,
    registry: &Arc<Registry>,
    metrics: &Arc<Metrics>,
) -> Result<(Arc<Control>, Vec<String>), DaemonError> {
    let options = ApiOptions::from_settings(settings);
    let (control, notes) = {
        let registry = Arc::clone(registry);
        let metrics = Arc::clone(metrics);
        let data_root = settings.data_root.clone();
        tokio::task::spawn_blocking(move || {
            let opened = Control::open(options, registry, metrics)?;
            // Once the data root is this daemon's (its catalog locked): the staging that packers
            // killed mid-pack left there (API jobs pack there); a live packer's is locked and stays.
            crate::pack::remove_stale_staging(&data_root);
            Ok(opened)
        })
        .await
        .map_err(DaemonError::CatalogTask)?
        .map_err(|source| DaemonError::DataRoot {
            path: settings.data_root.clone(),
            source,
        })?
    };
    for note in &notes {
        tracing::warn!("{note}");
    }
    let names = registry.names();
    tracing::info!(
        "datasets: {}; catalog {}",
        names.join(", "),
        control.catalog_path().display()
    );
    Ok((control, names))
}

/// Registers the datasets in object storage given with `--dataset NAME=URL` (their manifests and
/// shard metadata read now, off the async threads): a start fails, naming the URL, if one cannot
/// be. Returns every registered name.
async fn register_object_datasets(
    settings: &Settings,
    registry: &Arc<Registry>,
) -> Result<Vec<String>, DaemonError> {
    for (name, url) in &settings.object.datasets {
        let (shared, named, url) = (Arc::clone(registry), name.clone(), url.clone());
        let task = tokio::task::spawn_blocking(move || {
            let (remote, dataset) = shared.open_remote(&named, &url)?;
            shared.insert_remote(dataset, remote)?;
            tracing::info!("dataset '{named}' registered from {url}");
            Ok::<_, String>(())
        });
        task.await
            .map_err(DaemonError::CatalogTask)?
            .map_err(|reason| DaemonError::ObjectDataset {
                name: name.clone(),
                reason,
            })?;
    }
    Ok(registry.names())
}

/// Binds the consumer socket with the serving backend, and tells the control API which backend
/// serves.
fn start_socket_server(
    settings: &Settings,
    registry: &Arc<Registry>,
    metrics: &Arc<Metrics>,
    gpus: Vec<Arc<GpuBackend>>,
    control: &Control,
) -> Result<Server, DaemonError> {
    let served: Vec<String> = gpus.iter().map(|g| format!("cuda:{}", g.ordinal)).collect();
    control.attach_device_tiers(gpus.iter().map(|g| Arc::clone(&g.tier)).collect());
    let names: Vec<String> = gpus
        .iter()
        .map(|g| format!("cuda:{} ({})", g.ordinal, g.device.properties().name))
        .collect();
    let server_config = ServerConfig {
        socket_path: settings.socket_path.clone(),
        allowed_uids: settings.allowed_uids.clone(),
        sessions_max: settings.sessions_max,
        slot_memory_bytes_max: settings.slot_memory_bytes_max,
        stream_limits: StreamLimits::node_defaults(),
        metrics: Arc::clone(metrics),
        gpus,
        handshake_timeout: crate::ipc::HANDSHAKE_TIMEOUT_DEFAULT,
    };
    let server = Server::bind(server_config, Arc::clone(registry)).map_err(|source| {
        DaemonError::Socket {
            path: settings.socket_path.clone(),
            source,
        }
    })?;
    control.attach_backend(
        if served.is_empty() {
            "cpu".to_string()
        } else {
            served.join(",")
        },
        match names.is_empty() {
            false => format!(
                "streams on {} get exportable device slots filled by that device's GPU pipeline; \
                 host-memory streams are served from memfd slots",
                names.join(", ")
            ),
            true => format!(
                "--device {}: batches are served from host memory (memfd)",
                settings.device
            ),
        },
    );
    Ok(server)
}

/// Announces the control API's address and serves it until `stopped` turns true.
fn start_http(
    listener: tokio::net::TcpListener,
    control: &Arc<Control>,
    limits: crate::config::HttpConnections,
    stopped: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, DaemonError> {
    let address = listener.local_addr().map_err(DaemonError::Announce)?;
    // Whoever started the daemon may have stopped reading stdout after the first line: a closed
    // pipe must not take the daemon down.
    let mut stdout = io::stdout();
    let _ = writeln!(stdout, "gpufeed: http on {address}").and_then(|()| stdout.flush());
    tracing::info!("control API on http://{address}");
    let app = api::router(Arc::clone(control));
    Ok(tokio::spawn(api::serve::serve(
        listener, app, limits, stopped,
    )))
}

/// Waits (bounded) for the control API's requests in flight once it was told to stop.
async fn drain_http(task: tokio::task::JoinHandle<()>) {
    match tokio::time::timeout(HTTP_DRAIN, task).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!("the control API's task failed: {error}"),
        Err(_) => tracing::warn!(
            "requests still in flight after {} s; closing them",
            HTTP_DRAIN.as_secs()
        ),
    }
}

/// Binds the control API's listener, or none when it is off. The built-in default address is
/// allowed to be taken (another daemon on the node holds it): the daemon then serves its socket
/// without a control API and says so. An address that was asked for must bind.
async fn bind_http(listen: HttpListen) -> Result<Option<TcpListener>, DaemonError> {
    let bind = |address: SocketAddr| async move { TcpListener::bind(address).await };
    match listen {
        HttpListen::Off => Ok(None),
        HttpListen::Chosen(address) => {
            bind(address)
                .await
                .map(Some)
                .map_err(|source| DaemonError::Http {
                    address,
                    flag: " (--http)",
                    source,
                })
        }
        HttpListen::Default(address) => match bind(address).await {
            Ok(listener) => Ok(Some(listener)),
            Err(error) if error.kind() == io::ErrorKind::AddrInUse => {
                tracing::warn!(
                    "no control API: the default address {address} is in use (another daemon?); \
                     pass --http ADDR to choose one, or --http off"
                );
                Ok(None)
            }
            Err(source) => Err(DaemonError::Http {
                address,
                flag: "",
                source,
            }),
        },
    }
}

/// The shutdown signals, caught from installation on.
struct Signals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals, DaemonError> {
        use tokio::signal::unix::{signal, SignalKind};
        let handler = |kind: SignalKind, what: &'static str| {
            signal(kind).map_err(|source| DaemonError::Start { what, source })
        };
        Ok(Signals {
            terminate: handler(SignalKind::terminate(), "installing a SIGTERM handler")?,
            interrupt: handler(SignalKind::interrupt(), "installing a SIGINT handler")?,
        })
    }

    /// Waits for SIGTERM or SIGINT and names it.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.terminate.recv() => "SIGTERM",
            _ = self.interrupt.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HttpConnections;

    /// The configuration's defaults and bounds of the pipeline's settings are the pipeline's own
    /// (the configuration does not import them, so that it stays below the pipeline).
    #[test]
    fn configured_gpu_defaults_are_the_pipelines() {
        use crate::config as c;
        use crate::pipeline::gpu as p;
        let limits = stream_limits(&GpuSettings::node_defaults());
        let node = GpuStreamLimits::node_defaults();
        assert_eq!(limits.rounds_in_flight, node.rounds_in_flight);
        assert_eq!(limits.wait_spin, node.wait_spin);
        assert_eq!(limits.inline_gather_launches, node.inline_gather_launches);
        assert_eq!(limits.batch_group_max, node.batch_group_max);
        assert_eq!(limits.zero_copy, node.zero_copy);
        assert_eq!(limits.gather_piece_out_bytes, node.gather_piece_out_bytes);
        assert_eq!(limits.plan_threads, node.plan_threads);
        let gpu = GpuSettings::node_defaults();
        assert_eq!(
            gpu.device_pool_idle_release,
            p::DEVICE_POOL_IDLE_RELEASE_DEFAULT
        );
        assert_eq!(
            interrupt_cpus(gpu.interrupt_cpus),
            crate::pipeline::INTERRUPT_CPUS_DEFAULT
        );
        assert_eq!(limits.device_shard_bytes, p::DEVICE_SHARD_BYTES_DEFAULT);
        assert_eq!(limits.loader_copy_threads, p::LOADER_COPY_THREADS_DEFAULT);
        assert_eq!(
            c::LOADER_COPY_THREADS_MAX as usize,
            p::LOADER_COPY_THREADS_MAX
        );
        assert_eq!(c::ROUNDS_IN_FLIGHT_MAX as usize, p::ROUNDS_IN_FLIGHT_MAX);
        assert_eq!(
            c::INLINE_GATHER_TABLES_MAX as usize,
            p::INLINE_GATHER_LAUNCHES_MAX
        );
        assert_eq!(c::BATCH_GROUP_MAX_MAX as usize, p::BATCH_GROUP_MAX);
        assert_eq!(
            u128::from(c::FILLER_SPIN_US_MAX),
            p::WAIT_SPIN_MAX.as_micros()
        );
    }

    #[test]
    fn http_connections_keep_three_quarters_of_the_descriptors_for_consumers() {
        let limits = HttpConnections {
            connections_max: 256,
            idle_timeout: Duration::from_secs(30),
        };
        assert_eq!(
            http_connections_within(limits, Some(128)).connections_max,
            32
        );
        assert_eq!(http_connections_within(limits, Some(1 << 20)), limits);
        assert_eq!(http_connections_within(limits, Some(u64::MAX)), limits);
        assert_eq!(http_connections_within(limits, None), limits);
        assert_eq!(http_connections_within(limits, Some(2)).connections_max, 1);
    }
}
