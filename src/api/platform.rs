//! What the machine offers, as the status reports it: the CUDA devices and every read path with the
//! reason it is or is not usable. The types and the probe live here, apart from the status handler
//! (`status`), because the control state ([`super::state::Control`]) caches the probe and must not
//! import the handlers that import it. The probes themselves belong to the layers that know the
//! hardware: the CUDA devices to `device::probe`, io_uring, libcufile and nvidia-fs to `storage`;
//! this module puts their answers into the status's terms.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::device::probe::probe_cuda;
use crate::storage::cufile::{libcufile_present, nvidia_fs_loaded};
use crate::storage::UringQueue;

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
    /// The device's UUID as `nvidia-smi -L` shows it (`GPU-…`), the same in every process whatever
    /// its `CUDA_VISIBLE_DEVICES`; `null` when the driver could not say.
    pub uuid: Option<String>,
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

/// Probes the machine: the CUDA driver and devices, io_uring, libcufile and nvidia-fs. Blocks (the
/// driver's initialization takes a while) and never panics without a GPU.
pub fn probe_platform() -> Platform {
    let probe = probe_cuda();
    let cuda = Availability {
        available: probe.available,
        reason: probe.reason,
    };
    let devices: Vec<DeviceView> = probe
        .devices
        .into_iter()
        .map(|probed| {
            let p = probed.properties;
            DeviceView {
                device: format!("cuda:{}", p.ordinal),
                name: p.name,
                memory_bytes: p.memory_bytes,
                compute_capability: format!(
                    "{}.{}",
                    p.compute_capability.0, p.compute_capability.1
                ),
                multiprocessors: p.multiprocessors,
                exportable_memory: p.exportable_memory,
                pci_address: p.pci_address,
                uuid: p
                    .uuid
                    .map(|bytes| gpufeed_proto::protocol::DeviceUuid(bytes).to_string()),
                numa_node: probed.numa_node,
            }
        })
        .collect();
    let uring = match UringQueue::new(1) {
        Ok(_) => Availability {
            available: true,
            reason: "io_uring set up a queue".to_string(),
        },
        Err(error) => Availability {
            available: false,
            reason: format!("io_uring_setup failed: {error}"),
        },
    };
    let mut engines = vec![
        EngineView {
            device: "host".to_string(),
            engine: "io_uring".to_string(),
            available: uring.available,
            reason: uring.reason.clone(),
        },
        EngineView {
            device: "host".to_string(),
            engine: "pread".to_string(),
            available: true,
            reason: "positional reads work everywhere (the fallback where io_uring is not)"
                .to_string(),
        },
    ];
    if !devices.is_empty() {
        let libcufile = libcufile_present();
        let nvidia_fs = nvidia_fs_loaded();
        for device in &devices {
            let (available, reason) = match (libcufile, nvidia_fs) {
                (false, _) => (false, "libcufile cannot be loaded".to_string()),
                (true, false) => (
                    false,
                    "the nvidia-fs kernel driver is not loaded: cuFile would run in compatibility \
                     mode, a POSIX bounce-buffer path that io_uring bounce beats"
                        .to_string(),
                ),
                (true, true) => (
                    true,
                    "libcufile loads and nvidia-fs is loaded (the cuFile driver itself is opened \
                     by the GPU backend, not by this probe)"
                        .to_string(),
                ),
            };
            engines.push(EngineView {
                device: device.device.clone(),
                engine: "cufile".to_string(),
                available,
                reason,
            });
            engines.push(EngineView {
                device: device.device.clone(),
                engine: "uring_bounce".to_string(),
                available: uring.available,
                reason: format!(
                    "io_uring into pinned host buffers, then copies: {}",
                    uring.reason
                ),
            });
            engines.push(EngineView {
                device: device.device.clone(),
                engine: "page_cache_copy".to_string(),
                available: true,
                reason: "copies from registered page-cache windows need only the driver"
                    .to_string(),
            });
        }
    }
    Platform {
        cuda,
        devices,
        engines,
    }
}
