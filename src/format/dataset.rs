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
    /// The manifest file as it was when the dataset was opened: a re-pack in place replaces it.
    pub manifest_identity: FileIdentity,
}

/// Which file a path named, and its size and modification time: a file replaced or rewritten has
/// another identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    device: u64,
    inode: u64,
    bytes: u64,
    modified_ns: i128,
}

impl FileIdentity {
    /// An identity told apart from others by `inode` alone, for tests of what keys on identities.
    #[cfg(test)]
    pub(crate) fn for_tests(inode: u64) -> FileIdentity {
        FileIdentity {
            device: 0,
            inode,
            bytes: 0,
            modified_ns: 0,
        }
    }

    /// The identity of the file at `path` now.
    pub fn of(path: &Path) -> std::io::Result<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let metadata = std::fs::metadata(path)?;
        Ok(FileIdentity {
            device: metadata.dev(),
            inode: metadata.ino(),
            bytes: metadata.len(),
            modified_ns: i128::from(metadata.mtime()) * 1_000_000_000
                + i128::from(metadata.mtime_nsec()),
        })
    }
}

/// How an opened dataset's files differ from what it opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskChange {
    /// The manifest is gone.
    ManifestMissing(PathBuf),
    /// The manifest was replaced or rewritten (the dataset was packed again in place).
    ManifestChanged(PathBuf),
    /// A shard file is gone.
    ShardMissing(PathBuf),
    /// A shard file has another length than the manifest says.
    ShardLength {
        /// The shard file.
        path: PathBuf,
        /// Its length now.
        actual_bytes: u64,
        /// Its length in the manifest.
        expected_bytes: u64,
    },
    /// A shard file cannot be read (its permissions, or an I/O error): not corruption.
    ShardUnreadable {
        /// The shard file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl std::fmt::Display for DiskChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DiskChange::ManifestMissing(path) => {
                write!(
                    f,
                    "{} vanished while the dataset was registered",
                    path.display()
                )
            }
            DiskChange::ManifestChanged(path) => write!(
                f,
                "{} changed since the dataset was registered (packed again in place?)",
                path.display()
            ),
            DiskChange::ShardMissing(path) => {
                write!(
                    f,
                    "shard {} vanished while the dataset was registered",
                    path.display()
                )
            }
            DiskChange::ShardLength {
                path,
                actual_bytes,
                expected_bytes,
            } => write!(
                f,
                "shard {} is {actual_bytes} bytes, the manifest says {expected_bytes}",
                path.display()
            ),
            DiskChange::ShardUnreadable { path, reason } => {
                write!(f, "shard {} cannot be read: {reason}", path.display())
            }
        }
    }
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
        // Taken before the manifest is read: should it change in between, the identity is the older
        // file's, and the change is noticed later rather than missed.
        let manifest_path = dir.join(super::MANIFEST_FILE_NAME);
        let manifest_identity =
            FileIdentity::of(&manifest_path).map_err(|source| FormatError::Io {
                path: manifest_path.clone(),
                source,
            })?;
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
            manifest_identity,
        })
    }

    /// A dataset in `dir` from its manifest (already written there) and its shards' metadata read
    /// elsewhere: a dataset in object storage, whose shard files arrive in `dir` when fetched.
    pub fn from_parts(
        dir: &Path,
        manifest: Manifest,
        shards: Vec<Shard>,
    ) -> Result<Dataset, FormatError> {
        let manifest_path = dir.join(super::MANIFEST_FILE_NAME);
        let manifest_identity =
            FileIdentity::of(&manifest_path).map_err(|source| FormatError::Io {
                path: manifest_path.clone(),
                source,
            })?;
        assert_eq!(shards.len(), manifest.shards.len(), "one shard per entry");
        let verified = std::sync::Arc::new(VerifiedBlocks::new(&shards));
        Ok(Dataset {
            dir: dir.to_path_buf(),
            manifest,
            shards,
            verified,
            manifest_identity,
        })
    }

    /// How the files on disk differ from what was opened, if they do: the manifest gone or
    /// replaced, a shard gone, of another length, or unreadable. A few `stat`s and opens; no data is
    /// read.
    pub fn disk_change(&self) -> Option<DiskChange> {
        let manifest_path = self.dir.join(super::MANIFEST_FILE_NAME);
        match FileIdentity::of(&manifest_path) {
            Err(_) => return Some(DiskChange::ManifestMissing(manifest_path)),
            Ok(identity) if identity != self.manifest_identity => {
                return Some(DiskChange::ManifestChanged(manifest_path))
            }
            Ok(_) => {}
        }
        for (index, entry) in self.manifest.shards.iter().enumerate() {
            let path = self.manifest.shard_path(&self.dir, index);
            match super::open_regular(&path) {
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                    return Some(DiskChange::ShardMissing(path))
                }
                Err(error) => {
                    return Some(DiskChange::ShardUnreadable {
                        path,
                        reason: error.to_string(),
                    })
                }
                Ok(file) => match file.metadata() {
                    Ok(metadata) if metadata.len() != entry.file_bytes => {
                        return Some(DiskChange::ShardLength {
                            path,
                            actual_bytes: metadata.len(),
                            expected_bytes: entry.file_bytes,
                        })
                    }
                    Ok(_) => {}
                    Err(error) => {
                        return Some(DiskChange::ShardUnreadable {
                            path,
                            reason: error.to_string(),
                        })
                    }
                },
            }
        }
        None
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
        // Only the metadata prefix is touched, so the payload is never paged in here. A shard
        // truncated while it is parsed reads zeros past its new end instead of killing the process
        // (see `MappedFile`); the check after parsing then reports it rather than what was parsed.
        let map = crate::storage::mapped::MappedFile::map(&file).map_err(io)?;
        let metadata = parse_shard_metadata(&path, map.bytes(), file_bytes);
        map.check(&file)
            .map_err(|reason| io(std::io::Error::other(reason.to_string())))?;
        Shard::agreeing(path, manifest, index, metadata?)
    }

    /// Shard `index` of `manifest` at `path`, from metadata parsed elsewhere (a shard in object
    /// storage, whose metadata prefix was fetched alone), if it agrees with the manifest.
    pub fn agreeing(
        path: PathBuf,
        manifest: &Manifest,
        index: usize,
        metadata: ShardMetadata,
    ) -> Result<Shard, FormatError> {
        let entry = &manifest.shards[index];
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
        if header.version != manifest.format_version() {
            return Err(mismatch(format!(
                "format version {} versus {} in the manifest",
                header.version,
                manifest.format_version()
            )));
        }
        for (field, listed) in metadata.fields.iter().zip(&manifest.fields) {
            if field.name != listed.name
                || field.dtype != listed.dtype
                || field.shape != listed.shape
                || field.is_variable() != listed.is_variable()
            {
                return Err(mismatch(format!(
                    "field '{}' {} {:?}{} versus '{}' {} {:?}{} in the manifest",
                    field.name,
                    field.dtype,
                    field.shape,
                    if field.is_variable() {
                        " variable-length"
                    } else {
                        ""
                    },
                    listed.name,
                    listed.dtype,
                    listed.shape,
                    if listed.is_variable() {
                        " variable-length"
                    } else {
                        ""
                    },
                )));
            }
        }
        Ok(Shard { path, metadata })
    }
}
