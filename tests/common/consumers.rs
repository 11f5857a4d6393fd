//! What the tests that run consumer processes against a daemon share: the binaries (where the test
//! binary runs away from its build tree, `GPUFEED_BIN` and `GPUFEED_CONSUME_BIN` name the
//! `gpufeed` binary and the `consume` example), the payload of the `.npy` files `consume --dump`
//! writes, a copy of a dataset for a second daemon, and the wait for a daemon's streams to close.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufeed_client::consumer::Client;

/// The `gpufeed` binary.
pub fn gpufeed_bin() -> PathBuf {
    std::env::var_os("GPUFEED_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_gpufeed")),
        PathBuf::from,
    )
}

/// The `consume` example, built beside the tests.
pub fn consume_bin() -> PathBuf {
    std::env::var_os("GPUFEED_CONSUME_BIN").map_or_else(
        || {
            let exe = std::env::current_exe().unwrap();
            exe.parent()
                .unwrap()
                .parent()
                .unwrap()
                .join("examples")
                .join("consume")
        },
        PathBuf::from,
    )
}

/// The data of the `.npy` at `path`, after its header.
pub fn npy_payload(path: &Path) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let header = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header..].to_vec()
}

/// Copies the dataset directory `from` into `to` (a daemon owns its data root, so a second daemon
/// serves a copy).
pub fn copy_dataset(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Waits (30 s at most) until the daemon at `socket` counts no stream and no slot: every stream
/// closed and its slots reclaimed.
pub fn wait_for_no_streams(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = Client::connect(socket).unwrap().status().unwrap();
        if status.slots_allocated == 0 && status.streams == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "streams never closed, or their slots never reclaimed: {status:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
