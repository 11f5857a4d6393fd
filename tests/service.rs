//! Running the daemon as a service: the service manager's notify protocol (`READY=1`, `STOPPING=1`,
//! watchdog pings) over a Unix datagram socket this test listens on, the JSON log format, and the
//! example configuration in `deploy/`.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Longest a test waits for one message from the daemon: far above what starting takes, so that a
/// slow machine does not fail the test, while a daemon that never notifies still ends it.
const MESSAGE_WAIT: Duration = Duration::from_secs(60);

/// A datagram socket standing in for the service manager, at `path` (or an abstract name).
struct Manager {
    socket: UnixDatagram,
}

impl Manager {
    fn bind(path: &Path) -> Manager {
        let socket = UnixDatagram::bind(path).unwrap();
        socket.set_read_timeout(Some(MESSAGE_WAIT)).unwrap();
        Manager { socket }
    }

    fn bind_abstract(name: &str) -> Manager {
        use std::os::linux::net::SocketAddrExt;
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name).unwrap();
        let socket = UnixDatagram::bind_addr(&address).unwrap();
        socket.set_read_timeout(Some(MESSAGE_WAIT)).unwrap();
        Manager { socket }
    }

    /// The next message, waiting at most [`MESSAGE_WAIT`].
    fn next(&self, log: impl Fn() -> String) -> String {
        let mut buffer = [0u8; 4096];
        match self.socket.recv(&mut buffer) {
            Ok(n) => String::from_utf8(buffer[..n].to_vec()).unwrap(),
            Err(error) => panic!("no notify message ({error}); daemon log:\n{}", log()),
        }
    }

    /// Messages until one has a line equal to `line`; returns them all, that one last.
    fn until(&self, line: &str, log: impl Fn() -> String) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let message = self.next(&log);
            let found = message.lines().any(|l| l == line);
            seen.push(message);
            if found {
                return seen;
            }
        }
    }
}

/// `gpufeed serve --device cpu` on an empty data root in `root`, told of the manager at `socket`
/// (and of a watchdog when `watchdog_usec` is given).
fn serve(root: &Path, notify_socket: &str, watchdog_usec: Option<&str>) -> Command {
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut command = common::daemon::serve_command(&data, &[]);
    command
        .env("NOTIFY_SOCKET", notify_socket)
        .env_remove("WATCHDOG_PID")
        .env_remove("GPUFEED_LOG_FORMAT");
    match watchdog_usec {
        Some(usec) => command.env("WATCHDOG_USEC", usec),
        None => command.env_remove("WATCHDOG_USEC"),
    };
    command
}

#[test]
fn the_daemon_says_ready_once_serving_and_stopping_on_sigterm() {
    let root = tempfile::tempdir().unwrap();
    let manager = Manager::bind(&root.path().join("notify"));
    let mut daemon = common::daemon::start(
        serve(
            root.path(),
            root.path().join("notify").to_str().unwrap(),
            None,
        ),
        root.path(),
    );
    let ready = manager.next(|| daemon.log());
    assert!(
        ready.lines().any(|l| l == "READY=1"),
        "first message {ready:?}"
    );
    assert!(
        ready.contains("STATUS=serving 0 dataset(s) on "),
        "no status in {ready:?}"
    );
    let status = daemon.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "exit {status:?}; log:\n{}", daemon.log());
    let stopping = manager.next(|| daemon.log());
    assert!(
        stopping.lines().any(|l| l == "STOPPING=1"),
        "after SIGTERM: {stopping:?}"
    );
    assert!(stopping.contains("STATUS=SIGTERM: shutting down"));
}

#[test]
fn an_abstract_notify_socket_is_reached() {
    let root = tempfile::tempdir().unwrap();
    let name = format!("gpufeed-service-test-{}", std::process::id());
    let manager = Manager::bind_abstract(&name);
    let daemon = common::daemon::start(serve(root.path(), &format!("@{name}"), None), root.path());
    let ready = manager.next(|| daemon.log());
    assert!(ready.lines().any(|l| l == "READY=1"), "got {ready:?}");
}

#[test]
fn the_watchdog_is_pinged_while_the_daemon_serves() {
    let root = tempfile::tempdir().unwrap();
    let manager = Manager::bind(&root.path().join("notify"));
    // A 20 ms timeout: pings every 10 ms, so that two come quickly.
    let mut daemon = common::daemon::start(
        serve(
            root.path(),
            root.path().join("notify").to_str().unwrap(),
            Some("20000"),
        ),
        root.path(),
    );
    let before_ready = manager.until("READY=1", || daemon.log());
    assert!(
        before_ready
            .iter()
            .all(|m| !m.lines().any(|l| l == "WATCHDOG=1")),
        "a watchdog ping before READY=1: {before_ready:?}"
    );
    manager.until("WATCHDOG=1", || daemon.log());
    manager.until("WATCHDOG=1", || daemon.log());
    daemon.signal_and_wait(libc::SIGTERM);
    manager.until("STOPPING=1", || daemon.log());
}

#[test]
fn a_watchdog_of_another_process_is_not_pinged() {
    let root = tempfile::tempdir().unwrap();
    let manager = Manager::bind(&root.path().join("notify"));
    let mut command = serve(
        root.path(),
        root.path().join("notify").to_str().unwrap(),
        Some("20000"),
    );
    // PID 1 is never the daemon: the manager watches another process of the service.
    command.env("WATCHDOG_PID", "1");
    let mut daemon = common::daemon::start(command, root.path());
    let ready = manager.next(|| daemon.log());
    assert!(ready.lines().any(|l| l == "READY=1"), "got {ready:?}");
    daemon.signal_and_wait(libc::SIGTERM);
    // Every message up to the daemon's exit has arrived (datagrams are queued in order), so the
    // next one is the last: STOPPING=1, with no ping between.
    let next = manager.next(|| daemon.log());
    assert!(next.lines().any(|l| l == "STOPPING=1"), "got {next:?}");
}

