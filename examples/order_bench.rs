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
//! cache, warmed by one untimed epoch first), the orders taking turns run by run (so that a change of
//! the machine's load weighs on every order alike); one JSON line per run, then the medians.
//!
//! `--data tokens` packs int32 token rows instead (`--row-tokens` a row, zipf-distributed ids that
//! LZ4 with the byte shuffle stores about 2.5x smaller) and delivers them as stored; the decoded-block
//! cache is the daemon's shared one (`pipeline::block_cache`), `--cache-bytes` large (a quarter of
//! the decoded dataset unless given). Each line then also says the bytes read from the shard files
//! by the read engine (`disk_read_bytes`, O_DIRECT where the file system allows it) and from their
//! page cache in place (`page_cache_read_bytes`), per byte stored, and the cache's hits, misses and
//! evictions:
//!
//! ```text
//! cargo run --release --example order_bench -- --data tokens --samples 131072 --samples-per-shard 8192
//! ```
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
use gpufeed::metrics::{Metrics, ReadPath};
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
    /// The data: `embedding` (fp16 rows, stored raw) or `tokens` (int32 rows, LZ4).
    #[arg(long, default_value = "embedding")]
    data: String,
    /// Tokens per row with `--data tokens`.
    #[arg(long, default_value_t = 2048)]
    row_tokens: u64,
    /// Samples per shard (default: a quarter of the samples).
    #[arg(long)]
    samples_per_shard: Option<u64>,
    /// Raw bytes per block.
    #[arg(long, default_value_t = 64 << 10)]
    block_bytes: u32,
    /// Bytes the decoded-block cache may keep (default: the stream limit's 256 MiB with `embedding`,
    /// a quarter of the decoded dataset with `tokens`).
    #[arg(long)]
    cache_bytes: Option<u64>,
    /// Bytes of rows the stream may take ahead out of decoded blocks in shuffled orders
    /// (`pipeline::lookahead`), reserved within `--cache-bytes` (the cache keeps the rest); 0 turns
    /// the look-ahead off. Default: the stream limit's.
    #[arg(long)]
    lookahead_bytes: Option<u64>,
    /// How `--data tokens` is stored: `lz4` (with the byte shuffle) or `raw`.
    #[arg(long, default_value = "lz4")]
    codec: String,
}

const ROW_ELEMENTS: u64 = 512;

