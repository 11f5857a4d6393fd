//! The batch pipeline: what a stream is ([`stream_plan`]), which samples each rank gets, in which
//! order ([`order`]), how batches are assembled into slots ([`cpu`] on the CPU, [`gpu`] on the
//! device), and the filler thread that drives a stream's assembler and switches between the two
//! backends ([`filler`]).
//!
//! *Invariant*: the pipeline knows nothing of the wire format; a stream arrives as a
//! [`StreamRequest`], converted from the consumer's request by `ipc`.

pub mod block_cache;
pub(crate) mod cold_rows;
pub mod cpu;
pub mod filler;
pub mod gpu;
pub mod lookahead;
pub mod mixture;
pub mod order;
pub mod shard_gate;
pub mod stream_plan;
pub mod upload;
pub mod varlen;

pub use cpu::{Assembler, HostAssembler};
pub use filler::{
    BackendError, DeviceSlot, Ended, Filled, Filler, FillerError, GpuBackend, Handoff,
    InterruptCpus, SlotMemory, StreamBackend, DELIVER_AT_ONCE_MAX, INTERRUPT_CPUS_DEFAULT,
};
pub use gpu::{GpuAssembler, GpuFillTimings, GpuStreamLimits};
pub use order::{EpochOrder, Permutation, RankPlan, ShuffleKind, ShuffleMode, Tail};
pub use stream_plan::{
    CorruptPolicy, FieldPlan, FieldSelection, FillError, FillReport, Placement, PlacementRuns,
    PlanError, StreamDevice, StreamLimits, StreamPlan, StreamRequest,
};
