//! The thin layer: every CUDA driver and NVRTC call gpufeed makes, each turned into a `Result`.
//!
//! Raw bindings come from `cudarc::{driver, nvrtc}::sys`, which loads `libcuda` and `libnvrtc` on first
//! use. Nothing here owns a resource; the RAII types in the sibling modules do. Each function names the
//! section of NVIDIA's driver API documentation
//! (<https://docs.nvidia.com/cuda/cuda-driver-api/>) or NVRTC documentation
//! (<https://docs.nvidia.com/cuda/nvrtc/>) it wraps.
//!
//! Functions that take raw handles or pointers are `unsafe`: the handle must be live and the memory
//! valid for the access the call makes. Functions without such arguments are safe.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::mem::MaybeUninit;

use cudarc::driver::sys as cu;
use cudarc::nvrtc::sys as rtc;

/// A driver call returned something other than `CUDA_SUCCESS`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverCallError {
    /// The driver entry point that failed.
    pub call: &'static str,
    /// Its return code.
    pub code: cu::CUresult,
}

impl DriverCallError {
    /// Whether the call failed because the host range is registered already
    /// (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`): a transient condition, not a refusal.
    pub fn is_already_registered(&self) -> bool {
        self.code == cu::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    }

    /// The code's symbolic name, such as `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn name(&self) -> String {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string or fails; nothing else is touched.
        let rc = unsafe { cu::cuGetErrorName(self.code, &mut text) };
        if rc != cu::CUresult::CUDA_SUCCESS || text.is_null() {
            return format!("{:?}", self.code);
        }
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether the failure was running out of device memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY
    }
}

impl fmt::Display for DriverCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, self.name())
    }
}

impl fmt::Debug for DriverCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for DriverCallError {}

/// Result of a driver call.
pub type DriverResult<T> = Result<T, DriverCallError>;

fn check(call: &'static str, code: cu::CUresult) -> DriverResult<()> {
    if code == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverCallError { call, code })
    }
}

/// An NVRTC call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvrtcCallError {
    /// The NVRTC entry point that failed.
    pub call: &'static str,
    /// Its return code.
    pub code: rtc::nvrtcResult,
}

impl fmt::Display for NvrtcCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { CStr::from_ptr(rtc::nvrtcGetErrorString(self.code)) };
        write!(f, "{} failed: {}", self.call, text.to_string_lossy())
    }
}

impl std::error::Error for NvrtcCallError {}

fn check_rtc(call: &'static str, code: rtc::nvrtcResult) -> Result<(), NvrtcCallError> {
    if code == rtc::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(NvrtcCallError { call, code })
    }
}

// ---------------------------------------------------------------------------------------------------
// Loading

/// Every driver entry point this module calls. [`missing_driver_symbols`] checks them all up front,
/// because cudarc resolves a symbol on its first call and panics when it is absent (an old driver).
pub const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
    "cuIpcGetEventHandle",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
];

/// Every NVRTC entry point this module calls.
pub const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcVersion",
    "nvrtcGetNumSupportedArchs",
    "nvrtcGetSupportedArchs",
    "nvrtcGetErrorString",
    "nvrtcCreateProgram",
    "nvrtcDestroyProgram",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
];

/// Whether `libcuda` can be opened; `None` when it can, else a reason.
pub fn driver_library_missing() -> Option<String> {
    // SAFETY: is_culib_present only tries to dlopen the candidate names and closes what it opened.
    if unsafe { cu::is_culib_present() } {
        None
    } else {
        Some(
            "libcuda could not be loaded (no NVIDIA driver, or its folder is not on the loader path)"
                .into(),
        )
    }
}

/// Whether `libnvrtc` can be opened; `None` when it can, else a reason.
pub fn nvrtc_library_missing() -> Option<String> {
    // SAFETY: as for driver_library_missing.
    if unsafe { rtc::is_culib_present() } {
        None
    } else {
        Some("libnvrtc could not be loaded (CUDA's lib folder is not on LD_LIBRARY_PATH)".into())
    }
}

/// The driver symbols in [`DRIVER_SYMBOLS`] that the loaded `libcuda` lacks.
///
/// Call only after [`driver_library_missing`] returned `None`: cudarc's loader panics otherwise.
pub fn missing_driver_symbols() -> Vec<&'static str> {
    // SAFETY: the library is known to be loadable; culib() opens it once and keeps it for the process.
    let library = unsafe { cu::culib() };
    DRIVER_SYMBOLS
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: only the symbol's presence is tested; the returned pointer is never called.
            unsafe { library.get::<unsafe extern "C" fn()>(*name) }.is_err()
        })
        .collect()
}

/// The NVRTC symbols in [`NVRTC_SYMBOLS`] that the loaded `libnvrtc` lacks.
///
/// Call only after [`nvrtc_library_missing`] returned `None`.
pub fn missing_nvrtc_symbols() -> Vec<&'static str> {
    // SAFETY: as for missing_driver_symbols.
    let library = unsafe { rtc::culib() };
    NVRTC_SYMBOLS
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: only the symbol's presence is tested.
            unsafe { library.get::<unsafe extern "C" fn()>(*name) }.is_err()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------
