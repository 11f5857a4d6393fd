//! Device and page-locked host memory: plain buffers, fixed pools, and exportable batch slots.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys as cu;

use super::{ffi, Device, DeviceError, Stream};

/// Alignment of every buffer handed out by a [`BufferPool`]: the driver's own allocation alignment, so
/// that pooled buffers admit the same 16-byte vector accesses as fresh ones.
pub const POOL_ALIGN_BYTES: usize = 256;

/// Device memory that a kernel or copy can address: a base address and a length.
pub trait DeviceMemory {
    /// The device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn check_range(
    what: &'static str,
    offset: usize,
    bytes: usize,
    capacity: usize,
) -> Result<(), DeviceError> {
    if offset <= capacity && bytes <= capacity - offset {
        Ok(())
    } else {
        Err(DeviceError::OutOfBounds {
            what,
            offset: offset as u64,
            bytes: bytes as u64,
            capacity: capacity as u64,
        })
    }
}

/// Copies `data` to `memory` at `offset`; the bytes are in device memory when this returns.
///
/// The copy is not ordered after work queued on [`Stream`]s (they do not synchronise with the legacy
/// stream): the caller lets such work on the same memory finish first. Not for the hot path, which
/// uploads from pinned memory on its own stream.
pub fn write_sync(
    memory: &dyn DeviceMemory,
    device: &Device,
    offset: usize,
    data: &[u8],
) -> Result<(), DeviceError> {
    check_range("host-to-device copy", offset, data.len(), memory.len())?;
    if data.is_empty() {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: the range was checked against the allocation, which `memory` keeps alive for the call.
    unsafe { ffi::memcpy_htod(memory.device_ptr() + offset as u64, data) }?;
    ffi::legacy_stream_synchronize()?;
    Ok(())
}

/// Copies `out.len()` bytes from `memory` at `offset` into `out`, synchronously. Work queued on
/// [`Stream`]s that writes the range must have finished (an event or stream synchronised) first.
pub fn read_sync(
    memory: &dyn DeviceMemory,
    device: &Device,
    offset: usize,
    out: &mut [u8],
) -> Result<(), DeviceError> {
    check_range("device-to-host copy", offset, out.len(), memory.len())?;
    if out.is_empty() {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: as in write_sync.
    unsafe { ffi::memcpy_dtoh(out, memory.device_ptr() + offset as u64) }?;
    Ok(())
}

/// A device allocation (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    device: Device,
    ptr: cu::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least one byte is allocated, so that the address is valid).
    pub fn new(device: &Device, bytes: usize) -> Result<DeviceBuffer, DeviceError> {
        device.bind()?;
        // SAFETY: the device's context is current.
        let ptr = unsafe { ffi::mem_alloc(bytes.max(1)) }?;
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            bytes,
        })
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_host(device: &Device, data: &[u8]) -> Result<DeviceBuffer, DeviceError> {
        let buffer = DeviceBuffer::new(device, data.len())?;
        buffer.write(0, data)?;
        Ok(buffer)
    }

    /// The device this buffer lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Synchronous host-to-device copy at `offset`. Not ordered after work queued on [`Stream`]s: let
    /// such work on the same memory finish first.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        write_sync(self, &self.device, offset, data)
    }

    /// Synchronous device-to-host copy from `offset`. Not ordered after work queued on [`Stream`]s: let
    /// such work on the same memory finish first.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        read_sync(self, &self.device, offset, out)
    }

    /// The whole buffer, copied to the host synchronously.
    pub fn to_vec(&self) -> Result<Vec<u8>, DeviceError> {
        let mut out = vec![0u8; self.bytes];
        self.read(0, &mut out)?;
        Ok(out)
    }
}

impl DeviceMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: allocated in `new` and freed once; users of an asynchronous operation on the buffer
        // promised (in that operation's safety contract) to keep it alive until completion.
        let _ = unsafe { ffi::mem_free(self.ptr) };
    }
}

/// A range of a [`PinnedBuffer`] as kernels see it (see [`PinnedBuffer::mapped`]).
pub struct MappedHost<'a> {
    device_ptr: u64,
    bytes: usize,
    _buffer: std::marker::PhantomData<&'a PinnedBuffer>,
}

impl DeviceMemory for MappedHost<'_> {
    fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    fn len(&self) -> usize {
        self.bytes
    }
}

