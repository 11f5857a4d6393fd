//! Devices by identity: a consumer's `cuda:N` is its own device N, whatever its
//! `CUDA_VISIBLE_DEVICES`; the client sends that device's UUID in `OpenStream` and the daemon serves
//! the GPU with that UUID. On the CPU: what a daemon answers to a UUID it does not serve, through its
//! socket. On two GPUs (`#[ignore]`, run with `--include-ignored` there): a consumer with
//! `CUDA_VISIBLE_DEVICES=1` asking for `cuda:0` is served by the daemon's second GPU, bit-exact.

mod common;

use common::consumers::consume_bin;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use gpufeed_client::protocol::{Device, DeviceUuid, ErrorCode, Message, StreamSpec};
use gpufeed_client::transport;

/// A greeted raw connection to `socket`.
fn greeted(socket: &Path) -> UnixStream {
    let socket = UnixStream::connect(socket).unwrap();
    let hello = Message::Hello {
        client: "device-identity test".to_string(),
    };
    transport::send(&socket, &hello, &[]).unwrap();
    assert!(matches!(
        transport::recv(&socket).unwrap().0,
        Message::Welcome { .. }
    ));
    socket
}

/// The error frame `socket`'s daemon answers `spec` with.
fn refusal(socket: &Path, spec: StreamSpec) -> (ErrorCode, String) {
    let socket = greeted(socket);
    transport::send(&socket, &Message::OpenStream(spec), &[]).unwrap();
    match transport::recv(&socket).unwrap().0 {
        Message::Error { code, message } => (code, message),
        other => panic!("expected an error frame, got {other:?}"),
    }
}

#[test]
fn a_cpu_daemon_refuses_a_device_uuid_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let daemon = common::daemon::tiny_cpu_daemon(root.path());
    let uuid: DeviceUuid = "GPU-5e1f0a42-9b3c-11ee-8001-a0369f123456".parse().unwrap();
    let mut spec = StreamSpec::new("tiny", 4);
    spec.device = Device::Cuda(0);
    spec.device_uuid = Some(uuid);
    let (code, message) = refusal(&daemon.socket, spec.clone());
    assert_eq!(code, ErrorCode::BadRequest, "{message}");
    assert!(
        message.contains("cuda:0 of the consumer is GPU-5e1f0a42-9b3c-11ee-8001-a0369f123456"),
        "{message}"
    );
    assert!(message.contains("CPU backend"), "{message}");
    // The same request without the UUID gets the answer it always had.
    spec.device_uuid = None;
    let (code, message) = refusal(&daemon.socket, spec);
    assert_eq!(code, ErrorCode::BadRequest, "{message}");
    assert!(
        message.contains("device cuda:0 is not served: this daemon runs the CPU backend"),
        "{message}"
    );
    // A host-memory stream with a UUID is malformed.
    let mut host = StreamSpec::new("tiny", 4);
    host.device_uuid = Some(uuid);
    let (code, message) = refusal(&daemon.socket, host);
    assert_eq!(code, ErrorCode::BadFrame, "{message}");
    assert!(message.contains("host-memory stream"), "{message}");
}

/// The `devices` entry of `status` for the daemon's `cuda:N`.
fn served<'a>(status: &'a serde_json::Value, device: &str) -> &'a serde_json::Value {
    status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device"] == device)
        .unwrap_or_else(|| panic!("{device} is not served: {status}"))
}

/// Named `two_devices_…` so that the single-GPU runs skip it with `--skip two_devices`.
#[test]
#[ignore = "needs a CUDA GPU (two)"]
fn two_devices_a_consumer_cuda0_under_visible_devices_1_is_served_by_the_second() {
    let count = gpufeed::device::Device::count().unwrap_or(0);
    assert!(
        count >= 2,
        "this test needs two CUDA GPUs and sees {count}: run it on a machine with two"
    );
    const SAMPLES: u64 = 8192;
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let source = common::noise((SAMPLES * 16 * 4) as usize, 41);
    common::pack_fields(
        &data.join("ids"),
        &[common::field(
            "v",
            gpufeed_client::DType::U32,
            &[16],
            source.clone(),
        )],
        &common::options("ids", 64 << 10, Some(2048)),
    );
    // `GPUFEED_BIN` where the test binary runs away from its build tree (the GPU machine).
    let daemon_bin = std::env::var_os("GPUFEED_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_gpufeed")),
        PathBuf::from,
    );
    let mut command = Command::new(daemon_bin);
    command
        .args(["serve", "--data-root"])
        .arg(&data)
        .arg("--socket")
        .arg(root.path().join("gpufeed.sock"))
        .args(["--device", "cuda:0,cuda:1", "--http", "127.0.0.1:0"])
        // The daemon sees both GPUs in the driver's order; the consumer below sees only the second.
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("GPUFEED_API_TOKEN")
        .env_remove("GPUFEED_CONFIG")
        .env_remove("GPUFEED_HTTP");
    let daemon = common::daemon::start(command, root.path());
    let status = common::http::get(daemon.address(), "/v1/status", None).json();
    let first = served(&status, "cuda:0")["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    let second = served(&status, "cuda:1")["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(first, second, "two GPUs with one UUID: {status}");
    assert!(!served(&status, "cuda:1")["pci_bus_id"]
        .as_str()
        .unwrap()
        .is_empty());
    // This process sees the GPUs as the daemon does (neither sets CUDA_VISIBLE_DEVICES).
    let uuid_of_second = gpufeed::device::Device::open(1)
        .unwrap()
        .properties()
        .uuid
        .map(DeviceUuid)
        .unwrap();
    assert_eq!(uuid_of_second.to_string(), second);

    let dump = root.path().join("consumer.npy");
    let output = Command::new(consume_bin())
        .arg("--socket")
        .arg(&daemon.socket)
        .args([
            "--dataset",
            "ids",
            "--device",
            "cuda:0",
            "--batch-size",
            "256",
        ])
        .args(["--field", "v", "--dump"])
        .arg(&dump)
        .env("CUDA_VISIBLE_DEVICES", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(output.status.success(), "consume failed: {output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    let summary: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let batches = summary["batches"].as_u64().unwrap();
    assert_eq!(batches, SAMPLES / 256, "{summary}");

    // The daemon's second GPU filled every batch; its first filled none.
    let status = common::http::get(daemon.address(), "/v1/status", None).json();
    assert_eq!(
        served(&status, "cuda:1")["batches"].as_u64(),
        Some(batches),
        "{status}"
    );
    assert_eq!(
        served(&status, "cuda:0")["batches"].as_u64(),
        Some(0),
        "{status}"
    );
    // Bit-exact: dataset order, every sample once.
    assert!(
        common::read_npy(&dump).bytes == source,
        "the batches differ from the source"
    );
}
