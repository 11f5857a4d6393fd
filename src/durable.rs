//! Installing files and directories so that a crash leaves the old one or the new one, never part of
//! either, and clearing away what a writer that died left behind.
//!
//! Every writer of the daemon and its tools (the catalog, the module cache, `pack`, `unpack`) takes
//! the same steps: write aside under a hidden name beside the destination (so that the rename stays
//! on one file system), sync what was written, rename it into place, then sync the directory, without
//! which the rename itself may not survive a power loss. The hidden name `.NAME.KIND-PID-N` carries
//! the writer's process id, which is how [`remove_stale`] tells what a dead writer left.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// An I/O error and the file or directory it happened on.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct PathError {
    /// The file or directory.
    pub path: PathBuf,
    /// The operating system's error.
    #[source]
    pub source: io::Error,
}

/// Turns an I/O error on `path` into a [`PathError`] (for `map_err`).
pub fn on(path: &Path) -> impl FnOnce(io::Error) -> PathError + '_ {
    move |source| PathError {
        path: path.to_path_buf(),
        source,
    }
}

/// The directory holding `path`: its parent, or `.` for a bare file name.
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// A hidden name beside `out` to write aside under: `.NAME.KIND-PID-N`, with this process's id (so
/// that [`remove_stale`] can tell whether its writer still runs) and the clock's nanoseconds (so
/// that two writers of one process do not collide). `None` if `out` has no file name (`/`, `..`).
pub fn hidden_beside(out: &Path, kind: &str) -> Option<PathBuf> {
    let name = out.file_name()?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Some(parent_dir(out).join(format!(
        ".{}.{kind}-{}-{nanos}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Syncs the directory `dir`, so that the entries created, renamed or removed in it survive a crash.
pub fn sync_dir(dir: &Path) -> Result<(), PathError> {
    File::open(dir)
        .and_then(|dir| dir.sync_all())
        .map_err(on(dir))
}

/// Creates the file `path` holding `bytes`, synced.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), PathError> {
    let mut file = File::create(path).map_err(on(path))?;
    file.write_all(bytes).map_err(on(path))?;
    file.sync_all().map_err(on(path))
}

/// Renames `from` (a synced file or directory) over `to`, then syncs `to`'s directory so that the
/// rename survives a crash.
pub fn rename_synced(from: &Path, to: &Path) -> Result<(), PathError> {
    fs::rename(from, to).map_err(on(to))?;
    sync_dir(parent_dir(to))
}

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one: a synced file
/// written aside under a hidden name (`.NAME.tmp-PID-N`), renamed over `path`, then the directory
/// synced. The file written aside is removed if a step fails.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), PathError> {
    let temporary = hidden_beside(path, "tmp").ok_or_else(|| PathError {
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "not a file name"),
    })?;
    let written = write_synced(&temporary, bytes)
        .and_then(|()| fs::rename(&temporary, path).map_err(on(path)));
    if let Err(error) = written {
        let _ = fs::remove_file(&temporary);
        return Err(error);
    }
    sync_dir(parent_dir(path))
}

/// Holds the lock of a directory written aside (an exclusive `flock` on the directory itself) for as
/// long as its writer runs, so that [`remove_stale`] never removes it: the process id in its name
/// alone cannot tell, since that id may belong to another process by now, or the writer may run in
/// another PID namespace sharing the file system. The lock goes with the descriptor: when the
/// writer ends (or is killed), it is free.
#[derive(Debug)]
pub struct WriterLock {
    _directory: File,
}

impl WriterLock {
    /// Locks the directory `dir`; fails if another writer holds it.
    pub fn take(dir: &Path) -> Result<WriterLock, PathError> {
        let directory = File::open(dir).map_err(on(dir))?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(directory.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let source = io::Error::last_os_error();
            return Err(PathError {
                path: dir.to_path_buf(),
                source: if source.kind() == io::ErrorKind::WouldBlock {
                    io::Error::new(io::ErrorKind::WouldBlock, "locked by another writer")
                } else {
                    source
                },
            });
        }
        Ok(WriterLock {
            _directory: directory,
        })
    }
}

/// The process id in a hidden name `.NAME.KIND-PID-N`, if `name` is one for `kind`.
fn writer_pid(name: &str, kind: &str) -> Option<u32> {
    let (rest, nanos) = name.rsplit_once('-')?;
    let (rest, pid) = rest.rsplit_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let stem = rest.strip_suffix(kind)?.strip_suffix('.')?;
    (digits(nanos) && stem.len() > 1 && stem.starts_with('.'))
        .then(|| pid.parse().ok())
        .flatten()
}

/// Whether a process with this id exists in this PID namespace (or may: one we may not signal).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    // SAFETY: signal 0 delivers nothing; kill only reports whether the process exists and may be
    // signalled. No memory is involved.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Removes the directories `.NAME.KIND-PID-N` in `dir` that writers which died left behind (a
/// `kill -9`, a power loss), and returns them. A directory goes only if no process with its PID is
/// alive here *and* its [`WriterLock`] is free: the PID covers the moment between its creation and
/// its locking, the lock covers a PID reused or from another namespace. Files of that name (a
/// `.npy` that `unpack` writes aside) are left alone, since they carry no lock. A directory that
/// cannot be removed is logged and skipped: clearing up never fails the work that asked for it.
pub fn remove_stale(dir: &Path, kind: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(pid) = writer_pid(&name.to_string_lossy(), kind) else {
            continue;
        };
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !is_dir || pid == std::process::id() || process_alive(pid) {
            continue;
        }
        let Ok(lock) = WriterLock::take(&path) else {
            continue;
        };
        match fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::warn!(
                    "removed {}, left by a writer (process {pid}) that did not finish",
                    path.display()
                );
                removed.push(path);
            }
            Err(source) => tracing::warn!(
                "{}: left by a writer (process {pid}) that did not finish, and not removable: {source}",
                path.display()
            ),
        }
        drop(lock);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_names_parse_back_to_their_writer() {
        let out = Path::new("data/set");
        let hidden = hidden_beside(out, "partial").unwrap();
        assert_eq!(hidden.parent(), Some(Path::new("data")));
        let name = hidden.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(writer_pid(&name, "partial"), Some(std::process::id()));
        assert_eq!(writer_pid(&name, "old"), None);
        for other in [
            "set",
            ".set.partial",
            ".set.partial-1",
            "..partial-1-2",
            ".set.partial-x-2",
        ] {
            assert_eq!(writer_pid(other, "partial"), None, "{other}");
        }
        assert_eq!(hidden_beside(Path::new("/"), "partial"), None);
        assert_eq!(parent_dir(Path::new("set")), Path::new("."));
    }

    #[test]
    fn an_atomic_write_replaces_the_file_and_leaves_nothing_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("file.bin");
        write_atomically(&path, b"first").unwrap();
        write_atomically(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_atomic_write_names_the_path_and_removes_its_temporary() {
        let dir = tempfile::tempdir().unwrap();
        // A directory in the way: the rename of a file over it fails.
        let path = dir.path().join("in-the-way");
        fs::create_dir(path.join("")).unwrap();
        fs::write(path.join("keep"), b"x").unwrap();
        let error = write_atomically(&path, b"new").unwrap_err();
        assert_eq!(error.path, path);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_locked_directory_cannot_be_locked_again() {
        let dir = tempfile::tempdir().unwrap();
        let first = WriterLock::take(dir.path()).unwrap();
        let error = WriterLock::take(dir.path()).unwrap_err();
        assert_eq!(error.source.kind(), io::ErrorKind::WouldBlock);
        drop(first);
        WriterLock::take(dir.path()).unwrap();
    }
}
