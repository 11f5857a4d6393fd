use half::{bf16, f16};
use rand::{Rng, SeedableRng};

use super::lz4::{SRC_INPUT, SRC_OUTPUT};
use super::*;
use crate::kernels::{Lz4Status, Xxh3Job, Xxh3Status};

#[test]
fn f16_rule_matches_half_for_every_pattern() {
    for bits in 0..=u16::MAX {
        assert_eq!(
            f16_to_f32_bits(bits),
            f16::from_bits(bits).to_f32().to_bits(),
            "f16 {bits:#06x}"
        );
    }
}

#[test]
fn bf16_rule_matches_half_for_every_pattern() {
    for bits in 0..=u16::MAX {
        assert_eq!(
            bf16_to_f32_bits(bits),
            bf16::from_bits(bits).to_f32().to_bits(),
            "bf16 {bits:#06x}"
        );
    }
}

#[test]
fn f64_rule_matches_the_cpu_path_on_nan_and_random_patterns() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut patterns: Vec<u64> = (0..100_000).map(|_| rng.gen()).collect();
    for payload in [
        1u64,
        2,
        0x7ffff,
        1 << 29,
        (1 << 51) - 1,
        1 << 51,
        (1 << 52) - 1,
    ] {
        patterns.push(0x7ff0_0000_0000_0000 | payload);
        patterns.push(0xfff0_0000_0000_0000 | payload);
    }
    patterns.extend([
        0,
        1,
        0x0010_0000_0000_0000,
        0x7ff0_0000_0000_0000,
        0x36a0_0000_0000_0001,
    ]);
    for bits in patterns {
        let mut out = [0u8; 4];
        crate::decode::convert(
            gpufeed_proto::DType::F64,
            &bits.to_le_bytes(),
            gpufeed_proto::DType::F32,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            f64_to_f32_bits(bits),
            u32::from_le_bytes(out),
            "f64 {bits:#018x}"
        );
    }
}

fn agree_with_lz4_flex(stored: &[u8], raw_bytes: usize) {
    let mut cpu = vec![0u8; raw_bytes];
    let cpu_result = lz4_flex::block::decompress_into(stored, &mut cpu);
    let mut model = vec![0u8; raw_bytes];
    let (status, produced) = lz4_decode_transcribed(stored, &mut model);
    match cpu_result {
        Ok(n) if n == raw_bytes => {
            assert_eq!(
                status,
                Lz4Status::Ok,
                "lz4_flex accepted, model said {status:?}"
            );
            assert_eq!(produced, raw_bytes);
            assert!(model == cpu, "bytes differ");
        }
        Ok(n) => {
            assert_eq!(
                status,
                Lz4Status::SizeMismatch,
                "lz4_flex made {n} of {raw_bytes}"
            );
            assert_eq!(produced, n);
        }
        Err(e) => assert_ne!(
            status,
            Lz4Status::Ok,
            "lz4_flex rejected ({e}), model accepted"
        ),
    }
}

