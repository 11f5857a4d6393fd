//! Regression tests: a dataset packed again in place (`pack --force`) while the daemon ran kept its
//! old metadata, and new consumers failed with a misleading `CorruptData ... unexpected end of file`
//! while `/verify` said ok; a shard deleted under a registered dataset left it `ready`. Now the
//! daemon notices the replaced manifest (its file identity) and reads the dataset again for the next
//! stream, and a vanished shard shows in the dataset's state and refuses new streams, naming the file.

mod common;

use std::path::Path;
use std::process::Command;

use gpufeed::input::npy;
use gpufeed_client::protocol::{ErrorCode, StreamSpec};
use gpufeed_client::{Client, ClientError, DType};

/// Packs `samples` rows of 4 i32 (row i holds i + offset) into `data/toy`, replacing what is there.
fn pack(root: &Path, samples: u64, offset: i32) {
    pack_as(root, "toy", samples, offset);
}

/// As [`pack`], into `data/NAME`.
fn pack_as(root: &Path, name: &str, samples: u64, offset: i32) {
    let input = root.join(format!("input-{name}-{samples}-{offset}.npy"));
    let mut writer = npy::write_npy(&input, DType::I32, &[samples, 4]).unwrap();
    let bytes: Vec<u8> = (0..samples as i32)
        .flat_map(|i| [i + offset; 4])
        .flat_map(i32::to_le_bytes)
        .collect();
    writer.write_all(&bytes).unwrap();
    writer.finish().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(["pack", "--force", "--samples-per-shard", "32", "--out"])
        .arg(root.join("data").join(name))
        .arg(&input)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The first value of every row of one epoch, in order.
fn first_values(socket: &Path) -> Result<Vec<i32>, ClientError> {
    let stream = Client::connect(socket)?.open_stream(StreamSpec::new("toy", 8))?;
    let mut values = Vec::new();
    for batch in stream {
        let batch = batch?;
        let field = batch.field("data").unwrap();
        let bytes = field.host_bytes().unwrap();
        values.extend(
            bytes
                .chunks_exact(16)
                .map(|row| i32::from_le_bytes(row[..4].try_into().unwrap())),
        );
    }
    Ok(values)
}

#[test]
fn a_dataset_packed_again_in_place_is_read_again_and_a_vanished_shard_is_named() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("data")).unwrap();
    pack(root.path(), 64, 0);
    let daemon = common::daemon::start(
        common::daemon::serve_command(&root.path().join("data"), &[]),
        root.path(),
    );
    assert_eq!(
        first_values(&daemon.socket).unwrap(),
        (0..64).collect::<Vec<_>>()
    );

    // Packed again, in place, with more samples and other values.
    pack(root.path(), 96, 1000);
    let listed = common::http::request(daemon.address(), "GET", "/v1/datasets", &[], None).json();
    let error = listed["datasets"][0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("changed since"), "{listed}");
    assert_eq!(
        first_values(&daemon.socket).unwrap(),
        (1000..1096).collect::<Vec<_>>()
    );

    // A shard deleted: the state says so, naming it, and a new stream is refused with its name.
    let shard = root.path().join("data/toy/shard-000001.gfs");
    std::fs::remove_file(&shard).unwrap();
    let detail =
        common::http::request(daemon.address(), "GET", "/v1/datasets/toy", &[], None).json();
    assert_eq!(detail["dataset"]["state"], "missing", "{detail}");
    assert!(
        detail["dataset"]["error"]
            .as_str()
            .unwrap()
            .contains("shard-000001.gfs"),
        "{detail}"
    );
    match first_values(&daemon.socket) {
        Err(ClientError::Daemon { code, message }) => {
            assert_eq!(code, ErrorCode::Internal, "{message}");
            assert!(message.contains("shard-000001.gfs"), "{message}");
        }
        other => panic!("expected a refusal naming the shard, got {other:?}"),
    }
}

/// The README promises that datasets packed later under the data root are picked up: a rescan
/// registers them, and reads again the ones packed again in place.
#[test]
fn a_rescan_registers_datasets_packed_later_and_reloads_repacked_ones() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("data")).unwrap();
    pack(root.path(), 64, 0);
    let daemon = common::daemon::start(
        common::daemon::serve_command(&root.path().join("data"), &[]),
        root.path(),
    );
    pack_as(root.path(), "later", 16, 7);
    pack(root.path(), 40, 500);
    let report = common::http::request(daemon.address(), "POST", "/v1/rescan", &[], None);
    assert_eq!(report.status, 200);
    let report = report.json();
    assert_eq!(
        report["registered"],
        serde_json::json!(["later"]),
        "{report}"
    );
    assert_eq!(report["reloaded"], serde_json::json!(["toy"]), "{report}");
    let stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(StreamSpec::new("later", 4))
        .unwrap();
    assert_eq!(stream.count(), 4);
    assert_eq!(
        first_values(&daemon.socket).unwrap(),
        (500..540).collect::<Vec<_>>()
    );
}