/// Page-locked host memory (`cuMemAllocHost`): the source of asynchronous uploads.
pub struct PinnedBuffer {
    device: Device,
    ptr: *mut u8,
    /// The address kernels read the buffer at (page-locked memory is mapped for the device).
    device_ptr: u64,
    bytes: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through &/&mut self.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references only read.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `bytes` of page-locked memory, zeroed.
    pub fn new(device: &Device, bytes: usize) -> Result<PinnedBuffer, DeviceError> {
        device.bind()?;
        // SAFETY: the device's context is current.
        let ptr = unsafe { ffi::mem_alloc_host(bytes.max(1)) }? as *mut u8;
        // SAFETY: the allocation holds at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        // SAFETY: `ptr` is a live allocation of `mem_alloc_host`; the context is current.
        let device_ptr = match unsafe { ffi::mem_host_device_pointer(ptr.cast()) } {
            Ok(device_ptr) => device_ptr,
            Err(error) => {
                // SAFETY: allocated above, not used elsewhere.
                let _ = unsafe { ffi::mem_free_host(ptr.cast()) };
                return Err(error.into());
            }
        };
        Ok(PinnedBuffer {
            device: device.clone(),
            ptr,
            device_ptr,
            bytes,
        })
    }

    /// Bytes `offset .. offset + bytes` of the buffer as kernels read them: over PCIe, without a
    /// copy. For small tables a kernel reads once, which then need no upload (an upload may wait
    /// behind large copies on the copy engines).
    pub fn mapped(&self, offset: usize, bytes: usize) -> MappedHost<'_> {
        assert!(
            offset <= self.bytes && bytes <= self.bytes - offset,
            "range {offset}+{bytes} outside a pinned buffer of {} bytes",
            self.bytes
        );
        MappedHost {
            device_ptr: self.device_ptr + offset as u64,
            bytes,
            _buffer: std::marker::PhantomData,
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `bytes` initialised bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// The bytes, mutably. No asynchronous copy from or to this buffer may be in flight.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Queues a copy of `self[src_offset .. src_offset + bytes]` to `dst` at `dst_offset` on `stream`.
    ///
    /// # Safety
    /// Until the copy has completed on `stream`, `self` and `dst` stay allocated, the host does not write
    /// `self`, and no other work writes or reads the destination range.
    pub unsafe fn upload_async(
        &self,
        stream: &Stream,
        src_offset: usize,
        dst: &dyn DeviceMemory,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        check_range("pinned upload source", src_offset, bytes, self.bytes)?;
        check_range("pinned upload destination", dst_offset, bytes, dst.len())?;
        if bytes == 0 {
            return Ok(());
        }
        self.device.bind()?;
        ffi::memcpy_htod_async(
            dst.device_ptr() + dst_offset as u64,
            self.ptr.add(src_offset),
            bytes,
            stream.raw(),
        )?;
        Ok(())
    }

    /// Queues a copy of `src[src_offset .. src_offset + bytes]` into `self` at `dst_offset`.
    ///
    /// # Safety
    /// Until the copy has completed on `stream`, both stay allocated and the host neither reads nor
    /// writes the destination range of `self`.
    pub unsafe fn download_async(
        &self,
        stream: &Stream,
        src: &dyn DeviceMemory,
        src_offset: usize,
        dst_offset: usize,
        bytes: usize,
    ) -> Result<(), DeviceError> {
        check_range("pinned download source", src_offset, bytes, src.len())?;
        check_range("pinned download destination", dst_offset, bytes, self.bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        self.device.bind()?;
        ffi::memcpy_dtoh_async(
            self.ptr.add(dst_offset),
            src.device_ptr() + src_offset as u64,
            bytes,
            stream.raw(),
        )?;
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: allocated in `new`, freed once; in-flight copies were the caller's to finish.
        let _ = unsafe { ffi::mem_free_host(self.ptr as *mut _) };
    }
}

/// Threads that fault in the pages of a [`HostMappedBuffer`] at most.
const HOST_MAPPED_FAULT_THREADS_MAX: usize = 16;

/// Host memory that copies write and kernels read in place, for copies of tens of GiB: an
/// anonymous mapping (transparent huge pages asked for), its pages faulted in by several threads
/// at once, then page-locked and mapped for the devices (`cuMemHostRegister`). Unlike
/// [`PinnedBuffer`] (`cuMemAllocHost`, which faults and locks every page on the calling thread),
/// it is not zeroed by the driver, and is ready at the rate the threads fault pages in.
pub struct HostMappedBuffer {
    device: Device,
    map: memmap2::MmapMut,
    /// The address kernels read the buffer at.
    device_ptr: u64,
}

impl HostMappedBuffer {
    /// Maps and registers `bytes` of host memory; `None` when the host cannot give it (the mapping,
    /// or page-locking it, fails: short of memory, or over the locked-memory limit). The contents
    /// are zero.
    pub fn new(device: &Device, bytes: usize) -> Result<Option<HostMappedBuffer>, DeviceError> {
        let started = std::time::Instant::now();
        let mut map = match memmap2::MmapOptions::new().len(bytes.max(1)).map_anon() {
            Ok(map) => map,
            Err(error) => {
                tracing::warn!("mapping {bytes} bytes of host memory failed: {error}");
                return Ok(None);
            }
        };
        // Huge pages where the kernel gives them: fewer faults and a shorter registration.
        let _ = map.advise(memmap2::Advice::HugePage);
        let page = 4096;
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, HOST_MAPPED_FAULT_THREADS_MAX);
        let chunk = map.len().div_ceil(threads).next_multiple_of(page);
        std::thread::scope(|scope| {
            for part in map.chunks_mut(chunk) {
                scope.spawn(move || {
                    for offset in (0..part.len()).step_by(page) {
                        // SAFETY: within the part; a volatile write so that the fault happens.
                        unsafe { std::ptr::write_volatile(part.as_mut_ptr().add(offset), 0) };
                    }
                });
            }
        });
        let faulted = started.elapsed();
        device.bind()?;
        // SAFETY: the mapping is live, page-aligned and writable, and stays mapped until `drop`
        // unregisters it; the device's context is current.
        let device_ptr = match unsafe { ffi::mem_host_register_mapped(map.as_mut_ptr(), map.len()) }
        {
            Ok(device_ptr) => device_ptr,
            Err(error) => {
                tracing::warn!("page-locking {bytes} bytes of host memory failed: {error}");
                return Ok(None);
            }
        };
        tracing::info!(
            "{} MiB of host memory page-locked for the device in {:.3} s ({:.3} s faulting it in \
             on {threads} threads)",
            bytes >> 20,
            started.elapsed().as_secs_f64(),
            faulted.as_secs_f64()
        );
        Ok(Some(HostMappedBuffer {
            device: device.clone(),
            map,
            device_ptr,
        }))
    }

    /// The host address of byte `offset`.
    pub fn host_ptr(&self, offset: usize) -> *mut u8 {
        assert!(
            offset <= self.map.len(),
            "offset {offset} past a host buffer"
        );
        // SAFETY: within the mapping. Writes through it are the caller's to order (copies).
        unsafe { self.map.as_ptr().add(offset).cast_mut() }
    }
}

impl DeviceMemory for HostMappedBuffer {
    fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

impl Drop for HostMappedBuffer {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: registered in `new`, unregistered once, before the mapping goes; copies and
        // kernels using it were the owner's to finish first.
        let _ = unsafe { ffi::mem_host_unregister(self.map.as_ptr()) };
    }
}

/// Queues a device-to-device copy on `stream`.
///
/// # Safety
/// Both buffers stay allocated, and nothing else writes the destination range or the source range,
/// until the copy has completed on `stream`.
pub unsafe fn copy_async(
    stream: &Stream,
    src: &dyn DeviceMemory,
    src_offset: usize,
    dst: &dyn DeviceMemory,
    dst_offset: usize,
    bytes: usize,
) -> Result<(), DeviceError> {
    check_range("device copy source", src_offset, bytes, src.len())?;
    check_range("device copy destination", dst_offset, bytes, dst.len())?;
    if bytes == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    ffi::memcpy_dtod_async(
        dst.device_ptr() + dst_offset as u64,
        src.device_ptr() + src_offset as u64,
        bytes,
        stream.raw(),
    )?;
    Ok(())
}

/// Queues a fill of `memory[offset .. offset + bytes]` with `value` on `stream`.
///
/// # Safety
/// The buffer stays allocated, and nothing else uses the range, until the fill has completed.
pub unsafe fn fill_async(
    stream: &Stream,
    memory: &dyn DeviceMemory,
    offset: usize,
    bytes: usize,
    value: u8,
) -> Result<(), DeviceError> {
    check_range("device fill", offset, bytes, memory.len())?;
    if bytes == 0 {
        return Ok(());
    }
    stream.device().bind()?;
    ffi::memset_d8_async(
        memory.device_ptr() + offset as u64,
        value,
        bytes,
        stream.raw(),
    )?;
    Ok(())
}

/// A fixed number of equal device buffers carved from one allocation made at start.
///
/// Acquiring never allocates: when every buffer is out, [`BufferPool::acquire`] fails with
/// [`DeviceError::PoolExhausted`] and the caller applies back-pressure.
pub struct BufferPool {
    name: String,
    region: DeviceBuffer,
    buffer_bytes: usize,
    stride_bytes: usize,
    capacity: usize,
    free: Mutex<Vec<usize>>,
}

impl BufferPool {
    /// Allocates `count` buffers of `buffer_bytes` each (each aligned to [`POOL_ALIGN_BYTES`]).
    pub fn new(
        device: &Device,
        name: &str,
        count: usize,
        buffer_bytes: usize,
    ) -> Result<Arc<BufferPool>, DeviceError> {
        assert!(count > 0, "a pool holds at least one buffer");
        let stride_bytes = buffer_bytes.div_ceil(POOL_ALIGN_BYTES).max(1) * POOL_ALIGN_BYTES;
        let region = DeviceBuffer::new(device, stride_bytes * count)?;
        Ok(Arc::new(BufferPool {
            name: name.to_owned(),
            region,
            buffer_bytes,
            stride_bytes,
            capacity: count,
            free: Mutex::new((0..count).rev().collect()),
        }))
    }

