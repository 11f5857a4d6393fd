#!/usr/bin/env bash
# Builds, on this machine (no GPU needed), what scripts/gpu-checksum.sh runs on the GPU machine and
# stages it in .gpu/checksum/ (git-ignored): the checksum kernel's test binary and its benchmark,
# stripped. Then call the device tool with
#   command: bash scripts/gpu-checksum.sh     carry: [".gpu/checksum"]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/stage.sh

stage_clean .gpu/checksum
stage_test .gpu/checksum gpu_checksum
stage_build .gpu/checksum --example checksum_bench
strip .gpu/checksum/bin/*
du -sh .gpu/checksum/bin/* .gpu/checksum
