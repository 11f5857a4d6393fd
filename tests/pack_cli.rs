//! The `gpufeed pack` command line and its input handling, driven through the built binary on real
//! files: positional `.npy` files concatenated into field `data`, named `--field` inputs from `.npy` and
//! safetensors files, and every rejected input (mismatched sample counts, Fortran order, truncation,
//! big-endian and unsupported dtypes, a missing tensor, a bad block size), each named in the error. It
//! also covers the directory-level atomicity of a pack (an existing dataset is kept without `--force`
//! and replaced with it; a failed or cancelled pack leaves no manifest and no staging directory), the
//! JSON printed by `inspect`, `gpufeed demo` on the CPU backend, and the `--help` texts.

mod common;

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{
    assert_fails, assert_line_with, assert_succeeds, gpufeed, read_npy, stdout, write_npy,
};
use gpufeed::pack::{self, OnExisting, PackError, PackObserver};
use gpufeed_client::DType;
use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

/// Builds a CLI argument list from anything path- or string-like.
macro_rules! args {
    ($($arg:expr),* $(,)?) => {
        vec![$(OsString::from($arg)),*]
    };
}

/// Runs `gpufeed pack --quiet --block-bytes 4K` with `args`.
fn pack_cli(args: Vec<OsString>) -> std::process::Output {
    let mut all = args!["pack", "--quiet", "--block-bytes", "4K"];
    all.extend(args);
    gpufeed(all)
}

/// Unpacks `field` of `dataset` with the CLI into `out` and reads it back.
fn unpack_cli(dataset: &Path, field: &str, out: &Path, dtype: Option<&str>) -> common::NpyData {
    let mut args = args!["unpack", dataset, "--field", field, "--out", out, "--quiet"];
    if let Some(dtype) = dtype {
        args.extend(args!["--dtype", dtype]);
    }
    assert_succeeds(&gpufeed(args));
    read_npy(out)
}

/// Hand-built `.npy` version 1.0 bytes: magic, header dict padded to 64 bytes, then `data`.
fn npy_bytes(dict: &str, data: &[u8]) -> Vec<u8> {
    let unpadded = 10 + dict.len() + 1;
    let header_len = dict.len() + 1 + (64 - unpadded % 64) % 64;
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header_len as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(10 + header_len - 1, b' ');
    out.push(b'\n');
    out.extend_from_slice(data);
    out
}

/// Entries of `dir` whose names start with `.` (the packer's staging and retired directories).
fn hidden_entries(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with('.'))
        .collect()
}

/// Asserts nothing of a pack to `out` exists: no directory, no manifest, no staging directory.
fn assert_nothing_written(out: &Path) {
    assert!(
        !out.exists(),
        "{} exists after a failed pack",
        out.display()
    );
    let parent = out.parent().unwrap();
    assert_eq!(hidden_entries(parent), Vec::<String>::new());
}

#[test]
fn positional_npy_files_concatenate_into_field_data() {
    let tmp = tempfile::tempdir().unwrap();
    let a_bytes = common::i32_bytes(5 * 3, |i| i as i32 - 7);
    let b_bytes = common::i32_bytes(700 * 3, |i| (i as i32 * 31) % 1000);
    let a = write_npy(&tmp.path().join("a.npy"), DType::I32, &[5, 3], &a_bytes);
    let b = write_npy(&tmp.path().join("b.npy"), DType::I32, &[700, 3], &b_bytes);
    let out = tmp.path().join("concat");
    assert_succeeds(&pack_cli(args![
        "--out",
        &out,
        &a,
        &b,
        "--samples-per-shard",
        "300"
    ]));

    let back = unpack_cli(&out, "data", &tmp.path().join("data.npy"), None);
    assert_eq!(back.dtype, DType::I32);
    assert_eq!(back.shape, vec![705, 3]);
    assert!(back.bytes == [a_bytes, b_bytes].concat());
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
}