    /// Takes a free buffer; it returns to the pool when dropped.
    pub fn acquire(self: &Arc<Self>) -> Result<PoolBuffer, DeviceError> {
        let index = self
            .free
            .lock()
            .expect("pool free list poisoned")
            .pop()
            .ok_or_else(|| DeviceError::PoolExhausted {
                pool: self.name.clone(),
                capacity: self.capacity,
            })?;
        Ok(PoolBuffer {
            pool: Arc::clone(self),
            index,
        })
    }

    /// Buffers in the pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Buffers not handed out now.
    pub fn available(&self) -> usize {
        self.free.lock().expect("pool free list poisoned").len()
    }

    /// Bytes of each buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The device the pool lives on.
    pub fn device(&self) -> &Device {
        self.region.device()
    }
}

/// A buffer lent by a [`BufferPool`]; returned on drop.
///
/// Returning does not wait for the device: the holder drops it only once the work using it has
/// completed (an event it waited on), as with any buffer.
pub struct PoolBuffer {
    pool: Arc<BufferPool>,
    index: usize,
}

impl PoolBuffer {
    /// Index within the pool.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Synchronous host-to-device copy, not ordered after work queued on [`Stream`]s.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        write_sync(self, self.pool.device(), offset, data)
    }

    /// Synchronous device-to-host copy, not ordered after work queued on [`Stream`]s.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        read_sync(self, self.pool.device(), offset, out)
    }
}

