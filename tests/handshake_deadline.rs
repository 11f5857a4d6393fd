//! Regression tests: consumer sessions had no handshake deadline, so connections that never sent
//! Hello held every session (`--sessions-max` of them) forever and no consumer could connect. A
//! connection that has not sent Hello within the deadline (10 s) is now told why and closed, and its
//! session is free again.
//!
//! The first deadline was a read timeout on the socket, which restarts with every byte received: a
//! client sending its Hello one byte at a time, each within the timeout, kept its session for as long
//! as it liked. The deadline now bounds the whole Hello
//! (`trickled_hello_is_cut_off_at_the_deadline`).

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

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

#[test]
fn trickled_hello_is_cut_off_at_the_deadline() {
    // The daemon's socket server in this process, with a short deadline so that the test is quick.
    let root = tempfile::tempdir().unwrap();
    let socket_path = root.path().join("gpufeed.sock");
    let metrics = Arc::new(gpufeed::metrics::Metrics::new());
    let server = gpufeed::ipc::Server::bind(
        gpufeed::ipc::ServerConfig {
            socket_path: socket_path.clone(),
            allowed_uids: vec![nix::unistd::getuid().as_raw()],
            sessions_max: 1,
            slot_memory_bytes_max: 1 << 20,
            stream_limits: gpufeed::pipeline::StreamLimits::node_defaults(),
            metrics: Arc::clone(&metrics),
            gpus: Vec::new(),
            handshake_timeout: Duration::from_millis(300),
        },
        Arc::new(gpufeed::registry::Registry::new()),
    )
    .unwrap();
    let stopper = server.stopper();
    let serving = std::thread::spawn(move || server.run());

    // A client sends a valid Hello one byte every 100 ms: every read completes well within the
    // deadline, the whole frame (tens of bytes) takes seconds.
    let mut trickler = UnixStream::connect(&socket_path).unwrap();
    let reader = trickler.try_clone().unwrap();
    let hello = Message::Hello {
        client: "a client that trickles its Hello".into(),
    }
    .encode();
    let trickling = std::thread::spawn(move || {
        for byte in hello {
            if trickler.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    // Before the fix the Hello completed and a Welcome came back; now the deadline cuts it off.
    match transport::recv(&reader) {
        Ok((Message::Error { code, message }, _)) => {
            assert_eq!(code, ErrorCode::BadFrame);
            assert!(message.contains("no Hello within"), "{message}");
        }
        other => panic!("expected an error frame, got {other:?}"),
    }
    drop(reader);
    trickling.join().unwrap();
    // Its session (the only one) is free again: a consumer connects and gets its Welcome. The
    // server releases a session just after sending the error, so allow it a few tries.
    let mut last_error = None;
    let mut welcomed = false;
    for _ in 0..50 {
        match Client::connect(&socket_path).and_then(|mut c| c.status()) {
            Ok(_) => {
                welcomed = true;
                break;
            }
            Err(error) => {
                last_error = Some(error);
                std::thread::yield_now();
            }
        }
    }
    assert!(welcomed, "no session came free: {last_error:?}");
    stopper.stop();
    serving.join().unwrap().unwrap();
}
