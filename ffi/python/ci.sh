#!/usr/bin/env bash
# The Python package's CI: formatting and clippy of its extension crate (not a member of the root
# workspace); then `pip wheel ./ffi/python` once, which also builds the `gpufeed` daemon into the
# wheel (build.rs), in release as shipped unless GPUFEED_DAEMON_PROFILE=dev says otherwise; the wheel
# installed into a virtual environment under target/ and the pytest suite against the CPU backend
# with the `gpufeed` binary `cargo test` built; then the same wheel in a fresh virtual environment
# with no cargo on PATH, where tests/test_command.py runs the installed `gpufeed` command: pack,
# serve, a batch read from Python, SIGTERM. Any failure fails.
set -euo pipefail
cd "$(dirname "$0")"
root=$(cd ../.. && pwd)
target="$root/${CARGO_TARGET_DIR:-target}"
cargo fmt --check
cargo clippy --all-targets -- -D warnings

pip_quiet() { PIP_ROOT_USER_ACTION=ignore "$@" --quiet --disable-pip-version-check; }

wheels="$target/python-wheels"
rm -rf "$wheels"
started=$SECONDS
pip_quiet python3 -m pip wheel --no-deps --wheel-dir "$wheels" .
wheel=$(ls "$wheels"/gpufeed-*.whl)
echo "built $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB) in $((SECONDS - started)) s"

venv="$target/python-venv"
python3 -m venv "$venv"
pip_quiet "$venv/bin/pip" install numpy pytest pyarrow
pip_quiet "$venv/bin/pip" install --force-reinstall --no-deps "$wheel"
GPUFEED_BIN="${GPUFEED_BIN:-$target/debug/gpufeed}" "$venv/bin/python" -m pytest -q -rs tests

# A cluster image's install: the wheel alone, and nothing of the build's environment (env -i: no
# cargo, no CARGO_* or RUST* variables). Bounded: a daemon that never answers fails the step.
fresh="$target/python-fresh-venv"
rm -rf "$fresh"
python3 -m venv "$fresh"
pip_quiet "$fresh/bin/pip" install numpy pytest "$wheel"
env -i PATH="$fresh/bin:/usr/bin:/bin" HOME="$fresh" GPUFEED_TEST_FRESH_VENV=1 \
  timeout 300 "$fresh/bin/python" -m pytest -q -rs -p no:cacheprovider tests/test_command.py
