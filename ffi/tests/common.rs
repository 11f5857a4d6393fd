//! Shared by the ffi tests: a dataset packed from a .npy written here, and a CPU-backend daemon
//! serving it (the `gpufeed` binary of this workspace's target directory).

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Samples of the test dataset; each is two i32s: the sample index and a hash of it.
pub const SAMPLES: u32 = 1000;

/// The `ids` field's bytes: row `i` is `(i, i * 2654435761)`.
pub fn ids_bytes() -> Vec<u8> {
    (0..SAMPLES)
        .flat_map(|i| [i as i32, i.wrapping_mul(2_654_435_761) as i32])
        .flat_map(i32::to_le_bytes)
        .collect()
}

/// The target directory's profile folder (`target/debug`), from this test binary's path.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// The daemon binary, built when a run of this crate's tests alone has not built it.
pub fn gpufeed_bin() -> PathBuf {
    let bin = profile_dir().join("gpufeed");
    if !bin.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "gpufeed", "--bin", "gpufeed"])
            .status()
            .expect("cargo build");
        assert!(status.success(), "building the gpufeed binary failed");
    }
    bin
}

/// This crate's static library, built here for the profile the tests run under: `cargo test` builds
/// the library only as the rlib its tests link, so on a fresh clone no `.a` exists yet, and one left
/// by an earlier `cargo build` may be stale. Cargo rebuilds only what changed.
pub fn static_library() -> PathBuf {
    let profile = profile_dir();
    let mut build = Command::new(env!("CARGO"));
    build.args(["build", "-p", "gpufeed-ffi", "--lib"]);
    if profile.file_name().is_some_and(|name| name == "release") {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build");
    assert!(
        status.success(),
        "building the gpufeed-ffi static library failed"
    );
    let library = profile.join("libgpufeed_ffi.a");
    assert!(library.exists(), "cargo built no {}", library.display());
    library
}

/// Writes a C-order little-endian `<i4` .npy of shape `[rows, 2]`.
fn write_npy(path: &Path, rows: u32, data: &[u8]) {
    let mut header = format!("{{'descr': '<i4', 'fortran_order': False, 'shape': ({rows}, 2), }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write the .npy");
}

/// A daemon on the CPU backend serving datasets `toy` and `toy2` (field `ids`, four shards) from
/// `root`.
pub struct Daemon {
    child: Child,
    pub socket: PathBuf,
}

impl Daemon {
    pub fn start(root: &Path) -> Daemon {
        let npy = root.join("ids.npy");
        write_npy(&npy, SAMPLES, &ids_bytes());
        std::fs::create_dir_all(root.join("data")).unwrap();
        // `toy2`, the same rows, is a second source for mixtures.
        for name in ["toy", "toy2"] {
            let packed = Command::new(gpufeed_bin())
                .args([
                    "pack",
                    "--codec",
                    "raw",
                    "--samples-per-shard",
                    "250",
                    "--out",
                ])
                .arg(root.join("data").join(name))
                .arg(format!("--field=ids={}", npy.display()))
                .output()
                .expect("run gpufeed pack");
            assert!(
                packed.status.success(),
                "pack: {}",
                String::from_utf8_lossy(&packed.stderr)
            );
        }
        let socket = root.join("gpufeed.sock");
        let mut child = Command::new(gpufeed_bin())
            .args(["serve", "--device", "cpu", "--http", "off", "--data-root"])
            .arg(root.join("data"))
            .arg("--socket")
            .arg(&socket)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start gpufeed serve");
        // Ready once it says so (its first line), not after a sleep.
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(
            first.starts_with("gpufeed: serving"),
            "daemon said {first:?}"
        );
        Daemon { child, socket }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
