//! Regression test: a cancel that arrived during the last step of a pack (a rate-limited pack spends
//! its last moments waiting) was not seen before the commit, so the job answered "already succeeded"
//! and installed the dataset. The pack now checks for a cancel right before the commit.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use gpufeed::pack::{self, PackError, PackObserver};
use gpufeed_client::DType;

/// Asks to cancel only once every byte has been written: the moment between the last block and the
/// commit.
struct CancelWhenDone {
    total: AtomicU64,
    done: AtomicU64,
}

impl PackObserver for CancelWhenDone {
    fn started(&self, raw_bytes_total: u64) {
        self.total.store(raw_bytes_total, Ordering::SeqCst);
    }
    fn progress(&self, raw_bytes_done: u64) {
        self.done.store(raw_bytes_done, Ordering::SeqCst);
    }
    fn cancelled(&self) -> bool {
        let total = self.total.load(Ordering::SeqCst);
        total > 0 && self.done.load(Ordering::SeqCst) >= total
    }
}

#[test]
fn a_cancel_after_the_last_block_is_not_committed() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("set");
    let observer = CancelWhenDone {
        total: AtomicU64::new(0),
        done: AtomicU64::new(0),
    };
    let result = pack::pack(
        &out,
        &[common::field(
            "ids",
            DType::I32,
            &[1],
            common::i32_bytes(1000, |i| i as i32),
        )],
        &common::options("set", 4096, Some(500)),
        &observer,
    );
    assert!(matches!(result, Err(PackError::Cancelled)), "{result:?}");
    assert!(!out.exists(), "a cancelled pack installed its dataset");
    let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
    assert!(left.is_empty(), "the staging directory is left: {left:?}");
}
