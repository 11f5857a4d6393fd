#!/usr/bin/env bash
# Builds here what scripts/gpu-read.sh runs on the GPU machine and stages it in .gpu/read/
# (git-ignored): the GPU serving, storage and kernel test binaries, the daemon, the consume example and
# the hand-off benchmark, stripped, and the KvikIO wheels for the peer. Then call the device tool with
#   command: bash scripts/gpu-read.sh     carry: [".gpu/read"]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/stage.sh

stage=.gpu/read
stage_clean "$stage"
mkdir -p "$stage/whl"
stage_test "$stage" gpu_serve
stage_test "$stage" gpu_kernels
stage_test "$stage" gpu_storage
stage_test "$stage" gpu_tier
stage_build "$stage" --bin gpufeed --example consume --example handoff_bench
strip "$stage"/bin/*
git rev-parse HEAD >"$stage/bin/COMMIT"
if ! ls "$stage"/whl/kvikio_cu13-*.whl >/dev/null 2>&1; then
  stage_kvikio_wheels "$stage/whl"
fi
du -sh "$stage"/bin/* "$stage"/whl/* "$stage"
total_kib=$(du -sk "$stage" | cut -f1)
if [ "$total_kib" -gt $((62 * 1024)) ]; then
  echo "error: $stage is ${total_kib} KiB, over the device tool's 64 MiB limit" >&2
  exit 1
fi
