//! The service manager's readiness protocol (systemd's `sd_notify(3)`): `READY=1` once the daemon
//! serves, `STOPPING=1` when it begins shutting down, `STATUS=` lines saying what it does, and
//! `WATCHDOG=1` pings while its loops run, each a datagram sent to the Unix socket named by
//! `$NOTIFY_SOCKET` (a path, or an abstract name written with a leading `@`).
//!
//! Written over std's `UnixDatagram` rather than with a crate: the protocol is one datagram of
//! `KEY=VALUE` lines per state change, and std covers abstract addresses on Linux. Without
//! `$NOTIFY_SOCKET` (not run by a service manager) every call does nothing.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The variable naming the service manager's socket.
pub const NOTIFY_SOCKET_ENV_VAR: &str = "NOTIFY_SOCKET";
/// The variable giving the watchdog's timeout in microseconds.
pub const WATCHDOG_USEC_ENV_VAR: &str = "WATCHDOG_USEC";
/// The variable naming the process the watchdog expects pings from.
pub const WATCHDOG_PID_ENV_VAR: &str = "WATCHDOG_PID";

/// Longest `STATUS=` text sent: one line a person reads in `systemctl status`, well within a
/// datagram.
const STATUS_BYTES_MAX: usize = 512;

/// Why the notify variables could not be used. Each names the variable and its value.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `NOTIFY_SOCKET` is neither an absolute path nor `@` and an abstract name.
    #[error(
        "{NOTIFY_SOCKET_ENV_VAR}={value:?}: expected an absolute socket path or @ and an \
         abstract name"
    )]
    Address {
        /// The value.
        value: String,
    },
    /// The address could not be made into a socket address (too long, or holding a NUL byte).
    #[error("{NOTIFY_SOCKET_ENV_VAR}={value:?}")]
    AddressInvalid {
        /// The value.
        value: String,
        /// Why.
        source: io::Error,
    },
    /// `WATCHDOG_USEC` or `WATCHDOG_PID` is not a positive whole number.
    #[error("{variable}={value:?}: expected a positive whole number")]
    Number {
        /// The variable.
        variable: &'static str,
        /// The value.
        value: String,
    },
    /// The datagram socket the messages are sent from could not be created.
    #[error("creating a datagram socket for {NOTIFY_SOCKET_ENV_VAR}")]
    Socket(#[source] io::Error),
}

/// Where the messages go, once the variables have been read.
#[derive(Debug)]
struct Target {
    socket: UnixDatagram,
    address: SocketAddr,
    /// What `NOTIFY_SOCKET` said, for log lines.
    name: String,
}

/// The daemon's link to its service manager; inert when there is none.
#[derive(Debug)]
pub struct ServiceNotifier {
    target: Option<Target>,
    /// Half the watchdog's timeout: systemd's advice, so that one late ping does not kill the
    /// service. `None`: no watchdog, or it watches another process.
    watchdog_interval: Option<Duration>,
    /// Whether a failed send has been logged: a manager that went away would otherwise fill the log
    /// with one warning per ping.
    send_failure_logged: AtomicBool,
}

impl ServiceNotifier {
    /// A notifier that sends nothing (no service manager).
    pub fn inert() -> ServiceNotifier {
        ServiceNotifier {
            target: None,
            watchdog_interval: None,
            send_failure_logged: AtomicBool::new(false),
        }
    }

    /// Reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` from the process environment.
    pub fn from_environment() -> Result<ServiceNotifier, NotifyError> {
        let notify_socket = std::env::var_os(NOTIFY_SOCKET_ENV_VAR);
        let watchdog_usec = std::env::var_os(WATCHDOG_USEC_ENV_VAR);
        let watchdog_pid = std::env::var_os(WATCHDOG_PID_ENV_VAR);
        ServiceNotifier::from_values(
            notify_socket.as_deref(),
            watchdog_usec.as_deref(),
            watchdog_pid.as_deref(),
            std::process::id(),
        )
    }

