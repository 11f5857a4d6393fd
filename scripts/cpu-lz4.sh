#!/usr/bin/env bash
# CPU backend over an LZ4 token dataset four times its host memory (issue 37's CPU shapes):
# 1 GiB of int32 tokens (131072 rows of 2048 zipf ids, 8 KiB a row, LZ4 with the byte shuffle, about
# 2.3x) filled by the assembler alone (examples/order_bench.rs) in dataset order, window shuffle
# (2 shards of 4) and full shuffle, batch 1024, the stream's host memory a quarter of the decoded
# dataset (256 MiB: the look-ahead's default 192 MiB, the decoded-block cache the rest), page cache
# warm. Configurations, one dataset packed each:
#   lz4      pack defaults (64 KiB blocks of 8 rows), look-ahead on (the default)
#   lz4-off  the same, look-ahead off: the cache keeps the whole 256 MiB (the code before it)
#   lz4-16k  16 KiB blocks of 2 rows (`pack --block-bytes 16K`), look-ahead on
#   lz4-16k-off  the same, look-ahead off
#   raw      the same tokens stored raw (`pack --codec raw`)
# RUNS runs per order, the orders taking turns run by run, after one untimed epoch. On a machine
# shared with other work the wall time of single runs moves by 2x or more with their load; the
# table therefore also gives each order's ratio by the process's CPU time (every thread's), which
# the neighbours' load moves much less. Writes
# docs/benchmarks/cpu-lz4-DATE.jsonl (per configuration a `config` line with the exact command, then
# the bench's lines) and docs/benchmarks/cpu-lz4-DATE-table.md (machine, commands, medians, every
# run). About 9 minutes on the 2-core development VM.
#
#   bash scripts/cpu-lz4.sh [RUNS]        (default 5; CPU_LZ4_SAMPLES rows, default 131072)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
samples=${CPU_LZ4_SAMPLES:-131072}
day=$(date -u +%F)
stem=docs/benchmarks/cpu-lz4-$day
# A second run of the day keeps the first's files.
[ ! -e "$stem.jsonl" ] || stem=$stem-$(date -u +%H%M)
out=$stem.jsonl
table=$stem-table.md
cargo build --release --example order_bench >&2
commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src examples || echo "-dirty")
bench=target/release/examples/order_bench
common="--data tokens --samples $samples --runs $runs --orders none,window,full"
: >"$out"
machine="$(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(($(grep MemTotal /proc/meminfo | awk '{print $2}') / 1048576)) GiB RAM, $(uname -r)"
for config in lz4 lz4-off lz4-16k lz4-16k-off raw; do
    case $config in
    lz4) extra="" ;;
    lz4-off) extra="--lookahead-bytes 0" ;;
    lz4-16k) extra="--block-bytes 16384" ;;
    lz4-16k-off) extra="--block-bytes 16384 --lookahead-bytes 0" ;;
    raw) extra="--codec raw" ;;
    esac
    command="$bench $common $extra"
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    printf '{"config":"%s","command":"%s","started":"%s","commit":"%s","machine":"%s","load_average":"%s"}\n' \
        "$config" "$command" "$(date -u +%FT%TZ)" "$commit" "$machine" "$load" >>"$out"
    echo "== $config: $command (load $load)" >&2
    # shellcheck disable=SC2086 # $common and $extra are word lists
    $command | tee -a "$out" | grep summary >&2
done
python3 - "$out" "$table" "$day" "$machine" <<'PY'
import json, statistics, sys
path, table, day, machine = sys.argv[1:]
configs, current = [], None
for line in open(path):
    d = json.loads(line)
    if "config" in d:
        current = {"config": d, "runs": {}, "dataset": None}
        configs.append(current)
    elif "dataset_bytes_stored" in d:
        current["dataset"] = d
    elif "order" in d:
        current["runs"].setdefault(d["order"], []).append(d)
out = [f"# CPU backend, LZ4 tokens four times the stream's memory: figures ({day})", "",
       f"Machine: {machine}. Written by `scripts/cpu-lz4.sh` from `{path.split('/')[-1]}`; "
       "medians of the runs, every run listed (GB/s of int32 tokens delivered).", "",
       "| config | stored (ratio) | in order GB/s | window | window / in order | full | full / in order "
       "| by CPU time: window / full against in order "
       "| decode amplification (window / full) | read amplification (window / full) | rows served ahead (window / full) |",
       "|---|---|---|---|---|---|---|---|---|---|---|"]
def med(rows, key):
    return statistics.median(r[key] for r in rows)
for c in configs:
    ds, runs = c["dataset"], c["runs"]
    rate = {o: med(runs[o], "gb_per_s_i32") for o in runs}
    cpu = {o: med(runs[o], "cpu_seconds") for o in runs}
    every = {o: ", ".join(f"{r['gb_per_s_i32']:.3f}" for r in runs[o]) for o in runs}
    ratio = ds["dataset_bytes_decoded"] / ds["dataset_bytes_stored"]
    out.append(
        f"| {c['config']['config']} | {ds['dataset_bytes_stored'] / 1e6:.0f} MB ({ratio:.2f}x) "
        f"| **{rate['none']:.3f}** ({every['none']}) "
        f"| {rate['window']:.3f} ({every['window']}) | **{rate['window'] / rate['none']:.2f}** "
        f"| {rate['full']:.3f} ({every['full']}) | **{rate['full'] / rate['none']:.2f}** "
        f"| {cpu['none'] / cpu['window']:.2f} / {cpu['none'] / cpu['full']:.2f} "
        f"| {med(runs['window'], 'decode_amplification'):.2f} / {med(runs['full'], 'decode_amplification'):.2f} "
        f"| {med(runs['window'], 'read_amplification'):.2f} / {med(runs['full'], 'read_amplification'):.2f} "
        f"| {med(runs['window'], 'lookahead_rows_served'):.0f} / {med(runs['full'], 'lookahead_rows_served'):.0f} |")
out += ["", "Commands (load average when each started):", ""]
for c in configs:
    k = c["config"]
    out.append(f"- {k['config']}: `{k['command']}` at {k['started']}, commit {k['commit']}, load {k['load_average']}")
out += ["", "By CPU time: the median CPU seconds of the process (every thread) over an epoch in "
        "dataset order divided by the order's.", "", "Decode amplification: bytes decoded per raw byte of the rows delivered; read amplification: "
        "bytes read over every path (page-cache copies included, whole 4 KiB pages) per stored byte "
        "of the rows delivered (`gpufeed_host_*` in docs/API.md). Raw rows are read in place from "
        "the page cache, one row at a time, and nothing is decoded (decode amplification 0).", ""]
open(table, "w").write("\n".join(out))
print("\n".join(out))
PY
