//! Open shard files: a buffered descriptor always, and an O_DIRECT one where the file system allows.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::{FileId, StorageError};

/// How a file's reads bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectIo {
    /// Open with O_DIRECT where the file system allows it; aligned reads use it.
    Prefer,
    /// Always read through the page cache.
    Off,
}

/// One open file.
#[derive(Debug)]
pub struct OpenFile {
    /// The file's path, for error messages.
    pub path: PathBuf,
    /// Length when opened.
    pub len: u64,
    buffered: File,
    direct: Option<File>,
    /// Why O_DIRECT is not used, when it is not.
    pub direct_unavailable: Option<String>,
}

impl OpenFile {
    /// Descriptor for page-cache reads.
    pub fn buffered_fd(&self) -> RawFd {
        self.buffered.as_raw_fd()
    }

    /// Descriptor for O_DIRECT reads, if the file system allowed it.
    pub fn direct_fd(&self) -> Option<RawFd> {
        self.direct.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// The buffered file, for memory-mapping.
    pub fn file(&self) -> &File {
        &self.buffered
    }
}

/// The files an engine reads from, with a bound on how many may be open.
#[derive(Debug)]
pub struct FileTable {
    /// By id; `None` for an id not opened (or closed) by [`FileTable::open_at`] and
    /// [`FileTable::close`].
    files: Vec<Option<OpenFile>>,
    files_max: usize,
}

impl FileTable {
    /// An empty table holding at most `files_max` files.
    pub fn new(files_max: usize) -> FileTable {
        FileTable {
            files: Vec::new(),
            files_max,
        }
    }

    /// Opens `path` and returns its id (the next one).
    pub fn open(&mut self, path: &Path, direct_io: DirectIo) -> Result<FileId, StorageError> {
        let id = FileId(self.files.len() as u32);
        self.open_at(id, path, direct_io)?;
        Ok(id)
    }

    /// Opens `path` as file `id` (below the table's bound), for a reader that opens its files as
    /// they become readable rather than all at once (a dataset whose shards arrive from object
    /// storage).
    pub fn open_at(
        &mut self,
        id: FileId,
        path: &Path,
        direct_io: DirectIo,
    ) -> Result<(), StorageError> {
        if id.0 as usize >= self.files_max {
            return Err(StorageError::TooManyFiles {
                path: path.to_path_buf(),
                files_max: self.files_max,
            });
        }
        let io = |source| StorageError::Open {
            path: path.to_path_buf(),
            source,
        };
        let buffered = File::open(path).map_err(io)?;
        let len = buffered.metadata().map_err(io)?.len();
        let (direct, direct_unavailable) = match direct_io {
            DirectIo::Off => (None, Some("O_DIRECT disabled by configuration".to_string())),
            DirectIo::Prefer => match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                Ok(file) => (Some(file), None),
                // EINVAL: the file system does not support O_DIRECT; reads go through the page cache.
                Err(e) => (None, Some(format!("O_DIRECT open failed: {e}"))),
            },
        };
        let index = id.0 as usize;
        if self.files.len() <= index {
            self.files.resize_with(index + 1, || None);
        }
        self.files[index] = Some(OpenFile {
            path: path.to_path_buf(),
            len,
            buffered,
            direct,
            direct_unavailable,
        });
        Ok(())
    }

    /// Whether file `id` is open.
    pub fn is_open(&self, id: FileId) -> bool {
        self.files
            .get(id.0 as usize)
            .is_some_and(|file| file.is_some())
    }

    /// Closes file `id` (nothing if it is not open). The caller has no read of it in flight.
    pub fn close(&mut self, id: FileId) {
        if let Some(file) = self.files.get_mut(id.0 as usize) {
            *file = None;
        }
    }

    /// The open file with this id; panics if it is not open (a caller's bug: it opens a file
    /// before reading it).
    pub fn get(&self, id: FileId) -> &OpenFile {
        self.files[id.0 as usize]
            .as_ref()
            .unwrap_or_else(|| panic!("file {} is not open", id.0))
    }

    /// Number of file ids in use (open, or closed after they were opened).
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// True when no file is open.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}
