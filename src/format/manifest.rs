//! `manifest.json`: the dataset's table of contents.
//!
//! The manifest is the commit point of a pack: it is written last, and a directory without one is not a
//! dataset. It is JSON so that operators and other tools can read it; its serde types stay at this edge
//! and are checked into [`Manifest`] before anything else sees them.

use std::path::{Path, PathBuf};

use gpufeed_proto::DType;
use serde::{Deserialize, Serialize};

use super::{
    validate_field_name, FormatError, BLOCK_BYTES_MAX, BLOCK_BYTES_MIN, FIELDS_MAX, FORMAT_VERSION,
    FORMAT_VERSION_VARIABLE, MANIFEST_BYTES_MAX, SAMPLE_NDIM_MAX,
};

/// File name of the manifest inside a dataset directory.
pub const MANIFEST_FILE_NAME: &str = "manifest.json";
const FORMAT_TAG: &str = "gpufeed-dataset";
const CHECKSUM_NAME: &str = "xxh3-64";

/// A field as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestField {
    /// Field name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Per-sample shape; of a variable-length field, the shape of one element (a sample is a
    /// run of elements).
    pub shape: Vec<u64>,
    /// `None` for a fixed-shape field; for a variable-length field (format version 2), the most
    /// elements a sample has (readers check every sample against it).
    pub length_max: Option<u64>,
}

impl ManifestField {
    /// Bytes of one sample of a fixed-shape field; of one element of a variable-length field.
    pub fn sample_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size_bytes() as u64
    }

    /// Whether the field's samples vary in length.
    pub fn is_variable(&self) -> bool {
        self.length_max.is_some()
    }
}

/// A shard as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestShard {
    /// File name relative to the dataset directory (a plain name, never a path).
    pub file: String,
    /// Global index of the shard's first sample.
    pub first_sample: u64,
    /// Samples in the shard.
    pub sample_count: u64,
    /// The shard file's exact length.
    pub file_bytes: u64,
    /// The checksum stored after the shard's tables; ties the manifest to the exact shard written.
    pub table_checksum: u64,
}

