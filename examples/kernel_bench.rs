//! Kernel benchmark: LZ4 decode of 64 KiB blocks and gather + convert, against a device-to-device copy.
//!
//! Run on the GPU machine by `scripts/gpu-check.sh`:
//!
//! ```text
//! kernel_bench --mib 1024 --data /tmp/gpufeed-bench --out $OUT
//! ```
//!
//! It generates the two data sets of the issue (zipf-distributed int32 tokens and ReLU-sparse fp16),
//! compresses each 64 KiB block with lz4_flex (plain, and byte-shuffled as the packer can store them),
//! times both LZ4 decoders in several builds each (`Lz4Config::STANDARD`, one sequence per warp step,
//! and the two-phase `Lz4Config::TWO_PHASE`) with CUDA events (warm-up, then the median of repeated
//! runs; outputs verified against the raw bytes once, never timed on zeros) and prints the two side by
//! side, times gather + convert batches against a large device-to-device copy measured in the same run,
//! and times a small per-batch sequence with and without a CUDA graph. With `--data` it writes the
//! same blocks for `scripts/nvcomp_bench.py`: `NAME.lz4` (blocks at 16-byte aligned offsets),
//! `NAME.idx` (u64 offset, u64 stored bytes, u64 raw bytes per block) and `NAME.raw`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use gpufeed::decode::shuffle;
use gpufeed::device::{
    time_on_stream, BufferPool, CacheDir, Device, DeviceBuffer, DeviceMemory, PinnedBuffer, Stream,
};
use gpufeed::kernels::reference::relu_sparse_f16;
use gpufeed::kernels::{
    GatherLayout, GatherOp, GatherPlan, Gatherer, Lz4Config, Lz4Decoder, Lz4Job, Lz4Outcome,
    Lz4Status, SequencePath, Unshuffle, GATHER_OUTCOME_BYTES, LZ4_JOB_BYTES, LZ4_OUTCOME_BYTES,
};
use gpufeed::synth;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

const BLOCK_BYTES: usize = 64 << 10;
const WARMUP: usize = 3;
const REPS: usize = 20;

struct Args {
    mib: usize,
    profile: bool,
    data: Option<PathBuf>,
    out: Option<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        mib: 1024,
        profile: false,
        data: None,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--mib" => args.mib = it.next().context("--mib N")?.parse()?,
            "--data" => args.data = Some(it.next().context("--data DIR")?.into()),
            "--out" => args.out = Some(it.next().context("--out DIR")?.into()),
            "--profile" => args.profile = true,
            other => bail!(
                "unknown argument {other} (expected --mib N, --data DIR, --out DIR, --profile)"
            ),
        }
    }
    Ok(args)
}

/// Generates `bytes` of data in parallel, 16 MiB per task, each task seeded by its index.
fn generate(bytes: usize, make: fn(usize, u64) -> Vec<u8>) -> Vec<u8> {
    const TASK_BYTES: usize = 16 << 20;
    let tasks = bytes.div_ceil(TASK_BYTES);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut parts: Vec<Vec<u8>> = vec![Vec::new(); tasks];
    std::thread::scope(|scope| {
        for (t, chunk) in parts.chunks_mut(tasks.div_ceil(threads)).enumerate() {
            let first = t * tasks.div_ceil(threads);
            scope.spawn(move || {
                for (k, part) in chunk.iter_mut().enumerate() {
                    let index = first + k;
                    let len = TASK_BYTES.min(bytes - index * TASK_BYTES);
                    *part = make(len, 1000 + index as u64);
                }
            });
        }
    });
    parts.concat()
}

fn zipf_bytes(len: usize, seed: u64) -> Vec<u8> {
    synth::zipf_tokens_i32(len / 4, seed)
}

fn relu_bytes(len: usize, seed: u64) -> Vec<u8> {
    relu_sparse_f16(len / 2, seed)
}

/// A data set cut into 64 KiB blocks and LZ4-compressed, laid out as the staging buffer holds it.
struct Compressed {
    name: String,
    raw: Vec<u8>,
    staging: Vec<u8>,
    jobs: Vec<Lz4Job>,
    shuffled: bool,
}