#[test]
fn lz4_transcription_agrees_with_lz4_flex_on_valid_and_damaged_blocks() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut inputs: Vec<Vec<u8>> = vec![
        crate::synth::zipf_tokens_i32(4096, 1),
        vec![0u8; 70_000],
        b"abcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabc".repeat(300),
        crate::synth::random_bytes(5000, 2),
        vec![7u8; 1],
        Vec::new(),
    ];
    for period in 1..40 {
        let pattern: Vec<u8> = (0..period).map(|_| rng.gen()).collect();
        inputs.push(
            pattern
                .iter()
                .cycle()
                .take(3000 + period)
                .copied()
                .collect(),
        );
    }
    for raw in &inputs {
        let stored = lz4_flex::block::compress(raw);
        agree_with_lz4_flex(&stored, raw.len());
        // Wrong raw lengths.
        for delta in [1usize, 7, 100] {
            agree_with_lz4_flex(&stored, raw.len() + delta);
            agree_with_lz4_flex(&stored, raw.len().saturating_sub(delta));
        }
        // Truncations and byte damage.
        for _ in 0..50 {
            let cut = rng.gen_range(0..=stored.len());
            agree_with_lz4_flex(&stored[..cut], raw.len());
            let mut damaged = stored.clone();
            if !damaged.is_empty() {
                let at = rng.gen_range(0..damaged.len());
                damaged[at] ^= 1 << rng.gen_range(0..8);
                agree_with_lz4_flex(&damaged, raw.len());
            }
        }
    }
    // Hand-made sequences: zero offset, offset before the start, overlong lengths.
    agree_with_lz4_flex(&[0x14, b'a', 0, 0, 0x00], 6); // offset 0
    agree_with_lz4_flex(&[0x14, b'a', 2, 0, 0x00], 6); // offset 2 > 1 byte produced
    agree_with_lz4_flex(&[0xf0, 0xff, 0xff, 0x10], 1000); // literal length past the input
    agree_with_lz4_flex(&[0x1f, b'a', 1, 0, 0xff, 0xff, 0xff, 0x10, 0x00], 20); // match too long
    agree_with_lz4_flex(&[0x10, b'a'], 1); // literal-only
    agree_with_lz4_flex(&[0x00], 0); // empty block
    agree_with_lz4_flex(&[0x14, b'a', 1, 0], 6); // ends after a match
    for _ in 0..20_000 {
        let n = rng.gen_range(0..40);
        let garbage: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        agree_with_lz4_flex(&garbage, rng.gen_range(0..300));
    }
}

/// The two-phase model must give the one-phase model's status, count and bytes (poisoned buffers:
/// no byte past `produced` may change), and agree with lz4_flex.
fn two_phase_agrees(stored: &[u8], raw_bytes: usize, misalign: usize) {
    let mut one = vec![0xA5u8; raw_bytes];
    let one_result = lz4_decode_transcribed(stored, &mut one);
    let mut two = vec![0xA5u8; raw_bytes];
    let two_result = lz4_decode_two_phase_transcribed(stored, &mut two, misalign);
    assert_eq!(
        two_result,
        one_result,
        "{} stored bytes, {raw_bytes} raw, misalign {misalign}",
        stored.len()
    );
    assert!(
        two == one,
        "bytes differ from the one-phase model ({} stored bytes, {raw_bytes} raw)",
        stored.len()
    );
    let mut cpu = vec![0u8; raw_bytes];
    match lz4_flex::block::decompress_into(stored, &mut cpu) {
        Ok(n) if n == raw_bytes => {
            assert_eq!(two_result, (Lz4Status::Ok, raw_bytes));
            assert!(two == cpu, "bytes differ from lz4_flex");
        }
        Ok(n) => assert_eq!(two_result, (Lz4Status::SizeMismatch, n)),
        Err(e) => assert_ne!(two_result.0, Lz4Status::Ok, "lz4_flex rejected ({e})"),
    }
}

/// Blocks of every kind the GPU tests use: zipf tokens (plain and byte-shuffled), ReLU-sparse fp16,
/// noise, zeros, short and long periods, back-references of every distance, literal-only runs.
fn two_phase_inputs(rng: &mut rand::rngs::StdRng) -> Vec<Vec<u8>> {
    let zipf = crate::synth::zipf_tokens_i32(16_384, 31);
    let mut zipf_shuffled = vec![0u8; zipf.len()];
    crate::decode::shuffle(&zipf, 4, &mut zipf_shuffled);
    let relu = relu_sparse_f16(32_768, 32);
    let mut relu_shuffled = vec![0u8; relu.len()];
    crate::decode::shuffle(&relu, 2, &mut relu_shuffled);
    let mut inputs = vec![
        zipf,
        zipf_shuffled,
        relu,
        relu_shuffled,
        crate::synth::zipf_tokens_i32(700, 33),
        crate::synth::random_bytes(70_000, 34),
        crate::synth::random_bytes(300, 35),
        vec![0u8; 70_000],
        vec![0u8; 17],
        b"abcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabc".repeat(300),
        vec![7u8; 1],
        Vec::new(),
    ];
    for period in (1..40).chain([63, 64, 65, 100]) {
        let pattern: Vec<u8> = (0..period).map(|_| rng.gen()).collect();
        let n = 3000 + period;
        inputs.push(pattern.iter().cycle().take(n).copied().collect());
    }
    // Repeats from every distance, noise and zero runs, as in the GPU tests.
    for size in [70_000usize, 20_000, 4_000] {
        let mut out: Vec<u8> = Vec::with_capacity(size);
        while out.len() < size {
            match rng.gen_range(0..3) {
                0 if !out.is_empty() => {
                    let back = rng.gen_range(1..=out.len().min(65_535));
                    let n = rng.gen_range(4..600);
                    let start = out.len() - back;
                    for k in 0..n {
                        out.push(out[start + k]);
                    }
                }
                1 => out.extend(crate::synth::random_bytes(rng.gen_range(1..300), rng.gen())),
                _ => out.extend(std::iter::repeat_n(0u8, rng.gen_range(1..2000))),
            }
        }
        out.truncate(size);
        inputs.push(out);
    }
    inputs
}

