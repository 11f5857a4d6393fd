#!/usr/bin/env bash
# Builds the Python package's wheel here into .gpu/read/py/ (git-ignored), beside what
# scripts/gpu-stage-read.sh stages (the daemon and the consume example), for scripts/gpu-python.sh.
# Then call the device tool with
#   command: bash scripts/gpu-python.sh     carry: [".gpu/read"]
set -euo pipefail
cd "$(dirname "$0")/.."
stage=.gpu/read/py
rm -rf "$stage"
mkdir -p "$stage"
venv=target/python-venv
[ -x "$venv/bin/pip" ] || python3 -m venv "$venv"
PIP_ROOT_USER_ACTION=ignore "$venv/bin/pip" wheel --quiet --no-deps -w "$stage" ./ffi/python
# The GPU machine reaches no package index: pytest travels with the wheel.
mkdir -p "$stage/deps"
PIP_ROOT_USER_ACTION=ignore "$venv/bin/pip" download --quiet --only-binary :all: -d "$stage/deps" pytest
ls -la "$stage"
