//! gpufeed: a per-node daemon that feeds GPU training jobs device-resident batches.
//!
//! See `docs/ARCHITECTURE.md` for the module map and the invariants between modules.

pub mod api;
pub mod catalog;
pub mod config;
pub mod daemon;
pub mod decode;
pub mod demo;
pub mod device;
pub mod format;
pub mod input;
pub mod ipc;
pub mod kernels;
pub mod metrics;
pub mod pack;
pub mod pipeline;
pub mod registry;
pub mod storage;
pub mod synth;
pub mod tools;
