//! Interop tests: datasets written by `gpufeed pack` are read back by an independent Python reader
//! (`tests/interop/read_shards.py`: `struct` for the tables, the `xxhash` package for the xxh3-64
//! checksums, the reference C LZ4 through the `lz4` package, NumPy for the byte shuffle), and `.npy`
//! files written by `gpufeed unpack` are loaded by NumPy itself (`tests/interop/check_unpack.py`) and
//! compared with the inputs, which NumPy wrote too (`tests/interop/make_inputs.py`). Token files
//! (a Megatron-LM `.bin`/`.idx` pair, a flat `.bin`, a 1-D `.npy`) are written by
//! `tests/interop/token_files.py` in those tools' layouts, packed with `--tokens`, unpacked, and
//! compared with the script's own reading of the files (`.idx` parsed with `struct` and NumPy).
//! Parquet files and Arrow IPC files and streams are written by pyarrow
//! (`tests/interop/table_files.py`), packed, unpacked, and compared with pyarrow's reading. Nothing here uses
//! gpufeed's own reader, so a bug that is symmetric between gpufeed's writer and reader shows up.
//!
//! The tests need `python3` with the packages of `tests/requirements.txt`. When they are missing the
//! tests fail and say how to install them: a skipped test that passes reads as a pass in every
//! summary, so it used to hide that the independent check had not run at all. Where that is meant
//! (a machine without the packages, on purpose), `GPUFEED_ALLOW_SKIP=1` turns the failure into a
//! loud `SKIPPED` line and a pass, except under CI (the `CI` environment variable is set), where the
//! interop tests always run or fail.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const GPUFEED: &str = env!("CARGO_BIN_EXE_gpufeed");
const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/interop");
const INSTALL_HINT: &str = "python3 -m pip install -r tests/requirements.txt";

/// What an interop test does when python3 or its modules are missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WhenMissing {
    /// The test fails, saying what to install.
    Fail,
    /// The test prints SKIPPED and passes.
    Skip,
}

/// [`WhenMissing`] from the environment `variable` reads: skip only with `GPUFEED_ALLOW_SKIP=1`, and
/// never under CI.
fn when_missing(variable: impl Fn(&str) -> Option<std::ffi::OsString>) -> WhenMissing {
    let allowed = variable("GPUFEED_ALLOW_SKIP").is_some_and(|value| value == "1");
    if allowed && variable("CI").is_none() {
        WhenMissing::Skip
    } else {
        WhenMissing::Fail
    }
}

/// Whether `python3` and the required modules are importable. Panics when they are not, unless
/// skips are allowed ([`when_missing`]): then prints a loud SKIPPED line for the test `test` and
/// returns false.
fn python_ready(test: &str) -> bool {
    let problem = match missing_modules(None) {
        Ok(missing) if missing.is_empty() => return true,
        Ok(missing) => format!("python3 cannot import {}", missing.join(", ")),
        Err(problem) => problem,
    };
    if when_missing(|name| std::env::var_os(name)) == WhenMissing::Fail {
        panic!(
            "{problem}\nThe interop tests need them: run `{INSTALL_HINT}` (or, outside CI, set \
             GPUFEED_ALLOW_SKIP=1 to skip them knowingly)."
        );
    }
    // Written to the stderr handle rather than with eprintln!, which the test harness captures and
    // hides for passing tests: a skip must be visible.
    let _ = writeln!(
        std::io::stderr(),
        "\n*** SKIPPED: interop test {test}: {problem}. Run `{INSTALL_HINT}` to enable it. ***\n"
    );
    false
}

