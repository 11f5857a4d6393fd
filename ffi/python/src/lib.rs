//! `gpufeed._gpufeed`: the native half of the `gpufeed` Python package, over the Rust client crate.
//!
//! A [`Batch`] shares one lease on its slot (an `Arc` of the client's batch) with every array
//! exported from it through DLPack; the slot is released when the last of them goes, or at once by
//! `Batch.release()`. Device batches are made ready for the stream a DLPack consumer names (a
//! device-side wait on the batch's ready event, no host synchronisation), and released after the
//! work queued on that stream.

use std::ffi::{c_void, CStr};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use gpufeed_client::protocol::{
    BatchForm, CorruptPolicy, Device, FieldRequest, MixtureSource, Shuffle, StreamSpec, Tail,
    VariableRequest,
};
use gpufeed_client::spec::{resume_mismatch, ShuffleName};
use gpufeed_client::{ClientError, DType, FieldData, StreamState};
use pyo3::exceptions::{PyBufferError, PyDeprecationWarning, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyIterator, PyList, PyMapping, PyTuple};

/// DLPack device types.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: host slots are mapped read-only.
const DLPACK_FLAG_READ_ONLY: u64 = 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack 0.x's `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.x's `DLManagedTensorVersioned`.
#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// What an exported tensor keeps alive: the batch's lease and the shape the tensor points at.
struct Exported {
    _lease: Arc<Lease>,
    _shape: Box<[i64]>,
}

/// A batch's lease on its slot, shared by the Python batch and every array exported from it.
struct Lease {
    batch: Mutex<Option<gpufeed_client::Batch>>,
}

