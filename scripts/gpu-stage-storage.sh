#!/usr/bin/env bash
# Builds here what scripts/gpu-storage.sh runs on the GPU machine and stages it in .gpu/storage/
# (git-ignored): the GPU storage test binary and the read benchmark, stripped, and the KvikIO wheels for
# the side-by-side run. Then call the device tool with
#   command: bash scripts/gpu-storage.sh     carry: [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/stage.sh

stage_clean .gpu/storage
mkdir -p .gpu/storage/whl
stage_test .gpu/storage gpu_storage
stage_build .gpu/storage --example read_bench
strip .gpu/storage/bin/*

if ! ls .gpu/storage/whl/kvikio_cu13-*.whl >/dev/null 2>&1; then
  stage_kvikio_wheels .gpu/storage/whl
fi
du -sh .gpu/storage/bin/* .gpu/storage/whl .gpu
