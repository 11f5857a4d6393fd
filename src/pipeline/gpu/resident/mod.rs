//! The resident assembler ([`assembler`]): a stream whose blocks are all raw, read in place from
//! page-cache windows mapped for its life or from shards copied ahead into device memory
//! ([`device_shards`], by a loader thread beyond the registration budget: [`shard_loader`],
//! [`copy_helpers`]), or, in a full shuffle beyond the budget, from rows copied by host threads
//! into each round's staging ([`row_copies`]). [`open`] decides whether a stream qualifies and
//! maps its windows; [`planner`] plans its rows on threads of their own; [`group`] gathers small
//! batches together.

pub(in crate::pipeline::gpu) mod assembler;
mod copy_helpers;
mod device_shards;
mod group;
pub(in crate::pipeline::gpu) mod open;
pub(in crate::pipeline::gpu) mod ordered;
mod planner;
mod row_copies;
mod shard_checks;
mod shard_loader;
pub(in crate::pipeline::gpu) mod tier_fill;
mod tier_read;
