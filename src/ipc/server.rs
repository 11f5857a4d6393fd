//! The socket server: accepts consumers, checks their uid, runs one session per connection, and
//! hands each stream's filled slots to its consumer. The filling itself is the pipeline's
//! ([`crate::pipeline::Filler`]); this module speaks the protocol around it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use gpufeed_proto::protocol::{
    Backend, BatchForm, DecodeError, ErrorCode, FieldLayout, Message, StreamLayout, StreamSpec,
    VariableLayout, PROTOCOL_VERSION,
};
use gpufeed_proto::ring::{check_published, decode_release, RingBatch, RingError};
use gpufeed_proto::transport::{self, TransportError};
use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

use super::convert::daemon_status;
use super::ring::HandoffRing;
use super::slots::{Lease, SlotRing};
use crate::metrics::{Metrics, SlotLease};
use crate::pipeline::block_cache::BlockCache;
use crate::pipeline::cpu::{lookahead_bytes, working_set_bytes};
use crate::pipeline::varlen::VariableForm;
use crate::pipeline::{
    Ended, FillError, Filled, Filler, FillerError, GpuBackend, Handoff, StreamBackend,
    StreamLimits, StreamPlan, StreamRequest,
};
use crate::registry::Registry;

/// Settings of the socket server, all bounded.
#[derive(Clone)]
pub struct ServerConfig {
    /// Where the socket is created (mode 0600 while only the daemon's own uid is allowed, 0666
    /// when others are: see `socket_mode`).
    pub socket_path: PathBuf,
    /// Peer uids allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// Most concurrent sessions.
    pub sessions_max: u32,
    /// Most bytes of slot memory over all streams.
    pub slot_memory_bytes_max: u64,
    /// Per-stream bounds.
    pub stream_limits: StreamLimits,
    /// The serving ledger (sessions, streams, slots, batches) and the other measurements: reads,
    /// decode and gather times, hand-off latency.
    pub metrics: Arc<Metrics>,
    /// The GPU backends, one per device the daemon serves (none: the CPU backend only); host-memory
    /// streams are served either way.
    pub gpus: Vec<Arc<GpuBackend>>,
    /// How long a new connection may take to send its whole Hello before it is closed: a connection
    /// that never speaks, or sends its Hello a byte at a time, would otherwise hold a session (of the
    /// bounded `sessions_max`) forever.
    pub handshake_timeout: std::time::Duration,
}

/// The default [`ServerConfig::handshake_timeout`]: a client sends Hello as soon as it connects.
pub const HANDSHAKE_TIMEOUT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(10);

struct Shared {
    config: ServerConfig,
    registry: Arc<Registry>,
    next_session: AtomicU64,
    /// The decoded-block cache of the host streams, within the slot memory budget less what open
    /// streams reserved.
    block_cache: Arc<BlockCache>,
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

/// The socket file's mode for an allowlist of peer uids: owner-only while only the daemon's own uid
/// may connect; otherwise anyone may reach the socket, since other users' consumers must be able to
/// `connect` at all (a 0600 socket refuses them before the daemon sees them), and the allowlist,
/// checked on the peer's credentials for every connection, decides who is served. That check also
/// covers the moment between bind and chmod.
fn socket_mode(allowed_uids: &[u32]) -> u32 {
    let own_uid = nix::unistd::geteuid().as_raw();
    if allowed_uids.iter().all(|&uid| uid == own_uid) {
        0o600
    } else {
        0o666
    }
}

impl Server {
    /// Creates the socket at `config.socket_path`, replacing a stale socket left by a daemon that
    /// died (one nobody is listening on). Refuses if another daemon is listening there, and leaves
    /// anything at the path that is not a socket (a file, a directory, a symbolic link) untouched.
    pub fn bind(config: ServerConfig, registry: Arc<Registry>) -> io::Result<Server> {
        let path = &config.socket_path;
        remove_stale_socket(path)?;
        let listener = UnixListener::bind(path)?;
        // From here on the control API lists this server's sessions and can close them.
        registry.sessions().attach();
        std::fs::set_permissions(
            path,
            std::fs::Permissions::from_mode(socket_mode(&config.allowed_uids)),
        )?;
        Ok(Server {
            listener,
            stopping: Arc::new(AtomicBool::new(false)),
            shared: Arc::new(Shared {
                block_cache: BlockCache::new(
                    config.slot_memory_bytes_max,
                    Arc::clone(&config.metrics),
                ),
                config,
                registry,
                next_session: AtomicU64::new(1),
            }),
        })
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

/// Removes what is at `path` if it is a socket nobody listens on; fails, naming the path, if a daemon
/// listens there or if it is anything but a socket. Symbolic links are not followed: a link is not a
/// socket, so it is refused rather than its target replaced.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => {
            return Err(io::Error::new(
                error.kind(),
                format!("{}: {error}", path.display()),
            ))
        }
    };
    if !metadata.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{}: exists and is not a socket; refusing to replace it (choose another --socket \
                 path or remove it yourself)",
                path.display()
            ),
        ));
    }
    if UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{}: another daemon is listening there", path.display()),
        ));
    }
    std::fs::remove_file(path)
}

