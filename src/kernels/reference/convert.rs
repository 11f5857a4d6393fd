//! The gather kernel's element conversions transcribed, and the reference it must match.

use crate::kernels::{GatherOp, GatherOutcome, GatherPiece};

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
            .filter(|_| (piece.source as usize) < crate::kernels::GATHER_SOURCES_MAX);
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
