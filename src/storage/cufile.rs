//! The cuFile (GPUDirect Storage) engine: reads straight into device memory.
//!
//! libcufile is loaded at run time through cudarc's loader (in `device::ffi`), but its entry points are called through
//! function types declared here: cuFile returns a `CUfileError` struct whose error field is a C enum,
//! and binding it as a Rust enum would make an error code unknown to the bindings undefined behaviour.
//! Here every code is an integer, decoded into [`CuFileCode`] with a catch-all.
//! Reference: <https://docs.nvidia.com/gpudirect-storage/api-reference-guide/index.html>.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use super::files::FileTable;
use super::FileId;
use super::{Extent, ReadError, ReadErrorKind};
use crate::device::{Device, DeviceMemory};

/// cuFile's error struct as returned by value: an operation code and a CUDA driver result.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RawError {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t`: a handle type, a union of descriptor and opaque handle, and the file-system ops.
#[repr(C)]
struct Descriptor {
    handle_type: c_int,
    handle: DescriptorHandle,
    fs_ops: *const c_void,
}

/// The union member of `CUfileDescr_t` (pointer-sized and pointer-aligned).
#[repr(C)]
union DescriptorHandle {
    fd: c_int,
    _opaque: *mut c_void,
}

const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;
const SUCCESS: c_int = 0;

type DriverOpenFn = unsafe extern "C" fn() -> RawError;
type DriverGetPropertiesFn = unsafe extern "C" fn(*mut u8) -> RawError;
type HandleRegisterFn = unsafe extern "C" fn(*mut *mut c_void, *mut Descriptor) -> RawError;
type HandleDeregisterFn = unsafe extern "C" fn(*mut c_void);
type BufRegisterFn = unsafe extern "C" fn(*const c_void, usize, c_int) -> RawError;
type BufDeregisterFn = unsafe extern "C" fn(*const c_void) -> RawError;
type ReadFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;

/// A cuFile status code, as documented in cufile.h.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CuFileCode(pub i64);

impl std::fmt::Display for CuFileCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            5001 => "CU_FILE_DRIVER_NOT_INITIALIZED",
            5002 => "CU_FILE_DRIVER_INVALID_PROPS",
            5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
            5008 => "CU_FILE_IO_NOT_SUPPORTED",
            5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
            5010 => "CU_FILE_NVFS_DRIVER_ERROR",
            5011 => "CU_FILE_CUDA_DRIVER_ERROR",
            5012 => "CU_FILE_CUDA_POINTER_INVALID",
            5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
            5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
            5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
            5016 => "CU_FILE_INVALID_MAPPING_SIZE",
            5017 => "CU_FILE_INVALID_MAPPING_RANGE",
            5018 => "CU_FILE_INVALID_FILE_TYPE",
            5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
            5020 => "CU_FILE_DIO_NOT_SET",
            5022 => "CU_FILE_INVALID_VALUE",
            5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
            5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
            5025 => "CU_FILE_PERMISSION_DENIED",
            5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
            5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
            5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
            5029 => "CU_FILE_DEVICE_NOT_FOUND",
            5030 => "CU_FILE_INTERNAL_ERROR",
            5031 => "CU_FILE_GETNEWFD_FAILED",
            5033 => "CU_FILE_NVFS_SETUP_ERROR",
            5034 => "CU_FILE_IO_DISABLED",
            _ => "unknown cuFile error",
        };
        write!(f, "{name} ({})", self.0)
    }
}

/// cuFile could not be opened, or a cuFile call failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CuFileError {
    /// libcufile is not installed (or not under a name the loader knows).
    #[error("libcufile could not be loaded")]
    LibraryMissing,
    /// libcufile lacks an entry point gpufeed calls.
    #[error("libcufile lacks {symbol}: {reason}")]
    MissingSymbol {
        /// The entry point.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// A cuFile call returned an error.
    #[error("{call} failed: {code} (CUDA result {cuda_result})")]
    Call {
        /// The entry point.
        call: &'static str,
        /// The cuFile status code.
        code: CuFileCode,
        /// The CUDA driver result cuFile passed on.
        cuda_result: i32,
    },
    /// The device could not be made current.
    #[error("{0}")]
    Device(String),
    /// The file has no O_DIRECT descriptor, which cuFile needs; the reason it has none.
    #[error("{0}")]
    NoDirectDescriptor(String),
    /// The descriptor could not be duplicated for cuFile.
    #[error("dup: {0}")]
    Dup(String),
}

