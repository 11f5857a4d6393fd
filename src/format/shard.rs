//! The shard header, field table and block table: encoding and validated parsing.
//!
//! Layout (all integers little-endian; see `docs/FORMAT.md` for the drawing):
//! header (64 bytes) | field table (128 bytes a field) | block table (64 bytes a block) |
//! table checksum (8 bytes) | zero padding to 4096 | block payloads, each at a 4096-aligned offset.

use std::path::Path;

use gpufeed_proto::DType;

use super::{
    align_up, checksum, validate_field_name, FormatError, BLOCK_BYTES_MAX, BLOCK_BYTES_MIN,
    FIELDS_MAX, FIELD_NAME_BYTES_MAX, FORMAT_VERSION, FORMAT_VERSION_VARIABLE, OFFSET_BYTES,
    PAYLOAD_ALIGN_BYTES, SAMPLE_NDIM_MAX, SHARD_BLOCKS_MAX,
};

/// Size of the fixed shard header in bytes.
pub const HEADER_BYTES: usize = 64;
/// Size of one field table entry in bytes.
pub const FIELD_ENTRY_BYTES: usize = 128;
/// Size of one block table entry in bytes.
pub const BLOCK_ENTRY_BYTES: usize = 64;
/// The eight magic bytes every shard starts with.
pub const MAGIC: [u8; 8] = *b"GFEDSHRD";
/// The checksum algorithm code for xxh3-64 (the only one in version 1).
pub const CHECKSUM_XXH3_64: u32 = 1;

/// How a block's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    /// The payload is the raw bytes; nothing to decode.
    Raw,
    /// The payload is one LZ4 block (the standard block format, no frame, no size prefix).
    Lz4,
}

impl Codec {
    /// The code stored in the block table.
    pub const fn code(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Lz4 => 1,
        }
    }

    /// The codec with the given table code.
    pub fn from_code(code: u8) -> Option<Codec> {
        match code {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Lz4),
            _ => None,
        }
    }

    /// Lowercase name used in JSON summaries.
    pub const fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Lz4 => "lz4",
        }
    }
}

/// The reversible filter applied to a block's raw bytes before compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Filter {
    /// No filter.
    None,
    /// Byte shuffle of the field's element width: all first bytes of the elements, then all second
    /// bytes, and so on. It groups the slowly varying high bytes, which LZ4 then finds repeats in.
    ByteShuffle,
}

impl Filter {
    /// The code stored in the block table.
    pub const fn code(self) -> u8 {
        match self {
            Filter::None => 0,
            Filter::ByteShuffle => 1,
        }
    }

    /// The filter with the given table code.
    pub fn from_code(code: u8) -> Option<Filter> {
        match code {
            0 => Some(Filter::None),
            1 => Some(Filter::ByteShuffle),
            _ => None,
        }
    }
}

/// The fixed header of a shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardHeader {
    /// The format version the shard was written in: 1, or 2 when a field is variable-length.
    pub version: u32,
    /// Global index of the shard's first sample within the dataset.
    pub first_sample: u64,
    /// Number of samples in this shard.
    pub sample_count: u64,
    /// Number of field table entries.
    pub field_count: u32,
    /// Number of block table entries.
    pub block_count: u32,
    /// The dataset's block size: no block holds more raw bytes than this.
    pub block_bytes: u32,
    /// Offset of the first payload byte (the end of the metadata, rounded up to 4096).
    pub payload_offset: u64,
}

/// One field as described by a shard's field table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    /// The field's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Per-sample shape (empty for a scalar per sample).
    pub shape: Vec<u64>,
    /// Index of the field's first entry in the block table.
    pub first_block: u32,
    /// Number of consecutive block table entries belonging to this field.
    pub block_count: u32,
    /// `None` for a fixed-shape field; for a variable-length field (format version 2), the number
    /// of its first blocks that hold its offsets (the rest hold its values).
    pub offset_blocks: Option<u32>,
}

impl Field {
    /// Bytes of one sample of a fixed-shape field; of one element (one row of `shape`) of a
    /// variable-length field.
    pub fn sample_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size_bytes() as u64
    }

    /// Whether the field's samples vary in length (format version 2).
    pub fn is_variable(&self) -> bool {
        self.offset_blocks.is_some()
    }
}

