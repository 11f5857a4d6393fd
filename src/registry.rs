//! The datasets a daemon serves, by name, and the directory of its consumer sessions.
//!
//! Both are shared by the socket server (`ipc`), which reads them, and the control API (`api`), which
//! changes them; neither module knows the other.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use crate::format::{Dataset, FormatError, MANIFEST_FILE_NAME};
use crate::metrics::Metrics;
use crate::remote::{ObjectCache, ObjectCacheSettings, RemoteDataset, RemoteError};

/// Datasets by name. Readers take an `Arc` to a dataset; it stays valid while they use it even if it
/// is removed from the registry.
#[derive(Default)]
pub struct Registry {
    datasets: RwLock<BTreeMap<String, Arc<Dataset>>>,
    sessions: SessionDirectory,
    /// Of the datasets, those registered from object storage, by name.
    remote: RwLock<BTreeMap<String, Arc<RemoteDataset>>>,
    object_cache: Mutex<ObjectCacheSlot>,
}

/// The object cache: opened (its directory locked and indexed) when a dataset in object storage
/// is first registered, so that a daemon serving only local datasets never touches it.
#[derive(Default)]
enum ObjectCacheSlot {
    /// Object storage was not configured.
    #[default]
    Unconfigured,
    /// Configured, not opened yet.
    Configured(ObjectCacheSettings, Arc<Metrics>),
    /// Open.
    Open(Arc<ObjectCache>),
}

/// A dataset could not be removed because readers other than the registry hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InUse {
    /// References held outside the registry (each open stream holds at least one).
    pub references: usize,
}

/// A dataset directory under the data root that could not be registered.
#[derive(Debug)]
pub struct Skipped {
    /// The directory.
    pub dir: PathBuf,
    /// Why.
    pub reason: String,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Sets where datasets registered from object storage are cached (opened on first use).
    pub fn configure_object_cache(&self, settings: ObjectCacheSettings, metrics: Arc<Metrics>) {
        *self
            .object_cache
            .lock()
            .expect("object cache slot poisoned") = ObjectCacheSlot::Configured(settings, metrics);
    }

    /// The object cache, opened now if this is its first use; `url` is the dataset asking, for
    /// the error when none is configured.
    pub fn object_cache(&self, url: &str) -> Result<Arc<ObjectCache>, RemoteError> {
        let mut slot = self
            .object_cache
            .lock()
            .expect("object cache slot poisoned");
        let cache = match &*slot {
            ObjectCacheSlot::Open(cache) => return Ok(Arc::clone(cache)),
            ObjectCacheSlot::Unconfigured => {
                return Err(RemoteError::NoCache {
                    url: url.to_string(),
                })
            }
            ObjectCacheSlot::Configured(settings, metrics) => {
                ObjectCache::open(settings.clone(), Arc::clone(metrics))?
            }
        };
        *slot = ObjectCacheSlot::Open(Arc::clone(&cache));
        Ok(cache)
    }

    /// Opens the dataset in object storage at `url` (its manifest and shard metadata) without
    /// registering it; the manifest must name it `name`.
    pub fn open_remote(&self, name: &str, url: &str) -> Result<(RemoteDataset, Dataset), String> {
        let cache = self.object_cache(url).map_err(|error| error.to_string())?;
        let (remote, dataset) =
            RemoteDataset::open(&cache, url).map_err(|error| error.to_string())?;
        if dataset.manifest.name != name {
            return Err(format!(
                "the manifest at {url} names the dataset '{}', not '{name}'",
                dataset.manifest.name
            ));
        }
        Ok((remote, dataset))
    }

    /// Registers a dataset opened from object storage under its manifest name; fails if the name
    /// is taken.
    pub fn insert_remote(&self, dataset: Dataset, remote: RemoteDataset) -> Result<(), String> {
        let name = dataset.manifest.name.clone();
        // (The registry's lock is not taken while this one is held: `remove_unused` takes them
        // in the other order.)
        let taken = self.contains(&name);
        {
            // Listed as remote before it is served, so that no stream reads it as a local one.
            let mut listed = self.remote.write().expect("registry lock poisoned");
            if listed.contains_key(&name) || taken {
                return Err(format!(
                    "dataset name '{name}' is already registered from {}",
                    listed
                        .get(&name)
                        .map_or("a directory", |remote| remote.url())
                ));
            }
            listed.insert(name.clone(), Arc::new(remote));
        }
        self.insert(dataset).inspect_err(|_| {
            self.remote
                .write()
                .expect("registry lock poisoned")
                .remove(&name);
        })
    }

