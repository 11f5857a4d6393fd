//! The wire protocol between the daemon and its consumers (specified byte by byte in
//! `docs/PROTOCOL.md`).
//!
//! A frame is an 8-byte header — `u32` length of what follows the length field, `u16` protocol version,
//! `u16` message kind — and a payload of little-endian fields. Strings are a `u16` byte length and
//! UTF-8 bytes. Every length is bounded, and decoding never reads past the frame or allocates more than
//! the bounds allow.

use crate::dtype::DType;

/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u16 = 4;
/// Bytes of the frame header.
pub const FRAME_HEADER_BYTES: usize = 8;
/// Largest frame (header included).
pub const FRAME_BYTES_MAX: usize = 64 * 1024;
/// Longest string field, in bytes.
pub const STRING_BYTES_MAX: usize = 1024;
/// Most fields a stream may request.
pub const STREAM_FIELDS_MAX: usize = 256;
/// Most dimensions of a batch shape (the batch dimension plus six per-sample dimensions).
pub const BATCH_NDIM_MAX: usize = 7;
/// Most slots a stream may have.
pub const SLOTS_MAX: u32 = 64;
/// Most sources of a mixture stream ([`StreamSpec::sources`]).
pub const MIXTURE_SOURCES_MAX: usize = 64;
/// Tag of the extension record of a mixture in `OpenStream` (`docs/PROTOCOL.md`).
pub const OPEN_STREAM_EXTENSION_MIXTURE: u16 = 1;
/// Descriptors `StreamOpened` carries besides the slots' memory: the hand-off ring's memfd, the
/// consumer's doorbell and the daemon's doorbell (see [`crate::ring`]).
pub const STREAM_EXTRA_DESCRIPTORS: u32 = 3;
/// Descriptors `StreamOpened` carries: the memory of all the slots, then the extra ones.
pub const STREAM_OPENED_DESCRIPTORS: u32 = 1 + STREAM_EXTRA_DESCRIPTORS;
/// Most descriptors one frame carries.
pub const DESCRIPTORS_MAX: u32 = STREAM_OPENED_DESCRIPTORS;
/// `StreamLayout::slot_stride` is a multiple of this: each slot starts on its own page.
pub const SLOT_STRIDE_ALIGN_BYTES: u64 = 4096;

/// The stride the reference daemon gives slots of `slot_bytes`: `slot_bytes` rounded up to
/// [`SLOT_STRIDE_ALIGN_BYTES`] (at most the largest multiple of it that a `u64` holds).
pub fn slot_stride(slot_bytes: u64) -> u64 {
    slot_bytes
        .div_ceil(SLOT_STRIDE_ALIGN_BYTES)
        .saturating_mul(SLOT_STRIDE_ALIGN_BYTES)
        & !(SLOT_STRIDE_ALIGN_BYTES - 1)
}

/// Which memory batches live in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Host memory shared through memfd.
    Cpu,
    /// Device memory exported as POSIX file descriptors.
    Cuda,
}

/// Which device a stream's slots are allocated on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(u32),
}

/// Bytes of a device UUID on the wire (`OpenStream.device_uuid`).
pub const DEVICE_UUID_BYTES: usize = 16;

/// A physical GPU's UUID as the CUDA driver reports it (`cuDeviceGetUuid_v2`): the same GPU has the
/// same UUID in every process, whatever each process's `CUDA_VISIBLE_DEVICES`, while its ordinal
/// may differ. Shown as `nvidia-smi -L` shows it: `GPU-` and 32 hex digits in groups of 8-4-4-4-12.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceUuid(pub [u8; DEVICE_UUID_BYTES]);

impl std::fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GPU-")?;
        for (i, byte) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for DeviceUuid {
    type Err = String;

    /// Parses `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (the `GPU-` prefix and the dashes are
    /// optional; hex digits of either case).
    fn from_str(text: &str) -> Result<DeviceUuid, String> {
        let digits: String = text
            .trim()
            .trim_start_matches("GPU-")
            .chars()
            .filter(|c| *c != '-')
            .collect();
        let bad =
            || format!("{text:?} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)");
        if digits.len() != 2 * DEVICE_UUID_BYTES || !digits.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; DEVICE_UUID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(DeviceUuid(bytes))
    }
}

/// How an epoch's samples are ordered (see the daemon's `pipeline::order`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shuffle {
    /// Dataset order.
    None,
    /// Shuffle shards, then samples within windows of this many shards.
    Window(u32),
    /// Shuffle all samples.
    Full,
}

/// What happens to the samples that do not fill a whole step at the end of an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tail {
    /// Leave them out (drop_last).
    Drop,
    /// Serve one more full step, wrapping to the start of the epoch.
    Pad,
}

/// What a stream does when a block is corrupt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorruptPolicy {
    /// End the stream with an error naming shard, field and block.
    Fail,
    /// Serve a zero-filled substitute sample, counted in the batch and in metrics, so ranks stay in step.
    Replace,
}

/// How a batch holds a variable-length field (a field whose samples vary in length).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchForm {
    /// `[samples, L, ...]`, `L` the batch's longest sample, shorter ones zero-filled, with an
    /// `int32 [samples]` lengths tensor (`NAME.lengths`).
    Padded,
    /// The samples' values back to back, `[total, ...]`, with `int32 [samples + 1]` cumulative
    /// offsets (`NAME.cu_seqlens`, FlashAttention's varlen convention).
    Packed,
}

impl BatchForm {
    /// The code on the wire.
    pub const fn code(self) -> u8 {
        match self {
            BatchForm::Padded => 1,
            BatchForm::Packed => 2,
        }
    }

    /// The suffix of the name of the index tensor beside a field's values: `lengths` or
    /// `cu_seqlens`.
    pub const fn index_suffix(self) -> &'static str {
        match self {
            BatchForm::Padded => "lengths",
            BatchForm::Packed => "cu_seqlens",
        }
    }
}

/// How a stream asks for one variable-length field: its batch form, and a cap on its samples'
/// length (longer samples are truncated to it). A variable-length field the request does not name
/// is padded without a cap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariableRequest {
    /// Field name.
    pub name: String,
    /// The batch form.
    pub form: BatchForm,
    /// Elements a sample keeps at most; `None`: all of them (the slot then holds the dataset's
    /// longest sample for every row).
    pub cap: Option<u32>,
}

/// A variable-length field in a stream's layout: which layout entries hold its values and its
/// index tensor (lengths or cumulative offsets), so that a client shapes each batch from the index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariableLayout {
    /// Index in [`StreamLayout::fields`] of the values, whose `sample_shape` is
    /// `[length_bound, ...element shape]`.
    pub values: u16,
    /// Index in [`StreamLayout::fields`] of the `int32` index tensor.
    pub index: u16,
    /// The batch form.
    pub form: BatchForm,
}

/// Tag of the extension record of variable-length batch forms in `OpenStream` (`docs/PROTOCOL.md`).
pub const OPEN_STREAM_EXTENSION_VARIABLE: u16 = 2;
/// Tag of the extension record of variable-length layouts in `StreamOpened` (`docs/PROTOCOL.md`).
pub const STREAM_OPENED_EXTENSION_VARIABLE: u16 = 1;

/// A field requested by a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldRequest {
    /// Field name.
    pub name: String,
    /// Output dtype; `None` keeps the stored dtype.
    pub dtype: Option<DType>,
}

/// One dataset of a mixture stream and its weight.
#[derive(Clone, Debug)]
pub struct MixtureSource {
    /// Dataset name as registered with the daemon.
    pub dataset: String,
    /// The source's weight: positive and finite; the weights of a mixture need not sum to 1.
    pub weight: f64,
}

// Weights compare by their bits, so that equality is an equivalence (a NaN weight, which the
// spec's rules refuse, equals itself).
impl PartialEq for MixtureSource {
    fn eq(&self, other: &MixtureSource) -> bool {
        self.dataset == other.dataset && self.weight.to_bits() == other.weight.to_bits()
    }
}

