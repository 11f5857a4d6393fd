#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), everything scripts/gpu-check.sh runs on the GPU machine, and
# stages it in .gpu/ (git-ignored): the kernel test binary and the kernel benchmark, stripped, and the
# nvCOMP wheels for the comparison. Then call the device tool with
#   command: bash scripts/gpu-check.sh     carry: [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/stage.sh

stage_clean .gpu
mkdir -p .gpu/whl
stage_test .gpu gpu_kernels
stage_build .gpu --example kernel_bench
strip .gpu/bin/gpu_kernels .gpu/bin/kernel_bench

# nvCOMP 6 for CUDA 13 (the C library and its Python bindings), for Python 3.12 on the GPU machine.
if ! ls .gpu/whl/nvidia_libnvcomp_cu13-*.whl >/dev/null 2>&1 || ! ls .gpu/whl/nvidia_nvcomp_cu13-*.whl >/dev/null 2>&1; then
  stage_wheels .gpu/whl nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12
fi

du -sh .gpu/bin/* .gpu/whl/* .gpu
total_kib=$(du -sk .gpu | cut -f1)
if [ "$total_kib" -gt $((60 * 1024)) ]; then
  echo "error: .gpu is ${total_kib} KiB, over the 60 MiB kept under the device tool's 64 MiB limit" >&2
  exit 1
fi
