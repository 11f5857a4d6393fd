//! Regression test: the daemon's log carried ANSI colour codes when written to a file (a journal, a
//! redirect), which makes it hard to read and to grep. Colour is now used only on a terminal, and
//! never with `NO_COLOR` set (`no_color_turns_colour_off_on_a_terminal`, on a pseudo-terminal).

mod common;

#[test]
fn a_log_written_to_a_file_has_no_colour_codes() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let mut daemon = common::daemon::start(common::daemon::serve_command(&data, &[]), root.path());
    daemon.signal_and_wait(libc::SIGTERM);
    let log = daemon.log();
    assert!(log.contains("INFO"), "the daemon logged nothing: {log:?}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in the log file:\n{log}"
    );
}

/// With `NO_COLOR` set the log is plain even on a terminal (https://no-color.org); without it, the
/// same terminal gets colour, which shows the terminal is one the daemon recognises.
#[test]
fn no_color_turns_colour_off_on_a_terminal() {
    assert!(
        !terminal_log(Colour::NoColor).contains('\u{1b}'),
        "colour codes on a terminal with NO_COLOR set"
    );
    assert!(
        terminal_log(Colour::Default).contains('\u{1b}'),
        "no colour on a terminal without NO_COLOR: the test's terminal is not seen as one"
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Colour {
    NoColor,
    Default,
}

/// What a daemon, started and stopped with SIGTERM, writes to its standard error when that is a
/// pseudo-terminal.
fn terminal_log(colour: Colour) -> String {
    use std::io::Read;
    use std::os::fd::FromRawFd;

    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    // SAFETY: posix_openpt, grantpt, unlockpt and ptsname_r are called on the descriptor just opened
    // here, and ptsname_r writes at most `name.len()` bytes into the buffer given.
    let (terminal, name) = unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        assert!(
            master >= 0,
            "posix_openpt: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::grantpt(master), 0);
        assert_eq!(libc::unlockpt(master), 0);
        let mut name = [0u8; 128];
        assert_eq!(
            libc::ptsname_r(master, name.as_mut_ptr().cast(), name.len()),
            0
        );
        let end = name.iter().position(|&b| b == 0).unwrap();
        (
            std::fs::File::from_raw_fd(master),
            String::from_utf8(name[..end].to_vec()).unwrap(),
        )
    };
    let follower = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&name)
        .unwrap();
    let mut command = common::daemon::serve_command(&data, &["--http", "off"]);
    command
        .env_remove("NO_COLOR")
        .stdout(std::process::Stdio::null())
        .stderr(follower);
    if colour == Colour::NoColor {
        command.env("NO_COLOR", "1");
    }
    // The terminal is read until the daemon's first log line; a read error (EIO: the daemon, the
    // last holder of the follower side, is gone) ends it too.
    let reading = std::thread::spawn(move || {
        let mut terminal = terminal;
        let mut log = Vec::new();
        let mut buffer = [0u8; 4096];
        while let Ok(n) = terminal.read(&mut buffer) {
            if n == 0 {
                break;
            }
            log.extend_from_slice(&buffer[..n]);
            // One whole line logged at start-up is enough.
            if String::from_utf8_lossy(&log).contains("INFO") && log.ends_with(b"\n") {
                break;
            }
        }
        (terminal, log)
    });
    let mut child = command.spawn().unwrap();
    drop(command);
    let (terminal, log) = reading.join().unwrap();
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    child.wait().unwrap();
    drop(terminal);
    let log = String::from_utf8_lossy(&log).into_owned();
    assert!(log.contains("INFO"), "the daemon logged nothing: {log:?}");
    log
}