#[test]
fn lz4_two_phase_transcription_agrees_with_the_one_phase_model_and_lz4_flex() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(41);
    let inputs = two_phase_inputs(&mut rng);
    for (i, raw) in inputs.iter().enumerate() {
        let stored = lz4_flex::block::compress(raw);
        for misalign in [0, 1, 9, 15] {
            two_phase_agrees(&stored, raw.len(), (misalign + i) % 16);
        }
        // Wrong raw lengths: the output ends inside a chunk, at a chunk's end, or far beyond.
        for delta in [1usize, 4, 7, 100, 1000, 20_000] {
            two_phase_agrees(&stored, raw.len() + delta, i % 16);
            if delta <= raw.len() {
                two_phase_agrees(&stored, raw.len() - delta, i % 16);
            }
        }
        // Truncations and byte damage: faults in the fast parse's records, found by validation.
        let damage = if raw.len() > 10_000 { 12 } else { 40 };
        for _ in 0..damage {
            let cut = rng.gen_range(0..=stored.len());
            two_phase_agrees(&stored[..cut], raw.len(), rng.gen_range(0..16));
            if !stored.is_empty() {
                let mut damaged = stored.clone();
                let at = rng.gen_range(0..damaged.len());
                damaged[at] ^= 1 << rng.gen_range(0..8);
                two_phase_agrees(&damaged, raw.len(), rng.gen_range(0..16));
                // Several flips: more than one bad record in a chunk.
                for _ in 0..3 {
                    let at = rng.gen_range(0..damaged.len());
                    damaged[at] = rng.gen();
                }
                two_phase_agrees(&damaged, raw.len(), rng.gen_range(0..16));
            }
        }
    }
    // One field of one sequence made wrong, at several places in a chunk: offsets of 0, one and two
    // past the match start (the first bytes before the output), the largest; raw lengths ending
    // inside a sequence's literals, at its match start, one byte short of its end.
    for raw in [&inputs[0], &inputs[2], &inputs[3]] {
        let stored = lz4_flex::block::compress(raw);
        let sequences = lz4_sequences(&stored);
        assert_eq!(sequences.last().map(|s| s.end), Some(raw.len()));
        let n = sequences.len();
        for k in [0, 1, 5, 30, 31, 32, 33, 63, 64, 100, n / 2, n - 2] {
            let sequence = sequences[k];
            let at = sequence.offset_at.expect("not the last sequence");
            let ms = sequence.match_start;
            for offset in [0, ms + 1, ms + 2, 65_535] {
                if offset > 65_535 || (offset <= ms && offset != 0) {
                    continue;
                }
                let mut damaged = stored.clone();
                damaged[at..at + 2].copy_from_slice(&(offset as u16).to_le_bytes());
                two_phase_agrees(&damaged, raw.len(), k % 16);
            }
            for raw_bytes in [ms.saturating_sub(1), ms, ms + 1, sequence.end - 1] {
                two_phase_agrees(&stored, raw_bytes, k % 16);
            }
        }
    }
    // Literal-only blocks around the length classes: no extension, one byte, 255-byte chains, runs
    // longer than the window.
    for n in [
        1usize, 14, 15, 16, 269, 270, 271, 284, 285, 1000, 1023, 1024, 1040, 3000,
    ] {
        let raw = crate::synth::random_bytes(n, n as u64);
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
        for misalign in 0..16 {
            two_phase_agrees(&stored, n, misalign);
            two_phase_agrees(&stored, n + 1, misalign);
            two_phase_agrees(&stored[..stored.len() - 1], n, misalign);
        }
    }
    // Overlapping matches of every short offset, with match lengths of one, two and many extension
    // bytes, after literal runs of every extension class.
    for offset in 1..=40u16 {
        for lits in [offset as usize, offset as usize + 15, offset as usize + 300] {
            let pattern = crate::synth::random_bytes(lits, rng.gen());
            let mlen = rng.gen_range(19..3000usize);
            let mut stored = Vec::new();
            stored.push((lits.min(15) as u8) << 4 | 0x0f);
            if lits >= 15 {
                let mut rest = lits - 15;
                while rest >= 255 {
                    stored.push(255);
                    rest -= 255;
                }
                stored.push(rest as u8);
            }
            stored.extend_from_slice(&pattern);
            stored.extend_from_slice(&offset.to_le_bytes());
            let mut rest = mlen - 19;
            while rest >= 255 {
                stored.push(255);
                rest -= 255;
            }
            stored.push(rest as u8);
            stored.push(0x50);
            stored.extend_from_slice(b"tail!");
            two_phase_agrees(&stored, lits + mlen + 5, offset as usize);
            two_phase_agrees(&stored, lits + mlen + 4, offset as usize);
        }
    }
    // Hand-made faults, then garbage.
    for (stored, raw_bytes) in [
        (&[0x14, b'a', 0, 0, 0x00][..], 6),
        (&[0x14, b'a', 2, 0, 0x00], 6),
        (&[0x0f, 0xff, 0xff, 0x00, 0x00], 64),
        (&[0xf0, 0xff, 0xff, 0x10], 1000),
        (&[0xf0, 0xff, 0xff, 0xff], 1 << 20),
        (&[0x1f, b'a', 1, 0, 0xff, 0xff, 0xff, 0x10, 0x00], 20),
        (&[0x10, b'a'], 1),
        (&[0x00], 0),
        (&[0x14, b'a', 1, 0], 6),
        (&[0x14, b'a', 1], 6),
        (&[], 0),
    ] {
        for misalign in 0..16 {
            two_phase_agrees(stored, raw_bytes, misalign);
        }
    }
    for _ in 0..20_000 {
        let n = rng.gen_range(0..64);
        let garbage: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        two_phase_agrees(&garbage, rng.gen_range(0..512), rng.gen_range(0..16));
    }
}

