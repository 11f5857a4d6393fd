//! Regression test: a FIFO (or a device) where a shard or the manifest should be hung `verify`,
//! `unpack`, the daemon's start-up scan and `POST /v1/datasets` (opening a FIFO waits for a writer;
//! reading `/dev/zero` never ends). Dataset files that are not regular files are now refused before
//! anything is read, with an error naming the path.
//!
//! The tests below cover each way in: the offline tools, `POST /v1/datasets` (a FIFO as the dataset
//! path, as its manifest, as a shard or as a pack input, and a manifest linked to `/dev/zero`, which
//! used to be read until memory ran out), and the daemon's start-up scan, which must start, serve the
//! other datasets and still stop on SIGTERM.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use gpufeed_client::DType;

/// Runs `gpufeed ARGS`, failing the test if it has not finished within 60 s (it used to hang).
fn run_bounded(args: &[&std::ffi::OsStr]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_gpufeed"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(output) => output.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("gpufeed {args:?} hung on a FIFO");
        }
    }
}

fn dataset(root: &Path) -> std::path::PathBuf {
    named_dataset(root, "set")
}

/// A dataset called `name` in `root/name`: two shards of 50 samples.
fn named_dataset(root: &Path, name: &str) -> std::path::PathBuf {
    let dir = root.join(name);
    common::pack_fields(
        &dir,
        &[common::field(
            "ids",
            DType::I32,
            &[1],
            common::i32_bytes(100, |i| i as i32),
        )],
        &common::options(name, 4096, Some(50)),
    );
    dir
}

fn replace_with_fifo(path: &Path) {
    std::fs::remove_file(path).unwrap();
    nix::unistd::mkfifo(
        path,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
}

#[test]
fn a_fifo_shard_is_refused_by_verify_and_unpack() {
    let root = tempfile::tempdir().unwrap();
    let dir = dataset(root.path());
    let shard = gpufeed::format::Dataset::open(&dir).unwrap().shards[1]
        .path
        .clone();
    replace_with_fifo(&shard);
    let name = shard.file_name().unwrap().to_string_lossy().into_owned();
    let verify = run_bounded(&["verify".as_ref(), dir.as_os_str(), "--quiet".as_ref()]);
    assert!(!verify.status.success());
    let text = String::from_utf8_lossy(&verify.stderr).into_owned()
        + &String::from_utf8_lossy(&verify.stdout);
    assert!(
        text.contains(&name) && text.contains("not a regular file"),
        "{text}"
    );
    let out = root.path().join("ids.npy");
    let unpack = run_bounded(&[
        "unpack".as_ref(),
        dir.as_os_str(),
        "--field".as_ref(),
        "ids".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
        "--quiet".as_ref(),
    ]);
    assert!(!unpack.status.success());
    assert!(String::from_utf8_lossy(&unpack.stderr).contains("not a regular file"));
}

#[test]
fn a_fifo_manifest_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = dataset(root.path());
    replace_with_fifo(&dir.join("manifest.json"));
    let inspect = run_bounded(&["inspect".as_ref(), dir.as_os_str()]);
    assert!(!inspect.status.success());
    let stderr = String::from_utf8_lossy(&inspect.stderr);
    assert!(
        stderr.contains("manifest.json") && stderr.contains("not a regular file"),
        "{stderr}"
    );
}

/// `f()`, failing the test if it has not returned within 30 s (a request used to hang on a FIFO).
fn within_30_s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    finished
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{what} hung"))
}

#[test]
fn post_datasets_answers_fifos_and_devices_with_an_error() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    // A FIFO as the dataset directory itself.
    replace_with_fifo_new(&data.join("pipe"));
    // A dataset whose manifest is a FIFO.
    let fifo_manifest = dataset(&data).parent().unwrap().join("fifo-manifest");
    std::fs::rename(data.join("set"), &fifo_manifest).unwrap();
    replace_with_fifo(&fifo_manifest.join("manifest.json"));
    // A dataset whose manifest is a symbolic link to /dev/zero.
    let zero_manifest = data.join("zero-manifest");
    std::fs::rename(dataset(&data), &zero_manifest).unwrap();
    std::fs::remove_file(zero_manifest.join("manifest.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero_manifest.join("manifest.json")).unwrap();
    // A dataset with a FIFO shard.
    let fifo_shard = data.join("fifo-shard");
    std::fs::rename(dataset(&data), &fifo_shard).unwrap();
    let shard = gpufeed::format::Dataset::open(&fifo_shard).unwrap().shards[0]
        .path
        .clone();
    replace_with_fifo(&shard);
    // A FIFO as a pack input.
    replace_with_fifo_new(&data.join("tokens.npy"));

    let daemon = common::daemon::start(common::daemon::serve_command(&data, &[]), root.path());
    let address = daemon.address();
    for (name, path, what) in [
        ("pipe", "pipe", "pipe is not a directory"),
        ("fifomanifest", "fifo-manifest", "manifest.json"),
        ("zeromanifest", "zero-manifest", "manifest.json"),
        ("fifoshard", "fifo-shard", "shard-"),
    ] {
        let body = serde_json::json!({"name": name, "path": path});
        let reply = within_30_s(&format!("POST /v1/datasets {body}"), move || {
            common::http::send_json(address, "POST", "/v1/datasets", &body, None)
        });
        let text = String::from_utf8_lossy(&reply.body).into_owned();
        assert!(
            (400..500).contains(&reply.status),
            "{path}: {} {text}",
            reply.status
        );
        assert!(
            text.contains(what),
            "{path}: the error names no file: {text}"
        );
    }
    let source = serde_json::json!({"fields": [{"name": "tokens", "npy": ["tokens.npy"]}]});
    let body = serde_json::json!({"name": "packed", "source": source});
    let reply = within_30_s("POST /v1/datasets with a FIFO input", move || {
        common::http::send_json(address, "POST", "/v1/datasets", &body, None)
    });
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    assert_eq!(reply.status, 400, "{text}");
    assert!(text.contains("not a regular file"), "{text}");
    // The API still answers: no thread is stuck on a FIFO.
    let status = within_30_s("GET /v1/status", move || {
        common::http::get(address, "/v1/status", None)
    });
    assert_eq!(status.status, 200);
}

#[test]
fn a_manifest_linked_to_dev_zero_is_refused_by_the_tools() {
    let root = tempfile::tempdir().unwrap();
    let dir = dataset(root.path());
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("manifest.json")).unwrap();
    for command in ["inspect", "verify"] {
        let output = run_bounded(&[command.as_ref(), dir.as_os_str()]);
        assert!(!output.status.success(), "{command} succeeded");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("manifest.json") && stderr.contains("not a regular file"),
            "{command}: {stderr}"
        );
    }
}

