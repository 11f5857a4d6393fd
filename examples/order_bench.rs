//! Sample order on the CPU backend: the same epoch filled by the assembler (the pipeline alone, no
//! socket) in dataset order, window shuffle and full shuffle, with the bytes read per byte stored and
//! per byte delivered. The order modes must cost about the same: a shuffled epoch that reads whole
//! blocks for every row, or re-reads them batch after batch, shows here as a lower rate and a read
//! amplification well above 1.
//!
//! ```text
//! cargo run --release --example order_bench -- [--samples 262144] [--batch-size 1024] [--runs 3]
//! ```
//! The dataset is generated and packed into a temporary directory: an embedding-like fp16[512] field
//! (1 KiB a row, incompressible: stored raw) in 4 shards, delivered as f32. Each configuration runs
//! `--runs` times, each run on a fresh assembler (nothing kept from the previous run but the page
//! cache, warmed by one untimed epoch first); one JSON line per run, then the medians.
//!
//! `--row-probe` adds the machine's own ceiling for the shuffled orders: the rows of one window's
//! shards copied and converted to f32 by a bare loop (no planning, no block lookups; the same
//! copy, conversion and prefetch distance as the assembler), in file order and in a random order, and the
//! ratio of the two. A shuffled order reads each row from another page; where the memory system
//! serves scattered 1 KiB rows at a fraction of its sequential rate, no planning brings the
//! shuffled epochs closer than that fraction.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use gpufeed::format::Dataset;
use gpufeed::input::FieldSource;
use gpufeed::metrics::Metrics;
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed::pipeline::{Assembler, StreamLimits, StreamPlan, StreamRequest};
use gpufeed::synth;
use gpufeed_client::protocol::{FieldRequest, Shuffle, StreamSpec};
use gpufeed_client::DType;

#[derive(Parser)]
struct Args {
    /// Samples in the dataset (1 KiB stored each).
    #[arg(long, default_value_t = 262_144)]
    samples: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 1024)]
    batch_size: u32,
    /// Runs per order mode.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Shards per window of the window shuffle.
    #[arg(long, default_value_t = 2)]
    window_shards: u32,
    /// Order modes to run, comma-separated (none, window, full; other names are ignored); the ratios
    /// are against the first of none, window, full that runs.
    #[arg(long, value_delimiter = ',', default_value = "none,window,full")]
    orders: Vec<String>,
    /// Also measure the bare row copy in file order and in a random order (see above).
    #[arg(long)]
    row_probe: bool,
}

const ROW_ELEMENTS: u64 = 512;

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let fields = vec![FieldSource::from_bytes(
        "embedding",
        DType::F16,
        vec![ROW_ELEMENTS],
        synth::embedding_f16((args.samples * ROW_ELEMENTS) as usize, 1),
    )?];
    let options = PackOptions {
        name: "order".into(),
        block_bytes: 64 << 10,
        samples_per_shard: Some(args.samples.div_ceil(4)),
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let path = dir.path().join("order");
    pack::pack(&path, &fields, &options, &Quiet)?;
    let dataset = Arc::new(Dataset::open(&path)?);
    let stored_bytes: u64 = std::fs::read_dir(&path)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != "manifest.json")
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum();
    let (raw_blocks, blocks) = dataset.shards.iter().fold((0, 0), |(raw, all), shard| {
        let field = shard.metadata.field_blocks(0);
        let raw_here = field
            .iter()
            .filter(|b| b.codec == gpufeed::format::Codec::Raw)
            .count();
        (raw + raw_here, all + field.len())
    });
    println!("{{\"dataset_bytes_stored\":{stored_bytes},\"blocks\":{blocks},\"raw_blocks\":{raw_blocks}}}");
    let limits = StreamLimits::node_defaults();
    let modes = [
        ("none", Shuffle::None),
        ("window", Shuffle::Window(args.window_shards)),
        ("full", Shuffle::Full),
    ];
    let mut medians = Vec::new();
    // One epoch warms the page cache (and the dataset's record of verified blocks): reported, not
    // counted in the medians.
    let (seconds, delivered, read) = epoch(&dataset, &args, Shuffle::None, &limits)?;
    println!(
        "{{\"warm_up\":\"none\",\"seconds\":{seconds:.4},\"delivered_bytes\":{delivered},\"read_bytes\":{read},\"read_per_input_byte\":{:.3}}}",
        read as f64 / (delivered / 2) as f64
    );
    for (name, shuffle) in modes {
        if !args.orders.iter().any(|o| o == name) {
            continue;
        }
        let mut rates = Vec::new();
        let mut amplification = Vec::new();
        for run in 0..args.runs {
            let (seconds, delivered, read) = epoch(&dataset, &args, shuffle, &limits)?;
            let input_bytes = delivered / 2;
            let rate = input_bytes as f64 / seconds / 1e9;
            println!(
                "{{\"order\":\"{name}\",\"run\":{run},\"batch_size\":{},\"samples\":{},\"stored_bytes\":{stored_bytes},\"seconds\":{seconds:.4},\"gb_per_s_fp16_in\":{rate:.4},\"delivered_bytes\":{delivered},\"read_bytes\":{read},\"read_per_input_byte\":{:.3}}}",
                args.batch_size,
                args.samples,
                read as f64 / input_bytes as f64
            );
            rates.push(rate);
            amplification.push(read as f64 / input_bytes as f64);
        }
        medians.push((name, median(&mut rates), median(&mut amplification)));
    }
    if args.row_probe {
        row_probe(&dataset, &args)?;
    }
    let Some(&(_, in_order, _)) = medians.first() else {
        return Ok(());
    };
    for (name, rate, amplification) in &medians {
        println!(
            "{{\"summary\":\"{name}\",\"median_gb_per_s_fp16_in\":{rate:.4},\"vs_in_order\":{:.3},\"median_read_per_input_byte\":{amplification:.3}}}",
            rate / in_order
        );
    }
    Ok(())
}