fn compress(name: &str, raw: Vec<u8>, element_bytes: u32, shuffled: bool) -> Compressed {
    compress_blocks(name, raw, element_bytes, shuffled, BLOCK_BYTES)
}

fn compress_blocks(
    name: &str,
    raw: Vec<u8>,
    element_bytes: u32,
    shuffled: bool,
    block_bytes: usize,
) -> Compressed {
    let blocks: Vec<&[u8]> = raw.chunks(block_bytes).collect();
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per_thread = blocks.len().div_ceil(threads);
    let mut stored: Vec<Vec<u8>> = vec![Vec::new(); blocks.len()];
    std::thread::scope(|scope| {
        for (inputs, outputs) in blocks.chunks(per_thread).zip(stored.chunks_mut(per_thread)) {
            scope.spawn(move || {
                let mut scratch = vec![0u8; block_bytes];
                for (input, output) in inputs.iter().zip(outputs) {
                    *output = if shuffled {
                        let s = &mut scratch[..input.len()];
                        shuffle(input, element_bytes as usize, s);
                        lz4_flex::block::compress(s)
                    } else {
                        lz4_flex::block::compress(input)
                    };
                }
            });
        }
    });
    let mut staging = Vec::new();
    let mut jobs = Vec::new();
    let raw_total = raw.len() as u64;
    for (i, (block, stored)) in blocks.iter().zip(&stored).enumerate() {
        staging.resize(staging.len().div_ceil(16) * 16, 0);
        let dst_offset = (i * block_bytes) as u64;
        jobs.push(Lz4Job {
            src_offset: staging.len() as u64,
            src_bytes: stored.len() as u32,
            dst_offset,
            raw_bytes: block.len() as u32,
            // Scratch for the shuffled bytes: a second region after all outputs.
            unshuffle: shuffled.then_some(Unshuffle {
                element_bytes,
                scratch_offset: raw_total + dst_offset,
            }),
        });
        staging.extend_from_slice(stored);
    }
    Compressed {
        name: name.to_owned(),
        raw,
        staging,
        jobs,
        shuffled,
    }
}

impl Compressed {
    /// The first `blocks` blocks, with scratch offsets for a batch of that size.
    fn clone_prefix(&self, blocks: usize) -> Compressed {
        let jobs = &self.jobs[..blocks];
        let raw_bytes: u64 = jobs.iter().map(|j| j.raw_bytes as u64).sum();
        let last = jobs.last().expect("at least one block");
        Compressed {
            name: format!("{} (first {blocks} blocks)", self.name),
            raw: self.raw[..raw_bytes as usize].to_vec(),
            staging: self.staging[..(last.src_offset + last.src_bytes as u64) as usize].to_vec(),
            jobs: jobs
                .iter()
                .map(|j| Lz4Job {
                    unshuffle: j.unshuffle.map(|u| Unshuffle {
                        scratch_offset: raw_bytes + j.dst_offset,
                        ..u
                    }),
                    ..*j
                })
                .collect(),
            shuffled: self.shuffled,
        }
    }

    fn ratio(&self) -> f64 {
        self.raw.len() as f64 / self.jobs.iter().map(|j| j.src_bytes as f64).sum::<f64>()
    }

    /// Writes the blocks for the nvCOMP script (LZ4 streams as stored; the raw bytes only when they are
    /// what nvCOMP's output should equal, i.e. unshuffled).
    fn write_files(&self, dir: &std::path::Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(format!("{}.lz4", self.name)), &self.staging)?;
        let mut index = Vec::with_capacity(self.jobs.len() * 24);
        for job in &self.jobs {
            index.extend_from_slice(&job.src_offset.to_le_bytes());
            index.extend_from_slice(&(job.src_bytes as u64).to_le_bytes());
            index.extend_from_slice(&(job.raw_bytes as u64).to_le_bytes());
        }
        std::fs::write(dir.join(format!("{}.idx", self.name)), index)?;
        if !self.shuffled {
            std::fs::write(dir.join(format!("{}.raw", self.name)), &self.raw)?;
        }
        Ok(())
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).expect("no NaN timings"));
    values[values.len() / 2]
}

