//! The consumer API: connect to the daemon, open a stream, iterate over its batches.
//!
//! One connection is one session and carries at most one stream (`docs/PROTOCOL.md`). [`Client`] does
//! the handshake; [`Client::open_stream`] turns it into a [`Stream`], an iterator of [`Batch`]es. A batch
//! is a lease on one slot of shared memory: its fields are read in place, and dropping it hands the slot
//! back to the daemon for refilling. Several batches (up to the stream's slot count) may be held at once.
//!
//! Everything the daemon sends is validated before it is used to address memory: the descriptor count,
//! each descriptor's size, every field's offset and length against the slot size, every slot index, and
//! that the daemon never hands out a slot the client still holds. A violation ends the session with
//! [`ClientError::Protocol`].
//!
//! ```no_run
//! use gpufeed_client::consumer::{Client, ClientError};
//! use gpufeed_client::protocol::StreamSpec;
//!
//! # fn main() -> Result<(), ClientError> {
//! let client = Client::connect("/run/gpufeed/gpufeed.sock")?;
//! let mut spec = StreamSpec::new("tokens", 32);
//! spec.world_size = 8;
//! spec.rank = 3;
//! spec.start_at_step(100); // after world_size and batch_size are final
//! let mut stream = client.open_stream(spec)?;
//! for batch in &mut stream {
//!     let batch = batch?;
//!     let ids = batch.field("ids").expect("the dataset has an ids field");
//!     println!("step {}: {} bytes of {} {:?}", batch.step(), ids.byte_len(), ids.dtype, ids.shape);
//! }
//! let checkpoint = stream.state(); // resume later, at any world size, with StreamSpec::resume
//! # let _ = checkpoint;
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::fs::File;
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use memmap2::{Mmap, MmapOptions};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};

use gpufeed_proto::spec::{StreamState, FIELD_OFFSET_ALIGN_BYTES};

use crate::dtype::DType;
use crate::protocol::{
    Backend, BatchInfo, DaemonStatus, Device, ErrorCode, FieldLayout, Message, StreamLayout,
    StreamSpec, Tail, BATCH_NDIM_MAX, SLOTS_MAX,
};
use crate::transport::{self, TransportError};

// The held-slot set is a 64-bit mask.
const _: () = assert!(SLOTS_MAX <= 64);

/// An error of the consumer API.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon's socket could not be connected.
    #[error("cannot connect to the gpufeed daemon at {}: {source}", path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A frame could not be sent or received, or the daemon closed the connection.
    #[error("{0}")]
    Transport(#[from] TransportError),
    /// The daemon sent an `Error` frame; the session is over.
    #[error("the daemon ended the session with {code:?}: {message}")]
    Daemon {
        /// The stable error code.
        code: ErrorCode,
        /// The daemon's description.
        message: String,
    },
    /// The daemon sent a message that is out of place or describes memory it did not provide (wrong
    /// descriptor count, slot out of range, a field beyond its slot...). The client ends the session.
    #[error("the daemon broke the protocol: {0}")]
    Protocol(String),
    /// The stream spec breaks a protocol bound or asks for something this client cannot do; nothing was
    /// sent.
    #[error("invalid stream spec: {0}")]
    InvalidSpec(String),
    /// Every slot of the stream is held by batches (or arrays exported from them) that this consumer
    /// has not released, so the daemon has nowhere to put the next batch: waiting would never end.
    /// Release a batch (drop it, or copy the data out of exported arrays) and ask again; the
    /// session goes on.
    #[error(
        "all {slots} slots of the stream are held by this consumer: release a batch (or copy the \
         data out of arrays taken from it) before asking for the next one"
    )]
    AllSlotsHeld {
        /// The stream's slot count.
        slots: u32,
    },
    /// An earlier error ended the session; no further requests are possible.
    #[error("the session already ended: {0}")]
    Ended(String),
    /// A local system call failed (inspecting or mapping a slot, duplicating the socket).
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A CUDA driver call failed (mapping a device slot, waiting on or recording its events).
    #[error("CUDA: {0}")]
    Cuda(#[from] crate::cuda::CudaError),
}

/// Receives a frame that must not carry descriptors.
fn recv_plain(socket: &UnixStream) -> Result<Message, ClientError> {
    let (message, fds) = transport::recv(socket)?;
    if !fds.is_empty() {
        return Err(ClientError::Protocol(format!(
            "{} descriptors attached to a {} frame (only StreamOpened carries descriptors)",
            fds.len(),
            message.name()
        )));
    }
    Ok(message)
}

/// An unexpected reply: the daemon's own error if it sent one, else a protocol violation.
fn unexpected(message: Message, waiting_for: &str) -> ClientError {
    match message {
        Message::Error { code, message } => ClientError::Daemon { code, message },
        other => {
            ClientError::Protocol(format!("expected {waiting_for}, received {}", other.name()))
        }
    }
}

/// Checks what the encoder would otherwise panic on, and what the daemon would refuse on the spec
/// alone, before anything is sent.
fn check_spec(spec: &StreamSpec) -> Result<(), ClientError> {
    spec.validate()
        .map_err(|error| ClientError::InvalidSpec(error.to_string()))
}

/// A connected, greeted session that has not opened its stream yet.
#[derive(Debug)]
pub struct Client {
    socket: UnixStream,
    session: u64,
    backend: Backend,
    daemon_version: String,
}

impl Client {
    /// Connects to the daemon's socket and greets it.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref();
        let socket = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        Client::from_socket(socket)
    }

    /// Greets the daemon over an already connected socket: sends `Hello`, expects `Welcome`.
    pub fn from_socket(socket: UnixStream) -> Result<Client, ClientError> {
        let hello = Message::Hello {
            client: format!(
                "gpufeed-client/{} pid {}",
                env!("CARGO_PKG_VERSION"),
                std::process::id()
            ),
        };
        if let Err(error) = transport::send(&socket, &hello, &[]) {
            // The daemon checks the peer's uid and its session bound as soon as it accepts, and may
            // have sent its refusal and closed before the Hello went out: report the refusal.
            return match recv_plain(&socket) {
                Ok(Message::Error { code, message }) => Err(ClientError::Daemon { code, message }),
                _ => Err(error.into()),
            };
        }
        match recv_plain(&socket)? {
            Message::Welcome {
                session,
                backend,
                daemon_version,
            } => Ok(Client {
                socket,
                session,
                backend,
                daemon_version,
            }),
            other => Err(unexpected(other, "Welcome")),
        }
    }

    /// The session id the daemon assigned (it appears in the daemon's logs and status).
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Where the daemon keeps batches.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The daemon's version string.
    pub fn daemon_version(&self) -> &str {
        &self.daemon_version
    }

    /// Asks the daemon for its counters.
    pub fn status(&mut self) -> Result<DaemonStatus, ClientError> {
        transport::send(&self.socket, &Message::StatusRequest, &[])?;
        match recv_plain(&self.socket)? {
            Message::Status(status) => Ok(status),
            other => Err(unexpected(other, "Status")),
        }
    }

    /// Opens the session's one stream and maps its slots. The daemon starts filling slots at once.
    ///
    /// The spec is checked locally first ([`ClientError::InvalidSpec`]); the daemon checks the rest
    /// (dataset and field names, dtype conversions, resource bounds) and answers with an error code.
    pub fn open_stream(self, spec: StreamSpec) -> Result<Stream, ClientError> {
        check_spec(&spec)?;
        transport::send(&self.socket, &Message::OpenStream(spec.clone()), &[])?;
        let (message, fds) = transport::recv(&self.socket)?;
        let layout = match message {
            Message::StreamOpened(layout) => layout,
            other => {
                if !fds.is_empty() {
                    return Err(ClientError::Protocol(format!(
                        "{} descriptors attached to a {} frame",
                        fds.len(),
                        other.name()
                    )));
                }
                return Err(unexpected(other, "StreamOpened"));
            }
        };
        check_layout(&spec, &layout, fds.len())?;
        let slots = match layout.device {
            Device::Cpu => Slots::Host(map_slots(&layout, fds)?),
            Device::Cuda(ordinal) => Slots::Device(crate::cuda::DeviceSlots::import(
                ordinal,
                layout.slot_bytes as usize,
                fds,
                &layout.slot_events,
            )?),
        };
        let outbox = Outbox {
            inner: Mutex::new(OutboxInner {
                socket: self.socket.try_clone()?,
                held_slots: 0,
            }),
        };
        Ok(Stream {
            socket: self.socket,
            session: self.session,
            backend: self.backend,
            pending: VecDeque::with_capacity(layout.slot_count as usize),
            last_step: None,
            last_cursor_received: spec.start_cursor,
            batches_received: 0,
            cursor: spec.start_cursor,
            phase: Phase::Streaming,
            spec,
            memory: Arc::new(SlotMemory {
                layout,
                slots,
                cuda_stream: AtomicU64::new(0),
            }),
            outbox: Arc::new(outbox),
        })
    }
}