/// Fills one epoch with a fresh assembler: (seconds, delivered bytes, bytes read).
fn epoch(
    dataset: &Arc<Dataset>,
    args: &Args,
    shuffle: Shuffle,
    limits: &StreamLimits,
) -> Result<(f64, u64, u64)> {
    let mut spec = StreamSpec::new("order", args.batch_size);
    spec.shuffle = shuffle;
    spec.seed = 7;
    spec.fields = vec![FieldRequest {
        name: "embedding".into(),
        dtype: Some(DType::F32),
    }];
    let metrics = Arc::new(Metrics::new());
    let started = Instant::now();
    let plan = Arc::new(StreamPlan::new(
        Arc::clone(dataset),
        &StreamRequest::from(&spec),
        limits,
    )?);
    let mut assembler = Assembler::new(Arc::clone(&plan), limits, Arc::clone(&metrics))?;
    let mut slot = vec![0u8; plan.slot_bytes];
    for step in 0..plan.steps {
        assembler.fill(step, &mut slot)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let delivered = plan.slot_bytes as u64 * plan.steps;
    Ok((seconds, delivered, metrics.read_bytes_total()))
}

/// The bare row copy over the first `--window-shards` shards' maps: `--runs` passes in file order
/// and in a random order each, interleaved, into as many batch-sized slots as the stream would have
/// in turn; one JSON line per pass and one with the medians.
fn row_probe(dataset: &Dataset, args: &Args) -> Result<()> {
    let row = (ROW_ELEMENTS * 2) as usize;
    let maps = dataset
        .shards
        .iter()
        .take(args.window_shards.max(1) as usize)
        .map(|shard| {
            let file = std::fs::File::open(&shard.path)?;
            // SAFETY: the shards are not modified while the probe runs.
            Ok(unsafe { memmap2::Mmap::map(&file)? })
        })
        .collect::<Result<Vec<_>>>()?;
    let rows: Vec<&[u8]> = maps.iter().flat_map(|map| map.chunks_exact(row)).collect();
    // A random order of the rows (xorshift, Fisher–Yates).
    let mut shuffled: Vec<usize> = (0..rows.len()).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..shuffled.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        shuffled.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let in_order: Vec<usize> = (0..rows.len()).collect();
    let batch = args.batch_size as usize;
    let mut slots = vec![vec![0u8; batch * row * 2]; 4];
    let mut scratch: Vec<u8> = Vec::with_capacity(row);
    let mut pass = |order: &[usize]| -> f64 {
        let started = Instant::now();
        for (b, rows_of_batch) in order.chunks(batch).enumerate() {
            let slot = &mut slots[b % 4];
            for (r, &index) in rows_of_batch.iter().enumerate() {
                if let Some(&ahead) = rows_of_batch.get(r + 8) {
                    prefetch(rows[ahead]);
                }
                // As the assembler: the row is copied out of the map, then converted.
                scratch.clear();
                scratch.extend_from_slice(rows[index]);
                gpufeed::decode::convert(
                    DType::F16,
                    &scratch,
                    DType::F32,
                    &mut slot[r * row * 2..(r + 1) * row * 2],
                )
                .expect("f16 to f32 is supported");
            }
        }
        (order.len() * row) as f64 / started.elapsed().as_secs_f64() / 1e9
    };
    // One untimed pass each: the maps' pages and the slots are touched once.
    pass(&in_order);
    pass(&shuffled);
    let (mut sequential, mut random) = (Vec::new(), Vec::new());
    for run in 0..args.runs {
        sequential.push(pass(&in_order));
        random.push(pass(&shuffled));
        println!(
            "{{\"row_probe\":\"run\",\"run\":{run},\"rows\":{},\"file_order_gb_per_s\":{:.4},\"random_order_gb_per_s\":{:.4}}}",
            rows.len(),
            sequential[run],
            random[run]
        );
    }
    let (sequential, random) = (median(&mut sequential), median(&mut random));
    println!(
        "{{\"row_probe\":\"median\",\"file_order_gb_per_s\":{sequential:.4},\"random_order_gb_per_s\":{random:.4},\"random_vs_file_order\":{:.3}}}",
        random / sequential
    );
    Ok(())
}

/// Asks the CPU to start loading `row`'s first cache line (and its address translation).
fn prefetch(row: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; the pointer is a valid reference's.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(row.as_ptr().cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
