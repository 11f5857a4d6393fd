//! Frames over a Unix stream socket, with file descriptors passed as SCM_RIGHTS ancillary data.
//!
//! Both the daemon and the client use this module, so the two sides cannot disagree on framing.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::protocol::{DecodeError, Message, DESCRIPTORS_MAX};

/// A frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The socket failed.
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// The peer sent a frame that does not decode.
    #[error("bad frame: {0}")]
    Decode(#[from] DecodeError),
    /// The peer passed more descriptors than any frame may carry.
    #[error(
        "a frame carried more than {DESCRIPTORS_MAX} file descriptors or truncated ancillary data"
    )]
    TooManyDescriptors,
}

/// Most descriptors Linux passes with one message (`SCM_MAX_FD`, net/core/scm.c). The receive buffer
/// has room for that many, each in a control message of its own at worst, so the kernel never
/// truncates it: every descriptor it installs is taken here, and closed if the frame is refused. (A
/// buffer sized for [`DESCRIPTORS_MAX`] let a frame carrying more be truncated, and the descriptors the
/// kernel had installed were never closed.)
const SCM_MAX_FD: usize = 253;

fn nix_io(error: nix::Error) -> std::io::Error {
    std::io::Error::from_raw_os_error(error as i32)
}

/// Sends one message, with `fds` attached when not empty.
///
/// Uses MSG_NOSIGNAL so that a peer that went away yields an error instead of SIGPIPE.
pub fn send(
    socket: &UnixStream,
    message: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<(), TransportError> {
    send_frame(socket, &message.encode(), fds)
}

/// Sends an encoded frame (see [`send`]).
pub fn send_frame(
    socket: &UnixStream,
    frame: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), TransportError> {
    assert!(
        fds.len() <= DESCRIPTORS_MAX as usize,
        "at most {DESCRIPTORS_MAX} descriptors a frame"
    );
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut sent = 0usize;
    while sent < frame.len() {
        let iov = [IoSlice::new(&frame[sent..])];
        // Descriptors ride on the first byte only.
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage] = if sent == 0 && !raw.is_empty() {
            &rights
        } else {
            &[]
        };
        match sendmsg::<()>(
            socket.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EPIPE) | Err(nix::Error::ECONNRESET) => {
                return Err(TransportError::Closed)
            }
            Err(e) => return Err(TransportError::Io(nix_io(e))),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes, collecting any descriptors that arrive on the way.
/// Returns `Ok(false)` if the peer closed the connection before the first byte.
///
/// With a `deadline`, every read waits only for the time left until it (the socket's read timeout is
/// set before each read), so that the deadline bounds the whole read, not each piece: a peer
/// trickling a byte at a time cannot stretch it. Past the deadline the error is
/// [`std::io::ErrorKind::TimedOut`] or [`std::io::ErrorKind::WouldBlock`].
fn recv_exact(
    socket: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Option<Instant>,
) -> Result<bool, TransportError> {
    let mut got = 0usize;
    let mut cmsg_space: Vec<u8> = vec![0u8; SCM_MAX_FD * nix::cmsg_space!(RawFd).len()];
    while got < buf.len() {
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Io(std::io::ErrorKind::TimedOut.into()));
            }
            socket.set_read_timeout(Some(left))?;
        }
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let received = recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        );
        let message = match received {
            Ok(message) => message,
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::ECONNRESET) => return Err(TransportError::Closed),
            Err(e) => return Err(TransportError::Io(nix_io(e))),
        };
        let truncated = message.flags.contains(MsgFlags::MSG_CTRUNC);
        for cmsg in message.cmsgs().map_err(|e| TransportError::Io(nix_io(e)))? {
            if let ControlMessageOwned::ScmRights(received_fds) = cmsg {
                for fd in received_fds {
                    // SAFETY: the kernel just installed this descriptor in our table for us; nothing
                    // else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if truncated || fds.len() > DESCRIPTORS_MAX as usize {
            return Err(TransportError::TooManyDescriptors);
        }
        if message.bytes == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(TransportError::Closed);
        }
        got += message.bytes;
    }
    Ok(true)
}

/// Receives one message and the descriptors passed with it.
///
/// The length is checked against the protocol's bound before the body is read, so a hostile length
/// cannot make this allocate. Returns [`TransportError::Closed`] at a clean end of stream.
pub fn recv(socket: &UnixStream) -> Result<(Message, Vec<OwnedFd>), TransportError> {
    recv_within(socket, None)
}