/// Times `run` (which queues work on `stream`) with events: warm-up, then the median of REPS runs.
/// Returns (median ms, min ms, max ms).
fn time_ms(
    device: &Device,
    stream: &Stream,
    run: impl FnMut() -> Result<()>,
) -> Result<(f64, f64, f64)> {
    let samples = time_on_stream(device, stream, WARMUP, REPS, run)?;
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(0.0, f64::max);
    Ok((median(samples), min, max))
}

struct Row {
    what: String,
    value: String,
    note: String,
}

fn gbps(bytes: f64, ms: f64) -> f64 {
    bytes / (ms * 1e-3) / 1e9
}

fn bench_decode(
    device: &Device,
    stream: &Stream,
    decoder: &Lz4Decoder,
    set: &Compressed,
) -> Result<(f64, f64, f64)> {
    let table = DeviceBuffer::from_host(device, &Lz4Job::encode_all(&set.jobs))?;
    let src = DeviceBuffer::from_host(device, &set.staging)?;
    let dst_bytes = set.raw.len() * if set.shuffled { 2 } else { 1 };
    let dst = DeviceBuffer::from_host(device, &vec![0xA5u8; dst_bytes])?;
    let outcomes = DeviceBuffer::new(device, set.jobs.len() * LZ4_OUTCOME_BYTES)?;
    let count = set.jobs.len() as u32;
    // SAFETY: the buffers live until the end of this function, after the stream synchronisation.
    unsafe { decoder.decode_async(stream, &table, count, &src, &dst, &outcomes)? };
    stream.synchronize()?;
    let statuses = Lz4Outcome::decode_all(&outcomes.to_vec()?);
    if let Some((i, bad)) = statuses
        .iter()
        .enumerate()
        .find(|(_, o)| o.status != Lz4Status::Ok)
    {
        bail!("{}: block {i} decoded with {bad:?}", set.name);
    }
    let mut out = vec![0u8; set.raw.len()];
    dst.read(0, &mut out)?;
    if out != set.raw {
        bail!("{}: decoded bytes differ from the raw data", set.name);
    }
    time_ms(device, stream, || {
        // SAFETY: the buffers live until the end of this function, after time_ms's last event wait.
        unsafe { decoder.decode_async(stream, &table, count, &src, &dst, &outcomes)? };
        Ok(())
    })
}

/// One launch of each kernel for a profiler, in this order: LZ4 decode of both plain data sets with
/// the two-phase decoder (`Lz4Config::TWO_PHASE`), the same with the standard decoder, then one
/// f16 -> f32 gather. `ncu --launch-count 3` (scripts/gpu-check.sh) thus profiles the two-phase
/// decoder on both sets and the standard one on zipf_i32.
fn profile(device: &Device, stream: &Stream, zipf: Vec<u8>, relu: Vec<u8>) -> Result<()> {
    let sets = [
        compress("zipf_i32", zipf, 4, false),
        compress("relu_f16", relu, 2, false),
    ];
    let mut decoded = Vec::new();
    for config in [Lz4Config::TWO_PHASE, Lz4Config::STANDARD] {
        let (decoder, _) = Lz4Decoder::with_config(device, config, kernel_cache())?;
        for set in &sets {
            let table = DeviceBuffer::from_host(device, &Lz4Job::encode_all(&set.jobs))?;
            let src = DeviceBuffer::from_host(device, &set.staging)?;
            let dst = DeviceBuffer::new(device, set.raw.len())?;
            let outcomes = DeviceBuffer::new(device, set.jobs.len() * LZ4_OUTCOME_BYTES)?;
            // SAFETY: the buffers outlive the synchronisation that follows.
            unsafe {
                decoder.decode_async(
                    stream,
                    &table,
                    set.jobs.len() as u32,
                    &src,
                    &dst,
                    &outcomes,
                )?
            };
            stream.synchronize()?;
            decoded.push(dst);
        }
    }
    let (gatherer, _) = Gatherer::new(device, GatherLayout::STANDARD, kernel_cache())?;
    let source = &decoded[1];
    let elements = (source.len() / 2) as u64;
    let mut plan = GatherPlan::new();
    plan.push(0, 0, 0, elements, GatherOp::F16ToF32, 1.0);
    let table = DeviceBuffer::from_host(device, &plan.encode())?;
    let slot = DeviceBuffer::new(device, (elements * 4) as usize)?;
    let outcome = DeviceBuffer::new(device, GATHER_OUTCOME_BYTES)?;
    // SAFETY: as above.
    unsafe {
        gatherer.gather_async(
            stream,
            &table,
            plan.pieces().len() as u32,
            &[source],
            &slot,
            &outcome,
        )?
    };
    stream.synchronize()?;
    println!(
        "profiled, in order: lz4 decode of zipf_i32 and relu_f16 (two-phase), the same (standard), \
         gather f16->f32"
    );
    Ok(())
}

