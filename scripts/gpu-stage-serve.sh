#!/usr/bin/env bash
# Builds here what scripts/gpu-serve.sh runs on the GPU machine and stages it in .gpu/serve/
# (git-ignored): the GPU serving test binary, the daemon, the consume example and the serving
# benchmark, stripped. Then call the device tool with
#   command: bash scripts/gpu-serve.sh     carry: [".gpu/serve"]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/stage.sh

stage_clean .gpu/serve
stage_test .gpu/serve gpu_serve
stage_build .gpu/serve --bin gpufeed --example consume --example serve_bench
strip .gpu/serve/bin/*
du -sh .gpu/serve/bin/* .gpu/serve