/// The modules the interop tests need that python3 cannot import, each tried on its own so that the
/// message names the ones missing (it used to blame numpy when only lz4 was missing); with
/// `python_path`, as seen with that PYTHONPATH. An error when python3 itself cannot run.
fn missing_modules(python_path: Option<&std::path::Path>) -> Result<Vec<String>, String> {
    let mut command = Command::new("python3");
    command.args([
        "-c",
        "import importlib, sys\n\
         missing = []\n\
         for name in ('numpy', 'lz4.block', 'xxhash', 'pyarrow'):\n\
         \x20   try:\n\
         \x20       importlib.import_module(name)\n\
         \x20   except ImportError:\n\
         \x20       missing.append(name)\n\
         print(' '.join(missing))",
    ]);
    if let Some(path) = python_path {
        command.env("PYTHONPATH", path);
    }
    let output = command
        .output()
        .map_err(|error| format!("cannot run python3: {error}"))?;
    if !output.status.success() {
        return Err(format!(
            "the python3 probe failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect())
}

/// Regression test: outside CI a missing module made the interop tests print SKIPPED and pass, so a
/// machine without the packages reported every test green although the independent check never
/// ran. They fail now unless skipping is asked for, and under CI even then.
#[test]
fn missing_modules_fail_unless_skipping_is_asked_for() {
    let environment = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| std::ffi::OsString::from(value))
        }
    };
    assert_eq!(when_missing(environment(&[])), WhenMissing::Fail);
    assert_eq!(
        when_missing(environment(&[("GPUFEED_ALLOW_SKIP", "1")])),
        WhenMissing::Skip
    );
    assert_eq!(
        when_missing(environment(&[("GPUFEED_ALLOW_SKIP", "0")])),
        WhenMissing::Fail
    );
    assert_eq!(
        when_missing(environment(&[("GPUFEED_ALLOW_SKIP", "1"), ("CI", "true")])),
        WhenMissing::Fail
    );
    assert_eq!(
        when_missing(environment(&[("CI", "true")])),
        WhenMissing::Fail
    );
}

/// Regression test for the probe: with an `lz4` that cannot be imported (a stand-in package first
/// on PYTHONPATH), exactly `lz4.block` is named, not numpy.
#[test]
fn the_probe_names_the_missing_module() {
    if Command::new("python3").arg("--version").output().is_err() {
        // Without python3 there is nothing to probe; python_ready reports that case itself.
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("lz4")).unwrap();
    std::fs::write(
        dir.path().join("lz4").join("__init__.py"),
        "raise ImportError('a broken lz4 for the test')\n",
    )
    .unwrap();
    let missing = missing_modules(Some(dir.path())).unwrap();
    assert!(missing.contains(&"lz4.block".to_string()), "{missing:?}");
    // Nothing else is blamed: every other module named is missing without the stand-in too.
    let baseline = missing_modules(None).unwrap();
    for name in missing.iter().filter(|name| *name != "lz4.block") {
        assert!(baseline.contains(name), "{name} blamed: {missing:?}");
    }
}

fn describe(command: &Command) -> String {
    let mut line = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// Runs `command` and returns its output, or panics with everything it printed.
fn run_ok(mut command: Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{}`: {e}", describe(&command)));
    assert!(
        output.status.success(),
        "`{}` failed ({}):\n--- stdout\n{}--- stderr\n{}",
        describe(&command),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Runs `command`, which must fail, and returns its stderr.
fn run_failing(mut command: Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{}`: {e}", describe(&command)));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "`{}` should have failed but succeeded:\n--- stdout\n{}--- stderr\n{stderr}",
        describe(&command),
        String::from_utf8_lossy(&output.stdout),
    );
    stderr
}

fn python(script: &str) -> Command {
    let mut command = Command::new("python3");
    command.arg(Path::new(SCRIPTS).join(script));
    command
}

fn gpufeed(subcommand: &str) -> Command {
    let mut command = Command::new(GPUFEED);
    command.args([subcommand, "--quiet"]);
    command
}

/// The inputs written by `make_inputs.py`: field name and its .npy files, in order.
struct Inputs {
    fields: Vec<(String, Vec<PathBuf>)>,
    dir: PathBuf,
}