fn send_error(socket: &Mutex<UnixStream>, code: ErrorCode, message: String) {
    tracing::info!("session error ({code:?}): {message}");
    let socket = socket.lock().expect("socket lock poisoned");
    let _ = transport::send(&socket, &Message::Error { code, message }, &[]);
}

/// Counts an admitted session as closed when it ends, however it ends.
struct SessionSlot<'a>(&'a Metrics);

impl Drop for SessionSlot<'_> {
    fn drop(&mut self) {
        self.0.close_session();
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
    let Some(uid) = admitted_uid(&shared, &reader, &writer) else {
        return;
    };
    let metrics = &shared.config.metrics;
    if !metrics.open_session(shared.config.sessions_max) {
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
    let _session_slot = SessionSlot(metrics);
    let session_id = shared.next_session.fetch_add(1, Ordering::SeqCst);
    let Some(client) = handshake(&shared, &reader, &writer, session_id, uid) else {
        return;
    };
    let listed = shared.registry.sessions().register(
        crate::registry::SessionInfo {
            id: session_id,
            uid,
            client,
            started: std::time::SystemTime::now(),
        },
        session_closer(&reader, &writer),
    );
    if let Some(running) = serve_requests(&shared, &reader, &writer, &listed) {
        running.stop(&reader);
    }
    tracing::info!("session {session_id} ended");
}

/// `dataset` as its files are now: read again from disk if it was packed again in place since it was
/// registered; refused, naming the file, if a file of it vanished or cannot be read (a stream would
/// otherwise fail later with a misleading corruption error).
fn current_dataset(
    shared: &Shared,
    name: &str,
    dataset: Arc<crate::format::Dataset>,
) -> Result<Arc<crate::format::Dataset>, (ErrorCode, String)> {
    match dataset.disk_change() {
        None => Ok(dataset),
        Some(crate::format::DiskChange::ManifestChanged(_)) => {
            let fresh = shared.registry.reload(name).map_err(|reason| {
                (
                    ErrorCode::Internal,
                    format!(
                        "dataset '{name}' was packed again in place and does not open: {reason}"
                    ),
                )
            })?;
            tracing::info!("dataset '{name}' was packed again in place: read again from disk");
            Ok(fresh)
        }
        Some(change) => Err((
            ErrorCode::Internal,
            format!("dataset '{name}' cannot be served: {change}"),
        )),
    }
}

/// The peer's uid, if it may connect; otherwise the refusal is sent and `None` returned.
fn admitted_uid(
    shared: &Shared,
    reader: &UnixStream,
    writer: &Arc<Mutex<UnixStream>>,
) -> Option<u32> {
    let uid = match getsockopt(reader, PeerCredentials) {
        Ok(credentials) => credentials.uid(),
        Err(error) => {
            send_error(
                writer,
                ErrorCode::PermissionDenied,
                format!("cannot read peer credentials: {error}"),
            );
            return None;
        }
    };
    if !shared.config.allowed_uids.contains(&uid) {
        send_error(
            writer,
            ErrorCode::PermissionDenied,
            format!("uid {uid} is not allowed to connect"),
        );
        return None;
    }
    Some(uid)
}

/// Waits (within the handshake deadline) for the consumer's `Hello` and answers `Welcome`; returns
/// the client's description, or `None` once the session is refused or gone.
fn handshake(
    shared: &Shared,
    reader: &UnixStream,
    writer: &Arc<Mutex<UnixStream>>,
    session_id: u64,
    uid: u32,
) -> Option<String> {
    // The deadline bounds the whole Hello, not each read: a client trickling a byte at a time would
    // otherwise keep its session for ever.
    let deadline = std::time::Instant::now() + shared.config.handshake_timeout;
    let hello = transport::recv_before(reader, deadline);
    let client = match hello {
        // Descriptors on any client frame are BadFrame (docs/PROTOCOL.md), the Hello's too: they
        // are closed here (dropped with the frame) and the session refused.
        Ok((Message::Hello { .. }, fds)) if !fds.is_empty() => {
            send_error(
                writer,
                ErrorCode::BadFrame,
                format!(
                    "the Hello carried {} file descriptor(s): consumers may not pass descriptors",
                    fds.len()
                ),
            );
            return None;
        }
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
                writer,
                ErrorCode::BadFrame,
                format!(
                    "no Hello within {} s of connecting: closing the session",
                    shared.config.handshake_timeout.as_secs_f64()
                ),
            );
            return None;
        }
        Ok((other, _)) => {
            send_error(
                writer,
                ErrorCode::BadFrame,
                format!("expected Hello, got {}", other.name()),
            );
            return None;
        }
        Err(TransportError::Decode(DecodeError::Version { found })) => {
            let reason = format!(
                "this daemon (gpufeed {}) speaks consumer protocol version {PROTOCOL_VERSION} and the \
                 client speaks version {found}: use a client library of the daemon's release",
                env!("CARGO_PKG_VERSION")
            );
            tracing::info!("session {session_id}: refused: {reason}");
            let frame = Message::version_refusal(found, reason);
            let _ =
                transport::send_frame(&writer.lock().expect("socket lock poisoned"), &frame, &[]);
            return None;
        }
        Err(error) => {
            if !matches!(error, TransportError::Closed) {
                send_error(writer, ErrorCode::BadFrame, error.to_string());
            }
            return None;
        }
    };
    let welcome = Message::Welcome {
        session: session_id,
        backend: if !shared.config.gpus.is_empty() {
            Backend::Cuda
        } else {
            Backend::Cpu
        },
        daemon_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    if transport::send(&writer.lock().expect("socket lock poisoned"), &welcome, &[]).is_err() {
        return None;
    }
    Some(client)
}

