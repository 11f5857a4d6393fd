//! Regression tests for requests a consumer of another client library may send, and what the daemon
//! answers:
//! - an `OpenStream` asking for a shuffle window of zero shards was answered `BadFrame` (the decoder
//!   refused it), while `docs/PROTOCOL.md` documents `BadRequest` for it: a well-formed request that is
//!   invalid. It is now decoded and refused by the stream spec's rules, with their message.
//! - a `Hello` carrying 1 to 4 descriptors (SCM_RIGHTS) was accepted and the session welcomed, while
//!   `docs/PROTOCOL.md` says descriptors on any client frame are `BadFrame` (later frames were
//!   refused so already). It is now refused `BadFrame` before any `Welcome`.
//!
//! (What the daemon answers to bad releases in the hand-off ring: `tests/handoff_ring.rs`.)

mod common;

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Stdio;

use gpufeed_client::protocol::{ErrorCode, Message, Shuffle, StreamSpec};
use gpufeed_client::transport;

/// A greeted raw connection to `socket`.
fn greeted(socket: &Path) -> UnixStream {
    let socket = UnixStream::connect(socket).unwrap();
    let hello = Message::Hello {
        client: "protocol-requests test".to_string(),
    };
    transport::send(&socket, &hello, &[]).unwrap();
    assert!(matches!(
        transport::recv(&socket).unwrap().0,
        Message::Welcome { .. }
    ));
    socket
}

#[test]
fn a_window_of_zero_shards_is_a_bad_request() {
    let root = tempfile::tempdir().unwrap();
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let daemon = common::daemon::start_daemon(
        binary,
        root.path(),
        root.path().join("gpufeed.sock"),
        "cpu",
        &[],
        Stdio::null(),
    );
    let socket = greeted(&daemon.socket);
    // The client library refuses this spec before sending it; another client might not.
    let mut spec = StreamSpec::new("any", 4);
    spec.shuffle = Shuffle::Window(0);
    transport::send(&socket, &Message::OpenStream(spec), &[]).unwrap();
    match transport::recv(&socket).unwrap().0 {
        Message::Error { code, message } => {
            assert_eq!(code, ErrorCode::BadRequest, "{message}");
            assert!(message.contains("at least one shard"), "{message}");
        }
        other => panic!("expected an error frame, got {other:?}"),
    }
}

/// A `Hello` carrying descriptors (1 to 4, the most a frame may carry) was welcomed; it is refused
/// `BadFrame` and the session ends, and a plain `Hello` on the same daemon is still welcomed.
#[test]
fn a_hello_carrying_descriptors_is_a_bad_frame() {
    let root = tempfile::tempdir().unwrap();
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let daemon = common::daemon::start_daemon(
        binary,
        root.path(),
        root.path().join("gpufeed.sock"),
        "cpu",
        &[],
        Stdio::null(),
    );
    let files: Vec<std::fs::File> = (0..4)
        .map(|_| std::fs::File::open("/dev/null").unwrap())
        .collect();
    for count in 1..=4 {
        let socket = UnixStream::connect(&daemon.socket).unwrap();
        let fds: Vec<_> = files[..count].iter().map(AsFd::as_fd).collect();
        let hello = Message::Hello {
            client: format!("a Hello with {count} descriptors"),
        };
        transport::send(&socket, &hello, &fds).unwrap();
        match transport::recv(&socket).unwrap().0 {
            Message::Error { code, message } => {
                assert_eq!(code, ErrorCode::BadFrame, "{count} descriptors: {message}");
                assert!(message.contains("descriptor"), "{message}");
            }
            other => panic!("{count} descriptors: expected BadFrame, got {other:?}"),
        }
        assert!(
            matches!(
                transport::recv(&socket),
                Err(transport::TransportError::Closed)
            ),
            "the session ends after the refusal"
        );
    }
    drop(greeted(&daemon.socket));
}
