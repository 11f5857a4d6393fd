#!/usr/bin/env bash
# Coverage-guided fuzzing of every target for a bounded time, on stable Rust: what CI runs.
#
#   fuzz/smoke.sh                      # every target, FUZZ_SECONDS (default 15) each
#   FUZZ_SECONDS=300 fuzz/smoke.sh shard_metadata
#
# cargo-fuzz needs nightly for its sanitizer flags (or RUSTC_BOOTSTRAP=1), but the coverage
# instrumentation libFuzzer is guided by is plain codegen options that stable accepts. This builds
# the targets with them (release, debug assertions and overflow checks on, no AddressSanitizer),
# writes the seed corpora with examples/make_seeds.rs, and runs each target from its seeds and its
# committed regressions (regressions/TARGET/, replayed first) for FUZZ_SECONDS. Any crash, panic,
# timeout or out-of-memory fails the run; the input that caused it is kept under artifacts/TARGET/.
set -euo pipefail
cd "$(dirname "$0")"

seconds="${FUZZ_SECONDS:-15}"
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    targets=(message_decode ring_decode shard_metadata block_decode manifest npy_header)
fi

# An explicit --target keeps the flags off build scripts and proc macros, as cargo-fuzz does.
host="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="${RUSTFLAGS:-} -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
--cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --release --target "$host" --bins --example make_seeds
bin="${CARGO_TARGET_DIR:-target}/$host/release"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin/examples/make_seeds" "$work/seeds" >/dev/null

failed=()
for target in "${targets[@]}"; do
    inputs=()
    for dir in "$work/seeds/$target" "regressions/$target"; do
        if [ -d "$dir" ]; then
            inputs+=("$dir")
        fi
    done
    # New units go to the first directory (scratch); the seeds and regressions are only read.
    mkdir -p "$work/corpus/$target" "artifacts/$target"
    log="$work/$target.log"
    if "$bin/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="artifacts/$target/" \
        "$work/corpus/$target" "${inputs[@]}" >"$log" 2>&1; then
        runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
        coverage="$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)"
        echo "fuzz $target: ${seconds} s, ${runs:-?} runs, ${coverage:-cov: ?}, no crash"
    else
        echo "fuzz $target: FAILED (input kept under fuzz/artifacts/$target/); its log ends:"
        tail -n 60 "$log"
        failed+=("$target")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz smoke failed: ${failed[*]}"
    exit 1
fi