impl DeviceMemory for PoolBuffer {
    fn device_ptr(&self) -> u64 {
        self.pool.region.device_ptr() + (self.index * self.pool.stride_bytes) as u64
    }
    fn len(&self) -> usize {
        self.pool.buffer_bytes
    }
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        if let Ok(mut free) = self.pool.free.lock() {
            free.push(self.index);
        }
    }
}

/// A device allocation made with `cuMemCreate` for the POSIX file-descriptor handle type and mapped
/// read-write for its device: a batch slot that another process can map through [`Self::export_fd`].
pub struct ExportableBuffer {
    device: Device,
    handle: cu::CUmemGenericAllocationHandle,
    ptr: cu::CUdeviceptr,
    bytes: usize,
    mapped_bytes: usize,
}

// SAFETY: the handles are opaque driver values; the driver API is thread-safe.
unsafe impl Send for ExportableBuffer {}
// SAFETY: shared references only read the handles.
unsafe impl Sync for ExportableBuffer {}

impl ExportableBuffer {
    /// Allocates at least `bytes` (rounded up to the allocation granularity, 2 MiB on the H100).
    pub fn new(device: &Device, bytes: usize) -> Result<ExportableBuffer, DeviceError> {
        if !device.properties().exportable_memory {
            return Err(DeviceError::Unavailable {
                reason: "the device cannot export memory as POSIX file descriptors".into(),
            });
        }
        device.bind()?;
        let prop = ffi::exportable_allocation_properties(device.ordinal_i32());
        let granularity = ffi::mem_granularity(&prop)?;
        let mapped_bytes = bytes.max(1).div_ceil(granularity) * granularity;
        // SAFETY: context current; size is a multiple of the granularity.
        let handle = unsafe { ffi::mem_create(mapped_bytes, &prop) }?;
        // SAFETY: the handle is live and mapped_bytes long.
        unsafe { Self::map(device, handle, bytes, mapped_bytes, granularity) }
    }