impl Eq for MixtureSource {}

/// Everything that defines a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSpec {
    /// Dataset name as registered with the daemon.
    pub dataset: String,
    /// Fields to serve, in slot order; empty means every field, stored dtype.
    pub fields: Vec<FieldRequest>,
    /// Samples per batch on this rank.
    pub batch_size: u32,
    /// Shuffle seed.
    pub seed: u64,
    /// Epoch to serve.
    pub epoch: u64,
    /// Sample order.
    pub shuffle: Shuffle,
    /// This rank.
    pub rank: u32,
    /// Ranks consuming the epoch together.
    pub world_size: u32,
    /// Tail policy.
    pub tail: Tail,
    /// Position in the epoch's global order to start at (`step × world_size × batch_size` to start at
    /// a step; a checkpoint's cursor to resume, at any world size).
    pub start_cursor: u64,
    /// Slots filled ahead of the consumer (1 to [`SLOTS_MAX`]).
    pub prefetch: u32,
    /// Corrupt-block policy.
    pub on_corrupt: CorruptPolicy,
    /// Where slots live.
    pub device: Device,
    /// With `device` = `Cuda(n)`: the UUID of the GPU the consumer calls `cuda:n`, so that the daemon
    /// serves that physical GPU whatever its own ordinal for it. The client library fills it from
    /// its driver when it is `None`; a request without it means the daemon's ordinal `n`, as before
    /// the field existed. Must be `None` for host memory.
    pub device_uuid: Option<DeviceUuid>,
    /// A mixture: the datasets drawn from, with their weights (2 to [`MIXTURE_SOURCES_MAX`]), and
    /// `dataset` empty. Empty for a stream of `dataset` alone, as before the field existed.
    pub sources: Vec<MixtureSource>,
    /// A mixture's epoch length in positions; `None` for the sum of its sources' sample counts.
    /// Only with `sources`.
    pub mixture_epoch_samples: Option<u64>,
    /// Batch forms of variable-length fields (an extension record on the wire, sent only when not
    /// empty).
    pub variable: Vec<VariableRequest>,
}

/// Where one field sits in every slot of a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldLayout {
    /// Field name.
    pub name: String,
    /// Element type in the slot.
    pub dtype: DType,
    /// Per-sample shape.
    pub sample_shape: Vec<u64>,
    /// Byte offset of the field's batch within a slot.
    pub offset: u64,
    /// Bytes a full batch of this field occupies.
    pub batch_bytes: u64,
}

/// The reply to [`Message::OpenStream`]; the slots' descriptors travel with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamLayout {
    /// Number of slots.
    pub slot_count: u32,
    /// Size of each slot in bytes.
    pub slot_bytes: u64,
    /// Bytes from one slot's start to the next one's in the slots' memory: slot *i* occupies
    /// `[i * slot_stride, i * slot_stride + slot_bytes)` of it. At least `slot_bytes`, a multiple of
    /// [`SLOT_STRIDE_ALIGN_BYTES`].
    pub slot_stride: u64,
    /// Samples in the epoch.
    pub epoch_samples: u64,
    /// Batches this rank will receive from the start cursor to the end of the epoch.
    pub steps: u64,
    /// Fields in slot order.
    pub fields: Vec<FieldLayout>,
    /// Where the slots live: host memory (memfd descriptors) or a CUDA device (exported allocations).
    pub device: Device,
    /// On a CUDA device, the interprocess events of each slot, in slot order; empty for host memory.
    pub slot_events: Vec<SlotEvents>,
    /// The variable-length fields among `fields` (an extension record on the wire, sent only when
    /// not empty: a client that predates them refuses the layout rather than misread it).
    pub variable: Vec<VariableLayout>,
}

/// Bytes of a CUDA interprocess event handle (`CUipcEventHandle`).
pub const IPC_EVENT_HANDLE_BYTES: usize = 64;

/// The two interprocess CUDA events of a device slot.
///
/// The daemon records `ready` on its stream once the slot is filled; the client makes its stream wait
/// on it. The client records `released` on its stream when it releases the slot; the daemon's stream
/// waits on it before writing the slot again. Neither side blocks its host thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotEvents {
    /// `cuIpcGetEventHandle` of the daemon's fill-complete event.
    pub ready: [u8; IPC_EVENT_HANDLE_BYTES],
    /// `cuIpcGetEventHandle` of the event the client records when it is done with the slot.
    pub released: [u8; IPC_EVENT_HANDLE_BYTES],
}

/// One field of a ready batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchField {
    /// Byte offset within the slot.
    pub offset: u64,
    /// Element type.
    pub dtype: DType,
    /// Shape, batch dimension first.
    pub shape: Vec<u64>,
}

/// A filled slot handed to the consumer (through the hand-off ring, [`crate::ring::RingBatch`], with
/// the fields' places filled in from the layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchInfo {
    /// The slot; it belongs to the consumer until released.
    pub slot: u32,
    /// Epoch of the batch.
    pub epoch: u64,
    /// Step within the epoch, counted from the start of the epoch.
    pub step: u64,
    /// The epoch cursor once this batch has been consumed by every rank; a checkpoint records it.
    pub cursor_after: u64,
    /// Samples in the batch.
    pub samples: u32,
    /// Samples replaced because their block was corrupt.
    pub replaced: u32,
    /// Fields in slot order.
    pub fields: Vec<BatchField>,
    /// `CLOCK_MONOTONIC` time, in nanoseconds, at which the daemon saw the batch complete (on a CUDA
    /// device: its ready event done); a client on the same host measures the hand-off latency from it.
    pub ready_ns: u64,
}

/// Counters the daemon reports over the socket.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DaemonStatus {
    /// Connected sessions.
    pub sessions: u32,
    /// Open streams.
    pub streams: u32,
    /// Slots allocated over all streams.
    pub slots_allocated: u64,
    /// Bytes of slot memory allocated.
    pub slot_bytes_allocated: u64,
    /// Batches handed to consumers since start.
    pub batches_served: u64,
    /// Samples replaced because of corrupt blocks since start.
    pub samples_replaced: u64,
}

/// Stable error codes of [`Message::Error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// A frame could not be decoded or broke a bound.
    BadFrame,
    /// The peer speaks another protocol version.
    UnsupportedVersion,
    /// No dataset has that name.
    UnknownDataset,
    /// The request is well-formed but invalid (unknown field, bad sizes, stream already open...).
    BadRequest,
    /// A block was corrupt and the stream's policy is to fail.
    CorruptData,
    /// A bound was reached (sessions, slots, memory).
    ResourceExhausted,
    /// The peer's uid is not allowed.
    PermissionDenied,
    /// The daemon failed.
    Internal,
    /// The daemon closed the session (operator request, dataset removed, shutdown).
    Closed,
    /// A code this build does not know.
    Unknown(u16),
}

impl ErrorCode {
    /// The wire value.
    pub fn code(self) -> u16 {
        match self {
            ErrorCode::BadFrame => 1,
            ErrorCode::UnsupportedVersion => 2,
            ErrorCode::UnknownDataset => 3,
            ErrorCode::BadRequest => 4,
            ErrorCode::CorruptData => 5,
            ErrorCode::ResourceExhausted => 6,
            ErrorCode::PermissionDenied => 7,
            ErrorCode::Internal => 8,
            ErrorCode::Closed => 9,
            ErrorCode::Unknown(code) => code,
        }
    }