/// Product of `dims` times `element_bytes`, `None` on overflow.
fn extent_bytes(dims: &[u64], element_bytes: usize) -> Option<u64> {
    dims.iter()
        .try_fold(element_bytes as u64, |acc, &d| acc.checked_mul(d))
}

/// Validates a `StreamOpened` layout against the request before any memory is mapped.
fn check_layout(
    spec: &StreamSpec,
    layout: &StreamLayout,
    descriptors: usize,
) -> Result<(), ClientError> {
    let violation = |reason: String| Err(ClientError::Protocol(reason));
    if layout.slot_count == 0 || layout.slot_count > SLOTS_MAX {
        return violation(format!(
            "slot_count {} outside 1..={SLOTS_MAX}",
            layout.slot_count
        ));
    }
    if descriptors != layout.slot_count as usize {
        return violation(format!(
            "StreamOpened announced {} slots but carried {descriptors} descriptors",
            layout.slot_count
        ));
    }
    if layout.slot_bytes == 0 || usize::try_from(layout.slot_bytes).is_err() {
        return violation(format!("slot_bytes {} cannot be mapped", layout.slot_bytes));
    }
    let step_samples = u64::from(spec.world_size) * u64::from(spec.batch_size);
    let samples_left = layout.epoch_samples.saturating_sub(spec.start_cursor);
    let expected_steps = match spec.tail {
        Tail::Drop => samples_left / step_samples,
        Tail::Pad => samples_left.div_ceil(step_samples),
    };
    if layout.steps != expected_steps {
        return violation(format!(
            "{} steps announced, but {} samples from cursor {} in steps of {step_samples} with tail {:?} make {expected_steps}",
            layout.steps, layout.epoch_samples, spec.start_cursor, spec.tail
        ));
    }
    if layout.fields.is_empty() {
        return violation("the layout has no fields".to_string());
    }
    if layout.device != spec.device {
        return violation(format!(
            "slots on {:?}, the request asked for {:?}",
            layout.device, spec.device
        ));
    }
    let events_expected = match layout.device {
        Device::Cpu => 0,
        Device::Cuda(_) => layout.slot_count as usize,
    };
    if layout.slot_events.len() != events_expected {
        return violation(format!(
            "{} slot event pairs for {} slots on {:?}",
            layout.slot_events.len(),
            layout.slot_count,
            layout.device
        ));
    }
    if !spec.fields.is_empty() && spec.fields.len() != layout.fields.len() {
        return violation(format!(
            "{} fields requested, {} in the layout",
            spec.fields.len(),
            layout.fields.len()
        ));
    }
    let mut extents = Vec::with_capacity(layout.fields.len());
    for (index, field) in layout.fields.iter().enumerate() {
        if let Some(request) = spec.fields.get(index) {
            if request.name != field.name {
                return violation(format!(
                    "layout field {index} is {:?}, the request's is {:?}",
                    field.name, request.name
                ));
            }
            if request.dtype.is_some_and(|dtype| dtype != field.dtype) {
                return violation(format!(
                    "field {:?} is served as {}, {} was requested",
                    field.name,
                    field.dtype,
                    request.dtype.map_or("", DType::name)
                ));
            }
        }
        if layout.fields[..index].iter().any(|f| f.name == field.name) {
            return violation(format!("field {:?} appears twice", field.name));
        }
        check_field_layout(spec, layout, field)?;
        extents.push((field.offset, field.offset + field.batch_bytes));
    }
    extents.sort_unstable();
    if extents.windows(2).any(|pair| pair[0].1 > pair[1].0) {
        return violation("fields overlap within the slot".to_string());
    }
    Ok(())
}

fn check_field_layout(
    spec: &StreamSpec,
    layout: &StreamLayout,
    field: &FieldLayout,
) -> Result<(), ClientError> {
    let violation = |reason: String| Err(ClientError::Protocol(reason));
    if field.sample_shape.len() >= BATCH_NDIM_MAX {
        return violation(format!(
            "field {:?} has {} sample dimensions; a batch has at most {BATCH_NDIM_MAX} with the batch dimension",
            field.name,
            field.sample_shape.len()
        ));
    }
    if field.offset % FIELD_OFFSET_ALIGN_BYTES != 0 {
        return violation(format!(
            "field {:?} at offset {} is not {FIELD_OFFSET_ALIGN_BYTES}-aligned",
            field.name, field.offset
        ));
    }
    let needed = extent_bytes(&field.sample_shape, field.dtype.size_bytes())
        .and_then(|sample| sample.checked_mul(u64::from(spec.batch_size)));
    if needed.is_none_or(|needed| needed > field.batch_bytes) {
        return violation(format!(
            "field {:?} reserves {} bytes, less than {} samples of {:?} {}",
            field.name, field.batch_bytes, spec.batch_size, field.sample_shape, field.dtype
        ));
    }
    if field
        .offset
        .checked_add(field.batch_bytes)
        .is_none_or(|end| end > layout.slot_bytes)
    {
        return violation(format!(
            "field {:?} at offset {} with {} bytes ends beyond the {}-byte slot",
            field.name, field.offset, field.batch_bytes, layout.slot_bytes
        ));
    }
    Ok(())
}

/// Maps every slot read-only after checking that its descriptor is a file of at least `slot_bytes`.
fn map_slots(layout: &StreamLayout, fds: Vec<OwnedFd>) -> Result<Vec<Mmap>, ClientError> {
    let slot_bytes = layout.slot_bytes as usize;
    let mut slots = Vec::with_capacity(fds.len());
    for (slot, fd) in fds.into_iter().enumerate() {
        let file = File::from(fd);
        let metadata = file.metadata()?;
        if !metadata.file_type().is_file() {
            return Err(ClientError::Protocol(format!(
                "the descriptor of slot {slot} is not a memory file"
            )));
        }
        if metadata.len() < layout.slot_bytes {
            return Err(ClientError::Protocol(format!(
                "slot {slot} is {} bytes, the layout says {}",
                metadata.len(),
                layout.slot_bytes
            )));
        }
        // A file that shrinks under a mapping turns reads past its new end into SIGBUS; the seal
        // makes the size check above hold for the mapping's lifetime.
        let seals = fcntl(&file, FcntlArg::F_GET_SEALS).map_err(std::io::Error::from)?;
        if !SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
            return Err(ClientError::Protocol(format!(
                "slot {slot} is not sealed against shrinking (F_SEAL_SHRINK)"
            )));
        }
        // SAFETY: the mapping is shared with the daemon, which writes the slot while the daemon owns
        // it. The lease rule (docs/PROTOCOL.md, "Slots and leases") guarantees that the daemon never
        // writes a slot while a `Batch` for it exists, and slices of the mapping are only handed out
        // through a `Batch`. The file is at least `slot_bytes` long and sealed against shrinking, so
        // every page of the mapping stays backed.
        let map = unsafe { MmapOptions::new().len(slot_bytes).map(&file) }.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("mapping slot {slot} ({slot_bytes} bytes): {e}"),
            )
        })?;
        slots.push(map);
    }
    Ok(slots)
}

