//! `gpufeed demo`: the whole job on a generated dataset, with timings.
//!
//! It packs an embedding-like fp16 field and a token-like int32 field, verifies every block, starts the
//! daemon, pulls a whole epoch of batches through the client crate (embeddings converted to f32), and
//! checks every served value against the source. It prints the backend it chose and why, one line per
//! stage, and a final JSON line.
//!
//! The backend follows `--device` ([`DeviceRequest`]): `auto` takes the GPU backend on CUDA device 0
//! when the driver loads, the device exists and NVRTC loads, else the CPU backend.
//!
//! - **CPU backend**: the daemon's socket server runs in this process and the consumer reads the slots
//!   (shared host memory) in place, copying each batch out as it goes; the serve time includes those
//!   copies.
//! - **GPU backend**: the daemon is this executable's `gpufeed serve --device cuda:N`, a child process,
//!   because a consumer maps the daemon's slots and opens their interprocess events, which CUDA does
//!   not allow in the process that exported them. The consumer (this process) receives device-resident
//!   batches and, in the timed loop, copies each one once on the device into an epoch buffer, as a
//!   trainer reading it would (the copies are queued on the stream the batches are delivered on, so
//!   the daemon reuses a slot only after they are done). After the timer stops, the epoch buffer is
//!   copied to the host (timed and printed separately) and checked like the CPU backend's batches.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use gpufeed_client::consumer::{Client, ClientError, FieldData, FieldView};
use gpufeed_client::protocol::{Backend, Device as SlotDevice, FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::DType;
use serde_json::json;

use crate::daemon::DeviceRequest;
use crate::decode::{self, ConvertError};
use crate::device::{self, Device, DeviceBuffer, DeviceError, DeviceMemory, Stream};
use crate::format::{Dataset, FormatError, BLOCK_BYTES_DEFAULT};
use crate::input::{FieldSource, InputError};
use crate::ipc::{Server, ServerConfig};
use crate::pack::{self, CodecChoice, OnExisting, PackError, PackOptions, Quiet, ShuffleChoice};
use crate::pipeline::StreamLimits;
use crate::registry::Registry;
use crate::synth;
use crate::tools::{self, NoProgress};

/// Elements per sample of the embedding field.
const EMBEDDING_DIM: u64 = 256;
/// Tokens per sample of the token field.
const SEQUENCE_TOKENS: u64 = 128;
/// Samples per batch pulled by the demo consumer.
const BATCH_SIZE: u32 = 256;
/// Largest share of the device's memory the GPU demo keeps the served epoch in (for the check), in
/// percent; the daemon needs the rest.
const EPOCH_DEVICE_MEMORY_PERCENT_MAX: u64 = 25;

/// Why the demo failed. Each variant names the step; the cause, where there is one, is its source.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// `--samples 0`.
    #[error("--samples must be at least 1")]
    NoSamples,
    /// The CUDA device asked for cannot serve.
    #[error("--device {request}")]
    Gpu {
        /// The request.
        request: DeviceRequest,
        /// Why.
        source: DeviceError,
    },
    /// A file or process operation failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The generated data could not be made into fields.
    #[error(transparent)]
    Input(#[from] InputError),
    /// Packing failed.
    #[error(transparent)]
    Pack(#[from] PackError),
    /// The packed dataset does not open or verify.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Verification found problems.
    #[error("verify found problems: {0:?}")]
    Verify(Vec<String>),
    /// The dataset could not be registered with the in-process socket server.
    #[error("registering the demo dataset: {0}")]
    Register(String),
    /// The consumer failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A device operation of the GPU consumer failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The expected values could not be computed.
    #[error(transparent)]
    Convert(#[from] ConvertError),
    /// The daemon did not start, stop or serve as expected.
    #[error("{0}")]
    Daemon(String),
    /// What was served is not what was packed, or not in the shape asked for.
    #[error("{0}")]
    Check(String),
}

/// `Err(DemoError::Io)` naming `what` for an I/O failure.
fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Io { what, source }
}

type Result<T, E = DemoError> = std::result::Result<T, E>;

/// What `gpufeed demo` was asked to do.
pub struct DemoOptions {
    /// Work directory; a fresh temporary directory (removed afterwards) when `None`.
    pub dir: Option<PathBuf>,
    /// Samples to generate.
    pub samples: u64,
    /// Which backend serves the batches.
    pub device: DeviceRequest,
    /// The `gpufeed` executable, started as `gpufeed serve` for the GPU backend.
    pub gpufeed_binary: PathBuf,
}

/// The backend the demo serves from, with the reason it was chosen.
enum DemoBackend {
    /// The socket server in this process, serving host memory.
    Cpu { reason: String },
    /// `gpufeed serve --device cuda:N` as a child process, serving device memory.
    Gpu {
        device: Device,
        ordinal: u32,
        reason: String,
    },
}

impl DemoBackend {
    /// Chooses the backend `request` asks for; `cuda:N` fails when that device cannot serve.
    fn choose(request: DeviceRequest) -> Result<DemoBackend> {
        match request {
            DeviceRequest::Cpu => Ok(DemoBackend::Cpu {
                reason: "--device cpu".to_string(),
            }),
            DeviceRequest::Cuda(ordinal) => {
                let device =
                    probe_gpu(ordinal).map_err(|source| DemoError::Gpu { request, source })?;
                Ok(DemoBackend::Gpu {
                    device,
                    ordinal,
                    reason: format!("--device {request}"),
                })
            }
            DeviceRequest::Auto => match probe_gpu(0) {
                Ok(device) => Ok(DemoBackend::Gpu {
                    device,
                    ordinal: 0,
                    reason: "--device auto: the CUDA driver and NVRTC load, and device 0 exists"
                        .to_string(),
                }),
                Err(error) => Ok(DemoBackend::Cpu {
                    reason: format!("--device auto found no usable GPU: {error}"),
                }),
            },
        }
    }

    /// `cpu` or `cuda:N`, as the final JSON line names it.
    fn device_name(&self) -> String {
        match self {
            DemoBackend::Cpu { .. } => "cpu".to_string(),
            DemoBackend::Gpu { ordinal, .. } => format!("cuda:{ordinal}"),
        }
    }

    /// One line saying which backend and why.
    fn describe(&self) -> String {
        match self {
            DemoBackend::Cpu { reason } => format!("cpu, batches in host memory ({reason})"),
            DemoBackend::Gpu {
                device,
                ordinal,
                reason,
            } => format!(
                "cuda:{ordinal} ({}), batches in device memory ({reason})",
                device.properties().name
            ),
        }
    }
}

/// Opens CUDA device `ordinal` and checks what the GPU backend needs before the daemon is started:
/// the driver, the device, memory that can be shared with another process, and NVRTC (the daemon
/// compiles its kernels).
fn probe_gpu(ordinal: u32) -> Result<Device, DeviceError> {
    let device = Device::open(ordinal as usize)?;
    if !device.properties().exportable_memory {
        return Err(DeviceError::Unavailable {
            reason: format!(
                "CUDA device {ordinal} cannot share its memory with another process (POSIX file descriptor handles)"
            ),
        });
    }
    device::nvrtc_ready()?;
    Ok(device)
}

/// What a pass over the epoch brought back.
struct Served {
    batches: u64,
    /// The timed part: from connecting to the last batch being done with.
    seconds: f64,
    /// The served embeddings (f32) and tokens, in the order served.
    embedding: Vec<u8>,
    tokens: Vec<u8>,
}

/// Runs the demo as `demo` says.
pub fn run(demo: &DemoOptions) -> Result<()> {
    let samples = demo.samples;
    if samples == 0 {
        return Err(DemoError::NoSamples);
    }
    let temporary;
    let dir = match &demo.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .map_err(io_error(format!("creating {}", dir.display())))?;
            dir.clone()
        }
        None => {
            temporary = tempfile::Builder::new()
                .prefix("gpufeed-demo-")
                .tempdir()
                .map_err(io_error("creating a temporary directory"))?;
            temporary.path().to_path_buf()
        }
    };
    println!("gpufeed demo in {}", dir.display());
    let backend = DemoBackend::choose(demo.device)?;
    println!("backend: {}", backend.describe());

    let started = Instant::now();
    let embeddings = synth::embedding_f16((samples * EMBEDDING_DIM) as usize, 1);
    let tokens = synth::zipf_tokens_i32((samples * SEQUENCE_TOKENS) as usize, 2);
    println!(
        "generated {samples} samples: 'embedding' f16[{EMBEDDING_DIM}] and 'tokens' i32[{SEQUENCE_TOKENS}] ({:.1} MB) in {:.2} s",
        (embeddings.len() + tokens.len()) as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    let fields = vec![
        FieldSource::from_bytes(
            "embedding",
            DType::F16,
            vec![EMBEDDING_DIM],
            embeddings.clone(),
        )?,
        FieldSource::from_bytes("tokens", DType::I32, vec![SEQUENCE_TOKENS], tokens.clone())?,
    ];

    let dataset_dir = dir.join("demo-dataset");
    let options = PackOptions {
        name: "demo".into(),
        block_bytes: BLOCK_BYTES_DEFAULT,
        samples_per_shard: Some(samples.div_ceil(4)),
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Replace,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let started = Instant::now();
    let summary = pack::pack(&dataset_dir, &fields, &options, &Quiet)?;
    let pack_seconds = started.elapsed().as_secs_f64();
    println!(
        "pack:   {} shards, {:.1} MB raw -> {:.1} MB stored in {:.3} s ({:.2} GB/s)",
        summary.shard_count,
        summary.raw_bytes as f64 / 1e6,
        summary.stored_bytes as f64 / 1e6,
        pack_seconds,
        summary.raw_bytes as f64 / pack_seconds / 1e9
    );
    let dataset = Dataset::open(&dataset_dir)?;
    for field in tools::inspect(&dataset)["fields"]
        .as_array()
        .into_iter()
        .flatten()
    {
        println!(
            "        field '{}': ratio {}, blocks {}",
            field["name"].as_str().unwrap_or("?"),
            field["ratio"],
            field["codecs"]
        );
    }

    let started = Instant::now();
    let report = tools::verify(&dataset_dir, &NoProgress)?;
    let verify_seconds = started.elapsed().as_secs_f64();
    if !report.problems.is_empty() {
        return Err(DemoError::Verify(report.problems));
    }
    println!(
        "verify: {} blocks intact in {:.3} s ({:.2} GB/s of raw data)",
        report.blocks_ok,
        verify_seconds,
        summary.raw_bytes as f64 / verify_seconds / 1e9
    );

    let served = match &backend {
        DemoBackend::Cpu { .. } => serve_cpu(&dir, dataset)?,
        DemoBackend::Gpu {
            device, ordinal, ..
        } => {
            // The daemon process opens the dataset itself.
            drop(dataset);
            serve_gpu(&dir, &demo.gpufeed_binary, device, *ordinal)?
        }
    };

    let served_samples = served.batches * BATCH_SIZE as u64;
    let served_count = served_samples as usize;
    let mut expected = vec![0u8; served_count * EMBEDDING_DIM as usize * 4];
    decode::convert(
        DType::F16,
        &embeddings[..served_count * EMBEDDING_DIM as usize * 2],
        DType::F32,
        &mut expected,
    )?;
    if served.embedding != expected {
        return Err(DemoError::Check(
            "served embeddings differ from the source".into(),
        ));
    }
    if served.tokens[..] != tokens[..served_count * SEQUENCE_TOKENS as usize * 4] {
        return Err(DemoError::Check(
            "served tokens differ from the source".into(),
        ));
    }
    println!("check:  every served value equals the source");
    println!(
        "{}",
        json!({
            "samples": samples,
            "raw_bytes": summary.raw_bytes,
            "stored_bytes": summary.stored_bytes,
            "pack_seconds": pack_seconds,
            "verify_seconds": verify_seconds,
            "batches": served.batches,
            "serve_seconds": served.seconds,
            "samples_per_second": served_samples as f64 / served.seconds,
            "device": backend.device_name(),
        })
    );
    Ok(())
}

/// The stream the demo consumer asks for: both fields, embeddings converted to f32, dataset order.
fn demo_spec() -> StreamSpec {
    let mut spec = StreamSpec::new("demo", BATCH_SIZE);
    spec.fields = vec![
        FieldRequest {
            name: "embedding".into(),
            dtype: Some(DType::F32),
        },
        FieldRequest {
            name: "tokens".into(),
            dtype: None,
        },
    ];
    spec.shuffle = Shuffle::None;
    spec
}

/// The CPU backend: the daemon's socket server in this process, a consumer through the client crate
/// copying every batch out of the shared host memory as it arrives (timed with the pulls).
fn serve_cpu(dir: &Path, dataset: Dataset) -> Result<Served> {
    let registry = Arc::new(Registry::new());
    registry.insert(dataset).map_err(DemoError::Register)?;
    let socket_path = dir.join("gpufeed-demo.sock");
    let server = Server::bind(
        ServerConfig {
            socket_path: socket_path.clone(),
            allowed_uids: vec![nix::unistd::getuid().as_raw()],
            sessions_max: 4,
            slot_memory_bytes_max: 1 << 30,
            stream_limits: StreamLimits::node_defaults(),
            metrics: Arc::new(crate::metrics::Metrics::new()),
            gpus: Vec::new(),
            handshake_timeout: crate::ipc::HANDSHAKE_TIMEOUT_DEFAULT,
        },
        registry,
    )
    .map_err(io_error(format!("binding {}", socket_path.display())))?;
    std::thread::Builder::new()
        .name("gpufeed-demo-server".into())
        .spawn(move || server.run())
        .map_err(io_error("starting the socket server's thread"))?;
    let started = Instant::now();
    let mut stream = Client::connect(&socket_path)?.open_stream(demo_spec())?;
    let (mut embedding_out, mut tokens_out) = (Vec::new(), Vec::new());
    let (mut batches, mut served_bytes) = (0u64, 0u64);
    for batch in stream.by_ref() {
        let batch = batch?;
        let (embedding, tokens) = demo_fields(&batch)?;
        embedding.copy_to_host(&mut embedding_out)?;
        tokens.copy_to_host(&mut tokens_out)?;
        served_bytes += (embedding.byte_len() + tokens.byte_len()) as u64;
        batches += 1;
    }
    let serve_seconds = started.elapsed().as_secs_f64();
    let served_samples = batches * BATCH_SIZE as u64;
    println!(
        "serve:  {batches} batches of {BATCH_SIZE} ({served_samples} samples, embedding as f32) through the socket in {:.3} s: {:.0} samples/s, {:.2} GB/s delivered",
        serve_seconds,
        served_samples as f64 / serve_seconds,
        served_bytes as f64 / serve_seconds / 1e9
    );
    Ok(Served {
        batches,
        seconds: serve_seconds,
        embedding: embedding_out,
        tokens: tokens_out,
    })
}

/// The GPU backend: `gpufeed serve --device cuda:ORDINAL` as a child process on the datasets under
/// `dir`, and this process as its consumer on `device`. See the module documentation for what is timed.
fn serve_gpu(dir: &Path, gpufeed_binary: &Path, device: &Device, ordinal: u32) -> Result<Served> {
    let socket_path = dir.join("gpufeed-demo.sock");
    let started = Instant::now();
    let daemon = DaemonProcess::start(gpufeed_binary, dir, &socket_path, ordinal)?;
    println!(
        "daemon: `gpufeed serve --device cuda:{ordinal}` (pid {}) ready in {:.2} s (its kernels compiled, or loaded from the cache)",
        daemon.child.id(),
        started.elapsed().as_secs_f64()
    );

    // Declared before the batch stream, so that it outlives every batch delivered on it.
    let cuda_stream = Stream::new(device)?;
    let started = Instant::now();
    let client = Client::connect(&socket_path)?;
    if client.backend() != Backend::Cuda {
        return Err(DemoError::Daemon(format!(
            "the daemon started with --device cuda:{ordinal} serves from host memory"
        )));
    }
    let mut spec = demo_spec();
    spec.device = SlotDevice::Cuda(ordinal);
    let mut stream = client.open_stream(spec)?;
    // SAFETY: `cuda_stream` belongs to the primary context of CUDA device `ordinal` (crate::device
    // works in primary contexts, as the client does) and is dropped after `stream` and its batches.
    unsafe { stream.set_cuda_stream(cuda_stream.raw() as *mut std::ffi::c_void) };
    let steps = stream.layout().steps;
    let epoch_bytes = |name: &str| -> Result<u64> {
        let field = stream
            .layout()
            .fields
            .iter()
            .find(|field| field.name == name)
            .ok_or_else(|| DemoError::Check(format!("the stream has no field '{name}'")))?;
        Ok(steps * field.batch_bytes)
    };
    let (embedding_bytes, tokens_bytes) = (epoch_bytes("embedding")?, epoch_bytes("tokens")?);
    let memory_bytes = device.properties().memory_bytes;
    if (embedding_bytes + tokens_bytes) * 100 > memory_bytes * EPOCH_DEVICE_MEMORY_PERCENT_MAX {
        return Err(DemoError::Check(format!(
            "the served epoch ({:.1} MB) would take more than {EPOCH_DEVICE_MEMORY_PERCENT_MAX} % of cuda:{ordinal}'s {:.1} GB, where the demo keeps it for the check: pass fewer --samples",
            (embedding_bytes + tokens_bytes) as f64 / 1e6,
            memory_bytes as f64 / 1e9
        )));
    }
    let embedding_epoch = DeviceBuffer::new(device, embedding_bytes as usize)?;
    let tokens_epoch = DeviceBuffer::new(device, tokens_bytes as usize)?;
    let (mut embedding_filled, mut tokens_filled) = (0usize, 0usize);
    let mut batches = 0u64;
    for batch in stream.by_ref() {
        let batch = batch?;
        let (embedding, tokens) = demo_fields(&batch)?;
        copy_on_device(
            &cuda_stream,
            &embedding,
            &embedding_epoch,
            &mut embedding_filled,
        )?;
        copy_on_device(&cuda_stream, &tokens, &tokens_epoch, &mut tokens_filled)?;
        batches += 1;
        // Dropping the batch records its release on `cuda_stream`, after the copies.
    }
    cuda_stream.synchronize()?;
    let serve_seconds = started.elapsed().as_secs_f64();
    drop(stream);
    let served_bytes = (embedding_filled + tokens_filled) as u64;
    let served_samples = batches * BATCH_SIZE as u64;
    println!(
        "serve:  {batches} batches of {BATCH_SIZE} ({served_samples} samples, embedding as f32) in device memory on cuda:{ordinal}, from the daemon process through the socket, in {:.3} s: {:.0} samples/s, {:.2} GB/s delivered",
        serve_seconds,
        served_samples as f64 / serve_seconds,
        served_bytes as f64 / serve_seconds / 1e9
    );

    let started = Instant::now();
    let mut embedding_out = vec![0u8; embedding_filled];
    embedding_epoch.read(0, &mut embedding_out)?;
    let mut tokens_out = vec![0u8; tokens_filled];
    tokens_epoch.read(0, &mut tokens_out)?;
    println!(
        "        timed: pulling each batch and copying it once on the device, as a trainer reads it; then the epoch ({:.1} MB) was copied to the host for the check in {:.3} s, not timed above",
        served_bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    daemon.stop()?;
    Ok(Served {
        batches,
        seconds: serve_seconds,
        embedding: embedding_out,
        tokens: tokens_out,
    })
}

/// The two fields of a demo batch.
fn demo_fields(batch: &gpufeed_client::consumer::Batch) -> Result<(FieldView<'_>, FieldView<'_>)> {
    let field = |name: &str| {
        batch
            .field(name)
            .ok_or_else(|| DemoError::Check(format!("batch without '{name}'")))
    };
    Ok((field("embedding")?, field("tokens")?))
}

/// A field of a batch in device memory, as the client mapped it.
struct MappedField {
    ptr: u64,
    bytes: usize,
}

impl DeviceMemory for MappedField {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.bytes
    }
}

/// Queues on `stream` a copy of `field` (in device memory) into `epoch` at `*filled`, and advances
/// `*filled` past it.
fn copy_on_device(
    stream: &Stream,
    field: &FieldView<'_>,
    epoch: &DeviceBuffer,
    filled: &mut usize,
) -> Result<()> {
    let FieldData::Device { ptr, bytes } = field.data else {
        return Err(DemoError::Check(format!(
            "field '{}' arrived in host memory on a stream of a CUDA device",
            field.name
        )));
    };
    // SAFETY: the source is the batch's slot, which `stream` waits on before the copy (the client made
    // it wait for the slot's ready event) and which the daemon writes again only after the release
    // event that dropping the batch records on `stream`, after this copy. `epoch` outlives the copy:
    // the caller synchronises `stream` before reading or dropping it. The destination range is
    // checked against `epoch` and written by nothing else.
    unsafe {
        device::copy_async(
            stream,
            &MappedField { ptr, bytes },
            0,
            epoch,
            *filled,
            bytes,
        )
    }?;
    *filled += bytes;
    Ok(())
}

/// `gpufeed serve` started by the demo for the GPU backend; killed if still running when dropped.
struct DaemonProcess {
    child: Child,
    /// Its standard error (the daemon's log), shown when it fails.
    log_path: PathBuf,
}

impl DaemonProcess {
    /// Starts `gpufeed_binary serve` on the datasets under `data_root`, listening on `socket` (no HTTP
    /// control API), and waits for its readiness line.
    fn start(
        gpufeed_binary: &Path,
        data_root: &Path,
        socket: &Path,
        ordinal: u32,
    ) -> Result<DaemonProcess> {
        let log_path = data_root.join("gpufeed-demo-daemon.log");
        let log = File::create(&log_path)
            .map_err(io_error(format!("creating {}", log_path.display())))?;
        let child = Command::new(gpufeed_binary)
            .arg("serve")
            .arg("--data-root")
            .arg(data_root)
            .arg("--socket")
            .arg(socket)
            .args(["--device", &format!("cuda:{ordinal}"), "--http", "off"])
            // Its log is a file, shown as text when it fails.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(io_error(format!(
                "starting {} serve",
                gpufeed_binary.display()
            )))?;
        let mut daemon = DaemonProcess { child, log_path };
        // The daemon prints one line once it accepts connections; anything else (or nothing: it
        // exited) means it did not start.
        let mut line = String::new();
        let stdout = daemon.child.stdout.take().expect("stdout is piped");
        let read = BufReader::new(stdout).read_line(&mut line);
        if read.is_err() || !line.starts_with("gpufeed: serving") {
            let _ = daemon.child.kill();
            let status = daemon
                .child
                .wait()
                .map_err(io_error("waiting for the daemon"))?;
            return Err(DemoError::Daemon(format!(
                "`gpufeed serve --device cuda:{ordinal}` did not start ({status}, first line {line:?}); its log:\n{}",
                daemon.log()
            )));
        }
        Ok(daemon)
    }

    /// Stops the daemon as an operator would (SIGTERM: it closes the sessions and removes its socket)
    /// and waits for it; an exit other than 0 is an error carrying its log.
    fn stop(mut self) -> Result<()> {
        // SAFETY: kill(2) on our own child, which has not been waited for, so its pid is still ours.
        if unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) } != 0 {
            return Err(io_error("sending SIGTERM to the daemon")(
                std::io::Error::last_os_error(),
            ));
        }
        // Bounded: the daemon's shutdown waits a bounded time for each part.
        let status = self
            .child
            .wait()
            .map_err(io_error("waiting for the daemon"))?;
        if !status.success() {
            return Err(DemoError::Daemon(format!(
                "the daemon ended with {status} after SIGTERM; its log:\n{}",
                self.log()
            )));
        }
        Ok(())
    }

    /// The daemon's log so far, or why it cannot be read.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path)
            .unwrap_or_else(|error| format!("({}: {error})", self.log_path.display()))
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
