//! The GPU kernels: block checksum verification (xxh3-64), LZ4 block decompression and gather + dtype
//! conversion.
//!
//! The CUDA sources live in `kernels/*.cu` and are embedded in the binary; [`crate::device`] compiles
//! them with NVRTC for the device at hand and caches the result. This module owns the host side of each
//! kernel: the table layouts the kernels read (encoded explicitly, little-endian, never transmuted), the
//! status codes they write, and the launches. `docs/KERNELS.md` describes the designs and the
//! bounds-checking rules.
//!
//! *Invariant*: the kernels agree bit for bit with the CPU decode path (`crate::decode`: `lz4_flex` and
//! `half`; `crate::format::checksum` for xxh3), including on corrupt blocks, which both reject.
//! [`reference`] holds the CPU models the tests use to check that.
//!
//! *Invariant*: a kernel writes only inside the extents its table names, after checking them against
//! the lengths of the buffers it was given; a bad table entry or a malicious block is reported in the
//! outcome and never touches memory outside those extents.

mod gather;
mod launch;
mod lz4;
mod ordered;
#[doc(hidden)]
pub mod reference;
mod xxh3;

pub use gather::{
    resolve_inline, GatherLayout, GatherOp, GatherOutcome, GatherPiece, GatherPlan, GatherRegion,
    Gatherer, GATHER_BLOCK_THREADS, GATHER_INLINE_PIECES_MAX, GATHER_OUTCOME_BYTES,
    GATHER_PIECE_BYTES, GATHER_PIECE_OUT_BYTES_MAX, GATHER_REGIONS_MAX, GATHER_REGION_BYTES,
    GATHER_SOURCE, GATHER_SOURCES_MAX,
};
pub use lz4::{
    Lz4Config, Lz4Decoder, Lz4Job, Lz4Outcome, Lz4Status, SequencePath, Unshuffle, LZ4_JOB_BYTES,
    LZ4_OUTCOME_BYTES, LZ4_SOURCE, SHUFFLE_BYTES_MAX,
};
pub use ordered::{
    xxh3_u64_model, FeistelSpec, OrderSpec, OrderedField, OrderedLaunch, OrderedTables, WindowSpec,
};
pub use xxh3::{
    ChecksumVerifier, Xxh3Config, Xxh3Job, Xxh3Outcome, Xxh3Status, XXH3_JOB_BYTES,
    XXH3_OUTCOME_BYTES, XXH3_SOURCE,
};

use crate::device::{CacheDir, Device, DeviceError, ModuleOrigin};

/// Every kernel, loaded for one device.
pub struct Kernels {
    /// The block checksum verifier.
    pub xxh3: ChecksumVerifier,
    /// The LZ4 decoder.
    pub lz4: Lz4Decoder,
    /// The gather + convert kernel.
    pub gather: Gatherer,
    /// Where each module came from (memory, disk cache, fresh compilation), for the start-up log.
    pub origins: Vec<(&'static str, ModuleOrigin)>,
}

impl Kernels {
    /// Loads every kernel on `device`, compiling them with NVRTC unless a cache holds them.
    pub fn load(device: &Device, cache: CacheDir) -> Result<Kernels, DeviceError> {
        let (xxh3, xxh3_origin) = ChecksumVerifier::new(device, cache.clone())?;
        let (lz4, lz4_origin) = Lz4Decoder::with_config(device, Lz4Config::SERVING, cache.clone())?;
        let (gather, gather_origin) = Gatherer::new(device, GatherLayout::STANDARD, cache)?;
        Ok(Kernels {
            xxh3,
            lz4,
            gather,
            origins: vec![
                ("xxh3", xxh3_origin),
                ("lz4", lz4_origin),
                ("gather", gather_origin),
            ],
        })
    }
}
