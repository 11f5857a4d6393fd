//! Regression test: the control API never timed its connections out, so idle local connections (no
//! token is needed to connect) piled up until the daemon ran out of descriptors and consumer serving
//! went down with the API. Connections are now bounded (`--http-connections-max`: the rest wait in
//! the listen backlog, holding no descriptor of the daemon) and closed when they send no request
//! headers within `--http-idle-timeout`; the API answers again once idle connections are gone, and
//! consumers are served throughout.

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