/// Lets the control API close the session (an operator's DELETE, a forced dataset removal, the
/// daemon shutting down). The closer never blocks: it sends the error frame only if the writer is
/// free (the filler may be mid-send) and then shuts the socket down, which ends the session's
/// receive loop and, with it, the stream and its slots.
fn session_closer(
    reader: &UnixStream,
    writer: &Arc<Mutex<UnixStream>>,
) -> crate::registry::SessionCloser {
    let writer = Arc::clone(writer);
    let shutdown = reader.try_clone().ok();
    Arc::new(move |reason| {
        if let Ok(socket) = writer.try_lock() {
            let message = Message::Error {
                code: ErrorCode::Closed,
                message: format!("session closed by the daemon: {reason}"),
            };
            let _ = transport::send(&socket, &message, &[]);
        }
        if let Some(socket) = &shutdown {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    })
}

/// Serves the session's requests until it ends; returns its stream, if it opened one, to be stopped.
fn serve_requests(
    shared: &Arc<Shared>,
    reader: &UnixStream,
    writer: &Arc<Mutex<UnixStream>>,
    listed: &crate::registry::SessionEntry<'_>,
) -> Option<RunningStream> {
    let metrics = &shared.config.metrics;
    let mut stream: Option<RunningStream> = None;
    loop {
        let message = match transport::recv(reader) {
            Ok((message, fds)) => {
                if !fds.is_empty() {
                    send_error(
                        writer,
                        ErrorCode::BadFrame,
                        "consumers may not pass descriptors".into(),
                    );
                    break;
                }
                message
            }
            Err(TransportError::Closed) => break,
            Err(error) => {
                send_error(writer, ErrorCode::BadFrame, error.to_string());
                break;
            }
        };
        match message {
            Message::OpenStream(spec) => {
                if stream.is_some() {
                    send_error(
                        writer,
                        ErrorCode::BadRequest,
                        "this session already has a stream".into(),
                    );
                    break;
                }
                let dataset = spec.dataset.clone();
                let mixture = (!spec.sources.is_empty()).then(|| {
                    let sources = spec.sources.iter().map(|s| s.dataset.clone()).collect();
                    (spec.source_name(), sources)
                });
                match open_stream(shared, writer, spec) {
                    Ok(running) => {
                        match mixture {
                            Some((name, sources)) => listed.set_mixture_stream(&name, sources),
                            None => listed.set_stream(&dataset),
                        }
                        stream = Some(running);
                    }
                    Err((code, message)) => {
                        send_error(writer, code, message);
                        break;
                    }
                }
            }
            Message::StatusRequest => {
                let status = Message::Status(daemon_status(metrics.serving()));
                if transport::send(&writer.lock().expect("socket lock poisoned"), &status, &[])
                    .is_err()
                {
                    break;
                }
            }
            Message::Close => break,
            other => {
                send_error(
                    writer,
                    ErrorCode::BadFrame,
                    format!("{} is not a message a consumer sends", other.name()),
                );
                break;
            }
        }
    }
    stream
}

/// A stream being served: its slots, its hand-off ring and the filler thread.
struct RunningStream {
    ring: Arc<SlotRing>,
    handoff: Arc<HandoffRing>,
    /// Bytes counted against the slot memory limit for this stream.
    ring_bytes: u64,
    stop: Arc<AtomicBool>,
    filler: thread::JoinHandle<()>,
    metrics: Arc<Metrics>,
    /// A dataset in object storage: its shards, held in the cache until the stream ends (after
    /// the filler has stopped reading them: fields drop after `stop` joins it).
    _shards: Option<crate::remote::ShardPins>,
}

impl RunningStream {
    /// Ends the stream: stops the filler, waits for it, and frees the slots.
    fn stop(self, socket: &UnixStream) {
        self.stop.store(true, Ordering::SeqCst);
        // The filler may be asleep waiting for a release (its doorbell wakes it) or writing to a
        // consumer that is gone (shutting the socket down ends that write).
        self.handoff.daemon_bell.ring();
        let _ = socket.shutdown(std::net::Shutdown::Both);
        let _ = self.filler.join();
        let (free, filling, consumer) = self.ring.lease_counts();
        drop(self.ring);
        self.metrics.stream_closed(
            [free as u64, filling as u64, consumer as u64],
            self.ring_bytes,
        );
    }
}

/// Reserves the host memory a stream of `plan` on `backend` holds in the daemon's budget (its slots,
/// and a host stream's decoded-block working set and look-ahead beside them) and shrinks the shared
/// block cache to what the reservations leave: the bytes reserved and the look-ahead's, or the error
/// refusing the stream. A look-ahead the budget cannot hold is given up (0) before the stream is.
fn reserve_stream_memory(
    shared: &Shared,
    plan: &StreamPlan,
    backend: StreamBackend<'_>,
) -> Result<(u64, u64), (ErrorCode, String)> {
    let lookahead = match backend {
        StreamBackend::Cpu => lookahead_bytes(plan, &shared.config.stream_limits),
        StreamBackend::Gpu(_) => 0,
    };
    if lookahead > 0 {
        if let Ok(bytes) = reserve_stream_memory_with(shared, plan, backend, lookahead) {
            return Ok((bytes, lookahead));
        }
    }
    reserve_stream_memory_with(shared, plan, backend, 0).map(|bytes| (bytes, 0))
}

fn reserve_stream_memory_with(
    shared: &Shared,
    plan: &StreamPlan,
    backend: StreamBackend<'_>,
    lookahead: u64,
) -> Result<u64, (ErrorCode, String)> {
    // A host stream reserves the decoded blocks it may hold beyond the shared cache beside its slots:
    // the slots, the working sets and the cache share one budget.
    let working_set = match backend {
        StreamBackend::Cpu => working_set_bytes(plan),
        // Assembled on the host, through pinned buffers (a mixture, shards that arrive as it runs).
        StreamBackend::Gpu(_) if crate::pipeline::upload::assembled_on_host(plan) => {
            // An assembler per fill thread, each with its working set.
            let threads = crate::pipeline::upload::fill_threads(plan) as u64;
            working_set_bytes(plan)
                .saturating_mul(threads)
                .saturating_add(crate::pipeline::upload::upload_bytes(plan))
        }
        StreamBackend::Gpu(_) => 0,
    };
    let ring_bytes = gpufeed_proto::protocol::slot_stride(plan.slot_bytes as u64)
        .saturating_mul(u64::from(plan.slot_count))
        .saturating_add(working_set)
        .saturating_add(lookahead);
    if !shared
        .config
        .metrics
        .reserve_slot_bytes(ring_bytes, shared.config.slot_memory_bytes_max)
    {
        return Err((
            ErrorCode::ResourceExhausted,
            format!(
                "{ring_bytes} bytes of slots (and {working_set} of them the stream's decoded-block \
                 working set) would exceed the daemon's {}-byte slot memory limit",
                shared.config.slot_memory_bytes_max
            ),
        ));
    }
    // The cache keeps what the open streams' reservations leave.
    shared.block_cache.shrink_to_capacity();
    Ok(ring_bytes)
}

/// For a stream of a dataset in object storage: a host stream holds its shards batch by batch
/// (`pipeline::shard_gate`, set in `plan`). A GPU stream holds them all before it starts where
/// the node's cache holds them all (it then runs on the GPU pipeline, which opens every shard
/// file at once); otherwise it too holds them batch by batch through the gate, and its batches are
/// assembled on the host and uploaded (`pipeline::upload`), so that its first batch waits for the
/// shards it reads rather than for the whole dataset.
fn remote_shards(
    shared: &Shared,
    remote: Option<&crate::remote::RemoteDataset>,
    backend: StreamBackend<'_>,
    plan: &mut StreamPlan,
) -> Result<Option<crate::remote::ShardPins>, (ErrorCode, String)> {
    let name = plan.dataset.manifest.name.clone();
    match (remote, backend) {
        (Some(remote), StreamBackend::Cpu) => {
            plan.shard_gate = Some(Arc::new(remote.stream_shards(Arc::clone(&plan.dataset))));
            Ok(None)
        }
        (Some(remote), StreamBackend::Gpu(_)) if remote.cached_whole(&plan.dataset) => {
            hold_remote_shards(shared, &name, &plan.dataset)
        }
        (Some(remote), StreamBackend::Gpu(_)) => {
            tracing::info!(
                "stream of '{name}' on a device: its shards are not all in the node's cache; \
                 fetched as its batches need them, assembled on the host and uploaded (the GPU \
                 pipeline serves its streams once the cache holds them all)"
            );
            plan.shard_gate = Some(Arc::new(remote.stream_shards(Arc::clone(&plan.dataset))));
            Ok(None)
        }
        (None, _) => Ok(None),
    }
}

/// For a GPU stream of a dataset in object storage, its shards fetched into the node's cache (or
/// found there) and held there for the stream's life, before anything opens them; `None` for a
/// local dataset.
fn hold_remote_shards(
    shared: &Shared,
    name: &str,
    dataset: &crate::format::Dataset,
) -> Result<Option<crate::remote::ShardPins>, (ErrorCode, String)> {
    let Some(remote) = shared.registry.remote(name) else {
        return Ok(None);
    };
    remote.acquire(dataset).map(Some).map_err(|error| {
        let code = match error {
            crate::remote::RemoteError::Budget { .. } => ErrorCode::ResourceExhausted,
            crate::remote::RemoteError::Corrupt { .. } => ErrorCode::CorruptData,
            _ => ErrorCode::Internal,
        };
        (code, format!("dataset '{name}' cannot be served: {error}"))
    })
}

/// The registered dataset `name`, or the error naming the registered ones.
fn registered_dataset(
    shared: &Shared,
    name: &str,
) -> Result<Arc<crate::format::Dataset>, (ErrorCode, String)> {
    shared.registry.get(name).ok_or_else(|| {
        (
            ErrorCode::UnknownDataset,
            format!(
                "no dataset named '{name}' (registered: {})",
                shared.registry.names().join(", ")
            ),
        )
    })
}

/// The plan of a mixture stream: every source a registered local dataset. Its batches are
/// assembled by the CPU backend on any device (on a CUDA device, then uploaded into the device
/// slot: `pipeline::upload`); a source in object storage is refused as its shards are held through
/// one gate per stream.
fn mixture_plan(
    shared: &Shared,
    spec: &StreamSpec,
    request: &StreamRequest,
) -> Result<StreamPlan, (ErrorCode, String)> {
    let mut sources = Vec::with_capacity(spec.sources.len());
    for source in &spec.sources {
        let dataset = registered_dataset(shared, &source.dataset)?;
        if shared.registry.remote(&source.dataset).is_some() {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "mixture source '{}' is in object storage: mixtures serve local datasets only",
                    source.dataset
                ),
            ));
        }
        let dataset = current_dataset(shared, &source.dataset, dataset)?;
        sources.push((dataset, source.weight));
    }
    StreamPlan::mixture(
        sources,
        spec.mixture_epoch_samples,
        request,
        &shared.config.stream_limits,
    )
    .map_err(|e| (ErrorCode::BadRequest, e.to_string()))
}

