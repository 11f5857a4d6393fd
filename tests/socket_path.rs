//! Regression test for a data-loss bug: `gpufeed serve --socket PATH` used to delete whatever was at
//! PATH when nothing answered there (`Server::bind` removed any path it could not connect to), so a
//! mistyped `--socket` pointing at a user's file destroyed it. Only a stale socket may be replaced; a
//! regular file (or a directory, or a symbolic link) is refused with a clear error and left intact.

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;

fn serve(root: &Path, socket: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(["serve", "--device", "cpu", "--http", "off", "--data-root"])
        .arg(root)
        .arg("--socket")
        .arg(socket)
        .output()
        .expect("run gpufeed serve")
}

#[test]
fn a_regular_file_at_the_socket_path_is_refused_and_kept() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let precious = root.path().join("notes.txt");
    std::fs::write(&precious, b"my thesis").unwrap();
    let output = serve(&data, &precious);
    assert!(!output.status.success(), "serve must refuse the path");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is not a socket") && stderr.contains("notes.txt"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"my thesis");
}

#[test]
fn a_symbolic_link_at_the_socket_path_is_refused_and_its_target_kept() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let target = root.path().join("target.txt");
    std::fs::write(&target, b"keep").unwrap();
    let link = root.path().join("link.sock");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let output = serve(&data, &link);
    assert!(!output.status.success());
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
}

#[test]
fn a_stale_socket_is_still_replaced() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let socket = root.path().join("stale.sock");
    // A socket nobody listens on any more: bound, then its listener dropped.
    drop(UnixListener::bind(&socket).unwrap());
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(["serve", "--device", "cpu", "--http", "off", "--data-root"])
        .arg(&data)
        .arg("--socket")
        .arg(&socket)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(line.starts_with("gpufeed: serving"), "daemon said {line:?}");
}