#[test]
fn lz4_two_phase_period_step_divides_exactly() {
    // The copy moves a match byte back by floor(t / offset) + 1 periods with a multiply by
    // ceil(1024 / offset) and a shift: exact for every t and offset below 32.
    for offset in 1..32u32 {
        let inverse = (1023 + offset) / offset;
        for t in 0..32u32 {
            assert_eq!((t * inverse) >> 10, t / offset, "t {t}, offset {offset}");
        }
    }
}

#[test]
fn lz4_kernel_constants_match_the_two_phase_transcription() {
    let source = super::super::LZ4_SOURCE.source;
    let define = |name: &str| -> u64 {
        let line = source
            .lines()
            .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
            .unwrap_or_else(|| panic!("the kernel defines {name}"));
        let value = line.split_whitespace().nth(2).expect("a value");
        value
            .trim_end_matches('u')
            .parse()
            .expect("a decimal value")
    };
    assert_eq!(define("GF_WINDOW_BYTES"), LZ4_WINDOW_BYTES as u64);
    assert_eq!(define("GF_TP_FAST_HEADER"), LZ4_TP_FAST_HEADER as u64);
    assert_eq!(define("GF_TP_REFILL_AHEAD"), LZ4_TP_REFILL_AHEAD as u64);
    assert_eq!(
        define("GF_TP_FAST_SEQUENCE_MAX"),
        LZ4_TP_FAST_SEQUENCE_MAX as u64
    );
    assert_eq!(define("GF_TP_SRC_INPUT"), SRC_INPUT as u64);
    assert_eq!(define("GF_TP_SRC_OUTPUT"), SRC_OUTPUT as u64);
}

