//! `gpufeed-ffi`: a stable C ABI over the consumer client (`gpufeed-client`), for C and C++
//! training loops and for bindings of other languages. The header is `ffi/include/gpufeed.h`,
//! generated from this file by cbindgen (`docs/C_API.md`).
//!
//! Conventions: every function returns a [`GfStatus`]; on an error, [`gf_last_error`] gives a
//! message for the calling thread and [`gf_last_daemon_code`] the daemon's code where it sent one.
//! Handles are created by `gf_*` functions and freed by the matching `gf_*_close` or
//! `gf_batch_release`; passing null where a handle is expected is `GF_STATUS_INVALID_ARGUMENT`,
//! never undefined behaviour. No panic crosses the boundary (`GF_STATUS_PANIC`).

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use gpufeed_client::protocol::{
    BatchForm, CorruptPolicy, Device, ErrorCode, FieldRequest, MixtureSource, Shuffle, StreamSpec,
    Tail, VariableRequest, STRING_BYTES_MAX,
};
use gpufeed_client::{ClientError, DType, FieldData, StreamState};

/// What a call did.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfStatus {
    /// Done.
    Ok = 0,
    /// `gf_next`: the epoch is over; no batch was returned.
    EndOfEpoch = 1,
    /// A null pointer, invalid UTF-8, an unknown enum value or an option out of range; nothing was
    /// sent.
    InvalidArgument = 2,
    /// The daemon's socket could not be connected.
    Connect = 3,
    /// The daemon refused the request or ended the session: see `gf_last_daemon_code`.
    Daemon = 4,
    /// The daemon broke the protocol; the session is over.
    Protocol = 5,
    /// The session ended (the daemon went away, or an earlier error ended it).
    Session = 6,
    /// A CUDA driver call failed.
    Cuda = 7,
    /// `gf_next`: every slot is held by batches not released yet; release one and call again.
    AllSlotsHeld = 8,
    /// A bug in gpufeed (a panic was caught at the boundary).
    Panic = 9,
}

/// The daemon's stable error codes (`docs/PROTOCOL.md`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfDaemonCode {
    /// The daemon sent no code (the last error was not the daemon's).
    None = 0,
    /// A malformed frame.
    BadFrame = 1,
    /// The client's protocol version is not supported.
    UnsupportedVersion = 2,
    /// No dataset of that name.
    UnknownDataset = 3,
    /// The request breaks a rule or a limit.
    BadRequest = 4,
    /// Corrupt data under the `fail` policy.
    CorruptData = 5,
    /// A limit of the daemon is reached (sessions, slot memory).
    ResourceExhausted = 6,
    /// The caller is not allowed.
    PermissionDenied = 7,
    /// A bug in the daemon.
    Internal = 8,
    /// The daemon is shutting down.
    Closed = 9,
    /// A code this client does not know.
    Unknown = 10,
}

/// Sample order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfShuffle {
    /// The dataset's order.
    None = 0,
    /// Shards shuffled, then samples within windows of `window_shards` shards.
    Window = 1,
    /// Every sample anywhere.
    Full = 2,
}

/// How a batch holds a variable-length field (`docs/PROTOCOL.md`, *Variable-length fields*).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfBatchForm {
    /// `[samples, L, ...]` padded to the batch's longest with zeros, beside an int32 field
    /// `NAME.lengths` of `[samples]`.
    Padded = 1,
    /// `[total, ...]` values back to back, beside an int32 field `NAME.cu_seqlens` of
    /// `[samples + 1]` cumulative offsets from 0.
    Packed = 2,
}

/// What happens to the last, partial batch of an epoch.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfTail {
    /// Dropped.
    Drop = 0,
    /// Filled up with samples from the start of the epoch.
    Pad = 1,
}

/// What a corrupt block does to a stream.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfCorruptPolicy {
    /// The stream ends with `GF_DAEMON_CODE_CORRUPT_DATA`.
    Fail = 0,
    /// Its samples are zero-filled and counted in `GfBatchInfo::replaced`.
    Replace = 1,
}

/// Element types (the codes of the shard format).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GfDtype {
    /// Keep the stored type (field requests only).
    Stored = 0,
    /// uint8
    U8 = 1,
    /// int8
    I8 = 2,
    /// uint16
    U16 = 3,
    /// int16
    I16 = 4,
    /// uint32
    U32 = 5,
    /// int32
    I32 = 6,
    /// uint64
    U64 = 7,
    /// int64
    I64 = 8,
    /// IEEE half
    F16 = 9,
    /// bfloat16
    Bf16 = 10,
    /// float
    F32 = 11,
    /// double
    F64 = 12,
}

