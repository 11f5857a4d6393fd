#!/usr/bin/env bash
# Host memory of the CPU backend's streams as the process's resident set: before any stream, at the
# peak while N full-shuffle streams over one LZ4 token dataset fill at once through the shared
# decoded-block cache, and after they all closed (examples/rss_probe.rs; the daemon's allocator).
#
#   bash scripts/rss-streams.sh [STREAMS...]      (default: 1 20 200)
#
# One JSON line per stream count on stdout. RSS_SAMPLES (rows of 8 KiB, default 32768: 256 MiB
# decoded) and RSS_BUDGET_MIB (default 256) size the run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example rss_probe >&2
streams=("$@")
[ ${#streams[@]} -gt 0 ] || streams=(1 20 200)
for n in "${streams[@]}"; do
    target/release/examples/rss_probe --streams "$n" --samples "${RSS_SAMPLES:-32768}" \
        --budget-mib "${RSS_BUDGET_MIB:-256}" --steps 32
done