#[test]
fn named_fields_pack_side_by_side_and_repeat_names_concatenate() {
    let tmp = tempfile::tempdir().unwrap();
    let x_bytes = common::noise(40 * 2 * 4 * 4, 3);
    let y1_bytes = common::noise(25 * 8, 4);
    let y2_bytes = common::noise(15 * 8, 5);
    let x = write_npy(&tmp.path().join("x.npy"), DType::F32, &[40, 2, 4], &x_bytes);
    let y1 = write_npy(&tmp.path().join("y1.npy"), DType::U64, &[25], &y1_bytes);
    let y2 = write_npy(&tmp.path().join("y2.npy"), DType::U64, &[15], &y2_bytes);
    let out = tmp.path().join("named");
    let mut a = OsString::from("a=");
    a.push(&x);
    let (mut b1, mut b2) = (OsString::from("b="), OsString::from("b="));
    b1.push(&y1);
    b2.push(&y2);
    assert_succeeds(&pack_cli(args![
        "--out", &out, "--field", a, "--field", b1, "--field", b2
    ]));

    let a_back = unpack_cli(&out, "a", &tmp.path().join("a.npy"), None);
    assert_eq!((a_back.dtype, a_back.shape), (DType::F32, vec![40, 2, 4]));
    assert!(a_back.bytes == x_bytes);
    let b_back = unpack_cli(&out, "b", &tmp.path().join("b.npy"), None);
    assert_eq!((b_back.dtype, b_back.shape), (DType::U64, vec![40]));
    assert!(b_back.bytes == [y1_bytes, y2_bytes].concat());
}

#[test]
fn mismatched_sample_counts_name_the_field_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let x = write_npy(&tmp.path().join("x.npy"), DType::U8, &[5], &[1; 5]);
    let y = write_npy(&tmp.path().join("y.npy"), DType::U8, &[7, 2], &[2; 14]);
    let out = tmp.path().join("mismatch");
    let mut a = OsString::from("a=");
    a.push(&x);
    let mut b = OsString::from("b=");
    b.push(&y);
    let err = assert_fails(&pack_cli(args!["--out", &out, "--field", a, "--field", b]));
    assert_line_with(
        &err,
        &[&format!(
            "field 'b' ({}) has 7 samples but field 'a' has 5",
            y.display()
        )],
    );
    assert_nothing_written(&out);
}

#[test]
fn rejected_npy_inputs_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let inputs = tmp.path().join("inputs");
    fs::create_dir(&inputs).unwrap();
    let cases = [
        (
            "fortran.npy",
            npy_bytes(
                "{'descr': '<f4', 'fortran_order': True, 'shape': (4, 3), }",
                &[0; 48],
            ),
            "Fortran-order (column-major) arrays are not supported",
        ),
        (
            "truncated.npy",
            npy_bytes(
                "{'descr': '<i4', 'fortran_order': False, 'shape': (10, 2), }",
                &[0; 50],
            ),
            "truncated: the header implies",
        ),
        (
            "big-endian.npy",
            npy_bytes(
                "{'descr': '>f4', 'fortran_order': False, 'shape': (4,), }",
                &[0; 16],
            ),
            "big-endian dtype \">f4\" is not supported",
        ),
        (
            "bool.npy",
            npy_bytes(
                "{'descr': '|b1', 'fortran_order': False, 'shape': (8,), }",
                &[1; 8],
            ),
            "unsupported dtype \"|b1\"",
        ),
        (
            "garbage.npy",
            b"PK\x03\x04 not numpy".to_vec(),
            "not a NumPy .npy file",
        ),
    ];
    let good = write_npy(&inputs.join("good.npy"), DType::F32, &[4, 3], &[0; 48]);
    for (name, bytes, reason) in cases {
        let path = inputs.join(name);
        fs::write(&path, bytes).unwrap();
        let out = tmp.path().join(format!("out-{name}"));
        // As a positional input, and as the second file of a named field.
        let mut field = OsString::from("f=");
        field.push(&good);
        let mut second = OsString::from("f=");
        second.push(&path);
        for args in [
            args!["--out", &out, &path],
            args!["--out", &out, "--field", field, "--field", second],
        ] {
            let err = assert_fails(&pack_cli(args));
            assert_line_with(&err, &[&format!("{}: ", path.display()), reason]);
            assert_nothing_written(&out);
        }
    }
    let out = tmp.path().join("out-missing");
    let missing = inputs.join("missing.npy");
    let err = assert_fails(&pack_cli(args!["--out", &out, &missing]));
    assert_line_with(&err, &[&format!("{}: ", missing.display()), "No such file"]);
    assert_nothing_written(&out);
}