    /// Names of the datasets registered from object storage, sorted.
    pub fn remote_names(&self) -> Vec<String> {
        self.remote
            .read()
            .expect("registry lock poisoned")
            .keys()
            .cloned()
            .collect()
    }

    /// The object storage source of dataset `name`, if it was registered from one.
    pub fn remote(&self, name: &str) -> Option<Arc<RemoteDataset>> {
        self.remote
            .read()
            .expect("registry lock poisoned")
            .get(name)
            .cloned()
    }

    /// Registers every dataset directory directly under `root` (a directory holding `manifest.json`),
    /// under the name in its manifest. Returns the directories that could not be registered.
    pub fn scan(&self, root: &Path) -> std::io::Result<Vec<Skipped>> {
        let mut skipped = Vec::new();
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|path| path.join(MANIFEST_FILE_NAME).is_file())
            .collect();
        dirs.sort();
        for dir in dirs {
            match Dataset::open(&dir) {
                Ok(dataset) => {
                    if let Err(reason) = self.insert(dataset) {
                        skipped.push(Skipped { dir, reason });
                    }
                }
                Err(error) => skipped.push(Skipped {
                    dir,
                    reason: error.to_string(),
                }),
            }
        }
        Ok(skipped)
    }

    /// Registers an open dataset under its manifest name; fails if the name is taken.
    pub fn insert(&self, dataset: Dataset) -> Result<(), String> {
        self.insert_shared(Arc::new(dataset))
    }

    /// Registers a shared dataset under its manifest name; fails if the name is taken.
    pub fn insert_shared(&self, dataset: Arc<Dataset>) -> Result<(), String> {
        let mut datasets = self.datasets.write().expect("registry lock poisoned");
        let name = dataset.manifest.name.clone();
        if let Some(existing) = datasets.get(&name) {
            return Err(format!(
                "dataset name '{name}' is already registered from {}",
                existing.dir.display()
            ));
        }
        datasets.insert(name, dataset);
        Ok(())
    }

    /// Opens the directory of the dataset registered as `name` again and registers what it holds now
    /// in its place, for a dataset packed again in place: streams already open keep the dataset they
    /// opened. The manifest must still name the dataset `name`.
    pub fn reload(&self, name: &str) -> Result<Arc<Dataset>, String> {
        let dir = self
            .get(name)
            .ok_or_else(|| format!("no dataset named '{name}' is registered"))?
            .dir
            .clone();
        let fresh = Dataset::open(&dir).map_err(|error| error.to_string())?;
        if fresh.manifest.name != name {
            return Err(format!(
                "{} now holds dataset '{}', not '{name}'",
                dir.display(),
                fresh.manifest.name
            ));
        }
        let fresh = Arc::new(fresh);
        self.datasets
            .write()
            .expect("registry lock poisoned")
            .insert(name.to_string(), Arc::clone(&fresh));
        Ok(fresh)
    }

    /// Opens `dir` and registers it.
    pub fn open_and_insert(&self, dir: &Path) -> Result<(), FormatError> {
        let dataset = Dataset::open(dir)?;
        self.insert(dataset).map_err(|what| FormatError::Invalid {
            path: dir.to_path_buf(),
            what,
        })
    }

    /// The dataset named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Dataset>> {
        self.datasets
            .read()
            .expect("registry lock poisoned")
            .get(name)
            .cloned()
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.datasets
            .read()
            .expect("registry lock poisoned")
            .keys()
            .cloned()
            .collect()
    }

    /// Whether a dataset is registered under `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.datasets
            .read()
            .expect("registry lock poisoned")
            .contains_key(name)
    }

    /// References to dataset `name` held outside the registry: streams reading it, and anyone else
    /// who called [`Registry::get`] and still holds the result.
    pub fn references(&self, name: &str) -> Option<usize> {
        self.datasets
            .read()
            .expect("registry lock poisoned")
            .get(name)
            .map(|dataset| Arc::strong_count(dataset) - 1)
    }

    /// Removes dataset `name` unless something outside the registry holds it. The check and the
    /// removal happen under the write lock, so no stream can pick the dataset up in between.
    /// Returns `Ok(None)` when no such dataset is registered.
    pub fn remove_unused(&self, name: &str) -> Result<Option<Arc<Dataset>>, InUse> {
        let mut datasets = self.datasets.write().expect("registry lock poisoned");
        let Some(dataset) = datasets.get(name) else {
            return Ok(None);
        };
        let references = Arc::strong_count(dataset) - 1;
        if references > 0 {
            return Err(InUse { references });
        }
        self.remote
            .write()
            .expect("registry lock poisoned")
            .remove(name);
        Ok(datasets.remove(name))
    }

    /// Removes dataset `name` whoever holds it: streams reading it keep their `Arc` and go on until
    /// they end or are closed; no new stream can open it.
    pub fn remove(&self, name: &str) -> Option<Arc<Dataset>> {
        let removed = self
            .datasets
            .write()
            .expect("registry lock poisoned")
            .remove(name);
        self.remote
            .write()
            .expect("registry lock poisoned")
            .remove(name);
        removed
    }

    /// The directory of consumer sessions.
    pub fn sessions(&self) -> &SessionDirectory {
        &self.sessions
    }
}

