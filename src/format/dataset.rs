//! Opening a dataset directory: the manifest plus every shard's validated metadata.

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
    /// Which blocks' payloads have been found to match their checksums since the dataset was opened.
    pub verified: std::sync::Arc<VerifiedBlocks>,
}

/// A record, per block, of whether its stored bytes have been read and found to hash to the
/// checksum in its block table, shared by every reader of the opened dataset so that a block is
/// hashed once rather than by every stream. Datasets are immutable once packed (a re-pack replaces
/// the directory and is a new `Dataset`), so a block once verified stays verified. A bitset of
/// atomics: marking and testing never block.
#[derive(Debug)]
pub struct VerifiedBlocks {
    /// Per shard, the index of the first bit of each of its fields, then one past the last.
    firsts: Vec<Vec<usize>>,
    bits: Vec<std::sync::atomic::AtomicU64>,
}

impl VerifiedBlocks {
    /// An empty record for `shards`.
    pub fn new(shards: &[Shard]) -> VerifiedBlocks {
        let mut at = 0usize;
        let firsts = shards
            .iter()
            .map(|shard| {
                let mut firsts: Vec<usize> = shard
                    .metadata
                    .fields
                    .iter()
                    .map(|field| {
                        let first = at;
                        at += field.block_count as usize;
                        first
                    })
                    .collect();
                firsts.push(at);
                firsts
            })
            .collect();
        VerifiedBlocks {
            firsts,
            bits: (0..at.div_ceil(64))
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    fn bit(&self, shard: usize, field: usize, block: u32) -> usize {
        let bit = self.firsts[shard][field] + block as usize;
        assert!(
            bit < self.firsts[shard][field + 1],
            "block index out of range"
        );
        bit
    }

    /// Whether block `block` of field `field` in shard `shard` has been verified.
    pub fn contains(&self, shard: usize, field: usize, block: u32) -> bool {
        let bit = self.bit(shard, field, block);
        self.bits[bit / 64].load(std::sync::atomic::Ordering::Acquire) & (1 << (bit % 64)) != 0
    }

    /// Records that block `block` of field `field` in shard `shard` matched its checksum.
    pub fn insert(&self, shard: usize, field: usize, block: u32) {
        let bit = self.bit(shard, field, block);
        self.bits[bit / 64].fetch_or(1 << (bit % 64), std::sync::atomic::Ordering::Release);
    }
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
        let verified = std::sync::Arc::new(VerifiedBlocks::new(&shards));
        Ok(Dataset {
            dir: dir.to_path_buf(),
            manifest,
            shards,
            verified,
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
        let file = super::open_regular(&path).map_err(|source| {
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
