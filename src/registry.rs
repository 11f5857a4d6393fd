//! The datasets a daemon serves, by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::format::{Dataset, FormatError, MANIFEST_FILE_NAME};

/// Datasets by name. Readers take an `Arc` to a dataset; it stays valid while they use it even if it
/// is removed from the registry.
#[derive(Default)]
pub struct Registry {
    datasets: RwLock<BTreeMap<String, Arc<Dataset>>>,
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
        let mut datasets = self.datasets.write().expect("registry lock poisoned");
        let name = dataset.manifest.name.clone();
        if let Some(existing) = datasets.get(&name) {
            return Err(format!(
                "dataset name '{name}' is already registered from {}",
                existing.dir.display()
            ));
        }
        datasets.insert(name, Arc::new(dataset));
        Ok(())
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
}
