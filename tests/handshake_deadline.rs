//! Regression test: consumer sessions had no handshake deadline, so connections that never sent
//! Hello held every session (`--sessions-max` of them) forever and no consumer could connect. A
//! connection that has not sent Hello within the deadline (10 s) is now told why and closed, and its
//! session is free again.

mod common;

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Stdio;

use gpufeed_client::protocol::{ErrorCode, Message};
use gpufeed_client::{transport, Client};

#[test]
fn silent_connections_are_closed_and_free_their_sessions() {
    let root = tempfile::tempdir().unwrap();
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let socket = root.path().join("gpufeed.sock");
    let daemon = common::daemon::start_daemon(
        binary,
        root.path(),
        socket,
        "cpu",
        &["--sessions-max", "2"],
        Stdio::null(),
    );
    // Two connections that never speak take both sessions...
    let silent: Vec<UnixStream> = (0..2)
        .map(|_| UnixStream::connect(&daemon.socket).unwrap())
        .collect();
    // ...until the deadline: each is then told why and closed (the read blocks until then).
    for connection in &silent {
        match transport::recv(connection) {
            Ok((Message::Error { code, message }, _)) => {
                assert_eq!(code, ErrorCode::BadFrame);
                assert!(message.contains("no Hello within"), "{message}");
            }
            other => panic!("expected an error frame, got {other:?}"),
        }
    }
    // Their sessions are free again: a consumer connects and gets its Welcome. The daemon releases a
    // session just after sending the error, so allow it a few tries.
    let mut last_error = None;
    for _ in 0..50 {
        match Client::connect(&daemon.socket).and_then(|mut c| c.status()) {
            Ok(status) => {
                assert!(status.sessions >= 1);
                return;
            }
            Err(error) => {
                last_error = Some(error);
                std::thread::yield_now();
            }
        }
    }
    panic!("no session came free: {last_error:?}");
}
