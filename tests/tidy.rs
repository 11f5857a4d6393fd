//! Tidy: the structural rules of `docs/ARCHITECTURE.md` ("Rules the code keeps"), checked on the
//! sources, so that a change which breaks one fails CI instead of quietly eroding the layout.
//!
//! One rule is a clippy lint, configured for the whole workspace and run by CI with `-D warnings`:
//! every `unsafe` block carries a `SAFETY:` comment (`clippy::undocumented_unsafe_blocks`); this test
//! checks that the lint stays switched on. The import rules are plain text checks on the code (comments
//! left out) for paths and crate names, which is all they need.

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

/// Rule "Layers": `format`, `decode` and `kernels` sit below the pipeline and the servers and import
/// nothing from `ipc`, `api` or `pipeline`.
#[test]
fn lower_layers_import_nothing_from_upper_ones() {
    assert_none(
        "format, decode and kernels import nothing from ipc, api or pipeline",
        offenders(
            &["src/format", "src/decode", "src/kernels"],
            &["crate::ipc", "crate::api", "crate::pipeline"],
            &[],
        ),
    );
}

/// Rule "CUDA": every CUDA driver, NVRTC and cuFile call of the daemon goes through `src/device`, and
/// the client's through its CUDA module; nothing else names cudarc.
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

/// The `members` of the root manifest's `[workspace]` table.
fn workspace_members(manifest: &str) -> Vec<String> {
    let list = manifest
        .split("\nmembers = [")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("Cargo.toml lists the workspace members");
    let members: Vec<String> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect();
    assert!(members.len() >= 3, "members parsed as {members:?}");
    members
}

/// Rule "Proto": the wire types live in `gpufeed-proto`, which names neither CUDA nor memory
/// mapping; the daemon takes them from there, and only its consumers (`gpufeed demo`, `gpufeed
/// consume`) use the client crate.
#[test]
fn the_daemon_builds_on_the_proto_crate() {
    assert_none(
        "only src/demo.rs and src/consume.rs (consumers) import the client crate",
        offenders(
            &["src"],
            &["gpufeed_client"],
            &["src/demo.rs", "src/consume.rs"],
        ),
    );
    assert_none(
        "gpufeed-proto names neither cudarc nor memmap2",
        offenders(&["proto/src"], &["cudarc", "memmap2"], &[]),
    );
    let manifest =
        std::fs::read_to_string(root().join("proto/Cargo.toml")).expect("proto manifest");
    let dependencies = manifest.split("[dependencies]").nth(1).unwrap_or("");
    for forbidden in ["cudarc", "memmap2", "gpufeed-client"] {
        assert!(
            !dependencies.contains(forbidden),
            "ARCHITECTURE.md rule broken: proto/Cargo.toml depends on {forbidden}"
        );
    }
}

/// Rule "Pipeline": the pipeline has its own request type; the wire protocol and the framing are
/// converted in `ipc`, so `pipeline` names neither (element types and the spec rules it shares with
/// the client are not wire formats).
#[test]
fn the_pipeline_imports_no_wire_types() {
    assert_none(
        "pipeline imports no wire protocol or transport",
        offenders(
            &["src/pipeline"],
            &["gpufeed_proto::protocol", "gpufeed_proto::transport"],
            &[],
        ),
    );
}

/// Rule "Length": no function outside tests is longer than this many lines, so that a function stays
/// one idea a reader can hold (the renovation split a 333-line `queue_round` into one function per
/// phase). The exceptions are listed with their reason; each must still be over the limit, so the
/// list only shrinks.
const FUNCTION_LINES_MAX: usize = 150;

/// Functions allowed over [`FUNCTION_LINES_MAX`]: (file, function, why).
const LONG_FUNCTIONS: &[(&str, &str, &str)] = &[
    (
        "proto/src/protocol.rs",
        "decode",
        "one flat arm per message kind",
    ),
    (
        "src/metrics.rs",
        "render",
        "one flat block per metric family",
    ),
];

/// (file, function, lines) of every function in the non-test code of `dirs`. A function runs from
/// its `fn` line to the first later line that closes it at the same indentation, which rustfmt's
/// layout makes exact.
fn function_lengths(dirs: &[&str]) -> Vec<(String, String, usize)> {
    let root = root();
    let mut found = Vec::new();
    for dir in dirs {
        for file in rust_files(&root.join(dir)) {
            let relative = file.strip_prefix(&root).expect("under the root");
            let relative = relative.to_string_lossy().replace('\\', "/");
            let text = std::fs::read_to_string(&file).expect("a source file");
            let lines: Vec<&str> = text.lines().collect();
            let end = lines
                .windows(2)
                .position(|w| w[0].starts_with("#[cfg(test)]") && w[1].starts_with("mod tests"))
                .unwrap_or(lines.len());
            for (start, line) in lines[..end].iter().enumerate() {
                let indent = line.len() - line.trim_start().len();
                let Some(name) = function_name(line.trim_start()) else {
                    continue;
                };
                let close = format!("{}}}", &line[..indent]);
                if let Some(length) = lines[start + 1..end].iter().position(|l| *l == close) {
                    found.push((relative.clone(), name, length + 2));
                }
            }
        }
    }
    found
}