fn open_stream(
    shared: &Arc<Shared>,
    writer: &Arc<Mutex<UnixStream>>,
    spec: StreamSpec,
) -> Result<RunningStream, (ErrorCode, String)> {
    // The rules a spec must keep on its own, with the messages the client library gives for them; a
    // consumer of another client library gets the same answer.
    spec.validate()
        .map_err(|e| (ErrorCode::BadRequest, e.to_string()))?;
    let request = StreamRequest::from(&spec);
    // By the device's UUID where the consumer sent it (its ordinal may not be ours).
    let backend = super::devices::stream_backend(&spec, &shared.config.gpus)
        .map_err(|message| (ErrorCode::BadRequest, message))?;
    let limits = &shared.config.stream_limits;
    let (plan, shards) = if spec.sources.is_empty() {
        let dataset = registered_dataset(shared, &spec.dataset)?;
        let remote = shared.registry.remote(&spec.dataset);
        // A dataset in object storage: its cached files are checked when fetched, not here.
        let dataset = match remote {
            Some(_) => dataset,
            None => current_dataset(shared, &spec.dataset, dataset)?,
        };
        let mut plan = StreamPlan::new(dataset, &request, limits)
            .map_err(|e| (ErrorCode::BadRequest, e.to_string()))?;
        let shards = remote_shards(shared, remote.as_deref(), backend, &mut plan)?;
        (plan, shards)
    } else {
        (mixture_plan(shared, &spec, &request)?, None)
    };
    let plan = Arc::new(plan);
    let (ring_bytes, lookahead) = reserve_stream_memory(shared, &plan, backend)?;
    // The assembler keeps ahead what was reserved for it.
    let limits = &StreamLimits {
        lookahead_bytes_max: lookahead,
        ..*limits
    };
    let metrics = &shared.config.metrics;
    let undo = |code, message: String| {
        metrics.unreserve_slot_bytes(ring_bytes);
        (code, message)
    };
    let started = std::time::Instant::now();
    let ring = match backend {
        StreamBackend::Cpu => SlotRing::new(plan.slot_count, plan.slot_bytes).map_err(|e| {
            undo(
                ErrorCode::ResourceExhausted,
                format!("cannot allocate slots: {e}"),
            )
        })?,
        StreamBackend::Gpu(gpu) => {
            SlotRing::new_device(&gpu.device, plan.slot_count, plan.slot_bytes).map_err(|e| {
                undo(
                    ErrorCode::ResourceExhausted,
                    format!("cannot allocate device slots: {e}"),
                )
            })?
        }
    };
    let handoff_ring = Arc::new(HandoffRing::new(plan.slot_count).map_err(|e| {
        undo(
            ErrorCode::ResourceExhausted,
            format!("cannot create the hand-off ring: {e}"),
        )
    })?);
    let slots_made = started.elapsed();
    let filler = Filler::new(
        Arc::clone(&plan),
        backend,
        limits,
        Arc::clone(metrics),
        &shared.block_cache,
    )
    .map_err(|error| {
        let code = match error {
            FillerError::Storage(_) => ErrorCode::Internal,
            FillerError::DeviceReads(_) | FillerError::Gpu(_) => ErrorCode::ResourceExhausted,
        };
        undo(code, error.to_string())
    })?;
    tracing::info!(
        "stream of {} set up in {:.1} ms: {} slots of {} bytes {:.1} ms, pipeline {:.1} ms",
        spec.source_name(),
        started.elapsed().as_secs_f64() * 1e3,
        plan.slot_count,
        plan.slot_bytes,
        slots_made.as_secs_f64() * 1e3,
        (started.elapsed() - slots_made).as_secs_f64() * 1e3
    );
    let ring = Arc::new(ring);
    let slot_events = ring
        .slot_events()
        .map_err(|e| undo(ErrorCode::Internal, e.to_string()))?;
    let layout = stream_layout(&plan, &ring, spec.device, slot_events);
    {
        let mut descriptors = vec![ring
            .descriptor()
            .map_err(|e| undo(ErrorCode::Internal, e))?];
        descriptors.extend(
            handoff_ring
                .descriptors()
                .map_err(|e| undo(ErrorCode::Internal, e.to_string()))?,
        );
        let borrowed: Vec<_> = descriptors.iter().map(|fd| fd.as_fd()).collect();
        let socket = writer.lock().expect("socket lock poisoned");
        transport::send(&socket, &Message::StreamOpened(layout), &borrowed)
            .map_err(|e| undo(ErrorCode::Internal, e.to_string()))?;
    }
    metrics.stream_opened(plan.slot_count);
    let stop = Arc::new(AtomicBool::new(false));
    let handoff = RingHandoff {
        plan: Arc::clone(&plan),
        ring: Arc::clone(&ring),
        handoff: Arc::clone(&handoff_ring),
        free: (0..plan.slot_count).collect(),
        releases_taken: 0,
        batches_published: 0,
        publishing: Vec::with_capacity(crate::pipeline::DELIVER_AT_ONCE_MAX),
        waits: FreeSlotWaits::default(),
        stop: Arc::clone(&stop),
        writer: Arc::clone(writer),
        metrics: Arc::clone(metrics),
        // Armed once the filler thread runs: a thread that never started is reported by the
        // caller.
        unfinished: UnfinishedStream {
            writer: Arc::clone(writer),
            armed: false,
        },
    };
    let filler = filler.spawn(Arc::clone(&ring), handoff).map_err(|e| {
        metrics.stream_closed([u64::from(plan.slot_count), 0, 0], ring_bytes);
        (
            ErrorCode::Internal,
            format!("cannot start the filler thread: {e}"),
        )
    })?;
    Ok(RunningStream {
        ring,
        handoff: handoff_ring,
        ring_bytes,
        stop,
        filler,
        metrics: Arc::clone(metrics),
        _shards: shards,
    })
}

