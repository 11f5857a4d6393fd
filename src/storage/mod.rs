//! Storage engines: getting shard bytes from files into memory the decoder can reach.
//!
//! The engines read **extents** (file, offset, length, destination offset) into a destination buffer
//! and report a result per extent. On the CPU backend the destination is host memory; on the GPU
//! backend it is a pinned bounce buffer whose contents are then copied to the device, or device memory
//! itself through cuFile.
//!
//! Layers: [`queue`] is the submission/completion seam (io_uring, a pread fallback, and in tests a
//! fault injector); [`engine`] turns extents into aligned, bounded, retried reads; [`files`] holds the
//! open descriptors (O_DIRECT where the file system allows).
//!
//! *Invariant*: a destination byte range referenced by a submitted read belongs to that read until its
//! completion has been reaped; an engine never returns while reads into the caller's buffer are in
//! flight.

pub mod buffer;
pub mod cufile;
pub mod engine;
// Test support, not API: the integration tests inject faults through it, so it stays public but out
// of the documentation.
#[doc(hidden)]
pub mod fault;
pub mod files;
pub mod gpu;
pub mod mapped;
pub mod memory;
pub mod queue;
pub mod residency;
pub mod windows;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub use buffer::AlignedBuffer;
pub use engine::{EngineLimits, ReadEngine};
pub use files::{DirectIo, FileTable};
pub use queue::{AnyQueue, Completion, PreadQueue, ReadOp, ReadQueue, UringQueue, QUEUE_DEPTH_MAX};

/// Alignment O_DIRECT requires of file offsets, lengths and buffer addresses on the file systems
/// gpufeed targets.
pub const IO_ALIGN_BYTES: u64 = 4096;

/// Identifies an open file within a [`FileTable`]. (Here rather than in `files.rs`: [`Extent`] names
/// it, and `files.rs` builds on this file.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId(pub u32);

/// One read: `len` bytes at `offset` of `file`, into the destination at `dest_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// The file.
    pub file: FileId,
    /// File offset.
    pub offset: u64,
    /// Bytes to read.
    pub len: usize,
    /// Where the bytes go in the destination.
    pub dest_offset: usize,
}

/// Which engine serves reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineMode {
    /// cuFile where real GPUDirect Storage is present (the nvidia-fs driver is loaded), io_uring
    /// otherwise: cuFile's compatibility mode is itself a POSIX bounce-buffer path, which ours beats.
    Auto,
    /// cuFile, or fail with the reason it is unavailable.
    CuFile,
    /// io_uring (with O_DIRECT where possible), or fail with the reason it is unavailable.
    Uring,
}

/// An engine name that is not one of `auto`, `cufile`, `uring`.
#[derive(Debug, thiserror::Error)]
#[error("unknown engine {0:?} (expected auto, cufile or uring)")]
pub struct UnknownEngine(pub String);

impl FromStr for EngineMode {
    type Err = UnknownEngine;

    fn from_str(text: &str) -> Result<EngineMode, UnknownEngine> {
        match text {
            "auto" => Ok(EngineMode::Auto),
            "cufile" => Ok(EngineMode::CuFile),
            "uring" => Ok(EngineMode::Uring),
            _ => Err(UnknownEngine(text.to_string())),
        }
    }
}

impl fmt::Display for EngineMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineMode::Auto => "auto",
            EngineMode::CuFile => "cufile",
            EngineMode::Uring => "uring",
        })
    }
}

/// What went wrong with one extent.
#[derive(Debug, thiserror::Error)]
pub enum ReadErrorKind {
    /// The operating system reported an error.
    #[error("{0}")]
    Os(std::io::Error),
    /// The file ended before the extent did.
    #[error("unexpected end of file")]
    UnexpectedEof,
    /// EINTR or EAGAIN kept coming back.
    #[error("errno {errno} persisted after {retries} retries")]
    RetriesExhausted {
        /// The last errno.
        errno: i32,
        /// Retries made.
        retries: u32,
    },
    /// The kernel reported more bytes than were asked for (never expected; treated as corruption).
    #[error("read returned {returned} bytes, more than requested")]
    Overlong {
        /// What the read returned.
        returned: usize,
    },
}

/// An extent could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}: read of {len} bytes at offset {offset} failed: {kind}")]
pub struct ReadError {
    /// The file.
    pub path: PathBuf,
    /// File offset of the failed piece.
    pub offset: u64,
    /// Length of the failed piece.
    pub len: usize,
    /// What happened.
    pub kind: ReadErrorKind,
}

/// A storage engine could not be set up or can no longer be used.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A file could not be opened.
    #[error("{path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The file table is full.
    #[error("{path}: cannot open more than {files_max} files")]
    TooManyFiles {
        /// The file that did not fit.
        path: PathBuf,
        /// The bound.
        files_max: usize,
    },
    /// The submission queue itself failed; the engine refuses further work.
    #[error("the I/O queue failed: {source}")]
    Queue {
        /// The error from io_uring.
        source: std::io::Error,
    },
    /// A previous queue failure left the engine unusable.
    #[error("the I/O engine failed earlier and was stopped")]
    EngineBroken,
    /// A file changed while it was read through a memory map (truncated or rewritten in place, as
    /// `cp` or `rsync --inplace` over a served dataset does): what was read from it is not served.
    #[error("{path}: {reason}; nothing read from it since is served")]
    Changed {
        /// The file.
        path: PathBuf,
        /// How it changed.
        reason: mapped::MapChange,
    },
    /// The requested engine is not available here.
    #[error("engine {mode} unavailable: {reason}")]
    Unavailable {
        /// The engine asked for.
        mode: EngineMode,
        /// Why it cannot be used.
        reason: String,
    },
}
