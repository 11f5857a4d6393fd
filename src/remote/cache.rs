//! The node-local cache of shard files fetched from object storage: a directory with a byte
//! budget, shared by every stream of the daemon.
//!
//! A shard is fetched whole, with ranged GETs in parallel (at most `requests_in_flight` over the
//! whole cache, each of [`RANGE_BYTES`]), into a hidden file beside its place; it is synced and
//! verified (its length, its header and tables against the manifest, every block's xxh3-64) and
//! only then renamed into place, so a file under a shard's name is always complete. A stream pins
//! the shards it reads for its life ([`ShardPins`]); eviction, least recently used first, takes
//! only unpinned shards. The directory is locked by one daemon at a time and indexed again when
//! it opens: files left half-written by a daemon that stopped are removed, complete ones are kept
//! with their modification time as their last use.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};

use super::error::RemoteError;
use super::location::{IoRuntime, ObjectLocation};
use crate::format::{checksum, parse_shard_metadata, Dataset, ShardMetadata};
use crate::metrics::Metrics;

/// Bytes one ranged GET asks for: large enough that a request's latency is a small part of its
/// time, small enough that the requests in flight bound the memory held (16 × 8 MiB).
pub const RANGE_BYTES: u64 = 8 << 20;

/// Ranged GETs in flight over the whole cache unless configured.
pub const REQUESTS_IN_FLIGHT_DEFAULT: usize = 16;

/// Most ranged GETs in flight that may be configured.
pub const REQUESTS_IN_FLIGHT_MAX: usize = 256;

/// Shards one stream fetches at once (their ranges share the cache's request permits).
const SHARDS_IN_FLIGHT: usize = 8;

/// Worker threads of the cache's runtime: requests are I/O bound; hashing runs on its blocking
/// threads.
const RUNTIME_THREADS: usize = 2;

/// Where the cache lives and what it may hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectCacheSettings {
    /// The cache directory (one subdirectory per dataset version).
    pub dir: PathBuf,
    /// Most bytes of shard files kept, those being fetched included.
    pub bytes_max: u64,
    /// Ranged GETs in flight at once, over every fetch.
    pub requests_in_flight: usize,
}

/// The cache of shard files: see the module documentation.
pub struct ObjectCache {
    settings: ObjectCacheSettings,
    state: Mutex<CacheState>,
    /// Signalled whenever a fetch ends or a pin is released.
    settled: Condvar,
    metrics: Arc<Metrics>,
    runtime: IoRuntime,
    requests: Arc<tokio::sync::Semaphore>,
    _lock: crate::durable::WriterLock,
}

#[derive(Default)]
struct CacheState {
    files: HashMap<PathBuf, CachedFile>,
    /// Bytes of the files kept and of those being fetched.
    used_bytes: u64,
    /// A counter ordering uses: larger is more recent.
    clock: u64,
    next_id: u64,
}

struct CachedFile {
    /// Tells this entry from a later one under the same path (a pin names the entry it took).
    id: u64,
    bytes: u64,
    last_used: u64,
    pins: u32,
    /// Renamed into place, verified; false while it is fetched.
    complete: bool,
}

/// A snapshot of the cache for status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSnapshot {
    /// Bytes of shard files kept or being fetched.
    pub used_bytes: u64,
    /// The budget.
    pub bytes_max: u64,
    /// Shard files kept or being fetched.
    pub files: u64,
    /// Of them, pinned by open streams.
    pub pinned_files: u64,
}

/// Shards a stream reads, held in the cache until dropped.
pub struct ShardPins {
    cache: Arc<ObjectCache>,
    held: Vec<(PathBuf, u64)>,
}