fn main() -> Result<()> {
    let args = Args::parse();
    let tokens = args.data == "tokens";
    // Under the working directory: /tmp may be a memory file system, where O_DIRECT reads fail.
    let dir = tempfile::tempdir_in(".")?;
    let fields = if tokens {
        // Generated in parallel: a billion zipf draws on one core take half a minute.
        let total = (args.samples * args.row_tokens) as usize;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = total.div_ceil(threads);
        let parts: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let count = per.min(total.saturating_sub(t * per));
                    scope.spawn(move || synth::zipf_tokens_i32(count, 1 + t as u64))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        vec![FieldSource::from_bytes(
            "tokens",
            DType::I32,
            vec![args.row_tokens],
            parts.concat(),
        )?]
    } else {
        vec![FieldSource::from_bytes(
            "embedding",
            DType::F16,
            vec![ROW_ELEMENTS],
            synth::embedding_f16((args.samples * ROW_ELEMENTS) as usize, 1),
        )?]
    };
    let decoded_bytes: u64 = fields.iter().map(|f| f.total_bytes()).sum();
    let options = PackOptions {
        name: "order".into(),
        block_bytes: args.block_bytes,
        samples_per_shard: Some(
            args.samples_per_shard
                .unwrap_or_else(|| args.samples.div_ceil(4)),
        ),
        codec: if tokens && args.codec == "raw" {
            CodecChoice::Raw
        } else if tokens {
            CodecChoice::Lz4
        } else {
            CodecChoice::Auto
        },
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
    let mut limits = StreamLimits::node_defaults();
    let cache_bytes = args.cache_bytes.unwrap_or(if tokens {
        decoded_bytes / 4
    } else {
        limits.cache_bytes_max as u64
    });
    limits.cache_bytes_max = cache_bytes as usize;
    if let Some(bytes) = args.lookahead_bytes {
        limits.lookahead_bytes_max = bytes;
    }
    println!("{{\"data\":\"{}\",\"codec\":\"{}\",\"dataset_bytes_stored\":{stored_bytes},\"dataset_bytes_decoded\":{decoded_bytes},\"blocks\":{blocks},\"raw_blocks\":{raw_blocks},\"shards\":{},\"cache_bytes\":{cache_bytes},\"lookahead_bytes_max\":{},\"block_bytes\":{}}}", args.data, args.codec, dataset.shards.len(), limits.lookahead_bytes_max, args.block_bytes);
    let modes = [
        ("none", Shuffle::None),
        ("window", Shuffle::Window(args.window_shards)),
        ("full", Shuffle::Full),
    ];
    let mut medians = Vec::new();
    // One epoch warms the page cache (and the dataset's record of verified blocks): reported, not
    // counted in the medians.
    let warm = epoch(&dataset, &args, Shuffle::None, &limits)?;
    println!(
        "{{\"warm_up\":\"none\",\"seconds\":{:.4},\"delivered_bytes\":{},\"read_bytes\":{},\"read_per_input_byte\":{:.3}}}",
        warm.seconds,
        warm.delivered,
        warm.read,
        warm.read as f64 / (warm.delivered / input_divisor(tokens)) as f64
    );
    let modes: Vec<(&str, Shuffle)> = modes
        .into_iter()
        .filter(|(name, _)| args.orders.iter().any(|o| o == name))
        .collect();
    // Runs interleave the orders (none, window, full, none, ...), so that a machine whose load
    // changes over the minutes weighs on every order alike and the ratios stay fair.
    let mut rates = vec![Vec::new(); modes.len()];
    let mut amplification = vec![Vec::new(); modes.len()];
    for run in 0..args.runs {
        for (index, &(name, shuffle)) in modes.iter().enumerate() {
            let (rates, amplification) = (&mut rates[index], &mut amplification[index]);
            let e = epoch(&dataset, &args, shuffle, &limits)?;
            let (seconds, delivered, read) = (e.seconds, e.delivered, e.read);
            let input_bytes = delivered / input_divisor(tokens);
            let rate = input_bytes as f64 / seconds / 1e9;
            let rate_key = if tokens {
                "gb_per_s_i32"
            } else {
                "gb_per_s_fp16_in"
            };
            println!(
                "{{\"order\":\"{name}\",\"run\":{run},\"batch_size\":{},\"samples\":{},\"stored_bytes\":{stored_bytes},\"seconds\":{seconds:.4},\"{rate_key}\":{rate:.4},\"delivered_bytes\":{delivered},\"read_bytes\":{read},\"read_per_input_byte\":{:.3},\"disk_read_bytes\":{},\"page_cache_read_bytes\":{},\"disk_read_per_stored_byte\":{:.3},\"decode_seconds\":{:.4},\"cpu_seconds\":{:.4},\"cache_hits\":{},\"cache_misses\":{},\"cache_evictions\":{},\"cache_kept_bytes_end\":{},\"decoded_bytes\":{},\"needed_raw_bytes\":{},\"needed_stored_bytes\":{},\"decode_amplification\":{:.3},\"read_amplification\":{:.3},\"lookahead_rows_kept\":{},\"lookahead_rows_served\":{}}}",
                args.batch_size,
                args.samples,
                read as f64 / input_bytes as f64,
                e.disk,
                e.page_cache,
                e.disk as f64 / stored_bytes as f64,
                e.decode_seconds,
                e.cpu_seconds,
                e.cache.hits,
                e.cache.misses,
                e.cache.evictions,
                e.cache.kept_bytes,
                e.cache.decoded_bytes,
                e.cache.needed_raw_bytes,
                e.cache.needed_stored_bytes,
                e.cache.decode_amplification().unwrap_or(0.0),
                read as f64 / e.cache.needed_stored_bytes.max(1) as f64,
                e.cache.lookahead_rows_kept,
                e.cache.lookahead_rows_served,
            );
            rates.push(rate);
            amplification.push(if tokens {
                // Read amplification as the CPU-backend target counts it: the larger of bytes
                // decoded per raw byte delivered and bytes read (every path) per stored byte of
                // the rows delivered.
                e.cache
                    .decode_amplification()
                    .unwrap_or(0.0)
                    .max(read as f64 / e.cache.needed_stored_bytes.max(1) as f64)
            } else {
                read as f64 / input_bytes as f64
            });
        }
    }
    for ((name, _), (rates, amplification)) in modes
        .iter()
        .zip(rates.iter_mut().zip(amplification.iter_mut()))
    {
        medians.push((*name, median(rates), median(amplification)));
    }
    if args.row_probe {
        row_probe(&dataset, &args)?;
    }
    let Some(&(_, in_order, _)) = medians.first() else {
        return Ok(());
    };
    for (name, rate, amplification) in &medians {
        println!(
            "{{\"summary\":\"{name}\",\"median_gb_per_s_{}\":{rate:.4},\"vs_in_order\":{:.3},\"median_{}\":{amplification:.3}}}",
            if tokens { "i32" } else { "fp16_in" },
            rate / in_order,
            if tokens {
                "amplification"
            } else {
                "read_per_input_byte"
            },
        );
    }
    Ok(())
}

/// Delivered bytes per input byte: fp16 embeddings are delivered as f32, tokens as stored.
fn input_divisor(tokens: bool) -> u64 {
    if tokens {
        1
    } else {
        2
    }
}

/// What one epoch did.
struct Epoch {
    seconds: f64,
    delivered: u64,
    /// Bytes read over every path.
    read: u64,
    /// Bytes the read engine read from the shard files.
    disk: u64,
    /// Bytes copied or decoded in place from the shards' page cache.
    page_cache: u64,
    decode_seconds: f64,
    /// CPU time of the process over the epoch, every thread's (user and system): on a machine shared
    /// with other work the wall time moves with their load, the CPU time much less.
    cpu_seconds: f64,
    cache: gpufeed::metrics::BlockCacheCounts,
}

/// User and system CPU seconds of this process so far, over all its threads (those exited too).
fn process_cpu_seconds() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage of this process");
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    seconds(usage.user_time()) + seconds(usage.system_time())
}

