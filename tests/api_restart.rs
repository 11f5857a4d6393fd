//! Crash safety of the catalog: a daemon killed with SIGKILL in the middle of a pack job, then
//! started again on the same data root. The catalog must be intact (every registered dataset still
//! served), the interrupted job reported failed, the job's dataset not registered and its staging
//! directory gone, and the same pack must then succeed.

mod common;

use std::time::Duration;

use common::daemon::{serve_command, start};
use common::http::{get, request, send_json};
use common::{staging_dirs, write_tokens_npy};
use gpufeed::catalog::{CatalogData, CATALOG_FILE_NAME};
use serde_json::json;

#[test]
fn kill_9_during_a_pack_job_leaves_an_intact_catalog_and_a_failed_job() {
    let root = tempfile::tempdir().unwrap();
    let logs = root.path().join("logs");
    // 8 MiB of input at 1 MiB/s: the pack runs for about 8 s, so the kill lands in the middle.
    write_tokens_npy(&root.path().join("tokens.npy"), 128 * 1024);
    write_tokens_npy(&root.path().join("small.npy"), 1000);
    let slow = ["--pack-rate-max", "1M", "--pack-threads", "1"];
    let mut first = start(serve_command(root.path(), &slow), &logs);
    let address = first.address();

    // A dataset registered before the crash, through a pack job that finished.
    let small =
        json!({"name": "small", "source": {"fields": [{"name": "t", "npy": ["small.npy"]}]}});
    assert_eq!(
        send_json(address, "POST", "/v1/datasets", &small, None).status,
        202
    );
    let done = get(address, "/v1/jobs/1?wait_s=60", None).json();
    assert_eq!(done["state"], "succeeded", "{done}");

    let big = json!({"name": "big", "source": {"fields": [{"name": "t", "npy": ["tokens.npy"]}], "block_bytes": 4096}});
    let accepted = send_json(address, "POST", "/v1/datasets", &big, None);
    assert_eq!(accepted.status, 202, "{}", accepted.json());
    assert_eq!(accepted.json()["id"], 2);
    let mut running = None;
    for _ in 0..4000 {
        let job = get(address, "/v1/jobs/2", None).json();
        if job["state"] == "running" && job["raw_bytes_done"].as_u64().unwrap() > 0 {
            running = Some(job);
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let running = running.expect("the job reports progress");
    assert!(running["progress"].as_f64().unwrap() < 1.0, "{running}");

    // SIGKILL: no handler runs, nothing is flushed.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert_eq!(staging_dirs(root.path(), "big").len(), 1, "killed mid-pack");
    let bytes = std::fs::read(root.path().join(CATALOG_FILE_NAME)).unwrap();
    let catalog = CatalogData::from_json(std::path::Path::new("catalog"), &bytes)
        .expect("the catalog on disk is whole");
    assert!(catalog.datasets.contains_key("small"));
    assert!(!catalog.datasets.contains_key("big"));
    assert_eq!(catalog.jobs[&2].state, gpufeed::catalog::JobState::Running);

    // The next daemon settles the job and serves what was registered.
    let second = start(serve_command(root.path(), &[]), &logs);
    let address = second.address();
    let job = get(address, "/v1/jobs/2", None).json();
    assert_eq!(job["state"], "failed", "{job}");
    assert!(
        job["error"]
            .as_str()
            .unwrap()
            .contains("stopped during the job"),
        "{job}"
    );
    assert_eq!(
        get(address, "/v1/jobs/1", None).json()["state"],
        "succeeded"
    );
    let datasets = get(address, "/v1/datasets", None).json();
    let names: Vec<(&str, &str)> = datasets["datasets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["name"].as_str().unwrap(), d["state"].as_str().unwrap()))
        .collect();
    assert_eq!(names, [("small", "ready")]);
    get(address, "/v1/datasets/big", None).assert_error(404, "not_found");
    assert!(
        staging_dirs(root.path(), "big").is_empty(),
        "the staging directory is removed"
    );
    assert!(!root.path().join("big").exists());
    let verified = request(address, "POST", "/v1/datasets/small/verify", &[], None).json();
    assert_eq!(verified["ok"], true);

    // Nothing is half-registered: the same pack now runs to the end.
    let again = send_json(address, "POST", "/v1/datasets", &big, None);
    assert_eq!(again.status, 202, "{}", again.json());
    assert_eq!(again.json()["id"], 3, "job ids are not reused");
    let done = get(address, "/v1/jobs/3?wait_s=60", None).json();
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(
        get(address, "/v1/datasets/big", None).json()["summary"]["samples"],
        128 * 1024
    );
    assert!(!second.log().contains("panicked"), "{}", second.log());
}
