//! A dataset in Azure Blob Storage, end to end against Azurite, the storage emulator Microsoft
//! publishes (an npm package: `npm install azurite`): `gpufeed pack --out az://container/prefix`
//! uploads; `gpufeed serve --dataset NAME=az://...` registers it and serves it through the object
//! cache; every batch equals the same data packed locally, in a full shuffle, before and after a
//! restart (the second time from the cache). A missing container fails the registration naming
//! the URL. The emulator comes in through `AZURE_STORAGE_USE_EMULATOR=true` and
//! `AZURITE_BLOB_STORAGE_URL`, which the `object_store` crate reads from the environment like any
//! Azure setting (`docs/DEPLOY.md`).
//!
//! Azurite is `$AZURITE_BLOB` or `azurite-blob` on PATH; the container is made with the
//! `azure-storage-blob` Python package (`tests/requirements.txt`). Without either the test prints a
//! loud SKIPPED line and passes, except in CI (`CI` set), which installs both (`.ci/run`).

mod common;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::consumers::gpufeed_bin;

/// Azurite's well-known development account and key.
const ACCOUNT: &str = "devstoreaccount1";
const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
const CONTAINER: &str = "gpufeed-test";

/// An Azurite blob service on a loopback port, killed when dropped.
struct Azurite {
    child: Child,
    port: u16,
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Azurite blob service's command, where it is installed.
fn azurite_command() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("AZURITE_BLOB") {
        return Some(PathBuf::from(path));
    }
    let found = Command::new("azurite-blob")
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    found.then(|| PathBuf::from("azurite-blob"))
}

/// Whether python3 has the Azure SDK the test makes its container with.
fn azure_sdk() -> bool {
    Command::new("python3")
        .args(["-c", "import azure.storage.blob"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

impl Azurite {
    /// Starts Azurite in memory on a free loopback port and makes the test's container; `None`
    /// (after a loud SKIPPED line) where it or the SDK is not installed, outside CI.
    fn start(logs: &Path) -> Option<Azurite> {
        let (Some(command), true) = (azurite_command(), azure_sdk()) else {
            assert!(
                std::env::var_os("CI").is_none(),
                "Azurite or the Azure SDK is missing: `npm install azurite` (then AZURITE_BLOB=\
                 node_modules/.bin/azurite-blob) and `python3 -m pip install -r \
                 tests/requirements.txt`"
            );
            eprintln!(
                "SKIPPED: Azurite (npm install azurite) or python3's azure-storage-blob is \
                 missing; the Azure Blob Storage test did not run"
            );
            return None;
        };
        let port = common::free_port();
        let log = std::fs::File::create(logs.join("azurite.log")).unwrap();
        let child = Command::new(command)
            .args(["--silent", "--inMemoryPersistence", "--skipApiVersionCheck"])
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start Azurite");
        let azurite = Azurite { child, port };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "Azurite did not listen within 30 s"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let made = Command::new("python3")
            .args([
                "-c",
                "import sys\n\
                 from azure.storage.blob import BlobServiceClient\n\
                 BlobServiceClient.from_connection_string(sys.argv[1]).create_container(sys.argv[2])",
            ])
            .arg(azurite.connection_string())
            .arg(CONTAINER)
            .output()
            .unwrap();
        assert!(
            made.status.success(),
            "making the container: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        Some(azurite)
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn connection_string(&self) -> String {
        format!(
            "DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};\
             BlobEndpoint={}/{ACCOUNT};",
            self.endpoint()
        )
    }

    /// The environment that points the `object_store` crate's Azure client at this emulator.
    fn env(&self) -> [(&'static str, String); 2] {
        [
            ("AZURE_STORAGE_USE_EMULATOR", "true".to_string()),
            ("AZURITE_BLOB_STORAGE_URL", self.endpoint()),
        ]
    }
}

/// Writes an `.npy` of 3000 rows of 64 f32 (row r, element e: r * 64 + e) and packs it locally
/// under `root/local` and to `url` (shards of 500 rows: 6).
fn pack_both(root: &Path, url: &str, azurite: &Azurite) {
    let values: Vec<u8> = (0..3000 * 64u32)
        .flat_map(|v| (v as f32).to_le_bytes())
        .collect();
    let npy = common::write_npy(
        &root.join("rows.npy"),
        gpufeed_client::DType::F32,
        &[3000, 64],
        &values,
    );
    for out in [root.join("local").to_str().unwrap(), url] {
        let output = Command::new(gpufeed_bin())
            .args([
                "pack",
                "--quiet",
                "--samples-per-shard",
                "500",
                "--out",
                out,
            ])
            .arg(&npy)
            .envs(azurite.env())
            .output()
            .unwrap();
        common::assert_succeeds(&output);
    }
}

/// The rows `gpufeed consume` dumps of `dataset` from the daemon at `socket`, in a full shuffle.
fn dump(socket: &Path, dataset: &str, out: &Path) -> Vec<u8> {
    let output = Command::new(gpufeed_bin())
        .arg("consume")
        .arg("--socket")
        .arg(socket)
        .args([
            "--dataset",
            dataset,
            "--batch-size",
            "128",
            "--shuffle",
            "full",
        ])
        .args(["--seed", "9", "--dump"])
        .arg(out)
        .output()
        .unwrap();
    common::assert_succeeds(&output);
    common::consumers::npy_payload(out)
}

#[test]
fn a_dataset_in_azure_blob_storage_packs_serves_and_restarts_from_the_cache() {
    let root = tempfile::tempdir().unwrap();
    let Some(azurite) = Azurite::start(root.path()) else {
        return;
    };
    let url = format!("az://{CONTAINER}/rows");
    pack_both(root.path(), &url, &azurite);
    let env = azurite.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let dataset = format!("rows={url}");
    for round in ["cold", "after a restart"] {
        let log = root.path().join(format!("daemon-{}.log", round.len()));
        let daemon = common::daemon::start_daemon_env(
            &gpufeed_bin(),
            root.path(),
            root.path().join("azure.sock"),
            "cpu",
            &["--dataset", &dataset],
            Stdio::from(std::fs::File::create(&log).unwrap()),
            &env,
        );
        let remote = dump(&daemon.socket, "rows", &root.path().join("remote.npy"));
        let local = dump(&daemon.socket, "local", &root.path().join("local.npy"));
        // Whole batches of 128 (the default tail policy drops the last, partial one).
        assert_eq!(remote.len(), 3000 / 128 * 128 * 64 * 4, "{round}");
        assert!(
            remote == local,
            "{round}: the Azure dataset serves other rows"
        );
        drop(daemon);
        // The restarted daemon found the six shards the first one fetched in its cache.
        let log = std::fs::read_to_string(&log).unwrap();
        let kept = if round == "cold" {
            "0 shard files"
        } else {
            "6 shard files"
        };
        assert!(
            log.contains(kept),
            "{round}: the cache did not hold {kept}:\n{log}"
        );
    }

    // A container that does not exist: the daemon does not start, and says which URL.
    let missing = "gone=az://no-such-container/rows";
    let output = Command::new(gpufeed_bin())
        .args(["serve", "--data-root"])
        .arg(root.path())
        .arg("--socket")
        .arg(root.path().join("missing.sock"))
        .args(["--device", "cpu", "--http", "off", "--dataset", missing])
        .envs(azurite.env())
        .output()
        .unwrap();
    let error = common::assert_fails(&output);
    assert!(
        error.contains("az://no-such-container/rows"),
        "the error does not name the URL: {error}"
    );
}