/// The layout `StreamOpened` announces for `plan`'s slots in `ring`: each field where the plan puts
/// it, a variable-length field followed by its index tensor (`NAME.lengths` or `NAME.cu_seqlens`,
/// `int32`), described in the layout's `variable` record.
fn stream_layout(
    plan: &StreamPlan,
    ring: &SlotRing,
    device: gpufeed_proto::protocol::Device,
    slot_events: Vec<gpufeed_proto::protocol::SlotEvents>,
) -> StreamLayout {
    let batch_size = u64::from(plan.rank.batch_size);
    let mut fields = Vec::with_capacity(plan.fields.len());
    let mut variable = Vec::new();
    for f in &plan.fields {
        match &f.variable {
            None => fields.push(FieldLayout {
                name: f.name.clone(),
                dtype: f.out,
                sample_shape: f.sample_shape.clone(),
                offset: f.offset as u64,
                batch_bytes: f.sample_bytes_out as u64 * batch_size,
            }),
            Some(v) => {
                let form = match v.form {
                    VariableForm::Padded => BatchForm::Padded,
                    VariableForm::Packed => BatchForm::Packed,
                };
                let mut sample_shape = vec![v.length_bound];
                sample_shape.extend_from_slice(&f.sample_shape);
                fields.push(FieldLayout {
                    name: f.name.clone(),
                    dtype: f.out,
                    sample_shape,
                    offset: f.offset as u64,
                    batch_bytes: f.sample_bytes_out as u64 * v.length_bound * batch_size,
                });
                fields.push(FieldLayout {
                    name: format!("{}.{}", f.name, form.index_suffix()),
                    dtype: gpufeed_proto::DType::I32,
                    sample_shape: Vec::new(),
                    offset: v.index_offset as u64,
                    batch_bytes: 4 * v.index_elements(batch_size as usize) as u64,
                });
                variable.push(VariableLayout {
                    values: (fields.len() - 2) as u16,
                    index: (fields.len() - 1) as u16,
                    form,
                });
            }
        }
    }
    StreamLayout {
        slot_count: plan.slot_count,
        slot_bytes: plan.slot_bytes as u64,
        slot_stride: ring.slot_stride() as u64,
        epoch_samples: plan.order.len(),
        steps: plan.steps,
        fields,
        device,
        slot_events,
        variable,
    }
}

