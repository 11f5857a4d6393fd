//! What the machine offers, as the status reports it: the CUDA devices and every read path with the
//! reason it is or is not usable. The types live here, apart from the status handler that probes
//! them (`status`), because the control state ([`super::state::Control`]) caches the probe and must
//! not import the handlers that import it.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Whether something is usable, and why (not).
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct Availability {
    /// Usable.
    pub available: bool,
    /// Why it is or is not.
    pub reason: String,
}

/// A CUDA device.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DeviceView {
    /// `cuda:N`.
    pub device: String,
    /// The marketing name.
    pub name: String,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// Compute capability, `major.minor`.
    pub compute_capability: String,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// Whether allocations can be exported as file descriptors (needed for shared batch slots).
    pub exportable_memory: bool,
    /// The device's PCI address (`dddd:bb:dd.0`).
    pub pci_address: String,
    /// The host NUMA node the device is attached to, on a host with several (the daemon binds the
    /// threads of its streams there); `null` on a host with one or when unknown.
    pub numa_node: Option<u32>,
}

/// One read path on one device.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct EngineView {
    /// `host` or `cuda:N`.
    pub device: String,
    /// `io_uring`, `pread`, `cufile`, `uring_bounce` or `page_cache_copy`.
    pub engine: String,
    /// Usable on this machine.
    pub available: bool,
    /// Why it is or is not.
    pub reason: String,
}

/// What the machine offers, probed once (on the first status request).
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct Platform {
    /// The CUDA driver: loadable, with a device.
    pub cuda: Availability,
    /// The CUDA devices seen.
    pub devices: Vec<DeviceView>,
    /// Every read path per device.
    pub engines: Vec<EngineView>,
}
