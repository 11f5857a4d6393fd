//! Regression tests for two data-loss bugs of `pack --force`: with `--out` naming a non-empty directory
//! that was not a dataset, the user's files in it were deleted (exit 0); with `--out` naming a regular
//! file, the file was moved to a hidden `.old-*` name, the dataset installed, and the pack exited 1.
//! `--force` now replaces only a gpufeed dataset; anything else is refused with a clear error and left
//! exactly as it was, with nothing written beside it.

mod common;

use std::fs;
use std::path::Path;

use common::{assert_fails, assert_succeeds, gpufeed, write_npy};
use gpufeed_client::DType;

fn pack_force(out: &Path, input: &Path) -> std::process::Output {
    let args: Vec<std::ffi::OsString> = vec![
        "pack".into(),
        "--quiet".into(),
        "--force".into(),
        "--out".into(),
        out.into(),
        input.into(),
    ];
    gpufeed(args)
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn input(dir: &Path) -> std::path::PathBuf {
    write_npy(
        &dir.join("in.npy"),
        DType::I32,
        &[10],
        &common::i32_bytes(10, |i| i as i32),
    )
}

#[test]
fn force_refuses_a_directory_that_is_not_a_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let npy = input(tmp.path());
    let out = tmp.path().join("photos");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("holiday.jpg"), b"precious").unwrap();
    let err = assert_fails(&pack_force(&out, &npy));
    assert!(err.contains("not a gpufeed dataset"), "{err}");
    assert_eq!(names(&out), vec!["holiday.jpg"]);
    assert_eq!(fs::read(out.join("holiday.jpg")).unwrap(), b"precious");
    assert_eq!(names(tmp.path()), vec!["in.npy", "photos"]);
}

#[test]
fn force_refuses_a_regular_file_and_moves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let npy = input(tmp.path());
    let out = tmp.path().join("notes.txt");
    fs::write(&out, b"my notes").unwrap();
    let err = assert_fails(&pack_force(&out, &npy));
    assert!(err.contains("is not a directory"), "{err}");
    assert_eq!(fs::read(&out).unwrap(), b"my notes");
    // No hidden `.old-*` or staging directory beside it, no dataset anywhere.
    assert_eq!(names(tmp.path()), vec!["in.npy", "notes.txt"]);
}

#[test]
fn force_still_replaces_a_dataset_and_fills_an_empty_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let npy = input(tmp.path());
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    assert_succeeds(&pack_force(&empty, &npy));
    assert!(empty.join("manifest.json").exists());
    assert_succeeds(&pack_force(&empty, &npy));
    assert!(empty.join("manifest.json").exists());
}
