//! The on-disk dataset format, versions 1 and 2 (specified byte by byte in `docs/FORMAT.md`).
//!
//! A dataset is a directory holding `manifest.json` and shard files. This module parses and validates
//! both, and encodes them for the packer. It reads metadata only (through memmap2); payload bytes are
//! read by the storage engines and by the offline tools.
//!
//! *Invariant*: this module knows nothing of CUDA, tokio or the wire protocol. Everything it returns has
//! been validated: a caller may index blocks, fields and shards by what the tables say without further
//! bounds checks.

mod dataset;
mod error;
mod manifest;
mod offsets;
mod regular;
mod shard;

pub use dataset::{Dataset, DiskChange, FileIdentity, Shard, VerifiedBlocks};
pub use error::FormatError;
pub use manifest::{
    validate_dataset_name, Manifest, ManifestField, ManifestShard, MANIFEST_FILE_NAME,
};
pub use offsets::{check_offsets, check_values_blocks, values_first_sample};
pub use regular::open_regular;
pub use shard::{
    encode_shard_metadata, parse_shard_header, parse_shard_metadata, payload_offset, BlockEntry,
    Codec, Field, Filter, ShardHeader, ShardMetadata, BLOCK_ENTRY_BYTES, FIELD_ENTRY_BYTES,
    HEADER_BYTES,
};

/// The format version of datasets whose fields all have a fixed per-sample shape.
pub const FORMAT_VERSION: u32 = 1;
/// The format version of datasets with a variable-length field; this build reads and writes both.
pub const FORMAT_VERSION_VARIABLE: u32 = 2;
/// Bytes of one entry of a variable-length field's offsets (a u64: the end of a sample's values).
pub const OFFSET_BYTES: u64 = 8;

/// Alignment of every block payload, of the first payload and of the shard file's length, in bytes.
///
/// 4096 is the logical block size that O_DIRECT and cuFile require of file offsets and lengths on the
/// file systems gpufeed targets.
pub const PAYLOAD_ALIGN_BYTES: u64 = 4096;

/// Smallest permitted `block_bytes`.
pub const BLOCK_BYTES_MIN: u32 = 4096;
/// Largest permitted `block_bytes` (16 MiB): lengths are stored as u32 and a GPU decoder stages one
/// block per warp.
pub const BLOCK_BYTES_MAX: u32 = 16 << 20;
/// Default `block_bytes` (64 KiB): the LZ4 window, and large enough that per-block overhead vanishes.
pub const BLOCK_BYTES_DEFAULT: u32 = 64 << 10;

/// Most fields a dataset may have.
pub const FIELDS_MAX: usize = 256;
/// Most dimensions of a per-sample shape.
pub const SAMPLE_NDIM_MAX: usize = 6;
/// Longest field name in bytes (UTF-8). The name is stored zero-padded in 64 bytes.
pub const FIELD_NAME_BYTES_MAX: usize = 63;
/// Most blocks one shard may hold (keeps the block table under 256 MiB).
pub const SHARD_BLOCKS_MAX: u32 = 4 << 20;
/// Largest manifest accepted, in bytes.
pub const MANIFEST_BYTES_MAX: u64 = 64 << 20;

/// Rounds `value` up to the next multiple of [`PAYLOAD_ALIGN_BYTES`].
pub const fn align_up(value: u64) -> u64 {
    value.div_ceil(PAYLOAD_ALIGN_BYTES) * PAYLOAD_ALIGN_BYTES
}

/// The xxh3-64 checksum used for headers, tables and block payloads (seed 0).
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Checks a field name: 1 to 63 bytes of ASCII letters, digits, `_`, `-` and `.`.
///
/// The character set is narrow so that names are safe in file names, URLs, JSON and Prometheus labels.
pub fn validate_field_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > FIELD_NAME_BYTES_MAX {
        return Err(format!(
            "field name {name:?} must be 1 to {FIELD_NAME_BYTES_MAX} bytes long"
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(format!(
            "field name {name:?} may only hold ASCII letters, digits, '_', '-' and '.'"
        ));
    }
    Ok(())
}