/// Most dimensions of a field in a batch (the batch dimension included).
pub const GF_NDIM_MAX: usize = 8;

/// Room for a dataset name and its NUL.
pub const GF_NAME_BYTES: usize = 1025;
const _: () = assert!(GF_NAME_BYTES == STRING_BYTES_MAX + 1);

/// One requested field.
#[repr(C)]
pub struct GfFieldRequest {
    /// The field's name (NUL-terminated UTF-8).
    pub name: *const c_char,
    /// The element type to deliver (a `GfDtype`), or `GF_DTYPE_STORED`.
    pub dtype: u32,
}

/// How to serve one variable-length field.
#[repr(C)]
pub struct GfVariableRequest {
    /// The field's name (NUL-terminated UTF-8).
    pub name: *const c_char,
    /// Its batch form (a `GfBatchForm`).
    pub form: u32,
    /// The most elements a sample keeps (longer ones are truncated); 0 for no cap.
    pub cap: u32,
}

/// Everything that defines a stream. Fill it with [`gf_stream_options_init`], then change what you
/// need: later versions add fields at the end and `struct_size` tells them apart.
#[repr(C)]
pub struct GfStreamOptions {
    /// `sizeof(GfStreamOptions)` as the caller was compiled with (set by the init function).
    pub struct_size: u32,
    /// Dataset name (NUL-terminated UTF-8).
    pub dataset: *const c_char,
    /// Samples per batch on this rank.
    pub batch_size: u32,
    /// Fields to serve, in slot order; null (or a count of 0) for every field in its stored type.
    pub fields: *const GfFieldRequest,
    /// Entries of `fields`.
    pub field_count: usize,
    /// -1 for host memory, else the CUDA ordinal of the device batches are served on.
    pub device: i32,
    /// Sample order (a `GfShuffle`).
    pub shuffle: u32,
    /// Shards per window for `GF_SHUFFLE_WINDOW`.
    pub window_shards: u32,
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch.
    pub epoch: u64,
    /// This rank.
    pub rank: u32,
    /// Ranks consuming the epoch together.
    pub world_size: u32,
    /// Tail policy (a `GfTail`).
    pub tail: u32,
    /// Step of the epoch to start at (0: the beginning); ignored when `resume` is set.
    pub start_step: u64,
    /// A checkpoint to continue from (from [`gf_stream_state`]), at any world size; null for none.
    /// It gives the seed, epoch and shuffle left at their init values; `dataset`, and any of them
    /// set otherwise, must be the state's (else `GF_STATUS_INVALID_ARGUMENT` naming both values).
    pub resume: *const GfStreamState,
    /// Corrupt-block policy (a `GfCorruptPolicy`).
    pub on_corrupt: u32,
    /// Slots filled ahead of the consumer, at least (1 to 64): the daemon sizes slot rings in bytes
    /// and gives small batches more slots.
    pub prefetch: u32,
    /// Batch forms of variable-length fields; null (or a count of 0) serves each padded without
    /// a cap. Each field's values and its index (`NAME.lengths` or `NAME.cu_seqlens`) are fields
    /// of the batch, the index right after the values. Added after version 1 of this struct: read
    /// only when `struct_size` covers it.
    pub variable: *const GfVariableRequest,
    /// Entries of `variable`.
    pub variable_count: usize,
}

/// Bytes of `GfStreamOptions` before `variable` was added: callers compiled then pass this
/// `struct_size`, and are served as before.
const STREAM_OPTIONS_V1_BYTES: usize = std::mem::offset_of!(GfStreamOptions, variable);

/// One dataset of a mixture stream ([`gf_open_mixture_stream`]) and its weight.
#[repr(C)]
pub struct GfMixtureSource {
    /// Dataset name (NUL-terminated UTF-8).
    pub dataset: *const c_char,
    /// The source's weight: positive and finite; the weights need not sum to 1.
    pub weight: f64,
}

/// Where an epoch stands: enough to resume it.
#[repr(C)]
pub struct GfStreamState {
    /// Dataset name, NUL-terminated; for a mixture, its sources and weights as
    /// `mixture of web (0.7), code (0.3)` (and `, epoch of N samples` when given; cut to 1024
    /// bytes), which a resume checks against the mixture it opens.
    pub dataset: [c_char; GF_NAME_BYTES],
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch.
    pub epoch: u64,
    /// Sample order (a `GfShuffle`).
    pub shuffle: u32,
    /// Shards per window (window shuffle).
    pub window_shards: u32,
    /// Ranks that consumed the epoch together.
    pub world_size: u32,
    /// Samples per batch on each rank.
    pub batch_size: u32,
    /// Positions of the epoch's order consumed by all ranks together.
    pub cursor: u64,
}

