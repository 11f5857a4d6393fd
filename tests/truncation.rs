//! Files truncated while gpufeed reads them through a memory map (issue 42, items 1 and 2).
//!
//! A read of a mapped page that lies beyond the end of a file raises SIGBUS, whose default action
//! kills the process. `cp` or `rsync --inplace` over a served dataset truncates its shards in place:
//! the daemon died (exit 135) and every stream of the node with it. `np.save` over an input of a
//! running pack job, or `truncate` during `gpufeed pack`, did the same to the daemon and the packer.
//! Those reads now read zeros instead, and the reader fails before anything it read there is used:
//! the stream ends with an error naming the shard (the daemon and other streams go on, and the
//! dataset shows unreadable), the pack fails naming the input.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::daemon::{serve_command, start};
use common::http::{get, send_json};
use gpufeed::pack::CodecChoice;
use gpufeed_client::consumer::Client;
use gpufeed_client::protocol::{Shuffle, StreamSpec};
use gpufeed_client::DType;
use serde_json::json;

/// Bytes of one sample of the served dataset.
const ROW_BYTES: u64 = 1024;

/// Packs `root/name`: `samples` rows of `ROW_BYTES` noise bytes, stored raw (so that a shuffled
/// stream reads its rows in place from a map of each shard), 1024 samples (1 MiB) per shard.
fn raw_dataset(root: &Path, name: &str, samples: u64) -> PathBuf {
    let dir = root.join(name);
    let mut options = common::options(name, 64 << 10, Some(1024));
    options.codec = CodecChoice::Raw;
    common::pack_fields(
        &dir,
        &[common::field(
            "x",
            DType::U8,
            &[ROW_BYTES],
            common::noise((samples * ROW_BYTES) as usize, 42),
        )],
        &options,
    );
    dir
}

fn shards_of(dir: &Path) -> Vec<PathBuf> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gfs"))
        .collect();
    shards.sort();
    assert!(!shards.is_empty(), "no shard in {}", dir.display());
    shards
}

/// Truncates `path` to `bytes` in place, as `cp` over it or `rsync --inplace` would first.
fn truncate(path: &Path, bytes: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(bytes)
        .unwrap();
}

/// Item 1: a full-shuffle stream of a raw dataset whose shards are truncated to 8 KiB mid-stream.
#[test]
fn a_shard_truncated_while_served_ends_its_stream_not_the_daemon() {
    let root = tempfile::tempdir().unwrap();
    let dir = raw_dataset(root.path(), "ds", 8 * 1024);
    raw_dataset(root.path(), "other", 2 * 1024);
    let daemon = start(serve_command(root.path(), &[]), &root.path().join("logs"));

    let mut spec = StreamSpec::new("ds", 32);
    spec.shuffle = Shuffle::Full;
    spec.seed = 7;
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(spec)
        .unwrap();
    for _ in 0..5 {
        let batch = stream
            .next()
            .expect("a batch")
            .expect("read before the truncation");
        assert_eq!(batch.samples(), 32);
    }
    let shards = shards_of(&dir);
    for shard in &shards {
        truncate(shard, 8 << 10);
    }
    // The slots filled before the truncation are served; the first batch filled after it fails.
    let error = stream
        .by_ref()
        .find_map(Result::err)
        .expect("the stream must fail: its shards are truncated");
    let message = error.to_string();
    assert!(
        shards
            .iter()
            .any(|shard| message.contains(&shard.display().to_string())),
        "the error names no shard: {message}"
    );
    // Read through the shard's map (where the daemon used to die), not through the read engine.
    assert!(message.contains("while it was read"), "{message}");
    drop(stream);

    // The daemon is alive and serves another dataset whole.
    let mut other = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(StreamSpec::new("other", 64))
        .unwrap();
    let mut samples = 0;
    for batch in other.by_ref() {
        samples += batch.expect("the other dataset is intact").samples();
    }
    assert_eq!(samples, 2 * 1024);

    let status = get(daemon.address(), "/v1/datasets/ds", None).json();
    assert_eq!(status["dataset"]["state"], "unreadable", "{status}");
    let why = status["dataset"]["error"].as_str().unwrap();
    assert!(why.contains("shard-"), "{status}");
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
}