impl Lease {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<gpufeed_client::Batch>> {
        self.batch.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The DLPack code and bits of a gpufeed element type.
fn dl_dtype(dtype: DType) -> DlDataType {
    let (code, bits) = match dtype {
        DType::U8 => (1, 8),
        DType::U16 => (1, 16),
        DType::U32 => (1, 32),
        DType::U64 => (1, 64),
        DType::I8 => (0, 8),
        DType::I16 => (0, 16),
        DType::I32 => (0, 32),
        DType::I64 => (0, 64),
        DType::F16 => (2, 16),
        DType::F32 => (2, 32),
        DType::F64 => (2, 64),
        DType::BF16 => (4, 16),
    };
    DlDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// The NumPy type string of a gpufeed element type (`None` for bf16, which NumPy lacks).
fn typestr(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::BF16 => return None,
    })
}

/// Raises `gpufeed.errors.<class>(message, code)`.
fn raise(py: Python<'_>, class: &str, message: String, code: Option<String>) -> PyErr {
    let made = py
        .import("gpufeed.errors")
        .and_then(|errors| errors.getattr(class))
        .and_then(|class| class.call1((message.clone(), code)));
    match made {
        Ok(error) => PyErr::from_value(error),
        Err(error) => error,
    }
}

/// The Python exception for a client error.
fn to_py(py: Python<'_>, error: ClientError) -> PyErr {
    let message = error.to_string();
    match error {
        ClientError::Connect { .. } => raise(py, "ConnectError", message, None),
        ClientError::Daemon { code, .. } => {
            raise(py, "DaemonError", message, Some(format!("{code:?}")))
        }
        ClientError::VersionMismatch { .. } => raise(
            py,
            "DaemonError",
            message,
            Some("UnsupportedVersion".to_string()),
        ),
        ClientError::InvalidSpec(_) => raise(py, "InvalidSpecError", message, None),
        ClientError::AllSlotsHeld { .. } => raise(py, "AllSlotsHeldError", message, None),
        ClientError::Protocol(_) => raise(py, "ProtocolError", message, None),
        ClientError::Cuda(_) => raise(py, "CudaError", message, None),
        ClientError::Transport(_) | ClientError::Ended(_) | ClientError::Io(_) => {
            raise(py, "SessionError", message, None)
        }
    }
}

/// The socket path when `Client()` is given none: `GPUFEED_SOCKET`, else the daemon's own default
/// for `GPUFEED_DATA_ROOT` (`DATA_ROOT/gpufeed.sock`), else [`SOCKET_DEFAULT`]; with where it came
/// from, for the error when nothing listens there.
fn default_socket() -> (String, String) {
    let set = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    if let Some(socket) = set("GPUFEED_SOCKET") {
        return (socket, "from GPUFEED_SOCKET".to_string());
    }
    if let Some(root) = set("GPUFEED_DATA_ROOT") {
        let socket = std::path::Path::new(&root).join("gpufeed.sock");
        return (
            socket.to_string_lossy().into_owned(),
            "from GPUFEED_DATA_ROOT; GPUFEED_SOCKET is unset".to_string(),
        );
    }
    (
        SOCKET_DEFAULT.to_string(),
        "the default; GPUFEED_SOCKET and GPUFEED_DATA_ROOT are unset".to_string(),
    )
}

/// The socket path used when neither the caller nor the environment names one.
const SOCKET_DEFAULT: &str = "/run/gpufeed.sock";

/// A stream's client half, shared by the Python `Stream` and the `Client` that opened it (weakly),
/// so that `Client.close()` can end it.
type StreamCell = Mutex<Option<gpufeed_client::Stream>>;

/// What `Client.close()` ends.
struct ClientState {
    /// The connection made by the constructor, used by the first stream.
    first: Option<gpufeed_client::Client>,
    /// The streams opened, to close with the client. Entries of streams already gone are dropped at
    /// each open, so the list is bounded by the streams alive at once (which the daemon bounds by its
    /// session limit).
    streams: Vec<Weak<StreamCell>>,
    closed: bool,
}

/// A connection to the daemon. Each stream it opens is a session of its own.
#[pyclass(module = "gpufeed._gpufeed")]
struct Client {
    socket: String,
    state: Mutex<ClientState>,
}

impl Client {
    fn lock(&self) -> std::sync::MutexGuard<'_, ClientState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `world_size`, or its deprecated alias `world` (with a `DeprecationWarning`), else 1.
fn resolve_world_size(
    py: Python<'_>,
    world_size: Option<u32>,
    world: Option<u32>,
) -> PyResult<u32> {
    let Some(world) = world else {
        return Ok(world_size.unwrap_or(1));
    };
    if world_size.is_some() {
        return Err(PyValueError::new_err(
            "give world_size only: world is its deprecated alias, and both were given",
        ));
    }
    PyErr::warn(
        py,
        &py.get_type::<PyDeprecationWarning>(),
        c"open_stream(world=...) is deprecated and will be removed in the next release: use world_size=",
        1,
    )?;
    Ok(world)
}

#[pymethods]
impl Client {
    /// Connects to the daemon at `socket`, or where `GPUFEED_SOCKET` says when it is None (then
    /// `$GPUFEED_DATA_ROOT/gpufeed.sock`, then `/run/gpufeed.sock`).
    #[new]
    #[pyo3(signature = (socket=None))]
    fn new(py: Python<'_>, socket: Option<String>) -> PyResult<Client> {
        let (socket, origin) = match socket {
            Some(socket) => (socket, None),
            None => {
                let (socket, origin) = default_socket();
                (socket, Some(origin))
            }
        };
        let client = py
            .allow_threads(|| gpufeed_client::Client::connect(&socket))
            .map_err(|error| match (&error, origin) {
                (ClientError::Connect { .. }, Some(origin)) => raise(
                    py,
                    "ConnectError",
                    format!("{error} (no socket was given: {socket:?} is {origin})"),
                    None,
                ),
                _ => to_py(py, error),
            })?;
        Ok(Client {
            socket,
            state: Mutex::new(ClientState {
                first: Some(client),
                streams: Vec::new(),
                closed: false,
            }),
        })
    }

    /// The socket path.
    #[getter]
    fn socket(&self) -> &str {
        &self.socket
    }

    /// True once `close()` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().closed
    }