    /// The code with this wire value.
    pub fn from_code(code: u16) -> ErrorCode {
        match code {
            1 => ErrorCode::BadFrame,
            2 => ErrorCode::UnsupportedVersion,
            3 => ErrorCode::UnknownDataset,
            4 => ErrorCode::BadRequest,
            5 => ErrorCode::CorruptData,
            6 => ErrorCode::ResourceExhausted,
            7 => ErrorCode::PermissionDenied,
            8 => ErrorCode::Internal,
            9 => ErrorCode::Closed,
            other => ErrorCode::Unknown(other),
        }
    }
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Consumer → daemon, first frame of a session.
    Hello {
        /// Free-form client name, for logs.
        client: String,
    },
    /// Daemon → consumer, reply to `Hello`.
    Welcome {
        /// Session id.
        session: u64,
        /// Where batches live.
        backend: Backend,
        /// The daemon's version.
        daemon_version: String,
    },
    /// Consumer → daemon: open the session's stream.
    OpenStream(StreamSpec),
    /// Daemon → consumer: the stream's layout; carries the descriptor of the slots' memory (all the
    /// slots, `slot_stride` apart), then the hand-off ring and its two doorbells. Filled slots and
    /// releases then travel through the ring.
    StreamOpened(StreamLayout),
    /// Daemon → consumer: no more batches in this epoch.
    EndOfEpoch {
        /// The epoch.
        epoch: u64,
        /// Batches sent in this stream.
        steps: u64,
    },
    /// Daemon → consumer: the request or stream failed; the session ends after a fatal error.
    Error {
        /// Stable code.
        code: ErrorCode,
        /// Human-readable description.
        message: String,
    },
    /// Consumer → daemon: end the session.
    Close,
    /// Consumer → daemon: ask for [`Message::Status`].
    StatusRequest,
    /// Daemon → consumer: counters.
    Status(DaemonStatus),
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of [`BatchInfo::ready_ns`], comparable between
/// processes on one host.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(rc, 0, "CLOCK_MONOTONIC is always available");
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// The wire value of a device: `u32::MAX` for host memory, else the CUDA ordinal.
fn device_marker(device: Device) -> u32 {
    match device {
        Device::Cpu => u32::MAX,
        Device::Cuda(ordinal) => {
            assert!(ordinal != u32::MAX, "CUDA ordinal u32::MAX is reserved");
            ordinal
        }
    }
}

/// A frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The header's length is outside the bounds.
    #[error("frame length {0} outside {min}..={max}", min = FRAME_HEADER_BYTES - 4, max = FRAME_BYTES_MAX - 4)]
    Length(u32),
    /// The peer speaks another version.
    #[error("protocol version {found} is not supported (this build speaks {PROTOCOL_VERSION})")]
    Version {
        /// The version in the frame.
        found: u16,
    },
    /// The kind is not assigned.
    #[error("unknown message kind {0}")]
    Kind(u16),
    /// The payload is malformed.
    #[error("malformed {kind} frame: {reason}")]
    Malformed {
        /// The message kind's name.
        kind: &'static str,
        /// What is wrong.
        reason: String,
    },
}

const KIND_HELLO: u16 = 1;
const KIND_WELCOME: u16 = 2;
const KIND_OPEN_STREAM: u16 = 3;
const KIND_STREAM_OPENED: u16 = 4;
// Kinds 5 (Batch) and 6 (Release) were frames of version 2; since version 3 the hand-off ring
// carries them, and the codes stay unassigned.
const KIND_END_OF_EPOCH: u16 = 7;
const KIND_ERROR: u16 = 8;
const KIND_CLOSE: u16 = 9;
const KIND_STATUS_REQUEST: u16 = 10;
const KIND_STATUS: u16 = 11;

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        assert!(
            s.len() <= STRING_BYTES_MAX,
            "string longer than {STRING_BYTES_MAX} bytes"
        );
        self.u16(s.len() as u16);
        self.0.extend_from_slice(s.as_bytes());
    }
    /// An extension record: `u16` tag, `u32` length, the record's bytes.
    fn extension(&mut self, tag: u16, record: &[u8]) {
        self.u16(tag);
        self.u32(u32::try_from(record.len()).expect("a record fits in a frame"));
        self.0.extend_from_slice(record);
    }
    fn shape(&mut self, dims: &[u64]) {
        assert!(dims.len() <= BATCH_NDIM_MAX);
        self.u8(dims.len() as u8);
        for &d in dims {
            self.u64(d);
        }
    }
}

/// Writes what follows an `OpenStream`'s device: nothing for a request with neither a device UUID
/// nor an extension record (the earlier layouts, byte for byte); the UUID; then the extension
/// records, each `u16` tag, `u32` length and payload, in tag order and each at most once, before
/// which a CUDA stream without a UUID writes 16 zero bytes in its place (no GPU has that UUID).
fn encode_open_stream_tail(w: &mut Writer, spec: &StreamSpec) {
    let mixture = !spec.sources.is_empty();
    let variable = !spec.variable.is_empty();
    match (spec.device, spec.device_uuid) {
        (_, Some(uuid)) => w.0.extend_from_slice(&uuid.0),
        (Device::Cuda(_), None) if mixture || variable => {
            w.0.extend_from_slice(&[0; DEVICE_UUID_BYTES])
        }
        _ => {}
    }
    if mixture {
        assert!(spec.sources.len() <= MIXTURE_SOURCES_MAX);
        let mut payload = Writer(Vec::new());
        payload.u16(spec.sources.len() as u16);
        for source in &spec.sources {
            payload.str(&source.dataset);
            payload.u64(source.weight.to_bits());
        }
        payload.u64(spec.mixture_epoch_samples.unwrap_or(0));
        w.extension(OPEN_STREAM_EXTENSION_MIXTURE, &payload.0);
    }
    if variable {
        assert!(spec.variable.len() <= STREAM_FIELDS_MAX);
        let mut payload = Writer(Vec::new());
        payload.u16(spec.variable.len() as u16);
        for variable in &spec.variable {
            payload.str(&variable.name);
            payload.u8(variable.form.code());
            payload.u32(variable.cap.unwrap_or(0));
        }
        w.extension(OPEN_STREAM_EXTENSION_VARIABLE, &payload.0);
    }
}

/// The mixture record's bytes for `sources`: what [`encode_open_stream_tail`] writes, tag and
/// length included.
pub(crate) fn mixture_extension_bytes(sources: &[MixtureSource]) -> usize {
    let names: usize = sources.iter().map(|s| 2 + s.dataset.len() + 8).sum();
    2 + 4 + 2 + names + 8
}

/// The batch forms' record's bytes for `variable`: what [`encode_open_stream_tail`] writes, tag and
/// length included.
pub(crate) fn variable_extension_bytes(variable: &[VariableRequest]) -> usize {
    let fields: usize = variable.iter().map(|v| 2 + v.name.len() + 1 + 4).sum();
    2 + 4 + 2 + fields
}

/// What follows an `OpenStream`'s device, as the daemon of this version decodes it.
#[derive(Default)]
struct OpenStreamTail {
    device_uuid: Option<DeviceUuid>,
    sources: Vec<MixtureSource>,
    mixture_epoch_samples: Option<u64>,
    variable: Vec<VariableRequest>,
}

/// Reads what follows an `OpenStream`'s device (see [`encode_open_stream_tail`]): records in any
/// order, each tag at most once, an unknown tag refused.
fn decode_open_stream_tail(
    r: &mut Reader<'_>,
    device: Device,
) -> Result<OpenStreamTail, DecodeError> {
    let mut tail = OpenStreamTail::default();
    if r.at < r.bytes.len() && device != Device::Cpu {
        let bytes: [u8; DEVICE_UUID_BYTES] =
            r.take(DEVICE_UUID_BYTES)?.try_into().expect("16 bytes");
        tail.device_uuid = (bytes != [0; DEVICE_UUID_BYTES]).then_some(DeviceUuid(bytes));
    }
    let mut mixture_seen = false;
    while r.at < r.bytes.len() {
        // An unknown tag is refused before its length is believed.
        if let Some(tag) = r.peek_u16() {
            if tag != OPEN_STREAM_EXTENSION_MIXTURE && tag != OPEN_STREAM_EXTENSION_VARIABLE {
                return r.fail(if device == Device::Cpu {
                    // A host stream's trailing bytes were a UUID in earlier versions: say so.
                    format!(
                        "unknown extension {tag} (a device UUID is not given for a host-memory \
                         stream)"
                    )
                } else {
                    format!("unknown extension {tag}")
                });
            }
        }
        let (tag, mut record) = r.extension()?;
        match tag {
            OPEN_STREAM_EXTENSION_MIXTURE if !mixture_seen => {
                mixture_seen = true;
                (tail.sources, tail.mixture_epoch_samples) = decode_mixture(&mut record)?;
                record.finish(())?;
            }
            OPEN_STREAM_EXTENSION_MIXTURE => return r.fail("the mixture extension is given twice"),
            OPEN_STREAM_EXTENSION_VARIABLE if tail.variable.is_empty() => {
                tail.variable = decode_variable(&mut record)?;
                record.finish(())?;
            }
            OPEN_STREAM_EXTENSION_VARIABLE => {
                return r.fail("the record of variable-length fields is repeated")
            }
            other => unreachable!("extension tag {other} checked above"),
        }
    }
    Ok(tail)
}

