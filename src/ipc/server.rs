//! The socket server: accepts consumers, checks their uid, runs one session per connection.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread;

use gpufeed_client::protocol::{
    Backend, BatchField, BatchInfo, DaemonStatus, Device, ErrorCode, FieldLayout, Message,
    StreamLayout, StreamSpec,
};
use gpufeed_client::transport::{self, TransportError};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::slots::{Lease, SlotRing};
use crate::device::Device as CudaDevice;
use crate::kernels::Kernels;
use crate::metrics::SlotLease;
use crate::pipeline::{
    Assembler, FillError, FillReport, GpuAssembler, GpuStreamLimits, StreamLimits, StreamPlan,
};
use crate::registry::Registry;
use crate::storage::gpu::{GpuReader, GpuReaderLimits, PathChoice};
use crate::storage::windows::PageCacheWindows;

/// What the GPU backend needs to serve streams on its device.
pub struct GpuServing {
    /// The device; streams asking for `Device::Cuda(ordinal)` are served on it.
    pub device: CudaDevice,
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
    /// The registration budget the windows were made with (for status).
    pub registered: crate::config::RegistrationBudget,
}

impl GpuServing {
    /// Opens CUDA device `ordinal` and loads (compiling if needed) the kernels, with node defaults
    /// for every bound. Fails with [`crate::device::DeviceError::Unavailable`] where CUDA cannot be
    /// used, on which a caller asking for `auto` falls back to the CPU backend.
    pub fn open(
        ordinal: u32,
        engine: crate::storage::EngineMode,
        registered: crate::config::RegistrationBudget,
        zero_copy: crate::pipeline::gpu::ZeroCopy,
    ) -> Result<GpuServing, crate::device::DeviceError> {
        let device = CudaDevice::open(ordinal as usize)?;
        let kernels = Kernels::load(&device, crate::device::CacheDir::FromEnvironment)?;
        for (kernel, origin) in &kernels.origins {
            tracing::info!("kernel {kernel}: {origin:?}");
        }
        let reader_limits = GpuReaderLimits {
            window_bytes: registered.window_bytes as usize,
            registered_bytes_max: registered.bytes_max as usize,
            ..GpuReaderLimits::node_defaults()
        };
        tracing::info!(
            "page-cache registration budget {} bytes ({}), windows of {} bytes, zero-copy {zero_copy:?}",
            registered.bytes_max,
            registered.source.name(),
            registered.window_bytes
        );
        let windows = Arc::new(PageCacheWindows::new(
            &device,
            reader_limits.window_bytes,
            reader_limits.registered_bytes_max,
        ));
        Ok(GpuServing {
            windows,
            device,
            ordinal,
            kernels: Arc::new(kernels),
            reader_limits,
            choice: PathChoice::from_mode(engine),
            stream_limits: GpuStreamLimits {
                zero_copy,
                ..GpuStreamLimits::node_defaults()
            },
            registered,
        })
    }
}

/// Settings of the socket server, all bounded.
#[derive(Clone)]
pub struct ServerConfig {
    /// Where the socket is created (mode 0600).
    pub socket_path: PathBuf,
    /// Peer uids allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// Most concurrent sessions.
    pub sessions_max: u32,
    /// Most bytes of slot memory over all streams.
    pub slot_memory_bytes_max: u64,
    /// Per-stream bounds.
    pub stream_limits: StreamLimits,
    /// Where reads, decode and gather times, slot occupancy and hand-off latency are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The GPU backend, when the daemon runs on a device; host-memory streams are served either way.
    pub gpu: Option<Arc<GpuServing>>,
    /// How long a new connection may take to send its Hello before it is closed: a connection that
    /// never speaks would otherwise hold a session (of the bounded `sessions_max`) forever.
    pub handshake_timeout: std::time::Duration,
}

/// The default [`ServerConfig::handshake_timeout`]: a client sends Hello as soon as it connects.
pub const HANDSHAKE_TIMEOUT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(10);

/// Counters shared by all sessions; also what `Status` reports.
#[derive(Default, Debug)]
pub struct Counters {
    sessions: AtomicU32,
    streams: AtomicU32,
    slots: AtomicU64,
    slot_bytes: AtomicU64,
    batches: AtomicU64,
    replaced: AtomicU64,
}