/// One field of a batch. Pointers stay valid until the batch is released.
#[repr(C)]
pub struct GfField {
    /// Field name (NUL-terminated, owned by the batch).
    pub name: *const c_char,
    /// Element type.
    pub dtype: GfDtype,
    /// Dimensions, batch dimension first.
    pub ndim: u32,
    /// The first `ndim` entries are the shape.
    pub shape: [u64; GF_NDIM_MAX],
    /// The data in host memory (host streams), else null.
    pub host: *const c_void,
    /// The data's device address (`CUdeviceptr`, device streams), else 0.
    pub device_ptr: u64,
    /// Length in bytes (C order, no padding).
    pub bytes: u64,
}

/// What a batch is.
#[repr(C)]
pub struct GfBatchInfo {
    /// Epoch.
    pub epoch: u64,
    /// Step within the epoch.
    pub step: u64,
    /// Samples in the batch.
    pub samples: u32,
    /// Samples zero-filled for corrupt blocks.
    pub replaced: u32,
    /// The epoch cursor once every rank consumed this step.
    pub cursor_after: u64,
    /// Fields, for [`gf_batch_field`].
    pub field_count: u32,
}

/// A connection to the daemon (consumed by [`gf_open_stream`]).
pub struct GfClient {
    client: gpufeed_client::Client,
}

/// An open stream.
pub struct GfStream {
    stream: gpufeed_client::Stream,
}

/// A batch: a lease on one slot until [`gf_batch_release`].
pub struct GfBatch {
    batch: gpufeed_client::Batch,
    names: Vec<CString>,
}

thread_local! {
    static LAST_ERROR: RefCell<(CString, GfDaemonCode)> =
        RefCell::new((CString::default(), GfDaemonCode::None));
}

fn fail(status: GfStatus, message: impl Into<String>, code: GfDaemonCode) -> GfStatus {
    let message = CString::new(message.into().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = (message, code));
    status
}

fn invalid(message: impl Into<String>) -> GfStatus {
    fail(GfStatus::InvalidArgument, message, GfDaemonCode::None)
}

fn daemon_code(code: ErrorCode) -> GfDaemonCode {
    match code {
        ErrorCode::BadFrame => GfDaemonCode::BadFrame,
        ErrorCode::UnsupportedVersion => GfDaemonCode::UnsupportedVersion,
        ErrorCode::UnknownDataset => GfDaemonCode::UnknownDataset,
        ErrorCode::BadRequest => GfDaemonCode::BadRequest,
        ErrorCode::CorruptData => GfDaemonCode::CorruptData,
        ErrorCode::ResourceExhausted => GfDaemonCode::ResourceExhausted,
        ErrorCode::PermissionDenied => GfDaemonCode::PermissionDenied,
        ErrorCode::Internal => GfDaemonCode::Internal,
        ErrorCode::Closed => GfDaemonCode::Closed,
        ErrorCode::Unknown(_) => GfDaemonCode::Unknown,
    }
}

fn client_error(error: ClientError) -> GfStatus {
    let message = error.to_string();
    match error {
        ClientError::Connect { .. } => fail(GfStatus::Connect, message, GfDaemonCode::None),
        ClientError::Daemon { code, .. } => fail(GfStatus::Daemon, message, daemon_code(code)),
        ClientError::VersionMismatch { .. } => {
            fail(GfStatus::Daemon, message, GfDaemonCode::UnsupportedVersion)
        }
        ClientError::InvalidSpec(_) => invalid(message),
        ClientError::Protocol(_) => fail(GfStatus::Protocol, message, GfDaemonCode::None),
        ClientError::Cuda(_) => fail(GfStatus::Cuda, message, GfDaemonCode::None),
        ClientError::AllSlotsHeld { .. } => {
            fail(GfStatus::AllSlotsHeld, message, GfDaemonCode::None)
        }
        ClientError::Transport(_) | ClientError::Ended(_) | ClientError::Io(_) => {
            fail(GfStatus::Session, message, GfDaemonCode::None)
        }
    }
}