    /// Opens a stream (a session of its own) of `dataset`, or of a mixture of `sources`
    /// (`[(dataset, weight), ...]`), in batches of `batch_size` samples.
    #[pyo3(signature = (
        dataset=None, batch_size=None, *, sources=None, mixture_epoch_samples=None, fields=None,
        device="cpu", shuffle=None, window_shards=4, seed=None, epoch=None, rank=0,
        world_size=None, tail="drop", start_step=None, state=None, on_corrupt="fail", prefetch=4,
        world=None, variable=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn open_stream(
        &self,
        py: Python<'_>,
        dataset: Option<String>,
        batch_size: Option<u32>,
        sources: Option<Bound<'_, PyAny>>,
        mixture_epoch_samples: Option<u64>,
        fields: Option<Bound<'_, PyAny>>,
        device: &str,
        shuffle: Option<&str>,
        window_shards: u32,
        seed: Option<u64>,
        epoch: Option<u64>,
        rank: u32,
        world_size: Option<u32>,
        tail: &str,
        start_step: Option<u64>,
        state: Option<Bound<'_, PyDict>>,
        on_corrupt: &str,
        prefetch: u32,
        world: Option<u32>,
        variable: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Stream> {
        let Some(batch_size) = batch_size else {
            return Err(PyValueError::new_err("batch_size is required"));
        };
        let mut spec = match (dataset, sources) {
            (Some(dataset), None) => StreamSpec::new(dataset, batch_size),
            (None, Some(sources)) => {
                StreamSpec::mixture(mixture_sources(&sources, "sources")?, batch_size)
            }
            (Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "give a dataset or a mixture's sources, not both",
                ))
            }
            (None, None) => {
                return Err(PyValueError::new_err(
                    "give a dataset, or sources=[(dataset, weight), ...] for a mixture",
                ))
            }
        };
        spec.mixture_epoch_samples = mixture_epoch_samples;
        spec.fields = field_requests(py, fields)?;
        spec.variable = variable_requests(variable)?;
        spec.device = parse_device(device)?;
        // Unset (None): dataset order, seed 0, epoch 0, or the resume state's values.
        if let Some(shuffle) = shuffle {
            spec.shuffle = parse_shuffle(shuffle, window_shards)?;
        }
        spec.seed = seed.unwrap_or(spec.seed);
        spec.epoch = epoch.unwrap_or(spec.epoch);
        spec.rank = rank;
        spec.world_size = resolve_world_size(py, world_size, world)?;
        spec.tail = match tail {
            "drop" => Tail::Drop,
            "pad" => Tail::Pad,
            other => {
                return Err(PyValueError::new_err(format!(
                    "tail {other:?} is not drop or pad"
                )))
            }
        };
        spec.on_corrupt = match on_corrupt {
            "fail" => CorruptPolicy::Fail,
            "replace" => CorruptPolicy::Replace,
            other => {
                return Err(PyValueError::new_err(format!(
                    "on_corrupt {other:?} is not fail or replace"
                )))
            }
        };
        spec.prefetch = prefetch;
        if let Some(state) = state {
            if start_step.is_some() {
                return Err(PyValueError::new_err("give start_step or state, not both"));
            }
            let state = parse_state(&state)?;
            spec.resume(&state)
                .map_err(|e| PyValueError::new_err(format!("state: {e}")))?;
            // What was passed must be the state's even when it is the value an unset argument
            // takes (`shuffle="none"`, `seed=0`, `epoch=0`), which `resume` cannot tell from unset.
            let given = shuffle
                .map(|name| parse_shuffle(name, window_shards))
                .transpose()?;
            let mismatch = if let Some(given) = given.filter(|&given| given != state.shuffle) {
                Some(resume_mismatch(
                    "shuffle",
                    &ShuffleName(given),
                    &ShuffleName(state.shuffle),
                ))
            } else if let Some(seed) = seed.filter(|&seed| seed != state.seed) {
                Some(resume_mismatch("seed", &seed, &state.seed))
            } else {
                epoch
                    .filter(|&epoch| epoch != state.epoch)
                    .map(|epoch| resume_mismatch("epoch", &epoch, &state.epoch))
            };
            if let Some(error) = mismatch {
                return Err(PyValueError::new_err(format!("state: {error}")));
            }
        } else if let Some(step) = start_step {
            spec.start_at_step(step);
        }
        let first = {
            let mut state = self.lock();
            if state.closed {
                return Err(PyValueError::new_err("the client is closed"));
            }
            state.first.take()
        };
        let socket = self.socket.clone();
        let stream = py
            .allow_threads(move || {
                let client = match first {
                    Some(client) => client,
                    None => gpufeed_client::Client::connect(&socket)?,
                };
                client.open_stream(spec)
            })
            .map_err(|e| to_py(py, e))?;
        let cell = Arc::new(Mutex::new(Some(stream)));
        let mut state = self.lock();
        if state.closed {
            // Closed by another thread while this stream opened (without the GIL): the stream goes
            // with the client.
            return Err(PyValueError::new_err(
                "the client was closed while the stream opened",
            ));
        }
        state.streams.retain(|stream| stream.strong_count() > 0);
        state.streams.push(Arc::downgrade(&cell));
        Ok(Stream { inner: cell })
    }

    /// Closes the client and every stream it opened that is still open (batches still held stay
    /// valid until released). Idempotent.
    fn close(&self, py: Python<'_>) {
        let (first, streams) = {
            let mut state = self.lock();
            state.closed = true;
            (state.first.take(), std::mem::take(&mut state.streams))
        };
        drop(first);
        // Without the GIL: a thread waiting in `__next__` holds its stream's lock until its batch
        // comes, and needs the GIL to return.
        py.allow_threads(|| {
            for stream in streams.iter().filter_map(Weak::upgrade) {
                stream.lock().unwrap_or_else(PoisonError::into_inner).take();
            }
        });
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Closes the client (and its streams) on leaving a `with` block.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
        self.close(py);
    }
}

