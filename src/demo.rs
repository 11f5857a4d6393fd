//! `gpufeed demo`: the whole job on a generated dataset, with timings.
//!
//! It packs an embedding-like fp16 field and a token-like int32 field, verifies every block, starts the
//! daemon's socket server, pulls a whole epoch of batches through the client crate (embeddings
//! converted to f32), and checks every served value against the source. It prints one line per stage
//! and a final JSON line.

use std::path::Path;
use std::time::Instant;

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use gpufeed_client::consumer::Client;
use gpufeed_client::protocol::{FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::DType;
use serde_json::json;

use crate::decode;
use crate::format::{Dataset, BLOCK_BYTES_DEFAULT};
use crate::input::FieldSource;
use crate::ipc::{Server, ServerConfig};
use crate::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
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

/// Runs the demo in `dir` (a fresh temporary directory when `None`) with `samples` samples.
pub fn run(dir: Option<&Path>, samples: u64) -> Result<()> {
    ensure!(samples > 0, "--samples must be at least 1");
    let temporary;
    let dir = match dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            dir.to_path_buf()
        }
        None => {
            temporary = tempfile::Builder::new()
                .prefix("gpufeed-demo-")
                .tempdir()
                .context("creating a temporary directory")?;
            temporary.path().to_path_buf()
        }
    };
    println!("gpufeed demo in {}", dir.display());

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
    ensure!(
        report.problems.is_empty(),
        "verify found problems: {:?}",
        report.problems
    );
    println!(
        "verify: {} blocks intact in {:.3} s ({:.2} GB/s of raw data)",
        report.blocks_ok,
        verify_seconds,
        summary.raw_bytes as f64 / verify_seconds / 1e9
    );

    // Serve it: the daemon's socket server in this process, a consumer through the client crate.
    let registry = Arc::new(Registry::new());
    registry.insert(dataset).map_err(anyhow::Error::msg)?;
    let socket_path = dir.join("gpufeed-demo.sock");
    let server = Server::bind(
        ServerConfig {
            socket_path: socket_path.clone(),
            allowed_uids: vec![nix::unistd::getuid().as_raw()],
            sessions_max: 4,
            slot_memory_bytes_max: 1 << 30,
            stream_limits: StreamLimits::node_defaults(),
            metrics: Arc::new(crate::metrics::Metrics::new()),
            gpu: None,
        },
        registry,
    )?;
    std::thread::Builder::new()
        .name("gpufeed-demo-server".into())
        .spawn(move || server.run())?;
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
    let started = Instant::now();
    let mut stream = Client::connect(&socket_path)?.open_stream(spec)?;
    let (mut embedding_out, mut tokens_out) = (Vec::new(), Vec::new());
    let (mut batches, mut served_bytes) = (0u64, 0u64);
    for batch in stream.by_ref() {
        let batch = batch?;
        let embedding = batch
            .field("embedding")
            .context("batch without 'embedding'")?;
        let tokens = batch.field("tokens").context("batch without 'tokens'")?;
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

    let served = served_samples as usize;
    let mut expected = vec![0u8; served * EMBEDDING_DIM as usize * 4];
    decode::convert(
        DType::F16,
        &embeddings[..served * EMBEDDING_DIM as usize * 2],
        DType::F32,
        &mut expected,
    )?;
    ensure!(
        embedding_out == expected,
        "served embeddings differ from the source"
    );
    ensure!(
        tokens_out[..] == tokens[..served * SEQUENCE_TOKENS as usize * 4],
        "served tokens differ from the source"
    );
    println!("check:  every served value equals the source");
    println!(
        "{}",
        json!({
            "samples": samples,
            "raw_bytes": summary.raw_bytes,
            "stored_bytes": summary.stored_bytes,
            "pack_seconds": pack_seconds,
            "verify_seconds": verify_seconds,
            "batches": batches,
            "serve_seconds": serve_seconds,
            "samples_per_second": served_samples as f64 / serve_seconds,
        })
    );
    Ok(())
}
