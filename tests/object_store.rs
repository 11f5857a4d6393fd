//! Datasets in object storage, end to end against a real S3-compatible server: `moto` in server
//! mode (`python3 -m moto.server`, from PyPI: `tests/requirements.txt`), started by each test on a
//! loopback port of its own. `gpufeed pack --out s3://...` uploads; `gpufeed serve` registers by
//! `--dataset NAME=URL`, `datasets` in its `--config` file and `POST /v1/datasets`, and serves
//! through its object cache. Covered: batches equal to those of the same dataset on local disk,
//! cache hits after the first epoch and after a restart, half-written cache files removed at
//! start, eviction under a small budget and pinned shards never evicted, the server killed and
//! restarted mid-epoch, a corrupt object, and the errors of a missing bucket and manifest at
//! registration. The cache's own rules (least recently used evicted first, one fetch shared by
//! the holders of a shard, retries that recover, damaged transfers fetched again) are tested
//! against a store with injected faults in `src/remote/cache.rs`.
//!
//! Without moto the tests print a loud SKIPPED line and pass, except in CI (`CI` set), where they
//! fail: CI installs it.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::daemon::Daemon;
use gpufeed_client::consumer::Client;
use gpufeed_client::protocol::{CorruptPolicy, Shuffle, StreamSpec};
use gpufeed_client::DType;
use serde_json::{json, Value};

/// Samples of the test datasets: 2048 of 256 f16 (raw, 1 MiB) and 4 i32 (LZ4), 8 shards.
const SAMPLES: u64 = 2048;
const EMB_DIM: u64 = 256;
const SAMPLES_PER_SHARD: &str = "256";
const SHARDS: u64 = 8;
const BUCKET: &str = "gpufeed-test";
/// The test's secret key, which no error or log may show.
const SECRET_ACCESS_KEY: &str = "gpufeed-test-secret-9f3a";

/// A moto S3 server, killed when dropped.
struct Moto {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
    auth: Auth,
}

/// Whether the server checks credentials (moto's IAM), or takes any.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Auth {
    Any,
    Checked,
}

impl Moto {
    /// Starts moto on a free loopback port, or `None` (after a loud SKIPPED line) where it is not
    /// installed outside CI.
    fn start(logs: &Path) -> Option<Moto> {
        Moto::start_with(logs, Auth::Any)
    }

    /// Starts moto as [`Moto::start`] does, checking credentials or not; with them checked no
    /// bucket is created (no request of ours would be allowed).
    fn start_with(logs: &Path, auth: Auth) -> Option<Moto> {
        let installed = Command::new("python3")
            .args(["-c", "import moto.server"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if !installed {
            assert!(
                std::env::var_os("CI").is_none(),
                "moto is not installed: run `python3 -m pip install -r tests/requirements.txt`"
            );
            eprintln!(
                "SKIPPED: python3's moto package is missing (pip install 'moto[server]'); the \
                 object storage tests did not run"
            );
            return None;
        }
        let port = common::free_port();
        let mut moto = Moto {
            child: None,
            port,
            log: logs.join(format!("moto-{port}.log")),
            auth,
        };
        moto.restart();
        Some(moto)
    }

    /// Starts the server (again) on its port, with an empty store, and creates the bucket; returns
    /// once it answers.
    fn restart(&mut self) {
        let mut command = Command::new("python3");
        if self.auth == Auth::Checked {
            // moto's switch for checking every request's signature against its IAM users.
            command.env("INITIAL_NO_AUTH_ACTION_COUNT", "0");
        }
        let mut child = command
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start moto");
        // Its readiness line, then the rest of its log to a file (a full pipe would block it).
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        loop {
            let mut line = String::new();
            let read = stderr.read_line(&mut line).unwrap();
            assert!(read > 0, "moto exited before it served: {line}");
            log.write_all(line.as_bytes()).unwrap();
            if line.contains("Running on") {
                break;
            }
        }
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut stderr, &mut log);
        });
        self.child = Some(child);
        if self.auth == Auth::Checked {
            return;
        }
        let status = self.request("PUT", &format!("/{BUCKET}"), &[]).0;
        assert_eq!(status, 200, "creating the bucket");
    }

    /// Kills the server (SIGKILL): its store is gone with it.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// An unsigned HTTP/1.1 request to the server (moto does not check signatures): the status
    /// and the body.
    fn request(&self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\nConnection: \
             close\r\n\r\n",
            self.port,
            body.len()
        )
        .unwrap();
        stream.write_all(body).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        let head_end = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("an HTTP answer")
            + 4;
        let status = std::str::from_utf8(&answer[9..12])
            .unwrap()
            .parse()
            .unwrap();
        (status, answer[head_end..].to_vec())
    }

    /// Object `key` of the bucket.
    fn get(&self, key: &str) -> Vec<u8> {
        let (status, body) = self.request("GET", &format!("/{BUCKET}/{key}"), &[]);
        assert_eq!(status, 200, "GET {key}");
        body
    }

    /// Writes object `key` of the bucket.
    fn put(&self, key: &str, bytes: &[u8]) {
        let status = self.request("PUT", &format!("/{BUCKET}/{key}"), bytes).0;
        assert_eq!(status, 200, "PUT {key}");
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Points a command's object store client at `moto`, with test credentials and nothing else of
/// this machine's AWS settings.
fn s3_env(command: &mut Command, moto: &Moto) {
    for variable in [
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_CA_BUNDLE",
    ] {
        command.env_remove(variable);
    }
    command
        .env("AWS_ENDPOINT", moto.endpoint())
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "gpufeed-test-key")
        .env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        .env("AWS_DEFAULT_REGION", "us-east-1");
}

