//! Host memory of the CPU backend's streams, measured as the process's resident set: before any
//! stream, while N full-shuffle streams fill at once over one LZ4 token dataset sharing the
//! decoded-block cache, and after they all closed. Each stream used to keep a cache of its own of up
//! to 256 MiB that outlived it in the allocator; now what the streams hold is bounded by the cache's
//! budget plus a working set per stream, and returns to the system when they close.
//!
//! ```text
//! cargo run --release --example rss_probe -- [--streams 20] [--samples 32768] [--budget-mib 256]
//! ```
//! Prints one JSON line with the resident set (MiB) at each point and the cache's counters; the
//! allocator is the daemon's (mimalloc).

use std::sync::Arc;

use anyhow::Result;
use clap::Parser;
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::metrics::Metrics;
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed::pipeline::block_cache::BlockCache;
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed::synth;
use gpufeed_client::protocol::{Shuffle, StreamSpec};
use gpufeed_client::DType;

/// The daemon's allocator (see `src/main.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Streams filling at once.
    #[arg(long, default_value_t = 20)]
    streams: usize,
    /// Rows of 2048 int32 tokens (8 KiB decoded each).
    #[arg(long, default_value_t = 32_768)]
    samples: u64,
    /// Budget of the shared cache, MiB.
    #[arg(long, default_value_t = 256)]
    budget_mib: u64,
    /// Batches each stream fills.
    #[arg(long, default_value_t = 64)]
    steps: u64,
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir_in(".")?;
    let row = 2048u64;
    let fields = vec![FieldSource::from_bytes(
        "tokens",
        DType::I32,
        vec![row],
        synth::zipf_tokens_i32((args.samples * row) as usize, 3),
    )?];
    let options = PackOptions {
        name: "rss".into(),
        block_bytes: 64 << 10,
        samples_per_shard: Some(args.samples.div_ceil(4)),
        codec: CodecChoice::Lz4,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let path = dir.path().join("rss");
    pack::pack(&path, &fields, &options, &Quiet)?;
    drop(fields);
    let dataset = Arc::new(Dataset::open(&path)?);
    let metrics = Arc::new(Metrics::new());
    let cache = BlockCache::new(args.budget_mib << 20, Arc::clone(&metrics));
    // The source and the pack's buffers are freed: the baseline.
    unsafe_collect();
    let before = rss_mib();
    let peak = std::sync::Mutex::new(0f64);
    std::thread::scope(|scope| -> Result<()> {
        let mut handles = Vec::new();
        for stream in 0..args.streams {
            let (dataset, cache, metrics, peak) = (&dataset, &cache, &metrics, &peak);
            let steps = args.steps;
            handles.push(scope.spawn(move || -> Result<()> {
                let mut spec = StreamSpec::new("rss", 256);
                spec.shuffle = Shuffle::Full;
                spec.seed = stream as u64;
                let limits = StreamLimits::node_defaults();
                let plan = Arc::new(StreamPlan::new(
                    Arc::clone(dataset),
                    &StreamRequest::from(&spec),
                    &limits,
                )?);
                let mut assembler =
                    Assembler::with_cache(Arc::clone(&plan), &limits, Arc::clone(metrics), cache)?;
                let mut slot = vec![0u8; plan.slot_bytes];
                for step in 0..steps.min(plan.steps) {
                    assembler.fill(step, &mut slot)?;
                    let mut peak = peak.lock().unwrap();
                    *peak = peak.max(rss_mib());
                }
                Ok(())
            }));
        }
        for handle in handles {
            handle.join().expect("stream thread")?;
        }
        Ok(())
    })?;
    let during = *peak.lock().unwrap();
    let counts = metrics.block_cache().snapshot();
    let after = rss_mib();
    println!(
        "{{\"streams\":{},\"budget_mib\":{},\"rss_before_mib\":{before:.1},\"rss_peak_mib\":{during:.1},\"rss_after_close_mib\":{after:.1},\"held_bytes_after\":{},\"kept_bytes_after\":{},\"hits\":{},\"misses\":{},\"evictions\":{}}}",
        args.streams,
        args.budget_mib,
        counts.held_bytes,
        counts.kept_bytes,
        counts.hits,
        counts.misses,
        counts.evictions
    );
    Ok(())
}

extern "C" {
    fn mi_collect(force: bool);
}

fn unsafe_collect() {
    // SAFETY: mimalloc's own collection of its free lists.
    unsafe { mi_collect(true) };
}
