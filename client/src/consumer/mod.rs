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
//!
//! A mixture draws each row from one of several datasets, in proportion to their weights; each
//! source keeps its own order and epochs (`docs/PROTOCOL.md`, *Mixtures*); on a CUDA device its
//! batches are assembled on the host and uploaded:
//!
//! ```no_run
//! use gpufeed_client::consumer::{Client, ClientError};
//! use gpufeed_client::protocol::{MixtureSource, Shuffle, StreamSpec};
//!
//! # fn main() -> Result<(), ClientError> {
//! let source = |dataset: &str, weight| MixtureSource { dataset: dataset.into(), weight };
//! let mut spec = StreamSpec::mixture(vec![source("web", 0.7), source("code", 0.3)], 32);
//! spec.shuffle = Shuffle::Full;
//! let stream = Client::connect("/run/gpufeed/gpufeed.sock")?.open_stream(spec)?;
//! # let _ = stream;
//! # Ok(())
//! # }
//! ```

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use ring::ConsumerRing;

use crate::protocol::{
    Backend, DaemonStatus, Device, DeviceUuid, ErrorCode, Message, StreamSpec, SLOTS_MAX,
};
use crate::transport;

mod ahead;
mod batch;
mod error;
mod layout;
mod pacing;
mod ring;
mod slots;
mod stream;
#[cfg(test)]
mod tests;
mod variable;

pub use ahead::OpeningStream;
pub use batch::{Batch, FieldData, FieldView};
pub use error::ClientError;
use error::{recv_plain, unexpected};
use layout::*;
use slots::{Outbox, OutboxInner, SlotMemory, Slots};
use stream::*;
pub use stream::{OpenPhases, Stream};

// The held-slot set is a 64-bit mask.
const _: () = assert!(SLOTS_MAX <= 64);

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
    ///
    /// On a CUDA device, the device's UUID is sent with its ordinal (unless `spec.device_uuid`
    /// names one already): `cuda:N` means this process's device N, and the daemon serves that
    /// physical GPU whatever its own `CUDA_VISIBLE_DEVICES`.
    pub fn open_stream(self, mut spec: StreamSpec) -> Result<Stream, ClientError> {
        check_spec(&spec)?;
        if let (Device::Cuda(ordinal), None) = (spec.device, spec.device_uuid) {
            spec.device_uuid = Some(DeviceUuid(crate::cuda::device_uuid(ordinal)?));
        }
        let asked = std::time::Instant::now();
        transport::send(&self.socket, &Message::OpenStream(spec.clone()), &[])?;
        let (message, fds) = transport::recv(&self.socket)?;
        let answered = std::time::Instant::now();
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
                return Err(older_daemon_hint(unexpected(other, "StreamOpened"), &spec));
            }
        };
        check_layout(&spec, &layout, fds.len())?;
        let mut fds = fds;
        let ring_fds: [OwnedFd; 3] = fds
            .split_off(1)
            .try_into()
            .expect("check_layout counted the descriptors");
        let slots_fd = fds.pop().expect("check_layout counted the descriptors");
        let ring = ConsumerRing::map(ring_fds, layout.slot_count)?;
        let slots = match layout.device {
            Device::Cpu => Slots::Host(map_slots(&layout, slots_fd)?),
            Device::Cuda(ordinal) => Slots::Device(crate::cuda::DeviceSlots::import(
                ordinal,
                &layout,
                ring_memory_bytes(&layout).expect("checked by check_layout"),
                slots_fd,
            )?),
        };
        let open_phases = OpenPhases {
            daemon_s: (answered - asked).as_secs_f64(),
            map_s: answered.elapsed().as_secs_f64(),
        };
        let outbox = Outbox {
            inner: Mutex::new(OutboxInner {
                socket: self.socket.try_clone()?,
                held_slots: 0,
                releases_published: 0,
            }),
            ring,
        };
        Ok(Stream {
            socket: self.socket,
            session: self.session,
            backend: self.backend,
            last_step: None,
            last_cursor_received: spec.start_cursor,
            batches_received: 0,
            cursor: spec.start_cursor,
            phase: Phase::Streaming,
            pacing: pacing::Pacing::default(),
            open_phases,
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

/// `error` with a hint when it is a daemon's refusal of the device UUID that ends `spec`'s request:
/// a daemon from before the field existed reads it as trailing bytes of a malformed frame.
fn older_daemon_hint(error: ClientError, spec: &StreamSpec) -> ClientError {
    match error {
        ClientError::Daemon {
            code: ErrorCode::BadFrame,
            message,
        } if spec.device_uuid.is_some() && message.contains("trailing bytes") => {
            ClientError::Daemon {
                code: ErrorCode::BadFrame,
                message: format!(
                    "{message} (the daemon predates devices named by UUID in OpenStream: upgrade \
                     it to this client's release)"
                ),
            }
        }
        other => other,
    }
}
