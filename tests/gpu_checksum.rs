//! The block checksum kernel (`gf_xxh3_verify`) against the CPU checksum (`gpufeed::format::checksum`,
//! i.e. `xxhash_rust::xxh3::xxh3_64`), bit for bit.
//!
//! Every test needs a CUDA GPU and is ignored elsewhere; `scripts/gpu-checksum.sh` runs them on the GPU
//! machine with `--include-ignored`, then under compute-sanitizer (memcheck, racecheck) with
//! `GPUFEED_TEST_SCALE=small`. Inputs are drawn from a fresh seed every run (printed; set
//! `GPUFEED_TEST_SEED` to replay one). CI checks the kernel's algorithm without a GPU through its
//! transcription (`kernels::reference::xxh3_64_transcribed`), which the outcomes here are compared with
//! as well.

mod common;

use common::{device, fresh_rng, small};
use gpufeed::device::{CacheDir, Device, DeviceBuffer, DeviceError, Event, EventTiming, Stream};
use gpufeed::format::checksum;
use gpufeed::kernels::reference::xxh3_verify_transcribed;
use gpufeed::kernels::{
    ChecksumVerifier, Kernels, Xxh3Config, Xxh3Job, Xxh3Outcome, Xxh3Status, XXH3_JOB_BYTES,
    XXH3_OUTCOME_BYTES,
};
use gpufeed::synth;
use rand::rngs::StdRng;
use rand::Rng;

fn verifier(device: &Device, config: Xxh3Config) -> ChecksumVerifier {
    ChecksumVerifier::with_config(device, config, CacheDir::Disabled)
        .expect("the checksum kernel loads")
        .0
}

/// Every configuration the benchmark compares: each must be exact.
fn configs() -> Vec<Xxh3Config> {
    let mut configs = vec![Xxh3Config::STANDARD];
    if !small() {
        for blocks_per_step in [1, 2, 8] {
            configs.push(Xxh3Config {
                blocks_per_step,
                ..Xxh3Config::STANDARD
            });
        }
        configs.push(Xxh3Config {
            warps_per_block: 8,
            ..Xxh3Config::STANDARD
        });
    }
    configs
}

/// Blocks laid out in one source buffer as staging would hold them: at 4096-aligned offsets or at
/// arbitrary (mostly misaligned) ones, with gaps of junk between them. The last block ends exactly at
/// the end of the buffer, whose length is odd, so a read past any extent there leaves the allocation.
struct Staged {
    src: Vec<u8>,
    jobs: Vec<Xxh3Job>,
}

fn stage(blocks: &[Vec<u8>], rng: &mut StdRng) -> Staged {
    let mut src = Vec::new();
    let mut jobs = Vec::new();
    for (i, block) in blocks.iter().enumerate() {
        let gap = match rng.gen_range(0..3) {
            0 => (4096 - src.len() % 4096) % 4096,
            1 => rng.gen_range(0..64),
            _ => 0,
        };
        src.extend(std::iter::repeat_n(0xEEu8, gap));
        if i + 1 == blocks.len() && (src.len() + block.len()) % 2 == 0 {
            src.push(0xEE);
        }
        jobs.push(Xxh3Job {
            src_offset: src.len() as u64,
            bytes: block.len() as u32,
            expected: checksum(block),
        });
        src.extend_from_slice(block);
    }
    Staged { src, jobs }
}

/// Runs the kernel over `jobs` and `src` and copies the outcomes back.
fn run(
    device: &Device,
    verifier: &ChecksumVerifier,
    jobs: &[Xxh3Job],
    src: &[u8],
) -> Vec<Xxh3Outcome> {
    let stream = Stream::new(device).unwrap();
    let table = DeviceBuffer::from_host(device, &Xxh3Job::encode_all(jobs)).unwrap();
    let src = DeviceBuffer::from_host(device, src).unwrap();
    // Filled with a code no kernel writes, so that a job left without an outcome shows.
    let outcomes =
        DeviceBuffer::from_host(device, &vec![0xFF; jobs.len() * XXH3_OUTCOME_BYTES]).unwrap();
    let done = Event::new(device, EventTiming::Disabled).unwrap();
    // SAFETY: every buffer lives until `done` has been waited for below.
    unsafe {
        verifier
            .verify_async(&stream, &table, jobs.len() as u32, &src, &outcomes)
            .unwrap()
    };
    done.record(&stream).unwrap();
    done.synchronize().unwrap();
    Xxh3Outcome::decode_all(&outcomes.to_vec().unwrap())
}

/// The outcomes agree with the transcription job by job, and every job that fits has the CPU
/// checksum of its bytes as its hash.
fn check(jobs: &[Xxh3Job], src: &[u8], outcomes: &[Xxh3Outcome]) {
    assert_eq!(outcomes.len(), jobs.len());
    let model = xxh3_verify_transcribed(jobs, src);
    for (i, ((job, got), want)) in jobs.iter().zip(outcomes).zip(&model).enumerate() {
        assert_eq!(
            got, want,
            "job {i} ({job:?}): GPU and transcription disagree"
        );
        if got.status != Xxh3Status::BadJob {
            let start = job.src_offset as usize;
            assert_eq!(
                got.hash,
                checksum(&src[start..start + job.bytes as usize]),
                "job {i} ({} bytes at {start}): hash differs from the CPU checksum",
                job.bytes
            );
        }
    }
}