/// The batch forms of variable-length fields: `None`, or a mapping of field name to `"padded"`,
/// `"packed"`, or a `(form, cap)` pair (`cap` the most elements a sample keeps, or `None`).
fn variable_requests(variable: Option<Bound<'_, PyAny>>) -> PyResult<Vec<VariableRequest>> {
    let Some(variable) = variable else {
        return Ok(Vec::new());
    };
    let mapping = variable.downcast::<PyMapping>().map_err(|_| {
        PyValueError::new_err(
            "variable must map field names to \"padded\", \"packed\" or (form, cap)",
        )
    })?;
    let mut out = Vec::new();
    for item in mapping.items()?.iter() {
        let (name, value): (String, Bound<'_, PyAny>) = item.extract()?;
        let (form, cap): (String, Option<u32>) = match value.extract::<String>() {
            Ok(form) => (form, None),
            Err(_) => value.extract().map_err(|_| {
                PyValueError::new_err(format!(
                    "variable[{name:?}] is not \"padded\", \"packed\" or a (form, cap) pair"
                ))
            })?,
        };
        let form = match form.as_str() {
            "padded" => BatchForm::Padded,
            "packed" => BatchForm::Packed,
            other => {
                return Err(PyValueError::new_err(format!(
                    "variable[{name:?}]: form {other:?} is not padded or packed"
                )))
            }
        };
        if cap == Some(0) {
            return Err(PyValueError::new_err(format!(
                "variable[{name:?}]: a cap of 0 elements would serve nothing"
            )));
        }
        out.push(VariableRequest { name, form, cap });
    }
    Ok(out)
}

/// The requested fields: `None` (every field, stored dtype), a list of names, or a dict of name to
/// dtype name (or `None`).
fn field_requests(py: Python<'_>, fields: Option<Bound<'_, PyAny>>) -> PyResult<Vec<FieldRequest>> {
    let Some(fields) = fields else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    if let Ok(mapping) = fields.downcast::<PyMapping>() {
        // The dtype may be a gpufeed name ("f32"), a NumPy or PyTorch name ("float32"), or a NumPy or
        // PyTorch type (np.float32, torch.float32): gpufeed._dtypes maps each to gpufeed's name.
        let dtype_name = py.import("gpufeed._dtypes")?.getattr("dtype_name")?;
        for item in mapping.items()?.iter() {
            let (name, dtype): (String, Bound<'_, PyAny>) = item.extract()?;
            let dtype: Option<String> = dtype_name
                .call1((dtype, format!("fields[{name:?}]")))?
                .extract()?;
            out.push(FieldRequest {
                name,
                dtype: dtype.map(|d| parse_dtype(&d)).transpose()?,
            });
        }
    } else {
        for name in fields.try_iter()? {
            out.push(FieldRequest {
                name: name?.extract()?,
                dtype: None,
            });
        }
    }
    Ok(out)
}

fn parse_dtype(name: &str) -> PyResult<DType> {
    name.parse()
        .map_err(|e: gpufeed_client::DTypeError| PyValueError::new_err(e.to_string()))
}

fn parse_device(device: &str) -> PyResult<Device> {
    if device == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match device {
        "cuda" => Some(0),
        other => other.strip_prefix("cuda:").and_then(|n| n.parse().ok()),
    };
    ordinal.map(Device::Cuda).ok_or_else(|| {
        PyValueError::new_err(format!("device {device:?} is not cpu, cuda or cuda:N"))
    })
}

fn parse_shuffle(shuffle: &str, window_shards: u32) -> PyResult<Shuffle> {
    match shuffle {
        "none" => Ok(Shuffle::None),
        "window" => Ok(Shuffle::Window(window_shards)),
        "full" => Ok(Shuffle::Full),
        other => Err(PyValueError::new_err(format!(
            "shuffle {other:?} is not none, window or full"
        ))),
    }
}

fn shuffle_names(shuffle: Shuffle) -> (&'static str, u32) {
    match shuffle {
        Shuffle::None => ("none", 0),
        Shuffle::Window(shards) => ("window", shards),
        Shuffle::Full => ("full", 0),
    }
}

/// A mixture's sources from any iterable of (dataset, weight) pairs, tuples or lists alike (a
/// checkpoint that went through JSON holds lists); `what` names the argument in errors.
fn mixture_sources(value: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<MixtureSource>> {
    let mut sources = Vec::new();
    for (index, item) in value.try_iter()?.enumerate() {
        let item = item?;
        let pair = || {
            PyValueError::new_err(format!(
                "{what}[{index}] is not a (dataset, weight) pair: {item}"
            ))
        };
        if item.len().map_err(|_| pair())? != 2 || item.is_instance_of::<pyo3::types::PyString>() {
            return Err(pair());
        }
        sources.push(MixtureSource {
            dataset: item.get_item(0)?.extract().map_err(|_| pair())?,
            weight: item.get_item(1)?.extract().map_err(|_| pair())?,
        });
    }
    Ok(sources)
}

/// Version of the `state_dict` layout.
const STATE_VERSION: u32 = 1;

fn parse_state(state: &Bound<'_, PyDict>) -> PyResult<StreamState> {
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        state
            .get_item(key)?
            .ok_or_else(|| PyValueError::new_err(format!("state_dict has no {key:?}")))
    };
    let version: u32 = get("version")?.extract()?;
    if version != STATE_VERSION {
        return Err(PyValueError::new_err(format!(
            "state_dict version {version} is not {STATE_VERSION}"
        )));
    }
    let shuffle: String = get("shuffle")?.extract()?;
    // A mixture's keys; a state of a single dataset may lack them (taken before mixtures).
    let sources = match state.get_item("sources")? {
        Some(sources) => mixture_sources(&sources, "state_dict[\"sources\"]")?,
        None => Vec::new(),
    };
    let mixture_epoch_samples: Option<u64> = match state.get_item("mixture_epoch_samples")? {
        Some(samples) => samples.extract()?,
        None => None,
    };
    Ok(StreamState {
        dataset: get("dataset")?.extract()?,
        sources,
        mixture_epoch_samples,
        seed: get("seed")?.extract()?,
        epoch: get("epoch")?.extract()?,
        shuffle: parse_shuffle(&shuffle, get("window_shards")?.extract()?)?,
        world_size: get("world_size")?.extract()?,
        batch_size: get("batch_size")?.extract()?,
        cursor: get("cursor")?.extract()?,
    })
}

/// An open stream: iterates over the epoch's batches for this rank.
#[pyclass(module = "gpufeed._gpufeed")]
struct Stream {
    inner: Arc<StreamCell>,
}

impl Stream {
    fn with<T>(&self, f: impl FnOnce(&mut gpufeed_client::Stream) -> PyResult<T>) -> PyResult<T> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match inner.as_mut() {
            Some(stream) => f(stream),
            None => Err(PyValueError::new_err("the stream is closed")),
        }
    }
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Batch> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(stream) = inner.as_mut() else {
            return Err(PyStopIteration::new_err(()));
        };
        let next = py.allow_threads(|| stream.next());
        match next {
            None => Err(PyStopIteration::new_err(())),
            Some(Err(error)) => Err(to_py(py, error)),
            Some(Ok(batch)) => {
                let device = match stream.layout().device {
                    Device::Cpu => None,
                    Device::Cuda(ordinal) => Some(ordinal),
                };
                Ok(Batch::new(batch, device))
            }
        }
    }

    /// Where the epoch stands, for a checkpoint: a dict that `open_stream(..., state=...)` resumes
    /// from, at this or another world size.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let state = self.with(|s| Ok(s.state()))?;
        let (shuffle, window_shards) = shuffle_names(state.shuffle);
        let dict = PyDict::new(py);
        dict.set_item("version", STATE_VERSION)?;
        dict.set_item("dataset", state.dataset)?;
        let sources: Vec<(String, f64)> = state
            .sources
            .iter()
            .map(|s| (s.dataset.clone(), s.weight))
            .collect();
        dict.set_item("sources", sources)?;
        dict.set_item("mixture_epoch_samples", state.mixture_epoch_samples)?;
        dict.set_item("seed", state.seed)?;
        dict.set_item("epoch", state.epoch)?;
        dict.set_item("shuffle", shuffle)?;
        dict.set_item("window_shards", window_shards)?;
        dict.set_item("world_size", state.world_size)?;
        dict.set_item("batch_size", state.batch_size)?;
        dict.set_item("cursor", state.cursor)?;
        Ok(dict)
    }

    /// Batches this rank receives from where the stream started to the end of the epoch.
    #[getter]
    fn steps(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.layout().steps))
    }

    /// Samples in the epoch (the dataset's), over all ranks.
    #[getter]
    fn epoch_samples(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.layout().epoch_samples))
    }

    /// Slots the daemon fills ahead of the consumer.
    #[getter]
    fn slot_count(&self) -> PyResult<u32> {
        self.with(|s| Ok(s.layout().slot_count))
    }

    /// `"cpu"` or `"cuda:N"`: where batches are.
    #[getter]
    fn device(&self) -> PyResult<String> {
        self.with(|s| {
            Ok(match s.layout().device {
                Device::Cpu => "cpu".to_string(),
                Device::Cuda(n) => format!("cuda:{n}"),
            })
        })
    }

    /// Makes `stream` (a `CUstream` address as an int, e.g. `torch.cuda.current_stream().cuda_stream`;
    /// 0 is the legacy default stream) the stream batches are delivered on: each batch is ready for
    /// work queued on it, and released after that work. The stream must outlive the batches.
    fn set_cuda_stream(&self, stream: usize) -> PyResult<()> {
        self.with(|s| {
            // SAFETY: the caller vouches for the stream (documented in docs/PYTHON.md and above).
            unsafe { s.set_cuda_stream(stream as *mut c_void) };
            Ok(())
        })
    }

    /// Ends the stream; batches still held stay valid until released.
    fn close(&self, py: Python<'_>) {
        // Without the GIL, as in `Client.close`.
        py.allow_threads(|| {
            drop(
                self.inner
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take(),
            )
        });
    }

    /// True once the stream was closed (by `close()`, its `with` block or its client's `close()`).
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        py.allow_threads(|| {
            self.inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_none()
        })
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Closes the stream on leaving a `with` block.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
        self.close(py);
    }
}