/// One entry of the block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEntry {
    /// File offset of the stored payload; a multiple of 4096.
    pub stored_offset: u64,
    /// Length of the stored payload in bytes.
    pub stored_bytes: u32,
    /// Length of the block once decoded, in bytes.
    pub raw_bytes: u32,
    /// How the payload is stored.
    pub codec: Codec,
    /// The filter to undo after decompression.
    pub filter: Filter,
    /// Index of the field this block belongs to.
    pub field: u16,
    /// Offset of the block's first raw byte within the field's bytes in this shard.
    pub raw_offset: u64,
    /// Global index of the sample holding the block's first raw byte.
    pub first_sample: u64,
    /// xxh3-64 of the stored payload bytes.
    pub checksum: u64,
}

/// The validated metadata of one shard: header, fields and blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMetadata {
    /// The fixed header.
    pub header: ShardHeader,
    /// The field table.
    pub fields: Vec<Field>,
    /// The block table, fields in order and each field's blocks in raw-offset order.
    pub blocks: Vec<BlockEntry>,
    /// The checksum stored after the tables (also recorded in the manifest).
    pub table_checksum: u64,
}

impl ShardMetadata {
    /// Length the shard file must have: the end of the last payload rounded up to 4096.
    pub fn file_bytes(&self) -> u64 {
        let payload_end = self
            .blocks
            .iter()
            .map(|b| b.stored_offset + b.stored_bytes as u64)
            .max()
            .unwrap_or(self.header.payload_offset);
        align_up(payload_end.max(self.header.payload_offset))
    }

    /// The blocks of field `field_index` (of a variable-length field: its offsets' blocks, then
    /// its values').
    pub fn field_blocks(&self, field_index: usize) -> &[BlockEntry] {
        let field = &self.fields[field_index];
        let start = field.first_block as usize;
        &self.blocks[start..start + field.block_count as usize]
    }

    /// Bytes of the offsets region at the start of a variable-length field's byte stream
    /// ([`OFFSET_BYTES`] a sample); 0 for a fixed-shape field.
    pub fn offsets_bytes(&self, field_index: usize) -> u64 {
        if self.fields[field_index].is_variable() {
            self.header.sample_count * OFFSET_BYTES
        } else {
            0
        }
    }

    /// Bytes of field `field_index`'s byte stream in this shard (of a variable-length field: its
    /// offsets region and its values region).
    pub fn field_stream_bytes(&self, field_index: usize) -> u64 {
        self.field_blocks(field_index)
            .last()
            .map_or(0, |b| b.raw_offset + u64::from(b.raw_bytes))
    }
}

/// Largest stored size of an LZ4 block holding `raw_bytes` bytes: LZ4's worst case for incompressible
/// input (`raw + raw / 255 + 16`). Larger claims are rejected so a reader never sizes a buffer from an
/// unbounded table value.
pub const fn lz4_stored_bytes_max(raw_bytes: u32) -> u32 {
    raw_bytes + raw_bytes / 255 + 16
}

/// Offset of the first payload in a shard with this many fields and blocks.
pub fn payload_offset(field_count: usize, block_count: usize) -> u64 {
    align_up(
        (HEADER_BYTES + field_count * FIELD_ENTRY_BYTES + block_count * BLOCK_ENTRY_BYTES + 8)
            as u64,
    )
}

