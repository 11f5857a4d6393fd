//! Serving benchmark on the CPU backend: the pipeline alone (the assembler filling a slot in memory)
//! against the same batches pulled by a consumer through the socket, and the hand-off latency.
//!
//! ```text
//! cargo run --release --example serve_bench -- [--samples 131072] [--batch-size 256]
//! serve_bench --device cuda:0 --consume-bin PATH [--dir DIR] [--samples N] [--batch-size B]
//! ```
//! With `--device cuda:N` it measures the GPU backend per data kind (fp16 embeddings delivered as
//! f32; zipf int32 tokens, LZ4-compressed): the pipeline alone (the GPU assembler filling four device
//! slots, batches submitted up to two ahead of their completion, as the daemon's filler does, and
//! reading through the daemon's shared page-cache windows) against a consumer
//! *process* (the `consume` example, mapping the exported slots) pulling the same stream through the
//! socket, with the hand-off latency that process measured from each batch's `ready_ns`. Each kind runs
//! twice, the first run warming the page cache; both are printed.
//! Prints one JSON line. The dataset is generated (embedding-like fp16[256] delivered as f32, and
//! zipf int32 tokens[128]) and packed into a temporary directory.

#[path = "support/bench.rs"]
#[allow(dead_code)] // each benchmark uses part of the support module
mod bench;

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use gpufeed::input::FieldSource;
use gpufeed::ipc::{Server, ServerConfig};
use gpufeed::metrics::Metrics;
use gpufeed::pack::{CodecChoice, OnExisting};
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed::registry::Registry;
use gpufeed::synth;
use gpufeed_client::protocol::{FieldRequest, StreamSpec};
use gpufeed_client::{Client, DType};

#[derive(Parser)]
struct Args {
    /// Samples in the dataset.
    #[arg(long, default_value_t = 131_072)]
    samples: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    batch_size: u32,
    /// `cpu` (in-process consumer) or `cuda:N` (consumer process, see --consume-bin).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The `consume` example binary (GPU mode).
    #[arg(long)]
    consume_bin: Option<std::path::PathBuf>,
    /// Where the dataset is packed (default: a temporary directory).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// GPU mode: rounds queued on the device at once (default: the node default).
    #[arg(long)]
    rounds_in_flight: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(ordinal) = args.device.strip_prefix("cuda:") {
        return gpu::run(&args, ordinal.parse()?);
    }
    let dir = tempfile::tempdir()?;
    let fields = vec![
        FieldSource::from_bytes(
            "embedding",
            DType::F16,
            vec![256],
            synth::embedding_f16((args.samples * 256) as usize, 1),
        )?,
        FieldSource::from_bytes(
            "tokens",
            DType::I32,
            vec![128],
            synth::zipf_tokens_i32((args.samples * 128) as usize, 2),
        )?,
    ];
    let dataset = bench::pack_dataset(
        &dir.path().join("bench"),
        "bench",
        &fields,
        CodecChoice::Auto,
        OnExisting::Refuse,
    )?;
    let mut spec = StreamSpec::new("bench", args.batch_size);
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
    let limits = StreamLimits::node_defaults();

    // The pipeline alone: fill one slot per step, no socket, no consumer.
    let plan = Arc::new(StreamPlan::new(
        Arc::clone(&dataset),
        &StreamRequest::from(&spec),
        &limits,
    )?);
    let mut assembler = Assembler::new(Arc::clone(&plan), &limits, Arc::new(Metrics::new()))?;
    let mut slot = vec![0u8; plan.slot_bytes];
    let started = Instant::now();
    for step in 0..plan.steps {
        assembler.fill(step, &mut slot)?;
    }
    let pipeline_seconds = started.elapsed().as_secs_f64();
    let delivered_bytes: u64 = plan
        .fields
        .iter()
        .map(|f| (f.sample_bytes_out * args.batch_size as usize) as u64)
        .sum::<u64>()
        * plan.steps;