impl Counters {
    /// A snapshot.
    pub fn status(&self) -> DaemonStatus {
        DaemonStatus {
            sessions: self.sessions.load(Ordering::SeqCst),
            streams: self.streams.load(Ordering::SeqCst),
            slots_allocated: self.slots.load(Ordering::SeqCst),
            slot_bytes_allocated: self.slot_bytes.load(Ordering::SeqCst),
            batches_served: self.batches.load(Ordering::SeqCst),
            samples_replaced: self.replaced.load(Ordering::SeqCst),
        }
    }
}

struct Shared {
    config: ServerConfig,
    registry: Arc<Registry>,
    counters: Arc<Counters>,
    next_session: AtomicU64,
}

/// A bound socket, ready to serve.
pub struct Server {
    listener: UnixListener,
    shared: Arc<Shared>,
    stopping: Arc<AtomicBool>,
}

/// Stops a [`Server`]'s accept loop from another thread.
#[derive(Clone)]
pub struct ServerStopper {
    stopping: Arc<AtomicBool>,
    socket_path: PathBuf,
}

impl ServerStopper {
    /// Makes [`Server::run`] return once it wakes: sets the flag, then connects to the socket so that
    /// a blocked `accept` returns. Sessions already running are not touched (the control API closes
    /// them through the session directory).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&self.socket_path);
    }
}

impl Server {
    /// Creates the socket at `config.socket_path`, replacing a stale one left by a daemon that died
    /// (one nobody is listening on); refuses if another daemon is listening there.
    pub fn bind(config: ServerConfig, registry: Arc<Registry>) -> io::Result<Server> {
        let path = &config.socket_path;
        // Only a stale socket is replaced: anything else at the path (a user's file, a directory, a
        // symbolic link) is left alone and refused, whatever it is.
        if let Ok(metadata) = std::fs::symlink_metadata(path) {
            if !metadata.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{}: exists and is not a socket; refusing to replace it (choose another \
                         --socket path or remove it yourself)",
                        path.display()
                    ),
                ));
            }
            match UnixStream::connect(path) {
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("{}: another daemon is listening there", path.display()),
                    ))
                }
                Err(_) => std::fs::remove_file(path)?,
            }
        }
        let listener = UnixListener::bind(path)?;
        // From here on the control API lists this server's sessions and can close them.
        registry.sessions().attach();
        // Owner-only access; the uid allowlist is checked on every connection as well, which also
        // covers the moment between bind and chmod.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Server {
            listener,
            stopping: Arc::new(AtomicBool::new(false)),
            shared: Arc::new(Shared {
                config,
                registry,
                counters: Arc::new(Counters::default()),
                next_session: AtomicU64::new(1),
            }),
        })
    }

    /// The counters, for status reporting.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.shared.counters)
    }

    /// A handle that stops [`Server::run`].
    pub fn stopper(&self) -> ServerStopper {
        ServerStopper {
            stopping: Arc::clone(&self.stopping),
            socket_path: self.shared.config.socket_path.clone(),
        }
    }

    /// Accepts connections, one thread per session, until stopped or the listener fails.
    pub fn run(&self) -> io::Result<()> {
        for connection in self.listener.incoming() {
            if self.stopping.load(Ordering::SeqCst) {
                return Ok(());
            }
            let socket = match connection {
                Ok(socket) => socket,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => {
                    tracing::warn!("accept failed: {error}");
                    continue;
                }
            };
            let shared = Arc::clone(&self.shared);
            let spawned = thread::Builder::new()
                .name("gpufeed-session".into())
                .spawn(move || run_session(shared, socket));
            if let Err(error) = spawned {
                tracing::error!("cannot start a session thread: {error}");
            }
        }
        Ok(())
    }
}

fn send_error(socket: &Mutex<UnixStream>, code: ErrorCode, message: String) {
    tracing::info!("session error ({code:?}): {message}");
    let socket = socket.lock().expect("socket lock poisoned");
    let _ = transport::send(&socket, &Message::Error { code, message }, &[]);
}

/// Decrements the session count when a session ends, however it ends.
struct SessionSlot<'a>(&'a Counters);

