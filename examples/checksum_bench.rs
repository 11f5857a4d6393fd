//! Checksum benchmark: the xxh3-64 block verification kernel over random blocks already in device
//! memory, against a device-to-device copy of the same size measured in the same run.
//!
//! Run on the GPU machine by `scripts/gpu-checksum.sh`:
//!
//! ```text
//! checksum_bench --mib 1024
//! ```
//!
//! It fills `--mib` MiB with random bytes (never zeros), cuts them into blocks of 64 KiB (the default
//! block size) and of 4 KiB, 1 MiB and 16 MiB, computes each block's checksum on the CPU, checks once
//! that every GPU outcome is `Ok`, then times the kernel with CUDA events (warm-up, then the median of
//! `--reps` runs). Besides the standard configuration it times the others `Xxh3Config` allows on
//! 64 KiB blocks. Prints one JSON line; GB/s are 10^9 bytes per second of input hashed (for the copy:
//! bytes copied, and read + written).

use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use gpufeed::device::{time_on_stream, CacheDir, Device, DeviceBuffer, DeviceMemory, Stream};
use gpufeed::format::checksum;
use gpufeed::kernels::{ChecksumVerifier, Xxh3Config, Xxh3Job, Xxh3Outcome, Xxh3Status};
use gpufeed::synth;
use serde_json::json;

const WARMUP: usize = 3;

struct Args {
    mib: usize,
    reps: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        mib: 1024,
        reps: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--mib" => args.mib = it.next().context("--mib N")?.parse()?,
            "--reps" => args.reps = it.next().context("--reps N")?.parse()?,
            other => bail!("unknown argument {other} (expected --mib N, --reps N)"),
        }
    }
    ensure!(
        args.mib >= 16,
        "--mib must be at least 16 (one 16 MiB block)"
    );
    ensure!(args.reps >= 1, "--reps must be at least 1");
    Ok(args)
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

/// `bytes` random bytes, generated in parallel 16 MiB at a time, each part seeded by its index.
fn random_data(bytes: usize) -> Vec<u8> {
    const PART_BYTES: usize = 16 << 20;
    let parts = bytes.div_ceil(PART_BYTES);
    let mut out = vec![0u8; bytes];
    let per_thread = parts.div_ceil(threads());
    std::thread::scope(|scope| {
        for (t, chunk) in out.chunks_mut(per_thread * PART_BYTES).enumerate() {
            scope.spawn(move || {
                for (k, part) in chunk.chunks_mut(PART_BYTES).enumerate() {
                    let seed = 1000 + (t * per_thread + k) as u64;
                    part.copy_from_slice(&synth::random_bytes(part.len(), seed));
                }
            });
        }
    });
    out
}

/// One job per `block_bytes` of `data`, with the CPU checksum as the expected value.
fn jobs_for(data: &[u8], block_bytes: usize) -> Vec<Xxh3Job> {
    let blocks: Vec<&[u8]> = data.chunks(block_bytes).collect();
    let mut sums = vec![0u64; blocks.len()];
    let per_thread = blocks.len().div_ceil(threads());
    std::thread::scope(|scope| {
        for (inputs, outputs) in blocks.chunks(per_thread).zip(sums.chunks_mut(per_thread)) {
            scope.spawn(move || {
                for (input, output) in inputs.iter().zip(outputs) {
                    *output = checksum(input);
                }
            });
        }
    });
    blocks
        .iter()
        .zip(sums)
        .enumerate()
        .map(|(i, (block, expected))| Xxh3Job {
            src_offset: (i * block_bytes) as u64,
            bytes: block.len() as u32,
            expected,
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).expect("no NaN timings"));
    values[values.len() / 2]
}

/// Times `run` (which queues work on `stream`) with events: warm-up, then the median of `reps` runs,
/// in milliseconds.
fn time_ms(
    device: &Device,
    stream: &Stream,
    reps: usize,
    run: impl FnMut() -> Result<()>,
) -> Result<f64> {
    Ok(median(time_on_stream(device, stream, WARMUP, reps, run)?))
}

fn gbps(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e-3) / 1e9
}

/// The data on the device and how to time kernels over it.
struct Bench<'a> {
    device: &'a Device,
    stream: &'a Stream,
    src: &'a DeviceBuffer,
    reps: usize,
}