/// Fills one epoch with a fresh assembler and a fresh decoded-block cache of
/// `limits.cache_bytes_max`.
fn epoch(
    dataset: &Arc<Dataset>,
    args: &Args,
    shuffle: Shuffle,
    limits: &StreamLimits,
) -> Result<Epoch> {
    let mut spec = StreamSpec::new("order", args.batch_size);
    spec.shuffle = shuffle;
    spec.seed = 7;
    spec.fields = vec![if args.data == "tokens" {
        FieldRequest {
            name: "tokens".into(),
            dtype: None,
        }
    } else {
        FieldRequest {
            name: "embedding".into(),
            dtype: Some(DType::F32),
        }
    }];
    let metrics = Arc::new(Metrics::new());
    let cpu_started = process_cpu_seconds();
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
    let cpu_seconds = process_cpu_seconds() - cpu_started;
    let delivered = plan.slot_bytes as u64 * plan.steps;
    let cache = metrics.block_cache().snapshot();
    drop(assembler);
    Ok(Epoch {
        seconds,
        delivered,
        read: metrics.read_bytes_total(),
        disk: metrics.read_bytes_of(ReadPath::Uring) + metrics.read_bytes_of(ReadPath::Pread),
        page_cache: metrics.read_bytes_of(ReadPath::PageCache),
        decode_seconds: metrics.decode_seconds(),
        cpu_seconds,
        cache,
    })
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