    /// Maps an allocation another process exported (the descriptor stays the caller's). `bytes` is the
    /// length the exporter announced; it is rounded up to the granularity for mapping.
    pub fn import(
        device: &Device,
        fd: BorrowedFd<'_>,
        bytes: usize,
    ) -> Result<ExportableBuffer, DeviceError> {
        device.bind()?;
        let prop = ffi::exportable_allocation_properties(device.ordinal_i32());
        let granularity = ffi::mem_granularity(&prop)?;
        let mapped_bytes = bytes.max(1).div_ceil(granularity) * granularity;
        // SAFETY: context current; the descriptor is open for the duration of the call.
        let handle = unsafe { ffi::mem_import_fd(fd.as_raw_fd()) }?;
        // SAFETY: the handle is live; if the exporter's allocation is shorter than announced, cuMemMap
        // fails and the handle is released.
        unsafe { Self::map(device, handle, bytes, mapped_bytes, granularity) }
    }

    /// Reserves an address range, maps `handle` there and grants read-write access; releases
    /// everything it made if a step fails.
    ///
    /// # Safety
    /// `handle` is live and owned by the caller, who gives it up to the returned value.
    unsafe fn map(
        device: &Device,
        handle: cu::CUmemGenericAllocationHandle,
        bytes: usize,
        mapped_bytes: usize,
        granularity: usize,
    ) -> Result<ExportableBuffer, DeviceError> {
        let ptr = match ffi::mem_address_reserve(mapped_bytes, granularity) {
            Ok(ptr) => ptr,
            Err(e) => {
                let _ = ffi::mem_release(handle);
                return Err(e.into());
            }
        };
        if let Err(e) = ffi::mem_map(ptr, mapped_bytes, handle) {
            let _ = ffi::mem_address_free(ptr, mapped_bytes);
            let _ = ffi::mem_release(handle);
            return Err(e.into());
        }
        if let Err(e) = ffi::mem_set_access_read_write(ptr, mapped_bytes, device.ordinal_i32()) {
            let _ = ffi::mem_unmap(ptr, mapped_bytes);
            let _ = ffi::mem_address_free(ptr, mapped_bytes);
            let _ = ffi::mem_release(handle);
            return Err(e.into());
        }
        Ok(ExportableBuffer {
            device: device.clone(),
            handle,
            ptr,
            bytes,
            mapped_bytes,
        })
    }

    /// A new file descriptor for the allocation, to send to another process (`SCM_RIGHTS`).
    pub fn export_fd(&self) -> Result<OwnedFd, DeviceError> {
        self.device.bind()?;
        // SAFETY: the handle is live and was created (or imported) with the POSIX descriptor type.
        let fd = unsafe { ffi::mem_export_fd(self.handle) }?;
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Bytes mapped (the requested length rounded up to the granularity).
    pub fn mapped_bytes(&self) -> usize {
        self.mapped_bytes
    }

    /// Synchronous host-to-device copy, not ordered after work queued on [`Stream`]s.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        write_sync(self, &self.device, offset, data)
    }

    /// Synchronous device-to-host copy, not ordered after work queued on [`Stream`]s.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        read_sync(self, &self.device, offset, out)
    }
}

impl DeviceMemory for ExportableBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.bytes
    }
}

impl ExportableBuffer {
    /// `bytes` of this allocation from `offset`, as a region that work can be queued on (one slot of
    /// a ring allocated as one buffer).
    ///
    /// # Safety
    /// The region does not keep the buffer alive: the caller keeps the buffer alive as long as the
    /// region is used, and until the device work queued on it is done.
    pub unsafe fn region(&self, offset: usize, bytes: usize) -> Result<DeviceRegion, DeviceError> {
        check_range("exportable buffer region", offset, bytes, self.bytes)?;
        Ok(DeviceRegion {
            ptr: self.ptr + offset as u64,
            bytes,
        })
    }
}

/// A range of device memory inside an allocation its holder keeps alive ([`ExportableBuffer::region`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    ptr: u64,
    bytes: usize,
}

impl DeviceMemory for DeviceRegion {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.bytes
    }
}

impl Drop for ExportableBuffer {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: mapped in `map` and torn down once, in reverse order; work using the slot was the
        // holder's to finish first.
        unsafe {
            let _ = ffi::mem_unmap(self.ptr, self.mapped_bytes);
            let _ = ffi::mem_address_free(self.ptr, self.mapped_bytes);
            let _ = ffi::mem_release(self.handle);
        }
    }
}