    // Through the socket, with a consumer touching every byte it receives.
    let registry = Arc::new(Registry::new());
    registry
        .insert_shared(Arc::clone(&dataset))
        .map_err(anyhow::Error::msg)?;
    let metrics = Arc::new(Metrics::new());
    let socket = dir.path().join("bench.sock");
    let server = Server::bind(
        ServerConfig {
            socket_path: socket.clone(),
            allowed_uids: vec![nix::unistd::getuid().as_raw()],
            sessions_max: 4,
            slot_memory_bytes_max: 4 << 30,
            stream_limits: limits,
            metrics: Arc::clone(&metrics),
            gpus: Vec::new(),
            handshake_timeout: gpufeed::ipc::HANDSHAKE_TIMEOUT_DEFAULT,
        },
        registry,
    )?;
    std::thread::spawn(move || server.run());
    let started = Instant::now();
    let mut checksum = 0u64;
    let mut batches = 0u64;
    for batch in Client::connect(&socket)?.open_stream(spec)? {
        let batch = batch?;
        for field in batch.fields() {
            // Touch the bytes as a trainer's copy to the device would.
            checksum = checksum.wrapping_add(
                field
                    .host_bytes()
                    .expect("host memory")
                    .iter()
                    .step_by(64)
                    .map(|&b| b as u64)
                    .sum(),
            );
        }
        batches += 1;
    }
    let consumer_seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "samples": plan.steps * args.batch_size as u64,
            "batch_size": args.batch_size,
            "batches": batches,
            "delivered_bytes": delivered_bytes,
            "pipeline_gb_per_s": delivered_bytes as f64 / pipeline_seconds / 1e9,
            "consumer_gb_per_s": delivered_bytes as f64 / consumer_seconds / 1e9,
            "consumer_over_pipeline": pipeline_seconds / consumer_seconds,
            "handoff_p50_us_at_most": metrics.handoff_quantile_us(0.5),
            "handoff_p99_us_at_most": metrics.handoff_quantile_us(0.99),
            "checksum": checksum,
        })
    );
    Ok(())
}

mod gpu {
    //! The GPU mode.

    use std::process::Command;
    use std::sync::Arc;

    use anyhow::{Context, Result};
    use gpufeed::daemon::open_gpu_backend;
    use gpufeed::input::FieldSource;
    use gpufeed::ipc::{Server, ServerConfig};
    use gpufeed::metrics::Metrics;
    use gpufeed::pack::{CodecChoice, OnExisting};
    use gpufeed::pipeline::{StreamLimits, StreamPlan, StreamRequest};
    use gpufeed::registry::Registry;
    use gpufeed::storage::EngineMode;
    use gpufeed::synth;
    use gpufeed_client::protocol::{Device, FieldRequest, StreamSpec};
    use gpufeed_client::DType;

    use super::bench::{gpu_pipeline_alone, pack_dataset};
    use super::Args;

