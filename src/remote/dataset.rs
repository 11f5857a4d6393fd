//! A dataset in object storage: registered from its manifest and its shards' metadata, its shards
//! pinned in the cache for each stream; and the upload that `gpufeed pack --out URL` ends with.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::cache::{ObjectCache, ShardPins};
use super::error::RemoteError;
use super::location::{IoRuntime, ObjectLocation};
use crate::format::{
    checksum, parse_shard_header, parse_shard_metadata, Dataset, Manifest, Shard,
    MANIFEST_BYTES_MAX, MANIFEST_FILE_NAME,
};
use crate::pipeline::shard_gate::ShardGate;

/// Bytes of a shard asked for first at registration: the header and, for most shards, the
/// tables after it; the rest of the tables is asked for when the header says they are longer.
const METADATA_FIRST_BYTES: u64 = 64 << 10;

/// Shard files uploaded at once by `pack --out URL`, each in parts of [`UPLOAD_PART_BYTES`] with
/// [`UPLOAD_PARTS_IN_FLIGHT`] parts in flight (at most 4 × 4 × 16 MiB buffered).
const UPLOAD_FILES_IN_FLIGHT: usize = 4;
const UPLOAD_PART_BYTES: usize = 16 << 20;
const UPLOAD_PARTS_IN_FLIGHT: usize = 4;

/// A registered dataset's place in object storage, and the cache its shards go through.
pub struct RemoteDataset {
    location: ObjectLocation,
    cache: Arc<ObjectCache>,
    registered_at: std::time::SystemTime,
}

impl std::fmt::Debug for RemoteDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDataset")
            .field("url", &self.location.url())
            .finish()
    }
}

impl RemoteDataset {
    /// Reads the manifest at `url` and every shard's metadata (from the cache where it holds the
    /// shard, else with ranged GETs), and returns the dataset, whose directory is the cache's
    /// directory for this URL and manifest. Errors name the URL: a missing bucket or manifest,
    /// refused credentials, a manifest or shard that is not valid.
    pub fn open(
        cache: &Arc<ObjectCache>,
        url: &str,
    ) -> Result<(RemoteDataset, Dataset), RemoteError> {
        let (cache, url) = (Arc::clone(cache), url.to_string());
        let runtime_cache = Arc::clone(&cache);
        let (remote, dataset) = runtime_cache
            .runtime()
            .run(async move { RemoteDataset::open_async(cache, url).await })?;
        if dataset.manifest.fields.iter().any(|f| f.is_variable()) {
            remote.read_offsets_remotely(&dataset);
        }
        Ok((remote, dataset))
    }

    /// Lets streams of `dataset` read its variable-length fields' offsets with ranged GETs where
    /// the cache holds no copy of a shard (`pipeline::varlen::register_range_reader`).
    fn read_offsets_remotely(&self, dataset: &Dataset) {
        let (location, cache) = (self.location.clone(), Arc::clone(&self.cache));
        let objects: Vec<String> = dataset
            .manifest
            .shards
            .iter()
            .map(|s| s.file.clone())
            .collect();
        let reader: crate::pipeline::varlen::RangeReader = Arc::new(move |shard, range| {
            let object = objects
                .get(shard)
                .cloned()
                .ok_or_else(|| format!("no shard {shard}"))?;
            let (location, fetcher) = (location.clone(), Arc::clone(&cache));
            cache
                .runtime()
                .run(async move {
                    let errors = &fetcher.metrics().object_cache().fetch_errors;
                    let _permit = fetcher.requests().acquire().await.expect("never closed");
                    location.get_range(&object, range, errors).await
                })
                .map(|bytes| bytes.to_vec())
                .map_err(|error| error.to_string())
        });
        crate::pipeline::varlen::register_range_reader(dataset.dir.clone(), reader);
    }

