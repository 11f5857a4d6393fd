//! Device slots on the client side: the daemon's exported allocations mapped into this process, and
//! the two interprocess events of each slot (`docs/PROTOCOL.md`, "Slot memory, CUDA backend").
//!
//! The driver (`libcuda`) is loaded at run time through cudarc, only when a stream on a CUDA device is
//! opened, so the crate works on machines without a GPU. Every call's result is checked; a failure
//! names the call and the driver's error name.

use std::ffi::{c_char, c_void, CStr};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};

use cudarc::driver::sys as cu;

/// A CUDA stream handle as the driver API names it (a raw pointer).
pub(crate) type RawStream = cu::CUstream;

use crate::protocol::{StreamLayout, IPC_EVENT_HANDLE_BYTES};

/// Every driver entry point this module calls; checked before the first call, because cudarc's loader
/// panics on a missing symbol.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuDeviceGet",
    "cuDeviceGetPCIBusId",
    "cuDeviceGetUuid_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemGetAllocationGranularity",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemRelease",
    "cuIpcOpenEventHandle",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuMemcpyDtoH_v2",
];

/// A driver call failed, or the driver cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CudaError(pub String);

fn check(call: &'static str, code: cu::CUresult) -> Result<(), CudaError> {
    if code == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or fails.
    let rc = unsafe { cu::cuGetErrorName(code, &mut text) };
    let name = if rc == cu::CUresult::CUDA_SUCCESS && !text.is_null() {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{code:?}")
    };
    Err(CudaError(format!("{call} failed: {name}")))
}

/// Checks that `libcuda` loads and has every symbol this module calls.
fn probe_driver() -> Result<(), CudaError> {
    // SAFETY: only tries to dlopen the library under its known names.
    if !unsafe { cu::is_culib_present() } {
        return Err(CudaError(
            "libcuda could not be loaded (no NVIDIA driver, or its folder is not on the loader path)"
                .into(),
        ));
    }
    // SAFETY: the library loads; culib() keeps it open for the process.
    let library = unsafe { cu::culib() };
    let missing: Vec<&str> = DRIVER_SYMBOLS
        .iter()
        .copied()
        // SAFETY: only the symbol's presence is tested.
        .filter(|name| unsafe { library.get::<unsafe extern "C" fn()>(*name) }.is_err())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CudaError(format!(
            "the CUDA driver is too old: it lacks {}",
            missing.join(", ")
        )))
    }
}

/// One imported slot: where it starts in this process and its events.
#[derive(Debug)]
struct MappedSlot {
    ptr: cu::CUdeviceptr,
    ready: cu::CUevent,
    released: cu::CUevent,
    /// Whether a release of the slot was recorded on a stream with work queued (then `released`
    /// completes only after that work, which the unmapping must wait for).
    recorded: std::sync::atomic::AtomicBool,
}

/// How long dropping a stream's slots waits, at most, for the work its consumer queued on the last
/// batches before it unmaps them (see `Drop for DeviceSlots`).
const UNMAP_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// A stream's device slots, mapped read-write in this process on the daemon's device: the one
/// exported allocation that holds them all, imported and mapped once, slot *i* at *i* × `slot_stride`.
#[derive(Debug)]
pub(crate) struct DeviceSlots {
    device: cu::CUdevice,
    context: cu::CUcontext,
    /// The imported allocation (0 until imported).
    handle: cu::CUmemGenericAllocationHandle,
    /// The reserved address range (start, bytes; 0 bytes until reserved) and whether the allocation is
    /// mapped there.
    range: (cu::CUdeviceptr, usize),
    mapped: bool,
    slot_bytes: usize,
    slots: Vec<MappedSlot>,
}

// SAFETY: the handles are opaque driver values; the driver API is thread-safe, and every call first
// makes the context current on the calling thread.
unsafe impl Send for DeviceSlots {}
// SAFETY: as above; shared references only issue driver calls.
unsafe impl Sync for DeviceSlots {}

