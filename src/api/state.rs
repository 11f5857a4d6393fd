//! The control API's shared state ([`Control`]) and the daemon's start-up reconciliation of catalog,
//! data root and registry.
//!
//! ## How the catalog and the data-root scan combine
//!
//! Once a catalog exists it is the source of truth: every dataset in it is registered at start, or,
//! if its directory vanished or no longer opens, listed with state `missing` or `invalid` and the
//! reason. The scan of the data root then only adds dataset directories the catalog does not know
//! (origin `scanned`), skipping those unregistered through the API (the catalog's `unregistered`
//! list), so that `gpufeed serve` on a plain directory of datasets works as before and a
//! `DELETE /v1/datasets/{name}` survives a restart.
//!
//! ## Interrupted jobs
//!
//! A job the catalog shows as queued or running was interrupted by the daemon stopping (a crash, a
//! `kill -9`, a power cut). At start its staging directories (`.NAME.partial-*`) are removed. If its
//! output directory holds a complete dataset (the pack renamed it into place before the daemon died,
//! and the manifest and every shard header open and check), it is registered and the job marked
//! succeeded; otherwise the job is marked failed and nothing is registered.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Semaphore;

use super::confine::{ConfineError, DataRoot};
use super::error::ApiError;
use super::job_table::JobTable;
use super::platform::Platform;
use crate::catalog::{Catalog, CatalogData, CatalogError, DatasetRecord, JobState, Origin};
use crate::config::{JobLimits, Settings};
use crate::format::{Dataset, DiskChange, FormatError, MANIFEST_FILE_NAME};
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::storage::EngineMode;

/// Which requests need the bearer token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthScope {
    /// Requests that change something (every method but GET and HEAD): the API listens on loopback.
    Mutating,
    /// Every request: the API listens on a non-loopback address.
    Everything,
}

/// The API's token policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthPolicy {
    /// The bearer token; `None` leaves every endpoint open (only allowed on loopback).
    pub token: Option<String>,
    /// Which requests need it.
    pub scope: AuthScope,
}

/// What the control API is configured with.
#[derive(Clone, Debug)]
pub struct ApiOptions {
    /// The data root as configured.
    pub data_root: PathBuf,
    /// The token policy.
    pub auth: AuthPolicy,
    /// Largest request body.
    pub body_bytes_max: usize,
    /// Bounds on pack jobs.
    pub jobs: JobLimits,
    /// Threads compressing blocks in each pack job.
    pub pack_threads: usize,
    /// Most raw bytes per second each pack job packs.
    pub pack_bytes_per_s_max: Option<u64>,
    /// Most concurrent verifications (each reads a whole dataset).
    pub verifies_max: u32,
    /// The socket server's session bound, for status.
    pub sessions_max: u32,
    /// The socket server's slot memory bound, for status.
    pub slot_memory_bytes_max: u64,
    /// The configured device, for status.
    pub device: String,
    /// The configured engine, for status.
    pub engine: EngineMode,
    /// What the GPU backends are built with (the registration budget and the pipeline's tuning),
    /// for status.
    pub gpu: crate::config::GpuSettings,
    /// The consumers' socket, for status.
    pub socket_path: PathBuf,
    /// Uids allowed on the socket, for status.
    pub allowed_uids: Vec<u32>,
    /// The control API's configured connection bounds, for status.
    pub http_connections: crate::config::HttpConnections,
}

impl ApiOptions {
    /// The API options of a daemon configured with `settings`.
    pub fn from_settings(settings: &Settings) -> ApiOptions {
        let loopback = settings
            .http
            .addr()
            .is_none_or(|addr| addr.ip().is_loopback());
        ApiOptions {
            data_root: settings.data_root.clone(),
            auth: AuthPolicy {
                token: settings.api_token.clone(),
                scope: if loopback {
                    AuthScope::Mutating
                } else {
                    AuthScope::Everything
                },
            },
            body_bytes_max: usize::try_from(settings.body_bytes_max).unwrap_or(usize::MAX),
            jobs: settings.jobs,
            pack_threads: settings.pack_threads,
            pack_bytes_per_s_max: settings.pack_bytes_per_s_max,
            verifies_max: settings.jobs.running_max,
            sessions_max: settings.sessions_max,
            slot_memory_bytes_max: settings.slot_memory_bytes_max,
            device: settings.device.clone(),
            engine: settings.engine,
            gpu: settings.gpu.clone(),
            socket_path: settings.socket_path.clone(),
            allowed_uids: settings.allowed_uids.clone(),
            http_connections: settings.http_connections,
        }
    }
}

/// The daemon could not start its catalog.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The data root is unusable.
    #[error("data root {path}: {source}")]
    DataRoot {
        /// The configured data root.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The catalog could not be opened or written.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

/// Why a catalog dataset is not being served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DatasetProblem {
    pub state: DatasetState,
    pub reason: String,
}