/// The mixture record's payload: the sources and the epoch length (0 for the default).
fn decode_mixture(r: &mut Reader<'_>) -> Result<(Vec<MixtureSource>, Option<u64>), DecodeError> {
    let count = r.count("mixture sources", MIXTURE_SOURCES_MAX)?;
    if count == 0 {
        // The encoder writes no extension for a stream without sources: one naming none (an
        // epoch length alone) would not survive a round trip.
        return r.fail("the mixture extension names no sources");
    }
    let mut sources = Vec::with_capacity(count);
    for _ in 0..count {
        let dataset = r.str()?;
        let weight = f64::from_bits(r.u64()?);
        sources.push(MixtureSource { dataset, weight });
    }
    let epoch_samples = Some(r.u64()?).filter(|&samples| samples > 0);
    Ok((sources, epoch_samples))
}

/// The batch forms' record's payload: per field its name, form and cap (0 for none).
fn decode_variable(r: &mut Reader<'_>) -> Result<Vec<VariableRequest>, DecodeError> {
    let count = r.count("variable-length fields", STREAM_FIELDS_MAX)?;
    if count == 0 {
        // The encoder writes no record for a stream without batch forms: an empty one would not
        // survive a round trip.
        return r.fail("an empty record of variable-length fields");
    }
    let mut variable = Vec::with_capacity(count);
    for _ in 0..count {
        let name = r.str()?;
        let form = r.form()?;
        let cap = Some(r.u32()?).filter(|&cap| cap > 0);
        variable.push(VariableRequest { name, form, cap });
    }
    Ok(variable)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn fail<T>(&self, reason: impl Into<String>) -> Result<T, DecodeError> {
        Err(DecodeError::Malformed {
            kind: self.kind,
            reason: reason.into(),
        })
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.bytes.len() - self.at < n {
            return self.fail(format!(
                "needs {n} more bytes at payload offset {}, only {} left",
                self.at,
                self.bytes.len() - self.at
            ));
        }
        let slice = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let len = self.u16()? as usize;
        if len > STRING_BYTES_MAX {
            return self.fail(format!("string of {len} bytes exceeds {STRING_BYTES_MAX}"));
        }
        let bytes = self.take(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => self.fail("string is not UTF-8"),
        }
    }
    fn dtype(&mut self) -> Result<DType, DecodeError> {
        let code = self.u8()?;
        DType::from_code(code).or_else(|e| self.fail(e.to_string()))
    }
    fn shape(&mut self) -> Result<Vec<u64>, DecodeError> {
        let ndim = self.u8()? as usize;
        if ndim > BATCH_NDIM_MAX {
            return self.fail(format!("{ndim} dimensions exceed {BATCH_NDIM_MAX}"));
        }
        (0..ndim).map(|_| self.u64()).collect()
    }
    /// The next two bytes as a `u16`, without consuming them; `None` past the end.
    fn peek_u16(&self) -> Option<u16> {
        let bytes = self.bytes.get(self.at..self.at + 2)?;
        Some(u16::from_le_bytes(bytes.try_into().expect("2 bytes")))
    }
    /// An extension record: its tag, and a reader of its bytes alone.
    fn extension(&mut self) -> Result<(u16, Reader<'a>), DecodeError> {
        let rest = self.bytes.len() - self.at;
        if rest < 6 {
            return self.fail(format!(
                "{rest} trailing bytes, too few for an extension record"
            ));
        }
        let tag = self.u16()?;
        let len = self.u32()? as usize;
        let bytes = self.take(len)?;
        Ok((
            tag,
            Reader {
                bytes,
                at: 0,
                kind: self.kind,
            },
        ))
    }
    fn form(&mut self) -> Result<BatchForm, DecodeError> {
        match self.u8()? {
            1 => Ok(BatchForm::Padded),
            2 => Ok(BatchForm::Packed),
            other => self.fail(format!("unknown batch form {other}")),
        }
    }
    fn count(&mut self, what: &str, max: usize) -> Result<usize, DecodeError> {
        let n = self.u16()? as usize;
        if n > max {
            return self.fail(format!("{n} {what} exceed {max}"));
        }
        Ok(n)
    }
    fn finish<T>(self, value: T) -> Result<T, DecodeError> {
        if self.at != self.bytes.len() {
            return self.fail(format!("{} trailing bytes", self.bytes.len() - self.at));
        }
        Ok(value)
    }
}

/// The name of a message kind, or `None` for an unassigned code.
fn kind_name(kind: u16) -> Option<&'static str> {
    Some(match kind {
        KIND_HELLO => "Hello",
        KIND_WELCOME => "Welcome",
        KIND_OPEN_STREAM => "OpenStream",
        KIND_STREAM_OPENED => "StreamOpened",
        KIND_END_OF_EPOCH => "EndOfEpoch",
        KIND_ERROR => "Error",
        KIND_CLOSE => "Close",
        KIND_STATUS_REQUEST => "StatusRequest",
        KIND_STATUS => "Status",
        _ => return None,
    })
}

