//! Regression test: `gpufeed inspect DIR | head` panicked with a backtrace when `head` closed the pipe
//! early (`println!` panics on EPIPE). The output now just ends, with exit status 0 and nothing on
//! standard error.

mod common;

use std::process::{Command, Stdio};

use gpufeed_client::DType;

#[test]
fn inspect_into_a_closed_pipe_ends_quietly() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("set");
    // Many shards, so that the JSON summary is far larger than a pipe's buffer.
    let bytes: Vec<u8> = (0..4000u32).flat_map(|i| i.to_le_bytes()).collect();
    common::pack_fields(
        &dir,
        &[common::field("ids", DType::I32, &[1], bytes)],
        &common::options("set", 4096, Some(4)),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .arg("inspect")
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end at once, as `head -c 0` would.
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
}
