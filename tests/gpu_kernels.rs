//! The GPU kernels against the CPU decode path (`lz4_flex` + `half`), bit for bit.
//!
//! Tests named `gpu_*` need a CUDA GPU and are ignored elsewhere; `scripts/gpu-check.sh` runs them on
//! the GPU machine with `--include-ignored`, then again under compute-sanitizer (memcheck, racecheck)
//! with `GPUFEED_TEST_SCALE=small`. Inputs are drawn from a fresh seed every run (printed; set
//! `GPUFEED_TEST_SEED` to replay one). The two tests without the prefix run everywhere and check that a
//! machine without CUDA gets typed errors, not panics.

mod common;

use std::collections::HashMap;

use common::{device, fresh_rng, small};
use gpufeed::decode::{decode_block, shuffle, BlockRef};
use gpufeed::device::{
    compile, BufferPool, CacheDir, Device, DeviceBuffer, DeviceError, DeviceMemory, Event,
    EventTiming, ExportableBuffer, ModuleOrigin, PinnedBuffer, Stream,
};
use gpufeed::format::{checksum, BlockEntry, Codec, Filter};
use gpufeed::kernels::reference::{
    gather_reference, lz4_decode_transcribed, lz4_sequences, relu_sparse_f16,
};
use gpufeed::kernels::{
    resolve_inline, GatherLayout, GatherOp, GatherOutcome, GatherPiece, GatherPlan, GatherRegion,
    Gatherer, Kernels, Lz4Config, Lz4Decoder, Lz4Job, Lz4Outcome, Lz4Status, SequencePath,
    Unshuffle, GATHER_OUTCOME_BYTES, LZ4_OUTCOME_BYTES, LZ4_SOURCE,
};
use gpufeed::synth;
use gpufeed_client::DType;
use rand::rngs::StdRng;
use rand::Rng;

const POISON: u8 = 0xA5;

fn kernels(device: &Device) -> Kernels {
    Kernels::load(device, CacheDir::Disabled).expect("kernels load")
}

/// Every decoder variant the benchmark compares, the two-phase ones included: each must be exact.
fn lz4_variants(device: &Device) -> Vec<(Lz4Config, Lz4Decoder)> {
    let general = Lz4Config {
        sequences: SequencePath::GeneralOnly,
        min_blocks_per_sm: 0,
        ..Lz4Config::STANDARD
    };
    let uncapped = Lz4Config {
        min_blocks_per_sm: 0,
        ..Lz4Config::STANDARD
    };
    let eight_warps = Lz4Config {
        warps_per_block: 8,
        min_blocks_per_sm: 0,
        ..Lz4Config::STANDARD
    };
    let two_phase_eight_warps = Lz4Config {
        warps_per_block: 8,
        min_blocks_per_sm: 0,
        ..Lz4Config::TWO_PHASE
    };
    [
        Lz4Config::STANDARD,
        general,
        uncapped,
        eight_warps,
        Lz4Config::TWO_PHASE,
        Lz4Config::SERVING,
        two_phase_eight_warps,
    ]
    .into_iter()
    .map(|config| {
        let (decoder, _) = Lz4Decoder::with_config(device, config, CacheDir::Disabled).unwrap();
        (config, decoder)
    })
    .collect()
}

/// Both gather layouts: each must be exact.
fn gatherers(device: &Device) -> Vec<(GatherLayout, Gatherer)> {
    [GatherLayout::CoalescedStores, GatherLayout::WideLoads]
        .into_iter()
        .map(|layout| {
            (
                layout,
                Gatherer::new(device, layout, CacheDir::Disabled).unwrap().0,
            )
        })
        .collect()
}

#[test]
fn device_open_without_cuda_is_a_typed_error() {
    match Device::open(0) {
        Ok(device) => assert!(device.properties().multiprocessors > 0),
        Err(e) => assert!(e.is_unavailable(), "expected Unavailable, got {e}"),
    }
}

#[test]
fn kernels_compile_with_nvrtc_or_report_it_missing() {
    match compile(&LZ4_SOURCE, (9, 0), &[]) {
        Ok(image) => assert!(image.image.starts_with(b"\x7fELF"), "an sm_90 cubin"),
        Err(e) => assert!(e.is_unavailable(), "expected Unavailable, got {e}"),
    }
    // The two-phase build too (a different half of the source).
    match compile(&LZ4_SOURCE, (9, 0), &Lz4Config::TWO_PHASE.defines()) {
        Ok(image) => assert!(image.image.starts_with(b"\x7fELF"), "an sm_90 cubin"),
        Err(e) => assert!(e.is_unavailable(), "expected Unavailable, got {e}"),
    }
}

// ------------------------------------------------------------------------------------------------
// LZ4

/// One block as the packer would store it.
struct Block {
    raw: Vec<u8>,
    stored: Vec<u8>,
    filter: Filter,
    element_bytes: u32,
}

impl Block {
    fn new(raw: Vec<u8>, element_bytes: u32, filtered: bool) -> Block {
        let filter = if filtered && element_bytes > 1 && raw.len() % element_bytes as usize == 0 {
            Filter::ByteShuffle
        } else {
            Filter::None
        };
        let stored = if filter == Filter::ByteShuffle {
            let mut shuffled = vec![0; raw.len()];
            shuffle(&raw, element_bytes as usize, &mut shuffled);
            lz4_flex::block::compress(&shuffled)
        } else {
            lz4_flex::block::compress(&raw)
        };
        Block {
            raw,
            stored,
            filter,
            element_bytes,
        }
    }

    fn entry(&self, stored: &[u8], raw_bytes: u32) -> BlockEntry {
        BlockEntry {
            stored_offset: 0,
            stored_bytes: stored.len() as u32,
            raw_bytes,
            codec: Codec::Lz4,
            filter: self.filter,
            field: 0,
            raw_offset: 0,
            first_sample: 0,
            checksum: checksum(stored),
        }
    }
}

fn block_ref() -> BlockRef {
    BlockRef {
        shard: "test.gfs".into(),
        field: "f".into(),
        block: 0,
        stored_offset: 0,
    }
}

