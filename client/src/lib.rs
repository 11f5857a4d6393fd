//! `gpufeed-client`: the consumer side of gpufeed.
//!
//! This crate holds the types shared between the daemon and the processes that consume its batches,
//! the wire protocol, and the consumer API. It stays light on purpose (no async runtime, no HTTP
//! stack) so that a training process can link it without pulling in the daemon.

pub mod consumer;
pub mod cuda;
pub mod dtype;
pub mod protocol;
pub mod transport;

pub use consumer::{Batch, Client, ClientError, FieldData, FieldView, Stream, StreamState};
pub use dtype::{DType, DTypeError, ALL_DTYPES};
pub use protocol::{
    Backend, CorruptPolicy, DaemonStatus, Device, ErrorCode, FieldRequest, Shuffle, StreamLayout,
    StreamSpec, Tail,
};
