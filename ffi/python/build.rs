//! With the `daemon` feature (pyproject.toml turns it on for every wheel maturin builds; `cargo
//! clippy` here leaves it off), builds the `gpufeed` binary of the root crate, the daemon and its
//! tools, from the same source tree as this extension, and copies it to `$OUT_DIR/gpufeed`, from
//! where maturin puts it into the wheel as `gpufeed/_bin/gpufeed` (pyproject.toml's `include`). The
//! package's `gpufeed` console script execs it (python/gpufeed/_cli.py), so one wheel installs the
//! Python package and the daemon, and a machine that installs it needs no Rust toolchain.
//!
//! The binary is built by cargo itself, not copied from wherever one was built before, so it is
//! never stale: the nested `cargo build` decides what is out of date, and this script reruns when
//! any source file of the last build changed (the dep-info file cargo writes beside the binary).
//! The daemon is built in the profile the extension is: release for `pip wheel`/`pip install` and
//! `maturin build --release` (the one to ship), dev for `maturin develop`, which then reuses the
//! debug build of `cargo test`. `GPUFEED_DAEMON_PROFILE=release|dev` overrides that.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=GPUFEED_DAEMON_PROFILE");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    if env::var_os("CARGO_FEATURE_DAEMON").is_none() {
        return;
    }
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    let root = manifest_dir.join("../..");
    let root_manifest = root.join("Cargo.toml");
    if !root.join("src/main.rs").is_file() || !root_manifest.is_file() {
        panic!(
            "the `daemon` feature builds the gpufeed daemon from the repository this crate sits in, \
             but {} has no Cargo.toml and src/main.rs: build the wheel from a gpufeed checkout \
             (`pip wheel ./ffi/python`), not from an sdist, which carries the extension only",
            root.display()
        );
    }

    // Canonical, as the paths of cargo's dep-info are.
    let root = root
        .canonicalize()
        .unwrap_or_else(|err| panic!("resolving {}: {err}", root.display()));
    let root_manifest = root.join("Cargo.toml");

    let profile = env::var("GPUFEED_DAEMON_PROFILE")
        .unwrap_or_else(|_| env::var("PROFILE").expect("set by cargo"));
    let profile_dir = match profile.as_str() {
        "release" => "release",
        "dev" | "debug" => "debug",
        other => panic!("GPUFEED_DAEMON_PROFILE={other:?}: expected `release` or `dev`"),
    };
    // The root crate's own target directory, so that a `cargo build` or `cargo test` there and the
    // wheel build share their work. Under CARGO_TARGET_DIR, which the cargo building this crate
    // also uses, a subdirectory of it: cargo holds a lock on its build directory while build
    // scripts run, and a nested build in the same one would wait on it forever.
    let target_dir = match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("gpufeed-daemon"),
        None => root.join("target"),
    };
    let target = env::var("TARGET").expect("set by cargo");
    let cross = env::var("HOST").expect("set by cargo") != target;

    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .arg("build")
        .arg("--locked")
        .arg("--manifest-path")
        .arg(&root_manifest)
        .arg("--bin")
        .arg("gpufeed")
        .arg("--profile")
        .arg(if profile_dir == "debug" {
            "dev"
        } else {
            "release"
        })
        .arg("--target-dir")
        .arg(&target_dir);
    if cross {
        command.arg("--target").arg(&target);
    }
    // Rust flags reach this script encoded from the outer build; the nested cargo takes them from
    // RUSTFLAGS as a `cargo build` at the root would, so that both share one build.
    command.env_remove("CARGO_ENCODED_RUSTFLAGS");
    // `cargo clippy --features daemon` here sets clippy as the workspace wrapper for this script;
    // the daemon is a plain build (the root workspace's CI lints it), not clippy's rebuild of it.
    command.env_remove("RUSTC_WORKSPACE_WRAPPER");
    let started = Instant::now();
    let status = command
        .status()
        .unwrap_or_else(|err| panic!("running cargo to build the gpufeed daemon: {err}"));
    if !status.success() {
        panic!(
            "`cargo build --bin gpufeed --profile {profile}` of {} failed ({status}): see its errors above",
            root_manifest.display()
        );
    }

    let built_dir = if cross {
        target_dir.join(&target).join(profile_dir)
    } else {
        target_dir.join(profile_dir)
    };
    let built = built_dir.join("gpufeed");
    let bundled = out_dir.join("gpufeed");
    // Copied through a temporary name: an interrupted copy never leaves a truncated binary under
    // the name maturin includes.
    let partial = out_dir.join("gpufeed.partial");
    fs::copy(&built, &partial)
        .and_then(|_| fs::rename(&partial, &bundled))
        .unwrap_or_else(|err| {
            panic!(
                "copying the daemon {} to {}: {err}",
                built.display(),
                bundled.display()
            )
        });
    rerun_on_sources(&built_dir.join("gpufeed.d"), &root);
    println!(
        "cargo:warning=bundled the gpufeed daemon ({profile} profile, {:.0} s of cargo) from {}",
        started.elapsed().as_secs_f64(),
        built.display()
    );
}

/// Tells cargo to rerun this script when a source file of the daemon in this repository changes,
/// from the dep-info file cargo wrote beside the binary (`target: source source ...`); the
/// manifests and the lock file too, which dep-info does not name.
fn rerun_on_sources(dep_info: &Path, root: &Path) {
    for manifest in ["Cargo.toml", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={}", root.join(manifest).display());
    }
    let text = fs::read_to_string(dep_info).unwrap_or_else(|err| {
        panic!(
            "reading the daemon's dep-info {}: {err}",
            dep_info.display()
        )
    });
    let Some((_, sources)) = text.lines().next().and_then(|line| line.split_once(": ")) else {
        panic!("{}: no `target: sources` line", dep_info.display());
    };
    // Paths are separated by spaces; a space inside a path is escaped as `\ `.
    let mut path = String::new();
    let mut chars = sources.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => path.push(chars.next().expect("peeked")),
            ' ' => emit_if_under(&std::mem::take(&mut path), root),
            _ => path.push(c),
        }
    }
    emit_if_under(&path, root);
}

fn emit_if_under(path: &str, root: &Path) {
    // Registry and git sources outside the repository do not change under a given Cargo.lock.
    if !path.is_empty() && Path::new(path).starts_with(root) {
        println!("cargo:rerun-if-changed={path}");
    }
}