impl Drop for SessionSlot<'_> {
    fn drop(&mut self) {
        self.0.sessions.fetch_sub(1, Ordering::SeqCst);
    }
}

fn run_session(shared: Arc<Shared>, socket: UnixStream) {
    let reader = socket;
    let writer = match reader.try_clone() {
        Ok(writer) => Arc::new(Mutex::new(writer)),
        Err(error) => {
            tracing::warn!("cannot clone the session socket: {error}");
            return;
        }
    };
    let uid = match getsockopt(&reader, PeerCredentials) {
        Ok(credentials) => credentials.uid(),
        Err(error) => {
            send_error(
                &writer,
                ErrorCode::PermissionDenied,
                format!("cannot read peer credentials: {error}"),
            );
            return;
        }
    };
    if !shared.config.allowed_uids.contains(&uid) {
        send_error(
            &writer,
            ErrorCode::PermissionDenied,
            format!("uid {uid} is not allowed to connect"),
        );
        return;
    }
    let counters = &shared.counters;
    if counters.sessions.fetch_add(1, Ordering::SeqCst) >= shared.config.sessions_max {
        counters.sessions.fetch_sub(1, Ordering::SeqCst);
        send_error(
            &writer,
            ErrorCode::ResourceExhausted,
            format!(
                "the daemon serves at most {} sessions",
                shared.config.sessions_max
            ),
        );
        return;
    }
    let _session_slot = SessionSlot(counters);
    let session_id = shared.next_session.fetch_add(1, Ordering::SeqCst);
    if let Err(error) = reader.set_read_timeout(Some(shared.config.handshake_timeout)) {
        tracing::warn!("session {session_id}: cannot set the handshake deadline: {error}");
        return;
    }
    let hello = transport::recv(&reader);
    if let Err(error) = reader.set_read_timeout(None) {
        tracing::warn!("session {session_id}: cannot clear the handshake deadline: {error}");
        return;
    }
    let client = match hello {
        Ok((Message::Hello { client }, _)) => {
            tracing::info!("session {session_id}: {client} (uid {uid})");
            client
        }
        Err(TransportError::Io(error))
            if matches!(
                error.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            send_error(
                &writer,
                ErrorCode::BadFrame,
                format!(
                    "no Hello within {} s of connecting: closing the session",
                    shared.config.handshake_timeout.as_secs_f64()
                ),
            );
            return;
        }
        Ok((other, _)) => {
            send_error(
                &writer,
                ErrorCode::BadFrame,
                format!("expected Hello, got {}", other.name()),
            );
            return;
        }
        Err(error) => {
            if !matches!(error, TransportError::Closed) {
                send_error(&writer, ErrorCode::BadFrame, error.to_string());
            }
            return;
        }
    };
    let welcome = Message::Welcome {
        session: session_id,
        backend: if shared.config.gpu.is_some() {
            Backend::Cuda
        } else {
            Backend::Cpu
        },
        daemon_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if transport::send(&writer.lock().expect("socket lock poisoned"), &welcome, &[]).is_err() {
        return;
    }
    // The control API may close this session (an operator's DELETE, a forced dataset removal, the
    // daemon shutting down). The closer never blocks: it sends the error frame only if the writer is
    // free (the filler may be mid-send) and then shuts the socket down, which ends this session's
    // receive loop and, with it, the stream and its slots.
    let closer: crate::registry::SessionCloser = {
        let writer = Arc::clone(&writer);
        let shutdown = reader.try_clone().ok();
        Arc::new(move |reason| {
            if let Ok(socket) = writer.try_lock() {
                let message = Message::Error {
                    code: ErrorCode::Closed,
                    message: format!("session closed by the daemon: {reason:?}"),
                };
                let _ = transport::send(&socket, &message, &[]);
            }
            if let Some(socket) = &shutdown {
                let _ = socket.shutdown(std::net::Shutdown::Both);
            }
        })
    };
    let listed = shared.registry.sessions().register(
        crate::registry::SessionInfo {
            id: session_id,
            uid,
            client,
            started: std::time::SystemTime::now(),
        },
        closer,
    );
    let mut stream: Option<RunningStream> = None;
    loop {
        let message = match transport::recv(&reader) {
            Ok((message, fds)) => {
                if !fds.is_empty() {
                    send_error(
                        &writer,
                        ErrorCode::BadFrame,
                        "consumers may not pass descriptors".into(),
                    );
                    break;
                }
                message
            }
            Err(TransportError::Closed) => break,
            Err(error) => {
                send_error(&writer, ErrorCode::BadFrame, error.to_string());
                break;
            }
        };
        match message {
            Message::OpenStream(spec) => {
                if stream.is_some() {
                    send_error(
                        &writer,
                        ErrorCode::BadRequest,
                        "this session already has a stream".into(),
                    );
                    break;
                }
                let dataset = spec.dataset.clone();
                match open_stream(&shared, &writer, spec) {
                    Ok(running) => {
                        listed.set_stream(&dataset);
                        stream = Some(running);
                    }
                    Err((code, message)) => {
                        send_error(&writer, code, message);
                        break;
                    }
                }
            }
            Message::Release { slot } => {
                let Some(running) = &stream else {
                    send_error(
                        &writer,
                        ErrorCode::BadRequest,
                        "Release before OpenStream".into(),
                    );
                    break;
                };
                if let Err(error) = running.release(slot) {
                    send_error(&writer, ErrorCode::BadRequest, error);
                    break;
                }
            }
            Message::StatusRequest => {
                let status = Message::Status(counters.status());
                if transport::send(&writer.lock().expect("socket lock poisoned"), &status, &[])
                    .is_err()
                {
                    break;
                }
            }
            Message::Close => break,
            other => {
                send_error(
                    &writer,
                    ErrorCode::BadFrame,
                    format!("{} is not a message a consumer sends", other.name()),
                );
                break;
            }
        }
    }
    if let Some(running) = stream {
        running.stop(&reader);
    }
    tracing::info!("session {session_id} ended");
}

/// A stream being served: its slots, the filler thread and the channel that returns released slots.
struct RunningStream {
    ring: Arc<SlotRing>,
    /// Bytes counted against the slot memory limit for this stream.
    ring_bytes: u64,
    release: SyncSender<u32>,
    stop: Arc<AtomicBool>,
    filler: thread::JoinHandle<()>,
    counters: Arc<Counters>,
    metrics: Arc<crate::metrics::Metrics>,
}

impl RunningStream {
    fn release(&self, slot: u32) -> Result<(), String> {
        self.ring
            .transition(slot, Lease::Consumer, Lease::Free)
            .map_err(|e| format!("Release: {e}"))?;
        self.metrics.add_slots(SlotLease::Consumer, -1);
        self.metrics.add_slots(SlotLease::Free, 1);
        // The channel holds as many entries as there are slots and each slot is in it at most once,
        // so this never blocks.
        let _ = self.release.try_send(slot);
        Ok(())
    }

    /// Ends the stream: stops the filler, waits for it, and frees the slots.
    fn stop(self, socket: &UnixStream) {
        self.stop.store(true, Ordering::SeqCst);
        // The filler may be blocked waiting for a free slot (the channel closes when `release` drops)
        // or writing to a consumer that is gone (shutting the socket down ends that write).
        drop(self.release);
        let _ = socket.shutdown(std::net::Shutdown::Both);
        let _ = self.filler.join();
        let (free, filling, consumer) = self.ring.lease_counts();
        self.metrics.add_slots(SlotLease::Free, -(free as i64));
        self.metrics
            .add_slots(SlotLease::Filling, -(filling as i64));
        self.metrics
            .add_slots(SlotLease::Consumer, -(consumer as i64));
        let slots = self.ring.len() as u64;
        let bytes = self.ring_bytes;
        drop(self.ring);
        self.counters.slots.fetch_sub(slots, Ordering::SeqCst);
        self.counters.slot_bytes.fetch_sub(bytes, Ordering::SeqCst);
        self.counters.streams.fetch_sub(1, Ordering::SeqCst);
    }
}

fn open_stream(
    shared: &Arc<Shared>,
    writer: &Arc<Mutex<UnixStream>>,
    spec: StreamSpec,
) -> Result<RunningStream, (ErrorCode, String)> {
    let gpu = match spec.device {
        Device::Cpu => None,
        Device::Cuda(ordinal) => match &shared.config.gpu {
            Some(gpu) if gpu.ordinal == ordinal => Some(Arc::clone(gpu)),
            Some(gpu) => {
                return Err((
                    ErrorCode::BadRequest,
                    format!(
                        "device cuda:{ordinal} is not served: this daemon runs on cuda:{}",
                        gpu.ordinal
                    ),
                ))
            }
            None => {
                return Err((
                    ErrorCode::BadRequest,
                    format!(
                        "device cuda:{ordinal} is not served: this daemon runs the CPU backend"
                    ),
                ))
            }
        },
    };
    let dataset = shared.registry.get(&spec.dataset).ok_or_else(|| {
        (
            ErrorCode::UnknownDataset,
            format!(
                "no dataset named '{}' (registered: {})",
                spec.dataset,
                shared.registry.names().join(", ")
            ),
        )
    })?;
    let limits = &shared.config.stream_limits;
    let plan = Arc::new(
        StreamPlan::new(dataset, &spec, limits)
            .map_err(|e| (ErrorCode::BadRequest, e.to_string()))?,
    );
    let ring_bytes = plan.slot_bytes as u64 * plan.slot_count as u64;
    let counters = Arc::clone(&shared.counters);
    let before = counters.slot_bytes.fetch_add(ring_bytes, Ordering::SeqCst);
    if before + ring_bytes > shared.config.slot_memory_bytes_max {
        counters.slot_bytes.fetch_sub(ring_bytes, Ordering::SeqCst);
        return Err((
            ErrorCode::ResourceExhausted,
            format!(
                "{ring_bytes} bytes of slots would exceed the daemon's {}-byte slot memory limit",
                shared.config.slot_memory_bytes_max
            ),
        ));
    }
    let undo = |code, message: String| {
        counters.slot_bytes.fetch_sub(ring_bytes, Ordering::SeqCst);
        (code, message)
    };
    let metrics = Arc::clone(&shared.config.metrics);
    let (ring, filler) = match &gpu {
        None => {
            let ring = SlotRing::new(plan.slot_count, plan.slot_bytes).map_err(|e| {
                undo(
                    ErrorCode::ResourceExhausted,
                    format!("cannot allocate slots: {e}"),
                )
            })?;
            let assembler = Assembler::new(Arc::clone(&plan), limits, Arc::clone(&metrics))
                .map_err(|e| undo(ErrorCode::Internal, e.to_string()))?;
            if let Some(note) = &assembler.engine_note {
                tracing::warn!("{note}");
            }
            (
                ring,
                Filler::Cpu {
                    assembler: Box::new(assembler),
                    done: VecDeque::new(),
                },
            )
        }
        Some(gpu) => {
            let ring = SlotRing::new_device(&gpu.device, plan.slot_count, plan.slot_bytes)
                .map_err(|e| {
                    undo(
                        ErrorCode::ResourceExhausted,
                        format!("cannot allocate device slots: {e}"),
                    )
                })?;
            let reader =
                GpuReader::with_windows(&gpu.device, gpu.reader_limits, Arc::clone(&gpu.windows))
                    .map_err(|e| {
                    undo(
                        ErrorCode::ResourceExhausted,
                        format!("cannot set up device reads: {e}"),
                    )
                })?;
            let assembler = GpuAssembler::new(
                Arc::clone(&plan),
                Arc::clone(&gpu.kernels),
                reader,
                gpu.choice,
                &gpu.stream_limits,
                Arc::clone(&metrics),
            )
            .map_err(|e| undo(ErrorCode::ResourceExhausted, e.to_string()))?;
            (
                ring,
                Filler::Gpu {
                    assembler: Box::new(assembler),
                    slots: VecDeque::new(),
                },
            )
        }
    };
    let ring = Arc::new(ring);
    let layout = StreamLayout {
        slot_count: plan.slot_count,
        slot_bytes: plan.slot_bytes as u64,
        epoch_samples: plan.order.len(),
        steps: plan.steps,
        fields: plan
            .fields
            .iter()
            .map(|f| FieldLayout {
                name: f.name.clone(),
                dtype: f.out,
                sample_shape: f.sample_shape.clone(),
                offset: f.offset as u64,
                batch_bytes: (f.sample_bytes_out * plan.rank.batch_size as usize) as u64,
            })
            .collect(),
        device: spec.device,
        slot_events: ring
            .slot_events()
            .map_err(|e| undo(ErrorCode::Internal, e.to_string()))?,
    };
    {
        let descriptors = ring
            .descriptors()
            .map_err(|e| undo(ErrorCode::Internal, e))?;
        let borrowed: Vec<_> = descriptors.iter().map(|fd| fd.as_fd()).collect();
        let socket = writer.lock().expect("socket lock poisoned");
        transport::send(&socket, &Message::StreamOpened(layout), &borrowed)
            .map_err(|e| undo(ErrorCode::Internal, e.to_string()))?;
    }
    counters
        .slots
        .fetch_add(plan.slot_count as u64, Ordering::SeqCst);
    counters.streams.fetch_add(1, Ordering::SeqCst);
    let (release, free) = sync_channel(plan.slot_count as usize);
    for slot in 0..plan.slot_count {
        release
            .try_send(slot)
            .expect("channel sized for every slot");
    }
    let stop = Arc::new(AtomicBool::new(false));
    metrics.add_slots(SlotLease::Free, plan.slot_count as i64);
    let filler = {
        let (ring, stop, writer, counters, metrics) = (
            Arc::clone(&ring),
            Arc::clone(&stop),
            Arc::clone(writer),
            Arc::clone(&counters),
            Arc::clone(&metrics),
        );
        thread::Builder::new()
            .name("gpufeed-filler".into())
            .spawn(move || fill_stream(plan, filler, ring, free, stop, writer, counters, &metrics))
            .map_err(|e| {
                (
                    ErrorCode::Internal,
                    format!("cannot start the filler thread: {e}"),
                )
            })?
    };
    Ok(RunningStream {
        ring,
        ring_bytes,
        release,
        stop,
        filler,
        counters,
        metrics,
    })
}

/// The filler: for each step, waits for a free slot, fills it and hands it to the consumer.
///
/// The hand-off latency it records is the time from a slot being filled to its `Batch` frame having
/// been written to the consumer's socket (waiting for the socket lock included).
#[allow(clippy::too_many_arguments)]
fn fill_stream(
    plan: Arc<StreamPlan>,
    filler: Filler,
    ring: Arc<SlotRing>,
    free: Receiver<u32>,
    stop: Arc<AtomicBool>,
    writer: Arc<Mutex<UnixStream>>,
    counters: Arc<Counters>,
    metrics: &crate::metrics::Metrics,
) {
    let end_session = |error: FillError| {
        let (code, message) = match error {
            FillError::Corrupt { .. } => (ErrorCode::CorruptData, error.to_string()),
            error => (ErrorCode::Internal, error.to_string()),
        };
        send_error(&writer, code, message);
        let socket = writer.lock().expect("socket lock poisoned");
        let _ = socket.shutdown(std::net::Shutdown::Both);
    };
    // Batches are submitted up to the filler's depth ahead of the hand-off. The filler never blocks
    // on a free slot while it holds a batch the consumer has not got: the consumer may be waiting for
    // exactly that batch before it releases anything.
    // A local, so that it is dropped (its queued device work drained) before the ring it writes.
    let mut filler = filler;
    let depth = filler.depth();
    let mut next = 0u64;
    loop {
        let pending = filler.pending();
        if next == plan.steps && pending == 0 {
            break;
        }
        let slot = if next < plan.steps && pending < depth {
            if pending == 0 {
                match free.recv() {
                    Ok(slot) => Some(slot),
                    Err(_) => return,
                }
            } else {
                match free.try_recv() {
                    Ok(slot) => Some(slot),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
        } else {
            None
        };
        if let Some(slot) = slot {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            ring.transition(slot, Lease::Free, Lease::Filling)
                .expect("only free slots are in the channel");
            metrics.add_slots(SlotLease::Free, -1);
            metrics.add_slots(SlotLease::Filling, 1);
            if let Err(error) = filler.submit(&ring, slot, next) {
                return end_session(error);
            }
            next += 1;
            continue;
        }
        let (slot, step, report) = match filler.complete(&ring) {
            Ok(done) => done,
            Err(error) => return end_session(error),
        };
        let ready_ns = gpufeed_client::protocol::monotonic_ns();
        ring.transition(slot, Lease::Filling, Lease::Consumer)
            .expect("the filler holds the lease");
        metrics.add_slots(SlotLease::Filling, -1);
        metrics.add_slots(SlotLease::Consumer, 1);
        let filled = std::time::Instant::now();
        let batch = BatchInfo {
            slot,
            epoch: plan.epoch,
            step: plan.epoch_step(step),
            cursor_after: plan.cursor_after(step),
            samples: report.samples,
            replaced: report.replaced,
            fields: plan
                .fields
                .iter()
                .map(|f| {
                    let mut shape = vec![report.samples as u64];
                    shape.extend_from_slice(&f.sample_shape);
                    BatchField {
                        offset: f.offset as u64,
                        dtype: f.out,
                        shape,
                    }
                })
                .collect(),
            ready_ns,
        };
        let sent = transport::send(
            &writer.lock().expect("socket lock poisoned"),
            &Message::Batch(batch),
            &[],
        );
        if sent.is_err() {
            return;
        }
        metrics.observe_handoff(filled.elapsed());
        counters.batches.fetch_add(1, Ordering::SeqCst);
        counters
            .replaced
            .fetch_add(report.replaced as u64, Ordering::SeqCst);
    }
    if let Filler::Gpu { assembler, .. } = &filler {
        let t = assembler.timings;
        tracing::info!(
            "GPU stream done: {} steps in {} rounds; host plan {:.3} s, read {:.3} s, decode {:.3} s, \
             gather {:.3} s, waiting for the device {:.3} s",
            plan.steps,
            t.rounds,
            t.plan_s,
            t.read_s,
            t.decode_s,
            t.gather_s,
            t.wait_s
        );
    }
    let end = Message::EndOfEpoch {
        epoch: plan.epoch,
        steps: plan.steps,
    };
    let _ = transport::send(&writer.lock().expect("socket lock poisoned"), &end, &[]);
}

/// What fills a stream's slots: the CPU assembler into memfds, or the GPU assembler into device slots.
enum Filler {
    /// Fills each slot before `submit` returns; `done` holds the filled slots and steps.
    Cpu {
        assembler: Box<Assembler>,
        done: VecDeque<(u32, u64, FillReport)>,
    },
    /// Queues batches on the device; `slots` holds the submitted slots, oldest first.
    Gpu {
        assembler: Box<GpuAssembler>,
        slots: VecDeque<u32>,
    },
}

impl Filler {
    /// Batches submitted ahead of the hand-off at most.
    fn depth(&self) -> usize {
        match self {
            Filler::Cpu { .. } => 1,
            Filler::Gpu { assembler, .. } => assembler.rounds_in_flight(),
        }
    }

    /// Batches submitted and not completed.
    fn pending(&self) -> usize {
        match self {
            Filler::Cpu { done, .. } => done.len(),
            Filler::Gpu { slots, .. } => slots.len(),
        }
    }

    /// Starts filling `slot` with stream step `step` (the filler thread holds its Filling lease).
    fn submit(&mut self, ring: &SlotRing, slot: u32, step: u64) -> Result<(), FillError> {
        match self {
            Filler::Cpu { assembler, done } => {
                // SAFETY: the filler thread holds the slot's Filling lease.
                let memory = unsafe { ring.slot_mut(slot) };
                let report = assembler.fill(step, memory)?;
                done.push_back((slot, step, report));
                Ok(())
            }
            Filler::Gpu { assembler, slots } => {
                let device_slot = ring.device_slot(slot);
                assembler.submit(
                    step,
                    &device_slot.buffer,
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
    fn complete(&mut self, ring: &SlotRing) -> Result<(u32, u64, FillReport), FillError> {
        match self {
            Filler::Cpu { done, .. } => Ok(done.pop_front().expect("a batch was submitted")),
            Filler::Gpu { assembler, slots } => {
                let slot = *slots.front().expect("a batch was submitted");
                let (step, report) = assembler.complete(Some(&ring.device_slot(slot).ready))?;
                slots.pop_front();
                Ok((slot, step, report))
            }
        }
    }
}
