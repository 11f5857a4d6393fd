//! Regression tests (issue 16, item 1): `pack --force --out DIR` deleted any non-empty directory that
//! was not a dataset (a user's file vanished, exit 0), and with `--out` naming a regular file it moved
//! the file to a hidden `.old-*` name, installed the dataset and exited 1. `--force` now replaces only
//! a gpufeed dataset (a directory holding a valid manifest.json and only the shards it names); anything
//! else is left untouched and the error names the path. The HTTP pack jobs call the same
//! `pack::pack`, whose check is exercised here through the library with both policies.

mod common;

use std::ffi::OsString;
use std::fs;
use std::path::Path;

use common::{assert_fails, assert_line_with, assert_succeeds, gpufeed, write_npy};
use gpufeed::pack::{self, OnExisting, PackError, Quiet};
use gpufeed_client::DType;

/// Runs `gpufeed pack --quiet --block-bytes 4K --force --out OUT INPUT`.
fn pack_force(out: &Path, input: &Path) -> std::process::Output {
    let args: Vec<OsString> = vec![
        "pack".into(),
        "--quiet".into(),
        "--block-bytes".into(),
        "4K".into(),
        "--force".into(),
        "--out".into(),
        out.into(),
        input.into(),
    ];
    gpufeed(args)
}

/// A small `.npy` input in `dir`.
fn input(dir: &Path) -> std::path::PathBuf {
    let bytes = common::i32_bytes(64, |i| i as i32);
    write_npy(&dir.join("input.npy"), DType::I32, &[64], &bytes)
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

#[test]
fn force_leaves_a_directory_that_is_not_a_dataset_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input(tmp.path());
    let out = tmp.path().join("mine");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("thesis.tex"), b"years of work").unwrap();

    let err = assert_fails(&pack_force(&out, &input));
    assert_line_with(
        &err,
        &[
            &out.display().to_string(),
            "without manifest.json",
            "left untouched",
        ],
    );
    assert_eq!(fs::read(out.join("thesis.tex")).unwrap(), b"years of work");
    assert_eq!(names(&out), ["thesis.tex"]);
    assert_eq!(names(tmp.path()), ["input.npy", "mine"]);
}

#[test]
fn force_leaves_a_regular_file_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input(tmp.path());
    let out = tmp.path().join("notes.txt");
    fs::write(&out, b"do not lose me").unwrap();

    let err = assert_fails(&pack_force(&out, &input));
    assert_line_with(&err, &[&out.display().to_string(), "a regular file"]);
    assert_eq!(fs::read(&out).unwrap(), b"do not lose me");
    // No hidden `.old-*` or staging entry, and no dataset installed in the file's place.
    assert_eq!(names(tmp.path()), ["input.npy", "notes.txt"]);
}

#[test]
fn force_leaves_a_dataset_holding_other_files_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input(tmp.path());
    let out = tmp.path().join("ds");
    assert_succeeds(&pack_force(&out, &input));
    fs::write(out.join("README"), b"notes about this dataset").unwrap();
    let before = names(&out);

    let err = assert_fails(&pack_force(&out, &input));
    assert_line_with(&err, &[&out.display().to_string(), "\"README\""]);
    assert_eq!(names(&out), before);
    assert_eq!(
        fs::read(out.join("README")).unwrap(),
        b"notes about this dataset"
    );
}

#[test]
fn force_leaves_a_directory_with_an_invalid_manifest_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input(tmp.path());
    let out = tmp.path().join("other-tool");
    fs::create_dir(&out).unwrap();
    fs::write(out.join("manifest.json"), b"{\"something\": \"else\"}").unwrap();

    let err = assert_fails(&pack_force(&out, &input));
    assert_line_with(
        &err,
        &[&out.display().to_string(), "not a valid gpufeed manifest"],
    );
    assert_eq!(
        fs::read(out.join("manifest.json")).unwrap(),
        b"{\"something\": \"else\"}"
    );
}

#[test]
fn force_replaces_a_dataset_and_an_empty_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input(tmp.path());
    let out = tmp.path().join("ds");
    fs::create_dir(&out).unwrap();
    assert_succeeds(&pack_force(&out, &input));
    assert_succeeds(&pack_force(&out, &input));
    assert!(names(&out).contains(&"manifest.json".to_string()));
    assert_eq!(names(tmp.path()), ["ds", "input.npy"]);
}

#[test]
fn force_does_not_follow_a_symbolic_link() {
    let tmp = tempfile::tempdir().unwrap();
    let input = input(tmp.path());
    let target = tmp.path().join("real");
    assert_succeeds(&pack_force(&target, &input));
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();

    let err = assert_fails(&pack_force(&link, &input));
    assert_line_with(&err, &[&link.display().to_string(), "a symbolic link"]);
    assert!(fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
}

/// The HTTP pack jobs run `pack::pack` with [`OnExisting::Refuse`]: a file at the destination is
/// refused and kept, under either policy.
#[test]
fn library_pack_refuses_a_file_under_both_policies() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("target");
    fs::write(&out, b"keep").unwrap();
    for on_existing in [OnExisting::Refuse, OnExisting::Replace] {
        let mut options = common::options("target", 4096, None);
        options.on_existing = on_existing;
        let fields = [common::field(
            "x",
            DType::U8,
            &[4],
            (0..64u8).collect::<Vec<u8>>(),
        )];
        let error = pack::pack(&out, &fields, &options, &Quiet).unwrap_err();
        assert!(
            matches!(&error, PackError::NotADataset { path, .. } if path == &out),
            "{error:?}"
        );
        assert_eq!(fs::read(&out).unwrap(), b"keep");
        assert_eq!(names(tmp.path()), ["target"]);
    }
}
