//! `gpufeed-client`: the consumer side of gpufeed.
//!
//! This crate holds the types shared between the daemon and the processes that consume its batches,
//! the wire protocol, and the consumer API. It stays light on purpose (no async runtime, no HTTP
//! stack) so that a training process can link it without pulling in the daemon.

pub mod dtype;
pub mod protocol;
pub mod transport;

pub use dtype::{DType, DTypeError, ALL_DTYPES};