/// A decode case: stored bytes, the raw length the table claims, filter.
struct Case {
    stored: Vec<u8>,
    raw_bytes: u32,
    filter: Filter,
    element_bytes: u32,
}

/// Where the cases were laid out in the staging and output buffers.
struct Layout {
    jobs: Vec<Lz4Job>,
    src: Vec<u8>,
    dst_bytes: usize,
}

/// Places the cases at random (often misaligned) offsets, with gaps, as the pipeline might.
fn lay_out(cases: &[Case], rng: &mut StdRng) -> Layout {
    let mut src = Vec::new();
    let mut dst_end = 0u64;
    let mut jobs = Vec::new();
    for case in cases {
        let gap = if rng.gen_bool(0.5) {
            0
        } else {
            rng.gen_range(1..48)
        };
        src.extend(std::iter::repeat_n(0xEEu8, gap));
        let src_offset = src.len() as u64;
        src.extend_from_slice(&case.stored);
        let align = |end: u64, rng: &mut StdRng| {
            if rng.gen_bool(0.5) {
                end.div_ceil(16) * 16
            } else {
                end + rng.gen_range(0..24)
            }
        };
        let dst_offset = align(dst_end, rng);
        dst_end = dst_offset + case.raw_bytes as u64;
        let unshuffle = if case.filter == Filter::ByteShuffle {
            let scratch_offset = align(dst_end, rng);
            dst_end = scratch_offset + case.raw_bytes as u64;
            Some(Unshuffle {
                element_bytes: case.element_bytes,
                scratch_offset,
            })
        } else {
            None
        };
        jobs.push(Lz4Job {
            src_offset,
            src_bytes: case.stored.len() as u32,
            dst_offset,
            raw_bytes: case.raw_bytes,
            unshuffle,
        });
    }
    src.extend(std::iter::repeat_n(0xEEu8, rng.gen_range(0..32)));
    Layout {
        jobs,
        src,
        dst_bytes: dst_end as usize + rng.gen_range(0..64),
    }
}

struct DecodeRun {
    outcomes: Vec<Lz4Outcome>,
    dst: Vec<u8>,
    src_after: Vec<u8>,
}

fn run_decoder(device: &Device, decoder: &Lz4Decoder, layout: &Layout) -> DecodeRun {
    let stream = Stream::new(device).unwrap();
    let table = DeviceBuffer::from_host(device, &Lz4Job::encode_all(&layout.jobs)).unwrap();
    let src = DeviceBuffer::from_host(device, &layout.src).unwrap();
    let dst = DeviceBuffer::from_host(device, &vec![POISON; layout.dst_bytes]).unwrap();
    let outcomes =
        DeviceBuffer::from_host(device, &vec![0xFF; layout.jobs.len() * LZ4_OUTCOME_BYTES])
            .unwrap();
    let done = Event::new(device, EventTiming::Disabled).unwrap();
    // SAFETY: every buffer lives until `done` has been waited for below.
    unsafe {
        decoder
            .decode_async(
                &stream,
                &table,
                layout.jobs.len() as u32,
                &src,
                &dst,
                &outcomes,
            )
            .unwrap()
    };
    done.record(&stream).unwrap();
    done.synchronize().unwrap();
    DecodeRun {
        outcomes: Lz4Outcome::decode_all(&outcomes.to_vec().unwrap()),
        dst: dst.to_vec().unwrap(),
        src_after: src.to_vec().unwrap(),
    }
}

/// Checks each case against the CPU path and the transcription, and that no byte outside the jobs'
/// extents changed.
fn check_decode(cases: &[Case], layout: &Layout, run: &DecodeRun) -> HashMap<Lz4Status, usize> {
    assert!(
        run.src_after == layout.src,
        "the decoder wrote into its input"
    );
    let mut touched = vec![false; layout.dst_bytes];
    let mut statuses = HashMap::new();
    let mut scratch = Vec::new();
    for (i, (case, job)) in cases.iter().zip(&layout.jobs).enumerate() {
        let outcome = run.outcomes[i];
        *statuses.entry(outcome.status).or_insert(0) += 1;
        let block = Block {
            raw: Vec::new(),
            stored: Vec::new(),
            filter: case.filter,
            element_bytes: case.element_bytes,
        };
        let entry = block.entry(&case.stored, case.raw_bytes);
        let mut cpu = vec![0u8; case.raw_bytes as usize];
        let cpu_result = decode_block(
            &case.stored,
            &entry,
            case.element_bytes as usize,
            &mut scratch,
            &mut cpu,
            block_ref,
        );
        let mut model = vec![0u8; case.raw_bytes as usize];
        let (model_status, model_produced) = lz4_decode_transcribed(&case.stored, &mut model);
        assert_eq!(
            (outcome.status, outcome.produced as usize),
            (model_status, model_produced),
            "case {i}: GPU and transcription disagree"
        );
        let out_range = job.dst_offset as usize..job.dst_offset as usize + case.raw_bytes as usize;
        match cpu_result {
            Ok(()) => {
                assert_eq!(
                    outcome.status,
                    Lz4Status::Ok,
                    "case {i}: the CPU path decoded it"
                );
                assert!(
                    run.dst[out_range.clone()] == cpu[..],
                    "case {i}: bytes differ from the CPU path"
                );
            }
            Err(e) => assert_ne!(
                outcome.status,
                Lz4Status::Ok,
                "case {i}: the CPU path said {e}"
            ),
        }
        for t in &mut touched[out_range] {
            *t = true;
        }
        if let Some(u) = job.unshuffle {
            let s = u.scratch_offset as usize;
            for t in &mut touched[s..s + case.raw_bytes as usize] {
                *t = true;
            }
        }
    }
    let stray = run
        .dst
        .iter()
        .zip(&touched)
        .position(|(&b, &t)| !t && b != POISON);
    assert_eq!(stray, None, "a byte outside every job's extents changed");
    statuses
}