impl Inputs {
    fn make(dir: &Path) -> Inputs {
        let dir = dir.join("inputs");
        run_ok({
            let mut c = python("make_inputs.py");
            c.arg(&dir);
            c
        });
        let listing = std::fs::read_to_string(dir.join("manifest.txt")).unwrap();
        let fields = listing
            .lines()
            .map(|line| {
                let (name, files) = line.split_once(' ').expect("NAME FILE[,FILE...]");
                let files = files.split(',').map(|f| dir.join(f)).collect();
                (name.to_string(), files)
            })
            .collect();
        Inputs { fields, dir }
    }

    /// `pack --out OUT --field NAME=FILE ...` with the extra options.
    fn pack(&self, out: &Path, options: &[&str]) {
        let mut command = gpufeed("pack");
        command.arg("--out").arg(out);
        for (name, files) in &self.fields {
            for file in files {
                command
                    .arg("--field")
                    .arg(format!("{name}={}", file.display()));
            }
        }
        command.args(options);
        run_ok(command);
    }

    /// `read_shards.py DIR --expect NAME=FILE ...` for every field.
    fn read_shards(&self, dataset: &Path) -> Command {
        let mut command = python("read_shards.py");
        command.arg(dataset);
        for (name, files) in &self.fields {
            for file in files {
                command
                    .arg("--expect")
                    .arg(format!("{name}={}", file.display()));
            }
        }
        command
    }
}

/// The block counts from read_shards.py's JSON summary line.
#[derive(Debug, Default, Clone, Copy)]
struct Kinds {
    raw: u64,
    lz4: u64,
    lz4_shuffle: u64,
    shards: u64,
}

fn read_kinds(output: &Output) -> Kinds {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .last()
        .unwrap_or_else(|| panic!("read_shards.py printed no summary: {stdout:?}"));
    let json: serde_json::Value = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("read_shards.py summary {line:?} is not JSON: {e}"));
    let count = |key: &str| {
        json["blocks"][key]
            .as_u64()
            .unwrap_or_else(|| panic!("summary {line:?} lacks blocks.{key}"))
    };
    Kinds {
        raw: count("raw"),
        lz4: count("lz4"),
        lz4_shuffle: count("lz4+shuffle"),
        shards: json["shards"].as_u64().expect("summary has shards"),
    }
}

