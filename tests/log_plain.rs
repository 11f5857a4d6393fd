//! Regression test: the daemon's log carried ANSI colour codes when written to a file (a journal, a
//! redirect), which makes it hard to read and to grep. Colour is now used only on a terminal, and
//! never with `NO_COLOR` set.

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