#[test]
fn block_bytes_that_are_not_a_power_of_two_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let x = write_npy(&tmp.path().join("x.npy"), DType::U8, &[5], &[1; 5]);
    let out = tmp.path().join("blocks");
    for (value, reason) in [
        ("3000", "block size 3000 is not a power of two"),
        ("2K", "block size 2048 is not a power of two in 4096..="),
        (
            "32M",
            "block size 33554432 is not a power of two in 4096..=16777216",
        ),
    ] {
        let err = assert_fails(&gpufeed(args![
            "pack",
            "--quiet",
            "--out",
            &out,
            "--block-bytes",
            value,
            &x
        ]));
        assert_line_with(&err, &[reason]);
        assert_nothing_written(&out);
    }
    let err = assert_fails(&gpufeed(args![
        "pack",
        "--out",
        &out,
        "--block-bytes",
        "lots",
        &x
    ]));
    assert_line_with(&err, &["--block-bytes", "\"lots\" is not a byte count"]);
}

#[test]
fn existing_dataset_is_kept_without_force_and_replaced_with_it() {
    let tmp = tempfile::tempdir().unwrap();
    let old_bytes = common::i32_bytes(50, |i| i as i32);
    let new_bytes = common::i32_bytes(80, |i| -(i as i32));
    let old = write_npy(&tmp.path().join("old.npy"), DType::I32, &[50], &old_bytes);
    let new = write_npy(&tmp.path().join("new.npy"), DType::I32, &[80], &new_bytes);
    let out = tmp.path().join("ds");
    assert_succeeds(&pack_cli(args!["--out", &out, &old]));
    let manifest = fs::read(out.join("manifest.json")).unwrap();

    let err = assert_fails(&pack_cli(args!["--out", &out, &new]));
    assert_line_with(
        &err,
        &[&format!(
            "{}: already exists (pass --force to replace it)",
            out.display()
        )],
    );
    assert_eq!(fs::read(out.join("manifest.json")).unwrap(), manifest);
    let back = unpack_cli(&out, "data", &tmp.path().join("kept.npy"), None);
    assert!(back.bytes == old_bytes);
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());

    assert_succeeds(&pack_cli(args!["--out", &out, &new, "--force"]));
    let back = unpack_cli(&out, "data", &tmp.path().join("replaced.npy"), None);
    assert_eq!(back.shape, vec![80]);
    assert!(back.bytes == new_bytes);
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
    let names: Vec<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "one shard and the manifest: {names:?}");
}

#[test]
fn failed_pack_leaves_no_manifest_and_no_staging_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let good = write_npy(
        &tmp.path().join("good.npy"),
        DType::U16,
        &[30, 2],
        &[7; 120],
    );
    let mut bad_bytes = fs::read(&good).unwrap();
    bad_bytes.truncate(bad_bytes.len() - 10);
    let bad = tmp.path().join("bad.npy");
    fs::write(&bad, bad_bytes).unwrap();

    // The second field's file is truncated.
    let out = tmp.path().join("failed");
    let mut a = OsString::from("a=");
    a.push(&good);
    let mut b = OsString::from("b=");
    b.push(&bad);
    let err = assert_fails(&pack_cli(args!["--out", &out, "--field", a, "--field", b]));
    assert_line_with(&err, &[&format!("{}: truncated", bad.display())]);
    assert_nothing_written(&out);

    // The destination's parent does not exist: the staging directory cannot be created there.
    let out = tmp.path().join("no-such-parent").join("ds");
    let err = assert_fails(&pack_cli(args!["--out", &out, &good]));
    assert_line_with(
        &err,
        &[&tmp.path().join("no-such-parent").display().to_string()],
    );
    assert!(!out.exists());
    assert!(!out.parent().unwrap().exists());
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
}

