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

/// The crates whose sources the no-cycles rule covers (their `src` directories).
const CRATE_SOURCES: &[&str] = &["src", "client/src", "proto/src", "ffi/src"];

/// The module path of a source file of a crate rooted at `src`: `a/b.rs` and `a/b/mod.rs` are
/// `["a", "b"]`; the crate roots `lib.rs` and `main.rs` are `[]`.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main")
        || parts.last().unwrap() == "mod"
    {
        parts.pop();
    }
    parts
}

/// The code of a file outside its tests, comments left out: a `#[cfg(test)]` item of one line
/// (`mod tests;`) is skipped, a `#[cfg(test)]` block ends the code (tests come last in a file).
fn code_outside_tests(path: &Path) -> String {
    let lines = code_lines(path);
    let mut code = String::new();
    let mut index = 0;
    while index < lines.len() {
        let line = lines[index].1.trim();
        if line == "#[cfg(test)]" {
            let next = lines.get(index + 1).map_or("", |(_, l)| l.trim());
            if !next.ends_with(';') {
                break;
            }
            index += 2;
            continue;
        }
        code.push_str(line);
        code.push('\n');
        index += 1;
    }
    code
}

/// The paths a `use` tree names, each with the name it binds (`a::{b, c::d as e}` gives `a::b`
/// bound as `b` and `a::c::d` bound as `e`; a glob binds `*`).
fn expand_use_tree(tree: &str) -> Vec<(Vec<String>, String)> {
    let tree: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let tree = tree
        .replace(" :: ", "::")
        .replace(":: ", "::")
        .replace(" ::", "::");
    let mut found = Vec::new();
    expand_into(&[], tree.trim(), &mut found);
    found
}

fn expand_into(prefix: &[String], tree: &str, found: &mut Vec<(Vec<String>, String)>) {
    let tree = tree.trim();
    if let Some(inner) = tree.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
        let mut depth = 0;
        let mut start = 0;
        for (at, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_into(prefix, &inner[start..at], found);
                    start = at + 1;
                }
                _ => {}
            }
        }
        expand_into(prefix, &inner[start..], found);
        return;
    }
    if let Some(at) = tree.find("::{") {
        let mut path = prefix.to_vec();
        path.extend(tree[..at].split("::").map(str::to_string));
        expand_into(&path, &tree[at + 2..], found);
        return;
    }
    if tree.is_empty() {
        return;
    }
    let (path, bound) = match tree.split_once(" as ") {
        Some((path, alias)) => (path, alias.trim().to_string()),
        None => (tree, tree.rsplit("::").next().unwrap_or(tree).to_string()),
    };
    let mut full = prefix.to_vec();
    full.extend(
        path.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string),
    );
    if !full.is_empty() {
        found.push((full, bound));
    }
}

/// One path a file names: its segments, and whether it is a `pub use` (a re-export, which makes the
/// module a door to the item but does not make its code depend on it).
struct NamedPath {
    segments: Vec<String>,
    bound: String,
    reexport: bool,
}

/// The paths the code names: every `use` (its tree expanded), and outside them every path that
/// starts with `crate::`, `super::`, `self::` or one of `children` (the file's child modules).
fn named_paths(code: &str, children: &[String]) -> Vec<NamedPath> {
    let mut found = Vec::new();
    let mut rest_of_code = String::new();
    let mut rest = code;
    while let Some(at) = find_use(rest) {
        rest_of_code.push_str(&rest[..at.0]);
        let end = rest[at.1..].find(';').map_or(rest.len(), |e| at.1 + e);
        let reexport = rest[at.0..at.1].starts_with("pub");
        for (segments, bound) in expand_use_tree(&rest[at.1..end]) {
            found.push(NamedPath {
                segments,
                bound,
                reexport,
            });
        }
        rest = &rest[(end + 1).min(rest.len())..];
    }
    rest_of_code.push_str(rest);
    // A name a file re-exports and also uses in its own code is a dependency of that code.
    let used_reexports: Vec<NamedPath> = found
        .iter()
        .filter(|p| p.reexport && p.bound != "*" && names_word(&rest_of_code, &p.bound))
        .map(|p| NamedPath {
            segments: p.segments.clone(),
            bound: p.bound.clone(),
            reexport: false,
        })
        .collect();
    found.extend(used_reexports);
    let starts: Vec<&str> = ["crate", "super", "self"]
        .into_iter()
        .chain(children.iter().map(String::as_str))
        .collect();
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    for start in starts {
        let needle = format!("{start}::");
        for (at, _) in rest_of_code.match_indices(&needle) {
            let before = rest_of_code[..at].chars().next_back();
            if before.is_some_and(|c| is_ident(c) || c == ':') {
                continue;
            }
            let path: String = rest_of_code[at..]
                .chars()
                .take_while(|&c| is_ident(c) || c == ':')
                .collect();
            let segments: Vec<String> = path
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            found.push(NamedPath {
                bound: segments.last().cloned().unwrap_or_default(),
                segments,
                reexport: false,
            });
        }
    }
    found
}

