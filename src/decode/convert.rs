//! Element conversion from a field's stored dtype to the dtype a consumer asked for.
//!
//! The rules here are the reference for the GPU gather kernels:
//! - identity: a byte copy;
//! - `f16` and `bf16` to `f32`: exact, with the `half` crate's semantics (subnormals kept, infinities
//!   kept, NaN stays NaN with its sign and payload, and a signalling NaN becomes quiet: the top
//!   mantissa bit is set, so f16 `0x7C01` becomes f32 `0x7FC02000`);
//! - integers to `f32`: round to nearest, ties to even (Rust's `as`; exact up to 2^24);
//! - `f64` to `f32`: round to nearest, ties to even;
//! - signed and unsigned integers of at most 32 bits to `i64`: exact widening.

use gpufeed_proto::DType;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A conversion that gpufeed does not offer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot convert {from} to {to}: supported are identity, any type to f32, and integers of at most 32 bits to i64")]
pub struct ConvertError {
    /// Stored dtype.
    pub from: DType,
    /// Requested dtype.
    pub to: DType,
}

/// Whether [`convert`] supports `from` to `to`.
pub fn convert_supported(from: DType, to: DType) -> bool {
    use DType::*;
    from == to || to == F32 || (to == I64 && matches!(from, U8 | I8 | U16 | I16 | U32 | I32))
}

/// Elements converted per step: small enough for the stack, large enough for the SIMD paths in `half`.
const CHUNK_ELEMENTS: usize = 1024;

/// Converts the little-endian elements of `src` (dtype `from`) into `dst` (dtype `to`).
///
/// `src.len()` must be a multiple of `from`'s size and `dst.len()` must be exactly the converted size;
/// both are asserted, as callers size the buffers from the same shape.
pub fn convert(from: DType, src: &[u8], to: DType, dst: &mut [u8]) -> Result<(), ConvertError> {
    if !convert_supported(from, to) {
        return Err(ConvertError { from, to });
    }
    assert_eq!(src.len() % from.size_bytes(), 0);
    let count = src.len() / from.size_bytes();
    assert_eq!(dst.len(), count * to.size_bytes());
    if from == to {
        dst.copy_from_slice(src);
        return Ok(());
    }
    match (from, to) {
        (DType::F16, DType::F32) => halves_to_f32(src, dst, f16::from_bits, |h, out| {
            h.convert_to_f32_slice(out)
        }),
        (DType::BF16, DType::F32) => halves_to_f32(src, dst, bf16::from_bits, |h, out| {
            h.convert_to_f32_slice(out)
        }),
        (_, DType::F32) => map_elements::<4>(from, src, dst, |element| {
            (element_as_f64_or_int(from, element)).to_le_bytes()
        }),
        (_, DType::I64) => map_elements::<8>(from, src, dst, |element| {
            widen_to_i64(from, element).to_le_bytes()
        }),
        _ => unreachable!("convert_supported admitted {from} -> {to}"),
    }
    Ok(())
}

/// Converts 16-bit floats to f32 with `half`'s vectorised slice conversion: straight from `src` into
/// `dst` when both are aligned for their element types (on a little-endian machine the bytes are
/// the elements), otherwise through stack-sized chunks.
fn halves_to_f32<H: bytemuck::Pod + Default>(
    src: &[u8],
    dst: &mut [u8],
    from_bits: fn(u16) -> H,
    convert_chunk: fn(&[H], &mut [f32]),
) {
    #[cfg(target_endian = "little")]
    if let (Ok(halves), Ok(floats)) = (
        bytemuck::try_cast_slice::<u8, H>(src),
        bytemuck::try_cast_slice_mut::<u8, f32>(dst),
    ) {
        convert_chunk(halves, floats);
        return;
    }
    let mut halves = [H::default(); CHUNK_ELEMENTS];
    let mut floats = [0f32; CHUNK_ELEMENTS];
    for (src_chunk, dst_chunk) in src
        .chunks(CHUNK_ELEMENTS * 2)
        .zip(dst.chunks_mut(CHUNK_ELEMENTS * 4))
    {
        let n = src_chunk.len() / 2;
        for (half, bytes) in halves[..n].iter_mut().zip(src_chunk.chunks_exact(2)) {
            *half = from_bits(u16::from_le_bytes([bytes[0], bytes[1]]));
        }
        convert_chunk(&halves[..n], &mut floats[..n]);
        for (value, bytes) in floats[..n].iter().zip(dst_chunk.chunks_exact_mut(4)) {
            bytes.copy_from_slice(&value.to_le_bytes());
        }
    }
}