/// The start-up scan meets a dataset with a FIFO shard among the datasets of the data root: the
/// daemon starts, serves the good one, and stops on SIGTERM (it used to hang in the scan and ignore
/// the signal).
#[test]
fn the_start_up_scan_skips_a_fifo_shard_and_the_daemon_still_stops() {
    use std::io::BufRead;

    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    named_dataset(&data, "good");
    let bad = named_dataset(&data, "bad");
    let shard = gpufeed::format::Dataset::open(&bad).unwrap().shards[1]
        .path
        .clone();
    replace_with_fifo(&shard);
    let log_path = root.path().join("daemon.log");
    let mut child = common::daemon::serve_command(&data, &["--http", "off"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let first_line = within_30_s("the daemon's start-up scan", move || {
        let mut line = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .unwrap();
        line
    });
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        first_line.starts_with("gpufeed: serving"),
        "{first_line:?}; log:\n{}",
        log()
    );
    let socket = std::path::PathBuf::from(first_line.trim_end().rsplit(" on ").next().unwrap());
    let listed = gpufeed_client::Client::connect(&socket)
        .unwrap()
        .status()
        .unwrap();
    assert_eq!(listed.streams, 0);
    let mut stream = gpufeed_client::Client::connect(&socket)
        .unwrap()
        .open_stream(gpufeed_client::StreamSpec::new("good", 10))
        .unwrap();
    assert!(stream.next().unwrap().is_ok(), "log:\n{}", log());
    drop(stream);
    assert!(
        log().contains("not a regular file"),
        "the bad dataset is not reported: {}",
        log()
    );
    let pid = child.id();
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    let sent = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
    let status = within_30_s("the daemon's exit on SIGTERM", move || {
        child.wait().unwrap()
    });
    assert!(status.success(), "pid {pid}: {status:?}; log:\n{}", log());
}

fn replace_with_fifo_new(path: &Path) {
    nix::unistd::mkfifo(
        path,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
}

/// Regression test (issue 42, item 6): `gpufeed pack` blocked forever on a FIFO given as a `.npy`
/// input or as the file of `--field NAME=FILE:TENSOR` (opening a FIFO waits for a writer), though
/// `list-inputs` and `POST /v1/datasets` refused it. Pack inputs are now opened the way dataset files
/// are: anything but a regular file is refused, naming it.
#[test]
fn pack_refuses_a_fifo_input() {
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("ids.npy");
    replace_with_fifo_new(&npy);
    let tensors = tmp.path().join("fifo.safetensors");
    replace_with_fifo_new(&tensors);
    let out = tmp.path().join("ds");
    let field_npy = format!("a={}", npy.display());
    let field_tensor = format!("a={}:x", tensors.display());
    for field in [&field_npy, &field_tensor] {
        let output = run_bounded(&[
            "pack".as_ref(),
            "--quiet".as_ref(),
            "--out".as_ref(),
            out.as_os_str(),
            "--field".as_ref(),
            field.as_ref(),
        ]);
        let err = common::assert_fails(&output);
        let fifo = if field.contains("safetensors") {
            &tensors
        } else {
            &npy
        };
        common::assert_line_with(&err, &[&fifo.display().to_string(), "not a regular file"]);
        assert!(!out.exists());
    }
}

/// Regression test (issue 42, item 6): `serve --config FIFO` waited forever for a writer, and
/// `--config /dev/zero` read zeros until memory ran out. The configuration file must now be a
/// regular file of at most 1 MiB; either is refused naming it before the daemon starts.
#[test]
fn serve_refuses_a_fifo_or_device_or_huge_config() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("gpufeed.toml");
    replace_with_fifo_new(&fifo);
    let huge = tmp.path().join("huge.toml");
    std::fs::write(&huge, vec![b'#'; (1 << 20) + 1]).unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    for config in [fifo.as_path(), Path::new("/dev/zero"), huge.as_path()] {
        let output = run_bounded(&[
            "serve".as_ref(),
            "--data-root".as_ref(),
            data.as_os_str(),
            "--device".as_ref(),
            "cpu".as_ref(),
            "--http".as_ref(),
            "off".as_ref(),
            "--config".as_ref(),
            config.as_os_str(),
        ]);
        let err = common::assert_fails(&output);
        let why = if config == huge.as_path() {
            "larger than"
        } else {
            "not a regular file"
        };
        common::assert_line_with(&err, &[&config.display().to_string(), why]);
    }
}
