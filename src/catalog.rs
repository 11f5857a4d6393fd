//! The catalog: the datasets a daemon serves and the pack jobs it ran, persisted in the data root as
//! `.gpufeed-catalog.json`.
//!
//! Every change is written whole and atomically: the new catalog goes to a temporary file in the
//! data root, which is fsynced, renamed over the catalog, and the directory fsynced. A crash at any
//! point leaves either the old catalog or the new one, never a torn one; a temporary file left by a
//! crash is removed at the next start. A catalog that does not parse is an error naming the file and
//! is left untouched: the daemon never silently starts over with an empty one.
//!
//! The data root is locked (`flock` on `.gpufeed-catalog.lock`) for as long as the catalog is open,
//! so two daemons never write the same catalog.
//!
//! The format is JSON with exactly these keys (unknown keys are an error):
//!
//! ```json
//! {
//!   "format": "gpufeed-catalog",
//!   "version": 1,
//!   "next_job_id": 3,
//!   "datasets": {
//!     "demo": { "path": "demo", "origin": "packed", "registered_at_unix_s": 1700000000, "job": 2 }
//!   },
//!   "unregistered": ["old-run"],
//!   "jobs": {
//!     "2": { "dataset": "demo", "state": "succeeded", "created_at_unix_s": 1700000000,
//!            "started_at_unix_s": 1700000000, "finished_at_unix_s": 1700000010,
//!            "source": { "fields": [] }, "raw_bytes_total": 1024, "raw_bytes_done": 1024,
//!            "stored_bytes": 512, "error": null }
//!   }
//! }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::durable::{self, write_atomically};

/// The catalog's file name in the data root.
pub const CATALOG_FILE_NAME: &str = ".gpufeed-catalog.json";
/// The lock file's name in the data root.
pub const LOCK_FILE_NAME: &str = ".gpufeed-catalog.lock";
/// The value of the catalog's `format` key.
pub const CATALOG_FORMAT: &str = "gpufeed-catalog";
/// The catalog version this build reads and writes.
pub const CATALOG_VERSION: u32 = 1;
/// Largest catalog file read (64 MiB): far beyond any real catalog, small enough to hold in memory.
pub const CATALOG_BYTES_MAX: u64 = 64 << 20;

/// What the names of the temporary files a catalog write goes through start with, once their
/// leading dots are left out ([`durable::write_atomically`] writes `..gpufeed-catalog.json.tmp-PID-N`;
/// earlier builds wrote `.gpufeed-catalog.json.tmp-PID`).
const TEMP_STEM: &str = "gpufeed-catalog.json.tmp-";

impl From<durable::PathError> for CatalogError {
    fn from(error: durable::PathError) -> CatalogError {
        CatalogError::Io {
            path: error.path,
            source: error.source,
        }
    }
}

/// The catalog could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The catalog file is not a valid catalog. It was left as it is.
    #[error(
        "{path}: the catalog is corrupt ({reason}); it was left untouched. Move it aside to start \
         with an empty catalog: datasets under the data root are then found again by the scan, and \
         the job history is lost"
    )]
    Corrupt {
        /// The catalog file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Another process holds the data root's lock.
    #[error("{path}: another gpufeed daemon uses this data root")]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
}

/// How a dataset came into the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Registered through the API from an already-packed directory.
    Registered,
    /// Written by a pack job of this daemon.
    Packed,
    /// Found by the start-up scan of the data root.
    Scanned,
    /// In object storage, given with `--dataset` at start: listed, never written to the catalog
    /// (the configuration names it at each start).
    Configured,
}

/// One dataset in the catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetRecord {
    /// The dataset directory, relative to the data root.
    pub path: String,
    /// How it came into the catalog.
    pub origin: Origin,
    /// When it was registered, in seconds since the Unix epoch.
    pub registered_at_unix_s: u64,
    /// The pack job that wrote it, for packed datasets.
    pub job: Option<u64>,
}

/// A pack job's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for a running slot.
    Queued,
    /// Packing.
    Running,
    /// Finished; the dataset is registered.
    Succeeded,
    /// Finished with an error; nothing was registered and the staging directory was removed.
    Failed,
    /// Cancelled; nothing was registered and the staging directory was removed.
    Cancelled,
}

impl JobState {
    /// Whether the job has finished (succeeded, failed or cancelled).
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }

    /// The state's name as in the catalog and the API.
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }
}

/// One pack job in the catalog.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRecord {
    /// The dataset the job writes; its directory is `DATA_ROOT/<dataset>`.
    pub dataset: String,
    /// Its state when last written.
    pub state: JobState,
    /// When it was submitted.
    pub created_at_unix_s: u64,
    /// When it started packing.
    pub started_at_unix_s: Option<u64>,
    /// When it finished.
    pub finished_at_unix_s: Option<u64>,
    /// The pack options as submitted (the API's `source` object).
    pub source: serde_json::Value,
    /// Raw bytes to pack, once known.
    pub raw_bytes_total: u64,
    /// Raw bytes packed when the record was last written.
    pub raw_bytes_done: u64,
    /// Payload bytes stored, once the job succeeded.
    pub stored_bytes: Option<u64>,
    /// Why it failed.
    pub error: Option<String>,
}