fn map_elements<const OUT: usize>(
    from: DType,
    src: &[u8],
    dst: &mut [u8],
    f: impl Fn(&[u8]) -> [u8; OUT],
) {
    for (element, out) in src
        .chunks_exact(from.size_bytes())
        .zip(dst.chunks_exact_mut(OUT))
    {
        out.copy_from_slice(&f(element));
    }
}

/// One element of an integer or f64 dtype, converted to f32 with a single rounding.
fn element_as_f64_or_int(from: DType, e: &[u8]) -> f32 {
    match from {
        DType::U8 => e[0] as f32,
        DType::I8 => e[0] as i8 as f32,
        DType::U16 => u16::from_le_bytes([e[0], e[1]]) as f32,
        DType::I16 => i16::from_le_bytes([e[0], e[1]]) as f32,
        DType::U32 => u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as f32,
        DType::I32 => i32::from_le_bytes([e[0], e[1], e[2], e[3]]) as f32,
        DType::U64 => u64::from_le_bytes(e.try_into().expect("8-byte element")) as f32,
        DType::I64 => i64::from_le_bytes(e.try_into().expect("8-byte element")) as f32,
        DType::F64 => f64::from_le_bytes(e.try_into().expect("8-byte element")) as f32,
        DType::F16 | DType::BF16 | DType::F32 => unreachable!("handled by the caller"),
    }
}

fn widen_to_i64(from: DType, e: &[u8]) -> i64 {
    match from {
        DType::U8 => e[0] as i64,
        DType::I8 => e[0] as i8 as i64,
        DType::U16 => u16::from_le_bytes([e[0], e[1]]) as i64,
        DType::I16 => i16::from_le_bytes([e[0], e[1]]) as i64,
        DType::U32 => u32::from_le_bytes([e[0], e[1], e[2], e[3]]) as i64,
        DType::I32 => i32::from_le_bytes([e[0], e[1], e[2], e[3]]) as i64,
        _ => unreachable!("convert_supported admits only integers of at most 32 bits"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_f16_bit_pattern_matches_half() {
        let src: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let mut dst = vec![0u8; src.len() * 2];
        convert(DType::F16, &src, DType::F32, &mut dst).unwrap();
        for (bits, out) in (0..=u16::MAX).zip(dst.chunks_exact(4)) {
            let got = u32::from_le_bytes(out.try_into().unwrap());
            assert_eq!(
                got,
                f16::from_bits(bits).to_f32().to_bits(),
                "f16 bits {bits:#06x}"
            );
        }
    }

    /// Buffers not aligned for their elements take the chunked path; it must agree with the direct
    /// one (`Vec`s are aligned, so the tests above take the direct path).
    #[test]
    fn misaligned_buffers_convert_like_aligned_ones() {
        let bits: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        for dtype in [DType::F16, DType::BF16] {
            let mut aligned = vec![0u8; bits.len() * 2];
            convert(dtype, &bits, DType::F32, &mut aligned).unwrap();
            let mut src = vec![0u8; bits.len() + 1];
            src[1..].copy_from_slice(&bits);
            let mut dst = vec![0u8; aligned.len() + 1];
            convert(dtype, &src[1..], DType::F32, &mut dst[1..]).unwrap();
            assert!(
                dst[1..] == aligned[..],
                "{dtype}: misaligned buffers converted differently"
            );
        }
    }

    #[test]
    fn every_bf16_bit_pattern_matches_half() {
        let src: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let mut dst = vec![0u8; src.len() * 2];
        convert(DType::BF16, &src, DType::F32, &mut dst).unwrap();
        for (bits, out) in (0..=u16::MAX).zip(dst.chunks_exact(4)) {
            let got = u32::from_le_bytes(out.try_into().unwrap());
            assert_eq!(
                got,
                bf16::from_bits(bits).to_f32().to_bits(),
                "bf16 bits {bits:#06x}"
            );
        }
    }

    #[test]
    fn integers_convert_and_widen() {
        let src: Vec<u8> = [-3i16, 7, i16::MIN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut f = vec![0u8; 12];
        convert(DType::I16, &src, DType::F32, &mut f).unwrap();
        let floats: Vec<f32> = f
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(floats, [-3.0, 7.0, -32768.0]);
        let mut wide = vec![0u8; 24];
        convert(DType::I16, &src, DType::I64, &mut wide).unwrap();
        let ints: Vec<i64> = wide
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(ints, [-3, 7, -32768]);
        assert!(convert(DType::U64, &[0; 8], DType::I64, &mut [0; 8]).is_err());
        assert!(convert(DType::F32, &[0; 4], DType::F16, &mut [0; 2]).is_err());
    }
}
