//! Datasets in object storage (`s3://`, `gs://`, `az://`, `file://`), served through a node-local
//! cache of whole shard files.
//!
//! A dataset registered by URL is opened from its manifest and its shards' metadata (a ranged GET of
//! each shard's tables), fetched at registration. Its shard files arrive in the cache directory
//! when a stream needs them: fetched with ranged GETs in parallel (a bounded number in flight),
//! written aside and verified (header, tables against the manifest, every block's xxh3-64) before
//! they are renamed into place, then pinned for as long as a stream reads them. The rest of the
//! daemon reads them as the local files of an ordinary dataset. Unpinned shards are evicted least
//! recently used within the cache's byte budget, and the directory is indexed again when the
//! daemon starts (files left half-written are removed).
//!
//! Layers: [`location`] turns a URL into a store with credentials from the environment (or, for
//! S3, a profile of the shared AWS files: [`aws_profile`]) and retries its requests; [`cache`] holds the directory, its budget and its pins; [`dataset`] registers a
//! dataset and uploads one (`gpufeed pack --out s3://...`).

pub mod aws_profile;
pub mod cache;
pub mod dataset;
pub mod error;
pub mod location;

pub use cache::{ObjectCache, ObjectCacheSettings, ShardPins};
pub use dataset::{upload_dataset, RemoteDataset, Replace, StreamShards};
pub use error::RemoteError;
pub use location::{is_object_url, IoRuntime, ObjectLocation};
