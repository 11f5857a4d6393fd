//! Regression tests (issue 16, item 12): `gpufeed inspect DIR | head` panicked with a backtrace when
//! `head` closed the pipe early (`println!` panics on EPIPE), and so did every other subcommand that
//! prints: `verify`, the demo's report, and the closing lines `pack` and `unpack` write to standard
//! error. The output now just ends, with exit status 0 and no panic message (`serve` is the exception:
//! a daemon does not report success because its start-up line could not be printed).

mod common;

use std::ffi::OsStr;
use std::process::{Command, Output, Stdio};

use gpufeed_client::DType;

/// Which of the command's outputs is a pipe closed before it writes.
#[derive(Clone, Copy)]
enum Closed {
    Stdout,
    Stderr,
}

/// Runs `gpufeed ARGS` with `closed` a pipe whose read end is closed at once, as `head -c 0` would;
/// the other output is captured.
fn run_with_closed<I, S>(args: I, closed: Closed) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    match closed {
        Closed::Stdout => drop(child.stdout.take()),
        Closed::Stderr => drop(child.stderr.take()),
    }
    child.wait_with_output().unwrap()
}

/// Asserts the command ended with status 0 and printed no panic message.
fn assert_quiet_success(output: &Output) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!text.contains("panicked"), "{text}");
    assert!(output.status.success(), "{:?}: {text}", output.status);
}

/// Packs a dataset of many shards (a JSON summary far larger than a pipe's buffer) into `dir`.
fn dataset(dir: &std::path::Path) {
    let bytes: Vec<u8> = (0..4000u32).flat_map(|i| i.to_le_bytes()).collect();
    common::pack_fields(
        dir,
        &[common::field("ids", DType::I32, &[1], bytes)],
        &common::options("set", 4096, Some(4)),
    );
}

#[test]
fn inspect_into_a_closed_pipe_ends_quietly() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("set");
    dataset(&dir);
    assert_quiet_success(&run_with_closed(
        [OsStr::new("inspect"), dir.as_os_str()],
        Closed::Stdout,
    ));
}

#[test]
fn verify_into_a_closed_pipe_ends_quietly() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("set");
    dataset(&dir);
    assert_quiet_success(&run_with_closed(
        [OsStr::new("verify"), OsStr::new("--quiet"), dir.as_os_str()],
        Closed::Stdout,
    ));
}

#[test]
fn demo_into_a_closed_pipe_ends_quietly() {
    let root = tempfile::tempdir().unwrap();
    assert_quiet_success(&run_with_closed(
        [
            OsStr::new("demo"),
            OsStr::new("--device"),
            OsStr::new("cpu"),
            OsStr::new("--samples"),
            OsStr::new("1000"),
            OsStr::new("--dir"),
            root.path().as_os_str(),
        ],
        Closed::Stdout,
    ));
}

#[test]
fn pack_and_unpack_with_a_closed_stderr_end_quietly() {
    let root = tempfile::tempdir().unwrap();
    let input = common::write_npy(
        &root.path().join("x.npy"),
        DType::U16,
        &[100, 3],
        &[7u8; 600],
    );
    let dir = root.path().join("set");
    let pack = [
        OsStr::new("pack"),
        OsStr::new("--quiet"),
        OsStr::new("--out"),
        dir.as_os_str(),
        input.as_os_str(),
    ];
    assert_quiet_success(&run_with_closed(pack, Closed::Stderr));
    assert!(dir.join("manifest.json").exists());
    let out = root.path().join("back.npy");
    let unpack = [
        OsStr::new("unpack"),
        dir.as_os_str(),
        OsStr::new("--field"),
        OsStr::new("data"),
        OsStr::new("--out"),
        out.as_os_str(),
        OsStr::new("--quiet"),
    ];
    assert_quiet_success(&run_with_closed(unpack, Closed::Stderr));
    assert_eq!(common::read_npy(&out).bytes, vec![7u8; 600]);
}