/// One batch: a lease on a slot, and a mapping of field name to [`Field`] (`batch[name]`, `for name
/// in batch`, `items()`), registered as a `collections.abc.Mapping` by the package.
#[pyclass(module = "gpufeed._gpufeed", mapping)]
struct Batch {
    lease: Arc<Lease>,
    /// CUDA ordinal of device batches.
    device: Option<u32>,
    epoch: u64,
    step: u64,
    samples: u32,
    replaced: u32,
    cursor_after: u64,
    names: Vec<String>,
}

impl Batch {
    fn new(batch: gpufeed_client::Batch, device: Option<u32>) -> Batch {
        Batch {
            device,
            epoch: batch.epoch(),
            step: batch.step(),
            samples: batch.samples(),
            replaced: batch.replaced(),
            cursor_after: batch.cursor_after(),
            names: batch.fields().map(|f| f.name.to_string()).collect(),
            lease: Arc::new(Lease {
                batch: Mutex::new(Some(batch)),
            }),
        }
    }
}

#[pymethods]
impl Batch {
    #[getter]
    fn epoch(&self) -> u64 {
        self.epoch
    }
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }
    #[getter]
    fn samples(&self) -> u32 {
        self.samples
    }
    /// Samples zero-filled because their block was corrupt (`on_corrupt="replace"`).
    #[getter]
    fn replaced(&self) -> u32 {
        self.replaced
    }
    /// The epoch cursor once every rank consumed this step.
    #[getter]
    fn cursor_after(&self) -> u64 {
        self.cursor_after
    }

    /// The field names, in slot order (a list).
    fn keys(&self) -> Vec<String> {
        self.names.clone()
    }

    /// The fields, in slot order (a list).
    fn values(&self) -> PyResult<Vec<Field>> {
        self.names
            .iter()
            .map(|name| self.__getitem__(name))
            .collect()
    }

    /// `(name, field)` pairs, in slot order (a list).
    fn items(&self) -> PyResult<Vec<(String, Field)>> {
        self.names
            .iter()
            .map(|name| Ok((name.clone(), self.__getitem__(name)?)))
            .collect()
    }

    /// `batch[name]`, or `default` when the batch has no such field.
    #[pyo3(signature = (name, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        name: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let known = name
            .extract::<String>()
            .ok()
            .filter(|name| self.names.contains(name));
        match known {
            Some(name) => Ok(Bound::new(py, self.__getitem__(&name)?)?.into_any()),
            None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
        }
    }

    /// Iterates over the field names.
    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        PyList::new(py, &self.names)?.try_iter()
    }

    fn __contains__(&self, name: &Bound<'_, PyAny>) -> bool {
        name.extract::<String>()
            .is_ok_and(|name| self.names.contains(&name))
    }

    fn __len__(&self) -> usize {
        self.names.len()
    }

    fn __getitem__(&self, name: &str) -> PyResult<Field> {
        let guard = self.lease.lock();
        let Some(batch) = guard.as_ref() else {
            return Err(PyValueError::new_err("the batch was released"));
        };
        let Some(view) = batch.field(name) else {
            return Err(pyo3::exceptions::PyKeyError::new_err(name.to_string()));
        };
        let (ptr, bytes) = match view.data {
            FieldData::Host(data) => (data.as_ptr() as u64, data.len()),
            FieldData::Device { ptr, bytes } => (ptr, bytes),
        };
        Ok(Field {
            lease: Arc::clone(&self.lease),
            device: self.device,
            name: name.to_string(),
            dtype: view.dtype,
            shape: view.shape.to_vec(),
            ptr,
            bytes,
        })
    }

    /// Releases the slot now. Arrays exported from the batch must not be used afterwards.
    fn release(&self) {
        self.lease.lock().take();
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) {
        self.release();
    }
}