impl Message {
    /// The message kind's name (`"Hello"`, `"StreamOpened"`, ...), for logs and error messages.
    pub fn name(&self) -> &'static str {
        kind_name(self.kind()).expect("every message has an assigned kind")
    }

    fn kind(&self) -> u16 {
        match self {
            Message::Hello { .. } => KIND_HELLO,
            Message::Welcome { .. } => KIND_WELCOME,
            Message::OpenStream(_) => KIND_OPEN_STREAM,
            Message::StreamOpened(_) => KIND_STREAM_OPENED,
            Message::EndOfEpoch { .. } => KIND_END_OF_EPOCH,
            Message::Error { .. } => KIND_ERROR,
            Message::Close => KIND_CLOSE,
            Message::StatusRequest => KIND_STATUS_REQUEST,
            Message::Status(_) => KIND_STATUS,
        }
    }

    /// Encodes the message as one complete frame (header included).
    ///
    /// Panics if the message breaks a bound (a programmer error: the daemon and the client build
    /// messages from validated values).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(PROTOCOL_VERSION)
    }

    /// An `Error` frame with code `UnsupportedVersion` in the header of `peer_version`: the `Error`
    /// frame is laid out alike in every version, so a peer speaking another version reads the refusal
    /// (and its reason) instead of failing on the header.
    pub fn version_refusal(peer_version: u16, message: String) -> Vec<u8> {
        Message::Error {
            code: ErrorCode::UnsupportedVersion,
            message,
        }
        .encode_as(peer_version)
    }

    fn encode_as(&self, version: u16) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(64));
        w.u32(0);
        w.u16(version);
        w.u16(self.kind());
        match self {
            Message::Hello { client } => w.str(client),
            Message::Welcome {
                session,
                backend,
                daemon_version,
            } => {
                w.u64(*session);
                w.u8(match backend {
                    Backend::Cpu => 0,
                    Backend::Cuda => 1,
                });
                w.str(daemon_version);
            }
            Message::OpenStream(spec) => {
                w.str(&spec.dataset);
                assert!(spec.fields.len() <= STREAM_FIELDS_MAX);
                w.u16(spec.fields.len() as u16);
                for field in &spec.fields {
                    w.str(&field.name);
                    w.u8(field.dtype.map_or(0, DType::code));
                }
                w.u32(spec.batch_size);
                w.u64(spec.seed);
                w.u64(spec.epoch);
                let (mode, window) = match spec.shuffle {
                    Shuffle::None => (0, 0),
                    Shuffle::Window(shards) => (1, shards),
                    Shuffle::Full => (2, 0),
                };
                w.u8(mode);
                w.u32(window);
                w.u32(spec.rank);
                w.u32(spec.world_size);
                w.u8(match spec.tail {
                    Tail::Drop => 0,
                    Tail::Pad => 1,
                });
                w.u64(spec.start_cursor);
                w.u32(spec.prefetch);
                w.u8(match spec.on_corrupt {
                    CorruptPolicy::Fail => 0,
                    CorruptPolicy::Replace => 1,
                });
                w.u32(device_marker(spec.device));
                encode_open_stream_tail(&mut w, spec);
            }
            Message::StreamOpened(layout) => {
                w.u32(layout.slot_count);
                w.u64(layout.slot_bytes);
                w.u64(layout.slot_stride);
                w.u64(layout.epoch_samples);
                w.u64(layout.steps);
                assert!(layout.fields.len() <= STREAM_FIELDS_MAX);
                w.u16(layout.fields.len() as u16);
                for field in &layout.fields {
                    w.str(&field.name);
                    w.u8(field.dtype.code());
                    w.shape(&field.sample_shape);
                    w.u64(field.offset);
                    w.u64(field.batch_bytes);
                }
                w.u32(device_marker(layout.device));
                match layout.device {
                    Device::Cpu => assert!(layout.slot_events.is_empty()),
                    Device::Cuda(_) => {
                        assert_eq!(layout.slot_events.len(), layout.slot_count as usize);
                        for events in &layout.slot_events {
                            w.0.extend_from_slice(&events.ready);
                            w.0.extend_from_slice(&events.released);
                        }
                    }
                }
                if !layout.variable.is_empty() {
                    let mut record = Writer(Vec::new());
                    record.u16(layout.variable.len() as u16);
                    for variable in &layout.variable {
                        record.u16(variable.values);
                        record.u16(variable.index);
                        record.u8(variable.form.code());
                    }
                    w.extension(STREAM_OPENED_EXTENSION_VARIABLE, &record.0);
                }
            }
            Message::EndOfEpoch { epoch, steps } => {
                w.u64(*epoch);
                w.u64(*steps);
            }
            Message::Error { code, message } => {
                w.u16(code.code());
                let mut end = message.len().min(STRING_BYTES_MAX);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                w.str(&message[..end]);
            }
            Message::Close | Message::StatusRequest => {}
            Message::Status(status) => {
                w.u32(status.sessions);
                w.u32(status.streams);
                w.u64(status.slots_allocated);
                w.u64(status.slot_bytes_allocated);
                w.u64(status.batches_served);
                w.u64(status.samples_replaced);
            }
        }
        let mut bytes = w.0;
        assert!(
            bytes.len() <= FRAME_BYTES_MAX,
            "frame exceeds {FRAME_BYTES_MAX} bytes"
        );
        let length = (bytes.len() - 4) as u32;
        bytes[..4].copy_from_slice(&length.to_le_bytes());
        bytes
    }

    /// Reads the length field of a frame header: the bytes that follow it. Rejects lengths outside
    /// the bounds before anything is allocated.
    pub fn frame_length(header: [u8; 4]) -> Result<usize, DecodeError> {
        let length = u32::from_le_bytes(header);
        if (length as usize) < FRAME_HEADER_BYTES - 4 || length as usize > FRAME_BYTES_MAX - 4 {
            return Err(DecodeError::Length(length));
        }
        Ok(length as usize)
    }

    /// The decoder's properties on any input, for the fuzz target (`fuzz/fuzz_targets/
    /// message_decode.rs`) and the stable fuzz smoke test (`proto/tests/decode_fuzz.rs`): `body`
    /// decodes without panicking, and a message it decodes to encodes to a frame that decodes to the
    /// same message.
    #[doc(hidden)]
    pub fn check_decode(body: &[u8]) {
        let Ok(message) = Message::decode(body) else {
            return;
        };
        let frame = message.encode();
        let length = Message::frame_length(frame[..4].try_into().expect("a length field"))
            .expect("an encoded frame has a valid length");
        assert_eq!(length, frame.len() - 4);
        let again = Message::decode(&frame[4..]).expect("an encoded frame decodes");
        assert_eq!(
            again, message,
            "the message changed through encode and decode"
        );
    }

    /// Decodes a frame body: everything after the length field (version, kind, payload).
    pub fn decode(body: &[u8]) -> Result<Message, DecodeError> {
        if body.len() < 4 || body.len() > FRAME_BYTES_MAX - 4 {
            return Err(DecodeError::Length(body.len() as u32));
        }
        let version = u16::from_le_bytes([body[0], body[1]]);
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::Version { found: version });
        }
        let kind = u16::from_le_bytes([body[2], body[3]]);
        let payload = &body[4..];
        let Some(name) = kind_name(kind) else {
            return Err(DecodeError::Kind(kind));
        };
        let mut r = Reader {
            bytes: payload,
            at: 0,
            kind: name,
        };
        let message = match kind {
            KIND_HELLO => Message::Hello { client: r.str()? },
            KIND_WELCOME => {
                let session = r.u64()?;
                let backend = match r.u8()? {
                    0 => Backend::Cpu,
                    1 => Backend::Cuda,
                    other => return r.fail(format!("unknown backend {other}")),
                };
                Message::Welcome {
                    session,
                    backend,
                    daemon_version: r.str()?,
                }
            }
            KIND_OPEN_STREAM => {
                let dataset = r.str()?;
                let count = r.count("fields", STREAM_FIELDS_MAX)?;
                let mut fields = Vec::with_capacity(count);
                for _ in 0..count {
                    let name = r.str()?;
                    let dtype = match r.u8()? {
                        0 => None,
                        code => Some(DType::from_code(code).or_else(|e| r.fail(e.to_string()))?),
                    };
                    fields.push(FieldRequest { name, dtype });
                }
                let batch_size = r.u32()?;
                let seed = r.u64()?;
                let epoch = r.u64()?;
                let mode = r.u8()?;
                let window = r.u32()?;
                let shuffle = match (mode, window) {
                    (0, 0) => Shuffle::None,
                    // A window of zero shards decodes: the stream spec's rules refuse it
                    // (`BadRequest`), like every other well-formed request that is invalid.
                    (1, shards) => Shuffle::Window(shards),
                    (2, 0) => Shuffle::Full,
                    (0 | 2, _) => {
                        return r.fail("a window size is given for a shuffle mode without windows")
                    }
                    (other, _) => return r.fail(format!("unknown shuffle mode {other}")),
                };
                let rank = r.u32()?;
                let world_size = r.u32()?;
                let tail = match r.u8()? {
                    0 => Tail::Drop,
                    1 => Tail::Pad,
                    other => return r.fail(format!("unknown tail policy {other}")),
                };
                let start_cursor = r.u64()?;
                let prefetch = r.u32()?;
                let on_corrupt = match r.u8()? {
                    0 => CorruptPolicy::Fail,
                    1 => CorruptPolicy::Replace,
                    other => return r.fail(format!("unknown corrupt policy {other}")),
                };
                let device = match r.u32()? {
                    u32::MAX => Device::Cpu,
                    ordinal => Device::Cuda(ordinal),
                };
                let extra = decode_open_stream_tail(&mut r, device)?;
                Message::OpenStream(StreamSpec {
                    dataset,
                    fields,
                    batch_size,
                    seed,
                    epoch,
                    shuffle,
                    rank,
                    world_size,
                    tail,
                    start_cursor,
                    prefetch,
                    on_corrupt,
                    device,
                    device_uuid: extra.device_uuid,
                    sources: extra.sources,
                    mixture_epoch_samples: extra.mixture_epoch_samples,
                    variable: extra.variable,
                })
            }
            KIND_STREAM_OPENED => {
                let slot_count = r.u32()?;
                let slot_bytes = r.u64()?;
                let slot_stride = r.u64()?;
                let epoch_samples = r.u64()?;
                let steps = r.u64()?;
                let count = r.count("fields", STREAM_FIELDS_MAX)?;
                let mut fields = Vec::with_capacity(count);
                for _ in 0..count {
                    fields.push(FieldLayout {
                        name: r.str()?,
                        dtype: r.dtype()?,
                        sample_shape: r.shape()?,
                        offset: r.u64()?,
                        batch_bytes: r.u64()?,
                    });
                }
                let device = match r.u32()? {
                    u32::MAX => Device::Cpu,
                    ordinal => Device::Cuda(ordinal),
                };
                let mut slot_events = Vec::new();
                if let Device::Cuda(_) = device {
                    if slot_count > SLOTS_MAX {
                        return r.fail(format!("slot_count {slot_count} exceeds {SLOTS_MAX}"));
                    }
                    for _ in 0..slot_count {
                        let ready = r
                            .take(IPC_EVENT_HANDLE_BYTES)?
                            .try_into()
                            .expect("64 bytes");
                        let released = r
                            .take(IPC_EVENT_HANDLE_BYTES)?
                            .try_into()
                            .expect("64 bytes");
                        slot_events.push(SlotEvents { ready, released });
                    }
                }
                let mut variable = Vec::new();
                while r.at < r.bytes.len() {
                    let (tag, mut record) = r.extension()?;
                    match tag {
                        STREAM_OPENED_EXTENSION_VARIABLE if variable.is_empty() => {
                            let count =
                                record.count("variable-length fields", STREAM_FIELDS_MAX)?;
                            for _ in 0..count {
                                let values = record.u16()?;
                                let index = record.u16()?;
                                let form = record.form()?;
                                if usize::from(values.max(index)) >= fields.len() || values == index
                                {
                                    return record.fail(format!(
                                        "variable-length layout names fields {values} and {index} of {}",
                                        fields.len()
                                    ));
                                }
                                variable.push(VariableLayout {
                                    values,
                                    index,
                                    form,
                                });
                            }
                            record.finish(())?;
                            if variable.is_empty() {
                                return r.fail("an empty record of variable-length fields");
                            }
                        }
                        STREAM_OPENED_EXTENSION_VARIABLE => {
                            return r.fail("the record of variable-length fields is repeated")
                        }
                        other => return r.fail(format!("unknown extension record {other}")),
                    }
                }
                Message::StreamOpened(StreamLayout {
                    slot_count,
                    slot_bytes,
                    slot_stride,
                    epoch_samples,
                    steps,
                    fields,
                    device,
                    slot_events,
                    variable,
                })
            }
            KIND_END_OF_EPOCH => Message::EndOfEpoch {
                epoch: r.u64()?,
                steps: r.u64()?,
            },
            KIND_ERROR => Message::Error {
                code: ErrorCode::from_code(r.u16()?),
                message: r.str()?,
            },
            KIND_CLOSE => Message::Close,
            KIND_STATUS_REQUEST => Message::StatusRequest,
            KIND_STATUS => Message::Status(DaemonStatus {
                sessions: r.u32()?,
                streams: r.u32()?,
                slots_allocated: r.u64()?,
                slot_bytes_allocated: r.u64()?,
                batches_served: r.u64()?,
                samples_replaced: r.u64()?,
            }),
            _ => unreachable!("kind checked above"),
        };
        r.finish(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `OpenStream` on a CUDA device, with the device's UUID when `uuid` is given.
    fn cuda_request(uuid: Option<DeviceUuid>) -> StreamSpec {
        let mut spec = StreamSpec::new("tokens", 32);
        spec.device = Device::Cuda(0);
        spec.device_uuid = uuid;
        spec
    }

    /// A mixture of two datasets on `device`, with an epoch length.
    fn mixture_request(device: Device, uuid: Option<DeviceUuid>) -> StreamSpec {
        let mut spec = StreamSpec::mixture(
            vec![
                MixtureSource {
                    dataset: "web".into(),
                    weight: 0.7,
                },
                MixtureSource {
                    dataset: "code".into(),
                    weight: 0.3,
                },
            ],
            32,
        );
        spec.device = device;
        spec.device_uuid = uuid;
        spec.mixture_epoch_samples = Some(10_000);
        spec
    }

    /// Batch forms of two variable-length fields, one capped.
    fn variable_requests() -> Vec<VariableRequest> {
        vec![
            VariableRequest {
                name: "tokens".into(),
                form: BatchForm::Packed,
                cap: Some(512),
            },
            VariableRequest {
                name: "mask".into(),
                form: BatchForm::Padded,
                cap: None,
            },
        ]
    }

    /// Batch forms travel as the record of tag 2 after the device's UUID (or its place) and after
    /// the mixture's record of tag 1 when there is one: each record is tag, length and payload, so
    /// the frame is the request without them followed by exactly those bytes.
    #[test]
    fn batch_forms_travel_as_the_second_extension_record() {
        let record: Vec<u8> = [
            &2u16.to_le_bytes()[..],
            &(2 + (2 + 6 + 1 + 4) + (2 + 4 + 1 + 4) as u32).to_le_bytes(),
            &2u16.to_le_bytes(),
            &6u16.to_le_bytes(),
            b"tokens",
            &[2],
            &512u32.to_le_bytes(),
            &4u16.to_le_bytes(),
            b"mask",
            &[1],
            &0u32.to_le_bytes(),
        ]
        .concat();
        for (device, uuid) in [
            (Device::Cpu, None),
            (Device::Cuda(1), None),
            (Device::Cuda(1), Some(UUID)),
        ] {
            for mixture in [false, true] {
                let mut spec = if mixture {
                    mixture_request(device, uuid)
                } else {
                    let mut spec = StreamSpec::new("docs", 8);
                    spec.device = device;
                    spec.device_uuid = uuid;
                    spec
                };
                let mut without = Message::OpenStream(spec.clone()).encode();
                spec.variable = variable_requests();
                let with = Message::OpenStream(spec.clone()).encode();
                assert_eq!(with.len(), crate::spec::open_stream_frame_bytes(&spec));
                // Without a mixture or a UUID, a CUDA request gains the UUID's place too.
                if device != Device::Cpu && uuid.is_none() && !mixture {
                    without.extend_from_slice(&[0; DEVICE_UUID_BYTES]);
                }
                assert_eq!(with[4..without.len()], without[4..], "{spec:?}");
                assert_eq!(with[without.len()..], record[..], "{spec:?}");
                assert_eq!(Message::decode(&with[4..]), Ok(Message::OpenStream(spec)));
            }
        }
    }

    /// The records of one `OpenStream` come in any order, each at most once; an empty record of
    /// batch forms (which the encoder never writes: it would not survive a round trip), a repeated
    /// or an unknown one is malformed.
    #[test]
    fn extension_records_are_checked_one_by_one() {
        let mut spec = mixture_request(Device::Cpu, None);
        spec.variable = variable_requests();
        let frame = Message::OpenStream(spec.clone()).encode();
        let mixture = mixture_extension_bytes(&spec.sources);
        let variable = variable_extension_bytes(&spec.variable);
        let fixed = frame.len() - mixture - variable;
        let body = |records: &[&[u8]]| {
            let mut body = frame[4..fixed].to_vec();
            for record in records {
                body.extend_from_slice(record);
            }
            body
        };
        let mixture_record = &frame[fixed..fixed + mixture];
        let variable_record = &frame[fixed + mixture..];
        assert_eq!(
            Message::decode(&body(&[variable_record, mixture_record])),
            Ok(Message::OpenStream(spec))
        );
        let empty: Vec<u8> = [&2u16.to_le_bytes()[..], &2u32.to_le_bytes(), &[0, 0]].concat();
        let unknown: Vec<u8> = [&3u16.to_le_bytes()[..], &0u32.to_le_bytes()].concat();
        let mut long = variable_record.to_vec();
        long.push(0);
        long[2..6].copy_from_slice(&(variable - 6 + 1).to_le_bytes()[..4]);
        for (records, expected) in [
            (vec![&empty[..]], "empty record"),
            (vec![variable_record, variable_record], "repeated"),
            (vec![mixture_record, mixture_record], "given twice"),
            (vec![mixture_record, &unknown[..]], "unknown extension 3"),
            (vec![&long[..]], "trailing"),
            (vec![&variable_record[..variable - 1]], "more bytes"),
        ] {
            let error = Message::decode(&body(&records)).expect_err(expected);
            assert!(error.to_string().contains(expected), "{error}");
        }
    }

    /// A request without a mixture is the earlier layout byte for byte (older daemons read it), and
    /// a mixture is an extension after the device (and its UUID, or 16 zero bytes in its place).
    #[test]
    fn a_mixture_travels_as_an_extension_after_the_device() {
        let single = Message::OpenStream(StreamSpec::new("web", 32)).encode();
        let host = mixture_request(Device::Cpu, None);
        let frame = Message::OpenStream(host.clone()).encode();
        assert_eq!(frame.len(), crate::spec::open_stream_frame_bytes(&host));
        let cuda = mixture_request(Device::Cuda(0), None);
        let with_place = Message::OpenStream(cuda.clone()).encode();
        assert_eq!(with_place.len(), frame.len() + DEVICE_UUID_BYTES);
        assert_eq!(
            with_place.len(),
            crate::spec::open_stream_frame_bytes(&cuda)
        );
        let Message::OpenStream(decoded) = Message::decode(&with_place[4..]).unwrap() else {
            panic!("not an OpenStream");
        };
        assert_eq!(decoded.device_uuid, None);
        assert_eq!(decoded.sources, cuda.sources);
        // Tag and length, the source count, each source's name and weight, the epoch length; and
        // no dataset name.
        let extension = 2 + 4 + 2 + (2 + 3 + 8) + (2 + 4 + 8) + 8;
        assert_eq!(frame.len(), single.len() - "web".len() + extension);
    }

    const UUID: DeviceUuid = DeviceUuid([
        0x5e, 0x1f, 0x0a, 0x42, 0x9b, 0x3c, 0x11, 0xee, 0x80, 0x01, 0xa0, 0x36, 0x9f, 0x12, 0x34,
        0x56,
    ]);

    #[test]
    fn a_device_uuid_travels_as_16_bytes_after_the_device() {
        let without = Message::OpenStream(cuda_request(None)).encode();
        let with = Message::OpenStream(cuda_request(Some(UUID))).encode();
        assert_eq!(with.len(), without.len() + DEVICE_UUID_BYTES);
        // Everything before the UUID is the earlier layout, the frame's length field aside.
        assert_eq!(with[4..without.len()], without[4..]);
        assert_eq!(with[without.len()..], UUID.0);
        assert_eq!(
            u32::from_le_bytes(with[..4].try_into().unwrap()) as usize,
            with.len() - 4
        );
        for frame in [&with, &without] {
            let Message::OpenStream(decoded) = Message::decode(&frame[4..]).unwrap() else {
                panic!("not an OpenStream");
            };
            assert_eq!(decoded.device_uuid, (frame == &with).then_some(UUID));
        }
        assert_eq!(
            crate::spec::open_stream_frame_bytes(&cuda_request(Some(UUID))),
            with.len()
        );
    }

    #[test]
    fn a_device_uuid_is_refused_for_host_memory_and_when_cut_short() {
        let mut host = cuda_request(Some(UUID));
        host.device = Device::Cpu;
        let frame = Message::OpenStream(host.clone()).encode();
        let error = Message::decode(&frame[4..]).unwrap_err().to_string();
        assert!(error.contains("host-memory stream"), "{error}");
        assert!(host.validate().unwrap_err().to_string().contains("UUID"));

        let whole = Message::OpenStream(cuda_request(Some(UUID))).encode();
        for cut in [1, 8, 15] {
            let mut short = whole[..whole.len() - cut].to_vec();
            let length = (short.len() - 4) as u32;
            short[..4].copy_from_slice(&length.to_le_bytes());
            assert!(Message::decode(&short[4..]).is_err(), "cut {cut}");
        }
        let mut long = whole.clone();
        long.push(0);
        let length = (long.len() - 4) as u32;
        long[..4].copy_from_slice(&length.to_le_bytes());
        let error = Message::decode(&long[4..]).unwrap_err().to_string();
        assert!(error.contains("trailing"), "{error}");
    }

    #[test]
    fn a_device_uuid_prints_and_parses_as_nvidia_smi_shows_it() {
        let text = UUID.to_string();
        assert_eq!(text, "GPU-5e1f0a42-9b3c-11ee-8001-a0369f123456");
        assert_eq!(text.parse::<DeviceUuid>().unwrap(), UUID);
        assert_eq!(
            "5E1F0A429B3C11EE8001A0369F123456"
                .parse::<DeviceUuid>()
                .unwrap(),
            UUID
        );
        assert!("GPU-5e1f".parse::<DeviceUuid>().is_err());
        assert!("GPU-5e1f0a42-9b3c-11ee-8001-a0369f1234zz"
            .parse::<DeviceUuid>()
            .is_err());
    }

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello {
                client: "trainer".into(),
            },
            Message::Welcome {
                session: 7,
                backend: Backend::Cpu,
                daemon_version: "0.1.0".into(),
            },
            Message::OpenStream(StreamSpec {
                dataset: "tokens".into(),
                fields: vec![
                    FieldRequest {
                        name: "emb".into(),
                        dtype: Some(DType::F32),
                    },
                    FieldRequest {
                        name: "ids".into(),
                        dtype: None,
                    },
                ],
                batch_size: 32,
                seed: 1,
                epoch: 2,
                shuffle: Shuffle::Window(4),
                rank: 1,
                world_size: 8,
                tail: Tail::Pad,
                start_cursor: 512,
                prefetch: 4,
                on_corrupt: CorruptPolicy::Replace,
                device: Device::Cuda(0),
                device_uuid: None,
                sources: Vec::new(),
                mixture_epoch_samples: None,
                variable: Vec::new(),
            }),
            Message::OpenStream(cuda_request(Some(UUID))),
            Message::OpenStream(mixture_request(Device::Cpu, None)),
            Message::OpenStream(mixture_request(Device::Cuda(1), None)),
            Message::OpenStream(mixture_request(Device::Cuda(1), Some(UUID))),
            Message::OpenStream({
                let mut spec = crate::protocol::StreamSpec::new("docs", 8);
                spec.variable = variable_requests();
                spec
            }),
            Message::OpenStream({
                let mut spec = cuda_request(Some(UUID));
                spec.variable = vec![VariableRequest {
                    name: "tokens".into(),
                    form: BatchForm::Padded,
                    cap: Some(4),
                }];
                spec
            }),
            // A CUDA stream without a UUID writes its place before the record.
            Message::OpenStream({
                let mut spec = cuda_request(None);
                spec.variable = variable_requests();
                spec
            }),
            // Both records: the mixture's, then the batch forms'.
            Message::OpenStream({
                let mut spec = mixture_request(Device::Cpu, None);
                spec.variable = variable_requests();
                spec
            }),
            Message::OpenStream({
                let mut spec = mixture_request(Device::Cuda(1), None);
                spec.variable = variable_requests();
                spec
            }),
            Message::StreamOpened(StreamLayout {
                slot_count: 4,
                slot_bytes: 1 << 20,
                slot_stride: 1 << 20,
                epoch_samples: 1000,
                steps: 30,
                fields: vec![FieldLayout {
                    name: "emb".into(),
                    dtype: DType::F32,
                    sample_shape: vec![16, 4],
                    offset: 0,
                    batch_bytes: 8192,
                }],
                device: Device::Cpu,
                slot_events: Vec::new(),
                variable: Vec::new(),
            }),
            Message::StreamOpened(StreamLayout {
                slot_count: 4,
                slot_bytes: 1 << 20,
                slot_stride: 1 << 20,
                epoch_samples: 1000,
                steps: 30,
                fields: vec![
                    FieldLayout {
                        name: "tokens".into(),
                        dtype: DType::I32,
                        sample_shape: vec![512],
                        offset: 0,
                        batch_bytes: 8 * 512 * 4,
                    },
                    FieldLayout {
                        name: "tokens.cu_seqlens".into(),
                        dtype: DType::I32,
                        sample_shape: vec![],
                        offset: 16384,
                        batch_bytes: 36,
                    },
                ],
                device: Device::Cpu,
                slot_events: Vec::new(),
                variable: vec![VariableLayout {
                    values: 0,
                    index: 1,
                    form: BatchForm::Packed,
                }],
            }),
            Message::StreamOpened(StreamLayout {
                slot_count: 2,
                slot_bytes: 2 << 20,
                slot_stride: 2 << 20,
                epoch_samples: 10,
                steps: 3,
                fields: vec![FieldLayout {
                    name: "ids".into(),
                    dtype: DType::I32,
                    sample_shape: vec![8],
                    offset: 0,
                    batch_bytes: 128,
                }],
                device: Device::Cuda(1),
                slot_events: (0..2u8)
                    .map(|i| SlotEvents {
                        ready: [i; IPC_EVENT_HANDLE_BYTES],
                        released: [i + 100; IPC_EVENT_HANDLE_BYTES],
                    })
                    .collect(),
                variable: Vec::new(),
            }),
            Message::EndOfEpoch {
                epoch: 2,
                steps: 30,
            },
            Message::Error {
                code: ErrorCode::CorruptData,
                message: "shard x".into(),
            },
            Message::Close,
            Message::StatusRequest,
            Message::Status(DaemonStatus {
                sessions: 2,
                streams: 1,
                slots_allocated: 4,
                slot_bytes_allocated: 1 << 22,
                batches_served: 9,
                samples_replaced: 1,
            }),
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for message in samples() {
            let frame = message.encode();
            let length = Message::frame_length(frame[..4].try_into().unwrap()).unwrap();
            assert_eq!(length, frame.len() - 4);
            assert_eq!(Message::decode(&frame[4..]).unwrap(), message);
        }
    }

    /// A mixture extension naming no sources but an epoch length decoded as a request without
    /// sources and with that length, which encodes without the extension: the fuzzer found the
    /// round trip changing the message. Such an extension is malformed.
    #[test]
    fn a_mixture_extension_without_sources_is_rejected() {
        // The fuzzer's input (fuzz/fuzz_targets/message_decode.rs decodes it whole and after its
        // first 4 bytes).
        let input: [u8; 91] = [
            0x4, 0x0, 0x3, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0,
            0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x41, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0,
            0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x1, 0x0, 0x7e, 0x0, 0x0, 0x0, 0x0, 0x41, 0x0, 0x0, 0x0,
            0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x5, 0xb, 0x0, 0xff, 0xff, 0xff, 0xff, 0xb,
            0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0, 0x1, 0x0, 0xa, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0,
            0x2, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0,
        ];
        for body in [&input[..], &input[4..]] {
            Message::check_decode(body);
        }
        let body = &input[..];
        let error = Message::decode(body).expect_err("a mixture extension with no sources");
        assert!(error.to_string().contains("names no sources"), "{error}");
    }

    /// Every truncation is malformed but those that cut optional trailing parts whole: an
    /// `OpenStream` cut just before an extension record or its device UUID (or the UUID's place), a
    /// `StreamOpened` just before its extension record, is the same message without them.
    #[test]
    fn every_truncation_and_extension_is_rejected() {
        for message in samples() {
            let frame = message.encode();
            // The message with its optional trailing parts dropped, last first, and the length of
            // the body that decodes to it.
            let mut shorter: Vec<(usize, Message)> = Vec::new();
            let body = |message: &Message| message.encode().len() - 4;
            match &message {
                Message::OpenStream(spec) => {
                    let mut spec = spec.clone();
                    let place = spec.device != Device::Cpu
                        && spec.device_uuid.is_none()
                        && (!spec.variable.is_empty() || !spec.sources.is_empty());
                    if !spec.variable.is_empty() {
                        spec.variable.clear();
                        let message = Message::OpenStream(spec.clone());
                        shorter.push((body(&message), message));
                    }
                    if !spec.sources.is_empty() {
                        spec.sources.clear();
                        spec.mixture_epoch_samples = None;
                        let message = Message::OpenStream(spec.clone());
                        shorter.push((body(&message), message));
                    }
                    if place {
                        // Cut after the UUID's place: the 16 zero bytes are no UUID.
                        let message = Message::OpenStream(spec.clone());
                        shorter.push((body(&message) + DEVICE_UUID_BYTES, message));
                    }
                    if spec.device_uuid.is_some() {
                        spec.device_uuid = None;
                        let message = Message::OpenStream(spec);
                        shorter.push((body(&message), message));
                    }
                }
                Message::StreamOpened(layout) if !layout.variable.is_empty() => {
                    let message = Message::StreamOpened(StreamLayout {
                        variable: Vec::new(),
                        ..layout.clone()
                    });
                    shorter.push((body(&message), message));
                }
                _ => {}
            }
            for (length, expected) in &shorter {
                assert_eq!(
                    Message::decode(&frame[4..4 + length]).as_ref(),
                    Ok(expected),
                    "{message:?} cut to {length} bytes"
                );
            }
            for cut in 4..frame.len() - 4 {
                match Message::decode(&frame[4..4 + cut]) {
                    Err(_) => {}
                    Ok(decoded) => {
                        let (_, expected) = shorter
                            .iter()
                            .find(|(length, _)| *length == cut)
                            .unwrap_or_else(|| panic!("a cut at {cut} decodes: {decoded:?}"));
                        assert_eq!(&decoded, expected);
                    }
                }
            }
            let mut longer = frame[4..].to_vec();
            longer.push(0);
            assert!(Message::decode(&longer).is_err());
        }
    }

    #[test]
    fn slot_strides_are_whole_pages_of_at_least_the_slot() {
        assert_eq!(slot_stride(1), 4096);
        assert_eq!(slot_stride(4096), 4096);
        assert_eq!(slot_stride(4097), 8192);
        assert_eq!(slot_stride(u64::MAX) % SLOT_STRIDE_ALIGN_BYTES, 0);
    }

    #[test]
    fn bad_headers_are_rejected() {
        assert!(Message::frame_length(0u32.to_le_bytes()).is_err());
        assert!(Message::frame_length(u32::MAX.to_le_bytes()).is_err());
        assert_eq!(
            Message::decode(&[2, 0, 1, 0]),
            Err(DecodeError::Version { found: 2 })
        );
        // Version 3 passed one descriptor per slot: a peer speaking it is refused by version.
        assert_eq!(
            Message::decode(&[3, 0, 1, 0]),
            Err(DecodeError::Version { found: 3 })
        );
        assert_eq!(Message::decode(&[4, 0, 99, 0]), Err(DecodeError::Kind(99)));
        assert_eq!(Message::decode(&[4, 0, 5, 0]), Err(DecodeError::Kind(5)));
    }

    #[test]
    fn a_version_refusal_is_readable_in_the_peer_version() {
        let frame = Message::version_refusal(2, "speak 3".into());
        assert_eq!(&frame[4..6], &2u16.to_le_bytes());
        let mut as_ours = frame.clone();
        as_ours[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(
            Message::decode(&as_ours[4..]),
            Ok(Message::Error {
                code: ErrorCode::UnsupportedVersion,
                message: "speak 3".into()
            })
        );
    }
}