/// Whether `code` names `word` on its own (not as part of a longer name or path).
fn names_word(code: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(word).any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + word.len()..].chars().next();
        !before.is_some_and(|c| is_ident(c) || c == ':') && !after.is_some_and(is_ident)
    })
}

/// Where the next `use` declaration in `code` starts (its visibility included) and where its tree
/// starts.
fn find_use(code: &str) -> Option<(usize, usize)> {
    let mut from = 0;
    while let Some(found) = code[from..].find("use ") {
        let at = from + found;
        let line_start = code[..at].rfind('\n').map_or(0, |n| n + 1);
        let before = code[line_start..at].trim();
        let visibility = before.is_empty() || before.starts_with("pub");
        if visibility && (before.is_empty() || before.ends_with(')') || before == "pub") {
            let start = if before.is_empty() { at } else { line_start };
            return Some((start, at + 4));
        }
        from = at + 4;
    }
    None
}

/// A crate's modules and the paths each names, resolved to the modules they reach.
struct ModuleGraph {
    /// (module from, module to) -> the (file, path) that name `to` from `from`.
    edges: std::collections::BTreeMap<(Vec<String>, Vec<String>), Vec<String>>,
}

impl ModuleGraph {
    /// Reads the crate rooted at `src` (`repository` names its files in messages).
    fn read(src: &Path, repository: &Path) -> ModuleGraph {
        use std::collections::{BTreeMap, BTreeSet};
        let files: Vec<(PathBuf, Vec<String>)> = rust_files(src)
            .into_iter()
            .map(|f| {
                let module = module_path(src, &f);
                (f, module)
            })
            .collect();
        let mut children: BTreeMap<Vec<String>, BTreeSet<String>> = BTreeMap::new();
        for (_, module) in &files {
            if let Some((last, parent)) = module.split_last() {
                children
                    .entry(parent.to_vec())
                    .or_default()
                    .insert(last.clone());
            }
        }
        let children_of = |module: &[String]| -> Vec<String> {
            children
                .get(module)
                .map(|c| c.iter().cloned().collect())
                .unwrap_or_default()
        };
        let named: Vec<(String, Vec<String>, Vec<NamedPath>)> = files
            .iter()
            .map(|(file, module)| {
                let relative = file.strip_prefix(repository).unwrap_or(file);
                (
                    relative.display().to_string(),
                    module.clone(),
                    named_paths(&code_outside_tests(file), &children_of(module)),
                )
            })
            .collect();
        // Re-exports: a module's name for an item of one of its descendants leads to that
        // descendant (`super::Thing` re-exported by `mod.rs` from `thing.rs` reaches `thing.rs`).
        let mut reexports: BTreeMap<(Vec<String>, String), Vec<String>> = BTreeMap::new();
        let no_reexports = BTreeMap::new();
        for (_, module, paths) in &named {
            for path in paths.iter().filter(|p| p.reexport) {
                let (_, parents) = path.segments.split_last().expect("a path");
                if let Some(target) = resolve(module, parents, &children, &no_reexports) {
                    if target.len() > module.len() && target.starts_with(module) {
                        reexports.insert((module.clone(), path.bound.clone()), target);
                    }
                }
            }
        }
        let mut edges: BTreeMap<(Vec<String>, Vec<String>), Vec<String>> = BTreeMap::new();
        for (file, module, paths) in &named {
            for path in paths.iter().filter(|p| !p.reexport) {
                let Some(target) = resolve(module, &path.segments, &children, &reexports) else {
                    continue;
                };
                if target != *module {
                    edges
                        .entry((module.clone(), target))
                        .or_default()
                        .push(format!("{file} names {}", path.segments.join("::")));
                }
            }
        }
        ModuleGraph { edges }
    }

    /// Every pair of modules that import each other, as lines of text: two children of one
    /// module (a file or directory and all it holds), or a module's own file (`mod.rs`, `lib.rs`)
    /// and one of its children.
    fn mutual_imports(&self) -> Vec<String> {
        use std::collections::BTreeMap;
        let own = |module: &[String]| {
            let mut m = module.to_vec();
            m.push("(own file)".into());
            m
        };
        let mut lifted: BTreeMap<(Vec<String>, Vec<String>), &Vec<String>> = BTreeMap::new();
        for ((from, to), why) in &self.edges {
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            let pair = if common < from.len() && common < to.len() {
                (from[..=common].to_vec(), to[..=common].to_vec())
            } else if common == to.len() {
                (from[..=common].to_vec(), own(to))
            } else {
                (own(from), to[..=common].to_vec())
            };
            lifted.entry(pair).or_insert(why);
        }
        lifted
            .iter()
            .filter(|((a, b), _)| a < b && lifted.contains_key(&(b.clone(), a.clone())))
            .map(|((a, b), why)| {
                let back = lifted[&(b.clone(), a.clone())];
                format!(
                    "{} <-> {} ({}; {})",
                    a.join("::"),
                    b.join("::"),
                    why[0],
                    back[0]
                )
            })
            .collect()
    }
}