#[test]
fn a_bad_notify_socket_stops_the_start_naming_the_variable() {
    let root = tempfile::tempdir().unwrap();
    let output = serve(root.path(), "relative/notify", None)
        .output()
        .unwrap();
    let error = common::assert_fails(&output);
    assert!(
        error.contains("NOTIFY_SOCKET=\"relative/notify\""),
        "{error}"
    );
}

/// Every line a daemon writes to standard error with `format` chosen by `how`, from its start to its
/// exit on SIGTERM.
fn log_lines(how: &[(&str, &str)], args: &[&str]) -> Vec<String> {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let mut command = common::daemon::serve_command(&data, args);
    command
        .env_remove("NOTIFY_SOCKET")
        .env_remove("GPUFEED_LOG_FORMAT")
        .env_remove("GPUFEED_LOG");
    for (key, value) in how {
        command.env(key, value);
    }
    let mut daemon = common::daemon::start(command, root.path());
    let status = daemon.signal_and_wait(libc::SIGTERM);
    assert!(status.success(), "exit {status:?}");
    daemon.log().lines().map(str::to_string).collect()
}

fn assert_json_lines(lines: &[String]) {
    assert!(lines.len() >= 2, "too few log lines: {lines:?}");
    for line in lines {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {line:?}"));
        let object = value
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {line}"));
        for key in ["timestamp", "level", "fields"] {
            assert!(object.contains_key(key), "no {key:?} in {line}");
        }
    }
    assert!(
        lines.iter().any(|l| l.contains("SIGTERM: shutting down")),
        "the shutdown line is missing: {lines:?}"
    );
}

#[test]
fn log_format_json_writes_one_json_object_per_line() {
    assert_json_lines(&log_lines(&[], &["--log-format", "json"]));
    assert_json_lines(&log_lines(&[("GPUFEED_LOG_FORMAT", "json")], &[]));
    // The flag wins over the environment.
    let text = log_lines(&[("GPUFEED_LOG_FORMAT", "json")], &["--log-format", "text"]);
    assert!(
        text.iter().all(|l| !l.starts_with('{')),
        "JSON with --log-format text: {text:?}"
    );
    assert!(text.iter().any(|l| l.contains(" INFO ")), "{text:?}");
}

#[test]
fn a_bad_log_format_in_the_environment_is_refused_naming_the_variable() {
    let root = tempfile::tempdir().unwrap();
    let output = common::daemon::serve_command(root.path(), &[])
        .env("GPUFEED_LOG_FORMAT", "yaml")
        .output()
        .unwrap();
    let error = common::assert_fails(&output);
    assert!(error.contains("GPUFEED_LOG_FORMAT=\"yaml\""), "{error}");
}

/// `deploy/gpufeed.toml` parses, and names every key the configuration accepts (each has its
/// `GPUFEED_` variable), so that it stays a complete example as keys are added.
#[test]
fn the_example_configuration_parses_and_names_every_key() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/gpufeed.toml");
    let layer = gpufeed::config::ConfigLayer::from_toml_file(&path)
        .unwrap_or_else(|error| panic!("{}", gpufeed::error_chain(&error)));
    assert!(layer.data_root.is_some(), "the example sets no data_root");
    let text = std::fs::read_to_string(&path).unwrap();
    // The keys left commented out must parse too: the example's values are valid ones.
    let uncommented: String = text
        .lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(setting) if is_setting(setting) => format!("{setting}\n"),
            _ => format!("{line}\n"),
        })
        .collect();
    // Within their bounds too: both resolve to settings.
    for (what, text) in [("as given", &text), ("uncommented", &uncommented)] {
        gpufeed::config::ConfigLayer::from_toml_str(&path, text)
            .and_then(|layer| layer.resolve(1000))
            .unwrap_or_else(|error| panic!("{what}: {}", gpufeed::error_chain(&error)));
    }
    let missing: Vec<String> = gpufeed::config::ENV_VARS
        .iter()
        .map(|var| var.trim_start_matches("GPUFEED_").to_lowercase())
        .filter(|key| {
            !text.lines().any(|line| {
                line.trim_start_matches("# ")
                    .starts_with(&format!("{key} = "))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "keys missing from {}: {missing:?}",
        path.display()
    );
}

/// Whether `line` is a `key = value` line (a setting, not a sentence of a comment).
fn is_setting(line: &str) -> bool {
    line.split_once(" = ").is_some_and(|(key, _)| {
        !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
    })
}

/// `deploy/gpufeed.service` is a unit systemd accepts (`systemd-analyze verify`, with `ExecStart`
/// pointed at the binary under test, which must exist for the check). Where systemd-analyze is not
/// installed the test says so and checks nothing.
#[test]
fn the_example_unit_verifies() {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/gpufeed.service"),
    )
    .unwrap();
    assert!(
        unit.contains("\nType=notify\n"),
        "the unit is not Type=notify"
    );
    assert!(unit.contains("\nWatchdogSec="), "the unit sets no watchdog");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpufeed.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/gpufeed", env!("CARGO_BIN_EXE_gpufeed")),
    )
    .unwrap();
    let output = match Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
    {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("SKIPPED the_example_unit_verifies: systemd-analyze is not installed");
            return;
        }
        Err(error) => panic!("systemd-analyze: {error}"),
    };
    assert!(
        output.status.success() && output.stderr.is_empty(),
        "systemd-analyze verify: {:?}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}