/// One field of a batch, exported zero-copy through DLPack, `__cuda_array_interface__` (device) or
/// `__array_interface__` (host).
#[pyclass(module = "gpufeed._gpufeed")]
struct Field {
    lease: Arc<Lease>,
    device: Option<u32>,
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    ptr: u64,
    bytes: usize,
}

impl Field {
    fn released(&self) -> bool {
        self.lease.lock().is_none()
    }

    fn check_live(&self) -> PyResult<()> {
        if self.released() {
            return Err(PyBufferError::new_err(format!(
                "field {:?}: its batch was released",
                self.name
            )));
        }
        Ok(())
    }

    fn dl_tensor(&self, shape: &mut [i64]) -> DlTensor {
        DlTensor {
            data: self.ptr as *mut c_void,
            device: DlDevice {
                device_type: if self.device.is_some() {
                    DL_CUDA
                } else {
                    DL_CPU
                },
                device_id: self.device.unwrap_or(0) as i32,
            },
            ndim: shape.len() as i32,
            dtype: dl_dtype(self.dtype),
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        }
    }

    /// Makes a consumer's CUDA stream (DLPack's encoding: 1 legacy default, 2 per-thread default,
    /// else a `CUstream`; -1 none) wait for the batch, and releases the batch after that stream's
    /// work.
    fn sync_stream(&self, stream: Option<i64>) -> PyResult<()> {
        let (Some(_), Some(stream)) = (self.device, stream) else {
            return Ok(());
        };
        let raw = match stream {
            -1 => return Ok(()),
            0 => {
                return Err(PyValueError::new_err(
                    "stream 0 is ambiguous for CUDA (DLPack)",
                ))
            }
            1 => 0usize,
            other => other as usize,
        } as *mut c_void;
        let mut guard = self.lease.lock();
        let Some(batch) = guard.as_mut() else {
            return Err(PyBufferError::new_err("the batch was released"));
        };
        // SAFETY: the stream comes from the DLPack consumer, which queues its reads on it and keeps
        // it alive while it uses the tensor; it belongs to the device's primary context (PyTorch,
        // CuPy and JAX use the primary context).
        unsafe {
            batch
                .wait_ready_on(raw)
                .map_err(|e| PyBufferError::new_err(e.to_string()))?;
            batch.release_after(raw);
        }
        Ok(())
    }
}