#[test]
fn packed_blocks_decode_with_liblz4_and_xxhash() {
    if !python_ready("packed_blocks_decode_with_liblz4_and_xxhash") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let inputs = Inputs::make(tmp.path());

    // (label, pack options, check on the block kinds of that run)
    type Expect = fn(&Kinds) -> bool;
    let runs: [(&str, &[&str], Expect); 5] = [
        // fp16 normals do not compress (raw); ids and features compress best shuffled.
        ("default", &[], |k| k.raw > 0 && k.lz4_shuffle > 0),
        // Every block LZ4; wider-than-a-byte elements shuffled, uint8 pixels cannot be.
        (
            "lz4-shuffle-on",
            &["--codec", "lz4", "--shuffle-filter", "on"],
            |k| k.raw == 0 && k.lz4_shuffle > 0 && k.lz4 > 0,
        ),
        (
            "lz4-shuffle-off",
            &["--codec", "lz4", "--shuffle-filter", "off"],
            |k| k.raw == 0 && k.lz4_shuffle == 0 && k.lz4 > 0,
        ),
        // 1037 samples in shards of 100 (the last one short); 6000-byte wave samples span blocks.
        (
            "small-blocks-many-shards",
            &["--block-bytes", "4K", "--samples-per-shard", "100"],
            |k| k.shards == 11 && k.raw + k.lz4 + k.lz4_shuffle > 0,
        ),
        ("raw", &["--codec", "raw"], |k| {
            k.raw > 0 && k.lz4 == 0 && k.lz4_shuffle == 0
        }),
    ];
    let mut total = Kinds::default();
    let mut datasets = Vec::new();
    for (label, options, expect) in runs {
        let dataset = tmp.path().join(label);
        inputs.pack(&dataset, options);
        let output = run_ok(inputs.read_shards(&dataset));
        let kinds = read_kinds(&output);
        eprintln!("{label}: {kinds:?}");
        assert!(
            expect(&kinds),
            "pack {options:?}: unexpected block kinds {kinds:?}"
        );
        total.raw += kinds.raw;
        total.lz4 += kinds.lz4;
        total.lz4_shuffle += kinds.lz4_shuffle;
        datasets.push(dataset);
    }
    assert!(
        total.raw > 0 && total.lz4 > 0 && total.lz4_shuffle > 0,
        "the runs did not exercise raw, lz4 and lz4+shuffle blocks: {total:?}"
    );

    // The reader is not vacuous: a flipped payload bit fails its checksum...
    let corrupt = tmp.path().join("corrupt");
    std::fs::create_dir(&corrupt).unwrap();
    for entry in std::fs::read_dir(&datasets[0]).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), corrupt.join(entry.file_name())).unwrap();
    }
    let shard = corrupt.join("shard-000000.gfs");
    let mut bytes = std::fs::read(&shard).unwrap();
    let payload_offset = u64::from_le_bytes(bytes[48..56].try_into().unwrap()) as usize;
    bytes[payload_offset] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();
    let stderr = run_failing(inputs.read_shards(&corrupt));
    assert!(stderr.contains("payload checksum"), "{stderr}");

    // ...and a reference that differs in one NaN payload only is caught byte for byte.
    let mut command = python("read_shards.py");
    command.arg(&datasets[0]);
    for (name, files) in &inputs.fields {
        for file in files {
            let file = if name == "emb" {
                inputs.dir.join("emb_altered.npy")
            } else {
                file.clone()
            };
            command
                .arg("--expect")
                .arg(format!("{name}={}", file.display()));
        }
    }
    let stderr = run_failing(command);
    assert!(
        stderr.contains("field 'emb'") && stderr.contains("1 of"),
        "{stderr}"
    );

    // A Fortran-order array, as np.save writes it, is refused with a message saying so.
    let mut command = gpufeed("pack");
    command
        .arg("--out")
        .arg(tmp.path().join("fortran"))
        .arg("--field")
        .arg(format!("f={}", inputs.dir.join("fortran.npy").display()));
    let stderr = run_failing(command);
    assert!(stderr.contains("Fortran"), "{stderr}");
    assert!(!tmp.path().join("fortran").join("manifest.json").exists());
}

#[test]
fn unpacked_npy_loads_in_numpy() {
    if !python_ready("unpacked_npy_loads_in_numpy") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let inputs = Inputs::make(tmp.path());
    // Many shards and small blocks, so unpack stitches samples across blocks and shards.
    let dataset = tmp.path().join("dataset");
    inputs.pack(
        &dataset,
        &["--block-bytes", "4K", "--samples-per-shard", "100"],
    );

    // Every field as stored and as f32; integer fields of at most 32 bits also as i64.
    let narrow_integers = ["tokens", "image", "wave"];
    for (name, files) in &inputs.fields {
        let mut dtypes = vec![None, Some("f32")];
        if narrow_integers.contains(&name.as_str()) {
            dtypes.push(Some("i64"));
        }
        for dtype in dtypes {
            let out = tmp
                .path()
                .join(format!("{name}-{}.npy", dtype.unwrap_or("stored")));
            let mut command = gpufeed("unpack");
            command
                .arg(&dataset)
                .args(["--field", name])
                .arg("--out")
                .arg(&out);
            let mut check = python("check_unpack.py");
            check.arg(&out);
            for file in files {
                check.arg("--source").arg(file);
            }
            if let Some(dtype) = dtype {
                command.args(["--dtype", dtype]);
                check.args(["--dtype", dtype]);
            }
            run_ok(command);
            let output = run_ok(check);
            eprint!("{}", String::from_utf8_lossy(&output.stdout));
        }
    }
}