/// A catalog dataset's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DatasetState {
    /// Registered and its manifest is on disk.
    Ready,
    /// Its directory or a file of it vanished.
    Missing,
    /// It is on disk but does not open (corrupt, or outside the data root).
    Invalid,
    /// A file of it cannot be read (permissions, an I/O error).
    Unreadable,
}

impl DatasetState {
    pub(crate) fn name(self) -> &'static str {
        match self {
            DatasetState::Ready => "ready",
            DatasetState::Missing => "missing",
            DatasetState::Invalid => "invalid",
            DatasetState::Unreadable => "unreadable",
        }
    }
}

/// The state every handler shares.
pub struct Control {
    pub(crate) options: ApiOptions,
    pub(crate) root: DataRoot,
    pub(crate) registry: Arc<Registry>,
    pub(crate) catalog: Catalog,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) jobs: JobTable,
    pub(crate) verify_slots: Arc<Semaphore>,
    pub(crate) platform: tokio::sync::OnceCell<Platform>,
    pub(crate) started: Instant,
    backend: OnceLock<(String, String)>,
    device_tiers: OnceLock<Vec<Arc<crate::pipeline::gpu::DeviceTier>>>,
    problems: Mutex<BTreeMap<String, DatasetProblem>>,
    reserved: Mutex<BTreeSet<String>>,
    shutting_down: AtomicBool,
}

/// A dataset name held by one mutation (a registration, a pack job, a removal) until dropped.
pub(crate) struct Reservation {
    control: Arc<Control>,
    name: String,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.control
            .reserved
            .lock()
            .expect("reservation lock poisoned")
            .remove(&self.name);
    }
}

impl Control {
    /// Locks and reads the catalog under `options.data_root`, settles the jobs a previous daemon left
    /// unfinished, registers the catalog's datasets and those the scan finds, and writes the catalog
    /// if anything changed. Returns the control state and notes worth a warning in the log.
    ///
    /// Blocks on file I/O; call it before the runtime serves requests or on a blocking thread.
    pub fn open(
        options: ApiOptions,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
    ) -> Result<(Arc<Control>, Vec<String>), StartupError> {
        let root = DataRoot::new(&options.data_root).map_err(|source| StartupError::DataRoot {
            path: options.data_root.clone(),
            source,
        })?;
        let catalog = Catalog::open(root.canonical())?;
        let mut notes = Vec::new();
        let mut data = catalog.snapshot();
        let before = data.clone();
        settle_interrupted_jobs(&root, &mut data, &mut notes);
        let problems = register_catalog(&root, &registry, &data, &mut notes);
        scan(&root, &registry, &mut data, &mut notes);
        if data != before {
            catalog.update(|current| {
                *current = data;
                Ok::<_, CatalogError>(())
            })?;
        }
        let control = Control {
            jobs: JobTable::new(options.jobs),
            verify_slots: Arc::new(Semaphore::new(options.verifies_max.max(1) as usize)),
            options,
            root,
            registry,
            catalog,
            metrics,
            platform: tokio::sync::OnceCell::new(),
            started: Instant::now(),
            backend: OnceLock::new(),
            device_tiers: OnceLock::new(),
            problems: Mutex::new(problems),
            reserved: Mutex::new(BTreeSet::new()),
            shutting_down: AtomicBool::new(false),
        };
        Ok((Arc::new(control), notes))
    }

    /// Records what the socket server serves with (`cpu` or `cuda:N`) and why, for status.
    pub fn attach_backend(&self, backend: String, note: String) {
        let _ = self.backend.set((backend, note));
    }

    pub(crate) fn backend(&self) -> Option<&(String, String)> {
        self.backend.get()
    }

    /// Records the memory tier of each served GPU, for status and the device-cache endpoints.
    pub fn attach_device_tiers(&self, tiers: Vec<Arc<crate::pipeline::gpu::DeviceTier>>) {
        let _ = self.device_tiers.set(tiers);
    }

    /// The memory tier of each served GPU (none on the CPU backend).
    pub(crate) fn device_tiers(&self) -> &[Arc<crate::pipeline::gpu::DeviceTier>] {
        self.device_tiers.get().map_or(&[], Vec::as_slice)
    }

    /// The registry the API changes.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The canonical data root.
    pub fn data_root(&self) -> &Path {
        self.root.canonical()
    }

    /// The catalog file.
    pub fn catalog_path(&self) -> &Path {
        self.catalog.path()
    }

