//! The batch pipeline: which samples each rank gets, in which order ([`order`]), and how batches are
//! assembled into slots ([`assemble`]).

pub mod assemble;
pub mod gpu;
pub mod order;

pub use assemble::{
    Assembler, FieldPlan, FillError, FillReport, Placement, PlacementRuns, PlanError, StreamLimits,
    StreamPlan,
};
pub use gpu::{GpuAssembler, GpuFillTimings, GpuStreamLimits};
pub use order::{EpochOrder, Permutation, RankPlan, ShuffleMode, Tail};