/// How long the filler sleeps on its doorbell before it looks at the stop flag and the ring again:
/// a consumer that reads the daemon's doorbell itself (it has the descriptor) only slows its own
/// stream down to this.
const RELEASE_WAIT_MS: i32 = 100;

/// A stream's consumer as its filler sees it: free slots come back as releases in the hand-off ring,
/// filled slots go out as batch entries in it. The socket carries only the end of the epoch and errors.
///
/// The hand-off latency it records is the time from a slot being filled to its entry being published
/// (the consumer's doorbell rung, if it sleeps).
struct RingHandoff {
    plan: Arc<StreamPlan>,
    ring: Arc<SlotRing>,
    handoff: Arc<HandoffRing>,
    /// Slots released and not yet taken by the filler.
    free: VecDeque<u32>,
    releases_taken: u64,
    batches_published: u64,
    /// The ring entries of the batches being delivered (kept for its allocation).
    publishing: Vec<RingBatch>,
    /// For the stream's log line: how the filler waited for free slots.
    waits: FreeSlotWaits,
    stop: Arc<AtomicBool>,
    writer: Arc<Mutex<UnixStream>>,
    metrics: Arc<Metrics>,
    /// Tells the consumer if the filler stops without ending the stream (it panicked).
    unfinished: UnfinishedStream,
}