/// The name of the function a line starts, if it starts one with a body.
fn function_name(line: &str) -> Option<String> {
    let mut rest = line;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    if line.trim_end().ends_with(';') {
        return None;
    }
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

#[test]
fn no_function_is_longer_than_the_limit() {
    let lengths = function_lengths(&["src", "client/src", "proto/src"]);
    assert!(
        lengths.len() > 500,
        "only {} functions found",
        lengths.len()
    );
    let excepted = |file: &str, name: &str| {
        LONG_FUNCTIONS
            .iter()
            .any(|(f, n, _)| *f == file && *n == name)
    };
    let too_long: Vec<String> = lengths
        .iter()
        .filter(|(file, name, lines)| *lines > FUNCTION_LINES_MAX && !excepted(file, name))
        .map(|(file, name, lines)| format!("{file}: fn {name} is {lines} lines"))
        .collect();
    assert_none(
        &format!("no function over {FUNCTION_LINES_MAX} lines outside tests"),
        too_long,
    );
    for (file, name, _) in LONG_FUNCTIONS {
        let still_long = lengths
            .iter()
            .any(|(f, n, lines)| f == file && n == name && *lines > FUNCTION_LINES_MAX);
        assert!(
            still_long,
            "{file}: fn {name} is no longer over {FUNCTION_LINES_MAX} lines (or is gone): \
             take it off LONG_FUNCTIONS"
        );
    }
}

/// Rule "Errors": library code returns typed errors; `anyhow` is for the binary's edge only.
#[test]
fn anyhow_only_in_main() {
    assert_none(
        "anyhow only in the binary: src/main.rs and its module src/consume.rs",
        offenders(
            &["src", "client/src", "proto/src", "ffi/src"],
            &["anyhow"],
            &["src/main.rs", "src/consume.rs"],
        ),
    );
}

/// Rule "Unsafe": every `unsafe` block says why it is sound (`// SAFETY:`), which clippy checks for
/// the whole workspace: the lint must stay denied there and every crate must inherit it.
#[test]
fn the_unsafe_rule_stays_switched_on() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let lints = manifest
        .split("[workspace.lints.clippy]")
        .nth(1)
        .expect("Cargo.toml has a [workspace.lints.clippy] table");
    let lints = lints.split("\n[").next().unwrap_or(lints);
    assert!(
        lints.lines().any(|l| {
            l.trim_start().starts_with("undocumented_unsafe_blocks") && l.contains("\"deny\"")
        }),
        "ARCHITECTURE.md rule broken: clippy::undocumented_unsafe_blocks is not denied"
    );
    for krate in workspace_members(&manifest) {
        let path = root().join(&krate).join("Cargo.toml");
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

/// The attribute lines (`#[...]`) directly above the line `item` of the file `path` (relative to the
/// root), comment lines skipped.
fn attributes_above(path: &str, item: &str) -> Vec<String> {
    let lines = code_lines(&root().join(path));
    let index = lines
        .iter()
        .position(|(_, code)| code.trim() == item)
        .unwrap_or_else(|| panic!("{path}: no line `{item}`"));
    lines[..index]
        .iter()
        .rev()
        .map(|(_, code)| code.trim())
        .filter(|code| !code.is_empty())
        .take_while(|code| code.starts_with("#["))
        .map(str::to_string)
        .collect()
}

/// Rule "Test support": the modules kept public only for tests, benchmarks and the demo are out of
/// the documentation, each marked once.
#[test]
fn test_support_is_hidden_from_the_documentation() {
    for (path, item) in [
        ("src/lib.rs", "pub mod synth;"),
        ("src/storage/mod.rs", "pub mod fault;"),
        ("src/kernels/mod.rs", "pub mod reference;"),
    ] {
        let attributes = attributes_above(path, item);
        let hidden = attributes.iter().filter(|a| *a == "#[doc(hidden)]").count();
        assert_eq!(
            hidden, 1,
            "ARCHITECTURE.md rule broken: test support is #[doc(hidden)], once: {path}: `{item}` \
             has {attributes:?}"
        );
    }
}

/// The sibling modules (files or directories beside it) that the non-test code of the file `path`
/// (not a `mod.rs`) names, as `super::NAME` or by its full `crate::` path.
fn sibling_imports(path: &Path, src: &Path) -> Vec<String> {
    let dir = path.parent().expect("a file has a directory");
    let own = path.file_stem().unwrap_or_default().to_string_lossy();
    let module = dir
        .strip_prefix(src)
        .expect("under src")
        .to_string_lossy()
        .replace(['/', '\\'], "::");
    let siblings: Vec<String> = std::fs::read_dir(dir)
        .expect("a source directory")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.is_dir() || p.extension().is_some_and(|e| e == "rs"))
        .map(|p| {
            p.file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| name != "mod" && *name != own)
        .collect();
    let code: Vec<String> = code_lines(path)
        .into_iter()
        .map(|(_, code)| code)
        .take_while(|code| code.trim() != "#[cfg(test)]")
        .collect();
    let names = |prefix: &str, sibling: &str| {
        let needle = format!("{prefix}{sibling}");
        code.iter().any(|line| {
            line.match_indices(&needle).any(|(at, _)| {
                let after = line[at + needle.len()..].chars().next();
                !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
        })
    };
    siblings
        .into_iter()
        .filter(|sibling| {
            names("super::", sibling)
                || (!module.is_empty() && names(&format!("crate::{module}::"), sibling))
        })
        .collect()
}

/// No two files of a module import each other: each pair of siblings has one direction, so that a
/// file can be read (and changed) knowing only what it imports. Checked on `super::` and `crate::`
/// paths between files of the daemon's `src`.
#[test]
fn no_two_sibling_files_import_each_other() {
    let src = root().join("src");
    let mut edges = std::collections::BTreeSet::new();
    for file in rust_files(&src) {
        if file
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs" || n == "main.rs")
        {
            continue;
        }
        let stem = file
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let dir = file.parent().expect("a directory").to_path_buf();
        for sibling in sibling_imports(&file, &src) {
            edges.insert((dir.join(&stem), dir.join(sibling)));
        }
    }
    let cycles: Vec<String> = edges
        .iter()
        .filter(|(a, b)| a < b && edges.contains(&(b.clone(), a.clone())))
        .map(|(a, b)| {
            let relative = |p: &PathBuf| p.strip_prefix(root()).unwrap().display().to_string();
            format!("{} <-> {}", relative(a), relative(b))
        })
        .collect();
    assert_none("no two sibling files import each other", cycles);
}

/// Every file and directory of the repository (directories with a trailing `/`), relative to the
/// root, build outputs and hidden directories left out.
fn repository_paths() -> Vec<String> {
    let root = root();
    let mut found = Vec::new();
    let mut pending = vec![root.clone()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            let relative = path.strip_prefix(&root).expect("under the root");
            let relative = relative.to_string_lossy().replace('\\', "/");
            if path.is_dir() {
                found.push(format!("{relative}/"));
                pending.push(path);
            } else {
                found.push(relative);
            }
        }
    }
    found
}

/// ARCHITECTURE.md is the document the rules above cite: each rule (a `- **Name**:` bullet) is
/// stated once in it, and every file or directory it names in backticks exists (relative to the
/// root or, as the code map writes them, to the module described).
#[test]
fn architecture_md_states_each_rule_once_and_names_real_paths() {
    let text =
        std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut names: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("- **"))
        .filter_map(|rest| rest.split_once("**").map(|(name, _)| name))
        .collect();
    names.sort_unstable();
    let mut repeated: Vec<&str> = names
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    repeated.dedup();
    assert!(
        repeated.is_empty(),
        "ARCHITECTURE.md states these rules more than once: {repeated:?}"
    );
    let paths = repository_paths();
    let named = text
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|token| !token.contains(['*', ' ', ':']) && token.len() > 1)
        .filter(|token| {
            token.ends_with('/')
                || [".rs", ".md", ".toml", ".cu", ".h", ".sh", ".py"]
                    .iter()
                    .any(|extension| token.ends_with(extension))
        });
    let missing: Vec<&str> = named
        .filter(|token| {
            !paths
                .iter()
                .any(|path| path == token || path.ends_with(&format!("/{token}")))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
}

/// The checks find what they look for: a planted offender in a scratch file is reported, with its
/// line, and the same text in a comment is not.
#[test]
fn the_checks_see_code_and_skip_comments() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("planted.rs");
    std::fs::write(
        &file,
        "// crate::ipc in a comment\nuse crate::ipc::Server; /* crate::api */\n",
    )
    .unwrap();
    let lines = code_lines(&file);
    let hits: Vec<usize> = lines
        .iter()
        .filter(|(_, code)| code.contains("crate::ipc") || code.contains("crate::api"))
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(hits, vec![2]);
}
