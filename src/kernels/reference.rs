//! CPU models of the kernels, for tests.
//!
//! Two kinds live here. The *reference* ([`gather_reference`]) is built on the CPU decode path
//! (`crate::decode::convert`, hence `half`): the GPU must agree with it bit for bit. The *transcriptions*
//! ([`lz4_decode_transcribed`], [`f16_to_f32_bits`], ...) copy the kernels' own algorithms line for
//! line into Rust, so that CI, which has no GPU, checks those algorithms against the reference on every
//! input it can afford (all 65 536 half patterns, adversarial LZ4 blocks). The GPU tests then check the
//! kernels against the reference directly.

use super::{GatherOp, GatherOutcome, GatherPiece, Lz4Status};

/// The LZ4 kernel's parse and bounds checks, sequentially: decodes `input` into exactly `out.len()`
/// bytes. Returns the status the kernel reports and the bytes produced.
pub fn lz4_decode_transcribed(input: &[u8], out: &mut [u8]) -> (Lz4Status, usize) {
    let len = input.len();
    let cap = out.len();
    let mut ip = 0usize;
    let mut op = 0usize;
    let status = 'parse: loop {
        if ip >= len {
            break 'parse Lz4Status::InputOverrun;
        }
        let token = input[ip] as usize;
        ip += 1;
        let mut lit = token >> 4;
        if lit == 15 {
            loop {
                if ip >= len {
                    break 'parse Lz4Status::InputOverrun;
                }
                let b = input[ip] as usize;
                ip += 1;
                lit += b;
                if lit > len {
                    break 'parse Lz4Status::InputOverrun;
                }
                if b != 255 {
                    break;
                }
            }
        }
        if lit > len - ip {
            break 'parse Lz4Status::InputOverrun;
        }
        if lit > cap - op {
            break 'parse Lz4Status::OutputOverrun;
        }
        out[op..op + lit].copy_from_slice(&input[ip..ip + lit]);
        ip += lit;
        op += lit;
        if ip == len {
            break 'parse Lz4Status::Ok;
        }
        if len - ip < 2 {
            break 'parse Lz4Status::InputOverrun;
        }
        let offset = input[ip] as usize | (input[ip + 1] as usize) << 8;
        ip += 2;
        if offset == 0 {
            break 'parse Lz4Status::BadOffset;
        }
        let mut mlen = token & 15;
        if mlen == 15 {
            loop {
                if ip >= len {
                    break 'parse Lz4Status::InputOverrun;
                }
                let b = input[ip] as usize;
                ip += 1;
                mlen += b;
                if mlen > cap {
                    break 'parse Lz4Status::OutputOverrun;
                }
                if b != 255 {
                    break;
                }
            }
        }
        mlen += 4;
        if mlen > cap - op {
            break 'parse Lz4Status::OutputOverrun;
        }
        if offset > op {
            break 'parse Lz4Status::BadOffset;
        }
        let from = op - offset;
        if offset >= 32 || offset >= mlen {
            // Lanes read out[from + (i mod offset)]: bytes already written before this match.
            for i in 0..mlen {
                out[op + i] = out[from + i % offset];
            }
        } else {
            // Lanes stride by a multiple of the offset, each writing its one pattern byte.
            let stride = (32 / offset) * offset;
            for lane in 0..stride.min(mlen) {
                let v = out[from + lane % offset];
                let mut i = lane;
                while i < mlen {
                    out[op + i] = v;
                    i += stride;
                }
            }
        }
        op += mlen;
    };
    let status = if status == Lz4Status::Ok && op != cap {
        Lz4Status::SizeMismatch
    } else {
        status
    };
    (status, op)
}

/// The gather kernel's f16 -> f32 rule, transcribed (integer operations only).
pub fn f16_to_f32_bits(h: u16) -> u32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    if exp == 0x1f {
        if man == 0 {
            sign | 0x7f80_0000
        } else {
            sign | 0x7fc0_0000 | (man << 13)
        }
    } else if exp == 0 {
        if man == 0 {
            sign
        } else {
            let e = man.leading_zeros() - 22;
            sign | ((112 - e) << 23) | ((man << (14 + e)) & 0x7f_ffff)
        }
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    }
}

/// The gather kernel's bf16 -> f32 rule, transcribed.
pub fn bf16_to_f32_bits(h: u16) -> u32 {
    let x = h as u32;
    (if x & 0x7fff > 0x7f80 { x | 0x40 } else { x }) << 16
}

/// The gather kernel's f64 -> f32 rule for NaN, transcribed; other values round to nearest even.
pub fn f64_to_f32_bits(b: u64) -> u32 {
    if b & 0x7fff_ffff_ffff_ffff > 0x7ff0_0000_0000_0000 {
        let sign = (b >> 32) as u32 & 0x8000_0000;
        sign | 0x7fc0_0000 | ((b >> 29) as u32 & 0x3f_ffff)
    } else {
        (f64::from_bits(b) as f32).to_bits()
    }
}

/// What the gather kernel must produce: each piece converted by the CPU decode path into `dst`, with
/// the kernel's rules for pieces that do not fit (skipped and counted).
pub fn gather_reference(
    pieces: &[GatherPiece],
    sources: &[&[u8]],
    dst: &mut [u8],
) -> GatherOutcome {
    let mut outcome = GatherOutcome::default();
    for (index, piece) in pieces.iter().enumerate() {
        let n = piece.elements as u64;
        let in_bytes = n * piece.op.in_bytes();
        let out_bytes = n * piece.op.out_bytes();
        let fits = |offset: u64, bytes: u64, capacity: usize| {
            offset <= capacity as u64 && bytes <= capacity as u64 - offset
        };
        let source = sources
            .get(piece.source as usize)
            .filter(|_| (piece.source as usize) < super::GATHER_SOURCES_MAX);
        let Some(source) = source.filter(|s| {
            fits(piece.src_offset, in_bytes, s.len())
                && fits(piece.dst_offset, out_bytes, dst.len())
        }) else {
            outcome.faulted_pieces += 1;
            outcome.last_faulted_plus_1 = outcome.last_faulted_plus_1.max(index as u32 + 1);
            continue;
        };
        let src = &source[piece.src_offset as usize..(piece.src_offset + in_bytes) as usize];
        let out = &mut dst[piece.dst_offset as usize..(piece.dst_offset + out_bytes) as usize];
        match piece.op.dtypes() {
            None => out.copy_from_slice(src),
            Some((from, to)) => {
                crate::decode::convert(from, src, to, out)
                    .expect("every GatherOp is a supported conversion");
                if piece.op == GatherOp::U8ToF32 && piece.scale != 1.0 {
                    for word in out.chunks_exact_mut(4) {
                        let v = f32::from_le_bytes(word.try_into().expect("4 bytes")) * piece.scale;
                        word.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
    }
    outcome
}

/// `count` fp16 activations after a ReLU, little-endian: max(0, x) for x drawn from N(0, 1), so about
/// half are zero in runs of random length (the "ReLU-sparse fp16" of the kernel benchmarks).
pub fn relu_sparse_f16(count: usize, seed: u64) -> Vec<u8> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    let mut out = Vec::with_capacity(count * 2);
    for _ in 0..count {
        let x = normal.sample(&mut rng).max(0.0);
        out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use rand::{Rng, SeedableRng};

    use super::*;

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
                gpufeed_client::DType::F64,
                &bits.to_le_bytes(),
                gpufeed_client::DType::F32,
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
}