/// The catalog's content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogData {
    /// Always [`CATALOG_FORMAT`].
    pub format: String,
    /// Always [`CATALOG_VERSION`].
    pub version: u32,
    /// The id the next job gets; ids are never reused.
    pub next_job_id: u64,
    /// Datasets by name.
    pub datasets: BTreeMap<String, DatasetRecord>,
    /// Dataset directories (relative to the data root) that were unregistered but left on disk: the
    /// start-up scan does not register them again.
    pub unregistered: BTreeSet<String>,
    /// Jobs by id.
    pub jobs: BTreeMap<u64, JobRecord>,
}

impl Default for CatalogData {
    fn default() -> CatalogData {
        CatalogData {
            format: CATALOG_FORMAT.to_string(),
            version: CATALOG_VERSION,
            next_job_id: 1,
            datasets: BTreeMap::new(),
            unregistered: BTreeSet::new(),
            jobs: BTreeMap::new(),
        }
    }
}

impl CatalogData {
    /// Parses a catalog file's bytes; `path` names it in errors.
    pub fn from_json(path: &Path, bytes: &[u8]) -> Result<CatalogData, CatalogError> {
        let corrupt = |reason: String| CatalogError::Corrupt {
            path: path.to_path_buf(),
            reason,
        };
        let data: CatalogData =
            serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if data.format != CATALOG_FORMAT {
            return Err(corrupt(format!(
                "format is {:?}, expected {CATALOG_FORMAT:?}",
                data.format
            )));
        }
        if data.version != CATALOG_VERSION {
            return Err(corrupt(format!(
                "version {} is not supported (this gpufeed reads version {CATALOG_VERSION})",
                data.version
            )));
        }
        if let Some(&last) = data.jobs.keys().next_back() {
            if last >= data.next_job_id {
                return Err(corrupt(format!(
                    "job {last} is not below next_job_id {}",
                    data.next_job_id
                )));
            }
        }
        Ok(data)
    }

    /// The catalog as the JSON written to disk.
    pub fn to_json(&self) -> Vec<u8> {
        let mut bytes = serde_json::to_vec_pretty(self).expect("the catalog serializes");
        bytes.push(b'\n');
        bytes
    }
}

/// The open catalog of one data root: its content in memory and the lock on the root.
pub struct Catalog {
    path: PathBuf,
    data: Mutex<CatalogData>,
    // Held for the catalog's life: the flock is released when the file closes.
    _lock: File,
}

impl Catalog {
    /// Locks `root` and reads its catalog; a missing catalog is an empty one (nothing is written
    /// until the first change). Removes temporary files left by a write that a crash interrupted.
    pub fn open(root: &Path) -> Result<Catalog, CatalogError> {
        let lock_path = root.join(LOCK_FILE_NAME);
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|source| CatalogError::Io {
                path: lock_path.clone(),
                source,
            })?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let source = io::Error::last_os_error();
            return Err(if source.kind() == io::ErrorKind::WouldBlock {
                CatalogError::Locked { path: lock_path }
            } else {
                CatalogError::Io {
                    path: lock_path,
                    source,
                }
            });
        }
        remove_temporaries(root)?;
        let path = root.join(CATALOG_FILE_NAME);
        let data = match File::open(&path) {
            Ok(file) => {
                let mut bytes = Vec::new();
                file.take(CATALOG_BYTES_MAX + 1)
                    .read_to_end(&mut bytes)
                    .map_err(|source| CatalogError::Io {
                        path: path.clone(),
                        source,
                    })?;
                if bytes.len() as u64 > CATALOG_BYTES_MAX {
                    return Err(CatalogError::Corrupt {
                        path,
                        reason: format!("larger than {CATALOG_BYTES_MAX} bytes"),
                    });
                }
                CatalogData::from_json(&path, &bytes)?
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => CatalogData::default(),
            Err(source) => return Err(CatalogError::Io { path, source }),
        };
        Ok(Catalog {
            path,
            data: Mutex::new(data),
            _lock: lock,
        })
    }

    /// The catalog file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A copy of the content.
    pub fn snapshot(&self) -> CatalogData {
        self.lock().clone()
    }

    /// Reads the content without copying it.
    pub fn read<T>(&self, reader: impl FnOnce(&CatalogData) -> T) -> T {
        reader(&self.lock())
    }

    /// Applies `change` to a copy of the content and, if it succeeds, writes the copy atomically and
    /// makes it the content. If `change` fails nothing is written; if the write fails the content
    /// stays as it was, on disk and in memory. Changes are serialized: the file always holds the
    /// result of the last successful one.
    pub fn update<T, E: From<CatalogError>>(
        &self,
        change: impl FnOnce(&mut CatalogData) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut data = self.lock();
        let mut next = data.clone();
        let value = change(&mut next)?;
        write_atomically(&self.path, &next.to_json()).map_err(CatalogError::from)?;
        *data = next;
        Ok(value)
    }

    /// Writes the content again (at shutdown, so that the file is known to be complete).
    pub fn flush(&self) -> Result<(), CatalogError> {
        let data = self.lock();
        Ok(write_atomically(&self.path, &data.to_json())?)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CatalogData> {
        self.data.lock().expect("catalog lock poisoned")
    }
}