/// Token field: sample i holds [i, i*7, i*13, -i], so every sample names itself.
fn token_bytes() -> Vec<u8> {
    (0..SAMPLES as i32)
        .flat_map(|i| [i, i * 7, i * 13, -i])
        .flat_map(i32::to_le_bytes)
        .collect()
}

/// The test inputs as .npy files in `dir`.
fn write_inputs(dir: &Path) -> [PathBuf; 2] {
    let tok = common::write_npy(
        &dir.join("tok.npy"),
        DType::I32,
        &[SAMPLES, 4],
        &token_bytes(),
    );
    let emb = common::write_npy(
        &dir.join("emb.npy"),
        DType::F16,
        &[SAMPLES, EMB_DIM],
        &gpufeed::synth::embedding_f16((SAMPLES * EMB_DIM) as usize, 5),
    );
    [tok, emb]
}

/// `gpufeed pack` of the inputs in `inputs` as dataset `name` to `out` (a directory or a URL).
fn pack(inputs: &Path, name: &str, out: &str, moto: &Moto) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpufeed"));
    command
        .args(["pack", "--quiet", "--out", out, "--name", name])
        .args([
            "--block-bytes",
            "16K",
            "--samples-per-shard",
            SAMPLES_PER_SHARD,
        ])
        .arg("--field")
        .arg(format!("tok={}", inputs.join("tok.npy").display()))
        .arg("--field")
        .arg(format!("emb={}", inputs.join("emb.npy").display()));
    s3_env(&mut command, moto);
    common::assert_succeeds(&command.output().unwrap());
}

/// A test's directory: the inputs, a local copy of the dataset as `local` under the data root,
/// and the datasets `names` uploaded to the bucket.
fn setup(names: &[&str]) -> Option<(tempfile::TempDir, Moto)> {
    let root = tempfile::tempdir().unwrap();
    let moto = Moto::start(root.path())?;
    let inputs = root.path().join("inputs");
    std::fs::create_dir(&inputs).unwrap();
    write_inputs(&inputs);
    let local = root.path().join("local");
    pack(&inputs, "local", local.to_str().unwrap(), &moto);
    for name in names {
        pack(&inputs, name, &format!("s3://{BUCKET}/{name}"), &moto);
    }
    Some((root, moto))
}

/// A CPU daemon on `root` (its control API on), its object cache in `root/cache`, reaching
/// `moto`, with `extra` arguments.
fn serve(root: &Path, moto: &Moto, extra: &[&str]) -> Daemon {
    let cache = root.join("cache");
    let mut arguments = vec!["--object-cache-dir", cache.to_str().unwrap()];
    arguments.extend_from_slice(extra);
    let mut command = common::daemon::serve_command(root, &arguments);
    s3_env(&mut command, moto);
    common::daemon::start(command, &root.join("logs"))
}

fn spec(dataset: &str) -> StreamSpec {
    let mut spec = StreamSpec::new(dataset, 100);
    spec.shuffle = Shuffle::Full;
    spec.seed = 11;
    spec.prefetch = 2;
    spec
}

/// Every batch of one epoch of `dataset`: its fields' bytes, in order. Returns once the daemon
/// has ended the stream's session, so that the shards it held are let go.
fn epoch(daemon: &Daemon, dataset: &str) -> Vec<Vec<u8>> {
    epoch_of(daemon, spec(dataset))
}

fn epoch_of(daemon: &Daemon, request: StreamSpec) -> Vec<Vec<u8>> {
    let dataset = request.dataset.clone();
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(request)
        .unwrap_or_else(|error| panic!("{dataset}: {error}; log:\n{}", daemon.log()));
    let batches = stream
        .by_ref()
        .map(|batch| {
            let batch = batch.unwrap_or_else(|error| panic!("{dataset}: {error}"));
            let mut bytes = batch.field("tok").unwrap().host_bytes().unwrap().to_vec();
            bytes.extend_from_slice(batch.field("emb").unwrap().host_bytes().unwrap());
            bytes
        })
        .collect();
    drop(stream);
    wait_for_no_sessions(daemon);
    batches
}

/// Waits (bounded) until the daemon lists no consumer session: a session ends, and lets go of
/// what its stream held, just after its consumer leaves.
fn wait_for_no_sessions(daemon: &Daemon) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while common::http::get(daemon.address(), "/v1/sessions", None).json()["sessions"]
        .as_array()
        .is_some_and(|sessions| !sessions.is_empty())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "a session never ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The error a stream of `spec` ends with: refused when it opens, or failing a batch (a host