    /// Whether shutdown has begun: new jobs are refused.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    pub(crate) fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Reserves `name` for one mutation; 409 if another mutation holds it.
    pub(crate) fn reserve(self: &Arc<Self>, name: &str) -> Result<Reservation, ApiError> {
        let mut reserved = self.reserved.lock().expect("reservation lock poisoned");
        if !reserved.insert(name.to_string()) {
            return Err(ApiError::conflict(format!(
                "dataset '{name}' is being registered, packed or removed by another request"
            )));
        }
        Ok(Reservation {
            control: Arc::clone(self),
            name: name.to_string(),
        })
    }

    /// 409 unless `name` is free in the registry and the catalog (call while holding its
    /// reservation).
    pub(crate) fn check_name_free(&self, name: &str) -> Result<(), ApiError> {
        if self.registry.contains(name) || self.catalog.read(|d| d.datasets.contains_key(name)) {
            return Err(ApiError::conflict(format!(
                "a dataset named '{name}' is already in the catalog"
            )));
        }
        Ok(())
    }

    pub(crate) fn problem(&self, name: &str) -> Option<DatasetProblem> {
        self.problems
            .lock()
            .expect("problem lock poisoned")
            .get(name)
            .cloned()
    }

    pub(crate) fn clear_problem(&self, name: &str) {
        self.problems
            .lock()
            .expect("problem lock poisoned")
            .remove(name);
    }

    /// The state of catalog dataset `name` now: a registered dataset whose manifest vanished since
    /// is reported missing.
    pub(crate) fn dataset_state(&self, name: &str) -> (DatasetState, Option<String>) {
        if self.registry.get(name).is_some() && self.registry.remote(name).is_some() {
            // In object storage: its shards are in the cache only while streams need them.
            return (DatasetState::Ready, None);
        }
        if let Some(dataset) = self.registry.get(name) {
            return match dataset.disk_change() {
                None => (DatasetState::Ready, None),
                Some(change @ (DiskChange::ManifestMissing(_) | DiskChange::ShardMissing(_))) => {
                    (DatasetState::Missing, Some(change.to_string()))
                }
                // Served again, reloaded, when the next stream opens (or after a rescan).
                Some(change @ DiskChange::ManifestChanged(_)) => (
                    DatasetState::Ready,
                    Some(format!(
                        "{change}: the next stream opened reads it again from disk"
                    )),
                ),
                Some(change) => (DatasetState::Unreadable, Some(change.to_string())),
            };
        }
        match self.problem(name) {
            Some(problem) => (problem.state, Some(problem.reason)),
            None => (
                DatasetState::Missing,
                Some("the dataset is in the catalog but not registered".to_string()),
            ),
        }
    }
}

/// Seconds since the Unix epoch now.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Seconds since the Unix epoch as RFC 3339 UTC (`2024-05-01T12:00:00Z`).
pub(crate) fn rfc3339(unix_s: u64) -> String {
    // Howard Hinnant's civil-from-days algorithm (proleptic Gregorian calendar).
    let days = (unix_s / 86_400) as i64;
    let seconds = unix_s % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    )
}

/// Classifies why a dataset does not open.
pub(crate) fn format_problem(error: &FormatError) -> DatasetState {
    match error {
        FormatError::MissingShard { .. } => DatasetState::Missing,
        FormatError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            DatasetState::Missing
        }
        _ => DatasetState::Invalid,
    }
}

/// Removes the staging directories a pack of `dataset` may have left in the root.
pub(crate) fn remove_staging(root: &DataRoot, dataset: &str, notes: &mut Vec<String>) {
    let prefix = format!(".{dataset}.partial-");
    let Ok(entries) = std::fs::read_dir(root.canonical()) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let path = entry.path();
            match std::fs::remove_dir_all(&path) {
                Ok(()) => notes.push(format!(
                    "removed {}, left by an interrupted pack",
                    path.display()
                )),
                Err(error) => notes.push(format!("cannot remove {}: {error}", path.display())),
            }
        }
    }
}

fn settle_interrupted_jobs(root: &DataRoot, data: &mut CatalogData, notes: &mut Vec<String>) {
    let now = unix_now();
    let interrupted: Vec<u64> = data
        .jobs
        .iter()
        .filter(|(_, job)| !job.state.is_finished())
        .map(|(&id, _)| id)
        .collect();
    for id in interrupted {
        let dataset = data.jobs[&id].dataset.clone();
        remove_staging(root, &dataset, notes);
        let out = root.canonical().join(&dataset);
        let complete = !data.datasets.contains_key(&dataset)
            && Dataset::open(&out).is_ok_and(|d| d.manifest.name == dataset);
        let job = data.jobs.get_mut(&id).expect("listed above");
        job.finished_at_unix_s = Some(now);
        if complete {
            job.state = JobState::Succeeded;
            job.error = None;
            job.raw_bytes_done = job.raw_bytes_total;
            data.datasets.insert(
                dataset.clone(),
                DatasetRecord {
                    path: dataset.clone(),
                    origin: Origin::Packed,
                    registered_at_unix_s: now,
                    job: Some(id),
                },
            );
            notes.push(format!(
                "job {id} ({dataset}) had finished packing when the daemon stopped; registered it"
            ));
        } else {
            job.state = JobState::Failed;
            job.error = Some(
                "the daemon stopped during the job; nothing was registered and its staging \
                 directory was removed"
                    .to_string(),
            );
            notes.push(format!(
                "job {id} ({dataset}) was interrupted by the daemon stopping; marked failed"
            ));
        }
    }
}

