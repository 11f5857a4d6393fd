//! gpufeed: a per-node daemon that feeds GPU training jobs device-resident batches.
//!
//! See `docs/ARCHITECTURE.md` for the module map and the invariants between modules.

pub mod input;
