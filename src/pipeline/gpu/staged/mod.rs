//! The staged assembler: batches built in rounds that read, verify and decode blocks on the device
//! and gather rows from them ([`assembler`]), planned on the filler's thread ([`plan`]) and queued
//! phase by phase ([`queue`]).

pub(in crate::pipeline::gpu) mod assembler;
pub(in crate::pipeline::gpu) mod plan;
mod queue;
