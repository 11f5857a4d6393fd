#!/usr/bin/env bash
# Builds here what scripts/gpu-storage.sh runs on the GPU machine and stages it in .gpu/storage/
# (git-ignored): the GPU storage test binary and the read benchmark, stripped, and the KvikIO wheels for
# the side-by-side run. Then call the device tool with
#   command: bash scripts/gpu-storage.sh     carry: [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p .gpu/storage/bin .gpu/storage/whl
rm -f .gpu/storage/bin/*

tests_json=$(cargo test --release -p gpufeed --test gpu_storage --no-run --message-format=json)
test_bin=$(printf '%s\n' "$tests_json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_storage" and m.get("executable"):
        print(m["executable"])
')
cargo build --release -p gpufeed --example read_bench
cp "$test_bin" .gpu/storage/bin/gpu_storage
cp "$CARGO_TARGET_DIR/release/examples/read_bench" .gpu/storage/bin/read_bench
strip .gpu/storage/bin/*

if ! ls .gpu/storage/whl/kvikio_cu13-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/storage/whl kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
fi
du -sh .gpu/storage/bin/* .gpu/storage/whl .gpu
