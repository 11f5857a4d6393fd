//! Regression test: the control API never timed its connections out, so idle local connections (no
//! token is needed to connect) piled up until the daemon ran out of descriptors and consumer serving
//! went down with the API. Connections are now bounded (`--http-connections-max`: the rest wait in
//! the listen backlog, holding no descriptor of the daemon) and closed when they send no request
//! headers within `--http-idle-timeout`; the API answers again once idle connections are gone, and
//! consumers are served throughout.
//!
//! Only the headers were timed, though: a client that sent headers announcing a body and then
//! trickled or withheld the body kept its connection (and a blocked handler) for as long as it
//! liked. The whole body must now arrive within `--http-idle-timeout` of the headers
//! (`a_trickled_request_body_is_cut_off`).
//!
//! And `--http-connections-max` (256 by default) could exceed what the open descriptor limit leaves
//! consumers: under a low limit, idle connections still took every descriptor. The control API now
//! serves at most a quarter of the limit (`idle_connections_leave_descriptors_for_consumers`).

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use gpufeed_client::Client;

#[test]
fn idle_connections_are_bounded_and_closed() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let command = common::daemon::serve_command(
        &data,
        &["--http-connections-max", "4", "--http-idle-timeout", "1"],
    );
    let daemon = common::daemon::start(command, root.path());
    let address = daemon.address();
    // More idle connections than the limit: the first four are served (and timed out), the rest wait.
    let idle: Vec<TcpStream> = (0..12)
        .map(|_| TcpStream::connect(address).unwrap())
        .collect();
    // Consumers are served meanwhile.
    let status = Client::connect(&daemon.socket).unwrap().status().unwrap();
    assert_eq!(status.streams, 0);
    // Every idle connection is closed by the daemon within a bound (the read returns end of file,
    // or an error, instead of blocking until the test's own deadline).
    let started = Instant::now();
    for mut connection in idle {
        connection
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut byte = [0u8; 1];
        match connection.read(&mut byte) {
            Ok(0) => {}
            Err(error) if error.kind() != std::io::ErrorKind::WouldBlock => {}
            other => panic!("an idle connection was not closed: {other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    // A kept-alive connection that went idle after a request is closed too.
    let mut kept = TcpStream::connect(address).unwrap();
    std::io::Write::write_all(&mut kept, b"GET /healthz HTTP/1.1\r\nHost: gpufeed\r\n\r\n")
        .unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut reply = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match kept.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buffer[..n]),
            Err(error) => panic!("the idle kept-alive connection was not closed: {error}"),
        }
    }
    assert!(
        reply.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&reply)
    );
    // And the API answers again.
    let reply = common::http::request(address, "GET", "/v1/status", &[], None);
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
}

#[test]
fn a_trickled_request_body_is_cut_off() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let command = common::daemon::serve_command(&data, &["--http-idle-timeout", "1"]);
    let daemon = common::daemon::start(command, root.path());
    let mut connection = TcpStream::connect(daemon.address()).unwrap();
    std::io::Write::write_all(
        &mut connection,
        b"POST /v1/datasets HTTP/1.1\r\nHost: gpufeed\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"na",
    )
    .unwrap();
    // The rest of the body, a byte every 200 ms: each within the timeout, the whole far beyond it.
    let mut trickler = connection.try_clone().unwrap();
    let trickling = std::thread::spawn(move || {
        for _ in 0..96 {
            if std::io::Write::write_all(&mut trickler, b" ").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    // The daemon answers 408 and closes the connection (before the fix it waited for the whole
    // body, some 19 s, and answered 400 for the JSON).
    connection
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let mut reply = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match connection.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buffer[..n]),
            Err(error) => panic!(
                "the connection was not closed: {error}; so far: {}",
                String::from_utf8_lossy(&reply)
            ),
        }
    }
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("request_timeout"), "{reply}");
    drop(connection);
    trickling.join().unwrap();
}

#[test]
fn idle_connections_leave_descriptors_for_consumers() {
    use std::os::unix::process::CommandExt;

    use gpufeed_client::protocol::Message;
    use gpufeed_client::{transport, StreamSpec};

    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let bytes: Vec<u8> = (0..64u32).flat_map(u32::to_le_bytes).collect();
    common::pack_fields(
        &data.join("tiny"),
        &[common::field("v", gpufeed_client::DType::U32, &[4], bytes)],
        &common::options("tiny", 64 << 10, None),
    );
    // A daemon whose open descriptor limit (soft and hard: it cannot raise it) is 128, with the
    // default --http-connections-max of 256.
    let mut command = common::daemon::serve_command(&data, &[]);
    // SAFETY: setrlimit is async-signal-safe and touches only the child's own limits.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 128,
                rlim_max: 128,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let daemon = common::daemon::start(command, root.path());
    // More idle connections than the limit has descriptors. Each is answered (accepted) or waits in
    // the listen backlog; none is closed before the idle timeout (30 s).
    let idle: Vec<TcpStream> = (0..150)
        .map(|_| TcpStream::connect(daemon.address()).unwrap())
        .collect();
    // A consumer is still welcomed...
    let socket = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let hello = Message::Hello {
        client: "http_limits".into(),
    };
    transport::send(&socket, &hello, &[]).unwrap();
    match transport::recv(&socket) {
        Ok((Message::Welcome { .. }, _)) => {}
        other => panic!("no Welcome: {other:?}; log:\n{}", daemon.log()),
    }
    drop(socket);
    // ...and served: its stream's shard, ring and slots take descriptors too (before the fix the
    // stream was refused: "shard ... cannot be read: Too many open files").
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(StreamSpec::new("tiny", 8))
        .unwrap();
    assert!(stream.next().unwrap().is_ok());
    drop(stream);
    assert!(
        daemon
            .log()
            .contains("serving at most 32 control API connections"),
        "{}",
        daemon.log()
    );
    drop(idle);
}
