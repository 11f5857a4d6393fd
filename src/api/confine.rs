//! Confining the paths that API requests name to the data root.
//!
//! A request's path may be relative to the data root or absolute under it. It is refused if it has a
//! `..` component, if it is absolute and outside the root, or if, once every symbolic link in it is
//! resolved, it lands outside the root. The resolved path is what gets opened and recorded, so a link
//! changed later does not change what a catalog entry means.
//!
//! *Assumption*: untrusted users cannot write into the data root. Someone who can could swap a
//! directory for a link between the check and the open; the check is against requests, not against
//! local users.

use std::io;
use std::path::{Component, Path, PathBuf};

/// A requested path was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    /// The path leaves the data root, lexically or through a symbolic link.
    #[error("{requested:?} is outside the data root: {reason}")]
    Outside {
        /// The path as requested.
        requested: String,
        /// How it leaves.
        reason: String,
    },
    /// The path is not usable (empty, the root itself, a NUL byte).
    #[error("{requested:?}: {reason}")]
    Unusable {
        /// The path as requested.
        requested: String,
        /// What is wrong.
        reason: String,
    },
    /// Nothing exists at the path.
    #[error("{requested:?} does not exist under the data root")]
    NotFound {
        /// The path as requested.
        requested: String,
    },
    /// The file system refused to resolve the path.
    #[error("{requested:?}: {source}")]
    Io {
        /// The path as requested.
        requested: String,
        /// The operating system's error.
        source: io::Error,
    },
}

/// A path resolved inside the data root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Confined {
    /// The canonical absolute path (no links, no `.`).
    pub absolute: PathBuf,
    /// The same path relative to the canonical root.
    pub relative: PathBuf,
}

/// The data root, canonicalized once at start.
#[derive(Clone, Debug)]
pub struct DataRoot {
    configured: PathBuf,
    canonical: PathBuf,
}

impl DataRoot {
    /// Canonicalizes `configured`, which must be an existing directory.
    pub fn new(configured: &Path) -> io::Result<DataRoot> {
        let canonical = configured.canonicalize()?;
        if !canonical.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                format!("{} is not a directory", canonical.display()),
            ));
        }
        Ok(DataRoot {
            configured: configured.to_path_buf(),
            canonical,
        })
    }

    /// The canonical root.
    pub fn canonical(&self) -> &Path {
        &self.canonical
    }

    /// The lexical checks: the path relative to the root, without `.` components.
    fn relative(&self, requested: &str) -> Result<PathBuf, ConfineError> {
        let unusable = |reason: &str| ConfineError::Unusable {
            requested: requested.to_string(),
            reason: reason.to_string(),
        };
        if requested.is_empty() {
            return Err(unusable("the path is empty"));
        }
        if requested.contains('\0') {
            return Err(unusable("the path contains a NUL byte"));
        }
        let path = Path::new(requested);
        let inside = if path.is_absolute() {
            path.strip_prefix(&self.canonical)
                .or_else(|_| {
                    if self.configured.is_absolute() {
                        path.strip_prefix(&self.configured)
                    } else {
                        path.strip_prefix(&self.canonical)
                    }
                })
                .map_err(|_| ConfineError::Outside {
                    requested: requested.to_string(),
                    reason: format!(
                        "an absolute path must start with the data root {}",
                        self.canonical.display()
                    ),
                })?
        } else {
            path
        };
        let mut relative = PathBuf::new();
        for component in inside.components() {
            match component {
                Component::Normal(part) => relative.push(part),
                Component::CurDir => {}
                Component::ParentDir => {
                    return Err(ConfineError::Outside {
                        requested: requested.to_string(),
                        reason: "`..` components are not allowed".to_string(),
                    })
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(ConfineError::Outside {
                        requested: requested.to_string(),
                        reason: "the path is not relative to the data root".to_string(),
                    })
                }
            }
        }
        if relative.as_os_str().is_empty() {
            return Err(unusable(
                "the path names the data root itself, not something under it",
            ));
        }
        Ok(relative)
    }

    /// Resolves an existing path under the root, following links, and checks that the result is
    /// still under the root.
    pub fn resolve_existing(&self, requested: &str) -> Result<Confined, ConfineError> {
        let relative = self.relative(requested)?;
        let absolute = match self.canonical.join(&relative).canonicalize() {
            Ok(path) => path,
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                return Err(ConfineError::NotFound {
                    requested: requested.to_string(),
                })
            }
            Err(source) => {
                return Err(ConfineError::Io {
                    requested: requested.to_string(),
                    source,
                })
            }
        };
        let relative = match absolute.strip_prefix(&self.canonical) {
            Ok(inside) if !inside.as_os_str().is_empty() => inside.to_path_buf(),
            _ => {
                return Err(ConfineError::Outside {
                    requested: requested.to_string(),
                    reason: format!(
                        "it resolves (through a symbolic link) to {}",
                        absolute.display()
                    ),
                })
            }
        };
        Ok(Confined { absolute, relative })
    }

    /// The path of a new entry `name` directly under the root (a pack job's output), which must be a
    /// plain name. Whether something already exists there is the caller's question.
    pub fn child(&self, name: &str) -> Result<Confined, ConfineError> {
        let relative = self.relative(name)?;
        if relative.components().count() != 1 {
            return Err(ConfineError::Unusable {
                requested: name.to_string(),
                reason: "must be a single path component".to_string(),
            });
        }
        Ok(Confined {
            absolute: self.canonical.join(&relative),
            relative,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn paths_stay_under_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root_path = dir.path().join("root");
        std::fs::create_dir_all(root_path.join("a/b")).unwrap();
        symlink(outside.path(), root_path.join("escape")).unwrap();
        symlink(root_path.join("a/b"), root_path.join("inner")).unwrap();
        let root = DataRoot::new(&root_path).unwrap();

        let ok = root.resolve_existing("a/./b").unwrap();
        assert_eq!(ok.relative, PathBuf::from("a/b"));
        let absolute = root
            .resolve_existing(root.canonical().join("a").to_str().unwrap())
            .unwrap();
        assert_eq!(absolute.relative, PathBuf::from("a"));
        assert_eq!(
            root.resolve_existing("inner").unwrap().relative,
            PathBuf::from("a/b"),
            "a link that stays inside is recorded as its target"
        );
        for bad in ["../x", "a/../../x", "/etc", "escape", "escape/.", ""] {
            let error = root.resolve_existing(bad).unwrap_err();
            assert!(
                matches!(
                    error,
                    ConfineError::Outside { .. } | ConfineError::Unusable { .. }
                ),
                "{bad}: {error}"
            );
        }
        assert!(matches!(
            root.resolve_existing("a/..").unwrap_err(),
            ConfineError::Outside { .. }
        ));
        assert!(matches!(
            root.resolve_existing(".").unwrap_err(),
            ConfineError::Unusable { .. }
        ));
        assert!(matches!(
            root.resolve_existing("nothing").unwrap_err(),
            ConfineError::NotFound { .. }
        ));
        assert_eq!(root.child("new").unwrap().relative, PathBuf::from("new"));
        assert!(root.child("a/new").is_err());
    }
}
