//! Regression test: the GPU scripts (`scripts/gpu-*.sh`) exited 0 when their tests failed, so a failed
//! device run read as a pass. Their shared helpers now carry the failure to the exit status: a step
//! whose command fails makes `step_summary` (scripts/lib/check.sh) and `finish`
//! (scripts/lib/exits.sh) fail, while the remaining steps still run and log. Checked here with bash
//! and stand-in commands, no GPU needed.

use std::process::Command;

fn bash(script: &str) -> std::process::Output {
    let out = tempfile::tempdir().unwrap();
    Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("OUT", out.path())
        .output()
        .expect("bash runs")
}

#[test]
fn a_failed_step_fails_a_check_script() {
    let failed = bash(
        "budget_s=60; step_name_width=8; . scripts/lib/check.sh; \
         step good log 10 0 true; step bad log 10 0 false; step after log 10 0 true; step_summary",
    );
    let text = String::from_utf8_lossy(&failed.stdout);
    assert!(!failed.status.success(), "{text}");
    assert!(
        text.contains("bad") && text.contains("FAIL") && text.contains("after"),
        "{text}"
    );
    let passed = bash(
        "budget_s=60; step_name_width=8; . scripts/lib/check.sh; step good log 10 0 true; step_summary",
    );
    assert!(
        passed.status.success(),
        "{}",
        String::from_utf8_lossy(&passed.stdout)
    );
}

#[test]
fn a_failed_step_fails_a_hand_run_script() {
    let log = tempfile::NamedTempFile::new().unwrap();
    let path = log.path().display().to_string();
    let failed = bash(&format!(
        ". scripts/lib/exits.sh; true; note_exit $? {path}; false; note_exit $? {path}; finish"
    ));
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("1 step(s) failed"));
    let passed = bash(&format!(
        ". scripts/lib/exits.sh; true; note_exit $? {path}; finish"
    ));
    assert!(passed.status.success());
    assert_eq!(
        std::fs::read_to_string(log.path()).unwrap(),
        "exit 0\nexit 1\nexit 0\n"
    );
}

/// The cuFile fallback GPU test returned early, and passed, on a machine without cuFile: a pass that
/// tested nothing. Such a test now prints `SKIPPED: <test>: <reason>`, and the scripts' summaries
/// (`step_summary`, `finish`) count those lines and show them, without failing for them.
#[test]
fn tests_that_say_skipped_are_counted_in_the_summary() {
    let said = bash(
        "budget_s=60; step_name_width=8; . scripts/lib/check.sh; \
         step storage tests 10 0 bash -c 'printf \"test t ... \\nSKIPPED: t: cuFile unavailable\\nok\\n\"'; \
         step other tests 10 0 true; step_summary",
    );
    let text = String::from_utf8_lossy(&said.stdout);
    assert!(said.status.success(), "{text}");
    assert!(text.contains("tests that said SKIPPED: 1"), "{text}");
    assert!(text.contains("SKIPPED: t: cuFile unavailable"), "{text}");
    let none = bash(
        "budget_s=60; step_name_width=8; . scripts/lib/check.sh; step quiet tests 10 0 true; step_summary",
    );
    let text = String::from_utf8_lossy(&none.stdout);
    assert!(text.contains("tests that said SKIPPED: 0"), "{text}");
    let hand_run = bash(
        "echo 'SKIPPED: a: reason' >\"$OUT/storage.log\"; echo 'SKIPPED: b: reason' >>\"$OUT/storage.log\"; \
         . scripts/lib/exits.sh; finish",
    );
    let text = String::from_utf8_lossy(&hand_run.stdout);
    assert!(hand_run.status.success(), "{text}");
    assert!(text.contains("tests that said SKIPPED: 2"), "{text}");
}