impl DeviceSlots {
    /// Maps `fd` (the exported allocation of every slot of `layout`, `ring_bytes` long, already
    /// checked by the layout rules) on CUDA device `ordinal` and opens the slots' events. Everything made is released again
    /// if a step fails.
    pub(crate) fn import(
        ordinal: u32,
        layout: &StreamLayout,
        ring_bytes: usize,
        fd: OwnedFd,
    ) -> Result<DeviceSlots, CudaError> {
        assert_eq!(layout.slot_events.len(), layout.slot_count as usize);
        let (device, context) = retain_primary(ordinal)?;
        let mut slots = DeviceSlots {
            device,
            context,
            handle: 0,
            range: (0, 0),
            mapped: false,
            slot_bytes: layout.slot_bytes as usize,
            slots: Vec::with_capacity(layout.slot_count as usize),
        };
        slots.bind()?;
        // SAFETY: CUmemAllocationProp is plain data; all-zero is valid before the fields are set.
        let mut prop: cu::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal as i32;
        let mut granularity = 0usize;
        // SAFETY: reads `prop`, writes one size.
        check("cuMemGetAllocationGranularity", unsafe {
            cu::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let stride = layout.slot_stride as usize;
        let mapped_bytes = ring_bytes
            .checked_next_multiple_of(granularity.max(1))
            .ok_or_else(|| {
                CudaError(format!(
                    "{} slots {stride} bytes apart do not fit in the address space",
                    layout.slot_count
                ))
            })?;
        // SAFETY: the context is current; the descriptor is open for the call; each step uses what the
        // previous produced and is undone by Drop. If the daemon's allocation is shorter than the
        // layout says, cuMemMap fails.
        unsafe {
            check(
                "cuMemImportFromShareableHandle",
                cu::cuMemImportFromShareableHandle(
                    &mut slots.handle,
                    fd.as_raw_fd() as isize as *mut c_void,
                    cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ),
            )?;
            let mut base: cu::CUdeviceptr = 0;
            check(
                "cuMemAddressReserve",
                cu::cuMemAddressReserve(&mut base, mapped_bytes, granularity, 0, 0),
            )?;
            slots.range = (base, mapped_bytes);
            check(
                "cuMemMap",
                cu::cuMemMap(base, mapped_bytes, 0, slots.handle, 0),
            )?;
            slots.mapped = true;
            let mut access: cu::CUmemAccessDesc = MaybeUninit::zeroed().assume_init();
            access.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            access.location.id = ordinal as i32;
            access.flags = cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            check(
                "cuMemSetAccess",
                cu::cuMemSetAccess(base, mapped_bytes, &access, 1),
            )?;
        }
        for (index, handles) in layout.slot_events.iter().enumerate() {
            // Pushed piece by piece so that Drop releases whatever a failure leaves behind.
            slots.slots.push(MappedSlot {
                ptr: slots.range.0 + (index * stride) as cu::CUdeviceptr,
                ready: std::ptr::null_mut(),
                released: std::ptr::null_mut(),
                recorded: std::sync::atomic::AtomicBool::new(false),
            });
            let slot = slots.slots.last_mut().expect("pushed above");
            // SAFETY: the context is current.
            unsafe {
                slot.ready = open_event(&handles.ready)?;
                slot.released = open_event(&handles.released)?;
            }
        }
        Ok(slots)
    }

    /// Makes the slots' context current on the calling thread, once per thread: a thread whose
    /// current context is already this one (the usual case from the second batch on, and with
    /// PyTorch or CuPy, which use the same primary context) makes no further driver call to set it.
    fn bind(&self) -> Result<(), CudaError> {
        let mut current: cu::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the calling thread's current context (or null) into a live local.
        check("cuCtxGetCurrent", unsafe {
            cu::cuCtxGetCurrent(&mut current)
        })?;
        if current == self.context {
            return Ok(());
        }
        // SAFETY: the context was retained in `import` and is released only in Drop.
        check("cuCtxSetCurrent", unsafe {
            cu::cuCtxSetCurrent(self.context)
        })
    }

    /// The device address of `slot`.
    pub(crate) fn ptr(&self, slot: u32) -> u64 {
        self.slots[slot as usize].ptr
    }

    /// Makes `stream` wait (on the device) for the daemon's fill of `slot`. A fill already complete
    /// (the usual case: the daemon hands a batch out once its device work is done) needs no wait,
    /// and none is queued: a wait on another process's event makes the device switch to this
    /// process's context for it, which costs more than the host's query.
    pub(crate) fn wait_ready(&self, slot: u32, stream: cu::CUstream) -> Result<(), CudaError> {
        self.bind()?;
        let ready = self.slots[slot as usize].ready;
        let timer = QUERY_STATS.ready.start();
        // SAFETY: the event is live.
        let complete = event_complete(unsafe { cu::cuEventQuery(ready) });
        QUERY_STATS.ready.add(timer);
        if complete? {
            return Ok(());
        }
        // SAFETY: the event is live; the caller vouched for the stream (Stream::set_cuda_stream).
        check("cuStreamWaitEvent", unsafe {
            cu::cuStreamWaitEvent(stream, ready, 0)
        })
    }

    /// Records on `stream` that the consumer is done with `slot`; the daemon's stream waits on it
    /// before writing the slot again. If recording fails, waits for `stream` on the host instead, so
    /// that the slot is never released while work still reads it.
    ///
    /// A stream with no work left (its query says so) cannot read the slot any more: then nothing is
    /// recorded, and the daemon's wait on the `released` event is on a record already complete.
    pub(crate) fn release(&self, slot: u32, stream: cu::CUstream) -> Result<(), CudaError> {
        self.bind()?;
        let timer = QUERY_STATS.stream.start();
        // SAFETY: the caller vouched for the stream.
        let idle = event_complete(unsafe { cu::cuStreamQuery(stream) });
        QUERY_STATS.stream.add(timer);
        if idle? {
            return Ok(());
        }
        let mapped = &self.slots[slot as usize];
        // SAFETY: as in wait_ready.
        let recorded = check("cuEventRecord", unsafe {
            cu::cuEventRecord(mapped.released, stream)
        });
        if recorded.is_ok() {
            mapped
                .recorded
                .store(true, std::sync::atomic::Ordering::Relaxed);
        } else {
            // SAFETY: as above.
            check("cuStreamSynchronize", unsafe {
                cu::cuStreamSynchronize(stream)
            })?;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes at `ptr` (inside `slot`) to the host once the slot's fill is done.
    pub(crate) fn copy_to_host(
        &self,
        slot: u32,
        ptr: u64,
        out: &mut [u8],
    ) -> Result<(), CudaError> {
        let mapped = &self.slots[slot as usize];
        assert!(ptr >= mapped.ptr && ptr + out.len() as u64 <= mapped.ptr + self.slot_bytes as u64);
        self.bind()?;
        // SAFETY: the event is live; the range was checked to lie in the mapped slot.
        unsafe {
            check("cuEventSynchronize", cu::cuEventSynchronize(mapped.ready))?;
            if !out.is_empty() {
                check(
                    "cuMemcpyDtoH_v2",
                    cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, out.len()),
                )?;
            }
        }
        Ok(())
    }
}

/// Counts of the driver queries a consumer makes for each batch, for diagnosis: how many, and the
/// time of one in [`QUERY_TIMED_EVERY`] (two clock reads a query would cost a batch about as much as
/// the query), from which [`QueryCounter::read`] estimates the total and the slow calls.
#[derive(Debug, Default)]
pub struct QueryCounter {
    calls: std::sync::atomic::AtomicU64,
    timed: std::sync::atomic::AtomicU64,
    timed_ns: std::sync::atomic::AtomicU64,
    slow: std::sync::atomic::AtomicU64,
}

/// A query slower than this (nanoseconds) counts as slow.
pub const SLOW_QUERY_NS: u64 = 50_000;

/// One query in this many is timed: prime, so that the timed queries do not fall on the same batch
/// of every group of batches published together (up to 16).
pub const QUERY_TIMED_EVERY: u64 = 17;

impl QueryCounter {
    const fn new() -> QueryCounter {
        QueryCounter {
            calls: std::sync::atomic::AtomicU64::new(0),
            timed: std::sync::atomic::AtomicU64::new(0),
            timed_ns: std::sync::atomic::AtomicU64::new(0),
            slow: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Counts a query about to be made; the start time when this one is timed.
    fn start(&self) -> Option<std::time::Instant> {
        use std::sync::atomic::Ordering::Relaxed;
        let call = self.calls.fetch_add(1, Relaxed);
        (call % QUERY_TIMED_EVERY == 0).then(std::time::Instant::now)
    }

    /// Ends a query counted by [`Self::start`].
    fn add(&self, started: Option<std::time::Instant>) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(started) = started else {
            return;
        };
        let ns = started.elapsed().as_nanos() as u64;
        self.timed.fetch_add(1, Relaxed);
        self.timed_ns.fetch_add(ns, Relaxed);
        self.slow.fetch_add(u64::from(ns > SLOW_QUERY_NS), Relaxed);
    }

    /// (calls, their total seconds, and how many took over [`SLOW_QUERY_NS`]) so far in this
    /// process; the seconds and the slow calls are estimated from the timed ones, scaled to all.
    pub fn read(&self) -> (u64, f64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let calls = self.calls.load(Relaxed);
        let timed = self.timed.load(Relaxed);
        if timed == 0 {
            return (calls, 0.0, 0);
        }
        let scale = calls as f64 / timed as f64;
        let total_s = self.timed_ns.load(Relaxed) as f64 / 1e9 * scale;
        let slow = (self.slow.load(Relaxed) as f64 * scale).round() as u64;
        (calls, total_s, slow)
    }
}

/// The process's per-batch driver queries: of a batch's ready event (`cuEventQuery`, when it is
/// handed out) and of the consumer's stream (`cuStreamQuery`, when it is released).
#[derive(Debug)]
pub struct QueryStats {
    pub ready: QueryCounter,
    pub stream: QueryCounter,
}

/// This process's [`QueryStats`].
pub static QUERY_STATS: QueryStats = QueryStats {
    ready: QueryCounter::new(),
    stream: QueryCounter::new(),
};

/// The answer of `cuEventQuery` / `cuStreamQuery`: true when the work is complete, false when it is
/// still pending, an error otherwise.
fn event_complete(code: cu::CUresult) -> Result<bool, CudaError> {
    match code {
        cu::CUresult::CUDA_SUCCESS => Ok(true),
        cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => check("cuEventQuery/cuStreamQuery", other).map(|()| true),
    }
}

/// Keeps device `ordinal`'s primary CUDA context alive while it lives, as a training process's
/// framework does: streams opened and closed meanwhile then map their slots into a context that
/// already exists, instead of creating it again. Made with [`retain_primary_context`].
#[derive(Debug)]
pub struct PrimaryContext {
    device: cu::CUdevice,
}

// SAFETY: the device handle is a plain integer; the driver API is thread-safe.
unsafe impl Send for PrimaryContext {}

/// Initializes the driver and retains device `ordinal`'s primary context (see [`PrimaryContext`]).
pub fn retain_primary_context(ordinal: u32) -> Result<PrimaryContext, CudaError> {
    let (device, _context) = retain_primary(ordinal)?;
    Ok(PrimaryContext { device })
}

/// Initializes the driver and retains device `ordinal`'s primary context: the device and the
/// context, which the caller releases with `cuDevicePrimaryCtxRelease_v2(device)` when done.
fn retain_primary(ordinal: u32) -> Result<(cu::CUdevice, cu::CUcontext), CudaError> {
    probe_driver()?;
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        check("cuInit", cu::cuInit(0))?;
        let mut device: cu::CUdevice = 0;
        check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal as i32))?;
        let mut context: cu::CUcontext = std::ptr::null_mut();
        check(
            "cuDevicePrimaryCtxRetain",
            cu::cuDevicePrimaryCtxRetain(&mut context, device),
        )?;
        Ok((device, context))
    }
}

/// The UUID of this process's CUDA device `ordinal` (`cuDeviceGetUuid_v2`): the same physical GPU has
/// the same UUID in the daemon, whatever either process's `CUDA_VISIBLE_DEVICES`, so the daemon
/// serves the consumer's `cuda:N` on the right GPU
/// (<https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>).
pub fn device_uuid(ordinal: u32) -> Result<[u8; 16], CudaError> {
    probe_driver()?;
    // SAFETY: CUuuid is 16 plain bytes; all-zero is a valid value for the driver to overwrite.
    let mut uuid: cu::CUuuid = unsafe { MaybeUninit::zeroed().assume_init() };
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        check("cuInit", cu::cuInit(0))?;
        let mut device: cu::CUdevice = 0;
        check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal as i32))?;
        check(
            "cuDeviceGetUuid_v2",
            cu::cuDeviceGetUuid_v2(&mut uuid, device),
        )?;
    }
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The PCI address of device `ordinal` as sysfs names it (`dddd:bb:dd.f`, lower case).
pub fn pci_address(ordinal: u32) -> Result<String, CudaError> {
    probe_driver()?;
    let mut name = [0 as c_char; 32];
    // SAFETY: plain driver calls with valid out-pointers; the buffer's length is passed.
    unsafe {
        check("cuInit", cu::cuInit(0))?;
        let mut device: cu::CUdevice = 0;
        check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal as i32))?;
        check(
            "cuDeviceGetPCIBusId",
            cu::cuDeviceGetPCIBusId(name.as_mut_ptr(), name.len() as i32, device),
        )?;
    }
    // SAFETY: the driver wrote a NUL-terminated string within the buffer.
    let text = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy();
    Ok(text.to_ascii_lowercase())
}

