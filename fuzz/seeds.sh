#!/bin/sh
# Regenerates the seed corpora under fuzz/corpus/ (git-ignored) from real packer output.
set -eu
cd "$(dirname "$0")"
cargo run --release --example make_seeds -- corpus
