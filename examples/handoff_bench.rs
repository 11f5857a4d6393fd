//! Hand-off benchmark: a batch-size sweep of the pipeline alone beside a consumer process pulling the
//! same batches from a daemon through the shared-memory hand-off ring.
//!
//! ```text
//! cargo run --release --example handoff_bench -- --consume-bin target/release/examples/consume \
//!     [--device cpu|cuda:N] [--row-bytes 1024] [--samples 262144] [--batch-sizes 16,64,256,1024] \
//!     [--runs 3] [--min-batches 10000] [--dtype f32] [--shuffle none|window|full] [--out FILE.jsonl]
//! ```
//!
//! The dataset is generated: one field `data` of fp16 rows of `--row-bytes` bytes, packed raw into
//! 64 KiB blocks. For each batch size, a run is `E` epochs, as many as give at least
//! `--min-batches` batches; each run measures
//! - the **pipeline alone**: the assembler (CPU, or GPU with the daemon's page-cache windows) filling
//!   every step of the `E` epochs into as many slots as the daemon's ring has, in turn, a stream
//!   plan per epoch, no socket, no consumer;
//! - a **consumer process** (the `consume` example, `--epochs E`) pulling the same batches from a
//!   daemon running in this process. Its clock starts before it connects; the hand-off latency of
//!   each batch runs from the batch being ready (or from the consumer asking, if it asked later)
//!   to its arrival, and p50 / p99 / max are over every batch of the run. CPU time is counted over
//!   the consumer's run only: this process (the daemon) and the consumer process, each in cores.
//!
//! Prints a JSON line per run and a `"median"` line per batch size (the median of the runs), and
//! appends them to `--out` when given.

