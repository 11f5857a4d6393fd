//! Fuzzes the shard header / field table / block table parser.
//!
//! Input layout: `flags: u8`, then
//! - flags bit 0 set: `file_bytes: u64 LE`, then the shard bytes (lets a small input stand for the
//!   metadata prefix of a large shard, as the daemon maps only `payload_offset` bytes);
//!   clear: the shard bytes, with `file_bytes = bytes.len()`.
//! - flags bit 1 set: the header checksum and the table checksum are recomputed before parsing, so
//!   that mutations reach the validation behind the checksums instead of stopping at them.
//!
//! On success the parsed metadata must satisfy every invariant `format` promises its callers, and
//! re-encoding it must reproduce the metadata bytes exactly.
#![no_main]

use std::path::Path;

use gpufeed::format::{
    self, checksum, encode_shard_metadata, parse_shard_metadata, validate_field_name, Codec,
    Filter, ShardMetadata, BLOCK_BYTES_MAX, BLOCK_BYTES_MIN, BLOCK_ENTRY_BYTES, FIELDS_MAX,
    FIELD_ENTRY_BYTES, HEADER_BYTES, PAYLOAD_ALIGN_BYTES, SAMPLE_NDIM_MAX,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let (file_bytes, bytes) = if flags & 1 != 0 {
        if rest.len() < 8 {
            return;
        }
        let (len, bytes) = rest.split_at(8);
        (u64::from_le_bytes(len.try_into().unwrap()), bytes)
    } else {
        (rest.len() as u64, rest)
    };
    let mut owned;
    let bytes = if flags & 2 != 0 {
        owned = bytes.to_vec();
        fix_checksums(&mut owned);
        &owned[..]
    } else {
        bytes
    };
    if let Ok(metadata) = parse_shard_metadata(Path::new("fuzz.gfs"), bytes, file_bytes) {
        check_invariants(&metadata, bytes, file_bytes);
    }
});

/// Rewrites the header checksum and, where the header's counts place it inside `bytes`, the table
/// checksum.
fn fix_checksums(bytes: &mut [u8]) {
    if bytes.len() < HEADER_BYTES {
        return;
    }
    let header_checksum = checksum(&bytes[..56]);
    bytes[56..64].copy_from_slice(&header_checksum.to_le_bytes());
    let field_count = u32::from_le_bytes(bytes[32..36].try_into().unwrap()) as u64;
    let block_count = u32::from_le_bytes(bytes[36..40].try_into().unwrap()) as u64;
    let blocks_end = HEADER_BYTES as u64
        + field_count * FIELD_ENTRY_BYTES as u64
        + block_count * BLOCK_ENTRY_BYTES as u64;
    if blocks_end + 8 <= bytes.len() as u64 {
        let at = blocks_end as usize;
        let table_checksum = checksum(&bytes[HEADER_BYTES..at]);
        bytes[at..at + 8].copy_from_slice(&table_checksum.to_le_bytes());
    }
}

fn check_invariants(m: &ShardMetadata, bytes: &[u8], file_bytes: u64) {
    let h = &m.header;
    assert_eq!(h.field_count as usize, m.fields.len());
    assert_eq!(h.block_count as usize, m.blocks.len());
    assert!(!m.fields.is_empty() && m.fields.len() <= FIELDS_MAX);
    assert!(h.block_bytes.is_power_of_two());
    assert!((BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&h.block_bytes));
    assert!(h.sample_count > 0);
    assert!(h.first_sample.checked_add(h.sample_count).is_some());
    assert_eq!(
        h.payload_offset,
        format::payload_offset(m.fields.len(), m.blocks.len())
    );
    assert!(h.payload_offset <= bytes.len() as u64);
    assert!(h.payload_offset <= file_bytes);
    assert_eq!(
        file_bytes % PAYLOAD_ALIGN_BYTES,
        0,
        "file length not 4096-aligned"
    );
    assert_eq!(m.file_bytes(), file_bytes);

    let mut next_block = 0usize;
    let mut previous_end = h.payload_offset;
    for (index, field) in m.fields.iter().enumerate() {
        validate_field_name(&field.name).expect("parsed field name is valid");
        assert!(m.fields[..index].iter().all(|f| f.name != field.name));
        assert!(field.shape.len() <= SAMPLE_NDIM_MAX);
        assert_eq!(
            field.first_block as usize, next_block,
            "field blocks not contiguous"
        );
        assert!(field.block_count > 0);
        next_block = next_block
            .checked_add(field.block_count as usize)
            .expect("block range overflows");
        assert!(next_block <= m.blocks.len());
        let element = field.dtype.size_bytes() as u64;
        let sample_bytes = field
            .shape
            .iter()
            .try_fold(element, |acc, &d| acc.checked_mul(d))
            .expect("sample bytes overflow");
        assert!(sample_bytes > 0);
        assert_eq!(sample_bytes, field.sample_bytes());
        let field_bytes = sample_bytes
            .checked_mul(h.sample_count)
            .expect("field bytes overflow");

        let blocks = m.field_blocks(index);
        assert_eq!(blocks.len(), field.block_count as usize);
        let mut raw_offset = 0u64;
        for block in blocks {
            assert_eq!(block.field as usize, index);
            assert!(block.raw_bytes > 0 && block.raw_bytes <= h.block_bytes);
            assert!(block.stored_bytes > 0);
            assert_eq!(block.raw_bytes as u64 % element, 0);
            if block.codec == Codec::Raw {
                assert_eq!(block.stored_bytes, block.raw_bytes);
                assert_eq!(block.filter, Filter::None);
            }
            assert_eq!(block.raw_offset, raw_offset, "raw offsets not contiguous");
            raw_offset += block.raw_bytes as u64;
            assert!(raw_offset <= field_bytes);
            assert_eq!(
                block.first_sample,
                h.first_sample + block.raw_offset / sample_bytes
            );
            assert_eq!(block.stored_offset % PAYLOAD_ALIGN_BYTES, 0);
            assert!(
                block.stored_offset >= previous_end,
                "payloads overlap or go backwards"
            );
            let end = block
                .stored_offset
                .checked_add(block.stored_bytes as u64)
                .expect("stored extent overflows u64");
            assert!(end <= file_bytes, "stored extent past the end of the file");
            previous_end = end;
        }
        assert_eq!(raw_offset, field_bytes, "blocks do not cover the field");
    }
    assert_eq!(next_block, m.blocks.len());

    // The format has no slack: every reserved byte and the padding must be zero, so re-encoding what
    // was parsed reproduces the metadata byte for byte.
    let encoded = encode_shard_metadata(
        h.first_sample,
        h.sample_count,
        h.block_bytes,
        &m.fields,
        &m.blocks,
    );
    assert_eq!(encoded.len() as u64, h.payload_offset);
    assert!(
        encoded[..] == bytes[..encoded.len()],
        "re-encoding differs from the input"
    );
    let at = HEADER_BYTES + m.fields.len() * FIELD_ENTRY_BYTES + m.blocks.len() * BLOCK_ENTRY_BYTES;
    assert_eq!(
        u64::from_le_bytes(encoded[at..at + 8].try_into().unwrap()),
        m.table_checksum
    );
}