/// Armed while a stream's filler thread runs: dropped armed (the filler thread unwound from a panic, and the
/// hand-off with it), it sends the consumer an `Internal` error and shuts the socket, so that the
/// consumer fails at once instead of waiting for batches that will never come. Disarmed when the
/// stream ends any other way (finished, failed, or stopped).
struct UnfinishedStream {
    writer: Arc<Mutex<UnixStream>>,
    armed: bool,
}

impl Drop for UnfinishedStream {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let message =
            "the daemon's filler for this stream stopped unexpectedly (see the daemon's log)";
        tracing::error!("session error (Internal): {message}");
        // The lock may be poisoned by the panic being unwound; the socket is still sound.
        let socket = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let _ = transport::send(
            &socket,
            &Message::Error {
                code: ErrorCode::Internal,
                message: message.to_string(),
            },
            &[],
        );
        let _ = socket.shutdown(std::net::Shutdown::Both);
    }
}

/// The times a filler with nothing in flight found no free slot: how often, how long it slept on the
/// doorbell, and how many batches the consumer held (published and not released) when it looked.
#[derive(Debug, Default)]
struct FreeSlotWaits {
    waits: u64,
    sleeps: u64,
    slept_s: f64,
    held_sum: u64,
    held_max: u64,
}

impl RingHandoff {
    /// Takes the releases the consumer published since the last call, each checked: its sequence,
    /// its slot, and that the consumer held that slot. Returns how many it took.
    fn take_releases(&mut self) -> Result<u64, String> {
        let view = &self.handoff.view;
        let slot_count = view.slot_count();
        let ready = check_published(
            "release",
            view.releases_published(),
            self.releases_taken,
            slot_count,
        )
        .map_err(|e| e.to_string())?;
        for index in self.releases_taken..self.releases_taken + ready {
            let slot = decode_release(index, view.release_entry(index), slot_count)
                .map_err(|e| e.to_string())?;
            self.ring
                .transition(slot, Lease::Consumer, Lease::Free)
                .map_err(|e| {
                    RingError::Release {
                        index,
                        reason: e.to_string(),
                    }
                    .to_string()
                })?;
            self.metrics.move_slot(SlotLease::Consumer, SlotLease::Free);
            self.free.push_back(slot);
        }
        self.releases_taken += ready;
        Ok(ready)
    }

    /// Ends the stream because the consumer wrote something it may not into the ring.
    fn refuse(&mut self, reason: String) -> Ended {
        self.unfinished.armed = false;
        send_error(&self.writer, ErrorCode::BadRequest, reason);
        let socket = self.writer.lock().expect("socket lock poisoned");
        let _ = socket.shutdown(std::net::Shutdown::Both);
        Ended
    }
}

impl Handoff for RingHandoff {
    fn begin(&mut self) {
        self.unfinished.armed = true;
    }