/// What the control API and `gpufeed verify` say of the registered dataset `toy` while its shard 1
/// is something that cannot be read: the state `unreadable` (not `ready`, not `missing`) naming the
/// shard, the daemon's status counting it unavailable, `POST .../verify` refusing with that state
/// rather than reporting corruption, `gpufeed verify` calling it unreadable, and a new stream
/// refused naming the shard.
fn assert_shard_reported_unreadable(daemon: &common::daemon::Daemon, dataset: &Path, what: &str) {
    let detail =
        common::http::request(daemon.address(), "GET", "/v1/datasets/toy", &[], None).json();
    assert_eq!(detail["dataset"]["state"], "unreadable", "{what}: {detail}");
    let error = detail["dataset"]["error"].as_str().unwrap();
    assert!(error.contains("shard-000001.gfs"), "{what}: {detail}");
    assert!(error.contains("not a regular file"), "{what}: {detail}");
    let listed = common::http::request(daemon.address(), "GET", "/v1/datasets", &[], None).json();
    assert_eq!(
        listed["datasets"][0]["state"], "unreadable",
        "{what}: {listed}"
    );
    let status = common::http::request(daemon.address(), "GET", "/v1/status", &[], None).json();
    assert_eq!(status["datasets_unavailable"], 1, "{what}: {status}");

    let verify = common::http::request(
        daemon.address(),
        "POST",
        "/v1/datasets/toy/verify",
        &[],
        None,
    );
    assert_eq!(verify.status, 409, "{what}");
    let verify = verify.json();
    assert_eq!(verify["code"], "dataset_unavailable", "{what}: {verify}");
    let message = verify["message"].as_str().unwrap();
    assert!(message.contains("is unreadable"), "{what}: {verify}");
    assert!(!message.contains("corrupt"), "{what}: {verify}");

    let output = common::gpufeed([Path::new("verify"), Path::new("--quiet"), dataset]);
    let problems = common::assert_fails(&output);
    common::assert_line_with(&problems, &["unreadable: ", "shard-000001.gfs"]);
    assert!(!problems.contains("corrupt"), "{what}: {problems}");

    match first_values(&daemon.socket) {
        Err(ClientError::Daemon { code, message }) => {
            assert_ne!(code, ErrorCode::CorruptData, "{what}: {message}");
            assert!(message.contains("shard-000001.gfs"), "{what}: {message}");
        }
        other => panic!("{what}: expected a refusal naming the shard, got {other:?}"),
    }
}

/// Issue 16, item 9: a shard made unreadable under a registered dataset (here a directory, then a
/// FIFO, in its place: the tests run as root, for whom permissions do not make a file unreadable)
/// left the dataset `ready`, and a permission error read as corruption. Both now say what it is;
/// and once the shard is back, the dataset is ready and serves again.
#[test]
fn a_shard_made_unreadable_is_reported_unreadable_not_corrupt() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("data")).unwrap();
    pack(root.path(), 64, 0);
    let daemon = common::daemon::start(
        common::daemon::serve_command(&root.path().join("data"), &[]),
        root.path(),
    );
    let dataset = root.path().join("data/toy");
    let shard = dataset.join("shard-000001.gfs");
    let kept = root.path().join("shard-000001.gfs.kept");
    std::fs::rename(&shard, &kept).unwrap();

    std::fs::create_dir(&shard).unwrap();
    assert_shard_reported_unreadable(&daemon, &dataset, "a directory");
    std::fs::remove_dir(&shard).unwrap();

    let fifo = std::ffi::CString::new(shard.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo(3) with a NUL-terminated path that outlives the call.
    let made = unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) };
    assert_eq!(made, 0, "mkfifo: {}", std::io::Error::last_os_error());
    assert_shard_reported_unreadable(&daemon, &dataset, "a FIFO");
    std::fs::remove_file(&shard).unwrap();

    std::fs::rename(&kept, &shard).unwrap();
    let detail =
        common::http::request(daemon.address(), "GET", "/v1/datasets/toy", &[], None).json();
    assert_eq!(detail["dataset"]["state"], "ready", "{detail}");
    assert_eq!(
        first_values(&daemon.socket).unwrap(),
        (0..64).collect::<Vec<_>>()
    );
}