/// The mapped slots of a stream; shared by the stream and its batches so that a batch stays readable
/// after the stream is dropped.
#[derive(Debug)]
struct SlotMemory {
    layout: StreamLayout,
    slots: Slots,
    /// The consumer's CUDA stream (a `CUstream`; 0 is the legacy default stream): batches are made
    /// ready on it and released from it.
    cuda_stream: AtomicU64,
}

#[derive(Debug)]
enum Slots {
    Host(Vec<Mmap>),
    Device(crate::cuda::DeviceSlots),
}

impl SlotMemory {
    fn cuda_stream(&self) -> crate::cuda::RawStream {
        self.cuda_stream.load(Ordering::SeqCst) as usize as crate::cuda::RawStream
    }
}

/// The write half of the session, shared by the stream and its batches.
#[derive(Debug)]
struct Outbox {
    inner: Mutex<OutboxInner>,
}

#[derive(Debug)]
struct OutboxInner {
    socket: UnixStream,
    /// Bit `s` is set while slot `s` belongs to the client: from the `Batch` frame's arrival until the
    /// `Batch` is dropped.
    held_slots: u64,
}

impl Outbox {
    fn lock(&self) -> MutexGuard<'_, OutboxInner> {
        // A panic while holding the lock cannot leave the mask or the socket half-updated in a way
        // that matters more than the panic itself; keep going.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn send(&self, message: &Message) -> Result<(), TransportError> {
        transport::send(&self.lock().socket, message, &[])
    }

    /// Marks `slot` as the client's; false if it already was.
    fn take_slot(&self, slot: u32) -> bool {
        let mut inner = self.lock();
        let bit = 1u64 << slot;
        let free = inner.held_slots & bit == 0;
        inner.held_slots |= bit;
        free
    }

    /// Hands `slot` back. A send error is ignored: the daemon reclaims every slot when the
    /// connection ends.
    fn release(&self, slot: u32) {
        let mut inner = self.lock();
        inner.held_slots &= !(1u64 << slot);
        let _ = transport::send(&inner.socket, &Message::Release { slot }, &[]);
    }
}

impl Drop for Outbox {
    /// The stream and all its batches are gone: end the session.
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        let _ = transport::send(&inner.socket, &Message::Close, &[]);
    }
}

#[derive(Debug)]
enum Phase {
    /// Batches may still arrive.
    Streaming,
    /// `EndOfEpoch` arrived; queued batches may remain.
    Finished,
    /// An error ended the session. `reported` is false until the iterator has yielded it once.
    Failed { reason: String, reported: bool },
}

/// What the stream read from the socket.
enum Event {
    Batch(BatchInfo),
    EndOfEpoch,
    Status(DaemonStatus),
}

/// An open stream: an iterator over the epoch's batches for this rank, in step order.
///
/// `next()` blocks until the daemon sends a batch. The daemon fills at most `slot_count` slots ahead;
/// holding that many batches and calling `next()` waits forever unless the epoch ends, so drop (or
/// finish with) batches as you go. The session ends (`Close`) once the stream and every batch from it
/// are dropped.
#[derive(Debug)]
pub struct Stream {
    /// Read half; only the stream reads.
    socket: UnixStream,
    session: u64,
    backend: Backend,
    spec: StreamSpec,
    memory: Arc<SlotMemory>,
    outbox: Arc<Outbox>,
    /// Batches received but not yet yielded (a status request may read past them). Each holds a
    /// distinct slot, so there are at most `slot_count`.
    pending: VecDeque<BatchInfo>,
    last_step: Option<u64>,
    last_cursor_received: u64,
    batches_received: u64,
    /// `cursor_after` of the last batch yielded.
    cursor: u64,
    phase: Phase,
}

impl Stream {
    /// The slot layout the daemon chose.
    pub fn layout(&self) -> &StreamLayout {
        &self.memory.layout
    }

    /// The spec the stream was opened with.
    pub fn spec(&self) -> &StreamSpec {
        &self.spec
    }

    /// The session id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Where the daemon keeps batches.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Makes `stream` (a `CUstream` of the context of the stream's device; null, the default, is the
    /// legacy default stream) the stream batches are delivered on: each batch handed out from now on
    /// is ready for work queued on `stream` after `next()` returns, without the host waiting, and
    /// dropping a batch releases its slot once the work queued on `stream` before the drop is done.
    /// Has no effect on host-memory streams.
    ///
    /// # Safety
    /// `stream` stays valid while batches of this stream exist, and belongs to the primary context
    /// of the stream's device.
    pub unsafe fn set_cuda_stream(&mut self, stream: *mut std::ffi::c_void) {
        self.memory
            .cuda_stream
            .store(stream as usize as u64, Ordering::SeqCst);
    }

    /// Where the epoch stands for a checkpoint: `cursor` is the `cursor_after` of the last batch
    /// yielded. Store it once every rank has consumed that step.
    pub fn state(&self) -> StreamState {
        StreamState {
            dataset: self.spec.dataset.clone(),
            seed: self.spec.seed,
            epoch: self.spec.epoch,
            shuffle: self.spec.shuffle,
            world_size: self.spec.world_size,
            batch_size: self.spec.batch_size,
            cursor: self.cursor,
        }
    }

    /// Asks the daemon for its counters. Batches that arrive before the reply are queued for the
    /// iterator.
    pub fn status(&mut self) -> Result<DaemonStatus, ClientError> {
        if let Phase::Failed { reason, .. } = &self.phase {
            return Err(ClientError::Ended(reason.clone()));
        }
        if let Err(error) = self.outbox.send(&Message::StatusRequest) {
            return Err(self.fail(error.into(), false));
        }
        loop {
            match self.receive() {
                Ok(Event::Batch(info)) => self.pending.push_back(info),
                Ok(Event::EndOfEpoch) => {}
                Ok(Event::Status(status)) => return Ok(status),
                Err(error) => return Err(self.fail(error, false)),
            }
        }
    }

    /// Reads and validates one frame.
    fn receive(&mut self) -> Result<Event, ClientError> {
        let message = recv_plain(&self.socket)?;
        match message {
            Message::Batch(info) => {
                self.accept_batch(&info)?;
                Ok(Event::Batch(info))
            }
            Message::EndOfEpoch { epoch, steps } => {
                if !matches!(self.phase, Phase::Streaming) {
                    return Err(ClientError::Protocol("a second EndOfEpoch".to_string()));
                }
                if epoch != self.spec.epoch
                    || steps != self.batches_received
                    || steps != self.memory.layout.steps
                {
                    return Err(ClientError::Protocol(format!(
                        "EndOfEpoch for epoch {epoch} after {steps} steps, but the stream serves epoch {} and received {} of {} batches",
                        self.spec.epoch, self.batches_received, self.memory.layout.steps
                    )));
                }
                self.phase = Phase::Finished;
                Ok(Event::EndOfEpoch)
            }
            Message::Status(status) => Ok(Event::Status(status)),
            other => Err(unexpected(other, "Batch, EndOfEpoch or Status")),
        }
    }