#[path = "support/bench.rs"]
#[allow(dead_code)] // each benchmark uses part of the support module
mod bench;

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::ipc::{Server, ServerConfig};
use gpufeed::metrics::Metrics;
use gpufeed::pack::{CodecChoice, OnExisting};
use gpufeed::pipeline::{Assembler, GpuBackend, StreamLimits, StreamPlan, StreamRequest};
use gpufeed::registry::Registry;
use gpufeed::synth;
use gpufeed_client::protocol::{Device, FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::DType;
use serde_json::{json, Value};

#[derive(Parser)]
struct Args {
    /// The `consume` example binary.
    #[arg(long)]
    consume_bin: PathBuf,
    /// `cpu`, or `cuda:N` for the GPU backend on device N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Bytes of one stored fp16 row.
    #[arg(long, default_value_t = 1024)]
    row_bytes: usize,
    /// Rows in the dataset.
    #[arg(long, default_value_t = 262_144)]
    samples: u64,
    /// Batch sizes to measure, in rows.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256,1024,4096")]
    batch_sizes: Vec<u32>,
    /// Runs per batch size.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Least batches in a run (whole epochs are added until there are this many).
    #[arg(long, default_value_t = 10_000)]
    min_batches: u64,
    /// Unmeasured runs at the first batch size before the measured ones (kept in the output as
    /// `"kind": "warmup"`).
    #[arg(long, default_value_t = 1)]
    warmup_runs: u32,
    /// Deliver the rows converted to this dtype (default: as stored, fp16).
    #[arg(long)]
    dtype: Option<DType>,
    /// Sample order.
    #[arg(long, default_value = "none")]
    shuffle: String,
    /// Where the dataset is packed (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// With --dir: reuse the dataset packed there by an earlier run with the same --samples and
    /// --row-bytes (recorded beside it when its packing completed) instead of packing it again.
    #[arg(long, requires = "dir")]
    reuse: bool,
    /// Append the JSON lines to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The order `--shuffle` names, and its name for the `consume` example.
fn shuffle(args: &Args) -> Result<Shuffle> {
    Ok(match args.shuffle.as_str() {
        "none" => Shuffle::None,
        "window" => Shuffle::Window(4),
        "full" => Shuffle::Full,
        other => bail!("--shuffle {other}: expected none, window or full"),
    })
}

/// The CPUs the pipeline-alone measurement keeps off: those servicing the device's interrupts.
static PIPELINE_AVOIDS: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();

fn main() -> Result<()> {
    let args = Args::parse();
    // With GPUFEED_LOG set (as for the daemon, e.g. `info`), the in-process daemon's log goes to
    // stderr: its filler's per-stream line says where a stream's time went (waiting for the device,
    // for a free slot, delivering).
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("GPUFEED_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    if args.row_bytes % 2 != 0 || args.row_bytes == 0 {
        bail!(
            "--row-bytes {}: fp16 rows need an even, non-zero byte count",
            args.row_bytes
        );
    }
    let device = match args.device.as_str() {
        "cpu" => Device::Cpu,
        other => match other.strip_prefix("cuda:").map(str::parse::<u32>) {
            Some(Ok(ordinal)) => Device::Cuda(ordinal),
            _ => bail!("--device {other}: expected cpu or cuda:N"),
        },
    };
    // The pipeline alone runs on this thread: while it runs, off the device's interrupt CPUs, like
    // the daemon's fillers and the consumer (unless --avoid-irq-cpus off / GPUFEED_AVOID_IRQ_CPUS=off, as for the fillers).
    // Only then: the in-process daemon's threads and the consumer process choose for themselves.
    let gpu_settings = gpufeed::config::GpuSettings::from_environment()?;
    if let Device::Cuda(ordinal) = device {
        if gpu_settings.interrupt_cpus == gpufeed::config::InterruptCpus::Avoid {
            match gpufeed_client::cuda::pci_address(ordinal) {
                Ok(address) => {
                    let _ = PIPELINE_AVOIDS.set(gpufeed_client::affinity::interrupt_cpus(&address));
                }
                Err(error) => eprintln!(
                    "cuda:{ordinal}: no PCI address ({}): CPUs not chosen",
                    error.0
                ),
            }
        }
    }
    let backend = match device {
        Device::Cuda(ordinal) => Some(Arc::new(gpufeed::daemon::open_gpu_backend(
            ordinal,
            gpufeed::storage::EngineMode::Auto,
            &gpu_settings,
        )?)),
        Device::Cpu => None,
    };
    let temp = tempfile::tempdir()?;
    let root = args
        .dir
        .clone()
        .unwrap_or_else(|| temp.path().to_path_buf());
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let name = "handoff-bench";
    let width = args.row_bytes / 2;
    let packing = Instant::now();
    // What the generated dataset is made from: the same words, the same bytes (the generator is
    // seeded).
    let packed_from = root.join(format!("{name}.packed-from"));
    let wanted = format!(
        "samples {} row_bytes {} seed 1 raw",
        args.samples, args.row_bytes
    );
    let reusable = args.reuse
        && std::fs::read_to_string(&packed_from).is_ok_and(|recorded| recorded == wanted);
    let dataset = if reusable {
        let dataset = Arc::new(gpufeed::format::Dataset::open(&root.join(name))?);
        eprintln!(
            "reusing the dataset packed in {} ({wanted})",
            root.join(name).display()
        );
        dataset
    } else {
        // Recorded again only once the packing is complete.
        let _ = std::fs::remove_file(&packed_from);
        let dataset = bench::pack_dataset(
            &root.join(name),
            name,
            &[FieldSource::from_bytes(
                "data",
                DType::F16,
                vec![width as u64],
                synth::embedding_f16(args.samples as usize * width, 1),
            )?],
            CodecChoice::Raw,
            OnExisting::Replace,
        )?;
        std::fs::write(&packed_from, &wanted)
            .with_context(|| format!("writing {}", packed_from.display()))?;
        eprintln!(
            "packed {} rows of {} bytes in {:.1} s",
            args.samples,
            args.row_bytes,
            packing.elapsed().as_secs_f64()
        );
        dataset
    };
    // Page cache warm and clean: the packer's writes reach the disk before the clock runs (write-back
    // during a run would be measured with it), then every shard is read once.
    // SAFETY: sync takes no arguments.
    unsafe { libc::sync() };
    for entry in std::fs::read_dir(root.join(name))? {
        let path = entry?.path();
        if path.is_file() {
            std::io::copy(&mut std::fs::File::open(&path)?, &mut std::io::sink())?;
        }
    }

    let registry = Arc::new(Registry::new());
    registry
        .insert_shared(Arc::clone(&dataset))
        .map_err(anyhow::Error::msg)?;
    let limits = StreamLimits::node_defaults();
    let socket = root.join("handoff-bench.sock");
    let server = Server::bind(
        ServerConfig {
            socket_path: socket.clone(),
            allowed_uids: vec![nix::unistd::getuid().as_raw()],
            sessions_max: 4,
            slot_memory_bytes_max: 16 << 30,
            stream_limits: limits,
            metrics: Arc::new(Metrics::new()),
            gpus: backend.iter().cloned().collect(),
            handshake_timeout: gpufeed::ipc::HANDSHAKE_TIMEOUT_DEFAULT,
        },
        registry,
    )?;
    std::thread::spawn(move || server.run());

    let mut out = match &args.out {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?,
        ),
        None => None,
    };
    let mut emit = |line: Value| -> Result<()> {
        println!("{line}");
        if let Some(file) = &mut out {
            writeln!(file, "{line}")?;
        }
        Ok(())
    };
    let date = String::from_utf8(
        Command::new("date")
            .arg("-u")
            .arg("+%FT%TZ")
            .output()?
            .stdout,
    )?;
    // Warm-up runs at the first batch size, kept in the output as "warmup" lines and left out of the
    // medians: the first pipeline-alone epochs of a process ran at half speed or less (their first
    // registrations and launches), which made the first measured run's ratio meaningless.
    let measure_at = |batch_size, run| {
        measure(
            &args,
            &dataset,
            backend.as_deref(),
            &limits,
            &socket,
            device,
            batch_size,
            run,
        )
    };
    for run in 0..args.warmup_runs {
        let first_size = *args.batch_sizes.first().context("no batch size")?;
        let mut line = measure_at(first_size, run)?;
        line["kind"] = json!("warmup");
        line["date"] = json!(date.trim());
        emit(line)?;
    }
    for &batch_size in &args.batch_sizes {
        let mut runs = Vec::new();
        for run in 0..args.runs {
            let mut line = measure_at(batch_size, run)?;
            line["date"] = json!(date.trim());
            emit(line.clone())?;
            runs.push(line);
        }
        emit(median_line(&runs))?;
    }
    Ok(())
}

/// The stream spec of one epoch.
fn spec(args: &Args, batch_size: u32, device: Device, epoch: u64) -> Result<StreamSpec> {
    let mut spec = StreamSpec::new("handoff-bench", batch_size);
    spec.fields = vec![FieldRequest {
        name: "data".into(),
        dtype: args.dtype,
    }];
    spec.device = device;
    spec.shuffle = shuffle(args)?;
    spec.epoch = epoch;
    Ok(spec)
}

/// One run at one batch size: the pipeline alone, then the consumer process.
#[allow(clippy::too_many_arguments)]
fn measure(
    args: &Args,
    dataset: &Arc<Dataset>,
    backend: Option<&GpuBackend>,
    limits: &StreamLimits,
    socket: &std::path::Path,
    device: Device,
    batch_size: u32,
    run: u32,
) -> Result<Value> {
    let first = StreamPlan::new(
        Arc::clone(dataset),
        &StreamRequest::from(&spec(args, batch_size, device, 0)?),
        limits,
    )?;
    if first.steps == 0 {
        bail!(
            "batch size {batch_size}: the dataset of {} rows has no full batch",
            args.samples
        );
    }
    let epochs = args.min_batches.div_ceil(first.steps);
    let batches = epochs * first.steps;
    let batch_bytes_out: u64 = first
        .fields
        .iter()
        .map(|field| field.sample_bytes_out as u64 * u64::from(batch_size))
        .sum();
    let delivered_bytes = batch_bytes_out * batches;
    let input_bytes = args.row_bytes as u64 * u64::from(batch_size) * batches;

    // The pipeline alone, off the device's interrupt CPUs until the consumer's turn.
    let off_interrupt_cpus = gpufeed::device::numa::BoundForNow::new(None)
        .avoiding(PIPELINE_AVOIDS.get().map_or(&[], Vec::as_slice));
    let started = Instant::now();
    let mut device_seconds = 0.0;
    // The GPU pipeline's host phases summed over the epochs (see `GpuFillTimings`): where a batch's
    // time goes when the device is not the limit.
    let mut phases = [0.0f64; 5];
    for epoch in 0..epochs {
        let plan = Arc::new(StreamPlan::new(
            Arc::clone(dataset),
            &StreamRequest::from(&spec(args, batch_size, device, epoch)?),
            limits,
        )?);
        match backend {
            None => {
                let mut assembler =
                    Assembler::new(Arc::clone(&plan), limits, Arc::new(Metrics::new()))?;
                // As many slots as the daemon's ring, filled in turn: the same memory traffic.
                let mut slots = vec![vec![0u8; plan.slot_bytes]; plan.slot_count as usize];
                for step in 0..plan.steps {
                    let slot = &mut slots[(step % u64::from(plan.slot_count)) as usize];
                    assembler.fill(step, slot)?;
                }
            }
            Some(backend) => {
                let (seconds, timings) =
                    bench::gpu_pipeline_alone(backend, &plan, plan.slot_count as usize)?;
                device_seconds += seconds;
                for (sum, value) in phases.iter_mut().zip([
                    timings.plan_s,
                    timings.gather_s,
                    timings.wait_s,
                    timings.decode_s,
                    timings.copy_wait_s,
                ]) {
                    *sum += value;
                }
            }
        }
    }
    let pipeline_seconds = started.elapsed().as_secs_f64();

    drop(off_interrupt_cpus);

    // The consumer process.
    let (self_before, children_before) = bench::cpu_seconds();
    let started = Instant::now();
    let mut command = Command::new(&args.consume_bin);
    command
        .arg("--socket")
        .arg(socket)
        .args(["--dataset", "handoff-bench", "--field", "data"])
        .args(["--batch-size", &batch_size.to_string()])
        .args(["--epochs", &epochs.to_string()])
        .args(["--shuffle", &args.shuffle])
        .args(["--device", &args.device]);
    if let Some(dtype) = args.dtype {
        command.args(["--dtype", &dtype.to_string()]);
    }
    let output = command.output()?;
    let process_seconds = started.elapsed().as_secs_f64();
    let (self_after, children_after) = bench::cpu_seconds();
    anyhow::ensure!(output.status.success(), "consume failed: {output:?}");
    let consumer: Value = serde_json::from_str(
        String::from_utf8(output.stdout)?
            .lines()
            .last()
            .context("consume printed nothing")?,
    )?;
    let consumer_seconds = consumer["seconds"].as_f64().context("seconds")?;
    anyhow::ensure!(
        consumer["batches"].as_u64() == Some(batches),
        "the consumer received {} batches, not {batches}",
        consumer["batches"]
    );
    let mut line = json!({
        "kind": "run",
        "run": run,
        "device": args.device,
        "order": args.shuffle,
        "row_bytes": args.row_bytes,
        "dtype_out": args.dtype.map_or("f16".to_string(), |d| d.to_string()),
        "dataset_rows": args.samples,
        "dataset_bytes": args.samples * args.row_bytes as u64,
        "batch_size": batch_size,
        "batch_bytes_out": batch_bytes_out,
        "slot_count": first.slot_count,
        "epochs": epochs,
        "batches": batches,
        "input_bytes": input_bytes,
        "delivered_bytes": delivered_bytes,
        "pipeline_seconds": pipeline_seconds,
        "pipeline_device_seconds": if backend.is_some() { json!(device_seconds) } else { Value::Null },
        "pipeline_plan_seconds": backend.map(|_| phases[0]),
        "pipeline_queue_seconds": backend.map(|_| phases[1]),
        "pipeline_wait_seconds": backend.map(|_| phases[2]),
        "pipeline_outcome_seconds": backend.map(|_| phases[3]),
        "pipeline_copy_wait_seconds": backend.map(|_| phases[4]),
        "consumer_seconds": consumer_seconds,
        "consumer_process_seconds": process_seconds,
        "consumer_first_batch_seconds": consumer["first_batch_seconds"],
        "pipeline_batches_per_s": batches as f64 / pipeline_seconds,
        "consumer_batches_per_s": batches as f64 / consumer_seconds,
        "pipeline_input_gb_per_s": input_bytes as f64 / pipeline_seconds / 1e9,
        "consumer_input_gb_per_s": input_bytes as f64 / consumer_seconds / 1e9,
        "consumer_over_pipeline": pipeline_seconds / consumer_seconds,
        "handoff_us_p50": consumer["handoff_us_p50"],
        "handoff_us_p99": consumer["handoff_us_p99"],
        "handoff_us_max": consumer["handoff_us_max"],
        "daemon_cpu_cores": (self_after - self_before) / process_seconds,
        "consumer_cpu_cores": (children_after - children_before) / process_seconds,
    });
    // The consumer's own figures, as it reported them.
    for (key, from) in [
        ("release_us_p50", "release_us_p50"),
        ("release_us_p99", "release_us_p99"),
        ("release_us_mean", "release_us_mean"),
        ("handoff_us_p90", "handoff_us_p90"),
        ("handoff_us_mean", "handoff_us_mean"),
        ("consumer_ready_before_asked", "ready_before_asked"),
        ("consumer_epoch_times", "epoch_times"),
        ("consumer_ready_queries", "ready_queries"),
        ("consumer_stream_queries", "stream_queries"),
    ] {
        line[key] = consumer[from].clone();
    }
    Ok(line)
}

/// The median of each numeric field over `runs` (the other fields from the first run).
fn median_line(runs: &[Value]) -> Value {
    let mut line = runs[0].clone();
    line["kind"] = json!("median");
    line["runs"] = json!(runs.len());
    line.as_object_mut().expect("an object").remove("run");
    let keys: Vec<String> = line
        .as_object()
        .expect("an object")
        .keys()
        .cloned()
        .collect();
    for key in keys {
        let mut values: Vec<f64> = runs.iter().filter_map(|run| run[&key].as_f64()).collect();
        if values.len() == runs.len() && !runs[0][&key].is_u64() {
            values.sort_by(f64::total_cmp);
            line[&key] = json!(values[values.len() / 2]);
        }
    }
    line
}
