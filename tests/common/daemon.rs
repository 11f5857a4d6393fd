//! `gpufeed serve` as a child process, for every test that runs the daemon: over its socket only
//! (`--http off`, [`start_daemon`]) or with its control API on a free loopback port
//! ([`serve_command`] and [`start`]).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

/// `gpufeed serve` as a child process; killed when dropped.
pub struct Daemon {
    /// The `gpufeed serve` process.
    pub child: Child,
    /// The first line on stdout: `gpufeed: serving N dataset(s) on SOCKET`.
    pub first_line: String,
    /// The socket it serves on, as it announced it.
    pub socket: PathBuf,
    /// Where the control API listens; `None` when it is off.
    pub http: Option<SocketAddr>,
    /// The file its standard error goes to, when it goes to one.
    pub stderr_path: Option<PathBuf>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// The control API's address; panics when the daemon runs without it.
    pub fn address(&self) -> SocketAddr {
        self.http
            .expect("this daemon was started with its control API")
    }

    /// The daemon's log so far (empty when its standard error does not go to a file).
    pub fn log(&self) -> String {
        self.stderr_path
            .as_ref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    }

    /// Sends `signal` (`libc::SIGTERM`, ...) and waits for the exit.
    pub fn signal_and_wait(&mut self, signal: libc::c_int) -> ExitStatus {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
        self.child.wait().unwrap()
    }
}

/// Whether a daemon being started announces a control API address after its socket.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ControlApi {
    Off,
    On,
}

/// Starts `binary serve` on the datasets under `root`, listening on `socket`, with `--device device
/// --http off` and `extra` arguments, its standard error going to `stderr`; returns once the daemon
/// accepts connections.
pub fn start_daemon(
    binary: &Path,
    root: &Path,
    socket: PathBuf,
    device: &str,
    extra: &[&str],
    stderr: Stdio,
) -> Daemon {
    start_daemon_env(binary, root, socket, device, extra, stderr, &[])
}

/// [`start_daemon`] with the variables `env` set in the daemon's environment.
pub fn start_daemon_env(
    binary: &Path,
    root: &Path,
    socket: PathBuf,
    device: &str,
    extra: &[&str],
    stderr: Stdio,
    env: &[(&str, &str)],
) -> Daemon {
    let mut command = Command::new(binary);
    command
        .args(["serve", "--data-root"])
        .arg(root)
        .arg("--socket")
        .arg(&socket)
        .args(["--device", device, "--http", "off"])
        .args(extra)
        // Device memory kept idle between streams stays kept for the test's length (an hour, not
        // 30 s): free-memory checks then compare the device before and after with the same kept.
        .env("GPUFEED_DEVICE_POOL_IDLE_S", "3600")
        .envs(env.iter().copied());
    spawn_ready(command, stderr, None, ControlApi::Off)
}

/// The command line of a CPU daemon on `root`, its socket `root/api-test.sock`, with the API on a
/// free loopback port (unless `extra` gives `--http`) and no token or settings from the environment.
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

/// Starts `command`, a daemon with its control API on, its standard error appended to a log file in
/// `logs`, and waits for its two readiness lines: the socket's, then the API's address.
pub fn start(command: Command, logs: &Path) -> Daemon {
    std::fs::create_dir_all(logs).unwrap();
    let stderr_path = logs.join(format!("daemon-{}.log", std::process::id()));
    let stderr = std::fs::File::options()
        .create(true)
        .append(true)
        .open(&stderr_path)
        .unwrap();
    spawn_ready(command, stderr.into(), Some(stderr_path), ControlApi::On)
}

/// Starts `command` and waits for its readiness lines rather than for a time: the socket's, then,
/// when the control API is on, its address.
fn spawn_ready(
    mut command: Command,
    stderr: Stdio,
    stderr_path: Option<PathBuf>,
    api: ControlApi,
) -> Daemon {
    let child = command
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start gpufeed serve");
    let mut daemon = Daemon {
        child,
        first_line: String::new(),
        socket: PathBuf::new(),
        http: None,
        stderr_path,
    };
    let mut stdout = BufReader::new(daemon.child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(
        first.starts_with("gpufeed: serving"),
        "daemon said {first:?}; log:\n{}",
        daemon.log()
    );
    daemon.socket = PathBuf::from(first.trim_end().rsplit(" on ").next().unwrap());
    daemon.first_line = first.trim_end().to_string();
    if api == ControlApi::On {
        let mut second = String::new();
        stdout.read_line(&mut second).unwrap();
        let address = second
            .trim_end()
            .strip_prefix("gpufeed: http on ")
            .unwrap_or_else(|| panic!("daemon said {second:?}; log:\n{}", daemon.log()))
            .parse()
            .unwrap();
        daemon.http = Some(address);
    }
    daemon
}

/// A CPU daemon serving `tiny` (64 samples of four u32, one field `v`, one shard) from
/// `root/data`, its socket `root/gpufeed.sock`.
pub fn tiny_cpu_daemon(root: &Path) -> Daemon {
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let bytes: Vec<u8> = (0..64u32).flat_map(u32::to_le_bytes).collect();
    super::pack_fields(
        &data.join("tiny"),
        &[super::field("v", gpufeed_client::DType::U32, &[4], bytes)],
        &super::options("tiny", 64 << 10, None),
    );
    start_daemon(
        Path::new(env!("CARGO_BIN_EXE_gpufeed")),
        &data,
        root.join("gpufeed.sock"),
        "cpu",
        &[],
        Stdio::null(),
    )
}