fn xxh3_agrees(input: &[u8]) {
    assert_eq!(
        xxh3_64_transcribed(input),
        xxhash_rust::xxh3::xxh3_64(input),
        "{} bytes",
        input.len()
    );
}

#[test]
fn xxh3_transcription_matches_xxhash_rust_for_every_length_class() {
    let data = crate::synth::random_bytes(200_000, 21);
    // 0, 1-3, 4-8, 9-16, 17-128, 129-240, and the long path's first two blocks, at two offsets.
    for len in 0..=2113 {
        xxh3_agrees(&data[..len]);
        xxh3_agrees(&data[7..7 + len]);
    }
    // Around every 1 KiB boundary up to 70 KiB: where the number of scrambles, the partial block's
    // stripe count and the last stripe's overlap with it change.
    for k in 1..=70usize {
        for delta in [-65i64, -64, -63, -1, 0, 1, 63, 64, 65] {
            let len = (k as i64 * 1024 + delta) as usize;
            xxh3_agrees(&data[..len]);
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    for _ in 0..400 {
        let len = rng.gen_range(0..70_000);
        let start = rng.gen_range(0..=data.len() - len);
        xxh3_agrees(&data[start..start + len]);
    }
    // Inputs that are not random: zeros and ones.
    for len in [0, 3, 8, 16, 128, 240, 241, 1024, 1025, 65536] {
        xxh3_agrees(&vec![0u8; len]);
        xxh3_agrees(&vec![0xffu8; len]);
    }
}

#[test]
fn xxh3_transcription_gives_the_same_hash_for_every_group_size() {
    let data = crate::synth::random_bytes(70_000, 22);
    for len in [
        241,
        1024,
        1025,
        4096,
        4097,
        5 * 1024 + 1,
        9 * 1024 + 1,
        65536,
        70_000,
    ] {
        let expected = xxhash_rust::xxh3::xxh3_64(&data[..len]);
        for group in 1..=8 {
            assert_eq!(
                xxh3_64_transcribed_with_group(&data[..len], group),
                expected,
                "{len} bytes, {group} blocks per step"
            );
        }
    }
}

#[test]
fn xxh3_kernel_secret_table_is_the_default_secret() {
    let source = super::super::XXH3_SOURCE.source;
    let start = source
        .find("gf_xxh3_secret[24] = {")
        .expect("the kernel declares its secret table");
    let body = &source[start..];
    let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
    let words: Vec<u64> = body
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            let hex = t.strip_prefix("0x").and_then(|t| t.strip_suffix("ull"));
            u64::from_str_radix(hex.expect("0x...ull literals"), 16).expect("a hex word")
        })
        .collect();
    assert_eq!(words, xxh3_secret_words());
}

#[test]
fn xxh3_verify_transcription_reports_mismatches_and_bad_jobs() {
    let src = crate::synth::random_bytes(10_000, 24);
    let sum = |range: std::ops::Range<usize>| xxhash_rust::xxh3::xxh3_64(&src[range]);
    let jobs = [
        Xxh3Job {
            src_offset: 100,
            bytes: 5000,
            expected: sum(100..5100),
        },
        Xxh3Job {
            src_offset: 3,
            bytes: 17,
            expected: sum(3..20) ^ 1,
        },
        Xxh3Job {
            src_offset: 10_000,
            bytes: 0,
            expected: sum(0..0),
        },
        Xxh3Job {
            src_offset: 9_999,
            bytes: 2,
            expected: 0,
        },
        Xxh3Job {
            src_offset: u64::MAX,
            bytes: 1,
            expected: 0,
        },
    ];
    let outcomes = xxh3_verify_transcribed(&jobs, &src);
    let expected = [
        (Xxh3Status::Ok, sum(100..5100)),
        (Xxh3Status::Mismatch, sum(3..20)),
        (Xxh3Status::Ok, sum(0..0)),
        (Xxh3Status::BadJob, 0),
        (Xxh3Status::BadJob, 0),
    ];
    let got: Vec<(Xxh3Status, u64)> = outcomes.iter().map(|o| (o.status, o.hash)).collect();
    assert_eq!(got, expected);
}