// Initialisation and devices (driver API: "Initialization", "Version Management", "Device Management")

/// `cuInit(0)`.
pub fn init() -> DriverResult<()> {
    // SAFETY: cuInit takes no pointers.
    check("cuInit", unsafe { cu::cuInit(0) })
}

/// `cuDriverGetVersion`: the CUDA version the driver supports, as 1000 * major + 10 * minor.
pub fn driver_version() -> DriverResult<i32> {
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe {
        cu::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// `cuDeviceGetCount`.
pub fn device_count() -> DriverResult<i32> {
    let mut count: c_int = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe {
        cu::cuDeviceGetCount(&mut count)
    })?;
    Ok(count)
}

/// `cuDeviceGet`.
pub fn device_get(ordinal: i32) -> DriverResult<cu::CUdevice> {
    let mut device: cu::CUdevice = 0;
    // SAFETY: writes one device handle.
    check("cuDeviceGet", unsafe {
        cu::cuDeviceGet(&mut device, ordinal)
    })?;
    Ok(device)
}

/// `cuDeviceGetName`.
pub fn device_name(device: cu::CUdevice) -> DriverResult<String> {
    let mut name = [0 as c_char; 256];
    // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
    check("cuDeviceGetName", unsafe {
        cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, device)
    })?;
    // SAFETY: NUL-terminated within the array by the call's contract.
    Ok(unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `cuDeviceGetUuid_v2`: the device's 16-byte UUID, the same in every process whatever its
/// `CUDA_VISIBLE_DEVICES` (<https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>).
pub fn device_uuid(device: cu::CUdevice) -> DriverResult<[u8; 16]> {
    // SAFETY: CUuuid is 16 plain bytes; all-zero is a valid value for the driver to overwrite.
    let mut uuid: cu::CUuuid = unsafe { std::mem::zeroed() };
    // SAFETY: writes one CUuuid.
    check("cuDeviceGetUuid_v2", unsafe {
        cu::cuDeviceGetUuid_v2(&mut uuid, device)
    })?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// `cuDeviceGetAttribute`.
pub fn device_attribute(
    device: cu::CUdevice,
    attribute: cu::CUdevice_attribute,
) -> DriverResult<i32> {
    let mut value: c_int = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetAttribute", unsafe {
        cu::cuDeviceGetAttribute(&mut value, attribute, device)
    })?;
    Ok(value)
}

/// `cuDeviceTotalMem`.
pub fn device_total_bytes(device: cu::CUdevice) -> DriverResult<usize> {
    let mut bytes: usize = 0;
    // SAFETY: writes one size.
    check("cuDeviceTotalMem_v2", unsafe {
        cu::cuDeviceTotalMem_v2(&mut bytes, device)
    })?;
    Ok(bytes)
}

/// `cuDeviceGetExecAffinitySupport(CU_EXEC_AFFINITY_TYPE_SM_COUNT)`: whether this process may make
/// contexts on `device` limited to part of its SMs. The driver offers that to MPS clients only
/// (Volta and later: `CUctxCreateParams::execAffinityParams`, "Only supported Volta+ MPS"), so it
/// tells whether this process's CUDA work goes through an MPS server. `Ok(None)` when the driver
/// lacks the entry point (before CUDA 11.4): nothing can be said.
pub fn exec_affinity_sm_count_supported(device: cu::CUdevice) -> DriverResult<Option<bool>> {
    const SYMBOL: &str = "cuDeviceGetExecAffinitySupport";
    // SAFETY: only the symbol's presence is tested (cudarc's loader panics on a missing one); the
    // library was loaded by the caller's earlier driver calls.
    if unsafe { cu::culib().get::<unsafe extern "C" fn()>(SYMBOL) }.is_err() {
        return Ok(None);
    }
    let mut supported: c_int = 0;
    // SAFETY: writes one int.
    check(SYMBOL, unsafe {
        cu::cuDeviceGetExecAffinitySupport(
            &mut supported,
            cu::CUexecAffinityType::CU_EXEC_AFFINITY_TYPE_SM_COUNT,
            device,
        )
    })?;
    Ok(Some(supported != 0))
}

// ---------------------------------------------------------------------------------------------------
// Contexts ("Primary Context Management", "Context Management")

/// `cuDevicePrimaryCtxRetain`.
pub fn primary_context_retain(device: cu::CUdevice) -> DriverResult<cu::CUcontext> {
    let mut context: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context handle.
    check("cuDevicePrimaryCtxRetain", unsafe {
        cu::cuDevicePrimaryCtxRetain(&mut context, device)
    })?;
    Ok(context)
}

/// `cuDevicePrimaryCtxRelease`.
///
/// # Safety
/// Balances one earlier retain; nothing may use the context through that reference afterwards.
pub unsafe fn primary_context_release(device: cu::CUdevice) -> DriverResult<()> {
    check(
        "cuDevicePrimaryCtxRelease_v2",
        cu::cuDevicePrimaryCtxRelease_v2(device),
    )
}

/// `cuCtxSetCurrent`.
///
/// # Safety
/// `context` must be a live context (or null).
pub unsafe fn context_set_current(context: cu::CUcontext) -> DriverResult<()> {
    check("cuCtxSetCurrent", cu::cuCtxSetCurrent(context))
}

// ---------------------------------------------------------------------------------------------------
// Modules and launches ("Module Management", "Execution Control", "Occupancy")

/// `cuModuleLoadData`: loads a cubin, or JIT-compiles a NUL-terminated PTX image.
///
/// # Safety
/// The calling thread's current context is the one to load into; `image` is a complete cubin, or PTX
/// text ending in NUL.
pub unsafe fn module_load_data(image: &[u8]) -> DriverResult<cu::CUmodule> {
    let mut module: cu::CUmodule = std::ptr::null_mut();
    check(
        "cuModuleLoadData",
        cu::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void),
    )?;
    Ok(module)
}

