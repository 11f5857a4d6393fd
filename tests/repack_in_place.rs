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
