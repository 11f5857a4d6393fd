//! Opening a dataset directory: the manifest plus every shard's validated metadata.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::{parse_shard_metadata, FormatError, Manifest, ShardMetadata};

/// One shard of an open dataset: where it is and what its tables say.
#[derive(Clone, Debug)]
pub struct Shard {
    /// Absolute or dataset-relative path of the shard file.
    pub path: PathBuf,
    /// Validated header, fields and blocks.
    pub metadata: ShardMetadata,
}

/// An open dataset: its manifest and the metadata of all its shards, cross-checked.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// The dataset directory.
    pub dir: PathBuf,
    /// The validated manifest.
    pub manifest: Manifest,
    /// Shards in sample order, one per manifest entry.
    pub shards: Vec<Shard>,
}

impl Dataset {
    /// Opens a dataset directory, failing on the first missing, corrupt or inconsistent shard.
    ///
    /// Only metadata is read; block payloads are not checked here (see `gpufeed verify`).
    pub fn open(dir: &Path) -> Result<Dataset, FormatError> {
        let manifest = Manifest::load(dir)?;
        let shards = (0..manifest.shards.len())
            .map(|index| Shard::open(dir, &manifest, index))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Dataset {
            dir: dir.to_path_buf(),
            manifest,
            shards,
        })
    }

    /// Index of the field named `name`.
    pub fn field_index(&self, name: &str) -> Option<usize> {
        self.manifest.fields.iter().position(|f| f.name == name)
    }
}

impl Shard {
    /// Opens shard `index` of `manifest` in `dir`: maps its metadata with memmap2, validates it and
    /// checks that it agrees with the manifest.
    pub fn open(dir: &Path, manifest: &Manifest, index: usize) -> Result<Shard, FormatError> {
        let entry = &manifest.shards[index];
        let path = manifest.shard_path(dir, index);
        let file = File::open(&path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                FormatError::MissingShard { path: path.clone() }
            } else {
                FormatError::Io {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        let io = |source| FormatError::Io {
            path: path.clone(),
            source,
        };
        let file_bytes = file.metadata().map_err(io)?.len();
        if file_bytes != entry.file_bytes {
            return Err(FormatError::Length {
                path,
                expected_bytes: entry.file_bytes,
                actual_bytes: file_bytes,
            });
        }
        if file_bytes == 0 {
            return Err(FormatError::Length {
                path,
                expected_bytes: entry.file_bytes,
                actual_bytes: 0,
            });
        }
        // SAFETY: the mapping is read-only and private to this call. gpufeed never writes a shard after
        // its manifest exists; another process truncating the file while we parse would fault (SIGBUS),
        // which is the documented risk of memory-mapping shared files. Only the metadata prefix is
        // touched, so the payload is never paged in here.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let metadata = parse_shard_metadata(&path, &map, file_bytes)?;
        let mismatch = |what: String| FormatError::ManifestMismatch {
            path: path.clone(),
            what,
        };
        let header = &metadata.header;
        if header.first_sample != entry.first_sample || header.sample_count != entry.sample_count {
            return Err(mismatch(format!(
                "the shard holds samples {}..+{}, the manifest says {}..+{}",
                header.first_sample, header.sample_count, entry.first_sample, entry.sample_count
            )));
        }
        if header.block_bytes != manifest.block_bytes {
            return Err(mismatch(format!(
                "block_bytes {} versus {} in the manifest",
                header.block_bytes, manifest.block_bytes
            )));
        }
        if metadata.table_checksum != entry.table_checksum {
            return Err(mismatch(format!(
                "table checksum {:016x} versus {:016x} in the manifest",
                metadata.table_checksum, entry.table_checksum
            )));
        }
        if metadata.fields.len() != manifest.fields.len() {
            return Err(mismatch(format!(
                "{} fields versus {} in the manifest",
                metadata.fields.len(),
                manifest.fields.len()
            )));
        }
        for (field, listed) in metadata.fields.iter().zip(&manifest.fields) {
            if field.name != listed.name
                || field.dtype != listed.dtype
                || field.shape != listed.shape
            {
                return Err(mismatch(format!(
                    "field '{}' {} {:?} versus '{}' {} {:?} in the manifest",
                    field.name, field.dtype, field.shape, listed.name, listed.dtype, listed.shape
                )));
            }
        }
        Ok(Shard { path, metadata })
    }
}