    /// Validates a `Batch` frame against the layout and the stream's progress, then records its slot
    /// as held.
    fn accept_batch(&mut self, info: &BatchInfo) -> Result<(), ClientError> {
        let layout = &self.memory.layout;
        let violation = |reason: String| Err(ClientError::Protocol(reason));
        if !matches!(self.phase, Phase::Streaming) {
            return violation(format!("batch for step {} after EndOfEpoch", info.step));
        }
        if info.slot >= layout.slot_count {
            return violation(format!(
                "batch in slot {} of {}",
                info.slot, layout.slot_count
            ));
        }
        if self.batches_received >= layout.steps {
            return violation(format!("more than the {} announced batches", layout.steps));
        }
        if info.epoch != self.spec.epoch {
            return violation(format!(
                "batch of epoch {} in a stream of epoch {}",
                info.epoch, self.spec.epoch
            ));
        }
        if let Some(last) = self.last_step {
            if Some(info.step) != last.checked_add(1) {
                return violation(format!("step {} follows step {last}", info.step));
            }
        }
        if info.cursor_after <= self.last_cursor_received {
            return violation(format!(
                "cursor_after {} does not advance past {}",
                info.cursor_after, self.last_cursor_received
            ));
        }
        if info.samples == 0 || info.samples > self.spec.batch_size {
            return violation(format!(
                "{} samples in a batch of at most {}",
                info.samples, self.spec.batch_size
            ));
        }
        if info.replaced > info.samples {
            return violation(format!(
                "{} of {} samples replaced",
                info.replaced, info.samples
            ));
        }
        if info.fields.len() != layout.fields.len() {
            return violation(format!(
                "batch with {} fields, the layout has {}",
                info.fields.len(),
                layout.fields.len()
            ));
        }
        for (field, expected) in info.fields.iter().zip(&layout.fields) {
            if field.dtype != expected.dtype
                || field.shape.first() != Some(&u64::from(info.samples))
                || field.shape[1..] != expected.sample_shape[..]
            {
                return violation(format!(
                    "field {:?} arrived as {:?} {}, expected [{}] + {:?} {}",
                    expected.name,
                    field.shape,
                    field.dtype,
                    info.samples,
                    expected.sample_shape,
                    expected.dtype
                ));
            }
            let bytes = extent_bytes(&field.shape, field.dtype.size_bytes());
            if bytes.is_none_or(|bytes| bytes > expected.batch_bytes)
                || bytes
                    .and_then(|bytes| field.offset.checked_add(bytes))
                    .is_none_or(|end| end > layout.slot_bytes)
            {
                return violation(format!(
                    "field {:?} at offset {} with shape {:?} does not fit its {} reserved bytes in the {}-byte slot",
                    expected.name, field.offset, field.shape, expected.batch_bytes, layout.slot_bytes
                ));
            }
        }
        if !self.outbox.take_slot(info.slot) {
            return violation(format!(
                "slot {} handed out again while the client holds it",
                info.slot
            ));
        }
        self.last_step = Some(info.step);
        self.last_cursor_received = info.cursor_after;
        self.batches_received += 1;
        Ok(())
    }

    /// Ends the session after `error`: drops queued batches, shuts the socket down so the daemon
    /// reclaims the slots, and refuses further work.
    fn fail(&mut self, error: ClientError, reported: bool) -> ClientError {
        self.pending.clear();
        let _ = self.socket.shutdown(Shutdown::Both);
        self.phase = Phase::Failed {
            reason: error.to_string(),
            reported,
        };
        error
    }

    fn hand_out(&mut self, info: BatchInfo) -> Result<Batch, ClientError> {
        self.cursor = info.cursor_after;
        let batch = Batch {
            info,
            memory: Arc::clone(&self.memory),
            outbox: Arc::clone(&self.outbox),
            release_stream: None,
        };
        if let Slots::Device(slots) = &self.memory.slots {
            slots.wait_ready(batch.info.slot, self.memory.cuda_stream())?;
        }
        Ok(batch)
    }
}

impl Iterator for Stream {
    type Item = Result<Batch, ClientError>;

    /// The next batch in step order; `None` after `EndOfEpoch`, and after an error has been yielded.
    fn next(&mut self) -> Option<Result<Batch, ClientError>> {
        if let Some(info) = self.pending.pop_front() {
            return Some(self.hand_out(info));
        }
        match &mut self.phase {
            Phase::Streaming => {}
            Phase::Finished => return None,
            Phase::Failed { reported: true, .. } => return None,
            Phase::Failed { reason, reported } => {
                *reported = true;
                return Some(Err(ClientError::Ended(reason.clone())));
            }
        }
        let slots = self.memory.layout.slot_count;
        let held = self.outbox.lock().held_slots.count_ones();
        if held >= slots && self.batches_received < self.memory.layout.steps {
            return Some(Err(ClientError::AllSlotsHeld { slots }));
        }
        match self.receive() {
            Ok(Event::Batch(info)) => Some(self.hand_out(info)),
            Ok(Event::EndOfEpoch) => None,
            Ok(Event::Status(_)) => Some(Err(self.fail(
                ClientError::Protocol("Status without a StatusRequest".to_string()),
                true,
            ))),
            Err(error) => Some(Err(self.fail(error, true))),
        }
    }
}

/// A batch: a lease on one filled slot. Its fields are read in place; dropping it releases the slot.
#[derive(Debug)]
pub struct Batch {
    info: BatchInfo,
    memory: Arc<SlotMemory>,
    outbox: Arc<Outbox>,
    /// The CUDA stream whose queued work the release waits for, when not the stream's own (set
    /// by [`Batch::release_after`]).
    release_stream: Option<u64>,
}

/// One field of a batch.
#[derive(Clone, Copy, Debug)]
pub struct FieldView<'a> {
    /// Field name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape, batch dimension first.
    pub shape: &'a [u64],
    /// The batch's elements in C order: `product(shape) × dtype size` bytes, in host or device memory.
    pub data: FieldData<'a>,
    slot: u32,
    memory: &'a SlotMemory,
}

/// Where a field's bytes are.
#[derive(Clone, Copy, Debug)]
pub enum FieldData<'a> {
    /// In host memory (the CPU backend).
    Host(&'a [u8]),
    /// In device memory (the CUDA backend): `bytes` bytes at device address `ptr`, ready for work
    /// queued on the stream's CUDA stream (see [`Stream::set_cuda_stream`]).
    Device {
        /// The device address (a `CUdeviceptr`).
        ptr: u64,
        /// Length in bytes.
        bytes: usize,
    },
}

impl FieldView<'_> {
    /// The bytes, when the field is in host memory.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match self.data {
            FieldData::Host(bytes) => Some(bytes),
            FieldData::Device { .. } => None,
        }
    }

    /// The device address, when the field is in device memory.
    pub fn device_ptr(&self) -> Option<u64> {
        match self.data {
            FieldData::Host(_) => None,
            FieldData::Device { ptr, .. } => Some(ptr),
        }
    }

    /// Length of the data in bytes.
    pub fn byte_len(&self) -> usize {
        match self.data {
            FieldData::Host(bytes) => bytes.len(),
            FieldData::Device { bytes, .. } => bytes,
        }
    }

    /// Appends the field's bytes to `out`: a copy from host memory, or, from device memory, a
    /// synchronous copy once the daemon's fill is done (for checks and tools, not the training path).
    pub fn copy_to_host(&self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        match (self.data, &self.memory.slots) {
            (FieldData::Host(bytes), _) => out.extend_from_slice(bytes),
            (FieldData::Device { ptr, bytes }, Slots::Device(slots)) => {
                let start = out.len();
                out.resize(start + bytes, 0);
                slots.copy_to_host(self.slot, ptr, &mut out[start..])?;
            }
            (FieldData::Device { .. }, Slots::Host(_)) => {
                unreachable!("device views come from device slots")
            }
        }
        Ok(())
    }
}

