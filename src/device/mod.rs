//! CUDA device access: the driver and NVRTC loaded at run time, devices, memory, streams, modules.
//!
//! Three layers, as in cudarc: raw bindings (`cudarc::driver::sys`, `cudarc::nvrtc::sys`), the thin
//! [`ffi`] layer that turns every return code into a `Result`, and the RAII types here ([`Device`],
//! [`DeviceBuffer`], [`PinnedBuffer`], [`BufferPool`], [`ExportableBuffer`], [`Stream`], [`Event`],
//! [`Graph`], [`Module`]). Everything that owns a driver resource holds a [`Device`], so the context
//! outlives it.
//!
//! *Invariant*: nothing here panics when CUDA is missing. `libcuda` and `libnvrtc` are opened on first
//! use; [`Device::open`] probes for both libraries and for every symbol this crate calls before making
//! any call, because cudarc's loader panics on a missing library or symbol (it resolves lazily). A
//! failed probe is [`DeviceError::Unavailable`], on which the daemon falls back to its CPU backend.
//!
//! *Invariant*: the hot path allocates nothing on the device: buffers come from pools made at start
//! ([`BufferPool`]) and batch slots are allocated once ([`ExportableBuffer`]).

pub mod ffi;
mod memory;
mod module;
pub mod numa;
pub mod probe;
mod stream;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as cu;

pub use ffi::{DriverCallError, NvrtcCallError};
pub use memory::{
    copy_async, fill_async, BufferPool, DeviceBuffer, DeviceMemory, DeviceRegion, ExportableBuffer,
    HostMappedBuffer, MappedHost, PinnedBuffer, PoolBuffer, POOL_ALIGN_BYTES,
};
pub use module::{
    cache_file_name, compile, CacheDir, CompileOptions, CompiledImage, Kernel, KernelSource,
    Module, ModuleOrigin, Target,
};
pub use stream::{time_on_stream, Event, EventTiming, Graph, Stream};

/// A device operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// CUDA cannot be used here: no driver, no NVRTC, a driver too old, or no such device. The daemon
    /// falls back to its CPU backend on this error.
    #[error("CUDA is not available: {reason}")]
    Unavailable {
        /// What was missing.
        reason: String,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverCallError),
    /// An NVRTC call other than the compilation itself failed.
    #[error(transparent)]
    Nvrtc(#[from] NvrtcCallError),
    /// A kernel did not compile.
    #[error("compiling kernel '{kernel}' with options {options:?} failed:\n{log}")]
    Compile {
        /// The kernel source's name.
        kernel: String,
        /// The NVRTC options used.
        options: Vec<String>,
        /// NVRTC's log.
        log: String,
    },
    /// A pool has no free buffer.
    #[error("pool '{pool}' has no free buffer (all {capacity} are in use)")]
    PoolExhausted {
        /// The pool's name.
        pool: String,
        /// Buffers in the pool.
        capacity: usize,
    },
    /// A copy or table would reach past the end of a buffer.
    #[error("{what}: {bytes} bytes at offset {offset} do not fit in {capacity} bytes")]
    OutOfBounds {
        /// What was being done.
        what: &'static str,
        /// Offset of the range.
        offset: u64,
        /// Length of the range.
        bytes: u64,
        /// Length of the buffer.
        capacity: u64,
    },
    /// An operating-system call around device memory failed (duplicating an exported descriptor).
    #[error("{what}: {source}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl DeviceError {
    /// Whether this is [`DeviceError::Unavailable`].
    pub fn is_unavailable(&self) -> bool {
        matches!(self, DeviceError::Unavailable { .. })
    }
}

/// Probes for `libcuda` and every driver symbol used, then calls `cuInit`; the outcome is kept for the
/// process. See the module's invariant for why the probe exists.
fn driver_ready() -> Result<(), DeviceError> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            if let Some(reason) = ffi::driver_library_missing() {
                return Err(reason);
            }
            let missing = ffi::missing_driver_symbols();
            if !missing.is_empty() {
                return Err(format!(
                    "the NVIDIA driver is too old: libcuda lacks {}",
                    missing.join(", ")
                ));
            }
            ffi::init().map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|reason| DeviceError::Unavailable { reason })
}

/// Probes for `libnvrtc` and every NVRTC symbol used; the outcome is kept for the process.
pub(crate) fn nvrtc_ready() -> Result<(), DeviceError> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            if let Some(reason) = ffi::nvrtc_library_missing() {
                return Err(reason);
            }
            let missing = ffi::missing_nvrtc_symbols();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("libnvrtc lacks {}", missing.join(", ")))
            }
        })
        .clone()
        .map_err(|reason| DeviceError::Unavailable { reason })
}

/// What gpufeed needs to know about a device, read once when it is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProperties {
    /// The device's index among the driver's devices.
    pub ordinal: usize,
    /// Marketing name, such as "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Compute capability (major, minor), such as (9, 0).
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// L2 cache size in bytes.
    pub l2_bytes: u64,
    /// Device memory in bytes.
    pub memory_bytes: u64,
    /// CUDA version the driver supports, 1000 * major + 10 * minor.
    pub driver_version: i32,
    /// Whether allocations can be exported as POSIX file descriptors (needed for shared batch slots).
    pub exportable_memory: bool,
    /// Whether registered host memory is read by the device at its host address
    /// (`CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`): then one portable registration serves every such
    /// device at the same address.
    pub host_pointer_for_registered_memory: bool,
    /// The device's PCI address as sysfs names it (`dddd:bb:dd.0`); empty when unknown.
    pub pci_address: String,
    /// The device's UUID (`cuDeviceGetUuid_v2`): how consumers whose `CUDA_VISIBLE_DEVICES` differ
    /// from the daemon's name the same physical GPU. `None` when the driver could not say.
    pub uuid: Option<[u8; 16]>,
}

