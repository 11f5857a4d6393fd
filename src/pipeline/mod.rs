//! The batch pipeline: which samples each rank gets, in which order, and (with the storage engines and
//! decoders) how batches are assembled into slots.

pub mod order;

pub use order::{EpochOrder, Permutation, RankPlan, ShuffleMode, Tail};
