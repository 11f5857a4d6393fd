//! `gpufeed-proto`: what the gpufeed daemon and its consumers must agree on, and nothing else.
//!
//! - [`dtype`]: element types (their codes are part of the shard format and of the protocol);
//! - [`protocol`]: the messages of `docs/PROTOCOL.md`, their encoding and bounded decoding;
//! - [`ring`]: the shared-memory hand-off ring of a stream (batches out, releases back);
//! - [`transport`]: frames over a Unix socket with descriptors passed as `SCM_RIGHTS`;
//! - [`spec`]: what makes a stream spec valid on its own, the defaults, and the resume state.
//!
//! No CUDA and no memory mapping: the daemon's format layer and the client crate both build on it.

pub mod affinity;
pub mod dtype;
pub mod protocol;
pub mod ring;
pub mod spec;
pub mod transport;

pub use dtype::{DType, DTypeError, ALL_DTYPES};
pub use spec::{SpecError, StreamState};
