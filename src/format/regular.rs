//! Opening dataset files safely: a FIFO or a device where a shard or manifest should be would block
//! `open(2)` (a FIFO waits for a writer) or never end a read (`/dev/zero`), hanging `verify`,
//! `unpack`, the daemon's start-up scan or an HTTP request. Such paths are refused before anything is
//! read from them.

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Opens `path` for reading if it is a regular file (following symbolic links, as datasets may be
/// linked into place), else fails with `InvalidInput` saying what it is. Opening does not block on a
/// FIFO: the file is opened non-blocking, checked, then switched back to blocking reads.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "a directory"
        } else {
            "a FIFO, socket or device"
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("is {what}, not a regular file: refusing to read it"),
        ));
    }
    // SAFETY: fcntl on a descriptor this function owns; F_GETFL/F_SETFL only read and set its flags.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifos_and_directories_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("shard-0.gfs");
        nix::unistd::mkfifo(
            &fifo,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .unwrap();
        let error = open_regular(&fifo).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidInput);
        assert!(error.to_string().contains("FIFO"), "{error}");
        assert!(open_regular(dir.path()).is_err());
        let regular = dir.path().join("manifest.json");
        std::fs::write(&regular, b"{}").unwrap();
        let mut text = String::new();
        io::Read::read_to_string(&mut open_regular(&regular).unwrap(), &mut text).unwrap();
        assert_eq!(text, "{}");
    }
}