/// Runs `body`, turning a panic into `GF_STATUS_PANIC`.
fn guarded(body: impl FnOnce() -> GfStatus) -> GfStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(status) => status,
        Err(_) => fail(
            GfStatus::Panic,
            "a bug in gpufeed: a panic was caught at the C boundary",
            GfDaemonCode::None,
        ),
    }
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `text` is null or a NUL-terminated string that stays valid during the call.
unsafe fn string_arg<'a>(text: *const c_char, what: &str) -> Result<&'a str, GfStatus> {
    if text.is_null() {
        return Err(invalid(format!("{what} is null")));
    }
    // SAFETY: non-null, and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// The element type of a `GfDtype` value: `Ok(None)` for `GF_DTYPE_STORED`.
fn dtype_of(value: u32) -> Result<Option<DType>, GfStatus> {
    const ALL: [GfDtype; 13] = [
        GfDtype::Stored,
        GfDtype::U8,
        GfDtype::I8,
        GfDtype::U16,
        GfDtype::I16,
        GfDtype::U32,
        GfDtype::I32,
        GfDtype::U64,
        GfDtype::I64,
        GfDtype::F16,
        GfDtype::Bf16,
        GfDtype::F32,
        GfDtype::F64,
    ];
    let Some(&dtype) = ALL.iter().find(|d| **d as u32 == value) else {
        return Err(invalid(format!("{value} is not a GfDtype")));
    };
    Ok(Some(match dtype {
        GfDtype::Stored => return Ok(None),
        GfDtype::U8 => DType::U8,
        GfDtype::I8 => DType::I8,
        GfDtype::U16 => DType::U16,
        GfDtype::I16 => DType::I16,
        GfDtype::U32 => DType::U32,
        GfDtype::I32 => DType::I32,
        GfDtype::U64 => DType::U64,
        GfDtype::I64 => DType::I64,
        GfDtype::F16 => DType::F16,
        GfDtype::Bf16 => DType::BF16,
        GfDtype::F32 => DType::F32,
        GfDtype::F64 => DType::F64,
    }))
}

fn gf_dtype(dtype: DType) -> GfDtype {
    match dtype {
        DType::U8 => GfDtype::U8,
        DType::I8 => GfDtype::I8,
        DType::U16 => GfDtype::U16,
        DType::I16 => GfDtype::I16,
        DType::U32 => GfDtype::U32,
        DType::I32 => GfDtype::I32,
        DType::U64 => GfDtype::U64,
        DType::I64 => GfDtype::I64,
        DType::F16 => GfDtype::F16,
        DType::BF16 => GfDtype::Bf16,
        DType::F32 => GfDtype::F32,
        DType::F64 => GfDtype::F64,
    }
}

fn shuffle_of(value: u32, window_shards: u32) -> Result<Shuffle, GfStatus> {
    match value {
        v if v == GfShuffle::None as u32 => Ok(Shuffle::None),
        v if v == GfShuffle::Window as u32 => Ok(Shuffle::Window(window_shards)),
        v if v == GfShuffle::Full as u32 => Ok(Shuffle::Full),
        other => Err(invalid(format!("{other} is not a GfShuffle"))),
    }
}

/// The message of the calling thread's last error (empty if none), valid until its next failing
/// call. Never null.
#[no_mangle]
pub extern "C" fn gf_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().0.as_ptr())
}

/// The daemon's code of the calling thread's last error (`GF_DAEMON_CODE_NONE` when the daemon sent
/// none).
#[no_mangle]
pub extern "C" fn gf_last_daemon_code() -> GfDaemonCode {
    LAST_ERROR.with(|last| last.borrow().1)
}

/// Fills `options` with the defaults for `batch_size` samples a step from `dataset` (which must stay
/// valid until `gf_open_stream`): every field in its stored type, host memory, dataset order, seed
/// and epoch 0, rank 0 of 1, tail dropped, at least 4 slots ahead, failing on corrupt blocks.
///
/// # Safety
/// `options` is null or points to writable memory for a `GfStreamOptions`.
#[no_mangle]
pub unsafe extern "C" fn gf_stream_options_init(
    options: *mut GfStreamOptions,
    dataset: *const c_char,
    batch_size: u32,
) -> GfStatus {
    if options.is_null() {
        return invalid("options is null");
    }
    let defaults = GfStreamOptions {
        struct_size: std::mem::size_of::<GfStreamOptions>() as u32,
        dataset,
        batch_size,
        fields: std::ptr::null(),
        field_count: 0,
        device: -1,
        shuffle: GfShuffle::None as u32,
        window_shards: 4,
        seed: 0,
        epoch: 0,
        rank: 0,
        world_size: 1,
        tail: GfTail::Drop as u32,
        start_step: 0,
        resume: std::ptr::null(),
        on_corrupt: GfCorruptPolicy::Fail as u32,
        prefetch: gpufeed_client::PREFETCH_DEFAULT,
        variable: std::ptr::null(),
        variable_count: 0,
    };
    // SAFETY: non-null and writable by the caller's contract.
    unsafe { options.write(defaults) };
    GfStatus::Ok
}