impl Bench<'_> {
    /// Verifies every block once (all must be `Ok`), then times the kernel. Returns the JSON row.
    fn measure(
        &self,
        jobs: &[Xxh3Job],
        block_bytes: usize,
        config: Xxh3Config,
    ) -> Result<serde_json::Value> {
        let Bench {
            device,
            stream,
            src,
            reps,
        } = *self;
        let data_bytes = src.len();
        let (verifier, _) = ChecksumVerifier::with_config(device, config, CacheDir::Disabled)?;
        let table = DeviceBuffer::from_host(device, &Xxh3Job::encode_all(jobs))?;
        let outcomes =
            DeviceBuffer::new(device, jobs.len() * gpufeed::kernels::XXH3_OUTCOME_BYTES)?;
        let count = jobs.len() as u32;
        let launch = || -> Result<()> {
            // SAFETY: every buffer outlives the launches, which are synchronised before this returns.
            unsafe { verifier.verify_async(stream, &table, count, src, &outcomes)? };
            Ok(())
        };
        launch()?;
        stream.synchronize()?;
        let bad = Xxh3Outcome::decode_all(&outcomes.to_vec()?)
            .iter()
            .filter(|o| o.status != Xxh3Status::Ok)
            .count();
        ensure!(
            bad == 0,
            "{bad} of {} blocks of {block_bytes} bytes failed verification with {config:?}",
            jobs.len()
        );
        let ms = time_ms(device, stream, reps, launch)?;
        let block_threads = config.warps_per_block * 32;
        Ok(json!({
            "block_bytes": block_bytes,
            "jobs": jobs.len(),
            "warps_per_block": config.warps_per_block,
            "blocks_per_step": config.blocks_per_step,
            "resident_warps_per_sm": verifier.kernel().blocks_per_multiprocessor(block_threads)? * config.warps_per_block,
            "ms_median": ms,
            "gb_per_s": gbps(data_bytes as f64, ms),
        }))
    }
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let device = Device::open(0).context("opening CUDA device 0")?;
    let stream = Stream::new(&device)?;
    let bytes = args.mib << 20;
    let data = random_data(bytes);

    // One core of this host hashing the same bytes, for scale.
    let cpu_bytes = bytes.min(256 << 20);
    let t = Instant::now();
    let mut fold = 0u64;
    for block in data[..cpu_bytes].chunks(64 << 10) {
        fold ^= checksum(block);
    }
    let cpu_s = t.elapsed().as_secs_f64();
    std::hint::black_box(fold);

    let src = DeviceBuffer::from_host(&device, &data)?;
    let bench = Bench {
        device: &device,
        stream: &stream,
        src: &src,
        reps: args.reps,
    };
    let mut rows = Vec::new();
    let jobs_64k = jobs_for(&data, 64 << 10);
    for config in [
        Xxh3Config::STANDARD,
        Xxh3Config {
            blocks_per_step: 1,
            ..Xxh3Config::STANDARD
        },
        Xxh3Config {
            blocks_per_step: 2,
            ..Xxh3Config::STANDARD
        },
        Xxh3Config {
            blocks_per_step: 8,
            ..Xxh3Config::STANDARD
        },
        Xxh3Config {
            warps_per_block: 8,
            ..Xxh3Config::STANDARD
        },
    ] {
        rows.push(bench.measure(&jobs_64k, 64 << 10, config)?);
    }
    for block_bytes in [4 << 10, 1 << 20, 16 << 20] {
        let jobs = jobs_for(&data, block_bytes);
        rows.push(bench.measure(&jobs, block_bytes, Xxh3Config::STANDARD)?);
    }

    // A device-to-device copy of the same bytes: the memory system's pace on this device.
    let dst = DeviceBuffer::new(&device, bytes)?;
    let copy_ms = time_ms(&device, &stream, args.reps, || {
        // SAFETY: both buffers outlive the timing, which synchronises before returning.
        unsafe { gpufeed::device::copy_async(&stream, &src, 0, &dst, 0, bytes)? };
        Ok(())
    })?;

    let standard = &rows[0];
    let line = json!({
        "bench": "xxh3_verify",
        "device": device.properties().name,
        "bytes": bytes,
        "block_bytes": 64 << 10,
        "verify_gb_per_s": standard["gb_per_s"],
        "verify_ms_median": standard["ms_median"],
        "copy_gb_per_s": gbps(bytes as f64, copy_ms),
        "copy_read_write_gb_per_s": gbps(2.0 * bytes as f64, copy_ms),
        "copy_ms_median": copy_ms,
        "cpu_one_core_gb_per_s": gbps(cpu_bytes as f64, cpu_s * 1e3),
        "reps": args.reps,
        "runs": rows,
    });
    println!("{line}");
    Ok(())
}