impl Batch {
    /// Makes `stream` (a `CUstream` of the stream device's primary context; null is the legacy
    /// default stream) wait, on the device, for the daemon's fill of this batch: work queued on it
    /// afterwards reads the batch's final bytes, without the host waiting. The stream set with
    /// [`Stream::set_cuda_stream`] already waits; this is for other streams (DLPack consumers name
    /// theirs). No effect on host memory.
    ///
    /// # Safety
    /// `stream` is a live stream of the primary context of the stream's device.
    pub unsafe fn wait_ready_on(&self, stream: *mut std::ffi::c_void) -> Result<(), ClientError> {
        if let Slots::Device(slots) = &self.memory.slots {
            slots.wait_ready(self.info.slot, stream as crate::cuda::RawStream)?;
        }
        Ok(())
    }

    /// Releases the slot, when the batch is dropped, once the work queued on `stream` before the drop
    /// is done, instead of the work on the stream set with [`Stream::set_cuda_stream`]. No effect on
    /// host memory.
    ///
    /// # Safety
    /// `stream` stays live until the batch is dropped, and belongs to the primary context of the
    /// stream's device.
    pub unsafe fn release_after(&mut self, stream: *mut std::ffi::c_void) {
        self.release_stream = Some(stream as usize as u64);
    }

    /// The daemon's description of the batch.
    pub fn info(&self) -> &BatchInfo {
        &self.info
    }

    /// The slot it occupies.
    pub fn slot(&self) -> u32 {
        self.info.slot
    }

    /// Epoch of the batch.
    pub fn epoch(&self) -> u64 {
        self.info.epoch
    }

    /// Step within the epoch.
    pub fn step(&self) -> u64 {
        self.info.step
    }

    /// The epoch cursor once every rank has consumed this step; a checkpoint records it.
    pub fn cursor_after(&self) -> u64 {
        self.info.cursor_after
    }

    /// Samples in the batch.
    pub fn samples(&self) -> u32 {
        self.info.samples
    }

    /// Samples zero-filled because their block was corrupt (policy `Replace`).
    pub fn replaced(&self) -> u32 {
        self.info.replaced
    }

    /// The fields, in slot order.
    pub fn fields(&self) -> impl Iterator<Item = FieldView<'_>> + '_ {
        (0..self.info.fields.len()).map(|index| self.view(index))
    }

    /// The field called `name`.
    pub fn field(&self, name: &str) -> Option<FieldView<'_>> {
        let index = self
            .memory
            .layout
            .fields
            .iter()
            .position(|field| field.name == name)?;
        Some(self.view(index))
    }

    fn view(&self, index: usize) -> FieldView<'_> {
        let field = &self.info.fields[index];
        // Validated in `accept_batch`: the product does not overflow and the range lies in the slot.
        let len = extent_bytes(&field.shape, field.dtype.size_bytes()).expect("validated extent");
        let start = field.offset as usize;
        let data = match &self.memory.slots {
            Slots::Host(slots) => {
                FieldData::Host(&slots[self.info.slot as usize][start..start + len as usize])
            }
            Slots::Device(slots) => FieldData::Device {
                ptr: slots.ptr(self.info.slot) + start as u64,
                bytes: len as usize,
            },
        };
        FieldView {
            name: &self.memory.layout.fields[index].name,
            dtype: field.dtype,
            shape: &field.shape,
            data,
            slot: self.info.slot,
            memory: &self.memory,
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Slots::Device(slots) = &self.memory.slots {
            let stream = self.release_stream.map_or_else(
                || self.memory.cuda_stream(),
                |s| s as usize as crate::cuda::RawStream,
            );
            if slots.release(self.info.slot, stream).is_err() {
                // Neither recording the release event nor waiting for the stream worked: the
                // consumer's work may still read the slot, so it is not handed back; ending the
                // session makes the daemon reclaim the whole ring instead.
                let _ = self.outbox.lock().socket.shutdown(Shutdown::Both);
                return;
            }
        }
        self.outbox.release(self.info.slot);
    }
}

#[cfg(test)]
mod tests {
    //! The client against a scripted fake daemon on the other end of a socket pair.

    use super::*;
    use crate::protocol::{
        BatchField, CorruptPolicy, FieldRequest, Shuffle, FRAME_BYTES_MAX, FRAME_HEADER_BYTES,
        STREAM_FIELDS_MAX, STRING_BYTES_MAX,
    };
    use gpufeed_proto::spec::{OPEN_STREAM_FIXED_BYTES, PREFETCH_DEFAULT};
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// A safety net against a hung test, not a synchronisation mechanism.
    const TEST_TIMEOUT: Duration = Duration::from_secs(30);
    const SLOT_BYTES: u64 = 8192;
    const BATCH_SIZE: u32 = 2;

    struct Fake {
        socket: UnixStream,
    }

    impl Fake {
        fn send(&self, message: Message) {
            transport::send(&self.socket, &message, &[]).unwrap();
        }

        fn send_with(&self, message: Message, files: &[File]) {
            let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
            transport::send(&self.socket, &message, &fds).unwrap();
        }

        fn recv(&self) -> Message {
            let (message, fds) = transport::recv(&self.socket).unwrap();
            assert!(fds.is_empty());
            message
        }

        fn welcome(&self) {
            match self.recv() {
                Message::Hello { client } => assert!(client.starts_with("gpufeed-client/")),
                other => panic!("expected Hello, got {other:?}"),
            }
            self.send(Message::Welcome {
                session: 42,
                backend: Backend::Cpu,
                daemon_version: "fake".into(),
            });
        }

        /// Greets, reads the OpenStream, and answers with `layout` and `slot_count` memfds of
        /// `file_bytes` each (which the fake keeps to fill).
        fn open(&self, layout: StreamLayout, descriptors: usize, file_bytes: u64) -> Vec<File> {
            let files = (0..descriptors).map(|_| memfd(file_bytes)).collect();
            self.open_with(layout, files)
        }

        /// Greets, reads the OpenStream, and answers with `layout` and `files`.
        fn open_with(&self, layout: StreamLayout, files: Vec<File>) -> Vec<File> {
            self.welcome();
            match self.recv() {
                Message::OpenStream(spec) => assert_eq!(spec.batch_size, BATCH_SIZE),
                other => panic!("expected OpenStream, got {other:?}"),
            }
            self.send_with(Message::StreamOpened(layout), &files);
            files
        }

        /// Reads until the client disconnects and returns what it sent.
        fn drain(&self) -> Vec<Message> {
            let mut messages = Vec::new();
            loop {
                match transport::recv(&self.socket) {
                    Ok((message, _)) => messages.push(message),
                    Err(TransportError::Closed) => return messages,
                    Err(other) => panic!("fake daemon: {other}"),
                }
            }
        }
    }

