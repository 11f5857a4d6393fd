//! Regression test for a newcomer's trial: a user who installed only the `gpufeed` binary had no way
//! to pull batches from a daemon (the consumer was a Cargo example). `gpufeed consume` does it and
//! prints its JSON summary; its `--help` opens with its own description and lists the dtypes
//! `--dtype` takes. The client crate keeps a small example of its own
//! (`client/examples/client_minimal.rs`, the program a newcomer copies first), run here against a
//! CPU daemon too, so that it cannot rot while `gpufeed consume` is the only consumer that runs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
fn gpufeed_consume_pulls_an_epoch_and_reports_it() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let summary = consume_summary(
        &daemon.socket,
        &["--dataset", "tiny", "--batch-size", "4", "--dtype", "i64"],
    );
    assert_eq!(summary["batches"], 4, "{summary}");
    assert_eq!(summary["samples"], 16, "{summary}");
    // 16 samples of 4 elements, widened to i64.
    assert_eq!(summary["bytes"], 16 * 4 * 8, "{summary}");

    let help = Command::new(binary)
        .args(["consume", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    // The help opens with consume's own description, not the daemon's.
    assert!(
        help.starts_with("Consume one epoch of batches from a running daemon"),
        "{help}"
    );
    assert!(help.contains("possible values: u8, i8"), "{help}");
    assert!(help.contains("bf16, f32, f64"), "{help}");
}

/// Path of a client-crate example built next to the test binaries: a whole `cargo test` builds the
/// examples; a run of this test alone builds the one it needs.
fn example_binary(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let profile_dir = deps.parent().unwrap().parent().unwrap();
    let path = profile_dir.join("examples").join(name);
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "-p", "gpufeed-client", "--example", name]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().unwrap();
        assert!(status.success(), "building the example {name} failed");
    }
    assert!(
        path.exists(),
        "{} missing after building it",
        path.display()
    );
    path
}

#[test]
fn the_minimal_client_example_reads_an_epoch() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let output = Command::new(example_binary("client_minimal"))
        .arg(&daemon.socket)
        .args(["tiny", "4"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The tiny dataset: 16 samples of field `v`, u32[4], sample i holding 4i..4i+4.
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "steps 4", "{stdout}");
    for step in 0..4u32 {
        assert!(
            lines.contains(&format!("step {step} samples 4").as_str()),
            "{stdout}"
        );
        let first = 16 * step;
        let bytes = [first, first + 1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>();
        let field = format!("  field v U32 shape [4, 4]: 64 bytes, first {bytes:?}");
        assert!(
            lines.contains(&field.as_str()),
            "{field:?} not in\n{stdout}"
        );
    }
    assert_eq!(
        lines.last(),
        Some(&"batches 4, resume from cursor 16"),
        "{stdout}"
    );
}

/// `--open-ahead` opens each next epoch's stream on a helper thread before the current epoch ends:
/// the batches are the same, in the same order, as when every epoch is opened after the one before.
#[test]
fn opening_the_next_epoch_ahead_serves_the_same_batches() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let binary = Path::new(env!("CARGO_BIN_EXE_gpufeed"));
    let consume = |open_ahead: &str| {
        let dump = root.path().join(format!("ahead-{open_ahead}.npy"));
        let summary = consume_summary(
            &daemon.socket,
            &[
                "--dataset",
                "tiny",
                "--batch-size",
                "3",
                "--shuffle",
                "full",
                "--epochs",
                "3",
                "--seed",
                "7",
                "--open-ahead",
                open_ahead,
                "--dump",
                dump.to_str().unwrap(),
            ],
        );
        // 16 samples in steps of 3: 5 steps an epoch, the last partial one dropped.
        assert_eq!(summary["batches"], 15, "{summary}");
        assert_eq!(
            summary["epoch_times"].as_array().unwrap().len(),
            3,
            "{summary}"
        );
        std::fs::read(dump).unwrap()
    };
    let after = consume("0");
    let ahead = consume("0.5");
    let ahead_at_once = consume("1");
    assert_eq!(after, ahead);
    assert_eq!(after, ahead_at_once);

    let refused = Command::new(binary)
        .args(["consume", "--socket", "/nonexistent", "--dataset", "tiny"])
        .args(["--open-ahead", "1.5"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("not a fraction from 0 to 1"), "{stderr}");
}

/// Runs `gpufeed consume --socket SOCKET ARGS...`, checks that it succeeded, and returns its JSON
/// summary (its last line).
fn consume_summary(socket: &Path, args: &[&str]) -> serde_json::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .arg("consume")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// Daemon cores were divided by the consumer process's whole wall time, start-up included, so that a
/// figure of 0.63 cores was 0.81 to 0.93 over the stream. `consume --daemon-pid PID` reads the
/// daemon's CPU time (and its own) when its clock starts and after its last batch, and reports them
/// over the stream's `seconds`, with the readings they come from.
#[test]
fn consume_reports_the_daemons_and_its_own_cpu_over_the_stream() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let pid = daemon.child.id().to_string();
    let summary = consume_summary(
        &daemon.socket,
        &[
            "--dataset",
            "tiny",
            "--batch-size",
            "4",
            "--daemon-pid",
            &pid,
        ],
    );
    let daemon_cpu = summary["daemon_cpu_s_stream"].as_f64().expect("daemon CPU");
    let consumer_cpu = summary["consumer_cpu_s_stream"]
        .as_f64()
        .expect("consumer CPU");
    assert!(daemon_cpu >= 0.0 && consumer_cpu >= 0.0, "{summary}");
    let samples = &summary["cpu_samples"];
    let [start, end] =
        ["start_monotonic_s", "end_monotonic_s"].map(|k| samples[k].as_f64().unwrap());
    assert!(end >= start, "{summary}");
    let readings = samples["daemon_cpu_s"].as_array().unwrap();
    let difference = readings[1].as_f64().unwrap() - readings[0].as_f64().unwrap();
    assert!((difference - daemon_cpu).abs() < 1e-9, "{summary}");
    // Without --daemon-pid there is no daemon figure, and the consumer's own still is.
    let summary = consume_summary(&daemon.socket, &["--dataset", "tiny", "--batch-size", "4"]);
    assert!(summary["daemon_cpu_s_stream"].is_null(), "{summary}");
    assert!(
        summary["consumer_cpu_s_stream"].as_f64().is_some(),
        "{summary}"
    );
}
