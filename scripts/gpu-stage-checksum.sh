#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), what scripts/gpu-checksum.sh runs on the GPU machine and
# stages it in .gpu/checksum/ (git-ignored): the checksum kernel's test binary and its benchmark,
# stripped. Then call the device tool with
#   command: bash scripts/gpu-checksum.sh     carry: [".gpu/checksum"]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p .gpu/checksum/bin
rm -f .gpu/checksum/bin/*

# The test binary: cargo prints its path in the JSON build messages.
tests_json=$(cargo test --release -p gpufeed --test gpu_checksum --no-run --message-format=json)
test_bin=$(printf '%s\n' "$tests_json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_checksum" and m.get("executable"):
        print(m["executable"])
')
cargo build --release -p gpufeed --example checksum_bench
cp "$test_bin" .gpu/checksum/bin/gpu_checksum
cp "$CARGO_TARGET_DIR/release/examples/checksum_bench" .gpu/checksum/bin/checksum_bench
strip .gpu/checksum/bin/*
du -sh .gpu/checksum/bin/* .gpu/checksum