/// Encodes header, field table, block table and table checksum, zero-padded to the payload offset.
///
/// The caller guarantees the metadata is valid (the packer builds it); this is asserted where cheap.
pub fn encode_shard_metadata(
    first_sample: u64,
    sample_count: u64,
    block_bytes: u32,
    fields: &[Field],
    blocks: &[BlockEntry],
) -> Vec<u8> {
    assert!(!fields.is_empty() && fields.len() <= FIELDS_MAX);
    assert!(blocks.len() <= SHARD_BLOCKS_MAX as usize);
    let payload_offset = payload_offset(fields.len(), blocks.len());
    let mut out = Vec::with_capacity(payload_offset as usize);
    // Only a shard with a variable-length field is written as version 2, so that readers of
    // version 1 keep reading every other dataset.
    let version = if fields.iter().any(Field::is_variable) {
        FORMAT_VERSION_VARIABLE
    } else {
        FORMAT_VERSION
    };

    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
    out.extend_from_slice(&first_sample.to_le_bytes());
    out.extend_from_slice(&sample_count.to_le_bytes());
    out.extend_from_slice(&(fields.len() as u32).to_le_bytes());
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    out.extend_from_slice(&block_bytes.to_le_bytes());
    out.extend_from_slice(&CHECKSUM_XXH3_64.to_le_bytes());
    out.extend_from_slice(&payload_offset.to_le_bytes());
    let header_checksum = checksum(&out[..56]);
    out.extend_from_slice(&header_checksum.to_le_bytes());
    debug_assert_eq!(out.len(), HEADER_BYTES);

    for field in fields {
        assert!(field.name.len() <= FIELD_NAME_BYTES_MAX && field.shape.len() <= SAMPLE_NDIM_MAX);
        let mut name = [0u8; 64];
        name[..field.name.len()].copy_from_slice(field.name.as_bytes());
        out.extend_from_slice(&name);
        out.push(field.dtype.code());
        out.push(field.shape.len() as u8);
        out.push(u8::from(field.is_variable()));
        out.push(0);
        out.extend_from_slice(&field.offset_blocks.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&field.first_block.to_le_bytes());
        out.extend_from_slice(&field.block_count.to_le_bytes());
        for dim in 0..SAMPLE_NDIM_MAX {
            out.extend_from_slice(&field.shape.get(dim).copied().unwrap_or(0).to_le_bytes());
        }
    }
    for block in blocks {
        out.extend_from_slice(&block.stored_offset.to_le_bytes());
        out.extend_from_slice(&block.stored_bytes.to_le_bytes());
        out.extend_from_slice(&block.raw_bytes.to_le_bytes());
        out.push(block.codec.code());
        out.push(block.filter.code());
        out.extend_from_slice(&block.field.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        out.extend_from_slice(&block.raw_offset.to_le_bytes());
        out.extend_from_slice(&block.first_sample.to_le_bytes());
        out.extend_from_slice(&block.checksum.to_le_bytes());
        out.extend_from_slice(&[0u8; 16]);
    }
    let table_checksum = checksum(&out[HEADER_BYTES..]);
    out.extend_from_slice(&table_checksum.to_le_bytes());
    out.resize(payload_offset as usize, 0);
    out
}

/// Reads little-endian integers at fixed offsets of a slice whose length the caller has checked.
struct Le<'a>(&'a [u8]);

impl Le<'_> {
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes(
            self.0[at..at + 2]
                .try_into()
                .expect("length checked by caller"),
        )
    }
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(
            self.0[at..at + 4]
                .try_into()
                .expect("length checked by caller"),
        )
    }
    fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(
            self.0[at..at + 8]
                .try_into()
                .expect("length checked by caller"),
        )
    }
}