    pub fn run(args: &Args, ordinal: u32) -> Result<()> {
        let consume = args
            .consume_bin
            .clone()
            .context("--device cuda:N needs --consume-bin")?;
        let temp = tempfile::tempdir()?;
        let root = args
            .dir
            .clone()
            .unwrap_or_else(|| temp.path().to_path_buf());
        let mut serving = open_gpu_backend(
            ordinal,
            EngineMode::Auto,
            &gpufeed::config::GpuSettings::from_environment()?,
        )?;
        if let Some(rounds) = args.rounds_in_flight {
            serving.stream_limits.rounds_in_flight = rounds;
        }
        let serving = Arc::new(serving);
        let kinds: [(&str, FieldSource, Option<DType>); 2] = [
            (
                "emb",
                FieldSource::from_bytes(
                    "data",
                    DType::F16,
                    vec![1024],
                    synth::embedding_f16((args.samples * 1024) as usize, 1),
                )?,
                Some(DType::F32),
            ),
            (
                "tok",
                FieldSource::from_bytes(
                    "data",
                    DType::I32,
                    vec![512],
                    synth::zipf_tokens_i32((args.samples * 512) as usize, 2),
                )?,
                None,
            ),
        ];
        let registry = Arc::new(Registry::new());
        let mut datasets = Vec::new();
        for (name, field, dtype) in kinds {
            let dataset_name = format!("serve-bench-{name}");
            let dataset = pack_dataset(
                &root.join(&dataset_name),
                &dataset_name,
                &[field],
                CodecChoice::Auto,
                OnExisting::Replace,
            )?;
            registry
                .insert_shared(Arc::clone(&dataset))
                .map_err(anyhow::Error::msg)?;
            datasets.push((name, dataset, dtype));
        }
        let metrics = Arc::new(Metrics::new());
        let socket = root.join("serve-bench.sock");
        let server = Server::bind(
            ServerConfig {
                socket_path: socket.clone(),
                allowed_uids: vec![nix::unistd::getuid().as_raw()],
                sessions_max: 4,
                slot_memory_bytes_max: 16 << 30,
                stream_limits: StreamLimits::node_defaults(),
                metrics: Arc::clone(&metrics),
                gpus: vec![Arc::clone(&serving)],
                handshake_timeout: gpufeed::ipc::HANDSHAKE_TIMEOUT_DEFAULT,
            },
            registry,
        )?;
        std::thread::spawn(move || server.run());
        let limits = StreamLimits::node_defaults();
        for (name, dataset, dtype) in &datasets {
            let mut spec = StreamSpec::new(dataset.manifest.name.clone(), args.batch_size);
            spec.fields = vec![FieldRequest {
                name: "data".into(),
                dtype: *dtype,
            }];
            spec.device = Device::Cuda(ordinal);
            let plan = Arc::new(StreamPlan::new(
                Arc::clone(dataset),
                &StreamRequest::from(&spec),
                &limits,
            )?);
            let delivered: u64 =
                plan.fields[0].sample_bytes_out as u64 * args.batch_size as u64 * plan.steps;
            let stored: u64 = dataset.manifest.shards.iter().map(|s| s.file_bytes).sum();
            for run in 0..2 {
                // The pipeline alone, into a ring of four exportable slots, reading through the
                // daemon's registered page-cache windows, so that run 1 finds what run 0
                // registered, as a second epoch or a second consumer of the daemon does.
                let (pipeline_seconds, timings) = gpu_pipeline_alone(&serving, &plan, 4)?;
                // A consumer process through the socket.
                let output = Command::new(&consume)
                    .arg("--socket")
                    .arg(&socket)
                    .args(["--dataset", &dataset.manifest.name])
                    .args(["--batch-size", &args.batch_size.to_string()])
                    .args(["--device", &format!("cuda:{ordinal}")])
                    .args(
                        dtype
                            .map(|d| vec!["--dtype".to_string(), d.to_string()])
                            .unwrap_or_default(),
                    )
                    .output()?;
                anyhow::ensure!(output.status.success(), "consume failed: {output:?}");
                let line = String::from_utf8(output.stdout)?;
                let consumer: serde_json::Value =
                    serde_json::from_str(line.lines().last().context("no output")?)?;
                let consumer_seconds = consumer["seconds"].as_f64().context("seconds")?;
                println!(
                    "{}",
                    serde_json::json!({
                        "kind": name,
                        "run": run,
                        "device": format!("cuda:{ordinal}"),
                        "batch_size": args.batch_size,
                        "batches": plan.steps,
                        "stored_bytes": stored,
                        "delivered_bytes": delivered,
                        "pipeline_gb_per_s": delivered as f64 / pipeline_seconds / 1e9,
                        "consumer_gb_per_s": delivered as f64 / consumer_seconds / 1e9,
                        "consumer_over_pipeline": pipeline_seconds / consumer_seconds,
                        "consumer_bytes": consumer["bytes"],
                        "handoff_us_p50": consumer["handoff_us_p50"],
                        "handoff_us_p99": consumer["handoff_us_p99"],
                        "pipeline_seconds": pipeline_seconds,
                        "pipeline_plan_s": timings.plan_s,
                        "pipeline_read_s": timings.read_s,
                        "pipeline_decode_s": timings.decode_s,
                        "pipeline_gather_s": timings.gather_s,
                        "pipeline_wait_s": timings.wait_s,
                        "pipeline_rounds": timings.rounds,
                        "rounds_in_flight": serving.stream_limits.rounds_in_flight,
                    })
                );
            }
        }
        Ok(())
    }
}