/// Regression: `gpufeed pack --out DIR/name` with no `DIR` failed with the staging path it could not
/// create (`DIR/.name.partial-22260-…: No such file or directory`), which names neither the missing
/// directory nor what to do. A pack does not create the directory (a mistyped path would otherwise
/// hold a dataset somewhere unexpected); the error says which directory is missing.
#[test]
fn a_pack_into_a_missing_directory_names_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write_npy(&tmp.path().join("x.npy"), DType::U8, &[4, 2], &[1; 8]);
    let missing = tmp.path().join("missing").join("deeper");
    let out = missing.join("ds");
    let err = assert_fails(&pack_cli(args!["--out", &out, &input]));
    assert_line_with(
        &err,
        &[
            &out.display().to_string(),
            &format!("the directory {} does not exist", missing.display()),
        ],
    );
    assert!(!err.contains(".partial"), "{err}");
    assert!(!missing.exists());
}

/// A process id that no process has: a child's, once it has exited and been waited for.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Regression: a `kill -9` of `gpufeed pack` left its `.NAME.partial-PID-N` staging directory beside
/// `--out` for ever (84 MB in one trial), through later packs and daemon starts. The next pack into
/// the directory removes the staging of packers that are gone, and only theirs: a directory whose
/// process lives (this test's) stays, so does one whose lock is held (a packer in another PID
/// namespace, or a reused PID), and a file of that name (`unpack`'s, which carries no lock).
#[test]
fn a_pack_removes_the_staging_of_dead_packers_only() {
    let tmp = tempfile::tempdir().unwrap();
    let input = write_npy(&tmp.path().join("x.npy"), DType::U8, &[4, 2], &[1; 8]);
    let dead = dead_pid();
    let staging =
        |name: &str, pid: u32, n: u32| tmp.path().join(format!(".{name}.partial-{pid}-{n}"));
    let stale = staging("ds", dead, 1);
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join("shard-000000.gfs"), [0; 4096]).unwrap();
    let locked = staging("other", dead, 2);
    fs::create_dir(&locked).unwrap();
    let _held = gpufeed::durable::WriterLock::take(&locked).unwrap();
    let alive = staging("ds", std::process::id(), 3);
    fs::create_dir(&alive).unwrap();
    let unpacking = staging("y.npy", dead, 4);
    fs::write(&unpacking, [0; 16]).unwrap();

    assert_succeeds(&pack_cli(args!["--out", tmp.path().join("ds"), &input]));
    assert!(!stale.exists(), "the dead packer's staging is removed");
    for kept in [&locked, &alive, &unpacking] {
        assert!(kept.exists(), "{} was removed", kept.display());
    }
}

/// Regression (as above): the daemon removes dead packers' staging from its data root at start,
/// where its pack jobs write; a live packer's (locked) stays.
#[test]
fn the_daemon_removes_dead_packers_staging_from_its_data_root_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    fs::create_dir(&root).unwrap();
    let dead = dead_pid();
    let stale = root.join(format!(".ds.partial-{dead}-1"));
    fs::create_dir(&stale).unwrap();
    let locked = root.join(format!(".ds.partial-{dead}-2"));
    fs::create_dir(&locked).unwrap();
    let _held = gpufeed::durable::WriterLock::take(&locked).unwrap();
    let daemon = common::daemon::start(
        common::daemon::serve_command(&root, &[]),
        &tmp.path().join("logs"),
    );
    assert!(!stale.exists(), "{}", daemon.log());
    assert!(locked.exists());
}

/// Cancels a pack once `after` progress reports have arrived.
struct CancelAfter {
    reports: AtomicUsize,
    after: usize,
}

impl PackObserver for CancelAfter {
    fn progress(&self, _raw_bytes_done: u64) {
        self.reports.fetch_add(1, Ordering::SeqCst);
    }
    fn cancelled(&self) -> bool {
        self.reports.load(Ordering::SeqCst) >= self.after
    }
}