/// Parses and validates a shard's header only, from at least [`HEADER_BYTES`] bytes.
///
/// Checks, in this order: magic, version, header checksum, then the header's own rules. The version is
/// read before the checksum so that a shard from a newer gpufeed is reported as such rather than as
/// corrupt.
pub fn parse_shard_header(path: &Path, bytes: &[u8]) -> Result<ShardHeader, FormatError> {
    let invalid = |what: String| FormatError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    if bytes.len() < HEADER_BYTES {
        return Err(FormatError::Length {
            path: path.to_path_buf(),
            expected_bytes: HEADER_BYTES as u64,
            actual_bytes: bytes.len() as u64,
        });
    }
    let le = Le(&bytes[..HEADER_BYTES]);
    let magic: [u8; 8] = bytes[..8].try_into().expect("length checked");
    if magic != MAGIC {
        return Err(FormatError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
        });
    }
    let version = le.u32(8);
    if version != FORMAT_VERSION && version != FORMAT_VERSION_VARIABLE {
        return Err(FormatError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            supported: FORMAT_VERSION_VARIABLE,
        });
    }
    let stored = le.u64(56);
    let computed = checksum(&bytes[..56]);
    if stored != computed {
        return Err(FormatError::HeaderChecksum {
            path: path.to_path_buf(),
            stored,
            computed,
        });
    }
    let header_bytes = le.u32(12);
    if header_bytes as usize != HEADER_BYTES {
        return Err(invalid(format!(
            "header: header_bytes is {header_bytes}, version {version} requires {HEADER_BYTES}"
        )));
    }
    let header = ShardHeader {
        version,
        first_sample: le.u64(16),
        sample_count: le.u64(24),
        field_count: le.u32(32),
        block_count: le.u32(36),
        block_bytes: le.u32(40),
        payload_offset: le.u64(48),
    };
    let checksum_kind = le.u32(44);
    if checksum_kind != CHECKSUM_XXH3_64 {
        return Err(invalid(format!(
            "header: checksum algorithm {checksum_kind} is unknown (versions 1 and 2 use 1 = xxh3-64)"
        )));
    }
    if header.field_count == 0 || header.field_count as usize > FIELDS_MAX {
        return Err(invalid(format!(
            "header: field_count {} is outside 1..={FIELDS_MAX}",
            header.field_count
        )));
    }
    if header.block_count > SHARD_BLOCKS_MAX {
        return Err(invalid(format!(
            "header: block_count {} exceeds {SHARD_BLOCKS_MAX}",
            header.block_count
        )));
    }
    if !header.block_bytes.is_power_of_two()
        || !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&header.block_bytes)
    {
        return Err(invalid(format!(
            "header: block_bytes {} is not a power of two in {BLOCK_BYTES_MIN}..={BLOCK_BYTES_MAX}",
            header.block_bytes
        )));
    }
    let expected_payload_offset =
        payload_offset(header.field_count as usize, header.block_count as usize);
    if header.payload_offset != expected_payload_offset {
        return Err(invalid(format!(
            "header: payload_offset {} should be {expected_payload_offset} for {} fields and {} blocks",
            header.payload_offset, header.field_count, header.block_count
        )));
    }
    if header.sample_count == 0 {
        return Err(invalid("header: sample_count is 0".to_string()));
    }
    if header
        .first_sample
        .checked_add(header.sample_count)
        .is_none()
    {
        return Err(invalid(
            "header: first_sample + sample_count overflows".to_string(),
        ));
    }
    Ok(header)
}

/// Parses and validates the complete metadata of a shard from a prefix of the file.
///
/// `bytes` must hold at least the header and tables (the caller maps `payload_offset` bytes, or the
/// whole file); `file_bytes` is the file's length on disk, against which payload extents are checked.
pub fn parse_shard_metadata(
    path: &Path,
    bytes: &[u8],
    file_bytes: u64,
) -> Result<ShardMetadata, FormatError> {
    let header = parse_shard_header(path, bytes)?;
    let invalid = |what: String| FormatError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    // A shard's length is a multiple of 4096 by construction; checking it first also keeps every
    // rounding below (payload ends rounded up to 4096) from overflowing.
    if file_bytes % PAYLOAD_ALIGN_BYTES != 0 {
        return Err(FormatError::Length {
            path: path.to_path_buf(),
            expected_bytes: align_up(file_bytes.min(u64::MAX - PAYLOAD_ALIGN_BYTES)),
            actual_bytes: file_bytes,
        });
    }
    let fields_end = HEADER_BYTES + header.field_count as usize * FIELD_ENTRY_BYTES;
    let blocks_end = fields_end + header.block_count as usize * BLOCK_ENTRY_BYTES;
    let tables_end = blocks_end + 8;
    if (bytes.len() as u64) < header.payload_offset || file_bytes < header.payload_offset {
        return Err(FormatError::Length {
            path: path.to_path_buf(),
            expected_bytes: header.payload_offset,
            actual_bytes: file_bytes.min(bytes.len() as u64),
        });
    }
    let stored = Le(bytes).u64(blocks_end);
    let computed = checksum(&bytes[HEADER_BYTES..blocks_end]);
    if stored != computed {
        return Err(FormatError::TableChecksum {
            path: path.to_path_buf(),
            stored,
            computed,
        });
    }
    if bytes[tables_end..header.payload_offset as usize]
        .iter()
        .any(|&b| b != 0)
    {
        return Err(invalid(
            "the padding between the tables and the first payload is not zero".to_string(),
        ));
    }

    let fields = parse_fields(path, bytes, &header)?;
    let blocks = parse_blocks(path, bytes, &header, &fields, file_bytes)?;
    let metadata = ShardMetadata {
        header,
        fields,
        blocks,
        table_checksum: stored,
    };
    if metadata.file_bytes() != file_bytes {
        return Err(FormatError::Length {
            path: path.to_path_buf(),
            expected_bytes: metadata.file_bytes(),
            actual_bytes: file_bytes,
        });
    }
    Ok(metadata)
}

