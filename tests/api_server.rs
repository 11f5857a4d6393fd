//! The control API over TCP against the `gpufeed serve` binary: the readiness lines, every kind of
//! request error on the wire (malformed JSON, unknown fields, oversized bodies with and without a
//! truthful Content-Length, unknown routes), the token from the environment, the refusal to listen
//! beyond loopback without a token, configuration layering (file, environment, flags), and a clean
//! exit on SIGTERM that stops a running pack job, removes the socket and leaves a valid catalog.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;

use common::daemon::{serve_command, start};
use common::http::{get, request, send_json};
use common::{staging_dirs, write_tokens_npy};
use gpufeed::catalog::{CatalogData, CATALOG_FILE_NAME};
use serde_json::{json, Value};

const TOKEN: &str = "server-test-token-0123456789";

fn scratch() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    write_tokens_npy(&root.path().join("tokens.npy"), 2000);
    root
}

fn logs(root: &Path) -> std::path::PathBuf {
    root.join("logs")
}

#[test]
fn every_endpoint_answers_over_tcp_and_errors_are_json() {
    let root = scratch();
    let daemon = start(
        serve_command(root.path(), &["--body-limit", "4K"]),
        &logs(root.path()),
    );
    let address = daemon.address();

    assert_eq!(
        get(address, "/healthz", None).json(),
        json!({"status": "ok"})
    );
    let document = get(address, "/openapi.json", None).json();
    assert_eq!(document["paths"].as_object().unwrap().len(), 15);

    // A pack job through the API, then the dataset it made.
    let source =
        json!({"fields": [{"name": "tokens", "npy": ["tokens.npy"]}], "block_bytes": 8192});
    let accepted = send_json(
        address,
        "POST",
        "/v1/datasets",
        &json!({"name": "made", "source": source}),
        None,
    );
    assert_eq!(accepted.status, 202, "{}", accepted.json());
    let id = accepted.json()["id"].as_u64().unwrap();
    assert_eq!(
        accepted.header("location"),
        Some(format!("/v1/jobs/{id}").as_str())
    );
    let job = get(address, &format!("/v1/jobs/{id}?wait_s=60"), None).json();
    assert_eq!(job["state"], "succeeded", "{job}");
    let detail = get(address, "/v1/datasets/made", None).json();
    assert_eq!(detail["summary"]["samples"], 2000);
    let verified = request(address, "POST", "/v1/datasets/made/verify", &[], None).json();
    assert_eq!(verified["ok"], true, "{verified}");
    assert_eq!(get(address, "/v1/jobs", None).json()["jobs"][0]["id"], id);
    let sessions = get(address, "/v1/sessions", None).json();
    assert_eq!(sessions["open_sessions"], 0);
    let status = get(address, "/v1/status", None).json();
    assert_eq!(status["pools"]["socket_server"], true);
    assert_eq!(status["datasets"], 1);
    let metrics = get(address, "/metrics", None);
    assert!(metrics
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));
    assert!(String::from_utf8_lossy(&metrics.body).contains("gpufeed_datasets{state=\"ready\"} 1"));

    // Errors on the wire.
    let json_header = [("Content-Type", "application/json")];
    request(
        address,
        "POST",
        "/v1/datasets",
        &json_header,
        Some(b"{\"name\":"),
    )
    .assert_error(400, "invalid_json");
    request(
        address,
        "POST",
        "/v1/datasets",
        &json_header,
        Some(b"{\"name\": \"x\", \"path\": \"made\", \"extra\": true}"),
    )
    .assert_error(400, "invalid_json");
    request(address, "POST", "/v1/datasets", &[], Some(b"{}"))
        .assert_error(415, "unsupported_media_type");
    let big = vec![b' '; 64 << 10];
    request(address, "POST", "/v1/datasets", &json_header, Some(&big))
        .assert_error(413, "payload_too_large");
    send_json(
        address,
        "POST",
        "/v1/datasets",
        &json!({"name": "made", "path": "made"}),
        None,
    )
    .assert_error(409, "conflict");
    send_json(
        address,
        "POST",
        "/v1/datasets",
        &json!({"name": "etc", "path": "/etc"}),
        None,
    )
    .assert_error(403, "path_outside_root");
    get(address, "/v1/nothing", None).assert_error(404, "not_found");
    request(address, "PUT", "/v1/status", &[], None).assert_error(405, "method_not_allowed");
    request(address, "DELETE", "/v1/sessions/12", &[], None).assert_error(404, "not_found");

    // A chunked body larger than the limit, which announces no length up front.
    let mut stream = TcpStream::connect(address).unwrap();
    let chunk = vec![b'x'; 8192];
    write!(
        stream,
        "POST /v1/datasets HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        chunk.len()
    )
    .unwrap();
    let _ = stream.write_all(&chunk);
    let _ = stream.write_all(b"\r\n0\r\n\r\n");
    let mut raw = Vec::new();
    let _ = std::io::Read::read_to_end(&mut stream, &mut raw);
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("payload_too_large"), "{text}");

    let removed = request(address, "DELETE", "/v1/datasets/made", &[], None);
    assert_eq!(removed.status, 200, "{}", removed.json());
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
}