#[test]
fn pack_cancelled_midway_leaves_the_old_dataset_and_no_staging_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let old_bytes = common::noise(1000, 8);
    let field = |bytes: Vec<u8>| common::field("x", DType::U8, &[10], bytes);
    common::pack_fields(
        &out,
        &[field(old_bytes.clone())],
        &common::options("ds", 4096, None),
    );
    let manifest = fs::read(out.join("manifest.json")).unwrap();

    // 5 shards of one 4000-byte block each; the observer cancels after the second shard.
    let mut options = common::options("ds", 4096, Some(400));
    options.on_existing = OnExisting::Replace;
    let observer = CancelAfter {
        reports: AtomicUsize::new(0),
        after: 2,
    };
    let result = pack::pack(
        &out,
        &[field(common::noise(20_000, 9))],
        &options,
        &observer,
    );
    assert!(matches!(result, Err(PackError::Cancelled)), "{result:?}");
    assert_eq!(observer.reports.load(Ordering::SeqCst), 2);
    assert_eq!(fs::read(out.join("manifest.json")).unwrap(), manifest);
    assert_eq!(hidden_entries(tmp.path()), Vec::<String>::new());
    let back = unpack_cli(&out, "x", &tmp.path().join("x.npy"), None);
    assert!(back.bytes == old_bytes);
}

#[test]
fn inspect_prints_a_json_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens = write_npy(
        &tmp.path().join("t.npy"),
        DType::I32,
        &[300, 16],
        &common::i32_bytes(300 * 16, |i| (i % 50) as i32),
    );
    let emb = write_npy(
        &tmp.path().join("e.npy"),
        DType::F16,
        &[300, 2, 8],
        &common::noise(300 * 16 * 2, 2),
    );
    let out = tmp.path().join("inspected");
    let mut t = OsString::from("tokens=");
    t.push(&tokens);
    let mut e = OsString::from("emb=");
    e.push(&emb);
    assert_succeeds(&pack_cli(args![
        "--out",
        &out,
        "--name",
        "my-set",
        "--field",
        t,
        "--field",
        e,
        "--samples-per-shard",
        "128"
    ]));
    let text = assert_succeeds(&gpufeed(args!["inspect", &out]));
    let summary: serde_json::Value = serde_json::from_str(&text).expect("inspect prints JSON");
    assert_eq!(summary["name"], "my-set");
    assert_eq!(summary["format_version"], 1);
    assert_eq!(summary["samples"], 300);
    assert_eq!(summary["shards"], 3);
    assert_eq!(summary["block_bytes"], 4096);
    let fields = summary["fields"].as_array().unwrap();
    assert_eq!(fields.len(), 2);
    let expected = [
        ("tokens", "i32", vec![16], 64),
        ("emb", "f16", vec![2, 8], 32),
    ];
    for (field, (name, dtype, shape, sample_bytes)) in fields.iter().zip(expected) {
        assert_eq!(field["name"], name);
        assert_eq!(field["dtype"], dtype);
        assert_eq!(field["shape"], serde_json::json!(shape));
        assert_eq!(field["sample_bytes"], sample_bytes);
        assert_eq!(field["raw_bytes"], 300 * sample_bytes);
        let codecs = &field["codecs"];
        let counted = ["raw", "lz4", "lz4_shuffled"]
            .iter()
            .map(|c| codecs[c].as_u64().unwrap())
            .sum::<u64>();
        assert_eq!(field["blocks"].as_u64(), Some(counted));
    }
    assert_eq!(fields[0]["codecs"]["raw"], 0, "small ids compress");
    assert_eq!(summary["raw_bytes"], 300 * (64 + 32));
}

/// Writes a safetensors file holding `tensors` and returns its path.
fn write_safetensors(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (*name, TensorView::new(*dtype, shape.clone(), data).unwrap())
        })
        .collect();
    fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    path.to_path_buf()
}

fn safetensors_field(name: &str, file: &Path, tensor: &str) -> OsString {
    let mut arg = OsString::from(format!("{name}="));
    arg.push(file);
    arg.push(format!(":{tensor}"));
    arg
}

