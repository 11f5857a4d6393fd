//! Tidy: the structural rules of `docs/ARCHITECTURE.md` ("Rules the code keeps"), checked on the
//! sources, so that a change which breaks one fails CI instead of quietly eroding the layout.
//!
//! Two rules are clippy lints, configured for the whole workspace and run by CI with `-D warnings`:
//! every `unsafe` block carries a `SAFETY:` comment (`clippy::undocumented_unsafe_blocks`), and no
//! function outside tests is longer than the limit in `clippy.toml` (`clippy::too_many_lines`). This
//! test checks that those lints stay switched on. The import rules are plain text checks on `use`
//! paths and crate names, which is all they need.

use std::path::{Path, PathBuf};

/// The repository root (the daemon crate's manifest directory).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The code of a source file without its comments, line by line (string contents are kept: the
/// rules look for paths, which comments mention freely but strings rarely do).
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = Vec::new();
    let mut in_block_comment = false;
    for (number, line) in text.lines().enumerate() {
        let mut code = String::new();
        let mut rest = line;
        loop {
            if in_block_comment {
                match rest.find("*/") {
                    Some(end) => {
                        in_block_comment = false;
                        rest = &rest[end + 2..];
                    }
                    None => break,
                }
            } else {
                let line_comment = rest.find("//");
                let block_comment = rest.find("/*");
                match (line_comment, block_comment) {
                    (Some(l), Some(b)) if b < l => {
                        code.push_str(&rest[..b]);
                        in_block_comment = true;
                        rest = &rest[b + 2..];
                    }
                    (Some(l), _) => {
                        code.push_str(&rest[..l]);
                        break;
                    }
                    (None, Some(b)) => {
                        code.push_str(&rest[..b]);
                        in_block_comment = true;
                        rest = &rest[b + 2..];
                    }
                    (None, None) => {
                        code.push_str(rest);
                        break;
                    }
                }
            }
        }
        lines.push((number + 1, code));
    }
    lines
}

/// `path:line: code` for every code line of the files under `dirs` containing one of `needles`,
/// except in the files `allowed` (paths relative to the root).
fn offenders(dirs: &[&str], needles: &[&str], allowed: &[&str]) -> Vec<String> {
    let root = root();
    let mut found = Vec::new();
    for dir in dirs {
        for file in rust_files(&root.join(dir)) {
            let relative = file.strip_prefix(&root).expect("under the root");
            let relative = relative.to_string_lossy().replace('\\', "/");
            if allowed
                .iter()
                .any(|a| relative == *a || relative.starts_with(&format!("{a}/")))
            {
                continue;
            }
            for (number, code) in code_lines(&file) {
                if needles.iter().any(|n| code.contains(n)) {
                    found.push(format!("{relative}:{number}: {}", code.trim()));
                }
            }
        }
    }
    found
}

fn assert_none(rule: &str, found: Vec<String>) {
    assert!(
        found.is_empty(),
        "ARCHITECTURE.md rule broken: {rule}\n{}",
        found.join("\n")
    );
}

/// Rule "Layers": `format`, `decode` and `kernels` sit below the pipeline and the servers; they import
/// nothing from `ipc`, `api` or `pipeline`, nor the consumer crate (wire types come from
/// `gpufeed-proto`).
#[test]
fn lower_layers_import_nothing_from_upper_ones() {
    assert_none(
        "format, decode and kernels import nothing from ipc, api, pipeline or gpufeed_client",
        offenders(
            &["src/format", "src/decode", "src/kernels"],
            &[
                "crate::ipc",
                "crate::api",
                "crate::pipeline",
                "gpufeed_client",
            ],
            &[],
        ),
    );
}

/// Rule "Wire types": nothing under `pipeline` speaks the wire protocol; `ipc` converts requests.
#[test]
fn the_pipeline_speaks_no_wire_protocol() {
    assert_none(
        "pipeline imports no wire types (gpufeed_proto::protocol, gpufeed_client)",
        offenders(
            &["src/pipeline"],
            &["gpufeed_proto::protocol", "gpufeed_client", "crate::ipc"],
            &[],
        ),
    );
}

/// Rule "CUDA": every CUDA driver, NVRTC and cuFile call goes through `src/device` (the daemon) or
/// the client's CUDA module; nothing else names cudarc.
#[test]
fn only_the_device_layers_name_cudarc() {
    assert_none(
        "only src/device and client/src/cuda.rs name cudarc",
        offenders(
            &["src", "client/src", "proto/src"],
            &["cudarc"],
            &["src/device", "client/src/cuda.rs"],
        ),
    );
}

/// Rule "Errors": library code returns typed errors; `anyhow` is for the binary's edge only.
#[test]
fn anyhow_only_in_main() {
    assert_none(
        "anyhow only in src/main.rs",
        offenders(
            &["src", "client/src", "proto/src"],
            &["anyhow"],
            &["src/main.rs"],
        ),
    );
}

/// Rule "Proto stays light": the wire crate has no CUDA and no memory maps, so any consumer can link
/// it.
#[test]
fn the_proto_crate_stays_light() {
    let manifest =
        std::fs::read_to_string(root().join("proto/Cargo.toml")).expect("proto/Cargo.toml");
    for heavy in ["cudarc", "memmap2", "tokio", "axum"] {
        assert!(
            !manifest.contains(heavy),
            "ARCHITECTURE.md rule broken: gpufeed-proto depends on {heavy}"
        );
    }
}

/// Rules "Unsafe" and "Function length" are clippy lints: check that they stay on for the workspace,
/// and that the length limit is the one ARCHITECTURE.md states.
#[test]
fn the_clippy_rules_stay_switched_on() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let lints = manifest
        .split("[workspace.lints.clippy]")
        .nth(1)
        .expect("Cargo.toml has a [workspace.lints.clippy] table");
    let lints = lints.split("\n[").next().unwrap_or(lints);
    for lint in ["undocumented_unsafe_blocks", "too_many_lines"] {
        assert!(
            lints
                .lines()
                .any(|l| l.trim_start().starts_with(lint) && l.contains("\"deny\"")),
            "ARCHITECTURE.md rule broken: clippy::{lint} is not denied in [workspace.lints.clippy]"
        );
    }
    let clippy = std::fs::read_to_string(root().join("clippy.toml")).expect("clippy.toml");
    assert!(
        clippy
            .lines()
            .any(|l| l.replace(' ', "") == format!("too-many-lines-threshold={FUNCTION_LINES_MAX}")),
        "clippy.toml must set too-many-lines-threshold = {FUNCTION_LINES_MAX} (ARCHITECTURE.md)"
    );
    for krate in [".", "client", "proto"] {
        let path = root().join(krate).join("Cargo.toml");
        let text = std::fs::read_to_string(&path).expect("a crate manifest");
        let inherits = text
            .split("[lints]")
            .nth(1)
            .is_some_and(|t| t.trim_start().starts_with("workspace = true"));
        assert!(
            inherits,
            "{}: [lints] workspace = true is missing",
            path.display()
        );
    }
}

/// The function length limit, in lines of code (clippy counts neither blank lines nor comments).
const FUNCTION_LINES_MAX: usize = 100;
