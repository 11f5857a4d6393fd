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
    /// Whether this daemon's work on the device goes through a CUDA MPS server, as the driver says
    /// (SM-count execution affinity, which it offers to MPS clients only); `null` when it cannot
    /// say. See [`MpsView`].
    pub mps_client: Option<bool>,
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
                mps_client: probed.mps_client,
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

/// The pipe directory MPS uses when `CUDA_MPS_PIPE_DIRECTORY` is not set.
pub const MPS_DEFAULT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";

/// Whether the daemon runs under CUDA MPS (the Multi-Process Service: the kernels of its clients share
/// the GPU concurrently instead of being time-sliced between processes). Read from two signals,
/// neither of which alone is enough:
///
/// - the control daemon: `nvidia-cuda-mps-control -d` writes its pid to
///   `nvidia-cuda-mps-control.pid` in its pipe directory and removes the file when it stops; the
///   pipe directory is this process's `CUDA_MPS_PIPE_DIRECTORY`, else `/tmp/nvidia-mps` (the same
///   rule the CUDA driver follows when it looks for the control daemon at initialisation);
/// - the driver: whether this process's contexts may be limited to part of a device's SMs
///   (`cuDeviceGetExecAffinitySupport`), which CUDA offers to MPS clients only. The driver connects
///   to MPS once, when the process initialises CUDA: a control daemon started later, or one with
///   another pipe directory, does not make the daemon a client.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct MpsView {
    /// The daemon's CUDA work goes through an MPS server: the driver says it is a client on at least
    /// one device and a control daemon runs for its pipe directory.
    pub active: bool,
    /// The pipe directory the driver looks for the control daemon in.
    pub pipe_directory: String,
    /// `CUDA_MPS_PIPE_DIRECTORY`, or `default` (not set: `/tmp/nvidia-mps`).
    pub pipe_directory_source: String,
    /// The control daemon's pid, from its pid file in the pipe directory, when that process is alive
    /// (in this daemon's pid namespace); `null`: none runs there.
    pub control_daemon_pid: Option<u32>,
    /// Whether the driver says this process is an MPS client on some device (the devices' own
    /// `mps_client` in `platform.devices`); `null` when no device could say (no CUDA).
    pub client: Option<bool>,
    /// What the two signals say together.
    pub reason: String,
}