/// Connects to the daemon at `socket` and greets it; `*client` receives the connection.
///
/// # Safety
/// `socket` is a NUL-terminated string; `client` is writable.
#[no_mangle]
pub unsafe extern "C" fn gf_connect(socket: *const c_char, client: *mut *mut GfClient) -> GfStatus {
    guarded(|| {
        if client.is_null() {
            return invalid("client is null");
        }
        // SAFETY: the caller's contract.
        let socket = match unsafe { string_arg(socket, "socket") } {
            Ok(socket) => socket,
            Err(status) => return status,
        };
        match gpufeed_client::Client::connect(socket) {
            Ok(connected) => {
                // SAFETY: checked non-null; writable by the caller's contract.
                unsafe { client.write(Box::into_raw(Box::new(GfClient { client: connected }))) };
                GfStatus::Ok
            }
            Err(error) => client_error(error),
        }
    })
}

/// Closes a connection that opened no stream. Null is ignored.
///
/// # Safety
/// `client` is null or came from `gf_connect` and was not consumed or closed.
#[no_mangle]
pub unsafe extern "C" fn gf_client_close(client: *mut GfClient) {
    if !client.is_null() {
        // SAFETY: the caller's contract: a live handle from gf_connect, freed once.
        drop(unsafe { Box::from_raw(client) });
    }
}

/// A mixture as a resume state names it in `GfStreamState::dataset`.
fn mixture_label(sources: &[MixtureSource], epoch_samples: Option<u64>) -> String {
    let mut label = format!("mixture of {}", gpufeed_client::spec::mixture_name(sources));
    if let Some(samples) = epoch_samples {
        label += &format!(", epoch of {samples} samples");
    }
    let mut end = label.len().min(STRING_BYTES_MAX);
    while !label.is_char_boundary(end) {
        end -= 1;
    }
    label.truncate(end);
    label
}

/// A mixture's sources and epoch length, as [`gf_open_mixture_stream`] takes them.
type Mixture = (Vec<MixtureSource>, Option<u64>);