/// Moves the calling thread off the CPUs that service device `ordinal`'s interrupts
/// ([`crate::affinity`]), when other CPUs are allowed to it; returns the CPUs it runs on now, or
/// `None` when it was left as it was. Threads it starts afterwards inherit the restriction. For the
/// thread that takes batches from a stream: on the H100 test machine a consumer on the interrupt
/// CPU lost a quarter of its time at batches of 64 rows.
pub fn keep_thread_off_interrupt_cpus(ordinal: u32) -> Result<Option<Vec<usize>>, CudaError> {
    let address = pci_address(ordinal)?;
    let avoid = crate::affinity::interrupt_cpus(&address);
    crate::affinity::keep_thread_off(&avoid)
        .map_err(|e| CudaError(format!("setting the thread's CPU affinity: {e}")))
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: retained once in `retain_primary_context`.
        let _ = unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// Opens an interprocess event from its 64 handle bytes.
///
/// # Safety
/// A context is current.
unsafe fn open_event(bytes: &[u8; IPC_EVENT_HANDLE_BYTES]) -> Result<cu::CUevent, CudaError> {
    let handle = cu::CUipcEventHandle {
        reserved: bytes.map(|b| b as c_char),
    };
    let mut event: cu::CUevent = std::ptr::null_mut();
    check(
        "cuIpcOpenEventHandle",
        cu::cuIpcOpenEventHandle(&mut event, handle),
    )?;
    Ok(event)
}

impl DeviceSlots {
    /// Waits, for [`UNMAP_WAIT_MAX`] at most, until every release recorded on a stream with work
    /// queued has completed: until the work the consumer queued on its batches before releasing them
    /// is done. True when it has (a release never recorded needs no wait), false on a timeout or an
    /// error (the work is stuck, e.g. behind a collective whose peer died, or the daemon ended the
    /// session and its events are gone).
    fn releases_complete(&self) -> bool {
        let deadline = std::time::Instant::now() + UNMAP_WAIT_MAX;
        for slot in &self.slots {
            if slot.released.is_null() || !slot.recorded.load(std::sync::atomic::Ordering::Relaxed)
            {
                continue;
            }
            loop {
                // SAFETY: the event is live (destroyed only in Drop, after this).
                match event_complete(unsafe { cu::cuEventQuery(slot.released) }) {
                    Ok(true) => break,
                    Ok(false) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                    _ => return false,
                }
            }
        }
        true
    }
}

impl Drop for DeviceSlots {
    fn drop(&mut self) {
        let _ = self.bind();
        // Work the consumer queued on its batches may still read them (a framework frees a tensor,
        // and with it the last batch, while kernels reading it are queued, e.g. a rank running ahead
        // of its GPU behind an all-reduce): the memory is unmapped only once the release each batch
        // recorded after that work has completed, or those kernels fault. If that does not happen
        // within UNMAP_WAIT_MAX, the mapping is left in place (its device memory stays held until
        // the process exits) rather than pulled from under work that may still read it.
        let unmap = self.releases_complete();
        if !unmap {
            eprintln!(
                "gpufeed-client: the work queued on a stream's last batches did not finish within {} s; \
                 its {} bytes of device memory stay mapped until the process exits",
                UNMAP_WAIT_MAX.as_secs(),
                self.range.1
            );
        }
        // SAFETY: each resource was made in `import` and is torn down once, in reverse order; null
        // or zero values mark the steps that never happened.
        unsafe {
            for slot in &self.slots {
                if !slot.released.is_null() {
                    let _ = cu::cuEventDestroy_v2(slot.released);
                }
                if !slot.ready.is_null() {
                    let _ = cu::cuEventDestroy_v2(slot.ready);
                }
            }
            if unmap {
                if self.mapped {
                    let _ = cu::cuMemUnmap(self.range.0, self.range.1);
                }
                if self.range.1 > 0 {
                    let _ = cu::cuMemAddressFree(self.range.0, self.range.1);
                }
                if self.handle != 0 {
                    let _ = cu::cuMemRelease(self.handle);
                }
                // Retained once in `import`; a mapping left in place keeps the context too.
                let _ = cu::cuDevicePrimaryCtxRelease_v2(self.device);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_counter_times_one_call_in_n_and_scales_its_estimates_to_all() {
        let counter = QueryCounter::new();
        let mut timed = 0;
        for _ in 0..(QUERY_TIMED_EVERY * 4 + 1) {
            let started = counter.start();
            timed += u64::from(started.is_some());
            counter.add(started);
        }
        // The first call and every QUERY_TIMED_EVERY-th after it.
        assert_eq!(timed, 5);
        let (calls, total_s, slow) = counter.read();
        assert_eq!(calls, QUERY_TIMED_EVERY * 4 + 1);
        assert!(total_s >= 0.0);
        assert_eq!(slow, 0);
        // A slow timed call counts for the calls it stands for.
        counter
            .slow
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (_, _, slow) = counter.read();
        assert_eq!(
            slow,
            ((QUERY_TIMED_EVERY * 4 + 1) as f64 / 5.0).round() as u64
        );
        assert_eq!(QueryCounter::new().read(), (0, 0.0, 0));
    }
}
