//! Regression tests (issue 16, item 13): `pack --field x=model.safetensors` without `:TENSOR` said
//! "not a NumPy .npy file", which hid both what was missing and which tensors the file holds, and no
//! command listed the tensors of an input. The error now says a tensor must be named and lists the
//! file's tensors (also for a safetensors file whose name does not say so), and `gpufeed list-inputs
//! FILE...` prints the name, dtype and shape of every array of `.npy` and safetensors files.

mod common;

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use common::{assert_fails, assert_line_with, assert_succeeds, gpufeed, write_npy};
use gpufeed::tools::{self, InputFormat};
use gpufeed_client::DType;
use safetensors::tensor::{Dtype, TensorView};

/// Writes a safetensors file with tensors `weight` (f16 [4, 3]), `bias` (f32 [3]) and `mask`
/// (bool [2]) to `path`.
fn model(path: &Path) -> PathBuf {
    let weight = vec![1u8; 4 * 3 * 2];
    let bias = vec![2u8; 3 * 4];
    let mask = vec![1u8; 2];
    let views = vec![
        (
            "weight",
            TensorView::new(Dtype::F16, vec![4, 3], &weight).unwrap(),
        ),
        ("bias", TensorView::new(Dtype::F32, vec![3], &bias).unwrap()),
        (
            "mask",
            TensorView::new(Dtype::BOOL, vec![2], &mask).unwrap(),
        ),
    ];
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    path.to_path_buf()
}

/// Runs `gpufeed pack --quiet --out DIR --field FIELD`.
fn pack_field(out: &Path, field: &str) -> std::process::Output {
    let args: Vec<OsString> = vec![
        "pack".into(),
        "--quiet".into(),
        "--out".into(),
        out.into(),
        "--field".into(),
        field.into(),
    ];
    gpufeed(args)
}

#[test]
fn safetensors_field_without_tensor_names_what_is_missing_and_the_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let file = model(&tmp.path().join("model.safetensors"));
    let field = format!("x={}", file.display());
    let err = assert_fails(&pack_field(&tmp.path().join("ds"), &field));
    assert!(!err.contains("not a NumPy"), "{err}");
    assert_line_with(
        &err,
        &[
            &format!("--field x={}:TENSOR", file.display()),
            "weight f16 [4, 3]",
            "bias f32 [3]",
            "mask BOOL [2] (gpufeed cannot pack this dtype)",
        ],
    );
    assert!(!tmp.path().join("ds").exists());
}

#[test]
fn safetensors_file_under_another_name_is_recognised() {
    let tmp = tempfile::tempdir().unwrap();
    let file = model(&tmp.path().join("weights.bin"));
    let field = format!("x={}", file.display());
    let err = assert_fails(&pack_field(&tmp.path().join("ds"), &field));
    assert_line_with(
        &err,
        &["a safetensors file", ":TENSOR", "weight f16 [4, 3]"],
    );
}

#[test]
fn list_inputs_prints_every_array() {
    let tmp = tempfile::tempdir().unwrap();
    let file = model(&tmp.path().join("model.safetensors"));
    let npy = write_npy(&tmp.path().join("ids.npy"), DType::I32, &[5, 2], &[0u8; 40]);
    let args: Vec<OsString> = vec![
        "list-inputs".into(),
        file.clone().into(),
        npy.clone().into(),
    ];
    let out = assert_succeeds(&gpufeed(args));
    assert_line_with(
        &out,
        &[&file.display().to_string(), "safetensors", "3 tensor(s)"],
    );
    let words = |needle: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(needle))
            .unwrap_or_else(|| panic!("no line for {needle}:\n{out}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(words("weight"), ["weight", "f16", "[4,", "3]"]);
    assert_eq!(words("bias"), ["bias", "f32", "[3]"]);
    assert_eq!(
        words("mask"),
        ["mask", "BOOL", "[2]", "(gpufeed", "cannot", "pack", "this", "dtype)"]
    );
    assert_line_with(&out, &[&npy.display().to_string(), "NumPy .npy array"]);
    assert_eq!(words("i32"), ["i32", "[5,", "2]"]);
}

#[test]
fn list_inputs_fails_on_a_file_of_neither_format_after_listing_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("notes.txt");
    fs::write(&text, b"hello, world").unwrap();
    let npy = write_npy(&tmp.path().join("a.npy"), DType::U8, &[3], &[1, 2, 3]);
    let args: Vec<OsString> = vec!["list-inputs".into(), text.clone().into(), npy.into()];
    let output = gpufeed(args);
    let err = assert_fails(&output);
    assert_line_with(&err, &[&text.display().to_string(), "neither a NumPy .npy"]);
    assert_line_with(&common::stdout(&output), &["u8", "[3]"]);
}