/// The field table of a shard whose header is `header` (its checksum already checked).
fn parse_fields(
    path: &Path,
    bytes: &[u8],
    header: &ShardHeader,
) -> Result<Vec<Field>, FormatError> {
    let invalid = |what: String| FormatError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    let mut fields = Vec::with_capacity(header.field_count as usize);
    let mut next_block = 0u32;
    for index in 0..header.field_count as usize {
        let at = HEADER_BYTES + index * FIELD_ENTRY_BYTES;
        let entry = &bytes[at..at + FIELD_ENTRY_BYTES];
        let le = Le(entry);
        let name_len = entry[..64].iter().position(|&b| b == 0).unwrap_or(64);
        let name = std::str::from_utf8(&entry[..name_len])
            .map_err(|_| invalid(format!("field entry {index}: name is not UTF-8")))?
            .to_string();
        validate_field_name(&name).map_err(|e| invalid(format!("field entry {index}: {e}")))?;
        if entry[name_len..64].iter().any(|&b| b != 0) || entry[67] != 0 {
            return Err(invalid(format!(
                "field entry {index} ('{name}'): reserved bytes are not zero"
            )));
        }
        let variable = match (entry[66], header.version) {
            (0, _) => false,
            (1, FORMAT_VERSION_VARIABLE) => true,
            (kind, version) => {
                return Err(invalid(format!(
                    "field entry {index} ('{name}'): length kind {kind} is not valid in format version {version} (0 fixed; 1 variable, from version 2)"
                )))
            }
        };
        let offset_block_count = le.u32(68);
        if !variable && offset_block_count != 0 {
            return Err(invalid(format!(
                "field entry {index} ('{name}'): a fixed-shape field has offset_block_count {offset_block_count}, not 0"
            )));
        }
        let dtype = DType::from_code(entry[64])
            .map_err(|e| invalid(format!("field entry {index} ('{name}'): {e}")))?;
        let ndim = entry[65] as usize;
        if ndim > SAMPLE_NDIM_MAX {
            return Err(invalid(format!(
                "field entry {index} ('{name}'): ndim {ndim} exceeds {SAMPLE_NDIM_MAX}"
            )));
        }
        let dims: Vec<u64> = (0..SAMPLE_NDIM_MAX).map(|d| le.u64(80 + d * 8)).collect();
        if dims[ndim..].iter().any(|&d| d != 0) {
            return Err(invalid(format!(
                "field entry {index} ('{name}'): unused shape slots are not zero"
            )));
        }
        let shape = dims[..ndim].to_vec();
        let sample_bytes = shape
            .iter()
            .try_fold(dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                invalid(format!(
                    "field entry {index} ('{name}'): shape {shape:?} gives an empty or overflowing sample"
                ))
            })?;
        // A variable-length field's table says how many bytes its offsets take (8 a sample); its
        // values' length is only known from its blocks.
        let per_sample = if variable { OFFSET_BYTES } else { sample_bytes };
        let field_bytes = per_sample.checked_mul(header.sample_count).ok_or_else(|| {
            invalid(format!(
                "field entry {index} ('{name}'): sample_bytes x sample_count overflows"
            ))
        })?;
        let first_block = le.u32(72);
        let block_count = le.u32(76);
        if first_block != next_block
            || first_block
                .checked_add(block_count)
                .is_none_or(|end| end > header.block_count)
        {
            return Err(invalid(format!(
                "field entry {index} ('{name}'): blocks {first_block}..+{block_count} do not follow the previous field's within {} blocks",
                header.block_count
            )));
        }
        next_block = first_block + block_count;
        let table_blocks = if variable {
            offset_block_count
        } else {
            block_count
        };
        if table_blocks == 0
            || table_blocks > block_count
            || field_bytes.div_ceil(header.block_bytes as u64) > table_blocks as u64
        {
            return Err(invalid(format!(
                "field entry {index} ('{name}'): {table_blocks} blocks of at most {} bytes cannot hold {field_bytes} bytes{}",
                header.block_bytes,
                if variable { " of offsets" } else { "" }
            )));
        }
        if fields.iter().any(|f: &Field| f.name == name) {
            return Err(invalid(format!(
                "field entry {index}: duplicate field name '{name}'"
            )));
        }
        fields.push(Field {
            name,
            dtype,
            shape,
            first_block,
            block_count,
            offset_blocks: variable.then_some(offset_block_count),
        });
    }
    if next_block != header.block_count {
        return Err(invalid(format!(
            "the fields cover {next_block} blocks but the header says {}",
            header.block_count
        )));
    }
    // Version 2 is written only for a shard with a variable-length field (see
    // `encode_shard_metadata`): one without is version 1, byte for byte.
    if header.version == FORMAT_VERSION_VARIABLE && !fields.iter().any(Field::is_variable) {
        return Err(invalid(format!(
            "header: format version {FORMAT_VERSION_VARIABLE} but no field is variable-length              (such a shard is version {FORMAT_VERSION})"
        )));
    }

    Ok(fields)
}