/// Builds the spec of `options`, a mixture of `mixture` when given (then `options.dataset` is
/// null).
///
/// # Safety
/// As for `gf_open_stream`.
unsafe fn spec_of(
    options: &GfStreamOptions,
    mixture: Option<Mixture>,
) -> Result<StreamSpec, GfStatus> {
    let struct_size = options.struct_size as usize;
    if struct_size < STREAM_OPTIONS_V1_BYTES {
        return Err(invalid(format!(
            "options.struct_size is {}, not {}: initialise with gf_stream_options_init",
            options.struct_size,
            std::mem::size_of::<GfStreamOptions>()
        )));
    }
    let mut spec =
        match mixture {
            None => {
                // SAFETY: the caller's contract.
                let dataset = unsafe { string_arg(options.dataset, "options.dataset") }?;
                StreamSpec::new(dataset, options.batch_size)
            }
            Some(_) if !options.dataset.is_null() => return Err(invalid(
                "options.dataset is set for a mixture: its sources name its datasets (pass null)",
            )),
            Some((sources, epoch_samples)) => {
                let mut spec = StreamSpec::mixture(sources, options.batch_size);
                spec.mixture_epoch_samples = epoch_samples;
                spec
            }
        };
    if options.field_count > 0 {
        if options.fields.is_null() {
            return Err(invalid("options.fields is null with a field_count above 0"));
        }
        // SAFETY: `field_count` entries by the caller's contract.
        let fields = unsafe { std::slice::from_raw_parts(options.fields, options.field_count) };
        for (index, field) in fields.iter().enumerate() {
            // SAFETY: the caller's contract.
            let name = unsafe { string_arg(field.name, &format!("options.fields[{index}].name")) }?;
            spec.fields.push(FieldRequest {
                name: name.to_string(),
                dtype: dtype_of(field.dtype)?,
            });
        }
    }
    spec.device = match options.device {
        -1 => Device::Cpu,
        ordinal if ordinal >= 0 => Device::Cuda(ordinal as u32),
        other => {
            return Err(invalid(format!(
                "options.device {other} is not -1 or an ordinal"
            )))
        }
    };
    spec.shuffle = shuffle_of(options.shuffle, options.window_shards)?;
    spec.seed = options.seed;
    spec.epoch = options.epoch;
    spec.rank = options.rank;
    spec.world_size = options.world_size;
    spec.tail = match options.tail {
        v if v == GfTail::Drop as u32 => Tail::Drop,
        v if v == GfTail::Pad as u32 => Tail::Pad,
        other => return Err(invalid(format!("options.tail {other} is not a GfTail"))),
    };
    spec.on_corrupt = match options.on_corrupt {
        v if v == GfCorruptPolicy::Fail as u32 => CorruptPolicy::Fail,
        v if v == GfCorruptPolicy::Replace as u32 => CorruptPolicy::Replace,
        other => {
            return Err(invalid(format!(
                "options.on_corrupt {other} is not a GfCorruptPolicy"
            )))
        }
    };
    spec.prefetch = options.prefetch;
    if struct_size >= std::mem::size_of::<GfStreamOptions>() && options.variable_count > 0 {
        if options.variable.is_null() {
            return Err(invalid(
                "options.variable is null with a variable_count above 0",
            ));
        }
        // SAFETY: `variable_count` entries by the caller's contract.
        let requests =
            unsafe { std::slice::from_raw_parts(options.variable, options.variable_count) };
        for (index, request) in requests.iter().enumerate() {
            // SAFETY: the caller's contract.
            let name =
                unsafe { string_arg(request.name, &format!("options.variable[{index}].name")) }?;
            let form = match request.form {
                v if v == GfBatchForm::Padded as u32 => BatchForm::Padded,
                v if v == GfBatchForm::Packed as u32 => BatchForm::Packed,
                other => {
                    return Err(invalid(format!(
                        "options.variable[{index}].form {other} is not a GfBatchForm"
                    )))
                }
            };
            spec.variable.push(VariableRequest {
                name: name.to_string(),
                form,
                cap: (request.cap > 0).then_some(request.cap),
            });
        }
    }
    if options.resume.is_null() {
        spec.start_at_step(options.start_step);
    } else {
        // SAFETY: non-null, a GfStreamState by the caller's contract.
        let state = unsafe { &*options.resume };
        let bytes: Vec<u8> = state
            .dataset
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let dataset =
            String::from_utf8(bytes).map_err(|_| invalid("options.resume.dataset is not UTF-8"))?;
        // A mixture's state names it by its sources and weights (see GfStreamState::dataset).
        let (dataset, sources) = if spec.sources.is_empty() {
            (dataset, Vec::new())
        } else {
            let label = mixture_label(&spec.sources, spec.mixture_epoch_samples);
            if dataset != label {
                return Err(invalid(format!(
                    "options.resume: the state is of {dataset}, this stream a {label}: a \
                     checkpoint continues the stream it was taken from"
                )));
            }
            (String::new(), spec.sources.clone())
        };
        spec.resume(&StreamState {
            dataset,
            sources,
            mixture_epoch_samples: spec.mixture_epoch_samples,
            seed: state.seed,
            epoch: state.epoch,
            shuffle: shuffle_of(state.shuffle, state.window_shards)?,
            world_size: state.world_size,
            batch_size: state.batch_size,
            cursor: state.cursor,
        })
        .map_err(|e| invalid(format!("options.resume: {e}")))?;
    }
    spec.validate().map_err(|e| invalid(e.to_string()))?;
    Ok(spec)
}

/// Opens a stream on `client`, which it consumes whatever the outcome (one connection carries one
/// stream); `*stream` receives it.
///
/// # Safety
/// `client` came from `gf_connect` and was not consumed or closed; `options` points to options
/// initialised by `gf_stream_options_init` whose strings and arrays stay valid during the call;
/// `stream` is writable.
#[no_mangle]
pub unsafe extern "C" fn gf_open_stream(
    client: *mut GfClient,
    options: *const GfStreamOptions,
    stream: *mut *mut GfStream,
) -> GfStatus {
    guarded(|| {
        if client.is_null() {
            return invalid("client is null");
        }
        // SAFETY: a live handle from gf_connect, consumed here once.
        let client = unsafe { Box::from_raw(client) };
        if options.is_null() || stream.is_null() {
            return invalid("options or stream is null");
        }
        // SAFETY: non-null, initialised by the caller's contract.
        let spec = match unsafe { spec_of(&*options, None) } {
            Ok(spec) => spec,
            Err(status) => return status,
        };
        // SAFETY: writable by the caller's contract.
        unsafe { open_spec(*client, spec, stream) }
    })
}

/// Opens `spec` on `client`; `*stream` receives the stream.
///
/// # Safety
/// `stream` is non-null and writable.
unsafe fn open_spec(client: GfClient, spec: StreamSpec, stream: *mut *mut GfStream) -> GfStatus {
    match client.client.open_stream(spec) {
        Ok(opened) => {
            // SAFETY: non-null and writable by the caller's contract.
            unsafe { stream.write(Box::into_raw(Box::new(GfStream { stream: opened }))) };
            GfStatus::Ok
        }
        Err(error) => client_error(error),
    }
}

