#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), everything scripts/gpu-check.sh runs on the GPU machine, and
# stages it in .gpu/ (git-ignored): the kernel test binary and the kernel benchmark, stripped, and the
# nvCOMP wheels for the comparison. Then call the device tool with
#   command: bash scripts/gpu-check.sh     carry: [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"

mkdir -p .gpu/bin .gpu/whl
rm -f .gpu/bin/*

# The test binary: cargo prints its path in the JSON build messages.
tests_json=$(cargo test --release -p gpufeed --test gpu_kernels --no-run --message-format=json)
test_bin=$(printf '%s\n' "$tests_json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_kernels" and m.get("executable"):
        print(m["executable"])
')
cargo build --release -p gpufeed --example kernel_bench
cp "$test_bin" .gpu/bin/gpu_kernels
cp "$CARGO_TARGET_DIR/release/examples/kernel_bench" .gpu/bin/kernel_bench
strip .gpu/bin/gpu_kernels .gpu/bin/kernel_bench

# nvCOMP 6 for CUDA 13 (the C library and its Python bindings), for Python 3.12 on the GPU machine.
if ! ls .gpu/whl/nvidia_libnvcomp_cu13-*.whl >/dev/null 2>&1 || ! ls .gpu/whl/nvidia_nvcomp_cu13-*.whl >/dev/null 2>&1; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12
fi

du -sh .gpu/bin/* .gpu/whl/* .gpu
total_kib=$(du -sk .gpu | cut -f1)
if [ "$total_kib" -gt $((60 * 1024)) ]; then
  echo "error: .gpu is ${total_kib} KiB, over the 60 MiB kept under the device tool's 64 MiB limit" >&2
  exit 1
fi