fn check(call: &'static str, error: RawError) -> Result<(), CuFileError> {
    if error.err == SUCCESS {
        Ok(())
    } else {
        Err(CuFileError::Call {
            call,
            code: CuFileCode(error.err as i64),
            cuda_result: error.cu_err,
        })
    }
}

/// Whether libcufile can be loaded. Only tries to open the library under its known names; calls
/// nothing in it.
pub fn libcufile_present() -> bool {
    crate::device::ffi::cufile_library_present()
}

/// Whether the nvidia-fs kernel driver (real GPUDirect Storage) is loaded.
pub fn nvidia_fs_loaded() -> bool {
    Path::new("/proc/driver/nvidia-fs/version").exists() || Path::new("/dev/nvidia-fs0").exists()
}

/// The entry points, resolved once.
struct Api {
    handle_register: HandleRegisterFn,
    handle_deregister: HandleDeregisterFn,
    buf_register: BufRegisterFn,
    buf_deregister: BufDeregisterFn,
    read: ReadFn,
}

/// What happened to a cuFile read request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CuFileOutcome {
    /// The bytes are in device memory.
    Read,
    /// The file could not be registered with cuFile; the caller reads it another way.
    FileNotRegistered,
}

enum FileState {
    Registered { handle: *mut c_void, _fd: OwnedFd },
    Refused,
}

/// Device buffers registered with cuFile, bounded.
const REGISTERED_BUFFERS_MAX: usize = 16;
/// Largest single cuFileRead; longer extents are read in pieces, several at a time.
const READ_PIECE_BYTES: usize = 4 << 20;
/// Threads issuing cuFileRead calls for one extent.
pub const CUFILE_THREADS_DEFAULT: usize = 8;

/// An open cuFile driver and the files and buffers registered with it.
pub struct CuFileReader {
    device: Device,
    api: Api,
    nvidia_fs: bool,
    /// nvidia-fs version from the driver properties (0.0 when absent).
    pub nvfs_version: (u32, u32),
    files: HashMap<FileId, FileState>,
    buffers: Vec<(u64, usize)>,
    file_fallbacks: u64,
    /// Threads issuing reads for one extent (1 = sequential).
    pub threads: usize,
}

// SAFETY: cuFile handles may be used from any thread; the reader is used through &mut self.
unsafe impl Send for CuFileReader {}

impl CuFileReader {
    /// Loads libcufile, opens the driver and reads its properties. Fails with a reason when libcufile
    /// is absent, lacks an entry point, or the driver does not open.
    pub fn open(device: &Device) -> Result<CuFileReader, CuFileError> {
        if !libcufile_present() {
            return Err(CuFileError::LibraryMissing);
        }
        macro_rules! symbol {
            ($name:literal, $ty:ty) => {
                // SAFETY: the type matches the C prototype in cufile.h (with the error struct's enum
                // field read as an integer); the library is present (checked above).
                unsafe {
                    crate::device::ffi::cufile_symbol::<$ty>(concat!($name, "\0").as_bytes())
                }
                .map_err(|reason| CuFileError::MissingSymbol {
                    symbol: $name,
                    reason,
                })?
            };
        }
        let driver_open: DriverOpenFn = symbol!("cuFileDriverOpen", DriverOpenFn);
        let get_properties: DriverGetPropertiesFn =
            symbol!("cuFileDriverGetProperties", DriverGetPropertiesFn);
        let api = Api {
            handle_register: symbol!("cuFileHandleRegister", HandleRegisterFn),
            handle_deregister: symbol!("cuFileHandleDeregister", HandleDeregisterFn),
            buf_register: symbol!("cuFileBufRegister", BufRegisterFn),
            buf_deregister: symbol!("cuFileBufDeregister", BufDeregisterFn),
            read: symbol!("cuFileRead", ReadFn),
        };
        device
            .bind()
            .map_err(|e| CuFileError::Device(e.to_string()))?;
        // The driver is opened once per process and stays open: every stream's reader shares it, and
        // opening or closing it while another thread reads through it is not safe.
        static DRIVER: std::sync::OnceLock<Result<(u32, u32), CuFileError>> =
            std::sync::OnceLock::new();
        let nvfs_version = DRIVER
            .get_or_init(|| {
                // SAFETY: plain call of a resolved entry point.
                check("cuFileDriverOpen", unsafe { driver_open() })?;
                // CUfileDrvProps_t is a few dozen bytes of integers; a larger zeroed buffer absorbs
                // any growth of the struct in newer libraries.
                let mut properties = [0u8; 512];
                // SAFETY: the buffer is larger than the struct the library writes.
                Ok(
                    match check("cuFileDriverGetProperties", unsafe {
                        get_properties(properties.as_mut_ptr())
                    }) {
                        Ok(()) => (
                            u32::from_ne_bytes(properties[0..4].try_into().expect("4 bytes")),
                            u32::from_ne_bytes(properties[4..8].try_into().expect("4 bytes")),
                        ),
                        Err(reason) => {
                            tracing::warn!("{reason}");
                            (0, 0)
                        }
                    },
                )
            })
            .clone()?;
        Ok(CuFileReader {
            device: device.clone(),
            api,
            nvidia_fs: nvidia_fs_loaded(),
            nvfs_version,
            files: HashMap::new(),
            buffers: Vec::new(),
            file_fallbacks: 0,
            threads: CUFILE_THREADS_DEFAULT,
        })
    }