/// Opens a mixture stream on `client` (consumed whatever the outcome): `source_count` datasets of
/// `sources` drawn with their weights, `epoch_samples` positions an epoch (0: the sum of the
/// sources' samples), every other setting from `options`, whose `dataset` must be null. Every
/// source must have the requested fields in the same type and shape (else
/// `GF_STATUS_DAEMON_ERROR` naming the source and the field); on a CUDA device the batches are
/// assembled on the host and uploaded; fixed-shape
/// fields only (a variable-length field, or `options.variable`, is refused by the daemon naming
/// the source and the field). A resume state
/// must be of the same mixture. `*stream` receives the stream (`docs/C_API.md`).
///
/// # Safety
/// As for `gf_open_stream`; `sources` points to `source_count` entries whose names stay valid
/// during the call.
#[no_mangle]
pub unsafe extern "C" fn gf_open_mixture_stream(
    client: *mut GfClient,
    options: *const GfStreamOptions,
    sources: *const GfMixtureSource,
    source_count: usize,
    epoch_samples: u64,
    stream: *mut *mut GfStream,
) -> GfStatus {
    guarded(|| {
        if client.is_null() {
            return invalid("client is null");
        }
        // SAFETY: a live handle from gf_connect, consumed here once.
        let client = unsafe { Box::from_raw(client) };
        if options.is_null() || stream.is_null() || sources.is_null() {
            return invalid("options, sources or stream is null");
        }
        // SAFETY: `source_count` entries by the caller's contract.
        let entries = unsafe { std::slice::from_raw_parts(sources, source_count) };
        let mut mixture = Vec::with_capacity(entries.len());
        for (index, source) in entries.iter().enumerate() {
            // SAFETY: the caller's contract.
            let name =
                match unsafe { string_arg(source.dataset, &format!("sources[{index}].dataset")) } {
                    Ok(name) => name,
                    Err(status) => return status,
                };
            mixture.push(MixtureSource {
                dataset: name.to_string(),
                weight: source.weight,
            });
        }
        let epoch_samples = Some(epoch_samples).filter(|&samples| samples > 0);
        // SAFETY: non-null, initialised by the caller's contract.
        let spec = match unsafe { spec_of(&*options, Some((mixture, epoch_samples))) } {
            Ok(spec) => spec,
            Err(status) => return status,
        };
        // SAFETY: writable by the caller's contract.
        unsafe { open_spec(*client, spec, stream) }
    })
}

/// Waits for the next batch; `*batch` receives it, or null with `GF_STATUS_END_OF_EPOCH`.
///
/// # Safety
/// `stream` came from `gf_open_stream` and is not closed, and no other thread uses it during the
/// call; `batch` is writable.
#[no_mangle]
pub unsafe extern "C" fn gf_next(stream: *mut GfStream, batch: *mut *mut GfBatch) -> GfStatus {
    guarded(|| {
        if stream.is_null() || batch.is_null() {
            return invalid("stream or batch is null");
        }
        // SAFETY: checked non-null; writable by the caller's contract.
        unsafe { batch.write(std::ptr::null_mut()) };
        // SAFETY: a live handle used by this thread only, by the caller's contract.
        let stream = unsafe { &mut (*stream).stream };
        match stream.next() {
            None => GfStatus::EndOfEpoch,
            Some(Err(error)) => client_error(error),
            Some(Ok(next)) => {
                let names = next
                    .fields()
                    .map(|f| CString::new(f.name).unwrap_or_default())
                    .collect();
                let boxed = Box::new(GfBatch { batch: next, names });
                // SAFETY: checked non-null above.
                unsafe { batch.write(Box::into_raw(boxed)) };
                GfStatus::Ok
            }
        }
    })
}

/// Describes `batch` into `*info`.
///
/// # Safety
/// `batch` is a live batch; `info` is writable.
#[no_mangle]
pub unsafe extern "C" fn gf_batch_info(batch: *const GfBatch, info: *mut GfBatchInfo) -> GfStatus {
    if batch.is_null() || info.is_null() {
        return invalid("batch or info is null");
    }
    // SAFETY: a live batch by the caller's contract.
    let batch = unsafe { &*batch };
    let described = GfBatchInfo {
        epoch: batch.batch.epoch(),
        step: batch.batch.step(),
        samples: batch.batch.samples(),
        replaced: batch.batch.replaced(),
        cursor_after: batch.batch.cursor_after(),
        field_count: batch.names.len() as u32,
    };
    // SAFETY: writable by the caller's contract.
    unsafe { info.write(described) };
    GfStatus::Ok
}