/// `cuModuleUnload`.
///
/// # Safety
/// `module` is live and no function of it runs or will be launched.
pub unsafe fn module_unload(module: cu::CUmodule) -> DriverResult<()> {
    check("cuModuleUnload", cu::cuModuleUnload(module))
}

/// `cuModuleGetFunction`.
///
/// # Safety
/// `module` is live; the function handle is valid only as long as the module is.
pub unsafe fn module_function(module: cu::CUmodule, name: &CStr) -> DriverResult<cu::CUfunction> {
    let mut function: cu::CUfunction = std::ptr::null_mut();
    check(
        "cuModuleGetFunction",
        cu::cuModuleGetFunction(&mut function, module, name.as_ptr()),
    )?;
    Ok(function)
}

/// `cuOccupancyMaxActiveBlocksPerMultiprocessor`.
///
/// # Safety
/// `function` is live.
pub unsafe fn occupancy_blocks_per_multiprocessor(
    function: cu::CUfunction,
    block_threads: u32,
    dynamic_shared_bytes: usize,
) -> DriverResult<u32> {
    let mut blocks: c_int = 0;
    check(
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &mut blocks,
            function,
            block_threads as c_int,
            dynamic_shared_bytes,
        ),
    )?;
    Ok(blocks.max(0) as u32)
}

/// `cuLaunchKernel` with kernel parameters (no `extra`).
///
/// # Safety
/// `function` is live; `params` holds one pointer per kernel parameter, each to a value of exactly the
/// parameter's type, read during the call; every device address passed stays valid, and is used by
/// nothing conflicting, until the launch has completed on `stream`.
pub unsafe fn launch_kernel(
    function: cu::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    stream: cu::CUstream,
    params: &mut [*mut c_void],
) -> DriverResult<()> {
    check(
        "cuLaunchKernel",
        cu::cuLaunchKernel(
            function,
            grid.0,
            grid.1,
            grid.2,
            block.0,
            block.1,
            block.2,
            shared_bytes,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
    )
}

// ---------------------------------------------------------------------------------------------------
// Streams, events and graphs ("Stream Management", "Event Management", "Graph Management")

/// `cuStreamCreate(CU_STREAM_NON_BLOCKING)`: a stream that does not synchronise with the legacy
/// default stream.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn stream_create() -> DriverResult<cu::CUstream> {
    let mut stream: cu::CUstream = std::ptr::null_mut();
    check(
        "cuStreamCreate",
        cu::cuStreamCreate(
            &mut stream,
            cu::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint,
        ),
    )?;
    Ok(stream)
}

/// `cuStreamDestroy`.
///
/// # Safety
/// `stream` is live and not used afterwards (work already queued still completes).
pub unsafe fn stream_destroy(stream: cu::CUstream) -> DriverResult<()> {
    check("cuStreamDestroy_v2", cu::cuStreamDestroy_v2(stream))
}

/// `cuStreamSynchronize`: blocks until the stream's queued work is done (this stream only).
///
/// # Safety
/// `stream` is live.
pub unsafe fn stream_synchronize(stream: cu::CUstream) -> DriverResult<()> {
    check("cuStreamSynchronize", cu::cuStreamSynchronize(stream))
}

/// `cuStreamWaitEvent`: later work on `stream` waits for `event` without blocking the host.
///
/// # Safety
/// Both handles are live.
pub unsafe fn stream_wait_event(stream: cu::CUstream, event: cu::CUevent) -> DriverResult<()> {
    check("cuStreamWaitEvent", cu::cuStreamWaitEvent(stream, event, 0))
}

/// `cuStreamBeginCapture` in thread-local mode.
///
/// # Safety
/// `stream` is live and not capturing.
pub unsafe fn stream_begin_capture(stream: cu::CUstream) -> DriverResult<()> {
    check(
        "cuStreamBeginCapture_v2",
        cu::cuStreamBeginCapture_v2(
            stream,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        ),
    )
}

/// `cuStreamEndCapture`.
///
/// # Safety
/// `stream` is live and capturing, begun on this thread.
pub unsafe fn stream_end_capture(stream: cu::CUstream) -> DriverResult<cu::CUgraph> {
    let mut graph: cu::CUgraph = std::ptr::null_mut();
    check(
        "cuStreamEndCapture",
        cu::cuStreamEndCapture(stream, &mut graph),
    )?;
    Ok(graph)
}