/// Where block `block_in_field` of a variable-length field lies: whether it holds offsets (the
/// field's first `offset_blocks`, ending exactly at `offsets_bytes`) or values (from there on);
/// what is wrong if it straddles them. A fixed-shape field's blocks hold no offsets.
fn check_variable_block(
    field: &Field,
    block_in_field: u32,
    block: &BlockEntry,
    offsets_bytes: u64,
) -> Result<bool, String> {
    let Some(offset_blocks) = field.offset_blocks else {
        return Ok(false);
    };
    let end = block.raw_offset + u64::from(block.raw_bytes);
    let in_offsets = block_in_field < offset_blocks;
    let misplaced = if in_offsets {
        end > offsets_bytes || (block_in_field + 1 == offset_blocks && end != offsets_bytes)
    } else {
        block.raw_offset < offsets_bytes
    };
    if misplaced {
        return Err(format!(
            "the field's first {offset_blocks} blocks must hold exactly its {offsets_bytes} bytes of offsets"
        ));
    }
    Ok(in_offsets)
}

/// Checks that the blocks of `field` hold `raw_bytes` as its `sample_count` samples need: exactly
/// their bytes, or of a variable-length field its offsets and whole elements.
fn check_field_bytes(field: &Field, raw_bytes: u64, sample_count: u64) -> Result<(), String> {
    let sample_bytes = field.sample_bytes();
    if field.is_variable() {
        let offsets_bytes = OFFSET_BYTES * sample_count;
        if raw_bytes < offsets_bytes || (raw_bytes - offsets_bytes) % sample_bytes != 0 {
            return Err(format!(
                "field '{}': blocks hold {raw_bytes} bytes, not {offsets_bytes} bytes of offsets and whole {sample_bytes}-byte elements",
                field.name
            ));
        }
    } else if raw_bytes != sample_bytes * sample_count {
        return Err(format!(
            "field '{}': blocks hold {raw_bytes} bytes but {sample_count} samples of {sample_bytes} bytes need {}",
            field.name,
            sample_bytes * sample_count
        ));
    }
    Ok(())
}