/// Token inputs round-trip exactly: each is written by `token_files.py`, packed with `--tokens` in
/// small blocks over several shards, unpacked, and compared by the script with its own reading of
/// the file, remainder dropped; for a Megatron dataset `doc_start` too.
#[test]
fn token_files_pack_exactly_as_numpy_reads_them() {
    if !python_ready("token_files_pack_exactly_as_numpy_reads_them") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let script = "token_files.py";
    // (what to write, its dtype, the file to pack, --token-dtype, --seq-len)
    let cases: [(&str, &str, &str, Option<&str>, u64); 5] = [
        ("write-megatron", "int32", "m32", None, 100),
        ("write-megatron", "uint16", "m16", None, 37),
        ("write-flat", "uint16", "flat16.bin", Some("u16"), 64),
        ("write-flat", "uint32", "flat32.bin", Some("u32"), 50),
        ("write-npy", "int32", "tokens.npy", None, 128),
    ];
    for (index, (write, dtype, file, token_dtype, seq_len)) in cases.into_iter().enumerate() {
        let target = tmp.path().join(file);
        let mut writer = python(script);
        writer
            .arg(write)
            .arg(&target)
            .args([dtype, &index.to_string()]);
        run_ok(writer);
        let megatron = write == "write-megatron";
        let source = if megatron {
            target.with_extension("bin")
        } else {
            target.clone()
        };
        let dataset = tmp.path().join(format!("dataset-{index}"));
        let mut pack = gpufeed("pack");
        pack.arg("--out")
            .arg(&dataset)
            .arg("--tokens")
            .arg(&source)
            .args(["--seq-len", &seq_len.to_string()])
            .args(["--block-bytes", "4K", "--samples-per-shard", "7"]);
        if let Some(token_dtype) = token_dtype {
            pack.args(["--token-dtype", token_dtype]);
        }
        let packed = run_ok(pack);
        let packed_text = String::from_utf8_lossy(&packed.stderr).into_owned();
        let mut check = python(script);
        check.arg("check").arg(&source).arg(seq_len.to_string());
        let tokens = tmp.path().join(format!("tokens-{index}.npy"));
        run_ok({
            let mut unpack = gpufeed("unpack");
            unpack
                .arg(&dataset)
                .args(["--field", "tokens", "--out"])
                .arg(&tokens);
            unpack
        });
        check.arg(&tokens);
        if let Some(token_dtype) = token_dtype {
            check.args([
                "--dtype",
                if token_dtype == "u16" {
                    "uint16"
                } else {
                    "uint32"
                },
            ]);
        }
        if megatron {
            let starts = tmp.path().join(format!("doc-start-{index}.npy"));
            let mut unpack = gpufeed("unpack");
            unpack
                .arg(&dataset)
                .args(["--field", "doc_start", "--out"])
                .arg(&starts);
            run_ok(unpack);
            check.arg("--doc-start").arg(&starts);
        }
        let checked = String::from_utf8_lossy(&run_ok(check).stdout).into_owned();
        let words: Vec<&str> = checked.split_whitespace().collect();
        assert_eq!(words.first(), Some(&"ok"), "{file}: {checked}");
        // The pack reported the same sequences and dropped tokens as NumPy's reading gives.
        let reported = format!(
            "into {} sequences of {seq_len}; {} remainder tokens dropped",
            words[1], words[2]
        );
        assert!(
            packed_text.contains(&reported),
            "{file}: {packed_text} lacks {reported:?}"
        );
    }
}