    async fn open_async(
        cache: Arc<ObjectCache>,
        url: String,
    ) -> Result<(RemoteDataset, Dataset), RemoteError> {
        let location = ObjectLocation::parse(&url)?;
        let manifest_url = location.object_url(MANIFEST_FILE_NAME);
        let text = location
            .get_all(MANIFEST_FILE_NAME, MANIFEST_BYTES_MAX)
            .await?;
        let manifest = Manifest::from_json(Path::new(&manifest_url), &text).map_err(|source| {
            RemoteError::Format {
                url: manifest_url.clone(),
                source,
            }
        })?;
        // One directory per URL and manifest: a dataset packed again under the same URL is
        // another directory, so its shards never mix with the older ones.
        let mut identity = location.url().as_bytes().to_vec();
        identity.push(0);
        identity.extend_from_slice(&text);
        let dir = cache
            .dir()
            .join(format!("{}-{:016x}", manifest.name, checksum(&identity)));
        let manifest_path = dir.join(MANIFEST_FILE_NAME);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| RemoteError::Io { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        if std::fs::read(&manifest_path).ok().as_deref() != Some(&text[..]) {
            crate::durable::write_atomically(&manifest_path, &text)?;
        }
        let reads = (0..manifest.shards.len()).map(|index| {
            let (location, cache, manifest) = (&location, &cache, &manifest);
            let dir = &dir;
            async move {
                let path = manifest.shard_path(dir, index);
                let object = &manifest.shards[index].file;
                let shard_url = location.object_url(object);
                let prefix = shard_prefix(cache, location, object, &path, manifest, index).await?;
                let format = |source| RemoteError::Format {
                    url: shard_url.clone(),
                    source,
                };
                let metadata =
                    parse_shard_metadata(&path, &prefix, manifest.shards[index].file_bytes)
                        .map_err(format)?;
                Shard::agreeing(path, manifest, index, metadata).map_err(format)
            }
        });
        let shards = futures_util::future::try_join_all(reads).await?;
        let dataset =
            Dataset::from_parts(&dir, manifest, shards).map_err(|source| RemoteError::Format {
                url: manifest_url,
                source,
            })?;
        let registered_at = std::time::SystemTime::now();
        Ok((
            RemoteDataset {
                location,
                cache,
                registered_at,
            },
            dataset,
        ))
    }

    /// The dataset's URL.
    pub fn url(&self) -> &str {
        self.location.url()
    }

    /// When it was opened for registration.
    pub fn registered_at(&self) -> std::time::SystemTime {
        self.registered_at
    }

    /// Pins every shard of `dataset` (this dataset as registered) in the cache, fetching those
    /// it does not hold, for a stream about to read them.
    pub fn acquire(&self, dataset: &Dataset) -> Result<ShardPins, RemoteError> {
        self.cache.acquire(&self.location, dataset)
    }

    /// This dataset with its store put behind `wrap`: tests place a store that counts, holds or
    /// fails requests in front of the real one.
    #[cfg(test)]
    pub(crate) fn wrapping_store(
        self,
        wrap: impl FnOnce(Arc<dyn object_store::ObjectStore>) -> Arc<dyn object_store::ObjectStore>,
    ) -> RemoteDataset {
        RemoteDataset {
            location: self.location.wrapping_store(wrap),
            ..self
        }
    }

    /// Whether the node's cache holds every shard of `dataset` (this dataset as registered)
    /// complete now: a stream would fetch nothing (unless one is evicted meanwhile).
    pub fn cached_whole(&self, dataset: &Dataset) -> bool {
        dataset
            .shards
            .iter()
            .all(|shard| self.cache.holds(&shard.path))
    }

    /// The cache its shards go through.
    pub fn cache(&self) -> &Arc<ObjectCache> {
        &self.cache
    }

    /// The gate of a host stream reading `dataset` (this dataset as registered): its shards
    /// fetched and held batch by batch, a few fetched ahead, instead of all before it starts.
    pub fn stream_shards(&self, dataset: Arc<Dataset>) -> StreamShards {
        StreamShards {
            cache: Arc::clone(&self.cache),
            location: self.location.clone(),
            dataset,
            held: std::sync::Mutex::new(HashMap::new()),
        }
    }
}

/// The shards of one host stream of a dataset in object storage, made ready batch by batch: the
/// stream's [`ShardGate`]. Each shard it holds is pinned in the cache until released or until the
/// stream ends (this is dropped with the stream's plan).
pub struct StreamShards {
    cache: Arc<ObjectCache>,
    location: ObjectLocation,
    dataset: Arc<Dataset>,
    held: std::sync::Mutex<HashMap<usize, (PathBuf, u64)>>,
}

impl std::fmt::Debug for StreamShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamShards")
            .field("url", &self.location.url())
            .finish()
    }
}

impl StreamShards {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, (PathBuf, u64)>> {
        self.held.lock().expect("stream shards lock poisoned")
    }
}

impl ShardGate for StreamShards {
    fn hold(&self, shards: &[usize]) -> Result<(), String> {
        let mut held = self.lock();
        let fetches = self
            .cache
            .pin(&self.location, &self.dataset, shards, &mut held)
            .map_err(|error| error.to_string())?;
        let entries: Vec<(PathBuf, u64)> = shards.iter().map(|index| held[index].clone()).collect();
        drop(held);
        self.cache
            .fetch_now(&self.location, &self.dataset, fetches)
            .and_then(|()| self.cache.wait_complete(&self.location, &entries))
            .map_err(|error| error.to_string())
    }

    fn ahead(&self, shards: &[usize]) {
        let mut held = self.lock();
        match self
            .cache
            .pin(&self.location, &self.dataset, shards, &mut held)
        {
            Ok(fetches) => {
                drop(held);
                self.cache
                    .fetch_later(&self.location, &self.dataset, fetches);
            }
            // No room to fetch ahead: the batches' own shards are fetched when they are needed
            // (and fail there, naming the budget, if even they do not fit).
            Err(error) => tracing::debug!("not fetched ahead: {error}"),
        }
    }