/// Why a session is being closed from outside, sent to the consumer with the close.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// An operator asked for it (`DELETE /v1/sessions/{id}`).
    Operator,
    /// The dataset its stream reads was removed with `force`.
    DatasetRemoved,
    /// The daemon is shutting down.
    Shutdown,
}

impl std::fmt::Display for CloseReason {
    /// In words, as consumers read it in the error that closes their session.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CloseReason::Operator => "an operator closed it through the control API",
            CloseReason::DatasetRemoved => "the dataset its stream reads was removed",
            CloseReason::Shutdown => "the daemon is shutting down",
        })
    }
}

/// What the socket server tells the directory about a session when it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// The session id sent in `Welcome`.
    pub id: u64,
    /// The peer's uid.
    pub uid: u32,
    /// The client's self-description from `Hello`.
    pub client: String,
    /// When the session started.
    pub started: SystemTime,
}

/// A listed session as the control API reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionSnapshot {
    /// What the session said when it started.
    pub info: SessionInfo,
    /// The dataset its stream reads, once it opened one (for a mixture, `mixture of` its sources
    /// and weights).
    pub dataset: Option<String>,
    /// A mixture stream's datasets (empty otherwise): a forced removal of any of them closes it.
    pub sources: Vec<String>,
}

/// Closes one session: provided by the socket server, which alone knows the wire format. It must
/// not block for long and must not call back into the directory.
pub type SessionCloser = Arc<dyn Fn(CloseReason) + Send + Sync>;

struct ListedSession {
    snapshot: SessionSnapshot,
    closer: SessionCloser,
}

/// The consumer sessions the socket server has listed, for `GET /v1/sessions` and for closing
/// sessions from the control API.
///
/// The socket server calls [`SessionDirectory::attach`] once, then [`SessionDirectory::register`]
/// when a session starts and keeps the returned [`SessionEntry`] for the session's life; dropping the
/// entry unlists the session, however the session ends.
#[derive(Default)]
pub struct SessionDirectory {
    attached: AtomicBool,
    sessions: Mutex<BTreeMap<u64, ListedSession>>,
}

impl SessionDirectory {
    /// Marks the directory as fed by a socket server, so that an empty list means "no sessions"
    /// rather than "nobody reports sessions".
    pub fn attach(&self) {
        self.attached.store(true, Ordering::SeqCst);
    }

    /// Whether a socket server feeds the directory.
    pub fn is_attached(&self) -> bool {
        self.attached.load(Ordering::SeqCst)
    }