/// Megatron-LM datasets packed with `--documents`: one sample per document (empty ones too) in a
/// variable-length field that the independent reader reads back as the documents NumPy reads from
/// the `.idx` and `.bin`, over two files; a flat token file, which has no documents, is refused.
#[test]
fn megatron_documents_pack_one_sample_per_document() {
    if !python_ready("megatron_documents_pack_one_sample_per_document") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let mut bins = Vec::new();
    for (index, name) in ["first", "second"].into_iter().enumerate() {
        let prefix = tmp.path().join(name);
        let mut writer = python("token_files.py");
        writer
            .arg("write-megatron")
            .arg(&prefix)
            .args(["int32", &(10 + index).to_string()]);
        run_ok(writer);
        bins.push(prefix.with_extension("bin"));
    }
    let dataset = tmp.path().join("documents");
    let mut pack = gpufeed("pack");
    pack.arg("--out").arg(&dataset).arg("--documents").args([
        "--block-bytes",
        "4K",
        "--samples-per-shard",
        "9",
    ]);
    for bin in &bins {
        pack.arg("--tokens").arg(bin);
    }
    let packed = String::from_utf8_lossy(&run_ok(pack).stderr).into_owned();
    assert!(packed.contains("documents"), "{packed}");
    let mut check = python("token_files.py");
    check.arg("check-documents").arg(&dataset).args(&bins);
    let checked = String::from_utf8_lossy(&run_ok(check).stdout).into_owned();
    assert!(checked.starts_with("ok "), "{checked}");

    let flat = tmp.path().join("flat.bin");
    let mut writer = python("token_files.py");
    writer.arg("write-flat").arg(&flat).args(["uint16", "3"]);
    run_ok(writer);
    let mut pack = gpufeed("pack");
    pack.arg("--out")
        .arg(tmp.path().join("refused"))
        .arg("--documents")
        .arg("--tokens")
        .arg(&flat)
        .args(["--token-dtype", "u16"]);
    let refused = run_failing(pack);
    assert!(
        refused.contains("flat.bin") && refused.contains("no document boundaries"),
        "{refused}"
    );
}

/// Unpacks every field of `dataset` and returns `FIELD=COLUMN=NPY` arguments for
/// `table_files.py check`, the column named as the field.
fn unpack_fields(dataset: &Path, fields: &[&str], dir: &Path) -> Vec<String> {
    fields
        .iter()
        .map(|field| {
            let npy = dir.join(format!(
                "{}-{field}.npy",
                dataset.display().to_string().replace('/', "_")
            ));
            let mut unpack = gpufeed("unpack");
            unpack
                .arg(dataset)
                .args(["--field", field, "--out"])
                .arg(&npy);
            run_ok(unpack);
            format!("{field}={field}={}", npy.display())
        })
        .collect()
}