impl ShardPins {
    /// Shards held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

impl Drop for ShardPins {
    fn drop(&mut self) {
        self.cache.unpin(&self.held);
    }
}

/// One shard to fetch: where from, where to, and what it must hold.
#[derive(Clone)]
struct FetchJob {
    location: ObjectLocation,
    object: String,
    /// The cache entry it fills.
    entry: u64,
    path: PathBuf,
    file_bytes: u64,
    table_checksum: u64,
    metadata: ShardMetadata,
    requests: Arc<tokio::sync::Semaphore>,
    metrics: Arc<Metrics>,
}

impl ObjectCache {
    /// Opens (creating it) and locks the cache directory, removes what fetches a stopped daemon
    /// left half-written, indexes the shard files it holds and evicts the oldest beyond the
    /// budget.
    pub fn open(
        settings: ObjectCacheSettings,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<ObjectCache>, RemoteError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| RemoteError::Io { path, source }
        };
        std::fs::create_dir_all(&settings.dir).map_err(io(&settings.dir))?;
        let lock = crate::durable::WriterLock::take(&settings.dir)?;
        let mut found: Vec<(PathBuf, u64, std::time::SystemTime)> = Vec::new();
        let mut removed = 0usize;
        for dataset_dir in std::fs::read_dir(&settings.dir).map_err(io(&settings.dir))? {
            let dataset_dir = dataset_dir.map_err(io(&settings.dir))?.path();
            if !dataset_dir.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&dataset_dir).map_err(io(&dataset_dir))? {
                let entry = entry.map_err(io(&dataset_dir))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                let path = entry.path();
                if name.starts_with('.') {
                    // Written aside by a fetch that never finished: the directory is locked, so
                    // no other daemon is writing it.
                    if std::fs::remove_file(&path).is_ok() {
                        removed += 1;
                    }
                } else if name.ends_with(".gfs") {
                    let meta = entry.metadata().map_err(io(&path))?;
                    let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                    found.push((path, meta.len(), modified));
                }
            }
        }
        found.sort_by_key(|(_, _, modified)| *modified);
        let mut state = CacheState::default();
        for (path, bytes, _) in found {
            state.clock += 1;
            state.next_id += 1;
            state.used_bytes += bytes;
            let file = CachedFile {
                id: state.next_id,
                bytes,
                last_used: state.clock,
                pins: 0,
                complete: true,
            };
            state.files.insert(path, file);
        }
        let counters = metrics.object_cache();
        counters
            .budget_bytes
            .store(settings.bytes_max, Ordering::Relaxed);
        let runtime = IoRuntime::new(RUNTIME_THREADS).map_err(io(&settings.dir))?;
        let cache = ObjectCache {
            requests: Arc::new(tokio::sync::Semaphore::new(
                settings.requests_in_flight.clamp(1, REQUESTS_IN_FLIGHT_MAX),
            )),
            settings,
            state: Mutex::new(state),
            settled: Condvar::new(),
            metrics,
            runtime,
            _lock: lock,
        };
        {
            let mut state = cache.lock();
            // Over budget after a restart with a smaller one: the oldest go.
            let _ = cache.reserve(&mut state, 0, "the cache directory");
            tracing::info!(
                "object cache {}: {} shard files, {} bytes of a {}-byte budget; removed {removed} \
                 files a stopped fetch left",
                cache.settings.dir.display(),
                state.files.len(),
                state.used_bytes,
                cache.settings.bytes_max
            );
            cache.publish_bytes(&state);
        }
        Ok(Arc::new(cache))
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.settings.dir
    }

    /// The runtime the cache's requests run on (registration uses it too).
    pub fn runtime(&self) -> &IoRuntime {
        &self.runtime
    }

    /// Ranged GETs allowed in flight at once (registration's metadata requests share them).
    pub(crate) fn requests(&self) -> &Arc<tokio::sync::Semaphore> {
        &self.requests
    }

    /// The daemon's metrics, where the cache counts.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// What the cache holds now.
    pub fn snapshot(&self) -> CacheSnapshot {
        let state = self.lock();
        CacheSnapshot {
            used_bytes: state.used_bytes,
            bytes_max: self.settings.bytes_max,
            files: state.files.len() as u64,
            pinned_files: state.files.values().filter(|file| file.pins > 0).count() as u64,
        }
    }

    /// Whether the shard file at `path` is complete in the cache.
    pub fn holds(&self, path: &Path) -> bool {
        self.lock()
            .files
            .get(path)
            .is_some_and(|file| file.complete)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.state.lock().expect("object cache lock poisoned")
    }

    fn publish_bytes(&self, state: &CacheState) {
        self.metrics
            .object_cache()
            .bytes
            .store(state.used_bytes, Ordering::Relaxed);
    }

    /// Makes room for `bytes` more (evicting unpinned files, least recently used first) and
    /// counts them as used; refused, naming `url`, when pinned files leave no room.
    fn reserve(&self, state: &mut CacheState, bytes: u64, url: &str) -> Result<(), RemoteError> {
        while state.used_bytes + bytes > self.settings.bytes_max {
            let victim = state
                .files
                .iter()
                .filter(|(_, file)| file.complete && file.pins == 0)
                .min_by_key(|(_, file)| file.last_used)
                .map(|(path, _)| path.clone());
            let Some(path) = victim else {
                return Err(RemoteError::Budget {
                    url: url.to_string(),
                    needed_bytes: bytes,
                    bytes_max: self.settings.bytes_max,
                    pinned_bytes: state.used_bytes,
                });
            };
            let file = state.files.remove(&path).expect("chosen above");
            state.used_bytes -= file.bytes;
            if let Err(error) = std::fs::remove_file(&path) {
                tracing::warn!("object cache: cannot remove {}: {error}", path.display());
            }
            self.metrics
                .object_cache()
                .evictions
                .fetch_add(1, Ordering::Relaxed);
        }
        state.used_bytes += bytes;
        Ok(())
    }

    /// Pins every shard of `dataset` (registered from `location`) in the cache, fetching in
    /// shard order those it does not hold, and returns once all are complete and verified. The
    /// shards stay until the pins are dropped.
    pub fn acquire(
        self: &Arc<Self>,
        location: &ObjectLocation,
        dataset: &Dataset,
    ) -> Result<ShardPins, RemoteError> {
        let all: Vec<usize> = (0..dataset.shards.len()).collect();
        let mut held = HashMap::new();
        let fetches = self.pin(location, dataset, &all, &mut held)?;
        let pins = ShardPins {
            cache: Arc::clone(self),
            held: held.into_values().collect(),
        };
        self.fetch_now(location, dataset, fetches)?;
        self.wait_complete(location, &pins.held)?;
        Ok(pins)
    }

    /// Pins `shards` of `dataset` for a holder whose pins are `held` (shard index to the path
    /// and entry it pinned; shards already there are left alone): those the cache holds or is
    /// fetching are pinned, room is made for the others, which are returned, to be fetched
    /// (they carry a second pin, the fetch's, which [`ObjectCache::finish`] drops). Refused,
    /// with nothing of this call left pinned, when the budget has no room.
    pub(crate) fn pin(
        &self,
        location: &ObjectLocation,
        dataset: &Dataset,
        shards: &[usize],
        held: &mut HashMap<usize, (PathBuf, u64)>,
    ) -> Result<Vec<usize>, RemoteError> {
        let counters = self.metrics.object_cache();
        let mut state = self.lock();
        let mut pinned_now: Vec<usize> = Vec::new();
        let mut fetches = Vec::new();
        // Those the cache holds first, so that making room for the others never evicts them.
        let (present, absent): (Vec<usize>, Vec<usize>) = shards.iter().partition(|&&index| {
            let path = &dataset.shards[index].path;
            state
                .files
                .get(path)
                .is_some_and(|file| file.bytes == dataset.manifest.shards[index].file_bytes)
        });
        for index in present.into_iter().chain(absent) {
            if held.contains_key(&index) {
                continue;
            }
            let entry = &dataset.manifest.shards[index];
            let path = dataset.shards[index].path.clone();
            state.clock += 1;
            let now = state.clock;
            if let Some(file) = state.files.get_mut(&path) {
                if file.bytes == entry.file_bytes {
                    file.pins += 1;
                    file.last_used = now;
                    if file.complete {
                        counters.hits.fetch_add(1, Ordering::Relaxed);
                        // The last use survives a restart as the file's modification time.
                        let _ = std::fs::File::options()
                            .write(true)
                            .open(&path)
                            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
                    }
                    held.insert(index, (path, file.id));
                    pinned_now.push(index);
                    continue;
                }
                // A file of another length under the shard's name is not this shard: fetched
                // again, unless a stream holds it.
                if file.pins > 0 || !file.complete {
                    let what = format!(
                        "the cache holds {} bytes under {}, the manifest says {}, and a stream \
                         reads it",
                        file.bytes,
                        path.display(),
                        entry.file_bytes
                    );
                    drop(state);
                    self.undo_pins(held, &pinned_now);
                    return Err(RemoteError::Corrupt {
                        url: location.object_url(&entry.file),
                        what,
                    });
                }
                let bytes = file.bytes;
                state.files.remove(&path);
                state.used_bytes -= bytes;
                let _ = std::fs::remove_file(&path);
            }
            let url = location.object_url(&entry.file);
            if let Err(error) = self.reserve(&mut state, entry.file_bytes, &url) {
                drop(state);
                self.undo_pins(held, &pinned_now);
                return Err(error);
            }
            state.next_id += 1;
            let id = state.next_id;
            let file = CachedFile {
                id,
                bytes: entry.file_bytes,
                last_used: now,
                pins: 2,
                complete: false,
            };
            state.files.insert(path.clone(), file);
            held.insert(index, (path, id));
            pinned_now.push(index);
            fetches.push(index);
            counters.misses.fetch_add(1, Ordering::Relaxed);
        }
        self.publish_bytes(&state);
        Ok(fetches)
    }

    /// Undoes the pins `pin` took in this call (`shards`), the fetch's pins of new entries too.
    fn undo_pins(&self, held: &mut HashMap<usize, (PathBuf, u64)>, shards: &[usize]) {
        let mut entries = Vec::new();
        {
            let mut state = self.lock();
            for index in shards {
                let Some((path, id)) = held.remove(index) else {
                    continue;
                };
                if let Some(file) = state.files.get_mut(&path).filter(|f| f.id == id) {
                    if !file.complete {
                        // Not fetched by this call after all: the fetch's pin goes too.
                        file.pins -= 1;
                    }
                }
                entries.push((path, id));
            }
            self.publish_bytes(&state);
        }
        self.unpin(&entries);
    }

    /// Drops one pin of each entry; an entry left unpinned and incomplete (its fetch never ran)
    /// is removed with its reservation.
    pub(crate) fn unpin(&self, entries: &[(PathBuf, u64)]) {
        let mut state = self.lock();
        for (path, id) in entries {
            let Some(file) = state.files.get_mut(path).filter(|file| file.id == *id) else {
                continue;
            };
            file.pins -= 1;
            if !file.complete && file.pins == 0 {
                let bytes = file.bytes;
                state.files.remove(path);
                state.used_bytes -= bytes;
            }
        }
        self.publish_bytes(&state);
        drop(state);
        self.settled.notify_all();
    }

    /// Fetches shards `fetches` (returned by `pin`) and waits for them; the first error.
    pub(crate) fn fetch_now(
        &self,
        location: &ObjectLocation,
        dataset: &Dataset,
        fetches: Vec<usize>,
    ) -> Result<(), RemoteError> {
        if fetches.is_empty() {
            return Ok(());
        }
        let jobs = self.fetch_jobs(location, dataset, &fetches);
        let results = self.runtime.run(fetch_all(jobs));
        self.finish(results)
    }

    /// Fetches shards `fetches` (returned by `pin`) in the background.
    pub(crate) fn fetch_later(
        self: &Arc<Self>,
        location: &ObjectLocation,
        dataset: &Dataset,
        fetches: Vec<usize>,
    ) {
        if fetches.is_empty() {
            return;
        }
        let jobs = self.fetch_jobs(location, dataset, &fetches);
        let cache = Arc::clone(self);
        drop(self.runtime.spawn(async move {
            let results = fetch_all(jobs).await;
            if let Err(error) = cache.finish(results) {
                tracing::warn!("fetching ahead: {error}");
            }
        }));
    }

    /// Records what fetches ended with: each entry complete, or removed with its reservation
    /// (its holders then find it gone); drops the fetches' pins. Returns the first error.
    fn finish(
        &self,
        results: Vec<(FetchJob, Result<u64, RemoteError>)>,
    ) -> Result<(), RemoteError> {
        let mut first_error = None;
        {
            let mut state = self.lock();
            for (job, result) in results {
                let Some(file) = state
                    .files
                    .get_mut(&job.path)
                    .filter(|file| file.id == job.entry)
                else {
                    continue;
                };
                match result {
                    Ok(_) => {
                        file.complete = true;
                        file.pins -= 1;
                    }
                    Err(error) => {
                        let bytes = file.bytes;
                        state.files.remove(&job.path);
                        state.used_bytes -= bytes;
                        first_error.get_or_insert(error);
                    }
                }
            }
            self.publish_bytes(&state);
        }
        self.settled.notify_all();
        first_error.map_or(Ok(()), Err)
    }

    /// Waits until every entry of `entries` is complete; an error if one's fetch failed.
    pub(crate) fn wait_complete(
        &self,
        location: &ObjectLocation,
        entries: &[(PathBuf, u64)],
    ) -> Result<(), RemoteError> {
        let mut state = self.lock();
        for (path, id) in entries {
            loop {
                match state.files.get(path) {
                    Some(file) if file.id == *id && file.complete => break,
                    Some(file) if file.id == *id => {
                        state = self
                            .settled
                            .wait(state)
                            .expect("object cache lock poisoned");
                    }
                    _ => {
                        return Err(RemoteError::Store {
                            url: location.url().to_string(),
                            reason: format!(
                                "the fetch of {} failed (its error is in the log); open the \
                                 stream again to retry",
                                path.display()
                            ),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    fn fetch_jobs(
        &self,
        location: &ObjectLocation,
        dataset: &Dataset,
        fetches: &[usize],
    ) -> Vec<FetchJob> {
        let state = self.lock();
        fetches
            .iter()
            .map(|&index| {
                let entry = &dataset.manifest.shards[index];
                let path = dataset.shards[index].path.clone();
                FetchJob {
                    location: location.clone(),
                    object: entry.file.clone(),
                    entry: state.files.get(&path).map_or(0, |file| file.id),
                    path,
                    file_bytes: entry.file_bytes,
                    table_checksum: entry.table_checksum,
                    metadata: dataset.shards[index].metadata.clone(),
                    requests: Arc::clone(&self.requests),
                    metrics: Arc::clone(&self.metrics),
                }
            })
            .collect()
    }
}

/// Fetches `jobs`, in order, a bounded number at once (each holds a file open while its ranges
/// wait for the cache's request permits).
async fn fetch_all(jobs: Vec<FetchJob>) -> Vec<(FetchJob, Result<u64, RemoteError>)> {
    use futures_util::StreamExt;
    futures_util::stream::iter(jobs)
        .map(|job| async move {
            let result = fetch_shard(job.clone()).await.map(|()| job.file_bytes);
            (job, result)
        })
        .buffered(SHARDS_IN_FLIGHT)
        .collect()
        .await
}

/// Times a shard is fetched at most when what arrives does not verify.
const SHARD_FETCHES_MAX: u32 = 3;

/// Fetches one shard into place, again (up to [`SHARD_FETCHES_MAX`] times) when what arrived does
/// not verify, since a transfer may have been damaged. A shard whose blocks fail the same way in
/// two fetches is the object's own corruption and is kept, so that readers apply the
/// corrupt-block policy to those blocks as they do for a local shard.
async fn fetch_shard(job: FetchJob) -> Result<(), RemoteError> {
    let url = job.location.object_url(&job.object);
    let corrupt = || {
        job.metrics
            .object_cache()
            .corrupt_fetches
            .fetch_add(1, Ordering::Relaxed)
    };
    let mut previous_bad: Option<Vec<usize>> = None;
    let mut attempt = 1;
    loop {
        let temporary = crate::durable::hidden_beside(&job.path, "fetch")
            .expect("a shard path has a file name");
        let outcome = fetch_into(&job, &temporary).await;
        let last = attempt >= SHARD_FETCHES_MAX;
        let bad_blocks = match outcome {
            Ok(bad) => bad,
            Err(error) => {
                let _ = std::fs::remove_file(&temporary);
                if matches!(error, RemoteError::Corrupt { .. }) && !last {
                    corrupt();
                    tracing::warn!("{error}; fetching it again");
                    attempt += 1;
                    continue;
                }
                return Err(error);
            }
        };
        if !bad_blocks.is_empty() {
            corrupt();
            let repeated = previous_bad.as_ref() == Some(&bad_blocks);
            if !repeated {
                let _ = std::fs::remove_file(&temporary);
                if last {
                    return Err(RemoteError::Corrupt {
                        url,
                        what: format!(
                            "blocks {bad_blocks:?} do not match their checksums, and other \
                             blocks did in earlier fetches: the transfers are damaged"
                        ),
                    });
                }
                tracing::warn!(
                    "{url}: {} blocks do not match their checksums; fetching it again",
                    bad_blocks.len()
                );
                previous_bad = Some(bad_blocks);
                attempt += 1;
                continue;
            }
            tracing::warn!(
                "{url}: blocks {bad_blocks:?} do not match their checksums in two fetches: the \
                 object is corrupt; kept, and readers apply the corrupt-block policy to them"
            );
        }
        let installed = tokio::task::spawn_blocking({
            let path = job.path.clone();
            move || crate::durable::rename_synced(&temporary, &path)
        })
        .await
        .expect("the rename task runs to its end");
        installed?;
        job.metrics
            .object_cache()
            .fetched_bytes
            .fetch_add(job.file_bytes, Ordering::Relaxed);
        return Ok(());
    }
}

/// Fetches `job`'s shard into `temporary` with ranged GETs in parallel and verifies it; returns
/// the indices of the blocks whose payloads do not match their checksums.
async fn fetch_into(job: &FetchJob, temporary: &Path) -> Result<Vec<usize>, RemoteError> {
    let io = |source| RemoteError::Io {
        path: temporary.to_path_buf(),
        source,
    };
    // Read back by the verification: opened for both.
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create_new(true)
        .open(temporary)
        .map_err(io)?;
    file.set_len(job.file_bytes).map_err(io)?;
    let file = Arc::new(file);
    let ranges = (0..job.file_bytes)
        .step_by(RANGE_BYTES as usize)
        .map(|start| start..(start + RANGE_BYTES).min(job.file_bytes));
    let gets = ranges.map(|range| {
        let file = Arc::clone(&file);
        async move {
            let _permit = job
                .requests
                .acquire()
                .await
                .expect("the request semaphore is never closed");
            let errors = &job.metrics.object_cache().fetch_errors;
            let bytes = job
                .location
                .get_range(&job.object, range.clone(), errors)
                .await?;
            let path = temporary.to_path_buf();
            tokio::task::spawn_blocking(move || {
                file.write_all_at(&bytes, range.start)
                    .map_err(|source| RemoteError::Io { path, source })
            })
            .await
            .expect("the write task runs to its end")
        }
    });
    futures_util::future::try_join_all(gets).await?;
    let (job, path) = (job.clone(), temporary.to_path_buf());
    tokio::task::spawn_blocking(move || verify(&job, &path, &file))
        .await
        .expect("the verification task runs to its end")
}

/// Syncs the fetched file and checks it: its header and tables parse and match the manifest and
/// the metadata read at registration; returns the blocks whose payloads do not hash to their
/// checksums.
fn verify(job: &FetchJob, path: &Path, file: &std::fs::File) -> Result<Vec<usize>, RemoteError> {
    let io = |source| RemoteError::Io {
        path: path.to_path_buf(),
        source,
    };
    let url = job.location.object_url(&job.object);
    file.sync_all().map_err(io)?;
    let mut prefix = vec![0u8; job.metadata.header.payload_offset as usize];
    file.read_exact_at(&mut prefix, 0).map_err(io)?;
    let metadata = parse_shard_metadata(path, &prefix, job.file_bytes).map_err(|error| {
        RemoteError::Corrupt {
            url: url.clone(),
            what: format!("its metadata does not parse: {error}"),
        }
    })?;
    if metadata.table_checksum != job.table_checksum || metadata != job.metadata {
        return Err(RemoteError::Corrupt {
            url,
            what: format!(
                "its tables (checksum {:016x}) are not those registered (checksum {:016x} in \
                 the manifest)",
                metadata.table_checksum, job.table_checksum
            ),
        });
    }
    let mut payload = Vec::new();
    let mut bad = Vec::new();
    for (index, block) in metadata.blocks.iter().enumerate() {
        payload.resize(block.stored_bytes as usize, 0);
        file.read_exact_at(&mut payload, block.stored_offset)
            .map_err(io)?;
        if checksum(&payload) != block.checksum {
            bad.push(index);
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
    use crate::remote::dataset::RemoteDataset;
    use std::sync::atomic::AtomicU64;

    /// Packs a dataset `name` of 4 shards into `dir` and returns the bytes of its shards.
    fn pack(dir: &Path, name: &str) -> u64 {
        let bytes: Vec<u8> = (0..4096u32).flat_map(u32::to_le_bytes).collect();
        let field =
            crate::input::FieldSource::from_bytes("v", gpufeed_proto::DType::U32, vec![4], bytes)
                .unwrap();
        let options = PackOptions {
            name: name.to_string(),
            block_bytes: 4096,
            samples_per_shard: Some(256),
            codec: CodecChoice::Raw,
            shuffle: ShuffleChoice::Off,
            on_existing: OnExisting::Refuse,
            threads: 1,
        };
        let summary = crate::pack::pack(&dir.join(name), &[field], &options, &Quiet).unwrap();
        let manifest = crate::format::Manifest::load(&summary.dir).unwrap();
        manifest.shards.iter().map(|shard| shard.file_bytes).sum()
    }

    #[test]
    fn shards_a_stream_holds_are_never_evicted_and_go_once_released() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        pack(dir.path(), "b");
        let metrics = Arc::new(Metrics::new());
        let budget = bytes + bytes / 2;
        let settings = ObjectCacheSettings {
            dir: dir.path().join("cache"),
            bytes_max: budget,
            requests_in_flight: 4,
        };
        let cache = ObjectCache::open(settings, Arc::clone(&metrics)).unwrap();
        let url = |name: &str| format!("file://{}/{name}", dir.path().display());
        let (a, a_dataset) = RemoteDataset::open(&cache, &url("a")).unwrap();
        let (b, b_dataset) = RemoteDataset::open(&cache, &url("b")).unwrap();
        let held = a.acquire(&a_dataset).unwrap();
        assert_eq!(held.len(), 4);
        let refused = b.acquire(&b_dataset).map(|_| ()).unwrap_err();
        assert!(matches!(refused, RemoteError::Budget { .. }), "{refused}");
        assert!(refused.to_string().contains(&url("b")), "{refused}");
        // Refused whole: nothing of b is held, every shard of a is still there.
        assert_eq!(cache.snapshot().pinned_files, 4);
        assert!(a_dataset
            .shards
            .iter()
            .all(|shard| cache.holds(&shard.path)));
        drop(held);
        let _b = b.acquire(&b_dataset).unwrap();
        let counts = metrics.object_cache().snapshot();
        assert!(counts.evictions > 0, "{counts:?}");
        assert!(cache.snapshot().used_bytes <= budget);
        assert!(b_dataset
            .shards
            .iter()
            .all(|shard| cache.holds(&shard.path)));
    }

    /// Faults a [`FaultyStore`] puts into the GETs of shard files (`.gfs` objects; HEADs and the
    /// manifest pass untouched), and the GETs it saw: tests set up retries and overlapping fetches
    /// with these, not with timing.
    #[derive(Debug)]
    struct Faults {
        /// Shard GETs asked for, those failed, damaged or held included.
        shard_gets: AtomicU64,
        /// This many of the next shard GETs fail as they do while the store is down (an error of
        /// the store, which the cache retries).
        failing_gets: AtomicU64,
        /// This many shard GETs (after the failing ones) answer with their last byte changed, as
        /// a transfer damaged on the way would.
        damaged_gets: AtomicU64,
        /// Shard GETs take a permit of this before they are answered: closed, it holds them until
        /// the test opens it.
        gate: tokio::sync::Semaphore,
        /// Told of each shard GET as it arrives (bounded: tests wait for the first few only).
        arrivals: Mutex<std::sync::mpsc::SyncSender<()>>,
    }

    /// Whether shard GETs are answered at once or held until the test opens the gate.
    #[derive(Clone, Copy)]
    enum Gate {
        Open,
        Closed,
    }

    /// Permits of an open gate: more than the GETs of any test here.
    const GATE_OPEN_PERMITS: usize = 1 << 20;

    impl Faults {
        fn new(gate: Gate) -> (Arc<Faults>, std::sync::mpsc::Receiver<()>) {
            let (arrived, arrivals) = std::sync::mpsc::sync_channel(64);
            let permits = match gate {
                Gate::Open => GATE_OPEN_PERMITS,
                Gate::Closed => 0,
            };
            let faults = Faults {
                shard_gets: AtomicU64::new(0),
                failing_gets: AtomicU64::new(0),
                damaged_gets: AtomicU64::new(0),
                gate: tokio::sync::Semaphore::new(permits),
                arrivals: Mutex::new(arrived),
            };
            (Arc::new(faults), arrivals)
        }

        fn open_gate(&self) {
            self.gate.add_permits(GATE_OPEN_PERMITS);
        }

        /// Takes one of `count`: whether there was one left.
        fn take(count: &AtomicU64) -> bool {
            count
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        }
    }

    /// A store in front of another that applies [`Faults`] to the GETs of shard files.
    #[derive(Debug)]
    struct FaultyStore {
        inner: Arc<dyn object_store::ObjectStore>,
        faults: Arc<Faults>,
    }

    impl std::fmt::Display for FaultyStore {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "FaultyStore({})", self.inner)
        }
    }

    type StoreFuture<'a, T> =
        std::pin::Pin<Box<dyn std::future::Future<Output = object_store::Result<T>> + Send + 'a>>;

    // The trait's async methods as `async_trait` declares them, written out: the crate is not a
    // dependency of ours.
    impl object_store::ObjectStore for FaultyStore {
        fn put_opts<'life0, 'life1, 'async_trait>(
            &'life0 self,
            location: &'life1 object_store::path::Path,
            payload: object_store::PutPayload,
            opts: object_store::PutOptions,
        ) -> StoreFuture<'async_trait, object_store::PutResult>
        where
            'life0: 'async_trait,
            'life1: 'async_trait,
            Self: 'async_trait,
        {
            self.inner.put_opts(location, payload, opts)
        }

        fn put_multipart_opts<'life0, 'life1, 'async_trait>(
            &'life0 self,
            location: &'life1 object_store::path::Path,
            opts: object_store::PutMultipartOptions,
        ) -> StoreFuture<'async_trait, Box<dyn object_store::MultipartUpload>>
        where
            'life0: 'async_trait,
            'life1: 'async_trait,
            Self: 'async_trait,
        {
            self.inner.put_multipart_opts(location, opts)
        }

        fn get_opts<'life0, 'life1, 'async_trait>(
            &'life0 self,
            location: &'life1 object_store::path::Path,
            options: object_store::GetOptions,
        ) -> StoreFuture<'async_trait, object_store::GetResult>
        where
            'life0: 'async_trait,
            'life1: 'async_trait,
            Self: 'async_trait,
        {
            Box::pin(async move {
                let shard = !options.head && location.as_ref().ends_with(".gfs");
                if !shard {
                    return self.inner.get_opts(location, options).await;
                }
                let faults = &self.faults;
                faults.shard_gets.fetch_add(1, Ordering::SeqCst);
                let _ = faults
                    .arrivals
                    .lock()
                    .expect("arrivals lock poisoned")
                    .try_send(());
                drop(faults.gate.acquire().await.expect("never closed"));
                if Faults::take(&faults.failing_gets) {
                    return Err(object_store::Error::Generic {
                        store: "FaultyStore",
                        source: "connection refused (an injected fault)".into(),
                    });
                }
                let result = self.inner.get_opts(location, options).await?;
                if !Faults::take(&faults.damaged_gets) {
                    return Ok(result);
                }
                let (meta, range, attributes) = (
                    result.meta.clone(),
                    result.range.clone(),
                    result.attributes.clone(),
                );
                let mut bytes = result.bytes().await?.to_vec();
                *bytes.last_mut().expect("a shard range is not empty") ^= 0x5a;
                let body = bytes::Bytes::from(bytes);
                let payload = futures_util::stream::once(async move { Ok(body) });
                Ok(object_store::GetResult {
                    payload: object_store::GetResultPayload::Stream(Box::pin(payload)),
                    meta,
                    range,
                    attributes,
                })
            })
        }

        fn delete_stream(
            &self,
            locations: futures_util::stream::BoxStream<
                'static,
                object_store::Result<object_store::path::Path>,
            >,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::path::Path>>
        {
            self.inner.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&object_store::path::Path>,
        ) -> futures_util::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>
        {
            self.inner.list(prefix)
        }

        fn list_with_delimiter<'life0, 'life1, 'async_trait>(
            &'life0 self,
            prefix: Option<&'life1 object_store::path::Path>,
        ) -> StoreFuture<'async_trait, object_store::ListResult>
        where
            'life0: 'async_trait,
            'life1: 'async_trait,
            Self: 'async_trait,
        {
            self.inner.list_with_delimiter(prefix)
        }

        fn copy_opts<'life0, 'life1, 'life2, 'async_trait>(
            &'life0 self,
            from: &'life1 object_store::path::Path,
            to: &'life2 object_store::path::Path,
            options: object_store::CopyOptions,
        ) -> StoreFuture<'async_trait, ()>
        where
            'life0: 'async_trait,
            'life1: 'async_trait,
            'life2: 'async_trait,
            Self: 'async_trait,
        {
            self.inner.copy_opts(from, to, options)
        }
    }

    /// A cache of `bytes_max` bytes in `dir/cache`, and the metrics it counts in.
    fn open_cache(dir: &Path, bytes_max: u64) -> (Arc<ObjectCache>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let settings = ObjectCacheSettings {
            dir: dir.join("cache"),
            bytes_max,
            requests_in_flight: 4,
        };
        let cache = ObjectCache::open(settings, Arc::clone(&metrics)).unwrap();
        (cache, metrics)
    }

    /// Dataset `name`, packed in `dir`, registered in `cache`; and its location, its store behind
    /// `faults`.
    fn register(
        cache: &Arc<ObjectCache>,
        dir: &Path,
        name: &str,
        faults: &Arc<Faults>,
    ) -> (ObjectLocation, Dataset) {
        let url = format!("file://{}/{name}", dir.display());
        let (_, dataset) = RemoteDataset::open(cache, &url).unwrap();
        let location = ObjectLocation::parse(&url)
            .unwrap()
            .wrapping_store(|inner| {
                Arc::new(FaultyStore {
                    inner,
                    faults: Arc::clone(faults),
                })
            });
        (location, dataset)
    }

    /// Uses shard `index` of `dataset` as a stream does: pinned (fetched if the cache lacks it),
    /// then let go.
    fn use_shard(
        cache: &Arc<ObjectCache>,
        location: &ObjectLocation,
        dataset: &Dataset,
        index: usize,
    ) {
        let mut held = HashMap::new();
        let fetches = cache.pin(location, dataset, &[index], &mut held).unwrap();
        cache.fetch_now(location, dataset, fetches).unwrap();
        let entries: Vec<(PathBuf, u64)> = held.into_values().collect();
        cache.wait_complete(location, &entries).unwrap();
        cache.unpin(&entries);
    }

    /// The bytes of shard `index` of dataset `name` as packed in `dir` (the object's bytes).
    fn object_bytes(dir: &Path, name: &str, dataset: &Dataset, index: usize) -> Vec<u8> {
        std::fs::read(dir.join(name).join(&dataset.manifest.shards[index].file)).unwrap()
    }

    /// Ranged GETs one fetch of every shard of `dataset` makes.
    fn ranges_of(dataset: &Dataset) -> u64 {
        dataset
            .manifest
            .shards
            .iter()
            .map(|shard| shard.file_bytes.div_ceil(RANGE_BYTES))
            .sum()
    }

    /// Every shard of `dataset` is in the cache, byte for byte the object packed in `dir`.
    fn assert_cached_exactly(cache: &ObjectCache, dir: &Path, name: &str, dataset: &Dataset) {
        for (index, shard) in dataset.shards.iter().enumerate() {
            assert!(cache.holds(&shard.path), "shard {index} is not cached");
            assert!(
                std::fs::read(&shard.path).unwrap() == object_bytes(dir, name, dataset, index),
                "the cached shard {index} differs from its object"
            );
        }
    }

    #[test]
    fn eviction_takes_the_least_recently_used_shard_not_the_first_fetched() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        pack(dir.path(), "b");
        // Room for exactly the four shards of one dataset: each shard of another takes the place
        // of one, and the shards are all of one size, so exactly one.
        let (cache, metrics) = open_cache(dir.path(), bytes);
        let (faults, _) = Faults::new(Gate::Open);
        let (a_at, a) = register(&cache, dir.path(), "a", &faults);
        let (b_at, b) = register(&cache, dir.path(), "b", &faults);
        let sizes: Vec<u64> = [&a, &b]
            .iter()
            .flat_map(|dataset| dataset.manifest.shards.iter().map(|s| s.file_bytes))
            .collect();
        assert!(sizes.iter().all(|&size| size == sizes[0]), "{sizes:?}");
        for index in 0..4 {
            use_shard(&cache, &a_at, &a, index);
        }
        // Used again in another order: least recently used first, 2 0 3 1.
        for index in [2, 0, 3, 1] {
            use_shard(&cache, &a_at, &a, index);
        }
        let counts = metrics.object_cache().snapshot();
        assert_eq!((counts.misses, counts.hits, counts.evictions), (4, 4, 0));
        let cached = |dataset: &Dataset| -> Vec<bool> {
            dataset
                .shards
                .iter()
                .map(|shard| {
                    let held = cache.holds(&shard.path);
                    assert_eq!(held, shard.path.exists(), "{}", shard.path.display());
                    held
                })
                .collect()
        };
        use_shard(&cache, &b_at, &b, 0);
        assert_eq!(cached(&a), [true, true, false, true], "b0 must evict a2");
        use_shard(&cache, &b_at, &b, 1);
        assert_eq!(cached(&a), [false, true, false, true], "b1 must evict a0");
        // A hit makes a shard the most recently used: a3 stays, a1 goes.
        use_shard(&cache, &a_at, &a, 3);
        use_shard(&cache, &b_at, &b, 2);
        assert_eq!(cached(&a), [false, false, false, true], "b2 must evict a1");
        assert_eq!(cached(&b), [true, true, true, false]);
        let counts = metrics.object_cache().snapshot();
        assert_eq!((counts.misses, counts.hits, counts.evictions), (7, 5, 3));
        assert_eq!(cache.snapshot().used_bytes, bytes);
        assert_eq!(faults.shard_gets.load(Ordering::SeqCst), 7);
    }

    #[test]
    fn holders_asking_for_a_shard_being_fetched_share_that_fetch() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        let (cache, metrics) = open_cache(dir.path(), 4 * bytes);
        let (faults, arrivals) = Faults::new(Gate::Closed);
        let (location, dataset) = register(&cache, dir.path(), "a", &faults);
        let (location, dataset) = (Arc::new(location), Arc::new(dataset));
        // The first holder pins every shard and fetches them; its GETs are held at the gate.
        let first = std::thread::spawn({
            let (cache, location, dataset) = (
                Arc::clone(&cache),
                Arc::clone(&location),
                Arc::clone(&dataset),
            );
            move || cache.acquire(&location, &dataset)
        });
        arrivals.recv().unwrap();
        // A GET has arrived, so the fetch runs: the second holder pins the same shards.
        let all: Vec<usize> = (0..dataset.shards.len()).collect();
        let mut second = HashMap::new();
        let fetches = cache.pin(&location, &dataset, &all, &mut second).unwrap();
        assert!(fetches.is_empty(), "fetched again: {fetches:?}");
        assert!(
            dataset.shards.iter().all(|shard| !cache.holds(&shard.path)),
            "a shard was complete before the gate opened"
        );
        let second: Vec<(PathBuf, u64)> = second.into_values().collect();
        let waiting = std::thread::spawn({
            let (cache, location, entries) =
                (Arc::clone(&cache), Arc::clone(&location), second.clone());
            move || cache.wait_complete(&location, &entries)
        });
        faults.open_gate();
        let first = first.join().unwrap().unwrap();
        waiting.join().unwrap().unwrap();
        assert_eq!(
            faults.shard_gets.load(Ordering::SeqCst),
            ranges_of(&dataset)
        );
        let counts = metrics.object_cache().snapshot();
        assert_eq!((counts.misses, counts.hits), (4, 0), "{counts:?}");
        assert_eq!(counts.fetched_bytes, bytes, "{counts:?}");
        assert_cached_exactly(&cache, dir.path(), "a", &dataset);
        // Both hold every shard: one holder letting go leaves them pinned by the other.
        assert_eq!(cache.snapshot().pinned_files, 4);
        drop(first);
        assert_eq!(cache.snapshot().pinned_files, 4);
        cache.unpin(&second);
        assert_eq!(cache.snapshot().pinned_files, 0);
    }

    #[test]
    fn a_store_down_for_fewer_tries_than_the_limit_costs_retries_not_the_fetch() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        let (cache, metrics) = open_cache(dir.path(), 4 * bytes);
        let (faults, _) = Faults::new(Gate::Open);
        // Down for every try of a range but its last, wherever the failures fall.
        let failing = u64::from(crate::remote::location::GET_ATTEMPTS_MAX - 1);
        faults.failing_gets.store(failing, Ordering::SeqCst);
        let (location, dataset) = register(&cache, dir.path(), "a", &faults);
        let pins = cache.acquire(&location, &dataset).unwrap();
        assert_eq!(pins.len(), 4);
        assert_cached_exactly(&cache, dir.path(), "a", &dataset);
        assert_eq!(
            faults.shard_gets.load(Ordering::SeqCst),
            ranges_of(&dataset) + failing
        );
        let counts = metrics.object_cache().snapshot();
        assert_eq!(counts.fetch_errors, failing, "{counts:?}");
        assert_eq!(counts.corrupt_fetches, 0, "{counts:?}");
        assert_eq!(counts.fetched_bytes, bytes, "{counts:?}");
    }

    #[test]
    fn a_store_down_past_the_tries_fails_the_fetch_leaving_nothing_then_serves_once_back() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        let (cache, metrics) = open_cache(dir.path(), 4 * bytes);
        let (faults, _) = Faults::new(Gate::Open);
        let (location, dataset) = register(&cache, dir.path(), "a", &faults);
        faults.failing_gets.store(u64::MAX, Ordering::SeqCst);
        let mut held = HashMap::new();
        let fetches = cache.pin(&location, &dataset, &[1], &mut held).unwrap();
        let error = cache
            .fetch_now(&location, &dataset, fetches)
            .unwrap_err()
            .to_string();
        let tries = crate::remote::location::GET_ATTEMPTS_MAX;
        assert!(
            error.contains("shard-") && error.contains(&format!("after {tries} tries")),
            "{error}"
        );
        // Nothing of it is kept: not the file, not its place in the budget, not a half-written
        // file beside it.
        let entries: Vec<(PathBuf, u64)> = held.into_values().collect();
        assert!(cache.wait_complete(&location, &entries).is_err());
        cache.unpin(&entries);
        let shard_dir = dataset.shards[1].path.parent().unwrap();
        let shard_files: Vec<String> = std::fs::read_dir(shard_dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name != crate::format::MANIFEST_FILE_NAME)
            .collect();
        assert!(shard_files.is_empty(), "{shard_files:?}");
        assert_eq!(cache.snapshot().used_bytes, 0);
        assert_eq!(
            metrics.object_cache().snapshot().fetch_errors,
            u64::from(tries)
        );
        // The store back, the shard is fetched afresh.
        faults.failing_gets.store(0, Ordering::SeqCst);
        use_shard(&cache, &location, &dataset, 1);
        assert!(
            std::fs::read(&dataset.shards[1].path).unwrap()
                == object_bytes(dir.path(), "a", &dataset, 1)
        );
    }

    #[test]
    fn a_transfer_damaged_once_is_fetched_again_and_never_installed() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        let (cache, metrics) = open_cache(dir.path(), 4 * bytes);
        let (faults, _) = Faults::new(Gate::Open);
        faults.damaged_gets.store(1, Ordering::SeqCst);
        let (location, dataset) = register(&cache, dir.path(), "a", &faults);
        let _pins = cache.acquire(&location, &dataset).unwrap();
        assert_cached_exactly(&cache, dir.path(), "a", &dataset);
        let counts = metrics.object_cache().snapshot();
        assert_eq!(counts.corrupt_fetches, 1, "{counts:?}");
        assert_eq!(counts.fetch_errors, 0, "{counts:?}");
        assert_eq!(
            faults.shard_gets.load(Ordering::SeqCst),
            ranges_of(&dataset) + 1
        );
    }

    #[test]
    fn two_streams_needing_the_same_shards_share_one_fetch() {
        use crate::pipeline::shard_gate::ShardGate;
        let dir = tempfile::tempdir().unwrap();
        let bytes = pack(dir.path(), "a");
        let (cache, metrics) = open_cache(dir.path(), 4 * bytes);
        let (faults, arrivals) = Faults::new(Gate::Closed);
        let url = format!("file://{}/a", dir.path().display());
        let (remote, dataset) = RemoteDataset::open(&cache, &url).unwrap();
        let remote = remote.wrapping_store(|inner| {
            Arc::new(FaultyStore {
                inner,
                faults: Arc::clone(&faults),
            })
        });
        let dataset = Arc::new(dataset);
        let all: Vec<usize> = (0..dataset.shards.len()).collect();
        let first = Arc::new(remote.stream_shards(Arc::clone(&dataset)));
        let second = Arc::new(remote.stream_shards(Arc::clone(&dataset)));
        // The first stream fetches ahead (its GETs held at the gate); the second names the same
        // shards while that fetch runs, then both ask to hold them.
        first.ahead(&all);
        arrivals.recv().unwrap();
        second.ahead(&all);
        assert!(
            dataset.shards.iter().all(|shard| !cache.holds(&shard.path)),
            "a shard was complete before the gate opened"
        );
        let holding = [&first, &second].map(|stream| {
            let (stream, all) = (Arc::clone(stream), all.clone());
            std::thread::spawn(move || stream.hold(&all))
        });
        faults.open_gate();
        for hold in holding {
            hold.join().unwrap().unwrap();
        }
        assert_eq!(
            faults.shard_gets.load(Ordering::SeqCst),
            ranges_of(&dataset)
        );
        let counts = metrics.object_cache().snapshot();
        assert_eq!(
            (counts.misses, counts.fetched_bytes),
            (4, bytes),
            "{counts:?}"
        );
        assert_cached_exactly(&cache, dir.path(), "a", &dataset);
        // Each stream holds every shard until it lets go.
        first.release(&all);
        assert_eq!(cache.snapshot().pinned_files, 4);
        drop(second);
        assert_eq!(cache.snapshot().pinned_files, 0);
    }
}