fn remove_temporaries(root: &Path) -> Result<(), CatalogError> {
    let entries = fs::read_dir(root).map_err(|source| CatalogError::Io {
        path: root.to_path_buf(),
        source,
    })?;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.trim_start_matches('.').starts_with(TEMP_STEM) {
            let path = entry.path();
            tracing::warn!(
                "removing {}, left by a catalog write that did not finish",
                path.display()
            );
            fs::remove_file(&path).map_err(|source| CatalogError::Io { path, source })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(path: &str) -> DatasetRecord {
        DatasetRecord {
            path: path.to_string(),
            origin: Origin::Registered,
            registered_at_unix_s: 1,
            job: None,
        }
    }

    #[test]
    fn missing_catalog_is_empty_and_changes_survive_reopening() {
        let root = tempfile::tempdir().unwrap();
        let catalog = Catalog::open(root.path()).unwrap();
        assert_eq!(catalog.snapshot(), CatalogData::default());
        assert!(
            !catalog.path().exists(),
            "nothing is written before a change"
        );
        catalog
            .update(|data| {
                data.datasets.insert("a".into(), record("a"));
                Ok::<_, CatalogError>(())
            })
            .unwrap();
        drop(catalog);
        let reopened = Catalog::open(root.path()).unwrap();
        assert_eq!(reopened.snapshot().datasets["a"], record("a"));
    }

    #[test]
    fn a_failed_change_writes_nothing() {
        let root = tempfile::tempdir().unwrap();
        let catalog = Catalog::open(root.path()).unwrap();
        let result: Result<(), CatalogError> = catalog.update(|data| {
            data.datasets.insert("a".into(), record("a"));
            Err(CatalogError::Locked {
                path: PathBuf::from("x"),
            })
        });
        assert!(result.is_err());
        assert!(catalog.snapshot().datasets.is_empty());
        assert!(!catalog.path().exists());
    }

    #[test]
    fn a_corrupt_catalog_is_an_error_and_is_left_untouched() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join(CATALOG_FILE_NAME);
        for bad in [
            &b"{\"format\": \"gpufeed-catalog\", \"vers"[..],
            b"{\"format\": \"other\", \"version\": 1, \"next_job_id\": 1, \"datasets\": {}, \"unregistered\": [], \"jobs\": {}}",
            b"{\"format\": \"gpufeed-catalog\", \"version\": 9, \"next_job_id\": 1, \"datasets\": {}, \"unregistered\": [], \"jobs\": {}}",
            b"{\"format\": \"gpufeed-catalog\", \"version\": 1, \"next_job_id\": 1, \"datasets\": {}, \"unregistered\": [], \"jobs\": {}, \"extra\": 1}",
        ] {
            fs::write(&path, bad).unwrap();
            let error = Catalog::open(root.path()).err().expect("corrupt");
            assert!(
                matches!(error, CatalogError::Corrupt { .. }),
                "{error}"
            );
            assert!(error.to_string().contains("left untouched"), "{error}");
            assert_eq!(fs::read(&path).unwrap(), bad);
        }
    }

    #[test]
    fn an_interrupted_write_leaves_the_old_catalog() {
        let root = tempfile::tempdir().unwrap();
        let catalog = Catalog::open(root.path()).unwrap();
        catalog
            .update(|data| {
                data.datasets.insert("old".into(), record("old"));
                Ok::<_, CatalogError>(())
            })
            .unwrap();
        drop(catalog);
        // A crash between writing the temporary file and the rename: half a new catalog beside the
        // old one.
        let temp = root.path().join(format!("..{TEMP_STEM}99999-1"));
        fs::write(&temp, b"{\"format\": \"gpufeed-cat").unwrap();
        let reopened = Catalog::open(root.path()).unwrap();
        assert!(reopened.snapshot().datasets.contains_key("old"));
        assert!(!temp.exists(), "the leftover temporary file is removed");
    }

    #[test]
    fn a_second_opener_of_the_same_root_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let _first = Catalog::open(root.path()).unwrap();
        let error = Catalog::open(root.path()).err().expect("locked");
        assert!(matches!(error, CatalogError::Locked { .. }), "{error}");
    }
}