fn register_catalog(
    root: &DataRoot,
    registry: &Registry,
    data: &CatalogData,
    notes: &mut Vec<String>,
) -> BTreeMap<String, DatasetProblem> {
    let mut problems = BTreeMap::new();
    for (name, record) in &data.datasets {
        if crate::remote::is_object_url(&record.path) {
            let opened = registry
                .open_remote(name, &record.path)
                .and_then(|(remote, dataset)| registry.insert_remote(dataset, remote));
            if let Err(reason) = opened {
                notes.push(format!("catalog dataset '{name}' is missing: {reason}"));
                let state = DatasetState::Missing;
                problems.insert(name.clone(), DatasetProblem { state, reason });
            }
            continue;
        }
        let opened = root
            .resolve_existing(&record.path)
            .map_err(|error| {
                let state = match error {
                    ConfineError::NotFound { .. } => DatasetState::Missing,
                    _ => DatasetState::Invalid,
                };
                (state, error.to_string())
            })
            .and_then(|confined| {
                Dataset::open(&confined.absolute)
                    .map_err(|error| (format_problem(&error), error.to_string()))
            })
            .and_then(|dataset| {
                if dataset.manifest.name == *name {
                    Ok(dataset)
                } else {
                    Err((
                        DatasetState::Invalid,
                        format!(
                            "its manifest now names the dataset '{}'",
                            dataset.manifest.name
                        ),
                    ))
                }
            })
            .and_then(|dataset| {
                registry
                    .insert(dataset)
                    .map_err(|reason| (DatasetState::Invalid, reason))
            });
        if let Err((state, reason)) = opened {
            notes.push(format!(
                "catalog dataset '{name}' is {}: {reason}",
                state.name()
            ));
            problems.insert(name.clone(), DatasetProblem { state, reason });
        }
    }
    problems
}

pub(crate) fn scan(
    root: &DataRoot,
    registry: &Registry,
    data: &mut CatalogData,
    notes: &mut Vec<String>,
) {
    let known: BTreeSet<String> = data
        .datasets
        .values()
        .map(|record| record.path.clone())
        .collect();
    let Ok(entries) = std::fs::read_dir(root.canonical()) else {
        notes.push(format!("cannot list {}", root.canonical().display()));
        return;
    };
    let mut dirs: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            // Hidden entries are staging directories and the catalog's own files.
            (!name.starts_with('.') && entry.path().join(MANIFEST_FILE_NAME).is_file())
                .then(|| (name, entry.path()))
        })
        .collect();
    dirs.sort();
    for (relative, dir) in dirs {
        if known.contains(&relative) || data.unregistered.contains(&relative) {
            continue;
        }
        // Only directories that stay inside the root once links are resolved.
        let confined = match root.resolve_existing(&relative) {
            Ok(confined) if confined.relative == Path::new(&relative) => confined,
            Ok(confined) => {
                notes.push(format!(
                    "not serving {}: it is a link to {}",
                    dir.display(),
                    confined.absolute.display()
                ));
                continue;
            }
            Err(error) => {
                notes.push(format!("not serving {}: {error}", dir.display()));
                continue;
            }
        };
        match Dataset::open(&confined.absolute) {
            Ok(dataset) => {
                let name = dataset.manifest.name.clone();
                if data.datasets.contains_key(&name) {
                    notes.push(format!(
                        "not serving {}: dataset name '{name}' is already in the catalog",
                        dir.display()
                    ));
                    continue;
                }
                if let Err(reason) = registry.insert(dataset) {
                    notes.push(format!("not serving {}: {reason}", dir.display()));
                    continue;
                }
                data.datasets.insert(
                    name,
                    DatasetRecord {
                        path: relative,
                        origin: Origin::Scanned,
                        registered_at_unix_s: unix_now(),
                        job: None,
                    },
                );
            }
            Err(error) => notes.push(format!("not serving {}: {error}", dir.display())),
        }
    }
    // Forget unregistered directories that are gone: a new dataset there should be found again.
    data.unregistered
        .retain(|relative| root.canonical().join(relative).exists());
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