#[test]
fn list_input_reads_headers_only_and_refuses_non_files() {
    let tmp = tempfile::tempdir().unwrap();
    let listing = tools::list_input(&model(&tmp.path().join("m"))).unwrap();
    assert_eq!(listing.format, InputFormat::Safetensors);
    let names: Vec<_> = listing
        .arrays
        .iter()
        .map(|a| a.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["bias", "mask", "weight"]);
    let error = tools::list_input(tmp.path()).unwrap_err();
    assert!(error.to_string().contains("not a regular file"), "{error}");
}

/// Writes a safetensors file with the JSON header `header` (as written, duplicates and all) and
/// `data_bytes` data bytes.
fn raw_safetensors(path: &Path, header: &str, data_bytes: usize) -> PathBuf {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(7u8, data_bytes));
    fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// Regression test (issue 42, item 8): a safetensors header naming a tensor twice packed silently
/// (the `safetensors` crate keeps the last entry), and `list-inputs` listed tensors that `pack` then
/// refused (overlapping, reversed or out-of-range offsets, shapes whose size overflows) without
/// saying so. Both now refuse such a file with the same reason, naming the tensor (or the key).
#[test]
fn list_inputs_and_pack_refuse_a_header_pack_cannot_use_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, usize, &[&str]); 6] = [
        (
            "duplicate",
            r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"x":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]}}"#,
            4,
            &["\"x\" twice"],
        ),
        (
            "overlap",
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
            6,
            &["tensor \"b\"", "overlap tensor \"a\""],
        ),
        (
            "reversed",
            r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
            4,
            &["tensor \"a\"", "reversed"],
        ),
        (
            "beyond",
            r#"{"a":{"dtype":"U8","shape":[64],"data_offsets":[0,64]}}"#,
            8,
            &["truncated", "the header implies"],
        ),
        (
            "overflow",
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#,
            8,
            &["tensor \"a\"", "overflows"],
        ),
        (
            "gap",
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#,
            6,
            &["tensor \"b\"", "back to back"],
        ),
    ];
    for (name, header, data_bytes, needles) in cases {
        let file = raw_safetensors(
            &tmp.path().join(format!("{name}.safetensors")),
            header,
            data_bytes,
        );
        let listed = assert_fails(&gpufeed([
            std::ffi::OsStr::new("list-inputs"),
            file.as_os_str(),
        ]));
        let mut expected = vec![file.to_str().unwrap()];
        expected.extend_from_slice(needles);
        assert_line_with(&listed, &expected);
        let tensor = if name == "duplicate" { "x" } else { "a" };
        let field = format!("f={}:{tensor}", file.display());
        let packed = assert_fails(&pack_field(&tmp.path().join(name), &field));
        assert_line_with(&packed, &expected);
    }
}

/// Regression test (issue 42, item 8): `list-inputs` listed a 0-d tensor and one with a 0 in its
/// per-sample shape like any other, and `pack` then refused them. It now says why beside each.
#[test]
fn list_inputs_says_why_a_tensor_cannot_be_a_field() {
    let tmp = tempfile::tempdir().unwrap();
    let file = raw_safetensors(
        &tmp.path().join("m.safetensors"),
        r#"{"empty":{"dtype":"U8","shape":[3,0],"data_offsets":[0,0]},"ok":{"dtype":"U8","shape":[2,2],"data_offsets":[0,4]},"scalar":{"dtype":"U8","shape":[],"data_offsets":[4,5]}}"#,
        5,
    );
    let out = assert_succeeds(&gpufeed([
        std::ffi::OsStr::new("list-inputs"),
        file.as_os_str(),
    ]));
    assert_line_with(&out, &["scalar", "cannot pack this", "0-d"]);
    assert_line_with(&out, &["empty", "cannot pack this", "contains 0"]);
    let ok = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some("ok"))
        .unwrap();
    assert!(!ok.contains("cannot"), "{out}");
    for (tensor, why) in [("scalar", "0-d"), ("empty", "contains 0")] {
        let field = format!("f={}:{tensor}", file.display());
        let packed = assert_fails(&pack_field(&tmp.path().join(tensor), &field));
        assert!(
            packed.contains(why) || packed.contains("axis 0"),
            "{packed}"
        );
    }
}