unsafe extern "C" fn delete_managed(tensor: *mut DlManagedTensor) {
    if tensor.is_null() {
        return;
    }
    // SAFETY: made by `Box::into_raw` in `__dlpack__`, deleted once (by the consumer, or by the
    // capsule destructor when no consumer took it); its context is the `Exported` boxed with it.
    unsafe {
        let tensor = Box::from_raw(tensor);
        drop(Box::from_raw(tensor.manager_ctx as *mut Exported));
    }
}

unsafe extern "C" fn delete_versioned(tensor: *mut DlManagedTensorVersioned) {
    if tensor.is_null() {
        return;
    }
    // SAFETY: as in `delete_managed`.
    unsafe {
        let tensor = Box::from_raw(tensor);
        drop(Box::from_raw(tensor.manager_ctx as *mut Exported));
    }
}

const DLTENSOR: &CStr = c"dltensor";
const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";

/// A capsule that no consumer renamed (`used_dltensor`) still owns its tensor: delete it.
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by CPython with the capsule being destroyed; the names are checked before the
    // pointer is taken, so a consumed capsule (renamed) is left alone.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete_managed(ptr as *mut DlManagedTensor);
        } else if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR_VERSIONED.as_ptr()) == 1 {
            let ptr = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR_VERSIONED.as_ptr());
            delete_versioned(ptr as *mut DlManagedTensorVersioned);
        }
    }
}