/// The block table of a shard, field by field, with every block's extents checked against the
/// field, the payload order and the file's length.
fn parse_blocks(
    path: &Path,
    bytes: &[u8],
    header: &ShardHeader,
    fields: &[Field],
    file_bytes: u64,
) -> Result<Vec<BlockEntry>, FormatError> {
    let invalid = |what: String| FormatError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    let fields_end = HEADER_BYTES + header.field_count as usize * FIELD_ENTRY_BYTES;
    let mut blocks = Vec::with_capacity(header.block_count as usize);
    let mut previous_payload_end = header.payload_offset;
    for (field_index, field) in fields.iter().enumerate() {
        let sample_bytes = field.sample_bytes();
        // A variable-length field's stream is its offsets (8 bytes a sample), then its values,
        // whose length the blocks give.
        let (offsets_bytes, field_bytes) = match field.is_variable() {
            true => (OFFSET_BYTES * header.sample_count, u64::MAX),
            false => (0, sample_bytes * header.sample_count),
        };
        let mut raw_offset = 0u64;
        for block_in_field in 0..field.block_count {
            let index = (field.first_block + block_in_field) as usize;
            let at = fields_end + index * BLOCK_ENTRY_BYTES;
            let entry = &bytes[at..at + BLOCK_ENTRY_BYTES];
            let le = Le(entry);
            let place = format!(
                "field '{}' block {block_in_field} (table entry {index})",
                field.name
            );
            if entry[20..24].iter().any(|&b| b != 0) || entry[48..64].iter().any(|&b| b != 0) {
                return Err(invalid(format!("{place}: reserved bytes are not zero")));
            }
            let codec = Codec::from_code(entry[16])
                .ok_or_else(|| invalid(format!("{place}: unknown codec {}", entry[16])))?;
            let filter = Filter::from_code(entry[17])
                .ok_or_else(|| invalid(format!("{place}: unknown filter {}", entry[17])))?;
            let block = BlockEntry {
                stored_offset: le.u64(0),
                stored_bytes: le.u32(8),
                raw_bytes: le.u32(12),
                codec,
                filter,
                field: le.u16(18),
                raw_offset: le.u64(24),
                first_sample: le.u64(32),
                checksum: le.u64(40),
            };
            if block.field as usize != field_index {
                return Err(invalid(format!(
                    "{place}: names field {} instead of {field_index}",
                    block.field
                )));
            }
            if block.raw_bytes == 0 || block.raw_bytes > header.block_bytes {
                return Err(invalid(format!(
                    "{place}: raw_bytes {} is outside 1..={}",
                    block.raw_bytes, header.block_bytes
                )));
            }
            if block.stored_bytes == 0 {
                return Err(invalid(format!("{place}: stored_bytes is 0")));
            }
            if codec == Codec::Raw
                && (block.stored_bytes != block.raw_bytes || filter != Filter::None)
            {
                return Err(invalid(format!(
                    "{place}: a raw block must have stored_bytes == raw_bytes and no filter"
                )));
            }
            if block.raw_bytes as usize % field.dtype.size_bytes() != 0 {
                return Err(invalid(format!(
                    "{place}: raw_bytes {} is not a multiple of the {}-byte element",
                    block.raw_bytes,
                    field.dtype.size_bytes()
                )));
            }
            if block.raw_offset != raw_offset {
                return Err(invalid(format!(
                    "{place}: raw_offset is {} but the previous blocks end at {raw_offset}",
                    block.raw_offset
                )));
            }
            raw_offset = raw_offset
                .checked_add(block.raw_bytes as u64)
                .ok_or_else(|| invalid(format!("{place}: raw_offset overflows")))?;
            if raw_offset > field_bytes {
                return Err(invalid(format!(
                    "{place}: runs past the field's {field_bytes} bytes"
                )));
            }
            let in_offsets = check_variable_block(field, block_in_field, &block, offsets_bytes)
                .map_err(|what| invalid(format!("{place}: {what}")))?;
            // A values block's first sample is checked against the offsets by the reader that reads
            // them (the tables alone do not say which sample a value belongs to).
            let per_sample = if in_offsets {
                OFFSET_BYTES
            } else {
                sample_bytes
            };
            let expected_first_sample = header.first_sample + block.raw_offset / per_sample;
            if (!field.is_variable() || in_offsets) && block.first_sample != expected_first_sample {
                return Err(invalid(format!(
                    "{place}: first_sample is {} but its first byte belongs to sample {expected_first_sample}",
                    block.first_sample
                )));
            }
            if block.stored_offset % PAYLOAD_ALIGN_BYTES != 0
                || block.stored_offset < previous_payload_end
            {
                return Err(invalid(format!(
                    "{place}: stored_offset {} is not 4096-aligned at or after {previous_payload_end}",
                    block.stored_offset
                )));
            }
            if codec == Codec::Lz4 && block.stored_bytes > lz4_stored_bytes_max(block.raw_bytes) {
                return Err(invalid(format!(
                    "{place}: stored_bytes {} exceeds the LZ4 worst case {} for {} raw bytes",
                    block.stored_bytes,
                    lz4_stored_bytes_max(block.raw_bytes),
                    block.raw_bytes
                )));
            }
            let payload_end = match block.stored_offset.checked_add(block.stored_bytes as u64) {
                Some(end) if end <= file_bytes => end,
                _ => {
                    return Err(invalid(format!(
                        "{place}: payload {}..+{} lies beyond the {file_bytes}-byte file",
                        block.stored_offset, block.stored_bytes
                    )))
                }
            };
            previous_payload_end = payload_end;
            blocks.push(block);
        }
        check_field_bytes(field, raw_offset, header.sample_count).map_err(invalid)?;
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_metadata() -> (Vec<Field>, Vec<BlockEntry>) {
        let fields = vec![Field {
            name: "x".into(),
            dtype: DType::F16,
            shape: vec![2],
            first_block: 0,
            block_count: 1,
            offset_blocks: None,
        }];
        let blocks = vec![BlockEntry {
            stored_offset: 4096,
            stored_bytes: 12,
            raw_bytes: 12,
            codec: Codec::Raw,
            filter: Filter::None,
            field: 0,
            raw_offset: 0,
            first_sample: 10,
            checksum: 7,
        }];
        (fields, blocks)
    }

    #[test]
    fn encode_then_parse_round_trips() {
        let (fields, blocks) = sample_metadata();
        let mut bytes = encode_shard_metadata(10, 3, 4096, &fields, &blocks);
        assert_eq!(bytes.len(), 4096);
        bytes.resize(8192, 0);
        let parsed = parse_shard_metadata(Path::new("s"), &bytes, 8192).unwrap();
        assert_eq!(parsed.fields, fields);
        assert_eq!(parsed.blocks, blocks);
        assert_eq!(parsed.header.first_sample, 10);
        assert_eq!(parsed.file_bytes(), 8192);
    }

    /// Regression: a field entry whose `first_block + block_count` overflows u32 passed the range
    /// check (`None > Some(x)` is false) and then panicked on the addition. With consistent checksums
    /// the parser must reject it as invalid.
    #[test]
    fn overflowing_field_block_range_is_an_error_not_a_panic() {
        let (mut fields, blocks) = sample_metadata();
        let template = fields[0].clone();
        fields.push(Field {
            name: "y".into(),
            first_block: 1,
            block_count: u32::MAX,
            ..template.clone()
        });
        fields.push(Field {
            name: "z".into(),
            first_block: 0,
            block_count: 3,
            ..template
        });
        let mut bytes = encode_shard_metadata(10, 3, 4096, &fields, &blocks);
        bytes.resize(8192, 0);
        let error = parse_shard_metadata(Path::new("s"), &bytes, 8192).unwrap_err();
        assert!(error.to_string().contains("field entry 1"), "{error}");
    }

    /// Regression (found by reading the fuzz target's invariants): with a claimed file length near
    /// 2^64, a block ending there passed every extent check and rounding the file length up to 4096
    /// overflowed. Lengths that are not a multiple of 4096 are now rejected first.
    #[test]
    fn file_length_near_u64_max_is_an_error_not_a_panic() {
        let (fields, mut blocks) = sample_metadata();
        blocks[0].stored_offset = u64::MAX - 4095;
        blocks[0].stored_bytes = 12;
        let bytes = encode_shard_metadata(10, 3, 4096, &fields, &blocks);
        for file_bytes in [u64::MAX, u64::MAX - 100, u64::MAX - 4095] {
            assert!(parse_shard_metadata(Path::new("s"), &bytes, file_bytes).is_err());
        }
    }

    /// Regression (CI's fuzz smoke): a shard of fixed-shape fields whose header said version 2
    /// parsed, and re-encoding it wrote version 1 (only a shard with a variable-length field is
    /// version 2), so the metadata did not round-trip. Such a header is now rejected.
    #[test]
    fn version_2_without_a_variable_length_field_is_rejected() {
        let (fields, blocks) = sample_metadata();
        let mut bytes = encode_shard_metadata(10, 3, 4096, &fields, &blocks);
        bytes.resize(8192, 0);
        bytes[8..12].copy_from_slice(&FORMAT_VERSION_VARIABLE.to_le_bytes());
        let header_checksum = checksum(&bytes[..56]);
        bytes[56..64].copy_from_slice(&header_checksum.to_le_bytes());
        let error = parse_shard_metadata(Path::new("s"), &bytes, 8192).unwrap_err();
        assert!(
            error.to_string().contains("no field is variable-length"),
            "{error}"
        );
    }

    #[test]
    fn every_header_bit_flip_is_detected() {
        let (fields, blocks) = sample_metadata();
        let mut bytes = encode_shard_metadata(10, 3, 4096, &fields, &blocks);
        bytes.resize(8192, 0);
        for bit in 0..(HEADER_BYTES * 8) {
            let mut corrupt = bytes.clone();
            corrupt[bit / 8] ^= 1 << (bit % 8);
            assert!(parse_shard_metadata(Path::new("s"), &corrupt, 8192).is_err());
        }
    }
}