/// `cuGraphInstantiateWithFlags(0)`.
///
/// # Safety
/// `graph` is live.
pub unsafe fn graph_instantiate(graph: cu::CUgraph) -> DriverResult<cu::CUgraphExec> {
    let mut exec: cu::CUgraphExec = std::ptr::null_mut();
    check(
        "cuGraphInstantiateWithFlags",
        cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
    )?;
    Ok(exec)
}

/// `cuGraphLaunch`.
///
/// # Safety
/// Both handles are live; every resource the graph's nodes use is valid until it completes.
pub unsafe fn graph_launch(exec: cu::CUgraphExec, stream: cu::CUstream) -> DriverResult<()> {
    check("cuGraphLaunch", cu::cuGraphLaunch(exec, stream))
}

/// `cuGraphExecDestroy`.
///
/// # Safety
/// `exec` is live and not used afterwards.
pub unsafe fn graph_exec_destroy(exec: cu::CUgraphExec) -> DriverResult<()> {
    check("cuGraphExecDestroy", cu::cuGraphExecDestroy(exec))
}

/// `cuGraphDestroy`.
///
/// # Safety
/// `graph` is live and not used afterwards.
pub unsafe fn graph_destroy(graph: cu::CUgraph) -> DriverResult<()> {
    check("cuGraphDestroy", cu::cuGraphDestroy(graph))
}

/// `cuEventCreate`; `timing` chooses between a timing event and `CU_EVENT_DISABLE_TIMING`.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn event_create(timing: bool) -> DriverResult<cu::CUevent> {
    let flags = if timing {
        cu::CUevent_flags::CU_EVENT_DEFAULT
    } else {
        cu::CUevent_flags::CU_EVENT_DISABLE_TIMING
    };
    let mut event: cu::CUevent = std::ptr::null_mut();
    check(
        "cuEventCreate",
        cu::cuEventCreate(&mut event, flags as c_uint),
    )?;
    Ok(event)
}

/// `cuEventCreate` with `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`: synchronising on it puts the
/// thread to sleep instead of spinning, so a host waiting for the device costs no CPU.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn event_create_blocking() -> DriverResult<cu::CUevent> {
    let flags = cu::CUevent_flags::CU_EVENT_BLOCKING_SYNC as c_uint
        | cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    let mut event: cu::CUevent = std::ptr::null_mut();
    check("cuEventCreate", cu::cuEventCreate(&mut event, flags))?;
    Ok(event)
}

/// `cuEventCreate` with `CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING` (interprocess events may
/// not record timestamps): an event another process can open with `cuIpcOpenEventHandle`.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn event_create_interprocess() -> DriverResult<cu::CUevent> {
    let flags = cu::CUevent_flags::CU_EVENT_INTERPROCESS as c_uint
        | cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    let mut event: cu::CUevent = std::ptr::null_mut();
    check("cuEventCreate", cu::cuEventCreate(&mut event, flags))?;
    Ok(event)
}

/// `cuIpcGetEventHandle` ("Interprocess communication"): the 64 opaque bytes another process opens
/// the event with.
///
/// # Safety
/// `event` is live and was created with `CU_EVENT_INTERPROCESS`.
pub unsafe fn ipc_event_handle(event: cu::CUevent) -> DriverResult<[u8; 64]> {
    // SAFETY: the handle is plain bytes.
    let mut handle: cu::CUipcEventHandle = MaybeUninit::zeroed().assume_init();
    check(
        "cuIpcGetEventHandle",
        cu::cuIpcGetEventHandle(&mut handle, event),
    )?;
    Ok(handle.reserved.map(|b| b as u8))
}

/// `cuEventRecord`.
///
/// # Safety
/// Both handles are live.
pub unsafe fn event_record(event: cu::CUevent, stream: cu::CUstream) -> DriverResult<()> {
    check("cuEventRecord", cu::cuEventRecord(event, stream))
}

/// `cuEventSynchronize`: blocks until the work before the event's last record is done.
///
/// # Safety
/// `event` is live.
pub unsafe fn event_synchronize(event: cu::CUevent) -> DriverResult<()> {
    check("cuEventSynchronize", cu::cuEventSynchronize(event))
}

/// `cuEventQuery`: whether the work before the event's last record is done, without waiting.
///
/// # Safety
/// `event` is live.
pub unsafe fn event_query(event: cu::CUevent) -> DriverResult<bool> {
    match cu::cuEventQuery(event) {
        cu::CUresult::CUDA_SUCCESS => Ok(true),
        cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        code => Err(DriverCallError {
            call: "cuEventQuery",
            code,
        }),
    }
}

/// `cuEventElapsedTime`, in milliseconds.
///
/// # Safety
/// Both events are live timing events, recorded and complete.
pub unsafe fn event_elapsed_ms(start: cu::CUevent, end: cu::CUevent) -> DriverResult<f32> {
    let mut ms: f32 = 0.0;
    check(
        "cuEventElapsedTime_v2",
        cu::cuEventElapsedTime_v2(&mut ms, start, end),
    )?;
    Ok(ms)
}