/// Reads [`MpsView`]'s signals: the control daemon's pid file in `pipe_env`'s directory (the value of
/// `CUDA_MPS_PIPE_DIRECTORY`, `None` when not set) and the devices' `mps_client` from the platform
/// probe. Cheap (one small file read): called for every status request, as the control daemon may
/// start or stop while the daemon runs.
pub fn probe_mps(pipe_env: Option<std::ffi::OsString>, devices: &[DeviceView]) -> MpsView {
    let (pipe_directory, source) = match pipe_env {
        Some(dir) if !dir.is_empty() => (
            std::path::PathBuf::from(dir),
            "CUDA_MPS_PIPE_DIRECTORY".to_string(),
        ),
        _ => (
            std::path::PathBuf::from(MPS_DEFAULT_PIPE_DIRECTORY),
            "default".to_string(),
        ),
    };
    let control_daemon_pid =
        std::fs::read_to_string(pipe_directory.join("nvidia-cuda-mps-control.pid"))
            .ok()
            .and_then(|text| text.trim().parse::<u32>().ok())
            .filter(|&pid| pid > 0 && std::path::Path::new("/proc").join(pid.to_string()).exists());
    let answers: Vec<bool> = devices.iter().filter_map(|d| d.mps_client).collect();
    let client = if answers.is_empty() {
        None
    } else {
        Some(answers.iter().any(|&c| c))
    };
    let dir = pipe_directory.display();
    let reason = match (client, control_daemon_pid) {
        (Some(true), Some(pid)) => format!(
            "the driver reports this daemon an MPS client, and a control daemon (pid {pid}) runs \
             for {dir}: its kernels share the GPU concurrently with the other clients'"
        ),
        (Some(true), None) => format!(
            "the driver reports an MPS client, but no live control daemon is seen at {dir} (one in \
             another pid namespace?): not counted as active"
        ),
        (Some(false), Some(pid)) => format!(
            "a control daemon (pid {pid}) runs for {dir}, but this daemon is not its client: it \
             initialised CUDA before the control daemon started, or the server refused it \
             (its log says why); restart the daemon with the same CUDA_MPS_PIPE_DIRECTORY"
        ),
        (Some(false), None) => format!(
            "no MPS: no control daemon runs for {dir}; the kernels of separate processes on one \
             GPU are time-sliced"
        ),
        (None, Some(pid)) => format!(
            "a control daemon (pid {pid}) runs for {dir}, but no CUDA device answered whether this \
             daemon is its client"
        ),
        (None, None) => format!("no CUDA device to ask, and no control daemon runs for {dir}"),
    };
    MpsView {
        active: client == Some(true) && control_daemon_pid.is_some(),
        pipe_directory: dir.to_string(),
        pipe_directory_source: source,
        control_daemon_pid,
        client,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(mps_client: Option<bool>) -> DeviceView {
        DeviceView {
            device: "cuda:0".to_string(),
            name: "test".to_string(),
            memory_bytes: 0,
            compute_capability: "9.0".to_string(),
            multiprocessors: 132,
            exportable_memory: true,
            pci_address: String::new(),
            uuid: None,
            numa_node: None,
            mps_client,
        }
    }

    /// A pipe directory holding a control daemon's pid file that names a live process (this test's
    /// own), as `nvidia-cuda-mps-control -d` leaves it.
    fn pipe_directory_with_live_pid() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("nvidia-cuda-mps-control.pid"),
            format!("{}\n", std::process::id()),
        )
        .unwrap();
        dir
    }

    #[test]
    fn without_a_control_daemon_mps_is_not_active_whatever_the_driver_says() {
        let empty = tempfile::tempdir().unwrap();
        for client in [None, Some(false), Some(true)] {
            let view = probe_mps(Some(empty.path().into()), &[device(client)]);
            assert!(!view.active, "{view:?}");
            assert_eq!(view.control_daemon_pid, None);
            assert_eq!(view.client, client);
            assert_eq!(view.pipe_directory_source, "CUDA_MPS_PIPE_DIRECTORY");
            assert_eq!(view.pipe_directory, empty.path().display().to_string());
        }
    }

    #[test]
    fn a_control_daemon_and_a_client_device_make_it_active() {
        let dir = pipe_directory_with_live_pid();
        let view = probe_mps(
            Some(dir.path().into()),
            &[device(Some(false)), device(Some(true))],
        );
        assert!(view.active, "{view:?}");
        assert_eq!(view.control_daemon_pid, Some(std::process::id()));
        assert_eq!(view.client, Some(true));
        // A control daemon this process is not a client of (started after CUDA was initialised).
        let view = probe_mps(Some(dir.path().into()), &[device(Some(false))]);
        assert!(!view.active, "{view:?}");
        assert!(view.reason.contains("not its client"), "{}", view.reason);
        // No device to ask (no CUDA): not active.
        let view = probe_mps(Some(dir.path().into()), &[]);
        assert!(!view.active);
        assert_eq!(view.client, None);
    }

    #[test]
    fn a_stale_pid_file_is_no_control_daemon() {
        let dir = tempfile::tempdir().unwrap();
        // Above the kernel's pid_max (at most 2^22): no such process.
        std::fs::write(dir.path().join("nvidia-cuda-mps-control.pid"), "4194305\n").unwrap();
        let view = probe_mps(Some(dir.path().into()), &[device(Some(true))]);
        assert_eq!(view.control_daemon_pid, None);
        assert!(!view.active);
    }

    #[test]
    fn an_unset_or_empty_variable_means_the_default_directory() {
        for env in [None, Some(std::ffi::OsString::new())] {
            let view = probe_mps(env, &[]);
            assert_eq!(view.pipe_directory, MPS_DEFAULT_PIPE_DIRECTORY);
            assert_eq!(view.pipe_directory_source, "default");
        }
    }
}
