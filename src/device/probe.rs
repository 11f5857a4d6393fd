//! Probes of what the machine's CUDA devices offer, made before (or apart from) serving with them:
//! which devices the driver sees and what each is (for the status page), and whether one page-cache
//! registration can serve several devices (for a daemon serving more than one).

use super::{Device, DeviceError, DeviceProperties};

/// One device the driver sees and opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbedDevice {
    /// What the device is.
    pub properties: DeviceProperties,
    /// The host NUMA node it is attached to, on a host with several (unknown or one: `None`).
    pub numa_node: Option<u32>,
    /// Whether this process's work on the device goes through an MPS server, as the driver says
    /// (see [`super::ffi::exec_affinity_sm_count_supported`]); `None` when it cannot say.
    pub mps_client: Option<bool>,
}

/// What the CUDA driver offers on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaProbe {
    /// Whether the driver loads and at least one device opened.
    pub available: bool,
    /// Why it is or is not available: the device count, the devices that did not open, or the
    /// driver's error.
    pub reason: String,
    /// The devices that opened.
    pub devices: Vec<ProbedDevice>,
}

/// Opens every device the driver sees and reads its properties. Blocks (the driver's initialization
/// takes a while) and never panics without a GPU or a driver.
pub fn probe_cuda() -> CudaProbe {
    let count = match Device::count() {
        Ok(count) => count,
        Err(error) => {
            return CudaProbe {
                available: false,
                reason: error.to_string(),
                devices: Vec::new(),
            }
        }
    };
    if count == 0 {
        return CudaProbe {
            available: false,
            reason: "the CUDA driver loads but sees no device".to_string(),
            devices: Vec::new(),
        };
    }
    let mut devices = Vec::new();
    let mut failures = Vec::new();
    for ordinal in 0..count {
        match Device::open(ordinal) {
            Ok(device) => devices.push(ProbedDevice {
                properties: device.properties().clone(),
                numa_node: device.numa_placement().map(|n| n.node),
                mps_client: super::ffi::exec_affinity_sm_count_supported(device.inner.device)
                    .ok()
                    .flatten(),
            }),
            Err(error) => failures.push(format!("cuda:{ordinal}: {error}")),
        }
    }
    CudaProbe {
        available: !devices.is_empty(),
        reason: if failures.is_empty() {
            format!("the CUDA driver sees {count} device(s)")
        } else {
            format!("some devices did not open: {}", failures.join("; "))
        },
        devices,
    }
}

/// Whether one registration serves every device of `devices`, tried on this machine with a small
/// buffer: every device reads registered memory at its host address, a registration made with the
/// first device's context maps at that address in every other device's context, and the last
/// device's context can unregister it. `Err` says which step failed.
pub fn portable_registration_works(devices: &[&Device]) -> Result<(), String> {
    if let Some(device) = devices
        .iter()
        .find(|d| !d.properties().host_pointer_for_registered_memory)
    {
        return Err(format!(
            "cuda:{} reads registered memory at another address than the host's",
            device.properties().ordinal
        ));
    }
    let Some((&first, _)) = devices.split_first() else {
        return Ok(());
    };
    const PROBE_BYTES: usize = 2 << 20;
    let probe =
        memmap2::MmapMut::map_anon(PROBE_BYTES).map_err(|e| format!("probe buffer: {e}"))?;
    let host = probe.as_ptr();
    let bind = |device: &Device| device.bind().map_err(|e: DeviceError| e.to_string());
    bind(first)?;
    // SAFETY: a live, page-aligned anonymous mapping, unregistered below before it is unmapped; the
    // first device's context is current.
    let registered = unsafe { super::ffi::mem_host_register_read_only(host, PROBE_BYTES) }
        .map_err(|e| format!("registering a probe buffer: {e}"))?;
    let mut outcome = if registered == host as u64 {
        Ok(())
    } else {
        Err("the first device maps registered memory at another address".to_string())
    };
    for device in &devices[1..] {
        if outcome.is_err() {
            break;
        }
        outcome = bind(device).and_then(|()| {
            // SAFETY: registered portable above; this device's context is current.
            let mapped =
                unsafe { super::ffi::mem_host_device_pointer(host as *mut std::ffi::c_void) };
            match mapped {
                Ok(ptr) if ptr == host as u64 => Ok(()),
                Ok(_) => Err(format!(
                    "cuda:{} maps a portable registration at another address",
                    device.properties().ordinal
                )),
                Err(e) => Err(format!(
                    "cuda:{} does not see a portable registration: {e}",
                    device.properties().ordinal
                )),
            }
        });
    }
    let last = devices[devices.len() - 1];
    let unregistered = bind(last).and_then(|()| {
        // SAFETY: registered above; nothing reads it; a context is current.
        unsafe { super::ffi::mem_host_unregister(host) }.map_err(|e| e.to_string())
    });
    if let Err(reason) = unregistered {
        // Undo it from the context that made it, and do not share.
        let _ = bind(first);
        // SAFETY: as above.
        let _ = unsafe { super::ffi::mem_host_unregister(host) };
        outcome = outcome.and(Err(format!(
            "another device's context cannot unregister a portable registration: {reason}"
        )));
    }
    outcome
}
