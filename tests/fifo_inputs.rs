//! Regression test: a FIFO (or a device) where a shard or the manifest should be hung `verify`,
//! `unpack`, the daemon's start-up scan and `POST /v1/datasets` (opening a FIFO waits for a writer;
//! reading `/dev/zero` never ends). Dataset files that are not regular files are now refused before
//! anything is read, with an error naming the path.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::sync::mpsc;
use std::time::Duration;

use gpufeed_client::DType;

/// Runs `gpufeed ARGS`, failing the test if it has not finished within 60 s (it used to hang).
fn run_bounded(args: &[&std::ffi::OsStr]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("gpufeed {args:?} hung on a FIFO");
        }
    }
}

fn dataset(root: &Path) -> std::path::PathBuf {
    let dir = root.join("set");
    common::pack_fields(
        &dir,
        &[common::field(
            "ids",
            DType::I32,
            &[1],
            common::i32_bytes(100, |i| i as i32),
        )],
        &common::options("set", 4096, Some(50)),
    );
    dir
}

fn replace_with_fifo(path: &Path) {
    std::fs::remove_file(path).unwrap();
    nix::unistd::mkfifo(
        path,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
}

#[test]
fn a_fifo_shard_is_refused_by_verify_and_unpack() {
    let root = tempfile::tempdir().unwrap();
    let dir = dataset(root.path());
    let shard = gpufeed::format::Dataset::open(&dir).unwrap().shards[1]
        .path
        .clone();
    replace_with_fifo(&shard);
    let name = shard.file_name().unwrap().to_string_lossy().into_owned();
    let verify = run_bounded(&["verify".as_ref(), dir.as_os_str(), "--quiet".as_ref()]);
    assert!(!verify.status.success());
    let text = String::from_utf8_lossy(&verify.stderr).into_owned()
        + &String::from_utf8_lossy(&verify.stdout);
    assert!(
        text.contains(&name) && text.contains("not a regular file"),
        "{text}"
    );
    let out = root.path().join("ids.npy");
    let unpack = run_bounded(&[
        "unpack".as_ref(),
        dir.as_os_str(),
        "--field".as_ref(),
        "ids".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
        "--quiet".as_ref(),
    ]);
    assert!(!unpack.status.success());
    assert!(String::from_utf8_lossy(&unpack.stderr).contains("not a regular file"));
}

#[test]
fn a_fifo_manifest_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = dataset(root.path());
    replace_with_fifo(&dir.join("manifest.json"));
    let inspect = run_bounded(&["inspect".as_ref(), dir.as_os_str()]);
    assert!(!inspect.status.success());
    let stderr = String::from_utf8_lossy(&inspect.stderr);
    assert!(
        stderr.contains("manifest.json") && stderr.contains("not a regular file"),
        "{stderr}"
    );
}