fn random_block(rng: &mut StdRng, len: usize) -> Vec<u8> {
    synth::random_bytes(len, rng.gen())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_xxh3_matches_the_cpu_checksum_for_every_length_class() {
    let mut rng = fresh_rng("gpu_xxh3_matches_the_cpu_checksum_for_every_length_class");
    let device = device();
    // 0, 1-3, 4-8, 9-16, 17-128, 129-240, then the long path: around each 1 KiB block boundary, random
    // lengths, and the typical block sizes (4 KiB to 16 MiB, default 64 KiB).
    let mut lengths: Vec<usize> = (0..=300).collect();
    let boundaries = if small() { 4 } else { 20 };
    for k in 1..=boundaries {
        for delta in [-65i64, -64, -63, -1, 0, 1, 63, 64, 65] {
            lengths.push((k * 1024 + delta) as usize);
        }
    }
    let random = if small() { 20 } else { 200 };
    lengths.extend((0..random).map(|_| rng.gen_range(241..70_000)));
    lengths.extend([4096, 65536, 65536, 1 << 20]);
    if !small() {
        lengths.extend([16 << 20, rng.gen_range(1 << 20..16 << 20)]);
    }
    let blocks: Vec<Vec<u8>> = lengths
        .iter()
        .map(|&len| random_block(&mut rng, len))
        .collect();
    let staged = stage(&blocks, &mut rng);
    for config in configs() {
        println!("config {config:?}");
        let outcomes = run(
            &device,
            &verifier(&device, config),
            &staged.jobs,
            &staged.src,
        );
        check(&staged.jobs, &staged.src, &outcomes);
        let ok = outcomes
            .iter()
            .filter(|o| o.status == Xxh3Status::Ok)
            .count();
        assert_eq!(ok, staged.jobs.len(), "every block has its checksum");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_xxh3_detects_one_flipped_bit() {
    let mut rng = fresh_rng("gpu_xxh3_detects_one_flipped_bit");
    let device = device();
    let verifier = verifier(&device, Xxh3Config::STANDARD);
    let mut lengths = vec![
        1, 2, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1024, 1025,
    ];
    lengths.extend([4096, 65536, 65536 + 17]);
    lengths.extend((0..40).map(|_| rng.gen_range(1..70_000)));
    // Each block twice: intact, then with one bit flipped where its checksum was computed.
    let mut blocks = Vec::new();
    let mut flipped_at = Vec::new();
    for &len in &lengths {
        let block = random_block(&mut rng, len);
        let mut damaged = block.clone();
        let at = rng.gen_range(0..len);
        damaged[at] ^= 1 << rng.gen_range(0..8);
        blocks.push(block);
        blocks.push(damaged);
        flipped_at.push(at);
    }
    let mut staged = stage(&blocks, &mut rng);
    for pair in staged.jobs.chunks_exact_mut(2) {
        pair[1].expected = pair[0].expected;
    }
    let outcomes = run(&device, &verifier, &staged.jobs, &staged.src);
    check(&staged.jobs, &staged.src, &outcomes);
    for (i, pair) in outcomes.chunks_exact(2).enumerate() {
        assert_eq!(pair[0].status, Xxh3Status::Ok, "intact block {i}");
        assert_eq!(
            pair[1].status,
            Xxh3Status::Mismatch,
            "block {i} of {} bytes with bit flipped at byte {}",
            lengths[i],
            flipped_at[i]
        );
        assert_ne!(pair[1].hash, staged.jobs[2 * i + 1].expected);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_xxh3_refuses_out_of_bounds_jobs() {
    let mut rng = fresh_rng("gpu_xxh3_refuses_out_of_bounds_jobs");
    let device = device();
    let verifier = verifier(&device, Xxh3Config::STANDARD);
    // An odd-sized source, so that compute-sanitizer sees any read past its end.
    let src = random_block(&mut rng, 70_001);
    let len = src.len() as u64;
    let sum =
        |offset: u64, bytes: u32| checksum(&src[offset as usize..(offset + bytes as u64) as usize]);
    let bad = |src_offset: u64, bytes: u32| Xxh3Job {
        src_offset,
        bytes,
        expected: 0,
    };
    let good = |src_offset: u64, bytes: u32| Xxh3Job {
        src_offset,
        bytes,
        expected: sum(src_offset, bytes),
    };
    let jobs = vec![
        bad(len + 1, 0),
        good(0, 70_001),
        bad(len, 1),
        bad(len - 10, 11),
        good(len - 10, 10),
        bad(len - 300, 301),
        good(len - 300, 300),
        bad(len - 5000, 5001),
        good(len - 5000, 5000),
        bad(u64::MAX, 1),
        bad(u64::MAX - 5, 10),
        bad(u64::MAX - (u32::MAX as u64) + 1, u32::MAX),
        bad(1 << 63, u32::MAX),
        bad(0, u32::MAX),
        bad(0, 70_002),
        good(len, 0),
        good(1, 70_000),
    ];
    let outcomes = run(&device, &verifier, &jobs, &src);
    check(&jobs, &src, &outcomes);
    for (job, outcome) in jobs.iter().zip(&outcomes) {
        let fits = job.src_offset <= len && job.bytes as u64 <= len - job.src_offset;
        let want = if fits {
            Xxh3Status::Ok
        } else {
            Xxh3Status::BadJob
        };
        assert_eq!(outcome.status, want, "{job:?}");
        if !fits {
            assert_eq!(outcome.hash, 0, "a refused job reports no hash");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_xxh3_checks_thousands_of_jobs_in_one_launch() {
    let mut rng = fresh_rng("gpu_xxh3_checks_thousands_of_jobs_in_one_launch");
    let device = device();
    let verifier = verifier(&device, Xxh3Config::STANDARD);
    let count = if small() { 600 } else { 5000 };
    let blocks: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            let len = match i % 5 {
                0 => 65536,
                1 => 4096,
                2 => rng.gen_range(0..=240),
                _ => rng.gen_range(241..16384),
            };
            random_block(&mut rng, len)
        })
        .collect();
    let mut staged = stage(&blocks, &mut rng);
    // About one in ten blocks has a wrong checksum in its table.
    let mut corrupt = 0;
    for job in &mut staged.jobs {
        if rng.gen_bool(0.1) {
            job.expected ^= 1 << rng.gen_range(0..64);
            corrupt += 1;
        }
    }
    let outcomes = run(&device, &verifier, &staged.jobs, &staged.src);
    check(&staged.jobs, &staged.src, &outcomes);
    let mismatches = outcomes
        .iter()
        .filter(|o| o.status == Xxh3Status::Mismatch)
        .count();
    assert_eq!(mismatches, corrupt);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_xxh3_hashes_zero_length_jobs() {
    let mut rng = fresh_rng("gpu_xxh3_hashes_zero_length_jobs");
    let device = device();
    // Through Kernels::load, as the daemon loads it.
    let kernels = Kernels::load(&device, CacheDir::Disabled).expect("kernels load");
    assert!(kernels.origins.iter().any(|(name, _)| *name == "xxh3"));
    let src = random_block(&mut rng, 1000);
    let empty = checksum(&[]);
    assert_eq!(empty, 0x2D06_8005_38D3_94C2, "xxh3-64 of no bytes");
    let zero = |src_offset: u64, expected: u64| Xxh3Job {
        src_offset,
        bytes: 0,
        expected,
    };
    let jobs = [
        zero(0, empty),
        zero(500, empty),
        zero(1000, empty),
        zero(7, empty ^ 1),
    ];
    let outcomes = run(&device, &kernels.xxh3, &jobs, &src);
    check(&jobs, &src, &outcomes);
    let got: Vec<(Xxh3Status, u64)> = outcomes.iter().map(|o| (o.status, o.hash)).collect();
    assert_eq!(
        got,
        [
            (Xxh3Status::Ok, empty),
            (Xxh3Status::Ok, empty),
            (Xxh3Status::Ok, empty),
            (Xxh3Status::Mismatch, empty)
        ]
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_xxh3_refuses_tables_shorter_than_the_job_count() {
    let device = device();
    let verifier = verifier(&device, Xxh3Config::STANDARD);
    let stream = Stream::new(&device).unwrap();
    let (table3, table4) = (
        DeviceBuffer::new(&device, 3 * XXH3_JOB_BYTES).unwrap(),
        DeviceBuffer::new(&device, 4 * XXH3_JOB_BYTES).unwrap(),
    );
    let (outcomes3, outcomes4) = (
        DeviceBuffer::new(&device, 3 * XXH3_OUTCOME_BYTES).unwrap(),
        DeviceBuffer::new(&device, 4 * XXH3_OUTCOME_BYTES).unwrap(),
    );
    let src = DeviceBuffer::new(&device, 4096).unwrap();
    // SAFETY: both calls are refused before anything is queued.
    let (short_table, short_outcomes) = unsafe {
        (
            verifier.verify_async(&stream, &table3, 4, &src, &outcomes4),
            verifier.verify_async(&stream, &table4, 4, &src, &outcomes3),
        )
    };
    assert!(
        matches!(short_table, Err(DeviceError::OutOfBounds { what, .. }) if what.contains("job table")),
        "{short_table:?}"
    );
    assert!(
        matches!(short_outcomes, Err(DeviceError::OutOfBounds { what, .. }) if what.contains("outcome table")),
        "{short_outcomes:?}"
    );
    // No jobs: nothing is launched.
    // SAFETY: nothing is queued for zero jobs.
    unsafe { verifier.verify_async(&stream, &table3, 0, &src, &outcomes3) }.unwrap();
    stream.synchronize().unwrap();
}
