//! `examples/c/consume.c` built with the system C compiler against this crate's static library and
//! run against a CPU-backend daemon: the bytes it received (an FNV-1a checksum over them, in order)
//! are the source's, and it counted every batch.

mod common;

use std::process::Command;

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[test]
fn the_c_example_receives_the_source_bytes() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::Daemon::start(root.path());
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let library = common::static_library();
    let program = root.path().join("consume");
    let compiled = Command::new("cc")
        .arg("-std=c11")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-D_POSIX_C_SOURCE=200809L")
        .arg("-I")
        .arg(repo.join("ffi/include"))
        .arg(repo.join("examples/c/consume.c"))
        .arg(&library)
        .args(["-lpthread", "-ldl", "-lm", "-lrt", "-o"])
        .arg(&program)
        .output()
        .expect("run cc");
    assert!(
        compiled.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&program)
        .arg(&daemon.socket)
        .args(["toy", "64", "ids"])
        .output()
        .expect("run the C example");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "consume failed: {stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("field ids: dtype 6, shape [64, 2], 512 bytes in host memory"),
        "{stdout}"
    );
    let batches = common::SAMPLES / 64;
    let served = &common::ids_bytes()[..(batches * 64 * 8) as usize];
    let expected = format!(
        "batches {batches} samples {} bytes {} checksum {:016x} cursor {}",
        batches * 64,
        served.len(),
        fnv1a(served),
        batches * 64
    );
    assert!(
        stdout.contains(&expected),
        "expected {expected:?} in:\n{stdout}"
    );
}
