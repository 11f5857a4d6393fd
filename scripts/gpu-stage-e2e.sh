#!/usr/bin/env bash
# Builds here what scripts/gpu-e2e.sh runs on the GPU machine and stages it in .gpu/e2e/ (git-ignored):
# the gpufeed binary and the consume example, stripped, and the KvikIO wheels for the peers. DALI's
# wheel is looked at too, but carried only if it is small enough (it is not, so far: see
# .gpu/e2e/dali.txt). Then call the device tool with
#   command: bash scripts/gpu-e2e.sh     carry: [".gpu/e2e"]
#
#   --wheels-only   stage the peers' wheels only (no build), for a run of the peers alone
#   --no-dali       do not look at the DALI wheel
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/stage.sh
stage=.gpu/e2e
# What the device tool carries, working tree included, is at most 64 MiB.
stage_bytes_max=$((55 << 20))
dali_bytes_max=$((40 << 20))
build=1
dali=1
for arg in "$@"; do
  case "$arg" in
    --wheels-only) build=0 ;;
    --no-dali) dali=0 ;;
    *) echo "usage: $0 [--wheels-only] [--no-dali]" >&2; exit 2 ;;
  esac
done
mkdir -p "$stage/bin" "$stage/whl"

if [ "$build" = 1 ]; then
  stage_clean "$stage"
  stage_build "$stage" --bin gpufeed --example consume
  strip "$stage"/bin/*
  # What was built, for the run's log: the commit and any uncommitted change to the code.
  git rev-parse HEAD >"$stage/bin/COMMIT" 2>/dev/null || echo unknown >"$stage/bin/COMMIT"
  git status --porcelain --untracked-files=no -- src client examples kernels Cargo.toml Cargo.lock \
    >"$stage/bin/DIRTY" 2>/dev/null || true
fi

# The same wheels as scripts/gpu-stage-storage.sh (taken from its stage when there).
if ! ls "$stage"/whl/kvikio_cu13-*.whl >/dev/null 2>&1; then
  if ls .gpu/storage/whl/kvikio_cu13-*.whl >/dev/null 2>&1; then
    cp .gpu/storage/whl/*.whl "$stage/whl/"
  else
    stage_kvikio_wheels "$stage/whl"
  fi
fi

# DALI: pip prints a wheel's size as it starts downloading it; a wheel over the limit is not fetched
# (the download this script started is stopped) and the reason is written down for the run's log.
probe_dali() {
  local package=$1 probe=/tmp/gpufeed-dali-probe log pip_pid size_text size_bytes
  rm -rf "$probe"
  mkdir -p "$probe"
  log="$probe/pip.log"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$probe" "$package" >"$log" 2>&1 &
  pip_pid=$!
  for _ in $(seq 1 240); do
    grep -q 'Downloading .*\.whl (' "$log" && break
    kill -0 "$pip_pid" 2>/dev/null || break
    sleep 0.25
  done
  size_text=$(grep -o 'Downloading .*\.whl ([0-9.]* [kMG]B)' "$log" | head -1 | grep -o '([0-9.]* [kMG]B)' || true)
  if [ -z "$size_text" ]; then
    kill "$pip_pid" 2>/dev/null || true
    wait "$pip_pid" 2>/dev/null || true
    echo "$package: pip found no wheel ($(tail -1 "$log"))"
    return 2
  fi
  size_bytes=$(echo "$size_text" | tr -d '()' | awk '{m = ($2 == "kB") ? 1e3 : ($2 == "MB") ? 1e6 : 1e9; printf "%d", $1 * m}')
  if [ "$size_bytes" -gt "$dali_bytes_max" ]; then
    kill "$pip_pid" 2>/dev/null || true
    wait "$pip_pid" 2>/dev/null || true
    echo "$package: not carried: its wheel is $(echo "$size_text" | tr -d "()"), over the $((dali_bytes_max >> 20)) MiB left for it under the device tool's 64 MiB carry limit ($(date -u +%F))"
    return 1
  fi
  wait "$pip_pid"
  mkdir -p "$stage/whl-dali"
  cp "$probe"/*.whl "$stage/whl-dali/"
  echo "$package: carried ($(echo "$size_text" | tr -d "()")); its dependencies are not"
}
if [ "$dali" = 1 ]; then
  rm -rf "$stage/whl-dali"
  # The CUDA 12 build only where pip finds no CUDA 13 one (the GPU machine's driver is CUDA 13).
  probe_rc=0
  probe_dali nvidia-dali-cuda130 >"$stage/dali.txt" || probe_rc=$?
  if [ "$probe_rc" = 2 ]; then
    probe_dali nvidia-dali-cuda120 >>"$stage/dali.txt" || true
  fi
  cat "$stage/dali.txt"
fi

du -sh "$stage"/bin/* "$stage"/whl "$stage" 2>/dev/null || true
stage_bytes=$(du -sb "$stage" | cut -f1)
if [ "$stage_bytes" -gt "$stage_bytes_max" ]; then
  echo "$stage holds $stage_bytes bytes, more than $stage_bytes_max: it will not travel with the tree" >&2
  exit 1
fi