    fn take_free(&mut self, wait: bool) -> Result<Option<u32>, Ended> {
        let mut counted = false;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                self.unfinished.armed = false;
                return Err(Ended);
            }
            if let Some(slot) = self.free.pop_front() {
                self.ring
                    .transition(slot, Lease::Free, Lease::Filling)
                    .expect("only free slots are in the queue");
                self.metrics.move_slot(SlotLease::Free, SlotLease::Filling);
                return Ok(Some(slot));
            }
            match self.take_releases() {
                Ok(0) => {}
                Ok(_) => continue,
                Err(reason) => return Err(self.refuse(reason)),
            }
            if !wait {
                return Ok(None);
            }
            let view = &self.handoff.view;
            if !counted {
                // Once per call, however many doorbell timeouts it sleeps through.
                counted = true;
                let held = self.batches_published - self.releases_taken;
                self.waits.waits += 1;
                self.waits.held_sum += held;
                self.waits.held_max = self.waits.held_max.max(held);
            }
            // Say that we sleep, then look once more: a release published before the consumer saw
            // the waiting word is found here; one published after it rings the doorbell.
            view.set_daemon_waiting(true);
            let found = self.take_releases();
            if matches!(found, Ok(0)) {
                let slept = std::time::Instant::now();
                self.handoff.daemon_bell.wait(None, RELEASE_WAIT_MS);
                self.handoff.daemon_bell.clear();
                self.waits.sleeps += 1;
                self.waits.slept_s += slept.elapsed().as_secs_f64();
            }
            self.handoff.view.set_daemon_waiting(false);
            if let Err(reason) = found {
                return Err(self.refuse(reason));
            }
        }
    }

    fn deliver(&mut self, filled: &[Filled]) -> Result<(), Ended> {
        let ready_ns = gpufeed_proto::protocol::monotonic_ns();
        let started = std::time::Instant::now();
        let plan = &self.plan;
        self.publishing.clear();
        let mut replaced = 0u64;
        for batch in filled {
            self.ring
                .transition(batch.slot, Lease::Filling, Lease::Consumer)
                .expect("the filler holds the lease");
            replaced += u64::from(batch.report.replaced);
            self.publishing.push(RingBatch {
                slot: batch.slot,
                samples: batch.report.samples,
                replaced: batch.report.replaced,
                epoch: plan.epoch,
                step: plan.epoch_step(batch.step),
                cursor_after: plan.cursor_after(batch.step),
                ready_ns,
            });
        }
        let count = filled.len() as u64;
        self.metrics
            .move_slots(SlotLease::Filling, SlotLease::Consumer, count);
        // One count store and one fence for the batches completed together (a group's), and one
        // doorbell at most.
        if self
            .handoff
            .view
            .publish_batches(self.batches_published, &self.publishing)
        {
            self.handoff.consumer_bell.ring();
        }
        self.batches_published += count;
        self.metrics
            .batches_served(count, replaced, started.elapsed());
        Ok(())
    }

    fn fail(&mut self, error: FillError) {
        self.unfinished.armed = false;
        let code = match error {
            FillError::Corrupt { .. } => ErrorCode::CorruptData,
            _ => ErrorCode::Internal,
        };
        let message = error.to_string();
        send_error(&self.writer, code, message);
        let socket = self.writer.lock().expect("socket lock poisoned");
        let _ = socket.shutdown(std::net::Shutdown::Both);
    }

    fn finish(&mut self) {
        self.unfinished.armed = false;
        let w = &self.waits;
        if w.waits > 0 {
            tracing::info!(
                "hand-off: {} waits for a free slot with nothing in flight, {} of them slept on the \
                 doorbell for {:.3} s; the consumer held {:.1} of {} slots on average at a wait (at \
                 most {})",
                w.waits,
                w.sleeps,
                w.slept_s,
                w.held_sum as f64 / w.waits as f64,
                self.plan.slot_count,
                w.held_max
            );
        }
        let end = Message::EndOfEpoch {
            epoch: self.plan.epoch,
            steps: self.plan.steps,
        };
        let _ = transport::send(
            &self.writer.lock().expect("socket lock poisoned"),
            &end,
            &[],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::CloseReason;

    /// Regression test: the error that closes a session from outside named its reason with Rust's
    /// `Debug` (`session closed by the daemon: DatasetRemoved`). Consumers read it in words now.
    #[test]
    fn a_closed_session_is_told_why_in_words() {
        for reason in [
            CloseReason::Operator,
            CloseReason::DatasetRemoved,
            CloseReason::Shutdown,
        ] {
            let (daemon_side, consumer_side) = UnixStream::pair().unwrap();
            let writer = Arc::new(Mutex::new(daemon_side.try_clone().unwrap()));
            session_closer(&daemon_side, &writer)(reason);
            let (message, _) = transport::recv(&consumer_side).unwrap();
            let Message::Error { code, message } = message else {
                panic!("expected an error frame, got {message:?}");
            };
            assert_eq!(code, ErrorCode::Closed);
            assert!(
                !message.contains(&format!("{reason:?}")),
                "Debug text sent to a consumer: {message}"
            );
            assert!(
                message.starts_with("session closed by the daemon: ")
                    && message.split(' ').all(|word| !has_inner_capital(word)),
                "{message}"
            );
        }
    }

    /// A filler thread that panics drops its hand-off while unwinding: the consumer gets an
    /// `Internal` error and the socket is shut, instead of waiting for batches forever (a panicking
    /// filler once left a GPU test's consumer waiting until the test's time ran out). A stream that
    /// ended any other way sends nothing more.
    #[test]
    fn a_filler_that_panics_fails_its_stream_for_the_consumer() {
        let (daemon_side, consumer_side) = UnixStream::pair().unwrap();
        let writer = Arc::new(Mutex::new(daemon_side));
        let guard = UnfinishedStream {
            writer: Arc::clone(&writer),
            armed: true,
        };
        let filler = std::thread::spawn(move || {
            let _guard = guard;
            panic!("a filler's bug");
        });
        assert!(filler.join().is_err());
        let (message, _) = transport::recv(&consumer_side).unwrap();
        let Message::Error { code, message } = message else {
            panic!("expected an error frame, got {message:?}");
        };
        assert_eq!(code, ErrorCode::Internal);
        assert!(message.contains("stopped unexpectedly"), "{message}");
        // Shut: the consumer reads the end of the socket next.
        assert!(transport::recv(&consumer_side).is_err());

        let (daemon_side, consumer_side) = UnixStream::pair().unwrap();
        let writer = Arc::new(Mutex::new(daemon_side));
        let mut guard = UnfinishedStream {
            writer: Arc::clone(&writer),
            armed: true,
        };
        guard.armed = false;
        drop(guard);
        consumer_side.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        let read = std::io::Read::read(&mut &consumer_side, &mut byte);
        assert!(
            matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a disarmed guard sent something: {read:?}"
        );
    }

    /// Whether `word` looks like a Rust identifier in CamelCase (`DatasetRemoved`), not a word (a
    /// lower-case letter followed by a capital; `API` passes).
    fn has_inner_capital(word: &str) -> bool {
        let letters: Vec<char> = word.chars().collect();
        letters
            .windows(2)
            .any(|pair| pair[0].is_lowercase() && pair[1].is_uppercase())
    }
}
