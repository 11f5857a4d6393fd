//! `gpufeed demo`: the whole job on a generated dataset, with timings.
//!
//! It packs an embedding-like fp16 field and a token-like int32 field, verifies every block, decodes both
//! fields on the CPU (fp16 to f32) and checks every value against the source. It prints one line per
//! stage and a final JSON line.

use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use gpufeed_client::DType;
use serde_json::json;

use crate::decode;
use crate::format::{Dataset, BLOCK_BYTES_DEFAULT};
use crate::input::{self, FieldSource};
use crate::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use crate::synth;
use crate::tools::{self, NoProgress};

/// Elements per sample of the embedding field.
const EMBEDDING_DIM: u64 = 256;
/// Tokens per sample of the token field.
const SEQUENCE_TOKENS: u64 = 128;

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

    let started = Instant::now();
    let embedding_npy = dir.join("embedding-f32.npy");
    let tokens_npy = dir.join("tokens.npy");
    let written = tools::unpack(
        &dataset,
        "embedding",
        &embedding_npy,
        Some(DType::F32),
        &NoProgress,
    )? + tools::unpack(&dataset, "tokens", &tokens_npy, None, &NoProgress)?;
    let decode_seconds = started.elapsed().as_secs_f64();
    println!(
        "decode: both fields to .npy (embedding as f32) in {:.3} s ({:.2} GB/s out)",
        decode_seconds,
        written as f64 / decode_seconds / 1e9
    );

    let mut expected = vec![0u8; embeddings.len() * 2];
    decode::convert(DType::F16, &embeddings, DType::F32, &mut expected)?;
    let decoded = input::open_npy_field("check", &[embedding_npy])?;
    let mut bytes = Vec::new();
    decoded.copy_samples(0, samples, &mut bytes);
    ensure!(
        bytes == expected,
        "decoded embeddings differ from the source"
    );
    let decoded = input::open_npy_field("check", &[tokens_npy])?;
    bytes.clear();
    decoded.copy_samples(0, samples, &mut bytes);
    ensure!(bytes == tokens, "decoded tokens differ from the source");
    println!("check:  every decoded value equals the source");
    println!(
        "{}",
        json!({
            "samples": samples,
            "raw_bytes": summary.raw_bytes,
            "stored_bytes": summary.stored_bytes,
            "pack_seconds": pack_seconds,
            "verify_seconds": verify_seconds,
            "decode_seconds": decode_seconds,
        })
    );
    Ok(())
}
