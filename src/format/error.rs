use std::io;
use std::path::PathBuf;

/// A dataset's metadata (manifest, shard header or tables) is unreadable, corrupt or inconsistent.
///
/// Every variant names the file at fault; table problems also name the field or block entry.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// A shard named by the manifest does not exist.
    #[error("{path}: shard file is missing")]
    MissingShard {
        /// Where the shard was expected.
        path: PathBuf,
    },
    /// The manifest is not valid JSON of the expected shape, or breaks a rule of the format.
    #[error("{path}: invalid manifest: {reason}")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong, naming the JSON field.
        reason: String,
    },
    /// The file does not start with the shard magic.
    #[error("{path}: not a gpufeed shard (magic is {found:02x?}, expected \"GFEDSHRD\")")]
    BadMagic {
        /// The shard file.
        path: PathBuf,
        /// The first eight bytes found.
        found: [u8; 8],
    },
    /// The shard was written by a format version this build does not read.
    #[error(
        "{path}: shard format version {found} is not supported (this gpufeed reads version {supported})"
    )]
    UnsupportedVersion {
        /// The shard file.
        path: PathBuf,
        /// The version in the header.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The header's checksum does not match its bytes.
    #[error("{path}: header checksum mismatch (stored {stored:016x}, computed {computed:016x}): the header is corrupt")]
    HeaderChecksum {
        /// The shard file.
        path: PathBuf,
        /// Checksum recorded in the header.
        stored: u64,
        /// Checksum of the header bytes as read.
        computed: u64,
    },
    /// The field and block tables do not match their checksum.
    #[error("{path}: field/block table checksum mismatch (stored {stored:016x}, computed {computed:016x}): the tables are corrupt")]
    TableChecksum {
        /// The shard file.
        path: PathBuf,
        /// Checksum recorded after the tables.
        stored: u64,
        /// Checksum of the tables as read.
        computed: u64,
    },
    /// The file is shorter (or longer) than its metadata says.
    #[error("{path}: file is {actual_bytes} bytes but its metadata says {expected_bytes} (truncated or overwritten?)")]
    Length {
        /// The shard file.
        path: PathBuf,
        /// Length implied by the header, tables or manifest.
        expected_bytes: u64,
        /// Length on disk.
        actual_bytes: u64,
    },
    /// A header field or table entry breaks a rule of the format.
    #[error("{path}: {what}")]
    Invalid {
        /// The shard file.
        path: PathBuf,
        /// Which header field, field entry or block entry, and what is wrong with it.
        what: String,
    },
    /// The shard is valid on its own but disagrees with the manifest.
    #[error("{path}: shard does not match the manifest: {what}")]
    ManifestMismatch {
        /// The shard file.
        path: PathBuf,
        /// What differs.
        what: String,
    },
}
