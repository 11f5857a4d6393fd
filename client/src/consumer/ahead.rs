//! Opening a stream ahead of need: a training loop that finishes one epoch and then opens the next
//! waits for the connection, the daemon's set-up and the mapping of every slot (about 10 ms for a
//! ring of 32 device slots on an H100) before its first batch. [`OpeningStream`] does that on a
//! helper thread while the loop still consumes the epoch before, and the daemon fills the new
//! stream's first slots meanwhile.

use std::path::PathBuf;
use std::thread::JoinHandle;

use crate::protocol::StreamSpec;

use super::{Client, ClientError, Stream};

/// A stream being opened on a helper thread: connecting, greeting, opening and mapping its slots.
///
/// Each open stream is a session of its own and holds its own ring in the daemon (and, on a GPU,
/// device memory for its shards): open one ahead, not many. A daemon at its session or slot-memory
/// bound refuses it; open again once the current stream is dropped.
///
/// ```no_run
/// use gpufeed_client::consumer::{Client, ClientError, OpeningStream};
/// use gpufeed_client::protocol::StreamSpec;
///
/// # fn main() -> Result<(), ClientError> {
/// let socket = "/run/gpufeed/gpufeed.sock";
/// let spec = StreamSpec::new("tokens", 256);
/// let mut stream = Client::connect(socket)?.open_stream(spec.clone())?;
/// for epoch in 0..10u64 {
///     // The stream's steps, from its start (a resumed stream starts mid-epoch).
///     let steps = stream.layout().steps;
///     let mut received = 0;
///     let mut next = None;
///     while let Some(batch) = stream.next() {
///         let batch = batch?;
///         received += 1;
///         // ... train on the batch ...
///         // A quarter of the epoch left: open the next one.
///         if next.is_none() && epoch + 1 < 10 && received >= steps * 3 / 4 {
///             let mut spec = spec.clone();
///             spec.epoch = epoch + 1;
///             next = Some(OpeningStream::start(socket, spec));
///         }
///     }
///     match next {
///         Some(opening) => stream = opening.wait()?,
///         None => break,
///     }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct OpeningStream {
    socket: PathBuf,
    spec: StreamSpec,
    /// The helper thread; `None` if it could not be started (then `wait` opens the stream).
    handle: Option<JoinHandle<Result<Stream, ClientError>>>,
}

impl OpeningStream {
    /// Starts connecting to the daemon at `socket` and opening a stream of `spec` on a new thread.
    /// If no thread can be started, [`OpeningStream::wait`] opens the stream on the calling thread.
    pub fn start(socket: impl Into<PathBuf>, spec: StreamSpec) -> OpeningStream {
        let socket = socket.into();
        let (thread_socket, thread_spec) = (socket.clone(), spec.clone());
        let handle = std::thread::Builder::new()
            .name("gpufeed-open".to_string())
            .spawn(move || Client::connect(&thread_socket)?.open_stream(thread_spec))
            .ok();
        OpeningStream {
            socket,
            spec,
            handle,
        }
    }

    /// The spec being opened.
    pub fn spec(&self) -> &StreamSpec {
        &self.spec
    }

    /// The open stream, once it is: blocks until the helper thread is done.
    pub fn wait(self) -> Result<Stream, ClientError> {
        match self.handle {
            Some(handle) => handle.join().unwrap_or_else(|_| {
                Err(ClientError::Protocol(
                    "the thread opening the stream panicked".to_string(),
                ))
            }),
            None => Client::connect(&self.socket)?.open_stream(self.spec),
        }
    }
}