    /// The notifier the three variables' values describe for the process `own_pid`. An unset or
    /// empty `notify_socket` gives an inert one. The watchdog is on when `watchdog_usec` is set and
    /// `watchdog_pid` is unset or `own_pid` (a manager may watch the main process of a service
    /// whose child this is; that child must not ping for it).
    pub fn from_values(
        notify_socket: Option<&OsStr>,
        watchdog_usec: Option<&OsStr>,
        watchdog_pid: Option<&OsStr>,
        own_pid: u32,
    ) -> Result<ServiceNotifier, NotifyError> {
        let Some(value) = notify_socket.filter(|v| !v.is_empty()) else {
            return Ok(ServiceNotifier::inert());
        };
        let address = socket_address(value)?;
        let socket = UnixDatagram::unbound().map_err(NotifyError::Socket)?;
        let usec = positive(WATCHDOG_USEC_ENV_VAR, watchdog_usec)?;
        let pid = positive(WATCHDOG_PID_ENV_VAR, watchdog_pid)?;
        let watched = pid.is_none_or(|pid| pid == u64::from(own_pid));
        Ok(ServiceNotifier {
            target: Some(Target {
                socket,
                address,
                name: value.to_string_lossy().into_owned(),
            }),
            watchdog_interval: usec
                .filter(|_| watched)
                .map(|usec| Duration::from_micros(usec / 2).max(Duration::from_millis(1))),
            send_failure_logged: AtomicBool::new(false),
        })
    }

    /// How often [`ServiceNotifier::watchdog`] must be called; `None` when no watchdog watches
    /// this process.
    pub fn watchdog_interval(&self) -> Option<Duration> {
        self.watchdog_interval
    }

    /// Tells the manager the daemon serves, with what it serves as its status.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}", status_line(status)));
    }

    /// Tells the manager the daemon has begun shutting down, and why.
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={}", status_line(status)));
    }

    /// Pings the watchdog: the caller has checked that the daemon's loops are alive.
    pub fn watchdog(&self) {
        if self.watchdog_interval.is_some() {
            self.send("WATCHDOG=1");
        }
    }

    /// Sends one message; a failure is logged once, and never stops the daemon: serving matters
    /// more than telling the manager about it.
    fn send(&self, message: &str) {
        let Some(target) = &self.target else {
            return;
        };
        if let Err(error) = target
            .socket
            .send_to_addr(message.as_bytes(), &target.address)
        {
            if !self.send_failure_logged.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "cannot notify the service manager at {NOTIFY_SOCKET_ENV_VAR}={}: {error}",
                    target.name
                );
            }
        }
    }
}

/// `status` on one line (a newline would start another `KEY=VALUE`), within [`STATUS_BYTES_MAX`].
fn status_line(status: &str) -> String {
    let mut line: String = status
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if line.len() > STATUS_BYTES_MAX {
        let mut end = STATUS_BYTES_MAX;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
    }
    line
}

/// The socket address `NOTIFY_SOCKET` names: `@name` is the abstract address `name` (Linux), any
/// other value must be an absolute path.
fn socket_address(value: &OsStr) -> Result<SocketAddr, NotifyError> {
    let text = value.to_string_lossy().into_owned();
    let invalid = |source| NotifyError::AddressInvalid {
        value: text.clone(),
        source,
    };
    if let Some(name) = value.as_bytes().strip_prefix(b"@") {
        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            return SocketAddr::from_abstract_name(name).map_err(invalid);
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = name;
            return Err(NotifyError::Address { value: text });
        }
    }
    let path = Path::new(value);
    if !path.is_absolute() {
        return Err(NotifyError::Address { value: text });
    }
    SocketAddr::from_pathname(path).map_err(invalid)
}

/// The positive whole number `value` holds, if set and not empty.
fn positive(variable: &'static str, value: Option<&OsStr>) -> Result<Option<u64>, NotifyError> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let text = value.to_string_lossy();
    match text.trim().parse::<u64>() {
        Ok(number) if number > 0 => Ok(Some(number)),
        _ => Err(NotifyError::Number {
            variable,
            value: text.into_owned(),
        }),
    }
}

