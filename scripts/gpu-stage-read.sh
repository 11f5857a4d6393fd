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
stage_test "$stage" gpu_variable
stage_build "$stage" --bin gpufeed --example consume --example handoff_bench
strip "$stage"/bin/*
git rev-parse HEAD >"$stage/bin/COMMIT"
if ! ls "$stage"/whl/kvikio_cu13-*.whl >/dev/null 2>&1; then
  stage_kvikio_wheels "$stage/whl"
fi
du -sh "$stage"/bin/* "$stage"/whl/* "$stage"
# The device tool carries the tracked files too, within 64 MiB in all (and .gpu/read/py when
# scripts/gpu-stage-python.sh staged it; a base/ left by an A/B counts as well).
total_kib=$(du -sk .gpu/read | cut -f1)
tracked_kib=$(git ls-files -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
if [ $((total_kib + tracked_kib)) -gt $((62 * 1024)) ]; then
  echo "error: .gpu/read (${total_kib} KiB) and the tracked files (${tracked_kib} KiB) are over the device tool's 64 MiB" >&2
  exit 1
fi
