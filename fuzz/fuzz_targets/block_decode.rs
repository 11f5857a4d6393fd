//! Fuzzes the CPU block decoder (`decode::decode_block`): checksum, LZ4, byte unshuffle.
//!
//! Input layout: `flags: u8`, `raw_bytes: u32 LE`, then the payload.
//! - flags bit 0 clear ("decode"): the payload is a block's *stored* bytes. Bits 1-2 pick the element
//!   width (1, 2, 4, 8), bit 3 the codec (raw, lz4), bit 5 the filter (none, byte shuffle).
//!   `raw_bytes` is reduced to a multiple of the width in `width..=256 KiB` (for a raw block it is the
//!   payload length, as the table parser requires). The entry's checksum is computed over the payload
//!   so that the checksum passes and the LZ4 decoder really runs. On `Ok` the output must equal what
//!   an independent reference LZ4 decoder (below) produces, and every output byte must have been
//!   written (decoding into buffers pre-filled with 0x00 and 0xff gives the same result).
//! - flags bit 0 set ("round trip"): the payload is a block's *raw* bytes (cut to a multiple of the
//!   width, at most 256 KiB). Bits 3-4 pick the packer's codec policy (auto, lz4, raw, auto), bits
//!   5-6 its shuffle policy (auto, on, off, auto); `pack::encode_block` encodes it, and decoding must
//!   give back exactly the raw bytes.
//! - flags bit 7 set: the checksum in the entry is flipped; decoding must fail with `Checksum`.
//!
//! The preconditions the shard parser guarantees to callers (raw block: stored == raw bytes and no
//! filter; raw_bytes a multiple of the element width) are kept; everything else is arbitrary.
#![no_main]

use gpufeed::decode::{decode_block, unshuffle, BlockError, BlockRef};
use gpufeed::format::{checksum, BlockEntry, Codec, Filter};
use gpufeed::pack::{encode_block, CodecChoice, ShuffleChoice, MIN_SAVING_DIVISOR};
use libfuzzer_sys::fuzz_target;

const RAW_BYTES_MAX: usize = 256 << 10;

fuzz_target!(|data: &[u8]| {
    if data.len() < 5 {
        return;
    }
    let flags = data[0];
    let raw_bytes_in = u32::from_le_bytes(data[1..5].try_into().unwrap()) as usize;
    let payload = &data[5..];
    let width = 1usize << ((flags >> 1) & 3);
    let corrupt = flags & 0x80 != 0;
    if flags & 1 == 0 {
        decode_arbitrary(flags, raw_bytes_in, payload, width, corrupt);
    } else {
        round_trip(flags, payload, width, corrupt);
    }
});

fn at() -> BlockRef {
    BlockRef {
        shard: "fuzz.gfs".into(),
        field: "f".into(),
        block: 0,
        stored_offset: 4096,
    }
}

fn entry(
    stored: &[u8],
    raw_bytes: usize,
    codec: Codec,
    filter: Filter,
    corrupt: bool,
) -> BlockEntry {
    BlockEntry {
        stored_offset: 4096,
        stored_bytes: stored.len() as u32,
        raw_bytes: raw_bytes as u32,
        codec,
        filter,
        field: 0,
        raw_offset: 0,
        first_sample: 0,
        checksum: checksum(stored) ^ u64::from(corrupt),
    }
}

fn decode_arbitrary(flags: u8, raw_bytes_in: usize, payload: &[u8], width: usize, corrupt: bool) {
    let codec = if flags & 8 == 0 {
        Codec::Raw
    } else {
        Codec::Lz4
    };
    let (raw_bytes, filter) = match codec {
        Codec::Raw => {
            if payload.len() > RAW_BYTES_MAX {
                return;
            }
            (payload.len(), Filter::None)
        }
        Codec::Lz4 => {
            let filter = if flags & 0x20 == 0 {
                Filter::None
            } else {
                Filter::ByteShuffle
            };
            ((raw_bytes_in % (RAW_BYTES_MAX / width) + 1) * width, filter)
        }
    };
    let block = entry(payload, raw_bytes, codec, filter, corrupt);
    let mut scratch = Vec::new();
    let mut out_a = vec![0x00u8; raw_bytes];
    let mut out_b = vec![0xffu8; raw_bytes];
    let result_a = decode_block(payload, &block, width, &mut scratch, &mut out_a, at);
    let result_b = decode_block(payload, &block, width, &mut scratch, &mut out_b, at);
    if corrupt {
        assert!(matches!(result_a, Err(BlockError::Checksum { .. })));
        return;
    }
    match (&result_a, &result_b) {
        (Ok(()), Ok(())) => {
            assert!(out_a == out_b, "decode left some output bytes unwritten");
            let expected = match codec {
                Codec::Raw => payload.to_vec(),
                Codec::Lz4 => {
                    let plain = reference_lz4_decode(payload, raw_bytes)
                        .expect("decode_block accepted a block the reference decoder rejects");
                    assert_eq!(
                        plain.len(),
                        raw_bytes,
                        "decode_block accepted a short block"
                    );
                    match filter {
                        Filter::None => plain,
                        Filter::ByteShuffle => {
                            let mut out = vec![0; raw_bytes];
                            unshuffle(&plain, width, &mut out);
                            out
                        }
                    }
                }
            };
            assert!(
                out_a == expected,
                "decode_block output differs from the reference"
            );
        }
        (Err(a), Err(b)) => {
            assert!(
                !matches!(a, BlockError::Checksum { .. }),
                "checksum computed over the payload failed"
            );
            assert_eq!(a.to_string(), b.to_string());
            assert!(a.to_string().contains("field 'f', block 0"));
        }
        _ => panic!("decode_block is not deterministic: {result_a:?} vs {result_b:?}"),
    }
}

