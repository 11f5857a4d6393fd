//! The CPU decode path: checksum, LZ4 decompression, byte unshuffle, dtype conversion.
//!
//! This is the reference every GPU kernel is tested against, the decoder of the CPU backend, and what
//! `gpufeed verify` and `gpufeed unpack` use. It works on byte slices only: reading payloads is the
//! storage engines' job.
//!
//! *Invariant*: a block never decodes to more than its table entry's `raw_bytes`, and a corrupt block is
//! an error naming it, never a panic or an access outside the given slices.

mod convert;

use std::fmt;
use std::path::PathBuf;

pub use convert::{convert, convert_supported, ConvertError};

use crate::format::{checksum, BlockEntry, Codec, Filter};

/// Where a block lives, for error messages: shard file, field and block index within the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRef {
    /// The shard file.
    pub shard: PathBuf,
    /// The field's name.
    pub field: String,
    /// Index of the block among the field's blocks in this shard.
    pub block: u32,
    /// File offset of the stored payload.
    pub stored_offset: u64,
}

impl fmt::Display for BlockRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shard {}, field '{}', block {} (payload at byte {})",
            self.shard.display(),
            self.field,
            self.block,
            self.stored_offset
        )
    }
}

/// A block could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The stored bytes do not match the checksum in the block table.
    #[error(
        "{at}: checksum mismatch (table says {expected:016x}, payload hashes to {computed:016x})"
    )]
    Checksum {
        /// The block.
        at: BlockRef,
        /// Checksum from the block table.
        expected: u64,
        /// Checksum of the bytes read.
        computed: u64,
    },
    /// The LZ4 payload is malformed.
    #[error("{at}: corrupt LZ4 block: {reason}")]
    Lz4 {
        /// The block.
        at: BlockRef,
        /// The decoder's description of the fault.
        reason: String,
    },
    /// The LZ4 payload decoded to fewer bytes than the table says.
    #[error("{at}: decoded to {produced} bytes, the table says {expected}")]
    Size {
        /// The block.
        at: BlockRef,
        /// `raw_bytes` from the table.
        expected: u32,
        /// Bytes the decoder produced.
        produced: usize,
    },
    /// The payload could not be read.
    #[error("{at}: read failed: {source}")]
    Io {
        /// The block.
        at: BlockRef,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl BlockError {
    /// The block at fault.
    pub fn block(&self) -> &BlockRef {
        match self {
            BlockError::Checksum { at, .. }
            | BlockError::Lz4 { at, .. }
            | BlockError::Size { at, .. }
            | BlockError::Io { at, .. } => at,
        }
    }
}

/// Checks a block's stored bytes against its table checksum.
pub fn check_block(
    stored: &[u8],
    block: &BlockEntry,
    at: impl FnOnce() -> BlockRef,
) -> Result<(), BlockError> {
    let computed = checksum(stored);
    if computed != block.checksum || stored.len() != block.stored_bytes as usize {
        return Err(BlockError::Checksum {
            at: at(),
            expected: block.checksum,
            computed,
        });
    }
    Ok(())
}

/// Decodes one block's stored bytes into `out`, which must be exactly `block.raw_bytes` long.
///
/// Verifies the checksum first, so a corrupt payload is reported as such rather than as whatever the
/// LZ4 decoder makes of it. `scratch` is reused between calls to avoid allocating on every block of a
/// filtered field; it grows to at most one block.
pub fn decode_block(
    stored: &[u8],
    block: &BlockEntry,
    element_bytes: usize,
    scratch: &mut Vec<u8>,
    out: &mut [u8],
    at: impl Fn() -> BlockRef,
) -> Result<(), BlockError> {
    assert_eq!(
        out.len(),
        block.raw_bytes as usize,
        "output slice must be raw_bytes long"
    );
    check_block(stored, block, &at)?;
    match (block.codec, block.filter) {
        (Codec::Raw, _) => out.copy_from_slice(stored),
        (Codec::Lz4, Filter::None) => decompress_exact(stored, out, &at)?,
        (Codec::Lz4, Filter::ByteShuffle) => {
            scratch.clear();
            scratch.resize(out.len(), 0);
            decompress_exact(stored, scratch, &at)?;
            unshuffle(scratch, element_bytes, out);
        }
    }
    Ok(())
}

/// LZ4-decodes `stored` into exactly `out.len()` bytes; the decoder cannot write past `out`.
fn decompress_exact(
    stored: &[u8],
    out: &mut [u8],
    at: &impl Fn() -> BlockRef,
) -> Result<(), BlockError> {
    let produced = lz4_flex::block::decompress_into(stored, out).map_err(|e| BlockError::Lz4 {
        at: at(),
        reason: e.to_string(),
    })?;
    if produced != out.len() {
        return Err(BlockError::Size {
            at: at(),
            expected: out.len() as u32,
            produced,
        });
    }
    Ok(())
}

/// Byte shuffle: `out[b * n + i] = raw[i * width + b]` for `n = raw.len() / width` elements.
///
/// `raw.len()` must be a multiple of `width` (the format guarantees it for filtered blocks).
pub fn shuffle(raw: &[u8], width: usize, out: &mut [u8]) {
    assert_eq!(raw.len(), out.len());
    assert!(width > 0 && raw.len() % width == 0);
    // As for `unshuffle`: the format's element widths get a loop free of bounds checks (the packer
    // shuffles every block of a field twice-compressed under `--byte-shuffle auto`).
    match width {
        2 => shuffle_width::<2>(raw, out),
        4 => shuffle_width::<4>(raw, out),
        8 => shuffle_width::<8>(raw, out),
        _ => {
            let count = raw.len() / width;
            for (element, bytes) in raw.chunks_exact(width).enumerate() {
                for (byte_index, &byte) in bytes.iter().enumerate() {
                    out[byte_index * count + element] = byte;
                }
            }
        }
    }
}

fn shuffle_width<const W: usize>(raw: &[u8], out: &mut [u8]) {
    let count = raw.len() / W;
    let mut planes: [&mut [u8]; W] = {
        let mut rest = out;
        std::array::from_fn(|_| {
            let (plane, tail) = std::mem::take(&mut rest).split_at_mut(count);
            rest = tail;
            plane
        })
    };
    for (element, bytes) in raw.chunks_exact(W).enumerate() {
        let bytes: &[u8; W] = bytes.try_into().expect("chunks of W");
        for (plane, &byte) in planes.iter_mut().zip(bytes) {
            plane[element] = byte;
        }
    }
}

/// The inverse of [`shuffle`]: `out[i * width + b] = shuffled[b * n + i]`.
pub fn unshuffle(shuffled: &[u8], width: usize, out: &mut [u8]) {
    assert_eq!(shuffled.len(), out.len());
    assert!(width > 0 && shuffled.len() % width == 0);
    // The element widths of the format get a loop the compiler can unroll and keep free of bounds
    // checks; it runs several times faster than the generic one.
    match width {
        2 => unshuffle_width::<2>(shuffled, out),
        4 => unshuffle_width::<4>(shuffled, out),
        8 => unshuffle_width::<8>(shuffled, out),
        _ => {
            let count = shuffled.len() / width;
            for (element, bytes) in out.chunks_exact_mut(width).enumerate() {
                for (byte_index, byte) in bytes.iter_mut().enumerate() {
                    *byte = shuffled[byte_index * count + element];
                }
            }
        }
    }
}

fn unshuffle_width<const W: usize>(shuffled: &[u8], out: &mut [u8]) {
    let count = shuffled.len() / W;
    let planes: [&[u8]; W] = std::array::from_fn(|b| &shuffled[b * count..(b + 1) * count]);
    for (element, bytes) in out.chunks_exact_mut(W).enumerate() {
        let bytes: &mut [u8; W] = bytes.try_into().expect("chunks of W");
        for (byte, plane) in bytes.iter_mut().zip(&planes) {
            *byte = plane[element];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at() -> BlockRef {
        BlockRef {
            shard: "s.gfs".into(),
            field: "f".into(),
            block: 3,
            stored_offset: 4096,
        }
    }

    fn lz4_entry(stored: &[u8], raw_bytes: u32, filter: Filter) -> BlockEntry {
        BlockEntry {
            stored_offset: 4096,
            stored_bytes: stored.len() as u32,
            raw_bytes,
            codec: Codec::Lz4,
            filter,
            field: 0,
            raw_offset: 0,
            first_sample: 0,
            checksum: checksum(stored),
        }
    }

    #[test]
    fn shuffle_round_trips() {
        let raw: Vec<u8> = (0..96u8).collect();
        for width in [1, 2, 4, 8] {
            let mut shuffled = vec![0; raw.len()];
            shuffle(&raw, width, &mut shuffled);
            let mut back = vec![0; raw.len()];
            unshuffle(&shuffled, width, &mut back);
            assert_eq!(back, raw);
        }
        let mut shuffled = vec![0; 4];
        shuffle(&[1, 2, 3, 4], 2, &mut shuffled);
        assert_eq!(shuffled, [1, 3, 2, 4]);
    }

    #[test]
    fn decodes_shuffled_lz4() {
        let raw: Vec<u8> = (0..4096u32).flat_map(|v| (v / 7).to_le_bytes()).collect();
        let mut shuffled = vec![0; raw.len()];
        shuffle(&raw, 4, &mut shuffled);
        let stored = lz4_flex::block::compress(&shuffled);
        let entry = lz4_entry(&stored, raw.len() as u32, Filter::ByteShuffle);
        let mut out = vec![0; raw.len()];
        decode_block(&stored, &entry, 4, &mut Vec::new(), &mut out, at).unwrap();
        assert_eq!(out, raw);
    }

    #[test]
    fn wrong_raw_length_is_an_error_naming_the_block() {
        let raw = vec![5u8; 1000];
        let stored = lz4_flex::block::compress(&raw);
        // The table claims more bytes than the block holds: the decoder must stop, not read on.
        let entry = lz4_entry(&stored, 1200, Filter::None);
        let mut out = vec![0; 1200];
        let err = decode_block(&stored, &entry, 1, &mut Vec::new(), &mut out, at).unwrap_err();
        assert!(err.to_string().contains("field 'f', block 3"), "{err}");
        // And fewer: the decoder must not write past the output.
        let entry = lz4_entry(&stored, 800, Filter::None);
        let mut out = vec![0; 800];
        assert!(decode_block(&stored, &entry, 1, &mut Vec::new(), &mut out, at).is_err());
    }

    #[test]
    fn checksum_mismatch_is_reported_before_decoding() {
        let stored = lz4_flex::block::compress(&[9u8; 512]);
        let mut entry = lz4_entry(&stored, 512, Filter::None);
        entry.checksum ^= 1;
        let mut out = vec![0; 512];
        let err = decode_block(&stored, &entry, 1, &mut Vec::new(), &mut out, at).unwrap_err();
        assert!(matches!(err, BlockError::Checksum { .. }), "{err}");
    }
}