pub(crate) struct DeviceInner {
    device: cu::CUdevice,
    context: cu::CUcontext,
    properties: DeviceProperties,
    /// Loaded modules by cache key: the per-device module cache.
    modules: Mutex<HashMap<String, Arc<Module>>>,
}

// SAFETY: the context handle is an opaque driver pointer; the driver API is thread-safe and the context
// is made current on whichever thread uses it (`bind`). The module map is behind a mutex.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; shared references only read the handles.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // Modules unload before the context goes. Errors are ignored: nothing can be done about them
        // while dropping, and the process keeps running on the CPU backend at worst.
        let _ = self.bind();
        if let Ok(mut modules) = self.modules.lock() {
            modules.clear();
        }
        // SAFETY: balances the retain in Device::open; every object using the context held a Device,
        // so none is left.
        let _ = unsafe { ffi::primary_context_release(self.device) };
    }
}

impl DeviceInner {
    fn bind(&self) -> Result<(), DeviceError> {
        // SAFETY: the primary context is retained for as long as this value lives.
        unsafe { ffi::context_set_current(self.context) }?;
        Ok(())
    }
}

/// One CUDA device with its primary context. Cheap to clone; the context lives while any clone or any
/// resource made from it does.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("properties", &self.inner.properties)
            .finish()
    }
}

impl Device {
    /// Number of CUDA devices; [`DeviceError::Unavailable`] when the driver cannot be loaded.
    pub fn count() -> Result<usize, DeviceError> {
        driver_ready()?;
        Ok(ffi::device_count()?.max(0) as usize)
    }

    /// Opens device `ordinal`: loads the driver if needed and retains the device's primary context.
    pub fn open(ordinal: usize) -> Result<Device, DeviceError> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(DeviceError::Unavailable {
                reason: format!("no CUDA device {ordinal} (the driver sees {count})"),
            });
        }
        let device = ffi::device_get(ordinal as i32)?;
        let context = ffi::primary_context_retain(device)?;
        let mut inner = DeviceInner {
            device,
            context,
            properties: DeviceProperties {
                ordinal,
                name: String::new(),
                compute_capability: (0, 0),
                multiprocessors: 0,
                l2_bytes: 0,
                memory_bytes: 0,
                driver_version: 0,
                exportable_memory: false,
                host_pointer_for_registered_memory: false,
                pci_address: String::new(),
                uuid: None,
            },
            modules: Mutex::new(HashMap::new()),
        };
        // From here on the context is released by DeviceInner's Drop whatever fails.
        inner.bind()?;
        use cu::CUdevice_attribute as A;
        let attribute = |a| ffi::device_attribute(device, a);
        inner.properties = DeviceProperties {
            ordinal,
            name: ffi::device_name(device)?,
            compute_capability: (
                attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
                attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
            ),
            multiprocessors: attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            l2_bytes: attribute(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as u64,
            memory_bytes: ffi::device_total_bytes(device)? as u64,
            driver_version: ffi::driver_version()?,
            exportable_memory: attribute(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0
                && attribute(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0,
            host_pointer_for_registered_memory: attribute(
                A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
            )? != 0,
            pci_address: match (
                attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
                attribute(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
                attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
            ) {
                (Ok(domain), Ok(bus), Ok(device)) => {
                    numa::pci_address(domain as u32, bus as u32, device as u32)
                }
                _ => String::new(),
            },
            uuid: ffi::device_uuid(device).ok(),
        };
        Ok(Device {
            inner: Arc::new(inner),
        })
    }

    /// The device's NUMA node and that node's CPUs, on a host with several nodes (see [`numa`]);
    /// `None` on a host with one, or when the node is unknown (the reason is logged).
    pub fn numa_placement(&self) -> Option<numa::NumaPlacement> {
        let address = &self.properties().pci_address;
        if address.is_empty() {
            return None;
        }
        match numa::placement_of(std::path::Path::new("/sys"), address) {
            Ok(placement) => placement,
            Err(error) => {
                tracing::warn!(
                    "cuda:{}: NUMA node unknown: {error}",
                    self.properties().ordinal
                );
                None
            }
        }
    }

    /// The properties read at open.
    pub fn properties(&self) -> &DeviceProperties {
        &self.inner.properties
    }

    /// Makes this device's context current on the calling thread. Every method that calls the driver
    /// does this first, so callers need it only around raw [`ffi`] calls of their own.
    pub fn bind(&self) -> Result<(), DeviceError> {
        self.inner.bind()
    }

    pub(crate) fn ordinal_i32(&self) -> i32 {
        self.inner.properties.ordinal as i32
    }

    pub(crate) fn modules(&self) -> &Mutex<HashMap<String, Arc<Module>>> {
        &self.inner.modules
    }

    /// Free and total bytes of the device's memory, as the driver reports them (all processes).
    pub fn memory_info(&self) -> Result<(usize, usize), DeviceError> {
        self.bind()?;
        // SAFETY: the device's context is current.
        Ok(unsafe { ffi::mem_get_info() }?)
    }

    /// Whether two handles are the same device context.
    pub fn same_as(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