    fn release(&self, shards: &[usize]) {
        let entries: Vec<(PathBuf, u64)> = {
            let mut held = self.lock();
            shards
                .iter()
                .filter_map(|index| held.remove(index))
                .collect()
        };
        self.cache.unpin(&entries);
    }
}

impl Drop for StreamShards {
    fn drop(&mut self) {
        let entries: Vec<(PathBuf, u64)> = self.lock().drain().map(|(_, entry)| entry).collect();
        self.cache.unpin(&entries);
    }
}

/// The metadata prefix of shard `index` (header and tables, up to its payload offset): read from
/// the cached file where there is one, else fetched.
async fn shard_prefix(
    cache: &ObjectCache,
    location: &ObjectLocation,
    object: &str,
    path: &Path,
    manifest: &Manifest,
    index: usize,
) -> Result<Vec<u8>, RemoteError> {
    let file_bytes = manifest.shards[index].file_bytes;
    if cache.holds(path) {
        let path = path.to_path_buf();
        let local = tokio::task::spawn_blocking(move || local_prefix(&path))
            .await
            .expect("the read task runs to its end");
        if let Ok(prefix) = local {
            return Ok(prefix);
        }
    }
    let errors = &cache.metrics().object_cache().fetch_errors;
    let first = {
        let _permit = cache.requests().acquire().await.expect("never closed");
        location
            .get_range(object, 0..METADATA_FIRST_BYTES.min(file_bytes), errors)
            .await?
    };
    let header = parse_shard_header(path, &first).map_err(|source| RemoteError::Format {
        url: location.object_url(object),
        source,
    })?;
    let mut prefix = first.to_vec();
    if header.payload_offset > prefix.len() as u64 && header.payload_offset <= file_bytes {
        let _permit = cache.requests().acquire().await.expect("never closed");
        let rest = location
            .get_range(object, prefix.len() as u64..header.payload_offset, errors)
            .await?;
        prefix.extend_from_slice(&rest);
    }
    Ok(prefix)
}

/// The metadata prefix of a local shard file.
fn local_prefix(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path)?;
    let mut header = vec![0u8; 64];
    file.read_exact_at(&mut header, 0)?;
    let payload_offset = parse_shard_header(path, &header)
        .map_err(|error| std::io::Error::other(error.to_string()))?
        .payload_offset;
    let mut prefix = vec![0u8; payload_offset as usize];
    file.read_exact_at(&mut prefix, 0)?;
    Ok(prefix)
}

/// Whether an upload may replace a dataset already at its URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// Refuse when the URL already holds a manifest.
    Never,
    /// Replace it (its shards are overwritten first, its manifest last).
    Existing,
}

/// Uploads the packed dataset in `dir` to `url`: every shard first (several at once, each in
/// parts), the manifest last, so that the URL holds a dataset only once all of it is there.
/// Returns the bytes uploaded.
pub fn upload_dataset(dir: &Path, url: &str, replace: Replace) -> Result<u64, RemoteError> {
    let manifest = Manifest::load(dir).map_err(|source| RemoteError::Format {
        url: dir.display().to_string(),
        source,
    })?;
    let location = ObjectLocation::parse(url)?;
    let runtime = IoRuntime::new(2).map_err(|source| RemoteError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let dir = dir.to_path_buf();
    runtime.run(async move { upload(location, dir, manifest, replace).await })
}

async fn upload(
    location: ObjectLocation,
    dir: PathBuf,
    manifest: Manifest,
    replace: Replace,
) -> Result<u64, RemoteError> {
    if replace == Replace::Never && location.size_of(MANIFEST_FILE_NAME).await?.is_some() {
        return Err(RemoteError::Store {
            url: location.object_url(MANIFEST_FILE_NAME),
            reason: "a dataset is already there (pass --force to replace it)".to_string(),
        });
    }
    let files = Arc::new(tokio::sync::Semaphore::new(UPLOAD_FILES_IN_FLIGHT));
    let uploads = manifest.shards.iter().map(|entry| {
        let (location, files, path) = (&location, Arc::clone(&files), dir.join(&entry.file));
        async move {
            let _permit = files.acquire().await.expect("never closed");
            location
                .upload_file(
                    &entry.file,
                    &path,
                    UPLOAD_PART_BYTES,
                    UPLOAD_PARTS_IN_FLIGHT,
                )
                .await
        }
    });
    futures_util::future::try_join_all(uploads).await?;
    let text = std::fs::read(dir.join(MANIFEST_FILE_NAME)).map_err(|source| RemoteError::Io {
        path: dir.join(MANIFEST_FILE_NAME),
        source,
    })?;
    location
        .put(MANIFEST_FILE_NAME, bytes::Bytes::from(text))
        .await?;
    Ok(manifest.shards.iter().map(|entry| entry.file_bytes).sum())
}
