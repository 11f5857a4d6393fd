//! Regression test for issue 16, item 2: `gpufeed serve --socket PATH` deleted a regular file at
//! PATH. To replace a stale socket left by a daemon that died, `Server::bind` removed anything at
//! the path it could not connect to, and nothing can connect to a regular file, so a user's file
//! named by a mistyped `--socket` vanished and the daemon started in its place. Only a stale
//! socket may be replaced: anything else (a file, a symbolic link) is left untouched and the daemon
//! refuses to start with an error naming the path.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::{Command, Stdio};

use common::daemon::start_daemon;
use gpufeed_client::consumer::Client;

/// Runs `gpufeed serve` on an empty data root with its socket at `socket`, expecting it to refuse to
/// start with an error naming the path. A daemon that starts instead announces itself on stdout: it is
/// then killed and the test fails, rather than waiting on a daemon that serves.
fn serve_refuses(root: &Path, socket: &Path) {
    let data_root = root.join("data");
    std::fs::create_dir_all(&data_root).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(["serve", "--data-root"])
        .arg(&data_root)
        .arg("--socket")
        .arg(socket)
        .args(["--device", "cpu", "--http", "off"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpufeed serve");
    let mut announced = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut announced)
        .unwrap();
    if !announced.is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "the daemon started over {} ({announced:?}); what was there is {}",
            socket.display(),
            if socket.exists() { "replaced" } else { "gone" }
        );
    }
    let output = child.wait_with_output().unwrap();
    let stderr = common::assert_fails(&output);
    assert!(
        stderr.contains(&socket.display().to_string()) && stderr.contains("not a socket"),
        "the error names the path and why: {stderr}"
    );
}

#[test]
fn a_regular_file_at_the_socket_path_is_left_alone() {
    let root = tempfile::tempdir().unwrap();
    let notes = root.path().join("notes.txt");
    std::fs::write(&notes, "a user's file\n").unwrap();
    serve_refuses(root.path(), &notes);
    assert_eq!(
        std::fs::read_to_string(&notes).unwrap(),
        "a user's file\n",
        "the file is intact"
    );
}

#[test]
fn a_symbolic_link_at_the_socket_path_is_left_alone() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("target.txt");
    std::fs::write(&target, "kept\n").unwrap();
    let link = root.path().join("gpufeed.sock");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    serve_refuses(root.path(), &link);
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the link is intact"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "kept\n");
}

#[test]
fn a_stale_socket_is_still_replaced() {
    let root = tempfile::tempdir().unwrap();
    let socket = root.path().join("gpufeed.sock");
    // A socket file nobody listens on, as a daemon killed with SIGKILL leaves behind.
    drop(UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let daemon = start_daemon(
        Path::new(env!("CARGO_BIN_EXE_gpufeed")),
        root.path(),
        socket.clone(),
        "cpu",
        &[],
        Stdio::null(),
    );
    let status = Client::connect(&daemon.socket).unwrap().status().unwrap();
    assert_eq!(status.streams, 0);
}