/// The module a path named in `module` reaches: the deepest module along it, or the descendant an
/// item it names is re-exported from. `None` for a path into another crate or the standard library.
fn resolve(
    module: &[String],
    segments: &[String],
    children: &std::collections::BTreeMap<Vec<String>, std::collections::BTreeSet<String>>,
    reexports: &std::collections::BTreeMap<(Vec<String>, String), Vec<String>>,
) -> Option<Vec<String>> {
    let mut current = module.to_vec();
    let mut rest = segments;
    match segments.first()?.as_str() {
        "crate" => {
            current.clear();
            rest = &rest[1..];
        }
        "self" => rest = &rest[1..],
        "super" => {
            while rest.first().is_some_and(|s| s == "super") {
                current.pop()?;
                rest = &rest[1..];
            }
        }
        first if children.get(module).is_some_and(|c| c.contains(first)) => {}
        _ => return None,
    }
    while let Some(next) = rest.first() {
        if !children.get(&current).is_some_and(|c| c.contains(next)) {
            if let Some(target) = reexports.get(&(current.clone(), next.clone())) {
                return Some(target.clone());
            }
            break;
        }
        current.push(next.clone());
        rest = &rest[1..];
    }
    Some(current)
}

/// The pairs of modules of the crate rooted at `src` that import each other.
fn module_cycles(src: &Path) -> Vec<String> {
    ModuleGraph::read(src, &root()).mutual_imports()
}

/// No two modules import each other: each pair of children of a module has one direction, and a
/// module's own file (`mod.rs`, `lib.rs`) and a child are not imported both ways, so that a file can
/// be read (and changed) knowing only what it imports. A child module counts with everything it
/// holds; a `pub use` re-export is the module's door, not a dependency of its code unless that code
/// uses the name, and a name re-exported from a child leads to that child. Checked on every `use` tree and every `crate::`,
/// `super::`, `self::` and child-module path outside tests, in every crate of the workspace.
#[test]
fn no_two_modules_import_each_other() {
    let cycles: Vec<String> = CRATE_SOURCES
        .iter()
        .flat_map(|src| module_cycles(&root().join(src)))
        .collect();
    let pair = |cycle: &str| cycle.split(" (").next().unwrap_or(cycle).to_string();
    let allowed = |cycle: &String| CYCLES_ALLOWED.iter().any(|(p, _)| *p == pair(cycle));
    assert_none(
        "no two modules import each other",
        cycles.iter().filter(|c| !allowed(c)).cloned().collect(),
    );
    for (allowed_pair, _) in CYCLES_ALLOWED {
        assert!(
            cycles.iter().any(|c| pair(c) == *allowed_pair),
            "{allowed_pair} no longer import each other: take the pair off CYCLES_ALLOWED"
        );
    }
}

/// Module pairs that still import each other, with the reason; each must still be a cycle, so the
/// list only shrinks.
const CYCLES_ALLOWED: &[(&str, &str)] = &[(
    "device::(own file) <-> device::module",
    "`Device` holds the in-memory module cache that `module.rs` fills and `module.rs` builds on \
     `Device`; the cache leaves `Device` when the device layer is next reorganised",
)];

/// The cycle check sees what the sibling-only check it replaced missed: a `mod.rs` and its child
/// importing each other (one through a `use` group, the other through a path in the code), and two
/// sibling modules of which one is a directory; it follows a re-export to the child that defines the
/// item, and counts the re-export only where the parent's own code uses the name.
#[test]
fn the_cycle_check_sees_parents_children_and_directories() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |path: &str, text: &str| {
        let path = src.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    };
    write("lib.rs", "mod a;\nmod b;\nmod c;\n");
    write(
        "a/mod.rs",
        "mod child;\npub use child::Thing;\npub struct Shared;\nfn f() { child::run(); }\n",
    );
    write(
        "a/child.rs",
        "use super::{Shared, Thing as T};\npub fn run() {}\n",
    );
    write("b/mod.rs", "mod inner;\n");
    write("b/inner.rs", "fn f() -> crate::c::C { todo!() }\n");
    write(
        "c.rs",
        "pub struct C;\n#[cfg(test)]\nmod tests;\nuse crate::b::{self as bee};\n",
    );
    let mut cycles = module_cycles(src);
    for cycle in &mut cycles {
        *cycle = cycle.split(" (").next().unwrap().to_string();
    }
    assert_eq!(
        cycles,
        vec![
            "a::(own file) <-> a::child".to_string(),
            "b <-> c".to_string()
        ]
    );
    // A re-export the parent's own code does not use is no dependency of it.
    write(
        "a/mod.rs",
        "mod child;\npub use child::Thing;\npub struct Shared;\n",
    );
    write("c.rs", "pub struct C;\n");
    assert_eq!(module_cycles(src), Vec::<String>::new());
    // A re-export the parent's code uses is one.
    write(
        "a/mod.rs",
        "mod child;\npub use child::Thing;\npub struct Shared;\nfn f() -> Thing { todo!() }\n",
    );
    assert_eq!(module_cycles(src).len(), 1);
    // The child naming only its own item through the parent's re-export is no cycle.
    write("a/child.rs", "use super::Thing;\n");
    assert_eq!(module_cycles(src), Vec::<String>::new());
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