    /// Whether real GDS is present: the nvidia-fs kernel driver is loaded. Without it cuFile runs in
    /// compatibility mode, a POSIX bounce-buffer path.
    pub fn nvidia_fs_present(&self) -> bool {
        self.nvidia_fs
    }

    /// Files that could not be registered and were left to another path.
    pub fn file_fallbacks(&self) -> u64 {
        self.file_fallbacks
    }

    fn handle(&mut self, files: &FileTable, file: FileId) -> Option<*mut c_void> {
        if !self.files.contains_key(&file) {
            let open = files.get(file);
            let state = match self.register(open) {
                Ok((handle, fd)) => FileState::Registered { handle, _fd: fd },
                Err(reason) => {
                    tracing::warn!(
                        "cuFile cannot read {}: {reason}; reading it through the bounce path",
                        open.path.display()
                    );
                    self.file_fallbacks += 1;
                    FileState::Refused
                }
            };
            self.files.insert(file, state);
        }
        match self.files.get(&file) {
            Some(FileState::Registered { handle, .. }) => Some(*handle),
            _ => None,
        }
    }

    fn register(
        &self,
        open: &super::files::OpenFile,
    ) -> Result<(*mut c_void, OwnedFd), CuFileError> {
        let direct = open.direct_fd().ok_or_else(|| {
            CuFileError::NoDirectDescriptor(
                open.direct_unavailable
                    .clone()
                    .unwrap_or_else(|| "no O_DIRECT descriptor".into()),
            )
        })?;
        // cuFile keeps using the descriptor; a duplicate ties its life to the registration.
        // SAFETY: `direct` is an open descriptor owned by the file table for the duration of this call.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(direct) };
        let fd = borrowed
            .try_clone_to_owned()
            .map_err(|e| CuFileError::Dup(e.to_string()))?;
        let mut descriptor = Descriptor {
            handle_type: CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            handle: DescriptorHandle {
                _opaque: std::ptr::null_mut(),
            },
            fs_ops: std::ptr::null(),
        };
        // The opaque member was zeroed first so the bytes past the descriptor are defined.
        descriptor.handle.fd = fd.as_raw_fd();
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: both pointers are valid for the call; the descriptor stays open while registered.
        check("cuFileHandleRegister", unsafe {
            (self.api.handle_register)(&mut handle, &mut descriptor)
        })?;
        Ok((handle, fd))
    }

    fn register_buffer(&mut self, base: u64, bytes: usize) {
        if self.buffers.contains(&(base, bytes)) {
            return;
        }
        if self.buffers.len() == REGISTERED_BUFFERS_MAX {
            let (old, _) = self.buffers.remove(0);
            // SAFETY: registered below by this reader; reads are synchronous, so none is in flight.
            let _ = unsafe { (self.api.buf_deregister)(old as *const c_void) };
        }
        // SAFETY: `base .. base + bytes` is live device memory of the current context.
        match check("cuFileBufRegister", unsafe {
            (self.api.buf_register)(base as *const c_void, bytes, 0)
        }) {
            Ok(()) => self.buffers.push((base, bytes)),
            // Unregistered buffers still work (through cuFile's internal bounce buffers), only slower.
            Err(reason) => tracing::debug!("{reason}; reading without buffer registration"),
        }
    }