/// Receives one message (see [`recv`]) all of which must arrive before `deadline`: the deadline
/// bounds the whole frame, however its bytes are spread out in time. Past it the error is
/// [`TransportError::Io`] of kind [`std::io::ErrorKind::TimedOut`] or
/// [`std::io::ErrorKind::WouldBlock`]. The socket's read timeout is set while receiving and put back
/// as it was afterwards.
pub fn recv_before(
    socket: &UnixStream,
    deadline: Instant,
) -> Result<(Message, Vec<OwnedFd>), TransportError> {
    let previous = socket.read_timeout()?;
    let received = recv_within(socket, Some(deadline));
    socket.set_read_timeout(previous)?;
    received
}

fn recv_within(
    socket: &UnixStream,
    deadline: Option<Instant>,
) -> Result<(Message, Vec<OwnedFd>), TransportError> {
    let mut fds = Vec::new();
    let mut header = [0u8; 4];
    if !recv_exact(socket, &mut header, &mut fds, deadline)? {
        return Err(TransportError::Closed);
    }
    let length = Message::frame_length(header)?;
    let mut body = vec![0u8; length];
    recv_exact(socket, &mut body, &mut fds, deadline)?;
    Ok((Message::decode(&body)?, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    #[test]
    fn messages_and_descriptors_cross_a_socketpair() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = tempfile_in_memory();
        file.write_all(b"slot bytes").unwrap();
        send(&a, &Message::StatusRequest, &[file.as_fd()]).unwrap();
        send(&a, &Message::Close, &[]).unwrap();
        let (message, fds) = recv(&b).unwrap();
        assert_eq!(message, Message::StatusRequest);
        assert_eq!(fds.len(), 1);
        let mut received = std::fs::File::from(fds.into_iter().next().unwrap());
        received.rewind().unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "slot bytes");
        assert_eq!(recv(&b).unwrap().0, Message::Close);
        drop(a);
        assert!(matches!(recv(&b), Err(TransportError::Closed)));
    }

    /// Regression test: a frame carrying more descriptors than a frame may (here 100, over the
    /// DESCRIPTORS_MAX of 4) used to leak the descriptors the kernel installed, because the truncated control
    /// message was refused before they were taken. They are closed now: every copy of a pipe's write
    /// end sent in the frame is closed after the refusal, so its read end sees end-of-file.
    #[test]
    fn a_frame_with_too_many_descriptors_leaks_none() {
        let (a, b) = UnixStream::pair().unwrap();
        let (read_end, write_end) = nix::unistd::pipe().unwrap();
        let copies: Vec<OwnedFd> = (0..100).map(|_| write_end.try_clone().unwrap()).collect();
        let raw: Vec<RawFd> = copies.iter().map(AsRawFd::as_raw_fd).collect();
        let frame = Message::Close.encode();
        sendmsg::<()>(
            a.as_raw_fd(),
            &[IoSlice::new(&frame)],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .unwrap();
        drop(copies);
        drop(write_end);
        assert!(matches!(recv(&b), Err(TransportError::TooManyDescriptors)));
        // Every write end is closed: reading gives end-of-file at once instead of blocking.
        let mut reader = std::fs::File::from(read_end);
        let mut byte = [0u8; 1];
        nix::fcntl::fcntl(
            &reader,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )
        .unwrap();
        assert_eq!(
            reader.read(&mut byte).unwrap(),
            0,
            "a sent descriptor leaked"
        );
    }

    /// The deadline of [`recv_before`] bounds the whole frame: a peer that sent only part of one is
    /// answered with a timeout once the deadline passes, and the socket's own read timeout is as
    /// it was.
    #[test]
    fn a_deadline_bounds_the_whole_frame() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let frame = Message::Close.encode();
        a.write_all(&frame[..frame.len() - 1]).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_millis(50);
        match recv_before(&b, deadline) {
            Err(TransportError::Io(error)) => assert!(
                matches!(
                    error.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ),
                "{error}"
            ),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert_eq!(b.read_timeout().unwrap(), None);
    }

    #[test]
    fn oversized_length_is_rejected_before_reading_the_body() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(matches!(
            recv(&b),
            Err(TransportError::Decode(DecodeError::Length(_)))
        ));
    }

    fn tempfile_in_memory() -> std::fs::File {
        let fd =
            nix::sys::memfd::memfd_create(c"test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
        std::fs::File::from(fd)
    }
}