    /// A slot file as the daemon makes it: sealed against resizing.
    fn memfd(bytes: u64) -> File {
        let file = unsealed_memfd(bytes);
        fcntl(
            &file,
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW),
        )
        .unwrap();
        file
    }

    fn unsealed_memfd(bytes: u64) -> File {
        use nix::sys::memfd::{memfd_create, MFdFlags};
        let fd =
            memfd_create(c"slot", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
        let file = File::from(fd);
        file.set_len(bytes).unwrap();
        file
    }

    /// Runs `script` as the daemon and returns a greeted client on the other end.
    fn spawn_daemon(script: impl FnOnce(Fake) + Send + 'static) -> (UnixStream, JoinHandle<()>) {
        let (client, daemon) = UnixStream::pair().unwrap();
        client.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
        daemon.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
        let handle = std::thread::spawn(move || script(Fake { socket: daemon }));
        (client, handle)
    }

    /// Two fields: `ids` (u8 × 4 at offset 0) and `emb` (f32 × 2 at offset 4096).
    fn layout(slot_count: u32, steps: u64) -> StreamLayout {
        StreamLayout {
            slot_count,
            slot_bytes: SLOT_BYTES,
            epoch_samples: steps * u64::from(BATCH_SIZE),
            steps,
            fields: vec![
                FieldLayout {
                    name: "ids".into(),
                    dtype: DType::U8,
                    sample_shape: vec![4],
                    offset: 0,
                    batch_bytes: 8,
                },
                FieldLayout {
                    name: "emb".into(),
                    dtype: DType::F32,
                    sample_shape: vec![2],
                    offset: 4096,
                    batch_bytes: 16,
                },
            ],
            device: crate::protocol::Device::Cpu,
            slot_events: Vec::new(),
        }
    }

    fn batch(slot: u32, step: u64) -> BatchInfo {
        BatchInfo {
            slot,
            epoch: 0,
            step,
            cursor_after: (step + 1) * u64::from(BATCH_SIZE),
            samples: BATCH_SIZE,
            replaced: 0,
            fields: vec![
                BatchField {
                    offset: 0,
                    dtype: DType::U8,
                    shape: vec![2, 4],
                },
                BatchField {
                    offset: 4096,
                    dtype: DType::F32,
                    shape: vec![2, 2],
                },
            ],
            ready_ns: 0,
        }
    }

    fn ids_of(step: u64) -> Vec<u8> {
        (0..8).map(|i| step as u8 * 10 + i).collect()
    }

    fn emb_of(step: u64) -> Vec<u8> {
        (0..4)
            .flat_map(|i| (step as f32 + i as f32 / 4.0).to_le_bytes())
            .collect()
    }

    /// Writes step `step`'s data into a slot, as the daemon would.
    fn fill(slot: &File, step: u64) {
        slot.write_at(&ids_of(step), 0).unwrap();
        slot.write_at(&emb_of(step), 4096).unwrap();
    }

    fn assert_holds_step(batch: &Batch, step: u64) {
        assert_eq!(batch.step(), step);
        assert_eq!(batch.cursor_after(), (step + 1) * 2);
        let ids = batch.field("ids").unwrap();
        assert_eq!(
            (ids.name, ids.dtype, ids.shape),
            ("ids", DType::U8, &[2u64, 4][..])
        );
        assert_eq!(ids.host_bytes().unwrap(), &ids_of(step)[..]);
        let emb = batch.field("emb").unwrap();
        assert_eq!((emb.dtype, emb.shape), (DType::F32, &[2u64, 2][..]));
        assert_eq!(emb.host_bytes().unwrap(), &emb_of(step)[..]);
        let names: Vec<&str> = batch.fields().map(|f| f.name).collect();
        assert_eq!(names, ["ids", "emb"]);
        assert!(batch.field("labels").is_none());
    }

    fn open(socket: UnixStream) -> Result<Stream, ClientError> {
        Client::from_socket(socket)?.open_stream(StreamSpec::new("demo", BATCH_SIZE))
    }

    #[test]
    fn handshake_and_status_before_a_stream() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.welcome();
            assert_eq!(fake.recv(), Message::StatusRequest);
            fake.send(Message::Status(DaemonStatus {
                sessions: 3,
                batches_served: 17,
                ..DaemonStatus::default()
            }));
            assert!(fake.drain().is_empty());
        });
        let mut client = Client::from_socket(socket).unwrap();
        assert_eq!(
            (client.session(), client.backend(), client.daemon_version()),
            (42, Backend::Cpu, "fake")
        );
        let status = client.status().unwrap();
        assert_eq!((status.sessions, status.batches_served), (3, 17));
        drop(client);
        daemon.join().unwrap();
    }

    #[test]
    fn an_error_instead_of_welcome_is_a_daemon_error() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.recv();
            fake.send(Message::Error {
                code: ErrorCode::PermissionDenied,
                message: "uid 1234 is not allowed".into(),
            });
        });
        match Client::from_socket(socket) {
            Err(ClientError::Daemon { code, message }) => {
                assert_eq!(code, ErrorCode::PermissionDenied);
                assert!(message.contains("1234"));
            }
            other => panic!("expected a daemon error, got {other:?}"),
        }
        daemon.join().unwrap();
    }

    #[test]
    fn an_error_instead_of_stream_opened_is_a_daemon_error() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.welcome();
            fake.recv();
            fake.send(Message::Error {
                code: ErrorCode::UnknownDataset,
                message: "no dataset demo".into(),
            });
        });
        assert!(matches!(
            open(socket),
            Err(ClientError::Daemon {
                code: ErrorCode::UnknownDataset,
                ..
            })
        ));
        daemon.join().unwrap();
    }

    /// The main flow: batches arrive, are read in place, several are held at once, a dropped batch is
    /// released and its slot comes back with new data, `EndOfEpoch` ends the iterator, and the session
    /// closes only once the stream and every batch are gone.
    #[test]
    fn batches_are_leased_released_and_reused() {
        let (socket, daemon) = spawn_daemon(|fake| {
            let slots = fake.open(layout(2, 3), 2, SLOT_BYTES);
            fill(&slots[0], 0);
            fill(&slots[1], 1);
            fake.send(Message::Batch(batch(0, 0)));
            fake.send(Message::Batch(batch(1, 1)));
            assert_eq!(fake.recv(), Message::Release { slot: 0 });
            fill(&slots[0], 2);
            fake.send(Message::Batch(batch(0, 2)));
            fake.send(Message::EndOfEpoch { epoch: 0, steps: 3 });
            assert_eq!(
                fake.drain(),
                [
                    Message::Release { slot: 1 },
                    Message::Release { slot: 0 },
                    Message::Close
                ]
            );
        });
        let mut stream = open(socket).unwrap();
        assert_eq!(stream.layout().slot_count, 2);
        assert_eq!(stream.state().cursor, 0);
        let first = stream.next().unwrap().unwrap();
        assert_holds_step(&first, 0);
        assert_eq!(stream.state().cursor, 2);
        drop(first);
        let second = stream.next().unwrap().unwrap();
        let third = stream.next().unwrap().unwrap();
        assert_eq!(third.slot(), 0);
        assert_holds_step(&second, 1);
        assert_holds_step(&third, 2);
        assert!(stream.next().is_none());
        assert!(stream.next().is_none());
        assert_eq!(stream.state().cursor, 6);
        // The batches outlive the stream; the session ends with the last of them.
        drop(stream);
        assert_holds_step(&second, 1);
        drop(second);
        drop(third);
        daemon.join().unwrap();
    }

    #[test]
    fn batches_that_arrive_before_a_status_reply_are_queued() {
        let (socket, daemon) = spawn_daemon(|fake| {
            let slots = fake.open(layout(2, 2), 2, SLOT_BYTES);
            fill(&slots[0], 0);
            fill(&slots[1], 1);
            fake.send(Message::Batch(batch(0, 0)));
            fake.send(Message::Batch(batch(1, 1)));
            assert_eq!(fake.recv(), Message::StatusRequest);
            fake.send(Message::EndOfEpoch { epoch: 0, steps: 2 });
            fake.send(Message::Status(DaemonStatus {
                streams: 1,
                ..DaemonStatus::default()
            }));
            assert_eq!(
                fake.drain(),
                [
                    Message::Release { slot: 0 },
                    Message::Release { slot: 1 },
                    Message::Close
                ]
            );
        });
        let mut stream = open(socket).unwrap();
        assert_eq!(stream.status().unwrap().streams, 1);
        let steps: Vec<u64> = stream.by_ref().map(|b| b.unwrap().step()).collect();
        assert_eq!(steps, [0, 1]);
        drop(stream);
        daemon.join().unwrap();
    }

    #[test]
    fn an_error_frame_ends_the_stream_with_a_daemon_error() {
        let (socket, daemon) = spawn_daemon(|fake| {
            let slots = fake.open(layout(2, 3), 2, SLOT_BYTES);
            fill(&slots[0], 0);
            fake.send(Message::Batch(batch(0, 0)));
            fake.send(Message::Error {
                code: ErrorCode::CorruptData,
                message: "shard shard-000003.gfs field emb block 7: checksum mismatch".into(),
            });
            fake.drain();
        });
        let mut stream = open(socket).unwrap();
        assert_holds_step(&stream.next().unwrap().unwrap(), 0);
        match stream.next() {
            Some(Err(ClientError::Daemon { code, message })) => {
                assert_eq!(code, ErrorCode::CorruptData);
                assert!(message.contains("block 7"));
            }
            other => panic!("expected CorruptData, got {other:?}"),
        }
        assert!(stream.next().is_none());
        assert!(matches!(stream.status(), Err(ClientError::Ended(_))));
        drop(stream);
        daemon.join().unwrap();
    }

    #[test]
    fn an_error_read_by_status_is_reported_once_by_the_iterator() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.open(layout(2, 3), 2, SLOT_BYTES);
            assert_eq!(fake.recv(), Message::StatusRequest);
            fake.send(Message::Error {
                code: ErrorCode::Internal,
                message: "reader thread died".into(),
            });
            fake.drain();
        });
        let mut stream = open(socket).unwrap();
        assert!(matches!(
            stream.status(),
            Err(ClientError::Daemon {
                code: ErrorCode::Internal,
                ..
            })
        ));
        assert!(matches!(stream.next(), Some(Err(ClientError::Ended(_)))));
        assert!(stream.next().is_none());
        drop(stream);
        daemon.join().unwrap();
    }

    #[test]
    fn a_dropped_connection_is_a_transport_error() {
        let (socket, daemon) = spawn_daemon(|fake| {
            let slots = fake.open(layout(2, 3), 2, SLOT_BYTES);
            fill(&slots[0], 0);
            fake.send(Message::Batch(batch(0, 0)));
        });
        let mut stream = open(socket).unwrap();
        let first = stream.next().unwrap().unwrap();
        assert!(matches!(
            stream.next(),
            Some(Err(ClientError::Transport(TransportError::Closed)))
        ));
        assert!(stream.next().is_none());
        // The mapping outlives the connection.
        assert_holds_step(&first, 0);
        daemon.join().unwrap();
    }

    /// Runs a fake that answers OpenStream with `layout`, `descriptors` memfds of `file_bytes`, and
    /// expects the client to refuse it.
    fn assert_layout_refused(layout: StreamLayout, descriptors: usize, file_bytes: u64) {
        let (socket, daemon) = spawn_daemon(move |fake| {
            fake.open(layout, descriptors, file_bytes);
            fake.drain();
        });
        match open(socket) {
            Err(ClientError::Protocol(reason)) => assert!(!reason.is_empty()),
            other => panic!("expected a protocol error, got {other:?}"),
        }
        daemon.join().unwrap();
    }

    #[test]
    fn bad_layouts_are_refused() {
        assert_layout_refused(layout(2, 3), 1, SLOT_BYTES);
        assert_layout_refused(layout(2, 3), 3, SLOT_BYTES);
        assert_layout_refused(layout(0, 3), 0, SLOT_BYTES);
        assert_layout_refused(layout(2, 3), 2, SLOT_BYTES - 1);
        let mut beyond = layout(2, 3);
        beyond.fields[1].offset = SLOT_BYTES;
        assert_layout_refused(beyond, 2, SLOT_BYTES);
        let mut overflowing = layout(2, 3);
        overflowing.fields[1].batch_bytes = u64::MAX - 100;
        assert_layout_refused(overflowing, 2, SLOT_BYTES);
        let mut unaligned = layout(2, 3);
        unaligned.fields[1].offset = 100;
        assert_layout_refused(unaligned, 2, SLOT_BYTES);
        let mut too_small = layout(2, 3);
        too_small.fields[0].batch_bytes = 7;
        assert_layout_refused(too_small, 2, SLOT_BYTES);
        let mut overlapping = layout(2, 3);
        overlapping.fields[0].batch_bytes = 4097;
        assert_layout_refused(overlapping, 2, SLOT_BYTES);
        let mut duplicate = layout(2, 3);
        duplicate.fields[1].name = "ids".into();
        assert_layout_refused(duplicate, 2, SLOT_BYTES);
        let mut wrong_steps = layout(2, 3);
        wrong_steps.steps = 4;
        assert_layout_refused(wrong_steps, 2, SLOT_BYTES);
        let mut too_many_dims = layout(2, 3);
        too_many_dims.fields[0].sample_shape = vec![1; BATCH_NDIM_MAX];
        assert_layout_refused(too_many_dims, 2, SLOT_BYTES);
        let mut no_fields = layout(2, 3);
        no_fields.fields.clear();
        assert_layout_refused(no_fields, 2, SLOT_BYTES);
    }

    #[test]
    fn slots_that_can_shrink_are_refused() {
        let (socket, daemon) = spawn_daemon(|fake| {
            let files = vec![memfd(SLOT_BYTES), unsealed_memfd(SLOT_BYTES)];
            fake.open_with(layout(2, 3), files);
            fake.drain();
        });
        match open(socket) {
            Err(ClientError::Protocol(reason)) => assert!(reason.contains("slot 1"), "{reason}"),
            other => panic!("expected a protocol error, got {other:?}"),
        }
        daemon.join().unwrap();
    }

    /// A daemon that refuses the peer's uid answers before reading Hello and closes; the client
    /// reports the refusal even when its Hello can no longer be sent.
    #[test]
    fn a_refusal_sent_before_hello_is_reported() {
        let (client, daemon) = UnixStream::pair().unwrap();
        client.set_read_timeout(Some(TEST_TIMEOUT)).unwrap();
        transport::send(
            &daemon,
            &Message::Error {
                code: ErrorCode::PermissionDenied,
                message: "uid 1234 is not allowed to connect".into(),
            },
            &[],
        )
        .unwrap();
        drop(daemon);
        match Client::from_socket(client) {
            Err(ClientError::Daemon { code, .. }) => assert_eq!(code, ErrorCode::PermissionDenied),
            other => panic!("expected the refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_layout_must_match_the_requested_fields() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.open(layout(2, 3), 2, SLOT_BYTES);
            fake.drain();
        });
        let mut spec = StreamSpec::new("demo", BATCH_SIZE);
        spec.fields = vec![
            FieldRequest {
                name: "ids".into(),
                dtype: None,
            },
            FieldRequest {
                name: "emb".into(),
                dtype: Some(DType::F16),
            },
        ];
        let result = Client::from_socket(socket).unwrap().open_stream(spec);
        assert!(matches!(result, Err(ClientError::Protocol(_))));
        daemon.join().unwrap();
    }

    /// Opens a good stream, sends `frames` (the first batch's slot is filled), and expects the
    /// client to yield `good` batches and then a protocol error.
    fn assert_batches_refused(good: usize, frames: Vec<(Message, usize)>) {
        let (socket, daemon) = spawn_daemon(move |fake| {
            let slots = fake.open(layout(2, 3), 2, SLOT_BYTES);
            fill(&slots[0], 0);
            for (message, descriptors) in frames {
                let files: Vec<File> = (0..descriptors).map(|_| memfd(4096)).collect();
                fake.send_with(message, &files);
            }
            fake.drain();
        });
        let mut stream = open(socket).unwrap();
        let mut held = Vec::new();
        for _ in 0..good {
            held.push(stream.next().unwrap().unwrap());
        }
        match stream.next() {
            Some(Err(ClientError::Protocol(reason))) => assert!(!reason.is_empty()),
            other => panic!("expected a protocol error, got {other:?}"),
        }
        assert!(stream.next().is_none());
        drop(stream);
        drop(held);
        daemon.join().unwrap();
    }

    #[test]
    fn bad_batches_are_refused() {
        let ok = |slot, step| (Message::Batch(batch(slot, step)), 0);
        let bad = |edit: fn(&mut BatchInfo)| {
            let mut info = batch(0, 0);
            edit(&mut info);
            (Message::Batch(info), 0)
        };
        assert_batches_refused(0, vec![bad(|b| b.slot = 2)]);
        assert_batches_refused(0, vec![bad(|b| b.epoch = 1)]);
        assert_batches_refused(0, vec![bad(|b| b.samples = 3)]);
        assert_batches_refused(0, vec![bad(|b| b.replaced = 3)]);
        assert_batches_refused(0, vec![bad(|b| b.cursor_after = 0)]);
        assert_batches_refused(
            0,
            vec![bad(|b| {
                b.fields.pop();
            })],
        );
        assert_batches_refused(0, vec![bad(|b| b.fields[1].dtype = DType::F64)]);
        assert_batches_refused(0, vec![bad(|b| b.fields[0].shape = vec![2, 5])]);
        assert_batches_refused(0, vec![bad(|b| b.fields[0].shape = vec![1, 4])]);
        assert_batches_refused(0, vec![bad(|b| b.fields[1].offset = SLOT_BYTES - 8)]);
        assert_batches_refused(0, vec![bad(|b| b.fields[1].offset = u64::MAX - 4)]);
        assert_batches_refused(0, vec![(Message::Batch(batch(0, 0)), 1)]);
        // The same slot again while the client holds it.
        assert_batches_refused(1, vec![ok(0, 0), ok(0, 1)]);
        // Steps must follow each other.
        assert_batches_refused(1, vec![ok(0, 0), ok(1, 2)]);
        // An EndOfEpoch before the announced number of batches.
        assert_batches_refused(
            1,
            vec![ok(0, 0), (Message::EndOfEpoch { epoch: 0, steps: 1 }, 0)],
        );
        // Messages that only the client sends.
        assert_batches_refused(0, vec![(Message::Release { slot: 0 }, 0)]);
        assert_batches_refused(0, vec![(Message::Status(DaemonStatus::default()), 0)]);
    }

    #[test]
    fn more_batches_than_announced_are_refused() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.open(layout(2, 1), 2, SLOT_BYTES);
            fake.send(Message::Batch(batch(0, 0)));
            fake.send(Message::Batch(batch(1, 1)));
            fake.drain();
        });
        let mut stream = open(socket).unwrap();
        let first = stream.next().unwrap().unwrap();
        assert!(matches!(stream.next(), Some(Err(ClientError::Protocol(_)))));
        drop(first);
        drop(stream);
        daemon.join().unwrap();
    }

    #[test]
    fn specs_that_break_a_bound_are_refused_locally() {
        let base = StreamSpec::new("demo", 8);
        assert!(check_spec(&base).is_ok());
        let edits: [fn(&mut StreamSpec); 8] = [
            |s| s.dataset.clear(),
            |s| s.dataset = "d".repeat(STRING_BYTES_MAX + 1),
            |s| s.batch_size = 0,
            |s| s.rank = 1,
            |s| s.prefetch = SLOTS_MAX + 1,
            |s| s.shuffle = Shuffle::Window(0),
            |s| s.device = Device::Cuda(u32::MAX),
            // 256 names of 1024 bytes fit the field bound but not a frame.
            |s| {
                s.fields = (0..STREAM_FIELDS_MAX)
                    .map(|i| FieldRequest {
                        name: format!("{i:0>1024}"),
                        dtype: None,
                    })
                    .collect()
            },
        ];
        for edit in edits {
            let mut spec = base.clone();
            edit(&mut spec);
            assert!(matches!(
                check_spec(&spec),
                Err(ClientError::InvalidSpec(_))
            ));
        }
        // A request of exactly FRAME_BYTES_MAX is accepted and encodes to that size; one byte more
        // is refused.
        let mut largest = base.clone();
        let fixed = FRAME_HEADER_BYTES + 2 + largest.dataset.len() + 2 + OPEN_STREAM_FIXED_BYTES;
        let count = 65;
        let per_field = (FRAME_BYTES_MAX - fixed) / count;
        let remainder = (FRAME_BYTES_MAX - fixed) % count;
        largest.fields = (0..count)
            .map(|i| FieldRequest {
                name: "f".repeat(per_field - 3 + if i == 0 { remainder } else { 0 }),
                dtype: None,
            })
            .collect();
        assert!(check_spec(&largest).is_ok());
        assert_eq!(
            Message::OpenStream(largest.clone()).encode().len(),
            FRAME_BYTES_MAX
        );
        largest.fields[1].name.push('f');
        assert!(matches!(
            check_spec(&largest),
            Err(ClientError::InvalidSpec(_))
        ));
    }

    #[test]
    fn an_invalid_spec_sends_nothing() {
        let (socket, daemon) = spawn_daemon(|fake| {
            fake.welcome();
            assert!(fake.drain().is_empty());
        });
        let mut spec = StreamSpec::new("demo", BATCH_SIZE);
        spec.device = Device::Cuda(u32::MAX);
        let result = Client::from_socket(socket).unwrap().open_stream(spec);
        assert!(matches!(result, Err(ClientError::InvalidSpec(_))));
        daemon.join().unwrap();
    }

    #[test]
    fn streams_and_batches_can_move_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        fn assert_send<T: Send>() {}
        assert_send::<Stream>();
        assert_send::<Client>();
        assert_send_sync::<Batch>();
    }

    #[test]
    fn spec_helpers_set_the_cursor() {
        let mut spec = StreamSpec::new("demo", 8);
        assert_eq!(
            (
                spec.fields.len(),
                spec.world_size,
                spec.prefetch,
                spec.start_cursor
            ),
            (0, 1, PREFETCH_DEFAULT, 0)
        );
        assert_eq!(
            (spec.tail, spec.on_corrupt, spec.device),
            (Tail::Drop, CorruptPolicy::Fail, Device::Cpu)
        );
        spec.world_size = 4;
        spec.start_at_step(10);
        assert_eq!(spec.start_cursor, 320);
        spec.start_at_step(u64::MAX);
        assert_eq!(spec.start_cursor, u64::MAX);

        let state = StreamState {
            dataset: "other".into(),
            seed: 7,
            epoch: 3,
            shuffle: Shuffle::Window(4),
            world_size: 8,
            batch_size: 16,
            cursor: 4096,
        };
        spec.resume(&state);
        assert_eq!(spec.dataset, "other");
        assert_eq!(
            (spec.seed, spec.epoch, spec.shuffle),
            (7, 3, Shuffle::Window(4))
        );
        assert_eq!(spec.start_cursor, 4096);
        // The world and the batch size stay as configured: resume is elastic.
        assert_eq!((spec.world_size, spec.batch_size), (4, 8));
    }
}