#[pymethods]
impl Field {
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// gpufeed's name of the element type (`"f32"`, `"bf16"`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.bytes
    }

    /// The address of the first element (host or device).
    #[getter]
    fn data_ptr(&self) -> PyResult<u64> {
        self.check_live()?;
        Ok(self.ptr)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        match self.device {
            Some(ordinal) => (DL_CUDA, ordinal as i32),
            None => (DL_CPU, 0),
        }
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        self.check_live()?;
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "gpufeed exports batches without copying (copy=True is not supported)",
            ));
        }
        if let Some(device) = dl_device {
            if device != self.__dlpack_device__() {
                return Err(PyBufferError::new_err(format!(
                    "the batch is on DLPack device {:?}, not {device:?}",
                    self.__dlpack_device__()
                )));
            }
        }
        self.sync_stream(stream)?;
        let mut shape: Box<[i64]> = self.shape.iter().map(|&d| d as i64).collect();
        let dl_tensor = self.dl_tensor(&mut shape);
        let context = Box::into_raw(Box::new(Exported {
            _lease: Arc::clone(&self.lease),
            _shape: shape,
        })) as *mut c_void;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        let (pointer, name) = if versioned {
            let tensor = Box::new(DlManagedTensorVersioned {
                version: DlPackVersion { major: 1, minor: 0 },
                manager_ctx: context,
                deleter: Some(delete_versioned),
                flags: if self.device.is_none() {
                    DLPACK_FLAG_READ_ONLY
                } else {
                    0
                },
                dl_tensor,
            });
            (Box::into_raw(tensor) as *mut c_void, DLTENSOR_VERSIONED)
        } else {
            let tensor = Box::new(DlManagedTensor {
                dl_tensor,
                manager_ctx: context,
                deleter: Some(delete_managed),
            });
            (Box::into_raw(tensor) as *mut c_void, DLTENSOR)
        };
        // SAFETY: the pointer is a live managed tensor owned by the new capsule, whose destructor
        // deletes it unless a consumer took it (and renamed the capsule); the name is 'static.
        unsafe {
            let capsule =
                pyo3::ffi::PyCapsule_New(pointer, name.as_ptr(), Some(capsule_destructor));
            if capsule.is_null() {
                if versioned {
                    delete_versioned(pointer as *mut DlManagedTensorVersioned);
                } else {
                    delete_managed(pointer as *mut DlManagedTensor);
                }
                return Err(PyErr::fetch(py));
            }
            Ok(Bound::from_owned_ptr(py, capsule).downcast_into_unchecked())
        }
    }

    /// NumPy's array interface (host batches): read-only, C order.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.device.is_some() {
            return Err(pyo3::exceptions::PyAttributeError::new_err(
                "a device batch has __cuda_array_interface__, not __array_interface__",
            ));
        }
        self.interface(py, None)
    }

    /// The CUDA array interface, version 3 (device batches).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.device.is_none() {
            return Err(pyo3::exceptions::PyAttributeError::new_err(
                "a host batch has __array_interface__, not __cuda_array_interface__",
            ));
        }
        // The batch is ready on the stream set with Stream.set_cuda_stream, the legacy default
        // stream unless set (CAI's 1), which synchronises with the consumer's blocking streams.
        self.interface(py, Some(1))
    }
}

impl Field {
    fn interface<'py>(&self, py: Python<'py>, stream: Option<i64>) -> PyResult<Bound<'py, PyDict>> {
        self.check_live()?;
        let Some(typestr) = typestr(self.dtype) else {
            return Err(PyBufferError::new_err(format!(
                "field {:?} is bf16, which the array interfaces cannot describe: use DLPack",
                self.name
            )));
        };
        let dict = PyDict::new(py);
        dict.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        dict.set_item("typestr", typestr)?;
        dict.set_item("data", (self.ptr, self.device.is_none()))?;
        dict.set_item("strides", py.None())?;
        dict.set_item("version", 3)?;
        if self.device.is_some() {
            dict.set_item("stream", stream)?;
        }
        Ok(dict)
    }
}

/// Moves the calling thread off the CPUs that service `device`'s interrupts (`cuda` or `cuda:N`),
/// when other CPUs are allowed to it; returns the CPUs it runs on now, or None when it was left as it
/// was. Threads it starts afterwards inherit the restriction. For the thread that takes batches:
/// its per-batch CUDA driver calls stall behind the interrupt handler on those CPUs.
#[pyfunction]
fn keep_thread_off_interrupt_cpus(py: Python<'_>, device: &str) -> PyResult<Option<Vec<usize>>> {
    let Device::Cuda(ordinal) = parse_device(device)? else {
        return Err(PyValueError::new_err(format!(
            "device {device:?}: interrupt CPUs are a CUDA device's"
        )));
    };
    gpufeed_client::cuda::keep_thread_off_interrupt_cpus(ordinal)
        .map_err(|e| to_py(py, ClientError::Cuda(e)))
}

/// The native module.
#[pymodule]
fn _gpufeed(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(keep_thread_off_interrupt_cpus, module)?)?;
    module.add_class::<Client>()?;
    module.add_class::<Stream>()?;
    module.add_class::<Batch>()?;
    module.add_class::<Field>()?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
