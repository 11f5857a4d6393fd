//! Serving benchmark on the CPU backend: the pipeline alone (the assembler filling a slot in memory)
//! against the same batches pulled by a consumer through the socket, and the hand-off latency.
//!
//! ```text
//! cargo run --release --example serve_bench -- [--samples 131072] [--batch-size 256]
//! ```
//! Prints one JSON line. The dataset is generated (embedding-like fp16[256] delivered as f32, and
//! zipf int32 tokens[128]) and packed into a temporary directory.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::ipc::{Server, ServerConfig};
use gpufeed::metrics::Metrics;
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan};
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
}

fn main() -> Result<()> {
    let args = Args::parse();
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
    let options = PackOptions {
        name: "bench".into(),
        block_bytes: 64 << 10,
        samples_per_shard: None,
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    pack::pack(&dir.path().join("bench"), &fields, &options, &Quiet)?;
    let dataset = Arc::new(Dataset::open(&dir.path().join("bench"))?);
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
    let plan = Arc::new(StreamPlan::new(Arc::clone(&dataset), &spec, &limits)?);
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
            gpu: None,
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
            checksum =
                checksum.wrapping_add(field.host_bytes().expect("host memory").iter().step_by(64).map(|&b| b as u64).sum());
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
