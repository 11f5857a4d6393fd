#!/usr/bin/env bash
# Builds here what scripts/gpu-serve.sh runs on the GPU machine and stages it in .gpu/serve/
# (git-ignored): the GPU serving test binary, the daemon, the consume example and the serving
# benchmark, stripped. Then call the device tool with
#   command: bash scripts/gpu-serve.sh     carry: [".gpu/serve"]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p .gpu/serve/bin
rm -f .gpu/serve/bin/*

test_bin() {
  cargo test --release -p gpufeed --test "$1" --no-run --message-format=json | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])
' "$1"
}
cp "$(test_bin gpu_serve)" .gpu/serve/bin/gpu_serve
cargo build --release -p gpufeed --bin gpufeed --example consume --example serve_bench
cp "$CARGO_TARGET_DIR/release/gpufeed" "$CARGO_TARGET_DIR/release/examples/consume" \
  "$CARGO_TARGET_DIR/release/examples/serve_bench" .gpu/serve/bin/
strip .gpu/serve/bin/*
du -sh .gpu/serve/bin/* .gpu/serve
