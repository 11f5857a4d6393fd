//! What can go wrong with a dataset in object storage, each error naming the URL or file at fault.

use std::path::PathBuf;

/// An error reaching, reading or caching a dataset in object storage. Messages name the object's
/// URL (never credentials) or the cache file.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL is not one gpufeed reads datasets from.
    #[error("{url}: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// Why.
        reason: String,
    },
    /// The object does not exist: a missing bucket, prefix or manifest.
    #[error("{url}: not found (is the bucket, the prefix or the dataset's manifest missing?)")]
    NotFound {
        /// The object's URL.
        url: String,
    },
    /// The store refused the credentials or the access.
    #[error(
        "{url}: access denied: {reason} (credentials are read from the environment: AWS_*, \
         GOOGLE_*, AZURE_* variables; for S3 without keys there, the AWS_PROFILE profile of \
         ~/.aws; or the instance's role)"
    )]
    Denied {
        /// The object's URL.
        url: String,
        /// The store's answer.
        reason: String,
    },
    /// Any other failure of the store or the network, after the retries.
    #[error("{url}: {reason}")]
    Store {
        /// The object's URL.
        url: String,
        /// The store's answer, or the network's.
        reason: String,
    },
    /// The object's bytes are not what the manifest and the format say.
    #[error("{url}: {what}")]
    Corrupt {
        /// The object's URL.
        url: String,
        /// What is wrong.
        what: String,
    },
    /// The manifest or a shard's metadata is not a valid dataset.
    #[error("{url}: {source}")]
    Format {
        /// The object's URL.
        url: String,
        /// What the format found.
        #[source]
        source: crate::format::FormatError,
    },
    /// A file of the cache could not be written or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The daemon was started without an object cache.
    #[error("{url}: this daemon has no object cache configured (--object-cache-dir)")]
    NoCache {
        /// The URL asked for.
        url: String,
    },
    /// The cache's budget cannot hold what a stream needs at once.
    #[error(
        "the object cache cannot hold {url}: it needs {needed_bytes} more bytes, and of the \
         {bytes_max}-byte budget (--object-cache-max) {pinned_bytes} are held by open streams"
    )]
    Budget {
        /// The shard that did not fit.
        url: String,
        /// Its size.
        needed_bytes: u64,
        /// The budget.
        bytes_max: u64,
        /// Bytes of shards that streams hold and that cannot be evicted.
        pinned_bytes: u64,
    },
}

impl From<crate::durable::PathError> for RemoteError {
    fn from(error: crate::durable::PathError) -> RemoteError {
        RemoteError::Io {
            path: error.path,
            source: error.source,
        }
    }
}

impl RemoteError {
    /// The error for `error`, raised by the store reaching `url`.
    pub fn from_store(url: &str, error: object_store::Error) -> RemoteError {
        let url = url.to_string();
        match error {
            object_store::Error::NotFound { .. } => RemoteError::NotFound { url },
            object_store::Error::PermissionDenied { source, .. }
            | object_store::Error::Unauthenticated { source, .. } => RemoteError::Denied {
                url,
                reason: source.to_string(),
            },
            other => RemoteError::Store {
                url,
                reason: other.to_string(),
            },
        }
    }

    /// Whether trying again may help: the network or the store failed, not the request.
    pub fn is_transient(&self) -> bool {
        matches!(self, RemoteError::Store { .. })
    }
}
