//! Regression tests for two data-loss bugs of `pack --force`: with `--out` naming a non-empty directory
//! that was not a dataset, the user's files in it were deleted (exit 0); with `--out` naming a regular
//! file, the file was moved to a hidden `.old-*` name, the dataset installed, and the pack exited 1.
//! `--force` now replaces only a gpufeed dataset (a directory holding a valid manifest.json and only
//! the shards it names); anything else (a dataset directory holding other files, an invalid manifest,
//! a symbolic link) is refused with a clear error naming the path and left exactly as it was, with
//! nothing written beside it. The HTTP pack jobs call the same `pack::pack`, whose check is exercised
//! here through the library with both policies.

mod common;

use std::fs;
use std::path::Path;

use common::{assert_fails, assert_line_with, assert_succeeds, gpufeed, write_npy};
use gpufeed::pack::{self, OnExisting, PackError, Quiet};
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
