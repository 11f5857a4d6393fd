//! `gpufeed-client`: the consumer side of gpufeed.
//!
//! The consumer API over the wire types of `gpufeed-proto` (re-exported here, so a consumer needs one
//! dependency). It stays light on purpose (no async runtime, no HTTP stack) so that a training process
//! can link it without pulling in the daemon.

pub mod consumer;
pub mod cuda;

pub use gpufeed_proto::{affinity, dtype, protocol, ring, spec, transport};

pub use consumer::{Batch, Client, ClientError, FieldData, FieldView, OpeningStream, Stream};
pub use dtype::{DType, DTypeError, ALL_DTYPES};
pub use gpufeed_proto::spec::{StreamState, PREFETCH_DEFAULT};
pub use protocol::{
    Backend, CorruptPolicy, DaemonStatus, Device, ErrorCode, FieldRequest, Shuffle, StreamLayout,
    StreamSpec, Tail,
};
