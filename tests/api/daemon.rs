//! Helpers of the control API's process tests (`tests/api_server.rs`, `tests/api_restart.rs`): the
//! `gpufeed serve` binary as a child process and a minimal HTTP/1.1 client over `TcpStream`, small
//! enough to send exactly the malformed or oversized requests the tests need.

// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use gpufeed::input::npy;
use gpufeed_client::DType;
use serde_json::Value;

/// `gpufeed serve` as a child process; killed when dropped.
pub struct Daemon {
    pub child: Child,
    /// The first line on stdout: `gpufeed: serving N dataset(s) on SOCKET`.
    pub first_line: String,
    pub address: SocketAddr,
    pub socket: PathBuf,
    pub stderr_path: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The command line of a daemon on `root` with the API on a free loopback port (unless `extra`
/// gives `--http`).
pub fn serve_command(root: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpufeed"));
    command
        .args(["serve", "--data-root"])
        .arg(root)
        .arg("--socket")
        .arg(root.join("api-test.sock"))
        .args(["--device", "cpu"]);
    if !extra.contains(&"--http") {
        command.args(["--http", "127.0.0.1:0"]);
    }
    command
        .args(extra)
        .env_remove("GPUFEED_API_TOKEN")
        .env_remove("GPUFEED_CONFIG")
        .env_remove("GPUFEED_HTTP");
    command
}

/// Starts `command` and waits for its two readiness lines: the socket's, then the API's address.
pub fn start(mut command: Command, logs: &Path) -> Daemon {
    std::fs::create_dir_all(logs).unwrap();
    let stderr_path = logs.join(format!("daemon-{}.log", std::process::id()));
    let stderr = std::fs::File::options()
        .create(true)
        .append(true)
        .open(&stderr_path)
        .unwrap();
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start gpufeed serve");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let log = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(
        first.starts_with("gpufeed: serving"),
        "daemon said {first:?}; log:\n{}",
        log()
    );
    let socket = PathBuf::from(first.trim_end().rsplit(" on ").next().unwrap());
    let mut second = String::new();
    stdout.read_line(&mut second).unwrap();
    let address = second
        .trim_end()
        .strip_prefix("gpufeed: http on ")
        .unwrap_or_else(|| panic!("daemon said {second:?}; log:\n{}", log()))
        .parse()
        .unwrap();
    Daemon {
        child,
        first_line: first.trim_end().to_string(),
        address,
        socket,
        stderr_path,
    }
}

impl Daemon {
    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends `signal` (`libc::SIGTERM`, ...) and waits for the exit.
    pub fn signal_and_wait(&mut self, signal: libc::c_int) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
        self.child.wait().unwrap()
    }
}

/// An HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The body as JSON, panicking with the body if it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Asserts an error response with this status and code.
    pub fn assert_error(&self, status: u16, code: &str) {
        let body = self.json();
        assert_eq!(self.status, status, "{body}");
        assert_eq!(body["code"], code, "{body}");
        assert!(
            body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
    }
}

/// Sends one request (with `Connection: close`) and reads the whole response.
pub fn request(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Response {
    let mut stream = TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    if let Some(body) = body {
        // The server may answer (413) and close before reading all of an oversized body.
        let _ = stream.write_all(body);
    }
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Response {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete response: {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(n, v)| {
        n.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        let mut decoded = Vec::new();
        let mut rest = &body[..];
        loop {
            let end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size =
                usize::from_str_radix(std::str::from_utf8(&rest[..end]).unwrap(), 16).unwrap();
            if size == 0 {
                break;
            }
            decoded.extend_from_slice(&rest[end + 2..end + 2 + size]);
            rest = &rest[end + 2 + size + 2..];
        }
        body = decoded;
    }
    Response {
        status,
        headers,
        body,
    }
}

/// GET with an optional bearer token.
pub fn get(address: SocketAddr, path: &str, token: Option<&str>) -> Response {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    request(address, "GET", path, &headers, None)
}

/// A JSON request with an optional bearer token.
pub fn send_json(
    address: SocketAddr,
    method: &str,
    path: &str,
    body: &Value,
    token: Option<&str>,
) -> Response {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("Authorization", auth.as_str()));
    }
    request(
        address,
        method,
        path,
        &headers,
        Some(body.to_string().as_bytes()),
    )
}

/// Writes an `.npy` of `samples` i32 samples of 16 values, sample i holding i..i+16.
pub fn write_tokens_npy(path: &Path, samples: u64) {
    let mut writer = npy::write_npy(path, DType::I32, &[samples, 16]).unwrap();
    let mut chunk = Vec::with_capacity(1 << 20);
    for i in 0..samples {
        for j in 0..16u64 {
            chunk.extend_from_slice(&((i + j) as i32).to_le_bytes());
        }
        if chunk.len() >= 1 << 20 {
            writer.write_all(&chunk).unwrap();
            chunk.clear();
        }
    }
    writer.write_all(&chunk).unwrap();
    writer.finish().unwrap();
}

/// Staging directories a pack of `name` left in `root`.
pub fn staging_dirs(root: &Path, name: &str) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{name}.partial-"))
        })
        .map(|e| e.path())
        .collect()
}