/// Resolves at the next watchdog tick of `timer`, or never when there is no watchdog; for a
/// `tokio::select!` branch beside the daemon's other waits.
pub async fn next_watchdog_tick(timer: &mut Option<tokio::time::Interval>) {
    match timer {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notifier(socket: &str, usec: Option<&str>, pid: Option<&str>) -> ServiceNotifier {
        ServiceNotifier::from_values(
            Some(OsStr::new(socket)),
            usec.map(OsStr::new),
            pid.map(OsStr::new),
            42,
        )
        .unwrap()
    }

    #[test]
    fn without_a_socket_nothing_is_sent_and_no_watchdog_runs() {
        let inert = ServiceNotifier::from_values(None, Some(OsStr::new("1000")), None, 42).unwrap();
        assert!(inert.target.is_none());
        assert_eq!(inert.watchdog_interval(), None);
        let empty = notifier("", Some("1000"), None);
        assert!(empty.target.is_none());
    }

    #[test]
    fn the_watchdog_pings_at_half_its_timeout_only_for_the_watched_process() {
        let own = notifier("/run/notify", Some("4000000"), None);
        assert_eq!(own.watchdog_interval(), Some(Duration::from_secs(2)));
        let same = notifier("/run/notify", Some("4000000"), Some("42"));
        assert_eq!(same.watchdog_interval(), Some(Duration::from_secs(2)));
        let other = notifier("/run/notify", Some("4000000"), Some("7"));
        assert_eq!(other.watchdog_interval(), None);
        let off = notifier("/run/notify", None, None);
        assert_eq!(off.watchdog_interval(), None);
    }

    #[test]
    fn bad_values_are_refused_naming_the_variable() {
        let refused = |socket: &str, usec: Option<&str>| {
            ServiceNotifier::from_values(Some(OsStr::new(socket)), usec.map(OsStr::new), None, 42)
                .unwrap_err()
                .to_string()
        };
        assert!(refused("relative/notify", None).starts_with("NOTIFY_SOCKET=\"relative/notify\""));
        assert!(refused("vsock:2:1234", None).contains("expected an absolute socket path"));
        assert!(refused("/run/notify", Some("soon")).starts_with("WATCHDOG_USEC=\"soon\""));
        assert!(refused("/run/notify", Some("0")).contains("positive whole number"));
    }

    #[test]
    fn messages_reach_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        let by_path = notifier(path.to_str().unwrap(), Some("2000"), None);
        by_path.ready("serving\n2 datasets");
        by_path.watchdog();
        by_path.stopping("SIGTERM");
        let mut buffer = [0u8; 1024];
        let mut next = || {
            let n = listener.recv(&mut buffer).unwrap();
            String::from_utf8(buffer[..n].to_vec()).unwrap()
        };
        assert_eq!(next(), "READY=1\nSTATUS=serving 2 datasets");
        assert_eq!(next(), "WATCHDOG=1");
        assert_eq!(next(), "STOPPING=1\nSTATUS=SIGTERM");

        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            let name = format!("gpufeed-notify-test-{}", std::process::id());
            let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let abstract_listener = UnixDatagram::bind_addr(&address).unwrap();
            notifier(&format!("@{name}"), None, None).ready("up");
            let n = abstract_listener.recv(&mut buffer).unwrap();
            assert_eq!(&buffer[..n], b"READY=1\nSTATUS=up");
        }
    }

    #[test]
    fn a_status_is_one_line_of_bounded_length() {
        assert_eq!(status_line("a\nb\rc"), "a b c");
        let long = "é".repeat(STATUS_BYTES_MAX);
        let line = status_line(&long);
        assert!(line.len() <= STATUS_BYTES_MAX && line.len() >= STATUS_BYTES_MAX - 1);
    }
}