/// A `.npy` of `samples` rows of 4096 zero bytes, sparse: its data occupies no disk, and a pack of it
/// runs long enough (gigabytes) for the test to cut it while it runs.
fn sparse_npy(path: &Path, samples: u64) {
    let dict = format!("{{'descr': '|u1', 'fortran_order': False, 'shape': ({samples}, 4096), }}");
    let mut header = dict.into_bytes();
    let unpadded = 10 + header.len() + 1;
    header.extend(std::iter::repeat_n(b' ', (64 - unpadded % 64) % 64));
    header.push(b'\n');
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(b"\x93NUMPY\x01\x00").unwrap();
    file.write_all(&(header.len() as u16).to_le_bytes())
        .unwrap();
    file.write_all(&header).unwrap();
    file.set_len(10 + header.len() as u64 + samples * 4096)
        .unwrap();
}

/// The same as a safetensors file with one tensor `x`.
fn sparse_safetensors(path: &Path, samples: u64) {
    let bytes = samples * 4096;
    let header = format!(
        "{{\"x\":{{\"dtype\":\"U8\",\"shape\":[{samples},4096],\"data_offsets\":[0,{bytes}]}}}}"
    );
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(&(header.len() as u64).to_le_bytes())
        .unwrap();
    file.write_all(header.as_bytes()).unwrap();
    file.set_len(8 + header.len() as u64 + bytes).unwrap();
}

/// Waits (bounded) until `ready` holds, polling.
fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    for _ in 0..12_000 {
        if ready() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting until {what}");
}

/// Item 2, the command line: `truncate` of the input during `gpufeed pack` (a `.npy`, and a
/// safetensors tensor) killed the packer with SIGBUS; the pack now fails naming the input.
#[test]
fn an_input_truncated_during_gpufeed_pack_fails_the_pack_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let npy = root.path().join("big.npy");
    let tensors = root.path().join("big.safetensors");
    // 16 GiB each, sparse: the pack cannot finish before it is cut.
    sparse_npy(&npy, 4 << 20);
    sparse_safetensors(&tensors, 4 << 20);
    for (name, input, field) in [
        ("a", &npy, format!("x={}", npy.display())),
        ("b", &tensors, format!("x={}:x", tensors.display())),
    ] {
        let out = root.path().join(name);
        let child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
            .args(["pack", "--quiet", "--out"])
            .arg(&out)
            .args(["--field", &field])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The staging directory appears once the inputs are open and mapped.
        wait_until("the pack has started", || {
            !common::staging_dirs(root.path(), name).is_empty()
        });
        truncate(input, 8 << 10);
        let output = child.wait_with_output().unwrap();
        let err = common::assert_fails(&output);
        assert_eq!(output.status.code(), Some(1), "{err}");
        common::assert_line_with(&err, &[&input.display().to_string(), "while it was read"]);
        assert!(!out.exists());
    }
}

/// Item 2, an API job: `np.save` over the `.npy` of a running `POST /v1/datasets` job killed the
/// daemon (exit 135); the job now fails naming the input and the daemon goes on.
#[test]
fn an_input_truncated_during_a_pack_job_fails_the_job_not_the_daemon() {
    let root = tempfile::tempdir().unwrap();
    let input = root.path().join("big.npy");
    sparse_npy(&input, 1 << 20);
    let daemon = start(
        serve_command(root.path(), &["--pack-rate-max", "40M"]),
        &root.path().join("logs"),
    );
    let address = daemon.address();
    let request = json!({"name": "big", "source": {"fields": [{"name": "x", "npy": ["big.npy"]}]}});
    let accepted = send_json(address, "POST", "/v1/datasets", &request, None);
    assert_eq!(accepted.status, 202, "{}", accepted.json());
    let id = accepted.json()["id"].as_u64().unwrap();
    wait_until("the job reports progress", || {
        let job = get(address, &format!("/v1/jobs/{id}"), None).json();
        job["state"] == "running" && job["raw_bytes_done"].as_u64().unwrap_or(0) > 0
    });
    truncate(&input, 8 << 10);
    let job = get(address, &format!("/v1/jobs/{id}?wait_s=60"), None).json();
    assert_eq!(job["state"], "failed", "{job}");
    let error = job["error"].as_str().unwrap();
    assert!(
        error.contains("big.npy") && error.contains("while it was read"),
        "{job}"
    );
    // The daemon is alive and answers.
    let status = get(address, "/v1/status", None);
    assert_eq!(status.status, 200);
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
}