/// Parquet (snappy over several row groups, zstd), an Arrow IPC file (lz4) and a Hugging Face
/// `datasets` cache file (an IPC stream of 1000-row batches) written by pyarrow pack exactly as
/// pyarrow reads them: scalar columns (int64, float16, bool as u8) and fixed-size lists, nested ones
/// as 2-D samples; several files as one dataset, in small blocks over several shards.
#[test]
fn table_files_pack_exactly_as_pyarrow_reads_them() {
    if !python_ready("table_files_pack_exactly_as_pyarrow_reads_them") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let inputs = tmp.path().join("in");
    let mut write = python("table_files.py");
    write.arg("write").arg(&inputs);
    run_ok(write);
    // list-inputs describes each column: its type, the field it packs as, or why it cannot.
    let listed = run_ok({
        let mut list = Command::new(GPUFEED);
        list.arg("list-inputs")
            .arg(inputs.join("hf/data-00000-of-00001.arrow"))
            .arg(inputs.join("a.parquet"));
        list
    });
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    for needle in [
        "Arrow IPC stream, 2345 rows, 4 column(s)",
        "Parquet, 1000 rows, 5 column(s)",
        "fixed_size_list<fixed_size_list<uint8>[4]>[3]  u8 [3, 4]",
        "input_ids  list<int32>",
        "i32 [*] variable-length",
    ] {
        assert!(listed.contains(needle), "{listed} lacks {needle:?}");
    }
    let all = ["emb", "img", "label", "w", "flag"];
    // (files, fields, --threads): Parquet files are decoded row group by row group on several
    // threads, and in order on one.
    let cases: [(&[&str], &[&str], &str); 4] = [
        (&["a.parquet", "b.parquet"], &all, "3"),
        (&["a.parquet", "b.parquet"], &all, "1"),
        (&["a.arrow", "b.parquet"], &all, "2"),
        (&["hf/data-00000-of-00001.arrow"], &["emb", "label"], "2"),
    ];
    for (index, (files, fields, threads)) in cases.into_iter().enumerate() {
        let dataset = tmp.path().join(format!("dataset-{index}"));
        let mut pack = gpufeed("pack");
        pack.arg("--out")
            .arg(&dataset)
            .args(["--block-bytes", "4K", "--samples-per-shard", "333"])
            .args(["--threads", threads]);
        if fields.len() == all.len() {
            pack.args(files.iter().map(|f| inputs.join(f)));
        } else {
            // The cache file has string and list columns too: the fixed ones are named.
            for field in fields {
                for file in files {
                    pack.arg("--field")
                        .arg(format!("{field}={}:{field}", inputs.join(file).display()));
                }
            }
        }
        run_ok(pack);
        let mut check = python("table_files.py");
        check.arg("check");
        check.args(files.iter().map(|f| inputs.join(f)));
        check.arg("--");
        check.args(unpack_fields(&dataset, fields, tmp.path()));
        let checked = String::from_utf8_lossy(&run_ok(check).stdout).into_owned();
        assert!(checked.starts_with("ok "), "{files:?}: {checked}");
    }
}