fn random_raw(rng: &mut StdRng, kind: u32, len: usize) -> (Vec<u8>, u32) {
    let seed = rng.gen();
    match kind {
        0 => (
            synth::zipf_tokens_i32(len.div_ceil(4), seed)[..len].to_vec(),
            4,
        ),
        1 => (relu_sparse_f16(len.div_ceil(2), seed)[..len].to_vec(), 2),
        2 => (synth::random_bytes(len, seed), 1),
        3 => {
            let period = rng.gen_range(1..100);
            let pattern = synth::random_bytes(period, seed);
            (pattern.iter().cycle().take(len).copied().collect(), 1)
        }
        4 => {
            // Stretches of repeats, noise and zeros: matches of every offset and length.
            let mut out = Vec::with_capacity(len);
            while out.len() < len {
                match rng.gen_range(0..3) {
                    0 if !out.is_empty() => {
                        let back = rng.gen_range(1..=out.len().min(70_000));
                        let n = rng.gen_range(4..600);
                        let start = out.len() - back;
                        for k in 0..n {
                            out.push(out[start + k]);
                        }
                    }
                    1 => out.extend(synth::random_bytes(rng.gen_range(1..300), rng.gen())),
                    _ => out.extend(std::iter::repeat_n(0u8, rng.gen_range(1..2000))),
                }
            }
            out.truncate(len);
            (out, 8)
        }
        _ => (vec![0u8; len], 8),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_lz4_random_blocks_match_the_cpu_path() {
    let mut rng = fresh_rng("gpu_lz4_random_blocks_match_the_cpu_path");
    let device = device();
    let count = if small() { 48 } else { 600 };
    let mut cases = Vec::new();
    for i in 0..count {
        let len = match i % 4 {
            0 => 64 << 10,
            1 => rng.gen_range(1..=64 << 10),
            2 => rng.gen_range(1..600),
            _ => rng.gen_range(1..=16) * 4096,
        };
        let kind = rng.gen_range(0..6);
        let (raw, width) = random_raw(&mut rng, kind, len);
        let block = Block::new(raw, width, rng.gen_bool(0.5));
        cases.push(Case {
            raw_bytes: block.raw.len() as u32,
            stored: block.stored,
            filter: block.filter,
            element_bytes: block.element_bytes,
        });
    }
    let layout = lay_out(&cases, &mut rng);
    for (config, decoder) in lz4_variants(&device) {
        println!("variant {config:?}");
        let run = run_decoder(&device, &decoder, &layout);
        let statuses = check_decode(&cases, &layout, &run);
        assert_eq!(
            statuses.get(&Lz4Status::Ok),
            Some(&cases.len()),
            "{statuses:?}"
        );
    }
}

/// Valid blocks and every kind of damage the issue lists.
fn adversarial_cases(rng: &mut StdRng) -> Vec<Case> {
    let mut cases = Vec::new();
    let plain = |stored: Vec<u8>, raw_bytes: usize| Case {
        stored,
        raw_bytes: raw_bytes as u32,
        filter: Filter::None,
        element_bytes: 1,
    };
    let zipf = synth::zipf_tokens_i32(4096, rng.gen());
    let valid = Block::new(zipf.clone(), 4, false);
    // Truncated at many points, including mid-token and mid-offset.
    let cuts = if small() { 24 } else { 200 };
    for _ in 0..cuts {
        let cut = rng.gen_range(0..valid.stored.len());
        cases.push(plain(valid.stored[..cut].to_vec(), zipf.len()));
    }
    // Wrong raw lengths.
    for raw_bytes in [
        0,
        1,
        zipf.len() - 1,
        zipf.len() + 1,
        zipf.len() + 4096,
        zipf.len() * 2,
    ] {
        cases.push(plain(valid.stored.clone(), raw_bytes));
    }
    // Bit flips.
    let flips = if small() { 24 } else { 300 };
    for _ in 0..flips {
        let mut damaged = valid.stored.clone();
        let at = rng.gen_range(0..damaged.len());
        damaged[at] ^= 1 << rng.gen_range(0..8);
        cases.push(plain(damaged, zipf.len()));
    }
    // One field of one sequence made wrong deep inside the block, where the two-phase decoder's fast
    // parse takes the sequence and only its validation can catch it: offsets of 0, one and two past
    // the match start; raw lengths ending at a match start or one byte short of a sequence's end.
    let sequences = lz4_sequences(&valid.stored);
    for k in [
        0,
        5,
        31,
        32,
        33,
        100,
        sequences.len() / 2,
        sequences.len() - 2,
    ] {
        let sequence = sequences[k];
        let at = sequence.offset_at.expect("not the last sequence");
        for offset in [0, sequence.match_start + 1, sequence.match_start + 2] {
            if offset <= 65_535 {
                let mut damaged = valid.stored.clone();
                damaged[at..at + 2].copy_from_slice(&(offset as u16).to_le_bytes());
                cases.push(plain(damaged, zipf.len()));
            }
        }
        cases.push(plain(valid.stored.clone(), sequence.match_start));
        cases.push(plain(valid.stored.clone(), sequence.end - 1));
    }
    // Hand-made sequences.
    cases.push(plain(vec![0x14, b'a', 0, 0, 0x00], 6)); // zero offset
    cases.push(plain(vec![0x14, b'a', 2, 0, 0x00], 6)); // offset before the output's start
    cases.push(plain(vec![0x0f, 0xff, 0xff, 0x00, 0x00], 64)); // offset 65535 with nothing written
    cases.push(plain(vec![0xf0, 0xff, 0xff, 0x10], 1000)); // literal run past the input
    cases.push(plain(vec![0xf0, 0xff, 0xff, 0xff], 1 << 20)); // length extension cut off
    cases.push(plain(
        vec![0x1f, b'a', 1, 0, 0xff, 0xff, 0xff, 0x10, 0x00],
        20,
    )); // overlong match
    cases.push(plain(vec![0x14, b'a', 1, 0], 6)); // ends after a match
    cases.push(plain(vec![0x14, b'a', 1], 6)); // ends inside an offset
    cases.push(plain(Vec::new(), 0)); // empty input
    cases.push(plain(vec![0x00], 0)); // empty block
    cases.push(plain(vec![0x10, b'z'], 1)); // one literal
                                            // Literal-only blocks of every length class.
    for n in [1usize, 14, 15, 16, 270, 255 + 15, 65536] {
        let raw = synth::random_bytes(n, rng.gen());
        let mut stored = Vec::new();
        if n < 15 {
            stored.push((n as u8) << 4);
        } else {
            stored.push(0xf0);
            let mut rest = n - 15;
            while rest >= 255 {
                stored.push(255);
                rest -= 255;
            }
            stored.push(rest as u8);
        }
        stored.extend_from_slice(&raw);
        cases.push(plain(stored, n));
    }
    // Overlapping matches: every short offset, long lengths.
    for offset in 1..=40u16 {
        let mut stored = Vec::new();
        let lits = offset as usize;
        let pattern = synth::random_bytes(lits, rng.gen());
        // token: literal length (maybe extended), match length 15 + extension
        let lit_nibble = lits.min(15) as u8;
        stored.push((lit_nibble << 4) | 0x0f);
        if lits >= 15 {
            stored.push((lits - 15) as u8);
        }
        stored.extend_from_slice(&pattern);
        stored.extend_from_slice(&offset.to_le_bytes());
        let mlen = rng.gen_range(19..3000usize);
        let mut rest = mlen - 19;
        while rest >= 255 {
            stored.push(255);
            rest -= 255;
        }
        stored.push(rest as u8);
        stored.push(0x50); // five final literals
        stored.extend_from_slice(b"tail!");
        cases.push(plain(stored, lits + mlen + 5));
    }
    // Match-heavy blocks: zeros, compressing 255:1.
    let zeros = Block::new(vec![0u8; 65536], 1, false);
    cases.push(plain(zeros.stored.clone(), 65536));
    cases.push(plain(zeros.stored.clone(), 65535));
    // Random garbage.
    let garbage = if small() { 32 } else { 400 };
    for _ in 0..garbage {
        let n = rng.gen_range(0..64);
        cases.push(plain(
            synth::random_bytes(n, rng.gen()),
            rng.gen_range(0..512),
        ));
    }
    // Filtered blocks, valid and damaged: the unshuffle runs only after a clean decode.
    for width in [2u32, 4, 8] {
        let (raw, _) = random_raw(rng, 4, 8192);
        let block = Block::new(raw, width, true);
        let mut damaged = block.stored.clone();
        let at = rng.gen_range(0..damaged.len());
        damaged[at] ^= 0x40;
        for stored in [
            block.stored.clone(),
            damaged,
            block.stored[..block.stored.len() / 2].to_vec(),
        ] {
            cases.push(Case {
                stored,
                raw_bytes: block.raw.len() as u32,
                filter: block.filter,
                element_bytes: width,
            });
        }
    }
    cases
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_lz4_adversarial_blocks_fail_like_the_cpu_path_and_stay_in_bounds() {
    let mut rng = fresh_rng("gpu_lz4_adversarial_blocks_fail_like_the_cpu_path_and_stay_in_bounds");
    let device = device();
    let cases = adversarial_cases(&mut rng);
    let layout = lay_out(&cases, &mut rng);
    for (config, decoder) in lz4_variants(&device) {
        let run = run_decoder(&device, &decoder, &layout);
        let statuses = check_decode(&cases, &layout, &run);
        println!("{config:?}: statuses {statuses:?}");
        for status in [
            Lz4Status::Ok,
            Lz4Status::InputOverrun,
            Lz4Status::OutputOverrun,
            Lz4Status::BadOffset,
            Lz4Status::SizeMismatch,
        ] {
            assert!(
                statuses.contains_key(&status),
                "no case produced {status:?}: {statuses:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_lz4_refuses_jobs_outside_its_buffers() {
    let device = device();
    let valid = Block::new(vec![3u8; 4096], 4, true);
    let src_bytes = valid.stored.len() as u32;
    let good = Lz4Job {
        src_offset: 0,
        src_bytes,
        dst_offset: 0,
        raw_bytes: 4096,
        unshuffle: Some(Unshuffle {
            element_bytes: 4,
            scratch_offset: 4096,
        }),
    };
    let dst_bytes = 3 * 4096;
    let with = |f: &dyn Fn(&mut Lz4Job)| {
        let mut job = good;
        f(&mut job);
        job
    };
    let bad = vec![
        with(&|j| j.src_offset = 1),            // input runs past the source
        with(&|j| j.src_offset = u64::MAX - 3), // offset + length overflows
        with(&|j| j.dst_offset = dst_bytes as u64 - 100), // output past the destination
        with(&|j| j.dst_offset = u64::MAX),     // overflow
        with(&|j| j.unshuffle.as_mut().unwrap().scratch_offset = 2048), // scratch overlaps output
        with(&|j| j.unshuffle.as_mut().unwrap().scratch_offset = 2 * 4096 + 1), // scratch past the end
        with(&|j| j.unshuffle.as_mut().unwrap().element_bytes = 17), // width beyond the kernel's
        with(&|j| {
            j.unshuffle.as_mut().unwrap().element_bytes = 3; // raw length not a multiple of it
        }),
    ];
    let mut jobs = bad.clone();
    jobs.push(good);
    let layout = Layout {
        jobs,
        src: valid.stored.clone(),
        dst_bytes,
    };
    for (config, decoder) in lz4_variants(&device) {
        let run = run_decoder(&device, &decoder, &layout);
        for (i, outcome) in run.outcomes[..bad.len()].iter().enumerate() {
            assert_eq!(outcome.status, Lz4Status::BadJob, "{config:?}: job {i}");
        }
        assert_eq!(run.outcomes[bad.len()].status, Lz4Status::Ok);
        assert!(run.dst[..4096] == valid.raw[..], "the valid job decoded");
        assert!(
            run.dst[2 * 4096..].iter().all(|&b| b == POISON),
            "refused jobs wrote nothing"
        );
    }
}

// ------------------------------------------------------------------------------------------------
// Gather + convert

struct GatherRun {
    dst: Vec<u8>,
    outcome: GatherOutcome,
}

fn run_gather(
    device: &Device,
    gatherer: &Gatherer,
    plan: &GatherPlan,
    sources: &[Vec<u8>],
    dst_bytes: usize,
) -> GatherRun {
    let stream = Stream::new(device).unwrap();
    let table = DeviceBuffer::from_host(device, &plan.encode()).unwrap();
    let device_sources: Vec<DeviceBuffer> = sources
        .iter()
        .map(|s| DeviceBuffer::from_host(device, s).unwrap())
        .collect();
    let source_refs: Vec<&dyn DeviceMemory> = device_sources
        .iter()
        .map(|s| s as &dyn DeviceMemory)
        .collect();
    let dst = DeviceBuffer::from_host(device, &vec![POISON; dst_bytes]).unwrap();
    let outcome = DeviceBuffer::new(device, GATHER_OUTCOME_BYTES).unwrap();
    // SAFETY: every buffer lives until the stream is synchronised below.
    unsafe {
        gatherer
            .gather_async(
                &stream,
                &table,
                plan.pieces().len() as u32,
                &source_refs,
                &dst,
                &outcome,
            )
            .unwrap()
    };
    stream.synchronize().unwrap();
    GatherRun {
        dst: dst.to_vec().unwrap(),
        outcome: GatherOutcome::decode(&outcome.to_vec().unwrap()),
    }
}

fn check_gather(plan: &GatherPlan, sources: &[Vec<u8>], run: &GatherRun) {
    let mut expected = vec![POISON; run.dst.len()];
    let refs: Vec<&[u8]> = sources.iter().map(|s| s.as_slice()).collect();
    let outcome = gather_reference(plan.pieces(), &refs, &mut expected);
    assert_eq!(run.outcome, outcome);
    if let Some(at) = run.dst.iter().zip(&expected).position(|(a, b)| a != b) {
        let piece = plan.pieces().iter().find(|p| {
            (p.dst_offset..p.dst_offset + p.elements as u64 * p.op.out_bytes())
                .contains(&(at as u64))
        });
        panic!(
            "slot byte {at} differs: GPU {:#04x}, CPU {:#04x}; piece {piece:?}",
            run.dst[at], expected[at]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_converts_every_f16_and_bf16_pattern_like_half() {
    let device = device();
    let patterns: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
    // The patterns at several alignments: vector path (aligned), peeled head, element-misaligned.
    let mut source = vec![0u8; 8];
    source.extend_from_slice(&patterns);
    source.extend_from_slice(&patterns);
    source.push(0);
    source.extend_from_slice(&patterns);
    let starts = [
        8u64,
        8 + patterns.len() as u64 + 2,
        8 + 2 * patterns.len() as u64 + 1,
    ];
    let mut plan = GatherPlan::new();
    let mut dst_offset = 0u64;
    for op in [GatherOp::F16ToF32, GatherOp::Bf16ToF32] {
        for (k, &start) in starts.iter().enumerate() {
            // dst alignments: 16-aligned, then 4 past, then 1 past
            dst_offset = dst_offset.div_ceil(16) * 16 + [0, 4, 1][k];
            plan.push(0, start, dst_offset, 65536, op, 1.0);
            dst_offset += 65536 * 4;
        }
    }
    let sources = vec![source];
    for (layout, gatherer) in gatherers(&device) {
        println!("layout {layout:?}");
        let run = run_gather(
            &device,
            &gatherer,
            &plan,
            &sources,
            dst_offset as usize + 64,
        );
        check_gather(&plan, &sources, &run);
        // And directly against half, not only through the CPU path.
        for (i, bits) in (0..=u16::MAX).enumerate() {
            let got = u32::from_le_bytes(run.dst[i * 4..i * 4 + 4].try_into().unwrap());
            assert_eq!(
                got,
                half::f16::from_bits(bits).to_f32().to_bits(),
                "f16 {bits:#06x}"
            );
        }
    }
}

/// Random values of a dtype, with its special values mixed in.
fn random_elements(rng: &mut StdRng, dtype: DType, count: usize) -> Vec<u8> {
    let mut out = synth::random_bytes(count * dtype.size_bytes(), rng.gen());
    let specials: Vec<Vec<u8>> = match dtype {
        DType::F64 => [
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
            f64::MIN_POSITIVE,
            5e-324,
            1e-40,
            3.4028235677973366e38,
            1e39,
        ]
        .iter()
        .map(|v| v.to_le_bytes().to_vec())
        .chain(
            [0x7ff0_0000_0000_0001u64, 0xfff8_0000_2000_0001]
                .iter()
                .map(|b| b.to_le_bytes().to_vec()),
        )
        .collect(),
        DType::U64 | DType::I64 => [0u64, u64::MAX, 1 << 63, (1 << 24) + 1, (1 << 53) + 1]
            .iter()
            .map(|v| v.to_le_bytes().to_vec())
            .collect(),
        DType::U32 | DType::I32 => [0u32, u32::MAX, 1 << 31, (1 << 24) + 1, 16_777_217]
            .iter()
            .map(|v| v.to_le_bytes().to_vec())
            .collect(),
        _ => Vec::new(),
    };
    for special in specials {
        let at = rng.gen_range(0..count) * dtype.size_bytes();
        out[at..at + special.len()].copy_from_slice(&special);
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_every_op_matches_the_cpu_path() {
    let mut rng = fresh_rng("gpu_gather_every_op_matches_the_cpu_path");
    let device = device();
    let per_op = if small() { 2 } else { 12 };
    // Two sources, like the decode buffer and the staging buffer (raw blocks).
    let mut sources = vec![Vec::new(), Vec::new()];
    let mut plan = GatherPlan::new();
    let mut samples = Vec::new();
    for op in GatherOp::ALL {
        for _ in 0..per_op {
            let in_bytes = op.in_bytes() as usize;
            let count = match rng.gen_range(0..3) {
                0 => rng.gen_range(1..40),
                1 => rng.gen_range(1..5000),
                _ => rng.gen_range(50_000..300_000),
            };
            let dtype = op.dtypes().map_or(DType::U8, |(from, _)| from);
            let data = random_elements(&mut rng, dtype, count);
            let source = rng.gen_range(0..2usize);
            // Usually element-aligned, sometimes 16-aligned, sometimes not aligned at all.
            let pad = match rng.gen_range(0..3) {
                0 => (16 - sources[source].len() % 16) % 16,
                1 => (in_bytes - sources[source].len() % in_bytes) % in_bytes,
                _ => rng.gen_range(0..16),
            };
            sources[source].extend(std::iter::repeat_n(0x5Au8, pad));
            let src_offset = sources[source].len() as u64;
            sources[source].extend_from_slice(&data);
            let scale = if op == GatherOp::U8ToF32 && rng.gen_bool(0.5) {
                1.0 / 255.0
            } else {
                1.0
            };
            samples.push((source as u16, src_offset, count as u64, op, scale));
        }
    }
    // The order the pipeline chose: shuffled.
    for i in (1..samples.len()).rev() {
        samples.swap(i, rng.gen_range(0..=i));
    }
    let mut dst_offset = 0u64;
    for (source, src_offset, count, op, scale) in samples {
        dst_offset += match rng.gen_range(0..3) {
            0 => (16 - dst_offset % 16) % 16,
            1 => 0,
            _ => rng.gen_range(0..16),
        };
        plan.push(source, src_offset, dst_offset, count, op, scale);
        dst_offset += count * op.out_bytes();
    }
    for (layout, gatherer) in gatherers(&device) {
        println!("layout {layout:?}");
        let run = run_gather(
            &device,
            &gatherer,
            &plan,
            &sources,
            dst_offset as usize + 32,
        );
        assert_eq!(run.outcome.faulted_pieces, 0);
        check_gather(&plan, &sources, &run);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_skips_pieces_outside_their_buffers() {
    let device = device();
    let kernels = kernels(&device);
    let sources = vec![synth::random_bytes(1000, 1), synth::random_bytes(64, 2)];
    let piece = |source: u16, src_offset: u64, dst_offset: u64, elements: u32| GatherPiece {
        source,
        src_offset,
        dst_offset,
        elements,
        op: GatherOp::F16ToF32,
        scale: 1.0,
    };
    let mut plan = GatherPlan::new();
    plan.push_piece(piece(0, 0, 0, 500)); // fits exactly
    plan.push_piece(piece(0, 2, 2000, 500)); // reads one element past source 0
    plan.push_piece(piece(1, 0, 2000, 33)); // reads past source 1
    plan.push_piece(piece(2, 0, 2000, 1)); // no source 2
    plan.push_piece(piece(7, 0, 2000, 1)); // beyond the kernel's table
    plan.push_piece(piece(0, 0, 4000, 1)); // writes past the slot
    plan.push_piece(piece(0, u64::MAX - 1, 2000, 2)); // offset overflow
    plan.push_piece(piece(1, 0, 2000, 32)); // fits
    let run = run_gather(&device, &kernels.gather, &plan, &sources, 2000 + 128);
    assert_eq!(
        run.outcome,
        GatherOutcome {
            faulted_pieces: 6,
            last_faulted_plus_1: 7
        }
    );
    check_gather(&plan, &sources, &run);
}

/// Resident rounds pass the gather an outcome in their pinned buffer, mapped for the device and
/// zeroed by the host: the kernel's counts land there with no memset or download on the stream,
/// the same as through device memory, and a buffer zeroed again reads zero after a clean launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_writes_its_outcome_into_zeroed_mapped_host_memory() {
    let device = device();
    let kernels = kernels(&device);
    let stream = Stream::new(&device).unwrap();
    let sources = vec![synth::random_bytes(1000, 3)];
    let source = DeviceBuffer::from_host(&device, &sources[0]).unwrap();
    let piece = |src_offset: u64, dst_offset: u64, elements: u32| GatherPiece {
        source: 0,
        src_offset,
        dst_offset,
        elements,
        op: GatherOp::F16ToF32,
        scale: 1.0,
    };
    let mut faulty = GatherPlan::new();
    faulty.push_piece(piece(0, 0, 250)); // fits
    faulty.push_piece(piece(2, 1000, 500)); // reads past the source
    faulty.push_piece(piece(0, 4000, 1)); // writes past the slot
    faulty.push_piece(piece(500, 1000, 250)); // fits
    let mut clean = GatherPlan::new();
    clean.push_piece(piece(0, 0, 500));
    // The outcome at an offset inside a larger pinned buffer, as in a round's buffer.
    let mut host = PinnedBuffer::new(&device, 4096).unwrap();
    let at = 1024;
    for (plan, expected) in [
        (
            &faulty,
            GatherOutcome {
                faulted_pieces: 2,
                last_faulted_plus_1: 3,
            },
        ),
        (&clean, GatherOutcome::default()),
    ] {
        host.as_mut_slice()[at..at + GATHER_OUTCOME_BYTES].fill(0);
        let table = DeviceBuffer::from_host(&device, &plan.encode()).unwrap();
        let dst = DeviceBuffer::from_host(&device, &vec![POISON; 2000]).unwrap();
        let outcome = host.mapped(at, GATHER_OUTCOME_BYTES);
        // SAFETY: every buffer lives until the stream is synchronised below; the host does not
        // touch the pinned buffer meanwhile.
        unsafe {
            kernels
                .gather
                .gather_regions_async(
                    &stream,
                    &table,
                    plan.pieces().len() as u32,
                    &[&source],
                    None,
                    &dst,
                    (&outcome, true),
                )
                .unwrap()
        };
        stream.synchronize().unwrap();
        let run = GatherRun {
            dst: dst.to_vec().unwrap(),
            outcome: GatherOutcome::decode(&host.as_slice()[at..at + GATHER_OUTCOME_BYTES]),
        };
        assert_eq!(run.outcome, expected);
        check_gather(plan, &sources, &run);
        assert!(host.as_slice()[..at].iter().all(|&b| b == 0));
        assert!(host.as_slice()[at + GATHER_OUTCOME_BYTES..]
            .iter()
            .all(|&b| b == 0));
    }
}

/// Resident rounds may pass their piece table in the gather's launch parameters, each piece's region
/// resolved on the host (`resolve_inline`): the slot must be the same, byte for byte, as the
/// table-reading kernel's, for tables that take one launch of each size, or several, and a
/// piece that does not fit the slot is skipped and reported with its index in the whole table.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_with_its_table_in_the_launch_matches_the_table_kernel() {
    let mut rng = fresh_rng("gpu_gather_with_its_table_in_the_launch_matches_the_table_kernel");
    let device = device();
    let kernels = kernels(&device);
    assert!(
        kernels.gather.has_inline(),
        "the test machine's driver takes 32 KiB of parameters"
    );
    let stream = Stream::new(&device).unwrap();
    let sources = vec![
        synth::random_bytes(3 << 20, 5),
        synth::random_bytes(1 << 20, 6),
    ];
    let device_sources: Vec<DeviceBuffer> = sources
        .iter()
        .map(|s| DeviceBuffer::from_host(&device, s).unwrap())
        .collect();
    let regions: Vec<GatherRegion> = device_sources
        .iter()
        .map(|s| GatherRegion {
            ptr: s.device_ptr(),
            bytes: s.len() as u64,
        })
        .collect();
    for (count, faulty) in [
        (40usize, None),
        (256, Some(7usize)),
        (700, None),
        (1016, Some(1000)),
        (2500, Some(1800)),
    ] {
        // The same pieces twice: reading sources 0 and 1 (the reference) and regions 0 and 1.
        let mut by_source = GatherPlan::new();
        let mut by_region = GatherPlan::new();
        let mut dst_offset = 0u64;
        for index in 0..count {
            let op = GatherOp::ALL[rng.gen_range(0..GatherOp::ALL.len())];
            let elements = rng.gen_range(1..600u32);
            let source = rng.gen_range(0..2usize);
            let in_bytes = elements as u64 * op.in_bytes();
            let src_offset = rng.gen_range(0..sources[source].len() as u64 - in_bytes);
            let piece = GatherPiece {
                source: source as u16,
                src_offset,
                dst_offset: if faulty == Some(index) {
                    u64::MAX / 2
                } else {
                    dst_offset
                },
                elements,
                op,
                scale: if op == GatherOp::U8ToF32 {
                    1.0 / 255.0
                } else {
                    1.0
                },
            };
            by_source.push_piece(piece);
            by_region.push_piece(GatherPiece {
                source: GatherRegion::source_index(source),
                ..piece
            });
            dst_offset += elements as u64 * op.out_bytes() + rng.gen_range(0..16);
        }
        let mut resolved = Vec::new();
        assert!(resolve_inline(&by_region.encode(), &regions, &mut resolved));
        let dst = DeviceBuffer::from_host(&device, &vec![POISON; dst_offset as usize]).unwrap();
        let outcome = DeviceBuffer::new(&device, GATHER_OUTCOME_BYTES).unwrap();
        // SAFETY: every buffer lives until the stream is synchronised below; the sources do not
        // overlap the slot.
        unsafe {
            kernels
                .gather
                .gather_inline_async(&stream, &resolved, &dst, (&outcome, false))
                .unwrap()
        };
        stream.synchronize().unwrap();
        let run = GatherRun {
            dst: dst.to_vec().unwrap(),
            outcome: GatherOutcome::decode(&outcome.to_vec().unwrap()),
        };
        println!("{count} pieces: {:?}", run.outcome);
        assert_eq!(
            run.outcome,
            GatherOutcome {
                faulted_pieces: u32::from(faulty.is_some()),
                last_faulted_plus_1: faulty.map_or(0, |index| index as u32 + 1),
            }
        );
        check_gather(&by_source, &sources, &run);
    }
}

// ------------------------------------------------------------------------------------------------
// Memory, streams, graphs, caches

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_batch_slot_is_exportable_and_shared_through_its_fd() {
    use std::os::fd::AsFd;
    let device = device();
    let kernels = kernels(&device);
    let values = relu_sparse_f16(300_000, 9);
    let mut plan = GatherPlan::new();
    plan.push(0, 0, 0, 300_000, GatherOp::F16ToF32, 1.0);
    let slot_bytes = 300_000 * 4;
    let slot = ExportableBuffer::new(&device, slot_bytes).unwrap();
    assert!(slot.mapped_bytes() >= slot_bytes && slot.mapped_bytes() % (2 << 20) == 0);
    let stream = Stream::new(&device).unwrap();
    let source = DeviceBuffer::from_host(&device, &values).unwrap();
    let table = DeviceBuffer::from_host(&device, &plan.encode()).unwrap();
    let outcome = DeviceBuffer::new(&device, GATHER_OUTCOME_BYTES).unwrap();
    // SAFETY: all buffers outlive the stream synchronisation below.
    unsafe {
        kernels
            .gather
            .gather_async(
                &stream,
                &table,
                plan.pieces().len() as u32,
                &[&source],
                &slot,
                &outcome,
            )
            .unwrap()
    };
    stream.synchronize().unwrap();
    let fd = slot.export_fd().unwrap();
    // A second mapping of the same memory, as a consumer process would make from the descriptor.
    let imported = ExportableBuffer::import(&device, fd.as_fd(), slot_bytes).unwrap();
    assert_ne!(imported.device_ptr(), slot.device_ptr());
    let mut through_import = vec![0u8; slot_bytes];
    imported.read(0, &mut through_import).unwrap();
    let mut expected = vec![0u8; slot_bytes];
    gpufeed::decode::convert(DType::F16, &values, DType::F32, &mut expected).unwrap();
    assert!(
        through_import == expected,
        "the imported mapping sees the gathered batch"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_captured_graph_replays_decode_and_gather() {
    let mut rng = fresh_rng("gpu_captured_graph_replays_decode_and_gather");
    let device = device();
    let kernels = kernels(&device);
    let raw = synth::zipf_tokens_i32(4 * 16384, rng.gen());
    let blocks: Vec<Block> = raw
        .chunks(65536)
        .map(|c| Block::new(c.to_vec(), 4, true))
        .collect();
    let cases: Vec<Case> = blocks
        .iter()
        .map(|b| Case {
            stored: b.stored.clone(),
            raw_bytes: b.raw.len() as u32,
            filter: b.filter,
            element_bytes: 4,
        })
        .collect();
    let layout = lay_out(&cases, &mut rng);
    let table = DeviceBuffer::from_host(&device, &Lz4Job::encode_all(&layout.jobs)).unwrap();
    let src = DeviceBuffer::from_host(&device, &layout.src).unwrap();
    let decoded = DeviceBuffer::from_host(&device, &vec![POISON; layout.dst_bytes]).unwrap();
    let outcomes = DeviceBuffer::new(&device, cases.len() * LZ4_OUTCOME_BYTES).unwrap();
    // Gather every block's tokens, widened to i64, in reverse block order.
    let mut plan = GatherPlan::new();
    let mut dst_offset = 0;
    for job in layout.jobs.iter().rev() {
        plan.push(
            0,
            job.dst_offset,
            dst_offset,
            job.raw_bytes as u64 / 4,
            GatherOp::I32ToI64,
            1.0,
        );
        dst_offset += job.raw_bytes as u64 * 2;
    }
    let pieces = DeviceBuffer::from_host(&device, &plan.encode()).unwrap();
    let slot = DeviceBuffer::from_host(&device, &vec![POISON; dst_offset as usize]).unwrap();
    let gather_outcome = DeviceBuffer::new(&device, GATHER_OUTCOME_BYTES).unwrap();
    let stream = Stream::new(&device).unwrap();
    let graph = stream
        .capture(|s| {
            // SAFETY: the buffers outlive every replay (they are dropped after the final wait).
            unsafe {
                kernels.lz4.decode_async(
                    s,
                    &table,
                    cases.len() as u32,
                    &src,
                    &decoded,
                    &outcomes,
                )?;
                kernels.gather.gather_async(
                    s,
                    &pieces,
                    plan.pieces().len() as u32,
                    &[&decoded],
                    &slot,
                    &gather_outcome,
                )
            }
        })
        .unwrap();
    let done = Event::new(&device, EventTiming::Disabled).unwrap();
    for _ in 0..3 {
        // SAFETY: as above.
        unsafe { graph.launch(&stream).unwrap() };
    }
    done.record(&stream).unwrap();
    done.synchronize().unwrap();
    let statuses = Lz4Outcome::decode_all(&outcomes.to_vec().unwrap());
    assert!(
        statuses.iter().all(|o| o.status == Lz4Status::Ok),
        "{statuses:?}"
    );
    let mut expected = Vec::new();
    for block in blocks.iter().rev() {
        for token in block.raw.chunks_exact(4) {
            expected.extend_from_slice(
                &(i32::from_le_bytes(token.try_into().unwrap()) as i64).to_le_bytes(),
            );
        }
    }
    assert!(slot.to_vec().unwrap() == expected);
    assert_eq!(
        GatherOutcome::decode(&gather_outcome.to_vec().unwrap()),
        GatherOutcome::default()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_modules_come_from_memory_then_disk_then_a_fresh_compile() {
    let dir = tempfile::tempdir().unwrap();
    let cache = CacheDir::At(dir.path().to_owned());
    let first = device();
    let (_, origin) = Lz4Decoder::new(&first, 2, cache.clone()).unwrap();
    let ModuleOrigin::Compiled {
        cached_at: Ok(path),
    } = origin
    else {
        panic!("expected a fresh compilation written to the cache, got {origin:?}");
    };
    assert!(path.is_file());
    let (_, origin) = Lz4Decoder::new(&first, 2, cache.clone()).unwrap();
    assert_eq!(origin, ModuleOrigin::Memory);
    // A new device handle has an empty module cache: as after a restart, the image comes from disk.
    let second = device();
    assert!(!second.same_as(&first));
    let (_, origin) = Lz4Decoder::new(&second, 2, cache.clone()).unwrap();
    assert_eq!(origin, ModuleOrigin::Disk(path.clone()));
    // A damaged cache file is recompiled and replaced.
    std::fs::write(&path, b"not a cubin").unwrap();
    let third = device();
    let (_, origin) = Lz4Decoder::new(&third, 2, cache).unwrap();
    assert_eq!(
        origin,
        ModuleOrigin::Compiled {
            cached_at: Ok(path.clone())
        }
    );
    assert!(std::fs::read(&path).unwrap().starts_with(b"\x7fELF"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_pools_lend_a_fixed_number_of_aligned_buffers() {
    let device = device();
    let pool = BufferPool::new(&device, "staging", 3, 1000).unwrap();
    let a = pool.acquire().unwrap();
    let b = pool.acquire().unwrap();
    let c = pool.acquire().unwrap();
    assert!(matches!(
        pool.acquire(),
        Err(DeviceError::PoolExhausted { capacity: 3, .. })
    ));
    for buffer in [&a, &b, &c] {
        assert_eq!(buffer.device_ptr() % 256, 0);
        assert_eq!(buffer.len(), 1000);
    }
    b.write(0, &[1, 2, 3]).unwrap();
    let mut back = [0u8; 3];
    b.read(0, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3]);
    assert!(matches!(
        b.write(999, &[1, 2]),
        Err(DeviceError::OutOfBounds { .. })
    ));
    drop(b);
    assert_eq!(pool.available(), 1);
    let again = pool.acquire().unwrap();
    assert_eq!(pool.available(), 0);
    drop((a, c, again));
    assert_eq!(pool.available(), 3);
}