fn round_trip(flags: u8, payload: &[u8], width: usize, corrupt: bool) {
    let len = payload.len().min(RAW_BYTES_MAX) / width * width;
    if len == 0 {
        return;
    }
    let raw = &payload[..len];
    let codec_choice = match (flags >> 3) & 3 {
        1 => CodecChoice::Lz4,
        2 => CodecChoice::Raw,
        _ => CodecChoice::Auto,
    };
    let shuffle_choice = match (flags >> 5) & 3 {
        1 => ShuffleChoice::On,
        2 => ShuffleChoice::Off,
        _ => ShuffleChoice::Auto,
    };
    let encoded = encode_block(raw, width, codec_choice, shuffle_choice);
    match encoded.codec {
        Codec::Raw => {
            assert!(encoded.stored == raw);
            assert_eq!(encoded.filter, Filter::None);
            assert_ne!(codec_choice, CodecChoice::Lz4);
        }
        Codec::Lz4 => {
            assert_ne!(codec_choice, CodecChoice::Raw);
            if codec_choice == CodecChoice::Auto {
                let limit = len - len / MIN_SAVING_DIVISOR as usize;
                assert!(
                    encoded.stored.len() <= limit,
                    "auto kept an LZ4 block that saves too little"
                );
            }
        }
    }
    if encoded.filter == Filter::ByteShuffle {
        assert!(width > 1 && shuffle_choice != ShuffleChoice::Off);
    }
    let block = entry(&encoded.stored, len, encoded.codec, encoded.filter, corrupt);
    let mut out = vec![0u8; len];
    let result = decode_block(
        &encoded.stored,
        &block,
        width,
        &mut Vec::new(),
        &mut out,
        at,
    );
    if corrupt {
        assert!(matches!(result, Err(BlockError::Checksum { .. })));
    } else {
        result.expect("a block encoded by the packer must decode");
        assert!(out == raw, "round trip changed the bytes");
    }
}

/// A deliberately simple LZ4 block decoder written from the format description, independent of
/// lz4_flex. Returns `None` on malformed input or when the output would exceed `limit` bytes.
fn reference_lz4_decode(src: &[u8], limit: usize) -> Option<Vec<u8>> {
    fn length(src: &[u8], i: &mut usize, mut n: usize) -> Option<usize> {
        if n == 15 {
            loop {
                let b = *src.get(*i)?;
                *i += 1;
                n += b as usize;
                if b != 255 {
                    break;
                }
            }
        }
        Some(n)
    }
    let mut out = Vec::with_capacity(limit);
    let mut i = 0;
    loop {
        let token = *src.get(i)?;
        i += 1;
        let literals = length(src, &mut i, (token >> 4) as usize)?;
        out.extend_from_slice(src.get(i..i.checked_add(literals)?)?);
        i += literals;
        if out.len() > limit {
            return None;
        }
        if i == src.len() {
            return Some(out);
        }
        let offset = u16::from_le_bytes(src.get(i..i + 2)?.try_into().ok()?) as usize;
        i += 2;
        if offset == 0 || offset > out.len() {
            return None;
        }
        let match_len = length(src, &mut i, (token & 15) as usize)? + 4;
        if out.len() + match_len > limit {
            return None;
        }
        let start = out.len() - offset;
        for k in 0..match_len {
            let byte = out[start + k];
            out.push(byte);
        }
    }
}