/// List, string and binary columns of Parquet and Arrow IPC files (lists of scalars and of
/// fixed-size lists, some empty; a Hugging Face cache's `text` and `input_ids`) pack as
/// variable-length fields (format version 2) that an independent reader of the format
/// (`read_shards.py`) reads back row for row as pyarrow reads the columns, on one thread and on
/// several, beside fixed-shape columns that still unpack exactly.
#[test]
fn variable_length_columns_pack_exactly_as_pyarrow_reads_them() {
    if !python_ready("variable_length_columns_pack_exactly_as_pyarrow_reads_them") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let inputs = tmp.path().join("in");
    let mut write = python("table_files.py");
    write.arg("write").arg(&inputs);
    run_ok(write);
    // (files, variable-length columns, fixed-shape ones, --threads)
    type Case<'a> = (&'a [&'a str], &'a [&'a str], &'a [&'a str], &'a str);
    let cases: [Case; 3] = [
        (
            &["varlen.parquet", "varlen.arrow"],
            &["ids", "text", "pairs", "blob"],
            &["label"],
            "3",
        ),
        (
            &["varlen.arrow"],
            &["ids", "text", "pairs", "blob"],
            &["label"],
            "1",
        ),
        (
            &["hf/data-00000-of-00001.arrow"],
            &["text", "input_ids"],
            &["emb", "label"],
            "2",
        ),
    ];
    for (index, (files, variable, fixed, threads)) in cases.into_iter().enumerate() {
        let dataset = tmp.path().join(format!("varlen-{index}"));
        let mut pack = gpufeed("pack");
        pack.arg("--out")
            .arg(&dataset)
            .args(["--block-bytes", "4K", "--samples-per-shard", "333"])
            .args(["--threads", threads])
            .args(files.iter().map(|f| inputs.join(f)));
        run_ok(pack);
        let mut check = python("table_files.py");
        check.arg("check-variable").arg(&dataset);
        check.args(files.iter().map(|f| inputs.join(f)));
        check.arg("--");
        check.args(variable.iter().map(|c| format!("{c}={c}")));
        let checked = String::from_utf8_lossy(&run_ok(check).stdout).into_owned();
        assert!(checked.starts_with("ok "), "{files:?}: {checked}");
        let mut check = python("table_files.py");
        check.arg("check");
        check.args(files.iter().map(|f| inputs.join(f)));
        check.arg("--");
        check.args(unpack_fields(&dataset, fixed, tmp.path()));
        let checked = String::from_utf8_lossy(&run_ok(check).stdout).into_owned();
        assert!(checked.starts_with("ok "), "{files:?}: {checked}");
    }
}

/// Tables that cannot be packed are refused, naming the file, the column and (for nulls) the row,
/// and nothing is written: a list of lists, named or in a file packed whole, nulls (at the top level and
/// inside a fixed-size list), files whose column types disagree, and truncated Parquet, IPC file
/// and IPC stream inputs.
#[test]
fn malformed_tables_are_refused_naming_file_column_and_row() {
    if !python_ready("malformed_tables_are_refused_naming_file_column_and_row") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let inputs = tmp.path().join("in");
    let mut write = python("table_files.py");
    write.arg("write").arg(&inputs);
    run_ok(write);
    for (source, cut, target) in [
        ("a.parquet", "100", "cut.parquet"),
        ("a.arrow", "3000", "cut.arrow"),
        ("hf/data-00000-of-00001.arrow", "3000", "cut-stream.arrow"),
    ] {
        let mut truncate = python("table_files.py");
        truncate
            .arg("truncate")
            .arg(inputs.join(source))
            .arg(inputs.join(target))
            .arg(cut);
        run_ok(truncate);
    }
    let path = |name: &str| inputs.join(name).display().to_string();
    let field = |field: &str, file: &str, column: &str| format!("{field}={}:{column}", path(file));
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (
            vec!["--field".into(), field("ids", "nested.parquet", "ids")],
            vec![
                path("nested.parquet"),
                "column 'ids'".into(),
                "lists of lists".into(),
            ],
        ),
        (
            vec![path("nested.parquet")],
            vec![
                "column 'ids'".into(),
                "lists of lists".into(),
                "--field".into(),
            ],
        ),
        (
            vec![path("nulls.parquet")],
            vec![path("nulls.parquet"), "column 'label', row 13: null".into()],
        ),
        (
            vec![path("inner-null.parquet")],
            vec![
                path("inner-null.parquet"),
                "column 'emb', row 40: null".into(),
            ],
        ),
        (
            vec![path("a.parquet"), path("other.parquet")],
            vec![
                path("other.parquet"),
                "column 'label' is int32 here but int64".into(),
            ],
        ),
        (
            vec![
                "--field".into(),
                field("l", "a.parquet", "label"),
                "--field".into(),
                field("l", "other.parquet", "label"),
            ],
            vec![
                path("other.parquet"),
                "column 'label'".into(),
                "field 'l'".into(),
            ],
        ),
        (
            vec!["--field".into(), field("l", "a.parquet", "nope")],
            vec![path("a.parquet"), "no column 'nope'".into(), "label".into()],
        ),
        (
            vec![path("cut.parquet")],
            vec![path("cut.parquet"), "Parquet".into()],
        ),
        (
            vec![path("cut.arrow")],
            vec![path("cut.arrow"), "footer".into()],
        ),
        (
            vec!["--field".into(), field("l", "cut-stream.arrow", "label")],
            vec![path("cut-stream.arrow"), "truncated".into()],
        ),
    ];
    for (index, (args, needles)) in cases.into_iter().enumerate() {
        let dataset = tmp.path().join(format!("refused-{index}"));
        let mut pack = gpufeed("pack");
        pack.arg("--out").arg(&dataset).args(&args);
        let stderr = run_failing(pack);
        for needle in &needles {
            assert!(
                stderr.contains(needle.as_str()),
                "{args:?}: {stderr:?} lacks {needle:?}"
            );
        }
        assert!(
            !dataset.exists(),
            "{args:?}: a refused pack wrote {}",
            dataset.display()
        );
    }
}