    /// Reads one extent into `dest`, continuing short reads; decodes cuFile results exactly: a
    /// non-negative value is bytes read (0 is end of file), -1 means errno is set, and below -1 the
    /// negated value is a cuFile status code.
    pub fn read(
        &mut self,
        files: &FileTable,
        extent: &Extent,
        dest: &dyn DeviceMemory,
    ) -> Result<CuFileOutcome, ReadError> {
        let error = |offset: u64, kind| ReadError {
            path: files.get(extent.file).path.clone(),
            offset,
            len: extent.len,
            kind,
        };
        if self.device.bind().is_err() {
            return Ok(CuFileOutcome::FileNotRegistered);
        }
        let Some(handle) = self.handle(files, extent.file) else {
            return Ok(CuFileOutcome::FileNotRegistered);
        };
        self.register_buffer(dest.device_ptr(), dest.len());
        // Pieces of the extent are read by up to `threads` threads at once: cuFileRead is
        // synchronous, so parallel calls are how a single extent keeps several I/Os in flight.
        let pieces: Vec<(usize, usize)> = (0..extent.len.div_ceil(READ_PIECE_BYTES))
            .map(|i| {
                let start = i * READ_PIECE_BYTES;
                (start, (extent.len - start).min(READ_PIECE_BYTES))
            })
            .collect();
        let target = ReadTarget {
            read: self.api.read,
            handle: handle as usize,
            base: dest.device_ptr(),
            extent,
        };
        let threads = self.threads.min(pieces.len()).max(1);
        let outcome = if threads == 1 {
            pieces.iter().try_for_each(|piece| target.read_piece(piece))
        } else {
            target.read_pieces_parallel(&self.device, &pieces, threads)
        };
        outcome.map_err(|(offset, kind)| error(offset, kind))?;
        Ok(CuFileOutcome::Read)
    }
}

/// Where one extent's cuFile reads go: the entry point, the registered file handle, the destination's
/// device address and the extent.
struct ReadTarget<'a> {
    read: ReadFn,
    handle: usize,
    base: u64,
    extent: &'a Extent,
}

impl ReadTarget<'_> {
    /// Reads piece `(start, len)` of the extent (offsets relative to the extent), continuing short
    /// reads. Fails with the file offset at fault.
    fn read_piece(&self, &(start, len): &(usize, usize)) -> Result<(), (u64, ReadErrorKind)> {
        let extent = self.extent;
        let mut done = 0usize;
        while done < len {
            let file_offset = extent.offset + (start + done) as u64;
            // SAFETY: the destination range lies within the destination (checked by the caller); the
            // handle is registered and outlives this call; the call is synchronous.
            let result = unsafe {
                (self.read)(
                    self.handle as *mut c_void,
                    self.base as *mut c_void,
                    len - done,
                    file_offset as i64,
                    (extent.dest_offset + start + done) as i64,
                )
            };
            let kind = match result {
                0 => ReadErrorKind::UnexpectedEof,
                -1 => ReadErrorKind::Os(std::io::Error::last_os_error()),
                r if r < -1 => ReadErrorKind::Os(std::io::Error::other(format!(
                    "cuFileRead: {}",
                    CuFileCode(-(r as i64))
                ))),
                r if r as usize > len - done => ReadErrorKind::Overlong {
                    returned: r as usize,
                },
                r => {
                    done += r as usize;
                    continue;
                }
            };
            return Err((file_offset, kind));
        }
        Ok(())
    }

    /// Reads `pieces` on `threads` threads, each taking the next piece until none is left.
    fn read_pieces_parallel(
        &self,
        device: &Device,
        pieces: &[(usize, usize)],
        threads: usize,
    ) -> Result<(), (u64, ReadErrorKind)> {
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| -> Result<(), (u64, ReadErrorKind)> {
                        device.bind().map_err(|e| {
                            (
                                self.extent.offset,
                                ReadErrorKind::Os(std::io::Error::other(e.to_string())),
                            )
                        })?;
                        loop {
                            let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(piece) = pieces.get(index) else {
                                return Ok(());
                            };
                            self.read_piece(piece)?;
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("cuFile reads do not panic"))
                .collect::<Result<Vec<()>, _>>()
                .map(|_| ())
        })
    }
}

impl Drop for CuFileReader {
    fn drop(&mut self) {
        let _ = self.device.bind();
        for (base, _) in self.buffers.drain(..) {
            // SAFETY: registered by this reader; no read is in flight.
            let _ = unsafe { (self.api.buf_deregister)(base as *const c_void) };
        }
        for (_, state) in self.files.drain() {
            if let FileState::Registered { handle, .. } = state {
                // SAFETY: registered by this reader and deregistered once.
                unsafe { (self.api.handle_deregister)(handle) };
            }
        }
        // The driver stays open for the process (see `open`).
    }
}
