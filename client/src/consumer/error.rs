//! The consumer API's error, and the two ways a reply turns into one (a frame that carries
//! descriptors it should not, a message other than the one awaited). Apart from the module's root so
//! that the stream, ring and layout code can name them without importing the root back.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use crate::protocol::{ErrorCode, Message, PROTOCOL_VERSION};
use crate::transport::{self, TransportError};

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
    /// The daemon speaks another version of the consumer protocol; nothing was exchanged.
    #[error(
        "the daemon speaks gpufeed consumer protocol version {daemon} and this client \
         (gpufeed-client {}) speaks version {PROTOCOL_VERSION}: use a client library of the \
         daemon's release",
        env!("CARGO_PKG_VERSION")
    )]
    VersionMismatch {
        /// The daemon's protocol version.
        daemon: u16,
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
pub(super) fn recv_plain(socket: &UnixStream) -> Result<Message, ClientError> {
    let (message, fds) = match transport::recv(socket) {
        Ok(received) => received,
        Err(TransportError::Decode(crate::protocol::DecodeError::Version { found })) => {
            return Err(ClientError::VersionMismatch { daemon: found })
        }
        Err(error) => return Err(error.into()),
    };
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
pub(super) fn unexpected(message: Message, waiting_for: &str) -> ClientError {
    match message {
        Message::Error { code, message } => ClientError::Daemon { code, message },
        other => {
            ClientError::Protocol(format!("expected {waiting_for}, received {}", other.name()))
        }
    }
}