/// Describes field `index` (in slot order) of `batch` into `*field`.
///
/// # Safety
/// `batch` is a live batch; `field` is writable.
#[no_mangle]
pub unsafe extern "C" fn gf_batch_field(
    batch: *const GfBatch,
    index: u32,
    field: *mut GfField,
) -> GfStatus {
    if batch.is_null() || field.is_null() {
        return invalid("batch or field is null");
    }
    // SAFETY: a live batch by the caller's contract.
    let batch = unsafe { &*batch };
    let Some(view) = batch.batch.fields().nth(index as usize) else {
        return invalid(format!(
            "field index {index} is not below the batch's {} fields",
            batch.names.len()
        ));
    };
    let mut shape = [0u64; GF_NDIM_MAX];
    let ndim = view.shape.len().min(GF_NDIM_MAX);
    shape[..ndim].copy_from_slice(&view.shape[..ndim]);
    let (host, device_ptr) = match view.data {
        FieldData::Host(bytes) => (bytes.as_ptr() as *const c_void, 0),
        FieldData::Device { ptr, .. } => (std::ptr::null(), ptr),
    };
    let described = GfField {
        name: batch.names[index as usize].as_ptr(),
        dtype: gf_dtype(view.dtype),
        ndim: ndim as u32,
        shape,
        host,
        device_ptr,
        bytes: view.byte_len() as u64,
    };
    // SAFETY: writable by the caller's contract.
    unsafe { field.write(described) };
    GfStatus::Ok
}

/// Releases `batch` (its slot goes back to the daemon once the work queued on the stream's CUDA
/// stream is done). Its pointers are invalid afterwards. Null is ignored; a batch may be released
/// after its stream was closed.
///
/// # Safety
/// `batch` is null or a live batch, released once.
#[no_mangle]
pub unsafe extern "C" fn gf_batch_release(batch: *mut GfBatch) {
    if !batch.is_null() {
        // SAFETY: a live batch from gf_next, freed once, by the caller's contract.
        drop(unsafe { Box::from_raw(batch) });
    }
}

/// Makes `cuda_stream` (a `CUstream` of the device's primary context; null is the legacy default
/// stream) the stream device batches are delivered on: each batch is ready for work queued on it,
/// and released after the work queued on it before `gf_batch_release`.
///
/// # Safety
/// `stream` is a live stream handle; `cuda_stream` outlives the stream's batches.
#[no_mangle]
pub unsafe extern "C" fn gf_stream_set_cuda_stream(
    stream: *mut GfStream,
    cuda_stream: *mut c_void,
) -> GfStatus {
    if stream.is_null() {
        return invalid("stream is null");
    }
    // SAFETY: a live handle; the CUDA stream is the caller's to vouch for.
    unsafe { (*stream).stream.set_cuda_stream(cuda_stream) };
    GfStatus::Ok
}

/// Where the epoch stands, into `*state`: give it as `GfStreamOptions::resume` to continue, at any
/// world size, once every rank consumed the steps before it.
///
/// # Safety
/// `stream` is a live stream handle; `state` is writable.
#[no_mangle]
pub unsafe extern "C" fn gf_stream_state(
    stream: *const GfStream,
    state: *mut GfStreamState,
) -> GfStatus {
    if stream.is_null() || state.is_null() {
        return invalid("stream or state is null");
    }
    // SAFETY: a live handle by the caller's contract.
    let current = unsafe { &*stream }.stream.state();
    let name = if current.sources.is_empty() {
        current.dataset.clone()
    } else {
        mixture_label(&current.sources, current.mixture_epoch_samples)
    };
    let mut dataset = [0 as c_char; GF_NAME_BYTES];
    for (to, &from) in dataset.iter_mut().zip(name.as_bytes()) {
        *to = from as c_char;
    }
    let (shuffle, window_shards) = match current.shuffle {
        Shuffle::None => (GfShuffle::None as u32, 0),
        Shuffle::Window(shards) => (GfShuffle::Window as u32, shards),
        Shuffle::Full => (GfShuffle::Full as u32, 0),
    };
    let described = GfStreamState {
        dataset,
        seed: current.seed,
        epoch: current.epoch,
        shuffle,
        window_shards,
        world_size: current.world_size,
        batch_size: current.batch_size,
        cursor: current.cursor,
    };
    // SAFETY: writable by the caller's contract.
    unsafe { state.write(described) };
    GfStatus::Ok
}

/// Closes the stream. Batches still held stay valid until released; the session ends when the last
/// is released. Null is ignored.
///
/// # Safety
/// `stream` is null or a live stream handle, closed once.
#[no_mangle]
pub unsafe extern "C" fn gf_stream_close(stream: *mut GfStream) {
    if !stream.is_null() {
        // SAFETY: a live handle freed once by the caller's contract.
        drop(unsafe { Box::from_raw(stream) });
    }
}