/// A validated manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Dataset name.
    pub name: String,
    /// Total samples over all shards.
    pub sample_count: u64,
    /// Largest raw size of a block.
    pub block_bytes: u32,
    /// Fields, in table order.
    pub fields: Vec<ManifestField>,
    /// Shards, in sample order; together they cover `0..sample_count` without gaps.
    pub shards: Vec<ManifestShard>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestJson {
    format: String,
    format_version: u32,
    name: String,
    sample_count: u64,
    block_bytes: u32,
    checksum: String,
    fields: Vec<FieldJson>,
    shards: Vec<ShardJson>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FieldJson {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    /// Version 2: `true` for a variable-length field (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    variable_length: Option<bool>,
    /// Version 2, with `variable_length`: the most elements a sample has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    length_max: Option<u64>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardJson {
    file: String,
    first_sample: u64,
    sample_count: u64,
    file_bytes: u64,
    table_checksum: String,
}

/// A manifest field's `length_max` when it is variable-length (`variable_length: true` with a
/// `length_max`, in a version 2 manifest), `None` when it is not; else what is wrong.
fn length_max(field: &FieldJson, index: usize, format_version: u32) -> Result<Option<u64>, String> {
    match (field.variable_length, field.length_max) {
        (None, None) => Ok(None),
        (Some(true), Some(length_max)) if format_version == FORMAT_VERSION_VARIABLE => {
            Ok(Some(length_max))
        }
        (Some(true), Some(_)) => Err(format!(
            "fields[{index}] is variable-length, which needs format_version {FORMAT_VERSION_VARIABLE}"
        )),
        _ => Err(format!(
            "fields[{index}]: \"variable_length\": true and \"length_max\" go together"
        )),
    }
}

/// Checks a dataset name: 1 to 128 bytes of ASCII letters, digits, `_`, `-` and `.`, not starting with `.`.
pub fn validate_dataset_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 || name.starts_with('.') {
        return Err(format!(
            "dataset name {name:?} must be 1 to 128 bytes and must not start with '.'"
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(format!(
            "dataset name {name:?} may only hold ASCII letters, digits, '_', '-' and '.'"
        ));
    }
    Ok(())
}

impl Manifest {
    /// Reads and validates `DIR/manifest.json`.
    pub fn load(dir: &Path) -> Result<Manifest, FormatError> {
        let path = dir.join(MANIFEST_FILE_NAME);
        let io = |source| FormatError::Io {
            path: path.clone(),
            source,
        };
        let file = super::open_regular(&path).map_err(io)?;
        let length = file.metadata().map_err(io)?.len();
        let too_long = |length: u64| FormatError::Manifest {
            path: path.clone(),
            reason: format!("{length} bytes exceeds the {MANIFEST_BYTES_MAX}-byte limit"),
        };
        if length > MANIFEST_BYTES_MAX {
            return Err(too_long(length));
        }
        // Bounded even if the file grows while it is read.
        let mut text = Vec::with_capacity(length as usize);
        std::io::Read::read_to_end(
            &mut std::io::Read::take(file, MANIFEST_BYTES_MAX + 1),
            &mut text,
        )
        .map_err(io)?;
        if text.len() as u64 > MANIFEST_BYTES_MAX {
            return Err(too_long(text.len() as u64));
        }
        Manifest::from_json(&path, &text)
    }

    /// Parses and validates manifest JSON; `path` is only used in errors.
    pub fn from_json(path: &Path, text: &[u8]) -> Result<Manifest, FormatError> {
        let bad = |reason: String| FormatError::Manifest {
            path: path.to_path_buf(),
            reason,
        };
        let json: ManifestJson = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
        if json.format != FORMAT_TAG {
            return Err(bad(format!(
                "\"format\" is {:?}, expected {FORMAT_TAG:?}",
                json.format
            )));
        }
        if json.format_version != FORMAT_VERSION && json.format_version != FORMAT_VERSION_VARIABLE {
            return Err(bad(format!(
                "format_version {} is not supported (this gpufeed reads versions {FORMAT_VERSION} and {FORMAT_VERSION_VARIABLE})",
                json.format_version
            )));
        }
        if json.checksum != CHECKSUM_NAME {
            return Err(bad(format!(
                "\"checksum\" is {:?}; version 1 uses {CHECKSUM_NAME:?}",
                json.checksum
            )));
        }
        validate_dataset_name(&json.name).map_err(|e| bad(format!("\"name\": {e}")))?;
        if !json.block_bytes.is_power_of_two()
            || !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&json.block_bytes)
        {
            return Err(bad(format!(
                "\"block_bytes\" {} is not a power of two in {BLOCK_BYTES_MIN}..={BLOCK_BYTES_MAX}",
                json.block_bytes
            )));
        }
        if json.fields.is_empty() || json.fields.len() > FIELDS_MAX {
            return Err(bad(format!(
                "\"fields\" must hold 1 to {FIELDS_MAX} fields"
            )));
        }
        let mut fields = Vec::with_capacity(json.fields.len());
        for (index, field) in json.fields.into_iter().enumerate() {
            validate_field_name(&field.name).map_err(|e| bad(format!("fields[{index}]: {e}")))?;
            if fields.iter().any(|f: &ManifestField| f.name == field.name) {
                return Err(bad(format!(
                    "fields[{index}]: duplicate field name {:?}",
                    field.name
                )));
            }
            let dtype: DType = field
                .dtype
                .parse()
                .map_err(|e| bad(format!("fields[{index}].dtype: {e}")))?;
            if field.shape.len() > SAMPLE_NDIM_MAX {
                return Err(bad(format!(
                    "fields[{index}].shape has {} dimensions; at most {SAMPLE_NDIM_MAX}",
                    field.shape.len()
                )));
            }
            let sample_bytes = field
                .shape
                .iter()
                .try_fold(dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d));
            if !matches!(sample_bytes, Some(b) if b > 0) {
                return Err(bad(format!(
                    "fields[{index}].shape {:?} gives an empty or overflowing sample",
                    field.shape
                )));
            }
            let length_max = length_max(&field, index, json.format_version).map_err(bad)?;
            fields.push(ManifestField {
                name: field.name,
                dtype,
                shape: field.shape,
                length_max,
            });
        }
        if json.shards.is_empty() {
            return Err(bad("\"shards\" is empty".to_string()));
        }
        let mut shards = Vec::with_capacity(json.shards.len());
        let mut next_sample = 0u64;
        for (index, shard) in json.shards.into_iter().enumerate() {
            if shard.file.is_empty()
                || shard.file.starts_with('.')
                || shard.file.contains(['/', '\\', '\0'])
            {
                return Err(bad(format!(
                    "shards[{index}].file {:?} must be a plain file name inside the dataset directory",
                    shard.file
                )));
            }
            if shard.first_sample != next_sample || shard.sample_count == 0 {
                return Err(bad(format!(
                    "shards[{index}] covers samples {}..+{} but the previous shards end at {next_sample}",
                    shard.first_sample, shard.sample_count
                )));
            }
            next_sample = next_sample
                .checked_add(shard.sample_count)
                .ok_or_else(|| bad(format!("shards[{index}]: sample count overflows")))?;
            // FORMAT.md: exactly 16 lowercase hex digits, so that one checksum has one spelling.
            let lowercase_hex = shard.table_checksum.len() == 16
                && shard
                    .table_checksum
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            let table_checksum = u64::from_str_radix(&shard.table_checksum, 16)
                .ok()
                .filter(|_| lowercase_hex)
                .ok_or_else(|| {
                    bad(format!(
                        "shards[{index}].table_checksum {:?} is not 16 lowercase hex digits",
                        shard.table_checksum
                    ))
                })?;
            shards.push(ManifestShard {
                file: shard.file,
                first_sample: shard.first_sample,
                sample_count: shard.sample_count,
                file_bytes: shard.file_bytes,
                table_checksum,
            });
        }
        if json.format_version == FORMAT_VERSION_VARIABLE
            && !fields.iter().any(ManifestField::is_variable)
        {
            return Err(bad(format!(
                "format_version {FORMAT_VERSION_VARIABLE} without a variable-length field: such a dataset is version {FORMAT_VERSION}"
            )));
        }
        if next_sample != json.sample_count {
            return Err(bad(format!(
                "\"sample_count\" is {} but the shards hold {next_sample}",
                json.sample_count
            )));
        }
        Ok(Manifest {
            name: json.name,
            sample_count: json.sample_count,
            block_bytes: json.block_bytes,
            fields,
            shards,
        })
    }

    /// The manifest as pretty-printed JSON (what the packer writes).
    pub fn to_json(&self) -> String {
        let json = ManifestJson {
            format: FORMAT_TAG.to_string(),
            format_version: self.format_version(),
            name: self.name.clone(),
            sample_count: self.sample_count,
            block_bytes: self.block_bytes,
            checksum: CHECKSUM_NAME.to_string(),
            fields: self
                .fields
                .iter()
                .map(|f| FieldJson {
                    name: f.name.clone(),
                    dtype: f.dtype.name().to_string(),
                    shape: f.shape.clone(),
                    variable_length: f.is_variable().then_some(true),
                    length_max: f.length_max,
                })
                .collect(),
            shards: self
                .shards
                .iter()
                .map(|s| ShardJson {
                    file: s.file.clone(),
                    first_sample: s.first_sample,
                    sample_count: s.sample_count,
                    file_bytes: s.file_bytes,
                    table_checksum: format!("{:016x}", s.table_checksum),
                })
                .collect(),
        };
        let mut text = serde_json::to_string_pretty(&json).expect("manifest serialises");
        text.push('\n');
        text
    }

    /// The format version of this dataset: 2 if a field is variable-length, else 1.
    pub fn format_version(&self) -> u32 {
        if self.fields.iter().any(ManifestField::is_variable) {
            FORMAT_VERSION_VARIABLE
        } else {
            FORMAT_VERSION
        }
    }

    /// Path of shard `index` inside the dataset directory `dir`.
    pub fn shard_path(&self, dir: &Path, index: usize) -> PathBuf {
        dir.join(&self.shards[index].file)
    }
}
