//! Regression test for a newcomer's trial: a user who installed only the `gpufeed` binary had no way
//! to pull batches from a daemon (the consumer was a Cargo example). `gpufeed consume` does it and
//! prints its JSON summary; its `--help` lists the dtypes `--dtype` takes.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn gpufeed_consume_pulls_an_epoch_and_reports_it() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let output = Command::new(binary)
        .arg("consume")
        .arg("--socket")
        .arg(&daemon.socket)
        .args(["--dataset", "tiny", "--batch-size", "4", "--dtype", "i64"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(summary["batches"], 4, "{summary}");
    assert_eq!(summary["samples"], 16, "{summary}");
    // 16 samples of 4 elements, widened to i64.
    assert_eq!(summary["bytes"], 16 * 4 * 8, "{summary}");

    let help = Command::new(binary)
        .args(["consume", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("possible values: u8, i8"), "{help}");
    assert!(help.contains("bf16, f32, f64"), "{help}");
}