/// `cuEventDestroy`.
///
/// # Safety
/// `event` is live and not used afterwards.
pub unsafe fn event_destroy(event: cu::CUevent) -> DriverResult<()> {
    check("cuEventDestroy_v2", cu::cuEventDestroy_v2(event))
}

// ---------------------------------------------------------------------------------------------------
// Memory ("Memory Management")

/// `cuMemGetInfo`: (free, total) bytes of the current context's device.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn mem_get_info() -> DriverResult<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    check(
        "cuMemGetInfo_v2",
        cu::cuMemGetInfo_v2(&mut free, &mut total),
    )?;
    Ok((free, total))
}

/// `cuMemAlloc`.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn mem_alloc(bytes: usize) -> DriverResult<cu::CUdeviceptr> {
    let mut ptr: cu::CUdeviceptr = 0;
    check("cuMemAlloc_v2", cu::cuMemAlloc_v2(&mut ptr, bytes))?;
    Ok(ptr)
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` came from [`mem_alloc`] and is not used afterwards.
pub unsafe fn mem_free(ptr: cu::CUdeviceptr) -> DriverResult<()> {
    check("cuMemFree_v2", cu::cuMemFree_v2(ptr))
}

/// `cuMemAllocHost`: page-locked host memory, mapped for the device.
///
/// # Safety
/// A context is current on the calling thread.
pub unsafe fn mem_alloc_host(bytes: usize) -> DriverResult<*mut c_void> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    check("cuMemAllocHost_v2", cu::cuMemAllocHost_v2(&mut ptr, bytes))?;
    Ok(ptr)
}

/// `cuMemHostGetDevicePointer` of memory from [`mem_alloc_host`] (or registered portable with
/// [`mem_host_register_read_only`]): the address the current context's kernels read it at.
///
/// # Safety
/// `ptr` is such memory and is live; a context is current on the calling thread.
pub unsafe fn mem_host_device_pointer(ptr: *mut c_void) -> DriverResult<cu::CUdeviceptr> {
    let mut device_ptr: cu::CUdeviceptr = 0;
    check(
        "cuMemHostGetDevicePointer_v2",
        cu::cuMemHostGetDevicePointer_v2(&mut device_ptr, ptr, 0),
    )?;
    Ok(device_ptr)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` came from [`mem_alloc_host`], no copy using it is in flight, and it is not used afterwards.
pub unsafe fn mem_free_host(ptr: *mut c_void) -> DriverResult<()> {
    check("cuMemFreeHost", cu::cuMemFreeHost(ptr))
}

/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_DEVICEMAP |
/// CU_MEMHOSTREGISTER_PORTABLE`, then `cuMemHostGetDevicePointer`: page-locks an existing host
/// mapping and maps it for the devices (every context, as it is portable), which may only read it
/// (the mapping may be read-only, as a shard's is), and returns the address at which the current
/// context's kernels read it (copies use the host address). On failure nothing stays registered.
///
/// # Safety
/// `ptr .. ptr + bytes` is a live, page-aligned mapping that stays mapped until
/// [`mem_host_unregister`] is called for `ptr`; a context is current on the calling thread.
pub unsafe fn mem_host_register_read_only(
    ptr: *const u8,
    bytes: usize,
) -> DriverResult<cu::CUdeviceptr> {
    let flags = cu::CU_MEMHOSTREGISTER_READ_ONLY
        | cu::CU_MEMHOSTREGISTER_DEVICEMAP
        | cu::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: the caller's contract.
    unsafe { host_register_mapped(ptr.cast_mut(), bytes, flags) }
}

/// `cuMemHostRegister` with `flags` (which include `CU_MEMHOSTREGISTER_DEVICEMAP`), then
/// `cuMemHostGetDevicePointer`; on failure nothing stays registered.
///
/// # Safety
/// As [`mem_host_register_read_only`], the mapping writable unless `flags` say read-only.
unsafe fn host_register_mapped(
    ptr: *mut u8,
    bytes: usize,
    flags: u32,
) -> DriverResult<cu::CUdeviceptr> {
    check(
        "cuMemHostRegister_v2",
        cu::cuMemHostRegister_v2(ptr as *mut c_void, bytes, flags),
    )?;
    let mut device_ptr: cu::CUdeviceptr = 0;
    let mapped = check(
        "cuMemHostGetDevicePointer_v2",
        cu::cuMemHostGetDevicePointer_v2(&mut device_ptr, ptr as *mut c_void, 0),
    );
    if let Err(error) = mapped {
        // Registered just above and not used yet: undo it so that the caller sees nothing locked.
        let _ = check(
            "cuMemHostUnregister",
            cu::cuMemHostUnregister(ptr as *mut c_void),
        );
        return Err(error);
    }
    Ok(device_ptr)
}