#[test]
fn safetensors_tensors_pack_as_fields_and_a_missing_tensor_lists_the_names() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = common::noise(10 * 4 * 2, 11);
    let ids = common::noise(10 * 8, 12);
    let w = common::noise(10 * 3 * 2, 13);
    let file = write_safetensors(
        &tmp.path().join("model.safetensors"),
        &[
            ("emb", Dtype::F16, vec![10, 4], emb.clone()),
            ("ids", Dtype::I64, vec![10], ids.clone()),
            ("w", Dtype::BF16, vec![10, 3], w.clone()),
        ],
    );
    let out = tmp.path().join("st");
    assert_succeeds(&pack_cli(args![
        "--out",
        &out,
        "--field",
        safetensors_field("emb", &file, "emb"),
        "--field",
        safetensors_field("token_ids", &file, "ids"),
        "--field",
        safetensors_field("w", &file, "w"),
    ]));
    let back = unpack_cli(&out, "emb", &tmp.path().join("emb.npy"), None);
    assert_eq!((back.dtype, back.shape), (DType::F16, vec![10, 4]));
    assert!(back.bytes == emb);
    let back = unpack_cli(&out, "token_ids", &tmp.path().join("ids.npy"), None);
    assert_eq!((back.dtype, back.shape), (DType::I64, vec![10]));
    assert!(back.bytes == ids);
    let back = unpack_cli(&out, "w", &tmp.path().join("w.npy"), Some("f32"));
    assert_eq!((back.dtype, back.shape), (DType::F32, vec![10, 3]));
    let expected: Vec<u8> = w
        .chunks_exact(2)
        .flat_map(|b| {
            bf16::from_le_bytes([b[0], b[1]])
                .to_f32()
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    assert!(back.bytes == expected);

    let out = tmp.path().join("missing-tensor");
    let err = assert_fails(&pack_cli(args![
        "--out",
        &out,
        "--field",
        safetensors_field("x", &file, "embeddings"),
    ]));
    assert_line_with(
        &err,
        &[&format!(
            "{}: no tensor named \"embeddings\"; available: emb, ids, w",
            file.display()
        )],
    );
    assert_nothing_written(&out);
}

#[test]
fn demo_on_the_cpu_backend_checks_every_value_and_names_its_device() {
    let dir = tempfile::tempdir().unwrap();
    let out = assert_succeeds(&gpufeed(args![
        "demo",
        "--device",
        "cpu",
        "--samples",
        "1000",
        "--dir",
        dir.path()
    ]));
    assert_line_with(&out, &["backend: cpu", "(--device cpu)"]);
    assert_line_with(&out, &["serve:", "3 batches of 256", "through the socket"]);
    assert_line_with(&out, &["check:", "every served value equals the source"]);
    let summary: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(summary["device"], "cpu");
    assert_eq!(summary["batches"], 3);
    assert_eq!(summary["samples"], 1000);
}

#[test]
fn demo_refuses_an_unknown_device() {
    let err = assert_fails(&gpufeed(["demo", "--device", "gpu"]));
    assert_line_with(&err, &["--device", "expected auto, cpu or cuda:N"]);
}

#[test]
fn help_texts_mention_every_subcommand_and_option() {
    let top = assert_succeeds(&gpufeed(["--help"]));
    for command in ["pack", "inspect", "verify", "unpack", "list-inputs", "demo"] {
        assert!(
            top.lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "--help does not list {command}:\n{top}"
        );
    }
    let options: [(&str, &[&str]); 5] = [
        (
            "pack",
            &[
                "--out",
                "--name",
                "--field",
                "--block-bytes",
                "--samples-per-shard",
                "--codec",
                "--byte-shuffle",
                "--force",
                "--threads",
                "--quiet",
                "[PATH]",
            ],
        ),
        ("inspect", &["<DIR>"]),
        ("verify", &["<DIR>", "--quiet"]),
        (
            "unpack",
            &["<DIR>", "--field", "--out", "--force", "--dtype", "--quiet"],
        ),
        ("demo", &["--dir", "--samples", "--device"]),
    ];
    for (command, options) in options {
        let help = assert_succeeds(&gpufeed([command, "--help"]));
        for option in options {
            assert!(
                help.contains(option),
                "gpufeed {command} --help does not mention {option}:\n{help}"
            );
        }
    }
    let pack_help = stdout(&gpufeed(["pack", "--help"]));
    for value in ["auto", "lz4", "raw", "on", "off"] {
        assert!(pack_help.contains(value), "{value}:\n{pack_help}");
    }
}