#[test]
fn the_token_from_the_environment_guards_mutations() {
    let root = scratch();
    let mut command = serve_command(root.path(), &[]);
    command.env("GPUFEED_API_TOKEN", TOKEN);
    let daemon = start(command, &logs(root.path()));
    let address = daemon.address();
    assert_eq!(get(address, "/v1/datasets", None).status, 200);
    let body = json!({"name": "p", "source": {"fields": [{"name": "t", "npy": ["tokens.npy"]}]}});
    let refused = send_json(address, "POST", "/v1/datasets", &body, None);
    refused.assert_error(401, "unauthorized");
    assert!(refused
        .header("www-authenticate")
        .unwrap()
        .starts_with("Bearer"));
    send_json(
        address,
        "POST",
        "/v1/datasets",
        &body,
        Some("wrong-token-0123456789"),
    )
    .assert_error(401, "unauthorized");
    let accepted = send_json(address, "POST", "/v1/datasets", &body, Some(TOKEN));
    assert_eq!(accepted.status, 202, "{}", accepted.json());
    request(address, "DELETE", "/v1/jobs/1", &[], None).assert_error(401, "unauthorized");
}

#[test]
fn a_non_loopback_address_without_a_token_refuses_to_start() {
    let root = scratch();
    let output = serve_command(root.path(), &["--http", "0.0.0.0:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("not a loopback address"), "{stderr}");
    assert!(output.stdout.is_empty(), "nothing was announced");
    assert!(!root.path().join("api-test.sock").exists());
}

#[test]
fn settings_layer_file_then_environment_then_flags() {
    let root = scratch();
    let config = root.path().join("gpufeed.toml");
    // The file turns the API off and sets a tiny body limit; the environment turns the API on
    // again; a flag raises the body limit.
    std::fs::write(
        &config,
        format!(
            "data_root = {:?}\nhttp = \"off\"\nbody_limit = \"1K\"\njobs_max = 1\n",
            root.path().to_str().unwrap()
        ),
    )
    .unwrap();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed"));
    command
        .args(["serve", "--device", "cpu", "--config"])
        .arg(&config)
        .args(["--body-limit", "16K"])
        .env("GPUFEED_HTTP", "127.0.0.1:0")
        .env("GPUFEED_SOCKET", root.path().join("layered.sock"))
        .env_remove("GPUFEED_API_TOKEN");
    let daemon = start(command, &logs(root.path()));
    assert_eq!(daemon.socket, root.path().join("layered.sock"));
    let padded = json!({"name": "x", "path": "y/".repeat(4 << 10)});
    // 8 KiB passes the flag's limit (the file's 1K would refuse it): the path is then not found.
    send_json(daemon.address(), "POST", "/v1/datasets", &padded, None)
        .assert_error(400, "path_not_found");
    // A name longer than the file system allows is the request's fault, not the daemon's.
    let too_long = json!({"name": "x", "path": "y".repeat(4 << 10)});
    send_json(daemon.address(), "POST", "/v1/datasets", &too_long, None)
        .assert_error(400, "bad_request");
    let status = get(daemon.address(), "/v1/status", None).json();
    assert_eq!(status["pools"]["jobs_running_max"], 1, "from the file");

    // A misspelt key in the file is an error naming it.
    std::fs::write(&config, "data_rot = \"/x\"\n").unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("data_rot"));
}

#[test]
fn sigterm_stops_jobs_removes_the_socket_and_exits_zero() {
    let root = tempfile::tempdir().unwrap();
    write_tokens_npy(&root.path().join("tokens.npy"), 64 * 1024);
    let mut daemon = start(
        serve_command(
            root.path(),
            &["--pack-rate-max", "512K", "--pack-threads", "1"],
        ),
        &logs(root.path()),
    );
    let address = daemon.address();
    let body = json!({"name": "slow", "source": {"fields": [{"name": "t", "npy": ["tokens.npy"]}], "block_bytes": 4096}});
    let accepted = send_json(address, "POST", "/v1/datasets", &body, None);
    assert_eq!(accepted.status, 202);
    let mut progressed = false;
    for _ in 0..2000 {
        let job = get(address, "/v1/jobs/1", None).json();
        if job["raw_bytes_done"].as_u64().unwrap() > 0 {
            progressed = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(progressed, "the job never made progress");
    assert!(!staging_dirs(root.path(), "slow").is_empty());

    let status = daemon.signal_and_wait(libc::SIGTERM);
    assert_eq!(status.code(), Some(0), "log:\n{}", daemon.log());
    assert!(!daemon.socket.exists(), "the socket file is removed");
    assert!(
        !daemon.log().contains("did not stop"),
        "the socket server's accept loop must stop:\n{}",
        daemon.log()
    );
    assert!(
        staging_dirs(root.path(), "slow").is_empty(),
        "the stopped job cleaned up"
    );
    assert!(!root.path().join("slow").exists());
    let bytes = std::fs::read(root.path().join(CATALOG_FILE_NAME)).unwrap();
    let catalog = CatalogData::from_json(Path::new("catalog"), &bytes).unwrap();
    let job = &catalog.jobs[&1];
    assert_eq!(job.state, gpufeed::catalog::JobState::Failed);
    assert!(
        job.error.as_deref().unwrap().contains("shut down"),
        "{job:?}"
    );
    assert!(!catalog.datasets.contains_key("slow"));
    let log = daemon.log();
    assert!(log.contains("SIGTERM: shutting down"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

/// The socket's readiness line comes first and unchanged, for supervisors that read only it.
#[test]
fn the_socket_readiness_line_is_unchanged() {
    let root = scratch();
    gpufeed_pack(root.path());
    let daemon = start(serve_command(root.path(), &[]), &logs(root.path()));
    assert_eq!(
        daemon.first_line,
        format!(
            "gpufeed: serving 1 dataset(s) on {}",
            root.path().join("api-test.sock").display()
        )
    );
    let listed: Value = get(daemon.address(), "/v1/datasets", None).json();
    assert_eq!(listed["datasets"][0]["origin"], "scanned");
}

fn gpufeed_pack(root: &Path) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(["pack", "--quiet", "--out"])
        .arg(root.join("packed"))
        .arg(root.join("tokens.npy"))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The control API sees the socket server's sessions: a consumer with an open stream is listed with its
/// dataset, `DELETE /v1/sessions/{id}` ends it (the consumer gets an error naming the closure, its slots
/// are freed), and a forced dataset removal closes the streams that read it.
#[test]
fn sessions_are_listed_and_closed_through_the_api() {
    use gpufeed_client::protocol::ErrorCode;
    use gpufeed_client::{Client, ClientError, StreamSpec};

    let root = scratch();
    gpufeed_pack(root.path());
    let daemon = start(
        serve_command(root.path(), &["--api-token", TOKEN]),
        &logs(root.path()),
    );
    let client = Client::connect(&daemon.socket).unwrap();
    let session = client.session();
    let mut stream = client.open_stream(StreamSpec::new("packed", 10)).unwrap();
    let first = stream.next().unwrap().unwrap();
    drop(first);

    // The serving path feeds the metrics: bytes read and hand-off latency here; the slot gauges are
    // checked once the streams are closed, when they must all be back at zero. The filler
    // records a hand-off after its send returns, which may be after the consumer saw the batch, so
    // the test waits for the count rather than reading it once.
    let value = |metrics: &str, prefix: &str| -> f64 {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(prefix))
            .and_then(|rest| rest.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in:\n{metrics}"))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let metrics = loop {
        let metrics = String::from_utf8(get(daemon.address(), "/metrics", None).body).unwrap();
        if value(&metrics, "gpufeed_handoff_latency_seconds_count") >= 1.0 {
            break metrics;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no hand-off recorded:\n{metrics}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // Blocks whose pages are cached are read from the page cache, the others by the read engine.
    let read = value(&metrics, "gpufeed_read_bytes_total{engine=\"io_uring\"}")
        + value(&metrics, "gpufeed_read_bytes_total{engine=\"pread\"}")
        + value(&metrics, "gpufeed_read_bytes_total{engine=\"page_cache\"}");
    assert!(read > 0.0, "{metrics}");
    // Slot rings are sized in bytes: small batches get more slots than the prefetch depth, and every
    // one of them may be published to the consumer.
    let consumer = value(&metrics, "gpufeed_slots{lease=\"consumer\"}");
    let allocated = value(&metrics, "gpufeed_slots_allocated");
    assert!(consumer <= allocated && allocated <= 64.0, "{metrics}");

    let listed = get(daemon.address(), "/v1/sessions", None).json();
    let sessions = listed["sessions"].as_array().expect("sessions are listed");
    let entry = sessions
        .iter()
        .find(|s| s["id"] == session)
        .unwrap_or_else(|| panic!("session {session} not in {listed}"));
    assert_eq!(entry["dataset"], "packed", "{entry}");

    let deleted = request(
        daemon.address(),
        "DELETE",
        &format!("/v1/sessions/{session}"),
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        None,
    );
    assert!(deleted.status < 300, "{}", deleted.status);
    let ended = stream
        .by_ref()
        .find_map(Result::err)
        .expect("the stream ends");
    match ended {
        ClientError::Daemon { code, message } => {
            assert_eq!(code, ErrorCode::Closed);
            // Said in words, not Rust internals (it read "session closed by the daemon: Operator").
            assert!(
                !message.contains("Operator")
                    && !message.contains("Some(")
                    && !message.contains("::"),
                "{message}"
            );
        }
        // The socket may be shut down before the error frame is read.
        ClientError::Transport(_) | ClientError::Ended(_) => {}
        other => panic!("unexpected error {other}"),
    }
    drop(stream);
    // The session leaves the directory once its thread has freed the stream.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let listed = get(daemon.address(), "/v1/sessions", None).json();
        let still = listed["sessions"]
            .as_array()
            .is_some_and(|s| s.iter().any(|e| e["id"] == session));
        if !still {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "session never left: {listed}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = Client::connect(&daemon.socket).unwrap().status().unwrap();
    assert_eq!(status.slots_allocated, 0, "{status:?}");
    // A forced removal of the dataset closes the streams reading it; without force it is refused.
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(StreamSpec::new("packed", 10))
        .unwrap();
    drop(stream.next().unwrap().unwrap());
    let auth = format!("Bearer {TOKEN}");
    let refused = request(
        daemon.address(),
        "DELETE",
        "/v1/datasets/packed",
        &[("Authorization", &auth)],
        None,
    );
    refused.assert_error(409, "in_use");
    let forced = request(
        daemon.address(),
        "DELETE",
        "/v1/datasets/packed?force=true",
        &[("Authorization", &auth)],
        None,
    );
    assert!(forced.status < 300, "{}", forced.status);
    assert_eq!(forced.json()["streams_closed"], 1, "{}", forced.json());
    // The closed stream let go of the dataset before the answer (it reported 1 reference left).
    assert_eq!(forced.json()["references_left"], 0, "{}", forced.json());
    assert!(
        stream.by_ref().any(|r| r.is_err()),
        "the stream must end with an error"
    );
    drop(stream);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while Client::connect(&daemon.socket)
        .unwrap()
        .status()
        .unwrap()
        .slots_allocated
        != 0
    {
        assert!(std::time::Instant::now() < deadline, "slots never freed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    let metrics = String::from_utf8(get(daemon.address(), "/metrics", None).body).unwrap();
    for lease in ["free", "filling", "consumer"] {
        let line = format!("gpufeed_slots{{lease=\"{lease}\"}} 0");
        assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    }
}

/// Issue 16, item 11, over HTTP: a cancel that arrived while a rate-limited pack job held back its
/// last step (every byte written, the commit next) answered 409 "already succeeded" and installed
/// the dataset. The job here is one step (4 KiB at 100 bytes a second): once its progress shows
/// every byte done, it is in that last wait for about 40 s, so the cancel lands there whatever the
/// machine's speed, and must cancel it.
#[test]
fn cancelling_a_rate_limited_pack_in_its_last_step_cancels_it() {
    let root = tempfile::tempdir().unwrap();
    // 64 samples of 16 i32: 4096 bytes, one block, one step of the packer.
    write_tokens_npy(&root.path().join("tokens.npy"), 64);
    let daemon = start(
        serve_command(
            root.path(),
            &["--pack-rate-max", "100", "--pack-threads", "1"],
        ),
        &logs(root.path()),
    );
    let address = daemon.address();
    let body = json!({"name": "late", "source": {"fields": [{"name": "t", "npy": ["tokens.npy"]}], "block_bytes": 4096}});
    let accepted = send_json(address, "POST", "/v1/datasets", &body, None);
    assert_eq!(accepted.status, 202, "{}", accepted.json());
    let id = accepted.json()["id"].as_u64().unwrap();
    let mut last_step = false;
    for _ in 0..2000 {
        let job = get(address, &format!("/v1/jobs/{id}"), None).json();
        // Queued until a packing thread takes it, then running.
        assert!(
            job["state"] == "queued" || job["state"] == "running",
            "{job}"
        );
        let total = job["raw_bytes_total"].as_u64().unwrap();
        if total > 0 && job["raw_bytes_done"].as_u64().unwrap() == total {
            last_step = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(last_step, "the job never wrote its last block");

    let cancelled = request(address, "DELETE", &format!("/v1/jobs/{id}"), &[], None);
    assert_eq!(cancelled.status, 200, "{}", cancelled.json());
    assert_eq!(
        cancelled.json()["state"],
        "cancelled",
        "{}",
        cancelled.json()
    );
    get(address, "/v1/datasets/late", None).assert_error(404, "not_found");
    assert!(
        !root.path().join("late").exists(),
        "the dataset was installed"
    );
    assert!(
        staging_dirs(root.path(), "late").is_empty(),
        "the cancelled job cleaned up"
    );
    let job = get(address, &format!("/v1/jobs/{id}"), None).json();
    assert_eq!(job["state"], "cancelled", "{job}");
}

/// Regression: requests whose head the HTTP layer cannot parse (a `Content-Length` too large for a
/// number, a repeated one, more headers than allowed) were answered 400 or 431 with an empty body,
/// unlike every other error of the API, which has a JSON body with a stable `code`.
#[test]
fn unparsable_request_heads_get_json_errors() {
    let root = scratch();
    let daemon = start(serve_command(root.path(), &[]), &logs(root.path()));
    let address = daemon.address();
    request(
        address,
        "POST",
        "/v1/datasets",
        &[("Content-Length", "99999999999999999999999")],
        None,
    )
    .assert_error(400, "bad_request");
    request(
        address,
        "POST",
        "/v1/datasets",
        &[("Content-Length", "2"), ("Content-Length", "3")],
        None,
    )
    .assert_error(400, "bad_request");
    let names: Vec<String> = (0..120).map(|i| format!("X-Header-{i}")).collect();
    let many: Vec<(&str, &str)> = names.iter().map(|name| (name.as_str(), "1")).collect();
    let reply = request(address, "GET", "/healthz", &many, None);
    reply.assert_error(431, "headers_too_large");
    assert_eq!(reply.header("content-type"), Some("application/json"));
    // The API goes on answering.
    assert_eq!(get(address, "/healthz", None).status, 200);
}

/// Regression: `serve --help` said `--registered-window` defaults to 256M; the code uses 64M. Every
/// default the help states for a setting with a plain default is checked against the code's.
#[test]
fn serve_help_states_the_defaults_the_code_uses() {
    use gpufeed::config as c;
    let output = common::gpufeed(["serve", "--help"]);
    let help = common::assert_succeeds(&output);
    // Each option's entry: from its line (`  -x, --flag` or `      --flag`) to the next option's.
    let mut entries: Vec<String> = Vec::new();
    for line in help.lines() {
        if line.trim_start().starts_with('-') && line.len() - line.trim_start().len() <= 6 {
            entries.push(String::new());
        }
        if let Some(entry) = entries.last_mut() {
            entry.push(' ');
            entry.push_str(line.trim());
        }
    }
    let mib = |bytes: u64| format!("{}M", bytes >> 20);
    let gib = |bytes: u64| format!("{}G", bytes >> 30);
    let expected: Vec<(&str, String)> = vec![
        ("--sessions-max", c::SESSIONS_MAX_DEFAULT.to_string()),
        ("--slot-memory-max", gib(c::SLOT_MEMORY_BYTES_MAX_DEFAULT)),
        ("--http <ADDR>", c::HTTP_ADDR_DEFAULT.to_string()),
        ("--body-limit", mib(c::BODY_BYTES_MAX_DEFAULT)),
        ("--jobs-max", c::JOBS_RUNNING_MAX_DEFAULT.to_string()),
        ("--jobs-queued-max", c::JOBS_QUEUED_MAX_DEFAULT.to_string()),
        ("--job-records-max", c::JOB_RECORDS_MAX_DEFAULT.to_string()),
        (
            "--registered-window",
            mib(c::REGISTERED_WINDOW_BYTES_DEFAULT),
        ),
        ("--device-shard-memory", gib(c::DEVICE_SHARD_BYTES_DEFAULT)),
        (
            "--loader-copy-threads",
            c::LOADER_COPY_THREADS_DEFAULT.to_string(),
        ),
        (
            "--rounds-in-flight",
            c::ROUNDS_IN_FLIGHT_DEFAULT.to_string(),
        ),
        ("--filler-spin-us", c::FILLER_SPIN_US_DEFAULT.to_string()),
        (
            "--gather-piece-kib",
            c::GATHER_PIECE_KIB_DEFAULT.to_string(),
        ),
        (
            "--inline-gather-tables",
            c::INLINE_GATHER_TABLES_DEFAULT.to_string(),
        ),
        ("--batch-group-max", c::BATCH_GROUP_MAX_DEFAULT.to_string()),
        ("--plan-threads", c::PLAN_THREADS_AUTOMATIC.to_string()),
        (
            "--device-pool-idle-s",
            c::DEVICE_POOL_IDLE_S_DEFAULT.to_string(),
        ),
        (
            "--http-connections-max",
            c::HTTP_CONNECTIONS_MAX_DEFAULT.to_string(),
        ),
        (
            "--http-idle-timeout",
            c::HTTP_IDLE_TIMEOUT_S_DEFAULT.to_string(),
        ),
    ];
    for (flag, default) in expected {
        let text = entries
            .iter()
            .find(|entry| entry.contains(&format!("{flag} ")))
            .unwrap_or_else(|| panic!("{flag} is not in the help: {help}"));
        let stated = text
            .split("Default: ")
            .nth(1)
            .unwrap_or_else(|| panic!("{flag} states no default: {text}"))
            .split([' ', ','])
            .next()
            .unwrap()
            .trim_end_matches('.');
        assert_eq!(stated, default, "{flag}: {text}");
    }
}
