#!/usr/bin/env bash
# The Python package's CI: formatting and clippy of its extension crate (not a member of the root
# workspace), then `pip install ./ffi/python` into a virtual environment under target/ and its pytest
# suite against the CPU backend with the `gpufeed` binary `cargo test` built. Any failure fails.
set -euo pipefail
cd "$(dirname "$0")"
root=$(cd ../.. && pwd)
cargo fmt --check
cargo clippy --all-targets -- -D warnings
venv="$root/target/python-venv"
python3 -m venv "$venv"
PIP_ROOT_USER_ACTION=ignore "$venv/bin/pip" install --quiet --disable-pip-version-check numpy pytest pyarrow
PIP_ROOT_USER_ACTION=ignore "$venv/bin/pip" install --quiet --disable-pip-version-check .
GPUFEED_BIN="${GPUFEED_BIN:-$root/${CARGO_TARGET_DIR:-target}/debug/gpufeed}" \
  "$venv/bin/python" -m pytest -q -rs tests