    /// Lists a session until the returned entry is dropped.
    pub fn register(&self, info: SessionInfo, closer: SessionCloser) -> SessionEntry<'_> {
        let id = info.id;
        let listed = ListedSession {
            snapshot: SessionSnapshot {
                info,
                dataset: None,
                sources: Vec::new(),
            },
            closer,
        };
        self.lock().insert(id, listed);
        SessionEntry {
            directory: self,
            id,
        }
    }

    /// Every listed session, by id.
    pub fn list(&self) -> Vec<SessionSnapshot> {
        self.lock()
            .values()
            .map(|listed| listed.snapshot.clone())
            .collect()
    }

    /// Closes session `id`; false if it is not listed.
    pub fn close(&self, id: u64, reason: CloseReason) -> bool {
        let closer = self
            .lock()
            .get(&id)
            .map(|listed| Arc::clone(&listed.closer));
        // Called without the lock: closing ends the session, whose entry then unlists it.
        closer.map(|close| close(reason)).is_some()
    }

    /// Closes every session whose stream reads `dataset`; returns how many.
    pub fn close_streams_on(&self, dataset: &str, reason: CloseReason) -> usize {
        let closers: Vec<SessionCloser> = self
            .lock()
            .values()
            .filter(|listed| {
                listed.snapshot.dataset.as_deref() == Some(dataset)
                    || listed
                        .snapshot
                        .sources
                        .iter()
                        .any(|source| source == dataset)
            })
            .map(|listed| Arc::clone(&listed.closer))
            .collect();
        closers.iter().for_each(|close| close(reason));
        closers.len()
    }

    /// Closes every session; returns how many.
    pub fn close_all(&self, reason: CloseReason) -> usize {
        let closers: Vec<SessionCloser> = self
            .lock()
            .values()
            .map(|listed| Arc::clone(&listed.closer))
            .collect();
        closers.iter().for_each(|close| close(reason));
        closers.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, ListedSession>> {
        self.sessions
            .lock()
            .expect("session directory lock poisoned")
    }
}

/// A session's place in the [`SessionDirectory`]; unlists the session when dropped.
pub struct SessionEntry<'a> {
    directory: &'a SessionDirectory,
    id: u64,
}

impl SessionEntry<'_> {
    /// Records the dataset the session's stream reads.
    pub fn set_stream(&self, dataset: &str) {
        self.set_mixture_stream(dataset, Vec::new());
    }

    /// Records that the session's stream is a mixture (named `name`) of `sources`.
    pub fn set_mixture_stream(&self, name: &str, sources: Vec<String>) {
        if let Some(listed) = self.directory.lock().get_mut(&self.id) {
            listed.snapshot.dataset = Some(name.to_string());
            listed.snapshot.sources = sources;
        }
    }
}

impl Drop for SessionEntry<'_> {
    fn drop(&mut self) {
        self.directory.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A forced removal of a dataset closes the streams that read it, a mixture's among them when
    /// the dataset is one of its sources (a mixture's session is listed under its mixture name).
    #[test]
    fn removing_a_source_closes_the_mixtures_that_read_it() {
        let directory = SessionDirectory::default();
        let closed = Arc::new(AtomicUsize::new(0));
        let session = |id: u64| {
            let closed = Arc::clone(&closed);
            let closer: SessionCloser = Arc::new(move |_reason: CloseReason| {
                closed.fetch_add(1, Ordering::SeqCst);
            });
            let info = SessionInfo {
                id,
                uid: 0,
                client: format!("rank {id}"),
                started: SystemTime::UNIX_EPOCH,
            };
            directory.register(info, closer)
        };
        let single = session(1);
        single.set_stream("code");
        let mixture = session(2);
        mixture.set_mixture_stream(
            "mixture of web (0.7), code (0.3)",
            vec!["web".into(), "code".into()],
        );
        let other = session(3);
        other.set_stream("images");
        assert_eq!(
            directory.close_streams_on("code", CloseReason::DatasetRemoved),
            2
        );
        assert_eq!(closed.load(Ordering::SeqCst), 2);
        assert_eq!(
            directory.close_streams_on("web", CloseReason::DatasetRemoved),
            1
        );
    }
}