/// stream fetches its shards batch by batch).
fn stream_error(daemon: &Daemon, spec: StreamSpec) -> String {
    let mut stream = match Client::connect(&daemon.socket).unwrap().open_stream(spec) {
        Ok(stream) => stream,
        Err(error) => return error.to_string(),
    };
    let mut batches = 0;
    for batch in stream.by_ref() {
        match batch {
            Ok(_) => batches += 1,
            Err(error) => return error.to_string(),
        }
    }
    panic!(
        "the stream must fail; it served {batches} batches; cache {}; log:\n{}",
        cache_status(daemon),
        daemon.log()
    )
}

/// The object cache's figures in `/v1/status`.
fn cache_status(daemon: &Daemon) -> Value {
    common::http::get(daemon.address(), "/v1/status", None).json()["object_cache"].clone()
}

/// `key` of the cache's figures as a number.
fn figure(status: &Value, key: &str) -> u64 {
    status[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in {status}"))
}

#[test]
fn batches_equal_the_local_dataset_and_the_cache_serves_later_epochs_and_restarts() {
    let Some((root, moto)) = setup(&["remote", "viaapi"]) else {
        return;
    };
    let url = format!("s3://{BUCKET}/remote");
    let mut daemon = serve(root.path(), &moto, &["--dataset", &format!("remote={url}")]);
    let local = epoch(&daemon, "local");
    assert_eq!(local.len() as u64, SAMPLES / 100);
    assert!(epoch(&daemon, "remote") == local, "the first epoch differs");
    let first = cache_status(&daemon);
    assert_eq!(figure(&first, "misses"), SHARDS, "{first}");
    assert_eq!(figure(&first, "hits"), 0, "{first}");
    assert!(
        figure(&first, "fetched_bytes") > SAMPLES * EMB_DIM * 2,
        "{first}"
    );
    assert!(
        epoch(&daemon, "remote") == local,
        "the second epoch differs"
    );
    let second = cache_status(&daemon);
    assert_eq!(figure(&second, "misses"), SHARDS, "{second}");
    assert_eq!(figure(&second, "hits"), SHARDS, "{second}");
    let metrics = common::http::get(daemon.address(), "/metrics", None);
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(
        text.contains(&format!("gpufeed_object_cache_hits_total {SHARDS}")),
        "{text}"
    );

    // Listed by the API with its URL, from the configuration rather than the catalog.
    let listed = common::http::get(daemon.address(), "/v1/datasets", None).json();
    let remote = listed["datasets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|dataset| dataset["name"] == "remote")
        .unwrap_or_else(|| panic!("not listed: {listed}"))
        .clone();
    assert_eq!(remote["path"], url.as_str(), "{remote}");
    assert_eq!(remote["origin"], "configured", "{remote}");
    assert_eq!(remote["state"], "ready", "{remote}");
    assert_eq!(remote["shards"], SHARDS, "{remote}");

    // Registered through the API; a missing manifest or bucket is refused naming the URL.
    let created = common::http::send_json(
        daemon.address(),
        "POST",
        "/v1/datasets",
        &json!({"name": "viaapi", "path": format!("s3://{BUCKET}/viaapi")}),
        None,
    );
    assert_eq!(created.status, 201, "{}", created.json());
    assert_eq!(created.json()["path"], format!("s3://{BUCKET}/viaapi"));
    assert!(
        epoch(&daemon, "viaapi") == local,
        "the API's dataset differs"
    );
    for (name, missing) in [
        ("nothing", format!("s3://{BUCKET}/nothing")),
        ("nobucket", "s3://no-such-bucket/data".to_string()),
    ] {
        let refused = common::http::send_json(
            daemon.address(),
            "POST",
            "/v1/datasets",
            &json!({"name": name, "path": missing}),
            None,
        );
        refused.assert_error(422, "invalid_dataset");
        let message = refused.json()["message"].as_str().unwrap().to_string();
        assert!(
            message.contains(&format!("{missing}/manifest.json")) && message.contains("not found"),
            "{message}"
        );
    }

    // A fetch a stopped daemon left half-written is removed at start; what was complete is
    // served from the cache again, without a request for a shard.
    let cached_dir = std::fs::read_dir(root.path().join("cache"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.is_dir())
        .unwrap();
    let partial = cached_dir.join(".shard-000000.gfs.fetch-1-1");
    std::fs::write(&partial, b"half").unwrap();
    daemon.signal_and_wait(libc::SIGTERM);
    drop(daemon);
    let daemon = serve(root.path(), &moto, &["--dataset", &format!("remote={url}")]);
    assert!(!partial.exists(), "the half-written file is still there");
    assert!(
        epoch(&daemon, "remote") == local,
        "the epoch after a restart differs"
    );
    assert!(
        epoch(&daemon, "viaapi") == local,
        "the API's dataset after a restart"
    );
    let restarted = cache_status(&daemon);
    assert_eq!(figure(&restarted, "misses"), 0, "{restarted}");
    assert_eq!(figure(&restarted, "hits"), 2 * SHARDS, "{restarted}");
    assert!(
        !daemon.log().contains(SECRET_ACCESS_KEY),
        "the secret key is in the log"
    );
}

/// The bytes of every shard of the dataset packed in `dir` (the bucket's copies are packed alike).
fn dataset_bytes(dir: &Path) -> u64 {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    manifest["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|shard| shard["file_bytes"].as_u64().unwrap())
        .sum()
}

#[test]
fn a_small_budget_evicts_the_least_recently_used_and_fetches_again() {
    let Some((root, moto)) = setup(&["first", "second"]) else {
        return;
    };
    let bytes = dataset_bytes(&root.path().join("local"));
    // Room for one dataset and half of another.
    let budget = (bytes + bytes / 2).to_string();
    let daemon = serve(
        root.path(),
        &moto,
        &[
            "--object-cache-max",
            &budget,
            "--dataset",
            &format!("first=s3://{BUCKET}/first"),
            "--dataset",
            &format!("second=s3://{BUCKET}/second"),
        ],
    );
    let local = epoch(&daemon, "local");
    assert!(epoch(&daemon, "first") == local);
    assert!(epoch(&daemon, "second") == local);
    let after_two = cache_status(&daemon);
    assert!(figure(&after_two, "evictions") > 0, "{after_two}");
    assert!(figure(&after_two, "bytes") <= figure(&after_two, "budget_bytes"));
    assert_eq!(figure(&after_two, "misses"), 2 * SHARDS, "{after_two}");
    // The first dataset's shards made room for the second's: fetched again.
    assert!(epoch(&daemon, "first") == local);
    let again = cache_status(&daemon);
    assert!(figure(&again, "misses") > 2 * SHARDS, "{again}");
}

#[test]
fn the_server_killed_mid_epoch_fails_new_fetches_clearly_and_serves_again_once_back() {
    let Some((root, mut moto)) = setup(&["cached", "later"]) else {
        return;
    };
    let daemon = serve(
        root.path(),
        &moto,
        &[
            "--dataset",
            &format!("cached=s3://{BUCKET}/cached"),
            "--dataset",
            &format!("later=s3://{BUCKET}/later"),
        ],
    );
    let local = epoch(&daemon, "local");
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(spec("cached"))
        .unwrap();
    let mut served = Vec::new();
    for batch in stream.by_ref().take(local.len() / 2) {
        let batch = batch.unwrap();
        let mut bytes = batch.field("tok").unwrap().host_bytes().unwrap().to_vec();
        bytes.extend_from_slice(batch.field("emb").unwrap().host_bytes().unwrap());
        served.push(bytes);
    }
    // The store goes away mid-epoch: the open stream's shards are in the cache, so the epoch
    // goes on, exactly.
    moto.kill();
    for batch in stream.by_ref() {
        let batch = batch.unwrap();
        let mut bytes = batch.field("tok").unwrap().host_bytes().unwrap().to_vec();
        bytes.extend_from_slice(batch.field("emb").unwrap().host_bytes().unwrap());
        served.push(bytes);
    }
    assert!(
        served == local,
        "the epoch across the store's death differs"
    );
    drop(stream);
    // A stream whose shards must be fetched fails after the retries, naming the object.
    let error = stream_error(&daemon, spec("later"));
    assert!(
        error.contains(&format!("s3://{BUCKET}/later/shard-")) && error.contains("tries"),
        "{error}"
    );
    let down = cache_status(&daemon);
    assert!(figure(&down, "fetch_errors") >= 4, "{down}");
    // A registration while the store is down is refused naming the URL.
    let refused = common::http::send_json(
        daemon.address(),
        "POST",
        "/v1/datasets",
        &json!({"name": "other", "path": format!("s3://{BUCKET}/cached")}),
        None,
    );
    refused.assert_error(422, "invalid_dataset");
    assert!(
        refused.json()["message"]
            .as_str()
            .unwrap()
            .contains(&format!("s3://{BUCKET}/cached/manifest.json")),
        "{}",
        refused.json()
    );
    // Back (empty: moto keeps its store in memory), the dataset uploaded again: served exactly.
    moto.restart();
    pack(
        &root.path().join("inputs"),
        "later",
        &format!("s3://{BUCKET}/later"),
        &moto,
    );
    assert!(
        epoch(&daemon, "later") == local,
        "after the store came back"
    );
    assert!(epoch(&daemon, "cached") == local, "the cached dataset");
}

#[test]
fn a_corrupt_object_is_detected_and_handled_as_local_corruption() {
    let Some((root, moto)) = setup(&["damaged"]) else {
        return;
    };
    // One stored byte of shard 1's first payload block changed in the bucket.
    let key = "damaged/shard-000001.gfs";
    let mut shard = moto.get(key);
    let payload_offset = u64::from_le_bytes(shard[48..56].try_into().unwrap()) as usize;
    shard[payload_offset + 100] ^= 0x5a;
    moto.put(key, &shard);
    let daemon = serve(
        root.path(),
        &moto,
        &["--dataset", &format!("damaged=s3://{BUCKET}/damaged")],
    );
    let mut failing = spec("damaged");
    failing.shuffle = Shuffle::None;
    failing.on_corrupt = CorruptPolicy::Fail;
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(failing)
        .unwrap();
    let error = stream
        .by_ref()
        .find_map(Result::err)
        .expect("the stream must fail")
        .to_string();
    assert!(
        error.contains("shard-000001.gfs") && error.contains("block"),
        "{error}"
    );
    drop(stream);
    let status = cache_status(&daemon);
    // Fetched twice with the same block failing: the object's own corruption, kept.
    assert_eq!(figure(&status, "corrupt_fetches"), 2, "{status}");
    let mut replacing = spec("damaged");
    replacing.on_corrupt = CorruptPolicy::Replace;
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(replacing)
        .unwrap();
    let replaced: u32 = stream.by_ref().map(|batch| batch.unwrap().replaced()).sum();
    assert!(replaced > 0, "no sample was replaced");
}

#[test]
fn refused_credentials_and_a_missing_bucket_stop_the_start_naming_the_url() {
    let root = tempfile::tempdir().unwrap();
    let Some(moto) = Moto::start_with(root.path(), Auth::Checked) else {
        return;
    };
    let url = format!("s3://{BUCKET}/data");
    let mut command = common::daemon::serve_command(
        root.path(),
        &["--dataset", &format!("data={url}"), "--http", "off"],
    );
    s3_env(&mut command, &moto);
    let output = command.output().unwrap();
    let error = common::assert_fails(&output);
    assert!(
        error.contains(&format!("--dataset data: {url}/manifest.json"))
            && error.contains("access denied")
            && error.contains("credentials"),
        "{error}"
    );
    assert!(
        !error.contains(SECRET_ACCESS_KEY),
        "the secret key is in the error: {error}"
    );
    drop(moto);

    let Some(open) = Moto::start(root.path()) else {
        return;
    };
    let missing = "s3://no-such-bucket/data";
    let mut command = common::daemon::serve_command(
        root.path(),
        &["--dataset", &format!("data={missing}"), "--http", "off"],
    );
    s3_env(&mut command, &open);
    let error = common::assert_fails(&command.output().unwrap());
    assert!(
        error.contains(&format!("{missing}/manifest.json: not found")),
        "{error}"
    );
}

#[test]
fn pack_out_to_a_url_refuses_a_dataset_already_there_unless_forced() {
    let Some((root, moto)) = setup(&["packed"]) else {
        return;
    };
    let inputs = root.path().join("inputs");
    let mut again = Command::new(env!("CARGO_BIN_EXE_gpufeed"));
    again
        .args(["pack", "--quiet", "--out", &format!("s3://{BUCKET}/packed")])
        .arg("--field")
        .arg(format!("tok={}", inputs.join("tok.npy").display()));
    s3_env(&mut again, &moto);
    let error = common::assert_fails(&again.output().unwrap());
    assert!(
        error.contains(&format!("s3://{BUCKET}/packed/manifest.json")) && error.contains("--force"),
        "{error}"
    );
    // The refused upload wrote nothing: the dataset there is still the one packed first.
    let daemon = serve(
        root.path(),
        &moto,
        &["--dataset", &format!("packed=s3://{BUCKET}/packed")],
    );
    assert!(epoch(&daemon, "packed") == epoch(&daemon, "local"));
    drop(daemon);
    again.arg("--force");
    common::assert_succeeds(&again.output().unwrap());
    // Replaced: the dataset there now has the one field packed last.
    let daemon = serve(
        root.path(),
        &moto,
        &["--dataset", &format!("packed=s3://{BUCKET}/packed")],
    );
    let listed = common::http::get(daemon.address(), "/v1/datasets/packed", None).json();
    assert_eq!(listed["dataset"]["fields"], json!(["tok"]), "{listed}");
}

#[test]
fn a_dataset_larger_than_the_cache_streams_in_order_fetching_ahead_and_evicting_behind() {
    let Some((root, moto)) = setup(&["large"]) else {
        return;
    };
    let bytes = dataset_bytes(&root.path().join("local"));
    // Room for a little over half the dataset: a host stream holds only the shards of its batch
    // and the few after it.
    let budget = (bytes / 2 + bytes / 8).max(1 << 20);
    assert!(
        budget < bytes,
        "the dataset must not fit: {bytes} bytes, budget {budget}"
    );
    let daemon = serve(
        root.path(),
        &moto,
        &[
            "--object-cache-max",
            &budget.to_string(),
            "--dataset",
            &format!("large=s3://{BUCKET}/large"),
        ],
    );
    let in_order = |dataset: &str| {
        let mut request = spec(dataset);
        request.shuffle = Shuffle::None;
        epoch_of(&daemon, request)
    };
    let local = in_order("local");
    assert!(in_order("large") == local, "the first epoch differs");
    let first = cache_status(&daemon);
    assert_eq!(figure(&first, "misses"), SHARDS, "{first}");
    assert!(figure(&first, "evictions") > 0, "{first}");
    assert!(figure(&first, "bytes") <= budget, "{first}");
    assert!(in_order("large") == local, "the second epoch differs");
    let second = cache_status(&daemon);
    assert!(figure(&second, "misses") > SHARDS, "{second}");
    assert!(figure(&second, "bytes") <= budget, "{second}");
    // A fully shuffled batch reads every shard at once: more than the budget holds.
    let refused = stream_error(&daemon, spec("large"));
    assert!(
        refused.contains("object cache cannot hold")
            && refused.contains(&format!("s3://{BUCKET}/large/"))
            && refused.contains("--object-cache-max"),
        "{refused}"
    );
}

#[test]
fn a_stream_in_dataset_order_fails_clearly_when_the_store_dies_before_its_next_shards() {
    // Samples of 64 KiB in batches of 176 (11 MiB): the stream's ring holds two slots, so its
    // filler stays within two batches of the consumer, and it fetches shards (of 32 samples) only
    // a few ahead of the batch it fills; the last batch's shards are fetched after the store died.
    const BIG_SAMPLES: u64 = 1024;
    const BIG_DIM: u64 = 32768;
    let root = tempfile::tempdir().unwrap();
    let Some(mut moto) = Moto::start(root.path()) else {
        return;
    };
    let inputs = root.path().join("inputs");
    std::fs::create_dir(&inputs).unwrap();
    let rows = common::write_npy(
        &inputs.join("rows.npy"),
        DType::F16,
        &[BIG_SAMPLES, BIG_DIM],
        &common::noise((BIG_SAMPLES * BIG_DIM * 2) as usize, 3),
    );
    for out in [
        root.path().join("local").display().to_string(),
        format!("s3://{BUCKET}/big"),
    ] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpufeed"));
        command
            .args(["pack", "--quiet", "--codec", "raw", "--out", &out])
            .args(["--samples-per-shard", "32", "--field"])
            .arg(format!("rows={}", rows.display()));
        s3_env(&mut command, &moto);
        common::assert_succeeds(&command.output().unwrap());
    }
    let daemon = serve(
        root.path(),
        &moto,
        &["--dataset", &format!("big=s3://{BUCKET}/big")],
    );
    let request = |dataset: &str| {
        let mut request = StreamSpec::new(dataset, 176);
        request.shuffle = Shuffle::None;
        request.prefetch = 2;
        request
    };
    let rows_of = |batch: &gpufeed_client::consumer::Batch| {
        batch.field("rows").unwrap().host_bytes().unwrap().to_vec()
    };
    let local: Vec<Vec<u8>> = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(request("local"))
        .unwrap()
        .map(|batch| rows_of(&batch.unwrap()))
        .collect();
    assert_eq!(local.len(), 5);
    let mut stream = Client::connect(&daemon.socket)
        .unwrap()
        .open_stream(request("big"))
        .unwrap();
    let mut served = vec![rows_of(&stream.next().unwrap().unwrap())];
    moto.kill();
    let mut failure = None;
    for batch in stream.by_ref() {
        match batch {
            Ok(batch) => served.push(rows_of(&batch)),
            Err(error) => failure = Some(error.to_string()),
        }
    }
    let failure = failure.expect("the stream must fail once its next shards cannot come");
    assert!(
        failure.contains(&format!("s3://{BUCKET}/big/shard-")) && failure.contains("tries"),
        "{failure}"
    );
    assert!(
        served.len() < local.len(),
        "served {} batches",
        served.len()
    );
    assert!(
        served[..] == local[..served.len()],
        "a batch served before the failure differs"
    );
}

/// Where the environment gives no keys, the profile `AWS_PROFILE` names in the shared AWS files
/// gives them, and its `endpoint_url` reaches the store: a dataset registered with no `AWS_*` key
/// or endpoint in the environment serves the same batches as with them. A profile named but in
/// neither file stops the start naming the profile, and no secret of the files is shown.
#[test]
fn an_aws_profile_gives_the_keys_and_endpoint_the_environment_does_not() {
    let Some((root, moto)) = setup(&["profiled"]) else {
        return;
    };
    let aws = root.path().join("aws");
    std::fs::create_dir_all(&aws).unwrap();
    std::fs::write(
        aws.join("credentials"),
        format!(
            "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n\
             [gpufeed-test]\naws_access_key_id = gpufeed-test-key\n\
             aws_secret_access_key = {SECRET_ACCESS_KEY}\n"
        ),
    )
    .unwrap();
    std::fs::write(
        aws.join("config"),
        format!(
            "[profile gpufeed-test]\nregion = us-east-1\nendpoint_url = {}\n",
            moto.endpoint()
        ),
    )
    .unwrap();
    let profiled = |profile: &str, extra: &[&str]| {
        let cache = root.path().join("cache-profile");
        let mut arguments = vec!["--object-cache-dir", cache.to_str().unwrap()];
        arguments.extend_from_slice(extra);
        let mut command = common::daemon::serve_command(root.path(), &arguments);
        for variable in [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        ] {
            command.env_remove(variable);
        }
        command
            .env("AWS_PROFILE", profile)
            .env("AWS_SHARED_CREDENTIALS_FILE", aws.join("credentials"))
            .env("AWS_CONFIG_FILE", aws.join("config"))
            .env("AWS_ALLOW_HTTP", "true");
        command
    };
    let url = format!("s3://{BUCKET}/profiled");
    let daemon = common::daemon::start(
        profiled("gpufeed-test", &["--dataset", &format!("profiled={url}")]),
        &root.path().join("logs"),
    );
    // The same data packed locally, under the same data root.
    assert!(epoch(&daemon, "profiled") == epoch(&daemon, "local"));
    drop(daemon);

    let output = profiled(
        "nobody",
        &["--dataset", &format!("profiled={url}"), "--http", "off"],
    )
    .output()
    .unwrap();
    let error = common::assert_fails(&output);
    assert!(
        error.contains("AWS_PROFILE names the profile 'nobody'") && error.contains(&url),
        "{error}"
    );
    assert!(!error.contains(SECRET_ACCESS_KEY), "{error}");
}

/// A dataset in object storage named in the configuration file (`datasets`, as in
/// `deploy/gpufeed.toml`), with the cache's directory and budget set there too: registered at
/// start and served equal to the local copy, through the cache the file names. A file naming a
/// dataset the bucket lacks stops the start naming the URL.
#[test]
fn a_dataset_named_in_the_configuration_file_is_served_through_the_cache_it_names() {
    let Some((root, moto)) = setup(&["fromtoml"]) else {
        return;
    };
    let url = format!("s3://{BUCKET}/fromtoml");
    let cache = root.path().join("toml-cache");
    let config = root.path().join("gpufeed.toml");
    let write_config = |datasets: &str| {
        std::fs::write(
            &config,
            format!(
                "datasets = [{datasets:?}]\nobject_cache_dir = {:?}\nobject_cache_max = \"64M\"\n",
                cache.display().to_string()
            ),
        )
        .unwrap();
    };
    write_config(&format!("fromtoml={url}"));
    let config_argument = config.to_str().unwrap().to_string();
    let mut command =
        common::daemon::serve_command(root.path(), &["--config", config_argument.as_str()]);
    s3_env(&mut command, &moto);
    let mut daemon = common::daemon::start(command, &root.path().join("logs"));
    assert!(
        epoch(&daemon, "fromtoml") == epoch(&daemon, "local"),
        "the configured dataset differs"
    );
    let listed = common::http::get(daemon.address(), "/v1/datasets/fromtoml", None).json();
    assert_eq!(listed["dataset"]["path"], url.as_str(), "{listed}");
    assert_eq!(listed["dataset"]["origin"], "configured", "{listed}");
    let status = cache_status(&daemon);
    assert_eq!(figure(&status, "budget_bytes"), 64 << 20, "{status}");
    assert_eq!(figure(&status, "misses"), SHARDS, "{status}");
    // The shards are in the directory the file names (one directory per dataset under it).
    let cached_shards = std::fs::read_dir(&cache)
        .unwrap_or_else(|error| panic!("{}: {error}", cache.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_dir())
        .flat_map(|dir| std::fs::read_dir(dir).unwrap())
        .filter(|entry| {
            let name = entry.as_ref().unwrap().file_name();
            let name = name.to_string_lossy();
            name.ends_with(".gfs") && !name.starts_with('.')
        })
        .count() as u64;
    assert_eq!(cached_shards, SHARDS);
    daemon.signal_and_wait(libc::SIGTERM);
    drop(daemon);

    let absent = format!("s3://{BUCKET}/absent");
    write_config(&format!("absent={absent}"));
    let mut command = common::daemon::serve_command(
        root.path(),
        &["--config", config_argument.as_str(), "--http", "off"],
    );
    s3_env(&mut command, &moto);
    let error = common::assert_fails(&command.output().unwrap());
    assert!(
        error.contains(&format!("{absent}/manifest.json")) && error.contains("not found"),
        "{error}"
    );
}

/// A variable-length field (format version 2) in object storage: packed to the bucket from values
/// and offsets (`pack --offsets`), served through the object cache in both batch forms, every batch
/// equal to the same dataset's on local disk.
#[test]
fn a_variable_length_dataset_serves_from_object_storage_as_from_local_disk() {
    use gpufeed_client::protocol::{BatchForm, VariableRequest};
    let Some((root, moto)) = setup(&[]) else {
        return;
    };
    // Documents of 0 to 50 tokens, sample i's tokens starting at i * 1000.
    let (mut values, mut offsets) = (Vec::new(), vec![0i64]);
    for sample in 0..SAMPLES as i64 {
        let length = (sample * 7919 + 3) % 51;
        values.extend((0..length).map(|t| (sample * 1000 + t) as i32));
        offsets.push(values.len() as i64);
    }
    let inputs = root.path().join("inputs");
    let values_bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let offsets_bytes: Vec<u8> = offsets.iter().flat_map(|v| v.to_le_bytes()).collect();
    common::write_npy(
        &inputs.join("docs.npy"),
        DType::I32,
        &[values.len() as u64],
        &values_bytes,
    );
    common::write_npy(
        &inputs.join("docs.offsets.npy"),
        DType::I64,
        &[offsets.len() as u64],
        &offsets_bytes,
    );
    for (name, out) in [
        ("docs", root.path().join("docs").display().to_string()),
        ("remote", format!("s3://{BUCKET}/docs")),
    ] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpufeed"));
        command
            .args(["pack", "--quiet", "--out", &out, "--name", name])
            .args(["--block-bytes", "4K", "--samples-per-shard", "300"])
            .arg("--field")
            .arg(format!("tokens={}", inputs.join("docs.npy").display()))
            .arg("--offsets")
            .arg(format!(
                "tokens={}",
                inputs.join("docs.offsets.npy").display()
            ))
            .arg("--field")
            .arg(format!("emb={}", inputs.join("emb.npy").display()));
        s3_env(&mut command, &moto);
        common::assert_succeeds(&command.output().unwrap());
    }
    let url = format!("s3://{BUCKET}/docs");
    let daemon = serve(root.path(), &moto, &["--dataset", &format!("remote={url}")]);
    for form in [BatchForm::Padded, BatchForm::Packed] {
        let batches = |dataset: &str| -> Vec<Vec<u8>> {
            let mut request = spec(dataset);
            request.variable = vec![VariableRequest {
                name: "tokens".into(),
                form,
                cap: None,
            }];
            let mut stream = Client::connect(&daemon.socket)
                .unwrap()
                .open_stream(request)
                .unwrap_or_else(|error| panic!("{dataset}: {error}; log:\n{}", daemon.log()));
            let all = stream
                .by_ref()
                .map(|batch| {
                    let batch = batch.unwrap_or_else(|error| panic!("{dataset}: {error}"));
                    let mut bytes = Vec::new();
                    for field in batch.fields() {
                        bytes.extend_from_slice(field.host_bytes().unwrap());
                    }
                    bytes
                })
                .collect();
            drop(stream);
            wait_for_no_sessions(&daemon);
            all
        };
        let local = batches("docs");
        assert_eq!(local.len() as u64, SAMPLES / 100);
        assert!(
            batches("remote") == local,
            "{form:?}: the remote batches differ"
        );
    }
}

/// `pack --out s3://...` killed while it uploads leaves no dataset at the URL: its manifest goes
/// last, so registering the URL fails naming the missing manifest, and packing again (without
/// `--force`: there is no dataset to replace) uploads one that serves as the local copy does.
#[test]
fn a_pack_killed_mid_upload_leaves_no_dataset_and_packs_again() {
    let Some((root, moto)) = setup(&[]) else {
        return;
    };
    let inputs = root.path().join("inputs");
    // 64 shards of 32 samples (two of them 16 KiB blocks): an upload long enough to interrupt.
    let upload = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpufeed"));
        command
            .args(["pack", "--quiet", "--out", &format!("s3://{BUCKET}/cut")])
            .args([
                "--name",
                "cut",
                "--block-bytes",
                "16K",
                "--samples-per-shard",
                "32",
            ])
            .args(["--threads", "1"])
            .arg("--field")
            .arg(format!("tok={}", inputs.join("tok.npy").display()))
            .arg("--field")
            .arg(format!("emb={}", inputs.join("emb.npy").display()));
        s3_env(&mut command, &moto);
        command.stdout(Stdio::null()).stderr(Stdio::null());
        command
    };
    let listing = || {
        let (status, body) =
            moto.request("GET", &format!("/{BUCKET}?list-type=2&prefix=cut/"), &[]);
        assert_eq!(status, 200);
        String::from_utf8_lossy(&body).into_owned()
    };
    let mut cut = false;
    for _attempt in 0..5 {
        let mut child = upload().spawn().unwrap();
        // Killed as soon as its first shard object is in the bucket.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !listing().contains(".gfs") && std::time::Instant::now() < deadline {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let _ = child.kill();
        child.wait().unwrap();
        let now = listing();
        if now.contains(".gfs") && !now.contains("manifest.json") {
            cut = true;
            break;
        }
        // It finished before it was killed (or uploaded nothing): remove what is there and try
        // again.
        for key in now
            .split("<Key>")
            .skip(1)
            .filter_map(|k| k.split("</Key>").next())
        {
            moto.request("DELETE", &format!("/{BUCKET}/{key}"), &[]);
        }
    }
    assert!(cut, "the pack was never killed mid-upload");
    let (status, _) = moto.request("GET", &format!("/{BUCKET}/cut/manifest.json"), &[]);
    assert_eq!(status, 404, "a manifest was uploaded by the killed pack");
    // Registering the URL fails, naming what is missing.
    let mut command = common::daemon::serve_command(
        root.path(),
        &[
            "--object-cache-dir",
            root.path().join("cache").to_str().unwrap(),
            "--dataset",
            &format!("cut=s3://{BUCKET}/cut"),
        ],
    );
    s3_env(&mut command, &moto);
    let output = command.output().unwrap();
    assert!(!output.status.success());
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(
        error.contains(&format!("s3://{BUCKET}/cut/manifest.json")),
        "{error}"
    );
    // Packed again, without --force, over the leftovers: served as the local copy.
    let mut again = upload();
    again.stderr(Stdio::piped());
    common::assert_succeeds(&again.output().unwrap());
    let daemon = serve(
        root.path(),
        &moto,
        &["--dataset", &format!("cut=s3://{BUCKET}/cut")],
    );
    assert!(epoch(&daemon, "cut") == epoch(&daemon, "local"));
}
