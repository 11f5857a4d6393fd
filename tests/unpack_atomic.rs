//! Regression tests for a data-loss bug of `unpack`: a corrupt dataset left a truncated `.npy` with a
//! full-shape header at `--out`, and an existing `--out` was overwritten before the failure. The file
//! is now written aside and renamed over `--out` only when complete, and an existing `--out` is
//! replaced only with `--force`.

mod common;

use std::fs;
use std::path::Path;

use common::{assert_fails, assert_succeeds, gpufeed};
use gpufeed::format::Dataset;
use gpufeed_client::DType;

fn unpack(dataset: &Path, out: &Path, force: bool) -> std::process::Output {
    let mut args: Vec<std::ffi::OsString> = vec![
        "unpack".into(),
        dataset.into(),
        "--field".into(),
        "ids".into(),
        "--out".into(),
        out.into(),
        "--quiet".into(),
    ];
    if force {
        args.push("--force".into());
    }
    gpufeed(args)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Packs 4000 raw int32 samples in small blocks and corrupts one block of the last shard if asked.
fn dataset(root: &Path, corrupt: bool) -> std::path::PathBuf {
    let dir = root.join("set");
    let bytes = common::i32_bytes(4000, |i| i as i32 * 7);
    common::pack_fields(
        &dir,
        &[common::field("ids", DType::I32, &[1], bytes)],
        &common::options("set", 4096, Some(1000)),
    );
    if corrupt {
        let opened = Dataset::open(&dir).unwrap();
        let shard = opened.shards.last().unwrap();
        let block = shard.metadata.field_blocks(0)[0];
        let mut data = fs::read(&shard.path).unwrap();
        data[(block.stored_offset + 8) as usize] ^= 0x40;
        fs::write(&shard.path, data).unwrap();
    }
    dir
}

#[test]
fn a_corrupt_dataset_leaves_no_file_and_keeps_an_existing_one() {
    let root = tempfile::tempdir().unwrap();
    let set = dataset(root.path(), true);
    let outs = root.path().join("outs");
    fs::create_dir(&outs).unwrap();
    let out = outs.join("ids.npy");
    assert_fails(&unpack(&set, &out, false));
    assert_eq!(entries(&outs), Vec::<String>::new(), "nothing left behind");
    fs::write(&out, b"an older export").unwrap();
    assert_fails(&unpack(&set, &out, true));
    assert_eq!(fs::read(&out).unwrap(), b"an older export");
    assert_eq!(entries(&outs), vec!["ids.npy"]);
}

#[test]
fn an_existing_out_needs_force() {
    let root = tempfile::tempdir().unwrap();
    let set = dataset(root.path(), false);
    let out = root.path().join("ids.npy");
    fs::write(&out, b"keep me").unwrap();
    let err = assert_fails(&unpack(&set, &out, false));
    assert!(err.contains("already exists (pass --force"), "{err}");
    assert_eq!(fs::read(&out).unwrap(), b"keep me");
    assert_succeeds(&unpack(&set, &out, true));
    let written = common::read_npy(&out);
    assert_eq!(written.shape, vec![4000, 1]);
}