/// Times `BATCHES` per-batch sequences over all blocks of `set` (decoded and widened to i64): tables
/// uploaded from pinned memory, decode, gather; queued directly, then replayed as a CUDA graph.
fn bench_small_batches(
    device: &Device,
    stream: &Stream,
    gatherer: &Gatherer,
    set: &Compressed,
) -> Result<Vec<Row>> {
    let batch_blocks = set.jobs.len();
    let block_bytes = set.jobs[0].raw_bytes as usize;
    let jobs = &set.jobs[..];
    let last = jobs.last().expect("blocks");
    let staging_bytes = (last.src_offset + last.src_bytes as u64) as usize;
    let staging = DeviceBuffer::from_host(device, &set.staging[..staging_bytes])?;
    let decode_pool = BufferPool::new(device, "decode", 1, batch_blocks * block_bytes * 2)?;
    let decoded = decode_pool.acquire()?;
    let batch_jobs: Vec<Lz4Job> = jobs
        .iter()
        .map(|j| Lz4Job {
            unshuffle: j.unshuffle.map(|u| Unshuffle {
                scratch_offset: (batch_blocks * block_bytes) as u64 + j.dst_offset,
                ..u
            }),
            ..*j
        })
        .collect();
    let mut plan = GatherPlan::new();
    for (k, j) in batch_jobs.iter().enumerate() {
        plan.push(
            0,
            j.dst_offset,
            (k * block_bytes * 2) as u64,
            j.raw_bytes as u64 / 4,
            GatherOp::I32ToI64,
            1.0,
        );
    }
    let job_bytes = Lz4Job::encode_all(&batch_jobs);
    let piece_bytes = plan.encode();
    let mut pinned = PinnedBuffer::new(device, job_bytes.len() + piece_bytes.len())?;
    pinned.as_mut_slice()[..job_bytes.len()].copy_from_slice(&job_bytes);
    pinned.as_mut_slice()[job_bytes.len()..].copy_from_slice(&piece_bytes);
    let job_table = DeviceBuffer::new(device, batch_blocks * LZ4_JOB_BYTES)?;
    let piece_table = DeviceBuffer::new(device, piece_bytes.len())?;
    let outcomes = DeviceBuffer::new(device, batch_blocks * LZ4_OUTCOME_BYTES)?;
    let slot = DeviceBuffer::new(device, batch_blocks * block_bytes * 2)?;
    let gather_outcome = DeviceBuffer::new(device, GATHER_OUTCOME_BYTES)?;
    let (decoder, _) = Lz4Decoder::with_config(device, Lz4Config::STANDARD, kernel_cache())?;
    let pieces = plan.pieces().len() as u32;
    let enqueue = |s: &Stream| -> Result<(), gpufeed::device::DeviceError> {
        // SAFETY: every buffer here outlives the timing loops, which end with a synchronisation; the
        // pinned tables are not written while batches are in flight.
        unsafe {
            pinned.upload_async(s, 0, &job_table, 0, job_bytes.len())?;
            pinned.upload_async(s, job_bytes.len(), &piece_table, 0, piece_bytes.len())?;
            decoder.decode_async(
                s,
                &job_table,
                batch_blocks as u32,
                &staging,
                &decoded,
                &outcomes,
            )?;
            gatherer.gather_async(s, &piece_table, pieces, &[&decoded], &slot, &gather_outcome)
        }
    };
    const BATCHES: usize = 200;
    let (direct_ms, _, _) = time_ms(device, stream, || {
        for _ in 0..BATCHES {
            enqueue(stream)?;
        }
        Ok(())
    })?;
    let graph = stream.capture(enqueue)?;
    let (graph_ms, _, _) = time_ms(device, stream, || {
        for _ in 0..BATCHES {
            // SAFETY: as for the direct launches.
            unsafe { graph.launch(stream)? };
        }
        Ok(())
    })?;
    let check = Lz4Outcome::decode_all(&outcomes.to_vec()?);
    if check.iter().any(|o| o.status != Lz4Status::Ok) {
        bail!("small-batch decode failed: {check:?}");
    }
    let what = format!(
        "per-batch sequence, {batch_blocks} blocks of {} KiB",
        block_bytes >> 10
    );
    Ok(vec![
        Row {
            what: format!("{what}: direct launches"),
            value: format!("{:.1} us/batch", direct_ms * 1e3 / BATCHES as f64),
            note: "2 pinned uploads + decode + memset + gather".into(),
        },
        Row {
            what: format!("{what}: CUDA graph"),
            value: format!("{:.1} us/batch", graph_ms * 1e3 / BATCHES as f64),
            note: format!("{:.2}x the direct time", graph_ms / direct_ms),
        },
    ])
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let device = Device::open(0).context("opening CUDA device 0")?;
    let props = device.properties().clone();
    println!(
        "device: {} (sm_{}{}, {} SMs, {} MiB L2, driver CUDA {}.{})",
        props.name,
        props.compute_capability.0,
        props.compute_capability.1,
        props.multiprocessors,
        props.l2_bytes >> 20,
        props.driver_version / 1000,
        props.driver_version % 1000 / 10
    );
    let stream = Stream::new(&device)?;
    let mut rows: Vec<Row> = Vec::new();
    let bytes = args.mib << 20;

    let t = Instant::now();
    let zipf = generate(bytes, zipf_bytes);
    let relu = generate(bytes, relu_bytes);
    if args.profile {
        return profile(&device, &stream, zipf, relu);
    }
    let sets = vec![
        compress("zipf_i32", zipf.clone(), 4, false),
        compress("relu_f16", relu.clone(), 2, false),
        compress("zipf_i32_shuffled", zipf, 4, true),
        compress("relu_f16_shuffled", relu, 2, true),
    ];
    println!(
        "generated and compressed 4 x {} MiB in {:.1} s",
        args.mib,
        t.elapsed().as_secs_f64()
    );
    if let Some(dir) = &args.data {
        for set in &sets {
            set.write_files(dir)?;
        }
        println!("wrote the blocks to {}", dir.display());
    }

    // LZ4 decode: the standard configuration and its neighbours, then the two-phase decoder's builds.
    let general = Lz4Config {
        sequences: SequencePath::GeneralOnly,
        min_blocks_per_sm: 0,
        ..Lz4Config::STANDARD
    };
    const STANDARD_LABEL: &str = "standard: 4 warps/block, fast path, 40 registers";
    let configs = [
        (STANDARD_LABEL, Lz4Config::STANDARD),
        ("general path only (the run-1 kernel)", general),
        (
            "4 warps/block, fast path, 48 registers",
            Lz4Config {
                min_blocks_per_sm: 0,
                ..Lz4Config::STANDARD
            },
        ),
        (
            "2 warps/block, fast path",
            Lz4Config {
                warps_per_block: 2,
                min_blocks_per_sm: 0,
                ..Lz4Config::STANDARD
            },
        ),
        (
            "8 warps/block, fast path",
            Lz4Config {
                warps_per_block: 8,
                min_blocks_per_sm: 0,
                ..Lz4Config::STANDARD
            },
        ),
        (
            "two-phase: 4 warps/block, 40 registers (TWO_PHASE)",
            Lz4Config::TWO_PHASE,
        ),
        (
            "two-phase: 4 warps/block, registers uncapped",
            Lz4Config {
                min_blocks_per_sm: 0,
                ..Lz4Config::TWO_PHASE
            },
        ),
        (
            "two-phase: 8 warps/block, 40 registers",
            Lz4Config {
                warps_per_block: 8,
                min_blocks_per_sm: 6,
                ..Lz4Config::TWO_PHASE
            },
        ),
        (
            "two-phase: 8 warps/block, registers uncapped",
            Lz4Config {
                warps_per_block: 8,
                min_blocks_per_sm: 0,
                ..Lz4Config::TWO_PHASE
            },
        ),
    ];
    let mut best: Vec<(String, f64, &str)> = Vec::new();
    // Per data set: the standard decoder's rate, and the best two-phase build's rate and label.
    let mut side_by_side: Vec<(String, f64, f64, &str)> = sets
        .iter()
        .map(|set| (set.name.clone(), 0.0, 0.0, ""))
        .collect();
    for (label, config) in configs {
        let (decoder, _) = Lz4Decoder::with_config(&device, config, kernel_cache())?;
        let per_sm = decoder
            .kernel()
            .blocks_per_multiprocessor(config.warps_per_block * 32)?;
        for set in &sets {
            let (ms, min, max) = bench_decode(&device, &stream, &decoder, set)?;
            let rate = gbps(set.raw.len() as f64, ms);
            rows.push(Row {
                what: format!("lz4 decode {} ({label})", set.name),
                value: format!("{rate:.1} GB/s out"),
                note: format!(
                    "ratio {:.2}, median {ms:.3} ms (min {min:.3}, max {max:.3}), {} warps/SM resident",
                    set.ratio(),
                    per_sm * config.warps_per_block
                ),
            });
            match best.iter_mut().find(|(n, _, _)| *n == set.name) {
                Some((_, b, _)) if *b >= rate => {}
                Some((_, b, l)) => {
                    *b = rate;
                    *l = label;
                }
                None => best.push((set.name.clone(), rate, label)),
            }
            let entry = side_by_side
                .iter_mut()
                .find(|(n, _, _, _)| *n == set.name)
                .expect("every set has an entry");
            if label == STANDARD_LABEL {
                entry.1 = rate;
            } else if config.sequences == SequencePath::TwoPhase && rate > entry.2 {
                entry.2 = rate;
                entry.3 = label;
            }
        }
    }

    // Device-to-device copy, the ceiling for gather + convert.
    let copy_bytes = 1usize << 30;
    let copy_src = DeviceBuffer::from_host(&device, &synth::random_bytes(copy_bytes, 5))?;
    let copy_dst = DeviceBuffer::new(&device, copy_bytes)?;
    let (copy_ms, _, _) = time_ms(&device, &stream, || {
        // SAFETY: both buffers outlive the timing (synchronised inside time_ms).
        unsafe { gpufeed::device::copy_async(&stream, &copy_src, 0, &copy_dst, 0, copy_bytes)? };
        Ok(())
    })?;
    let copy_rate = gbps(2.0 * copy_bytes as f64, copy_ms);
    rows.push(Row {
        what: "device-to-device copy, 1 GiB".into(),
        value: format!("{copy_rate:.0} GB/s read+write"),
        note: format!("median {copy_ms:.3} ms"),
    });
    drop(copy_dst);

    // Gather + convert batches, samples in a random order from a large source.
    let source = copy_src; // 1 GiB of random bytes (never zeros)
    let mut rng = StdRng::seed_from_u64(17);
    let cases: [(&str, GatherOp, u64, usize); 5] = [
        (
            "f16->f32, 256 samples x 512 Ki elements",
            GatherOp::F16ToF32,
            512 << 10,
            256,
        ),
        (
            "bf16->f32, 256 samples x 512 Ki elements",
            GatherOp::Bf16ToF32,
            512 << 10,
            256,
        ),
        (
            "i32->i64 tokens, 16384 samples x 2048",
            GatherOp::I32ToI64,
            2048,
            16384,
        ),
        (
            "u8->f32 images /255, 1024 x 224x224x3",
            GatherOp::U8ToF32,
            224 * 224 * 3,
            1024,
        ),
        (
            "identity copy, 256 samples x 1 MiB",
            GatherOp::Copy,
            1 << 20,
            256,
        ),
    ];
    let mut gather_worst = f64::INFINITY;
    for layout in [GatherLayout::CoalescedStores, GatherLayout::WideLoads] {
        let (gatherer, _) = Gatherer::new(&device, layout, kernel_cache())?;
        for (label, op, elements, samples) in cases {
            let sample_in = elements * op.in_bytes();
            let slots = (source.len() as u64 / sample_in) as usize;
            let mut order: Vec<usize> = (0..slots).collect();
            order.shuffle(&mut rng);
            let mut plan = GatherPlan::new();
            let scale = if op == GatherOp::U8ToF32 {
                1.0 / 255.0
            } else {
                1.0
            };
            for (k, &slot) in order.iter().cycle().take(samples).enumerate() {
                plan.push(
                    0,
                    slot as u64 * sample_in,
                    k as u64 * elements * op.out_bytes(),
                    elements,
                    op,
                    scale,
                );
            }
            let out_bytes = samples as u64 * elements * op.out_bytes();
            let in_bytes = samples as u64 * sample_in;
            let table = DeviceBuffer::from_host(&device, &plan.encode())?;
            let slot = DeviceBuffer::new(&device, out_bytes as usize)?;
            let outcome = DeviceBuffer::new(&device, GATHER_OUTCOME_BYTES)?;
            let pieces = plan.pieces().len() as u32;
            let (ms, _, _) = time_ms(&device, &stream, || {
                // SAFETY: the buffers outlive the timing.
                unsafe {
                    gatherer.gather_async(&stream, &table, pieces, &[&source], &slot, &outcome)?
                };
                Ok(())
            })?;
            let rate = gbps((in_bytes + out_bytes) as f64, ms);
            if layout == GatherLayout::STANDARD {
                gather_worst = gather_worst.min(rate / copy_rate);
            }
            rows.push(Row {
                what: format!("gather {label} ({layout:?})"),
                value: format!("{rate:.0} GB/s read+write"),
                note: format!(
                    "{:.2}x the D2D copy; {} MiB in, {} MiB out, median {ms:.3} ms",
                    rate / copy_rate,
                    in_bytes >> 20,
                    out_bytes >> 20
                ),
            });
        }
    }

    // Small batches queued the way the pipeline does it, with direct launches and as a CUDA graph.
    let (gatherer, _) = Gatherer::new(&device, GatherLayout::STANDARD, kernel_cache())?;
    let small_sets = [
        sets[2].clone_prefix(32),
        compress_blocks(
            "zipf_i32_shuffled_1k",
            sets[2].raw[..32 << 10].to_vec(),
            4,
            true,
            1024,
        ),
    ];
    for set in &small_sets {
        rows.extend(bench_small_batches(&device, &stream, &gatherer, set)?);
    }

    let mut table = String::new();
    writeln!(table, "| measurement | result | notes |")?;
    writeln!(table, "|---|---|---|")?;
    for row in &rows {
        writeln!(table, "| {} | {} | {} |", row.what, row.value, row.note)?;
    }
    writeln!(table)?;
    for (name, rate, label) in &best {
        writeln!(
            table,
            "best lz4 decode {name}: {rate:.1} GB/s out ({label})"
        )?;
    }
    writeln!(
        table,
        "worst gather / D2D copy ({:?}): {gather_worst:.2}x",
        GatherLayout::STANDARD
    )?;
    writeln!(table)?;
    writeln!(
        table,
        "| lz4 decode, GB/s out | standard | two-phase (best build) | two-phase / standard |"
    )?;
    writeln!(table, "|---|---|---|---|")?;
    for (name, standard, two_phase, label) in &side_by_side {
        writeln!(
            table,
            "| {name} | {standard:.1} | {two_phase:.1} ({label}) | {:.2}x |",
            two_phase / standard
        )?;
    }
    print!("{table}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        std::fs::write(out.join("kernel_bench.md"), &table)?;
    }
    Ok(())
}

/// The compiled-kernel cache the daemon would use under this environment: `GPUFEED_CACHE_DIR`, else
/// the default under `XDG_CACHE_HOME` or `HOME`.
fn kernel_cache() -> CacheDir {
    std::env::var_os("GPUFEED_CACHE_DIR")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .or_else(|| gpufeed::config::kernel_cache_dir_default(|name| std::env::var_os(name)))
        .map_or(CacheDir::Disabled, CacheDir::At)
}
