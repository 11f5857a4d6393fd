//! Regression tests (issue 16, item 3): `unpack` of a corrupt dataset left a truncated `.npy` whose
//! header claimed the full shape, and it overwrote an existing `--out` before failing. The array is
//! now written to a hidden file beside `--out` and renamed into place only on success; an existing
//! `--out` is replaced only with `--force`, and only if it is a regular file.

mod common;

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::{assert_fails, assert_line_with, assert_succeeds, gpufeed, read_npy};
use gpufeed::format::Dataset;
use gpufeed::tools::{self, NoProgress, UnpackError};
use gpufeed_client::DType;

const SAMPLES: u64 = 4096;

/// Packs an incompressible i32 field `x` of [`SAMPLES`] samples (several raw blocks) into `dir`;
/// returns its bytes.
fn build(dir: &Path) -> Vec<u8> {
    let bytes = common::noise(SAMPLES as usize * 4, 7);
    let mut options = common::options("set", 4096, None);
    options.codec = gpufeed::pack::CodecChoice::Raw;
    common::pack_fields(
        dir,
        &[common::field("x", DType::I32, &[1], bytes.clone())],
        &options,
    );
    bytes
}

/// Flips a byte in the payload of the last block, so that decoding fails only at the end.
fn corrupt_last_block(dir: &Path) {
    let dataset = Dataset::open(dir).unwrap();
    let shard = dataset.shards.last().unwrap();
    let block = shard.metadata.blocks.last().unwrap();
    let file = OpenOptions::new()
        .write(true)
        .read(true)
        .open(&shard.path)
        .unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, block.stored_offset).unwrap();
    file.write_all_at(&[byte[0] ^ 0x40], block.stored_offset)
        .unwrap();
}

/// Runs `gpufeed unpack DIR --field x --out OUT --quiet` with `extra` arguments.
fn unpack(dir: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut args: Vec<OsString> = vec![
        "unpack".into(),
        dir.into(),
        "--field".into(),
        "x".into(),
        "--out".into(),
        out.into(),
        "--quiet".into(),
    ];
    args.extend(extra.iter().map(OsString::from));
    gpufeed(args)
}

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A dataset and an empty output directory.
fn setup() -> (tempfile::TempDir, PathBuf, PathBuf, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    let dataset = tmp.path().join("set");
    let bytes = build(&dataset);
    let outputs = tmp.path().join("outputs");
    fs::create_dir(&outputs).unwrap();
    (tmp, dataset, outputs, bytes)
}

#[test]
fn corrupt_dataset_leaves_no_output_file() {
    let (_tmp, dataset, outputs, _) = setup();
    corrupt_last_block(&dataset);
    let out = outputs.join("x.npy");
    let err = assert_fails(&unpack(&dataset, &out, &[]));
    assert_line_with(&err, &["checksum mismatch"]);
    assert_eq!(names(&outputs), Vec::<String>::new());
}

#[test]
fn corrupt_dataset_keeps_an_existing_output_even_with_force() {
    let (_tmp, dataset, outputs, _) = setup();
    corrupt_last_block(&dataset);
    let out = outputs.join("x.npy");
    fs::write(&out, b"yesterday's results").unwrap();
    assert_fails(&unpack(&dataset, &out, &["--force"]));
    assert_eq!(fs::read(&out).unwrap(), b"yesterday's results");
    assert_eq!(names(&outputs), ["x.npy"]);
}

/// The library's `tools::unpack` replaces an existing file, but only once the new array is whole.
#[test]
fn library_unpack_of_a_corrupt_dataset_keeps_an_existing_output() {
    let (_tmp, dataset, outputs, _) = setup();
    corrupt_last_block(&dataset);
    let out = outputs.join("x.npy");
    fs::write(&out, b"yesterday's results").unwrap();
    let opened = Dataset::open(&dataset).unwrap();
    let error = tools::unpack(&opened, "x", &out, None, &NoProgress).unwrap_err();
    assert!(matches!(error, UnpackError::Block(_)), "{error:?}");
    assert_eq!(fs::read(&out).unwrap(), b"yesterday's results");
    assert_eq!(names(&outputs), ["x.npy"]);
}

#[test]
fn existing_output_is_replaced_only_with_force() {
    let (_tmp, dataset, outputs, bytes) = setup();
    let out = outputs.join("x.npy");
    fs::write(&out, b"keep me").unwrap();

    let err = assert_fails(&unpack(&dataset, &out, &[]));
    assert_line_with(
        &err,
        &[&out.display().to_string(), "already exists", "--force"],
    );
    assert_eq!(fs::read(&out).unwrap(), b"keep me");
    assert_eq!(names(&outputs), ["x.npy"]);

    assert_succeeds(&unpack(&dataset, &out, &["--force"]));
    let back = read_npy(&out);
    assert_eq!(back.shape, vec![SAMPLES, 1]);
    assert!(back.bytes == bytes);
    assert_eq!(names(&outputs), ["x.npy"]);
}

#[test]
fn force_does_not_replace_a_directory() {
    let (_tmp, dataset, outputs, _) = setup();
    let out = outputs.join("x.npy");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("inside"), b"data").unwrap();
    let err = assert_fails(&unpack(&dataset, &out, &["--force"]));
    assert_line_with(&err, &[&out.display().to_string(), "a directory"]);
    assert_eq!(fs::read(out.join("inside")).unwrap(), b"data");
    assert_eq!(names(&outputs), ["x.npy"]);
}

#[test]
fn fresh_output_is_written_without_leftovers() {
    let (_tmp, dataset, outputs, bytes) = setup();
    let out = outputs.join("x.npy");
    assert_succeeds(&unpack(&dataset, &out, &[]));
    assert!(read_npy(&out).bytes == bytes);
    assert_eq!(names(&outputs), ["x.npy"]);
}