/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE`, then
/// `cuMemHostGetDevicePointer`: page-locks an existing writable host mapping, which copies may then
/// write and kernels read (at the returned address). On failure nothing stays registered.
///
/// # Safety
/// `ptr .. ptr + bytes` is a live, page-aligned, writable mapping that stays mapped until
/// [`mem_host_unregister`] is called for `ptr`; a context is current on the calling thread.
pub unsafe fn mem_host_register_mapped(
    ptr: *mut u8,
    bytes: usize,
) -> DriverResult<cu::CUdeviceptr> {
    let flags = cu::CU_MEMHOSTREGISTER_DEVICEMAP | cu::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: the caller's contract.
    unsafe { host_register_mapped(ptr, bytes, flags) }
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// `ptr` was registered with [`mem_host_register_read_only`] or [`mem_host_register_mapped`], no
/// copy from it is in flight, and a
/// context is current on the calling thread.
pub unsafe fn mem_host_unregister(ptr: *const u8) -> DriverResult<()> {
    check(
        "cuMemHostUnregister",
        cu::cuMemHostUnregister(ptr as *mut c_void),
    )
}

/// `cuMemcpyHtoD` (synchronous).
///
/// # Safety
/// `dst .. dst + src.len()` is device memory of the current context.
pub unsafe fn memcpy_htod(dst: cu::CUdeviceptr, src: &[u8]) -> DriverResult<()> {
    check(
        "cuMemcpyHtoD_v2",
        cu::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len()),
    )
}

/// `cuStreamSynchronize` on the legacy default stream: waits for synchronous copies to land.
///
/// A "synchronous" copy from pageable memory may return once the bytes are staged, before the DMA
/// into device memory is done; work on non-blocking streams is not ordered after it. Waiting for the
/// legacy stream (not the whole device) closes that gap.
pub fn legacy_stream_synchronize() -> DriverResult<()> {
    // SAFETY: the null handle names the current context's legacy default stream.
    check("cuStreamSynchronize", unsafe {
        cu::cuStreamSynchronize(std::ptr::null_mut())
    })
}

/// `cuMemcpyDtoH` (synchronous).
///
/// # Safety
/// `src .. src + dst.len()` is device memory of the current context.
pub unsafe fn memcpy_dtoh(dst: &mut [u8], src: cu::CUdeviceptr) -> DriverResult<()> {
    check(
        "cuMemcpyDtoH_v2",
        cu::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len()),
    )
}

/// `cuMemcpyHtoDAsync`.
///
/// # Safety
/// The device range is valid; `src .. src + bytes` stays valid and unmodified until the copy has
/// completed on `stream` (for page-locked memory the copy runs after the call returns).
pub unsafe fn memcpy_htod_async(
    dst: cu::CUdeviceptr,
    src: *const u8,
    bytes: usize,
    stream: cu::CUstream,
) -> DriverResult<()> {
    check(
        "cuMemcpyHtoDAsync_v2",
        cu::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream),
    )
}

/// `cuMemcpyDtoHAsync`.
///
/// # Safety
/// The device range is valid; `dst .. dst + bytes` stays valid and is neither read nor written by the
/// host until the copy has completed on `stream`.
pub unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: cu::CUdeviceptr,
    bytes: usize,
    stream: cu::CUstream,
) -> DriverResult<()> {
    check(
        "cuMemcpyDtoHAsync_v2",
        cu::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream),
    )
}

/// `cuMemcpyDtoDAsync`.
///
/// # Safety
/// Both device ranges are valid until the copy has completed on `stream`.
pub unsafe fn memcpy_dtod_async(
    dst: cu::CUdeviceptr,
    src: cu::CUdeviceptr,
    bytes: usize,
    stream: cu::CUstream,
) -> DriverResult<()> {
    check(
        "cuMemcpyDtoDAsync_v2",
        cu::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream),
    )
}

/// `cuMemsetD8Async`.
///
/// # Safety
/// The device range is valid until the set has completed on `stream`.
pub unsafe fn memset_d8_async(
    dst: cu::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: cu::CUstream,
) -> DriverResult<()> {
    check(
        "cuMemsetD8Async",
        cu::cuMemsetD8Async(dst, value, bytes, stream),
    )
}

// ---------------------------------------------------------------------------------------------------
// Virtual memory management ("Virtual Memory Management")

/// Properties of a pinned device allocation on `ordinal`, exportable as a POSIX file descriptor.
pub fn exportable_allocation_properties(ordinal: i32) -> cu::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is plain old data for which all-zero bytes are a valid value.
    let mut prop: cu::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
    prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

/// `cuMemGetAllocationGranularity` (minimum granularity).
pub fn mem_granularity(prop: &cu::CUmemAllocationProp) -> DriverResult<usize> {
    let mut granularity: usize = 0;
    // SAFETY: reads `prop`, writes one size.
    check("cuMemGetAllocationGranularity", unsafe {
        cu::cuMemGetAllocationGranularity(
            &mut granularity,
            prop,
            cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granularity)
}

/// `cuMemCreate`.
///
/// # Safety
/// A context is current; `bytes` is a multiple of the granularity for `prop`.
pub unsafe fn mem_create(
    bytes: usize,
    prop: &cu::CUmemAllocationProp,
) -> DriverResult<cu::CUmemGenericAllocationHandle> {
    let mut handle: cu::CUmemGenericAllocationHandle = 0;
    check("cuMemCreate", cu::cuMemCreate(&mut handle, bytes, prop, 0))?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// `handle` is live; its mappings may outlive this call (the memory goes when the last one is unmapped).
pub unsafe fn mem_release(handle: cu::CUmemGenericAllocationHandle) -> DriverResult<()> {
    check("cuMemRelease", cu::cuMemRelease(handle))
}

/// `cuMemAddressReserve`.
///
/// # Safety
/// A context is current.
pub unsafe fn mem_address_reserve(bytes: usize, alignment: usize) -> DriverResult<cu::CUdeviceptr> {
    let mut ptr: cu::CUdeviceptr = 0;
    check(
        "cuMemAddressReserve",
        cu::cuMemAddressReserve(&mut ptr, bytes, alignment, 0, 0),
    )?;
    Ok(ptr)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// The range was reserved with [`mem_address_reserve`] and nothing is mapped in it any more.
pub unsafe fn mem_address_free(ptr: cu::CUdeviceptr, bytes: usize) -> DriverResult<()> {
    check("cuMemAddressFree", cu::cuMemAddressFree(ptr, bytes))
}

/// `cuMemMap`.
///
/// # Safety
/// `ptr .. ptr + bytes` is reserved and unmapped; `handle` is live and at least `bytes` long.
pub unsafe fn mem_map(
    ptr: cu::CUdeviceptr,
    bytes: usize,
    handle: cu::CUmemGenericAllocationHandle,
) -> DriverResult<()> {
    check("cuMemMap", cu::cuMemMap(ptr, bytes, 0, handle, 0))
}

/// `cuMemUnmap`.
///
/// # Safety
/// The range is mapped and no work in flight uses it.
pub unsafe fn mem_unmap(ptr: cu::CUdeviceptr, bytes: usize) -> DriverResult<()> {
    check("cuMemUnmap", cu::cuMemUnmap(ptr, bytes))
}

/// `cuMemSetAccess`: read-write access for device `ordinal`.
///
/// # Safety
/// The range is mapped.
pub unsafe fn mem_set_access_read_write(
    ptr: cu::CUdeviceptr,
    bytes: usize,
    ordinal: i32,
) -> DriverResult<()> {
    // SAFETY: CUmemAccessDesc is plain old data; all-zero is valid before the fields are set.
    let mut desc: cu::CUmemAccessDesc = MaybeUninit::zeroed().assume_init();
    desc.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal;
    desc.flags = cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check("cuMemSetAccess", cu::cuMemSetAccess(ptr, bytes, &desc, 1))
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor, owned by the caller.
///
/// # Safety
/// `handle` is live and was created with the POSIX file-descriptor handle type requested.
pub unsafe fn mem_export_fd(handle: cu::CUmemGenericAllocationHandle) -> DriverResult<c_int> {
    let mut fd: c_int = -1;
    check(
        "cuMemExportToShareableHandle",
        cu::cuMemExportToShareableHandle(
            &mut fd as *mut c_int as *mut c_void,
            handle,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        ),
    )?;
    Ok(fd)
}

/// `cuMemImportFromShareableHandle` from a POSIX file descriptor (which stays the caller's).
///
/// # Safety
/// A context is current; `fd` is an open descriptor.
pub unsafe fn mem_import_fd(fd: c_int) -> DriverResult<cu::CUmemGenericAllocationHandle> {
    let mut handle: cu::CUmemGenericAllocationHandle = 0;
    check(
        "cuMemImportFromShareableHandle",
        cu::cuMemImportFromShareableHandle(
            &mut handle,
            fd as isize as *mut c_void,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ),
    )?;
    Ok(handle)
}

// ---------------------------------------------------------------------------------------------------
// NVRTC ("Compilation", "Supported Compile Options")

/// `nvrtcVersion`: (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), NvrtcCallError> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: writes two ints.
    check_rtc("nvrtcVersion", unsafe {
        rtc::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

/// `nvrtcGetSupportedArchs`: the `sm_XY` numbers (10 * X + Y) this NVRTC can generate code for.
pub fn nvrtc_supported_archs() -> Result<Vec<i32>, NvrtcCallError> {
    let mut count: c_int = 0;
    // SAFETY: writes one int.
    check_rtc("nvrtcGetNumSupportedArchs", unsafe {
        rtc::nvrtcGetNumSupportedArchs(&mut count)
    })?;
    let mut archs = vec![0 as c_int; count.max(0) as usize];
    // SAFETY: the array holds `count` ints, as the previous call said.
    check_rtc("nvrtcGetSupportedArchs", unsafe {
        rtc::nvrtcGetSupportedArchs(archs.as_mut_ptr())
    })?;
    Ok(archs)
}

/// What one NVRTC compilation produced.
pub struct NvrtcOutput {
    /// The cubin (when a real `sm_` architecture was targeted) or NUL-terminated PTX.
    pub image: Vec<u8>,
    /// The compiler's log (warnings), possibly empty.
    pub log: String,
}

/// Why a compilation failed: the program did not compile (with its log) or NVRTC itself failed.
pub enum NvrtcFailure {
    /// `nvrtcCompileProgram` rejected the source; the log says why.
    Compile(String),
    /// Another NVRTC call failed.
    Call(NvrtcCallError),
}

impl From<NvrtcCallError> for NvrtcFailure {
    fn from(e: NvrtcCallError) -> Self {
        NvrtcFailure::Call(e)
    }
}

/// Compiles `source` with `options`; returns the cubin when `cubin` is true, else PTX.
pub fn nvrtc_compile(
    source: &str,
    name: &str,
    options: &[String],
    cubin: bool,
) -> Result<NvrtcOutput, NvrtcFailure> {
    let source_c =
        CString::new(source).map_err(|_| NvrtcFailure::Compile("NUL in source".into()))?;
    let name_c = CString::new(name).map_err(|_| NvrtcFailure::Compile("NUL in name".into()))?;
    let options_c: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<Result<_, _>>()
        .map_err(|_| NvrtcFailure::Compile("NUL in an option".into()))?;
    let option_ptrs: Vec<*const c_char> = options_c.iter().map(|o| o.as_ptr()).collect();

    let mut program: rtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the strings outlive the program (destroyed below before they drop); no headers.
    check_rtc("nvrtcCreateProgram", unsafe {
        rtc::nvrtcCreateProgram(
            &mut program,
            source_c.as_ptr(),
            name_c.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    })?;
    let result = (|| {
        // SAFETY: `program` is live; the option pointers are valid NUL-terminated strings.
        let compiled = unsafe {
            rtc::nvrtcCompileProgram(program, option_ptrs.len() as c_int, option_ptrs.as_ptr())
        };
        let log = program_log(program)?;
        if compiled != rtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(NvrtcFailure::Compile(if log.is_empty() {
                NvrtcCallError {
                    call: "nvrtcCompileProgram",
                    code: compiled,
                }
                .to_string()
            } else {
                log
            }));
        }
        let image = if cubin {
            let mut size: usize = 0;
            // SAFETY: `program` is live and compiled; writes one size.
            check_rtc("nvrtcGetCUBINSize", unsafe {
                rtc::nvrtcGetCUBINSize(program, &mut size)
            })?;
            let mut image = vec![0u8; size];
            // SAFETY: the buffer holds `size` bytes, as NVRTC asked.
            check_rtc("nvrtcGetCUBIN", unsafe {
                rtc::nvrtcGetCUBIN(program, image.as_mut_ptr() as *mut c_char)
            })?;
            image
        } else {
            let mut size: usize = 0;
            // SAFETY: as above, for the PTX (its size includes the terminating NUL).
            check_rtc("nvrtcGetPTXSize", unsafe {
                rtc::nvrtcGetPTXSize(program, &mut size)
            })?;
            let mut image = vec![0u8; size];
            // SAFETY: the buffer holds `size` bytes.
            check_rtc("nvrtcGetPTX", unsafe {
                rtc::nvrtcGetPTX(program, image.as_mut_ptr() as *mut c_char)
            })?;
            image
        };
        Ok(NvrtcOutput { image, log })
    })();
    // SAFETY: `program` is live and destroyed once.
    let destroyed = check_rtc("nvrtcDestroyProgram", unsafe {
        rtc::nvrtcDestroyProgram(&mut program)
    });
    let output = result?;
    destroyed?;
    Ok(output)
}

fn program_log(program: rtc::nvrtcProgram) -> Result<String, NvrtcCallError> {
    let mut size: usize = 0;
    // SAFETY: `program` is live; writes one size.
    check_rtc("nvrtcGetProgramLogSize", unsafe {
        rtc::nvrtcGetProgramLogSize(program, &mut size)
    })?;
    if size <= 1 {
        return Ok(String::new());
    }
    let mut log = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes.
    check_rtc("nvrtcGetProgramLog", unsafe {
        rtc::nvrtcGetProgramLog(program, log.as_mut_ptr() as *mut c_char)
    })?;
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Ok(String::from_utf8_lossy(&log[..end]).trim_end().to_owned())
}

/// Whether libcufile can be loaded: only tries to open the library under its known names.
pub fn cufile_library_present() -> bool {
    // SAFETY: only tries to dlopen the candidate names; calls nothing in the library.
    unsafe { cudarc::cufile::sys::is_culib_present() }
}

/// The entry point `name` (NUL-terminated) of the loaded libcufile, as a function pointer of type
/// `T` (cudarc keeps the library open for the life of the process). Call only after
/// [`cufile_library_present`] returned true.
///
/// # Safety
/// `T` is a function pointer type matching the entry point's C prototype in cufile.h.
pub unsafe fn cufile_symbol<T: Copy>(name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller checked that the library is loadable.
    let library = unsafe { cudarc::cufile::sys::culib() };
    // SAFETY: the caller vouches for the type.
    unsafe { library.get::<T>(name) }
        .map(|symbol| *symbol)
        .map_err(|e| e.to_string())
}
