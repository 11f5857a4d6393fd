"""Recomputes every figure of the headline table in docs/benchmarks/README.md from its jsonl file.

    python3 docs/benchmarks/headline.py

Each row names its file and the records it takes; the figure is the median over the measured runs
(warm-up runs left out), and the runs themselves are printed beside it so that the spread is seen.
Only the standard library is needed.
"""

import json
import pathlib
import statistics

HERE = pathlib.Path(__file__).resolve().parent


def records(name):
    with open(HERE / name) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def median_row(label, values, unit="", extra=""):
    shown = ", ".join(f"{v:.2f}" for v in values)
    print(f"{label:<58} {statistics.median(values):8.2f} {unit:<8} ({shown}){extra}")
    return statistics.median(values)


def read_bench(name, case, order, label):
    """gpufeed rows of a read-path jsonl: GB/s of stored bytes in over the consumer's stream, and
    the daemon's CPU over the stream where the run recorded it (else over the consumer's wall)."""
    runs = [r for r in records(name) if r.get("loader") == "gpufeed" and r.get("case") == case
            and r.get("order") == order and r.get("gb_per_s_in_stream")]
    if all("daemon_cores_stream" in r for r in runs):
        cores = statistics.median(r["daemon_cores_stream"] for r in runs)
        over = "over the stream"
    else:
        cores = statistics.median(r["daemon_cores"] for r in runs)
        over = "over the wall"
    return median_row(label, [r["gb_per_s_in_stream"] for r in runs], "GB/s",
                      f"  daemon cores {cores:.2f} ({over})")


def a_b(name, default_commit, base_commit):
    """An A/B run of scripts/gpu-read.sh: case `default` (this build's daemon) against case
    `bin:.gpu/read/base` (another build's), per order, and their ratio."""
    for order_name in ("none", "window", "full"):
        tried = read_bench(name, "default", order_name, f"{default_commit}, {order_name}")
        base = read_bench(name, "bin:.gpu/read/base", order_name, f"{base_commit}, {order_name}")
        print(f"{'  ' + default_commit + ' / ' + base_commit:<58} {tried / base:8.3f} x")


def peer(name, loader, label, key="gb_per_s_in", **match):
    runs = [r for r in records(name) if r.get("loader") == loader
            and all(r.get(k) == v for k, v in match.items())]
    return median_row(label, [r[key] for r in runs], "GB/s")


def handoff(name, batch, label):
    runs = [r for r in records(name) if r.get("kind") == "run" and r["batch_size"] == batch]
    ratio = statistics.median(r["consumer_over_pipeline"] for r in runs)
    p50 = statistics.median(r["handoff_us_p50"] for r in runs)
    p99 = statistics.median(r["handoff_us_p99"] for r in runs)
    per_s = statistics.median(r["consumer_batches_per_s"] for r in runs)
    return median_row(label, [r["consumer_input_gb_per_s"] for r in runs], "GB/s",
                      f"  consumer/pipeline {ratio:.3f}, hand-off p50 {p50:.2f} µs, p99 {p99:.2f} µs,"
                      f" {per_s / 1000:.0f} k batches/s")


def multi_gpu(name, case, order, label):
    runs = [r for r in records(name) if r["case"] == case and r["order"] == order]
    cores = statistics.median(r["daemon_cores"] for r in runs)
    return median_row(label, [r["bytes_in"] / r["seconds"] / 1e9 for r in runs], "GB/s",
                      f"  daemon cores {cores:.2f} (over the wall)")


def python_bench(name, loader, batch, label):
    runs = [r for r in records(name) if r["loader"] == loader and r["batch_size"] == batch]
    return median_row(label, [r["bytes"] / r["seconds"] / 1e9 for r in runs], "GB/s out")


def cpu_order(name, order, label):
    runs = [r for r in records(name) if r.get("order") == order and "gb_per_s_fp16_in" in r]
    return median_row(label, [r["gb_per_s_fp16_in"] for r in runs], "GB/s")


def cpu_lz4(name, config, order, label):
    """A configuration of scripts/cpu-lz4.sh: GB/s of int32 tokens, and the decode amplification."""
    runs, current = [], None
    for r in records(name):
        if "config" in r:
            current = r["config"]
        elif current == config and r.get("order") == order:
            runs.append(r)
    amplification = statistics.median(r["decode_amplification"] for r in runs)
    return median_row(label, [r["gb_per_s_i32"] for r in runs], "GB/s",
                      f"  decode amplification {amplification:.2f}")


def main():
    print("== One H100: 8 GiB of fp16 2 KiB rows, batch 4096, fp32 out, page cache warm (run 97)")
    run97 = "read-path-2026-11-28-run97-row-copies-004b2c7.jsonl"
    order = read_bench(run97, "default", "none", "dataset order, in budget")
    window = read_bench(run97, "default", "window", "window shuffle, in budget")
    read_bench(run97, "default", "full", "full shuffle, in budget")
    print(f"{'  window / dataset order':<58} {window / order:8.3f} x")
    kvikio = peer(run97, "kvikio", "KvikIO, 8 threads (the best of 4/8/16)", threads=8)
    print(f"{'  gpufeed / KvikIO':<58} {order / kvikio:8.3f} x")
    register_copy = peer(run97, "register-copy", "register-and-copy peer")
    print(f"{'  gpufeed / register-and-copy':<58} {order / register_copy:8.3f} x")
    for workers in (4, 8, 16):
        peer(run97, "torch-random", f"PyTorch DataLoader (batched), {workers} workers, one run",
             workers=workers)
    for case in ("third", "third-copy4"):
        for order_name in ("none", "window", "full"):
            value = read_bench(run97, case, order_name, f"3x the budget, {case}, {order_name}")
            print(f"{'  / dataset order in budget':<58} {value / order:8.3f} x")

    print("== A 2xH100 host, one GPU, budget a third of the dataset: 004b2c7 against 9e0041a (run 99)")
    a_b("read-path-2026-11-28-run99-upload-overlap-ab-9e0041a.jsonl", "9e0041a (reverted)", "004b2c7")

    print("== One H100, one run: the renovated pipeline (82e2dc9) against ca96f83 (run 94)")
    a_b("read-path-2026-11-28-run94-renovation-82e2dc9.jsonl", "82e2dc9", "ca96f83")

    print("== Earlier: beyond the budget with 8 copy threads (runs 91-92, f0c0ee2 and 69e9ebd)")
    run92 = "read-path-2026-11-26-run92-checks-f0c0ee2.jsonl"
    read_bench(run92, "third", "none", "3x the budget, dataset order, registering (run 92)")
    read_bench(run92, "third-copy8", "none", "3x the budget, dataset order, 8 copy threads (run 92)")
    run91 = "read-path-2026-11-26-run91-checks-69e9ebd.jsonl"
    read_bench(run91, "third", "window", "3x the budget, window, registering (run 91)")
    read_bench(run91, "third-copy8", "window", "3x the budget, window, 8 copy threads (run 91)")

    print("== One H100: LZ4 int32 tokens, 4 GiB, batch 2048 (run 82)")
    tokens = "read-path-2026-11-26-run82-tokens-1e8449a.jsonl"
    tokens_order = read_bench(tokens, "default", "none", "tokens, dataset order")
    tokens_window = read_bench(tokens, "default", "window", "tokens, window shuffle")
    print(f"{'  window / dataset order':<58} {tokens_window / tokens_order:8.3f} x")

    print("== One H100: page cache dropped before each round (run 82)")
    cold = "read-path-2026-11-26-run82-cold-1e8449a.jsonl"
    for order_name in ("none", "window", "full"):
        read_bench(cold, "cold", order_name, f"cold, {order_name}")
    peer(cold, "dd-direct", "dd iflag=direct")
    peer(cold, "kvikio", "KvikIO cold, 8 threads")
    peer(cold, "random-read-probe", "random 4 KiB reads, queue depth 64", key="gb_per_s")

    print("== Hand-off, one H100: 8 GiB of 2 KiB rows, dataset order, one epoch a run")
    handoff("handoff-2026-11-26-h100-run62-check64-0b98e98.jsonl", 64, "batch 64 (hand-off run 62)")
    run61 = "handoff-2026-11-26-h100-run61-final-b4f4f72.jsonl"
    for batch in (256, 1024, 4096, 16384):
        handoff(run61, batch, f"batch {batch} (hand-off run 61)")

    print("== Hand-off, CPU backend, 2-core development VM")
    cpu_handoff = "handoff-2026-11-26-cpu-b4f4f72.jsonl"
    handoff(cpu_handoff, 16, "batch 16 of 1 KiB rows")
    handoff(cpu_handoff, 1024, "batch 1024 of 1 KiB rows")

    print("== Two H100, one daemon: 4 GiB of fp16 2 KiB rows, batch 4096")
    two = "multi-gpu-2026-11-26-h100x2-b4f4f72.jsonl"
    for order_name in ("none", "window"):
        one = multi_gpu(two, "one", order_name, f"{order_name}, one consumer (cuda:0)")
        both = multi_gpu(two, "two", order_name, f"{order_name}, one consumer per GPU (slowest stream)")
        print(f"{'  two / one':<58} {both / one:8.3f} x")

    print("== Python consumer against the Rust one, one H100: 2 GiB of fp16 rows, fp32 out")
    python = "python-2026-11-28-run95-82e2dc9.jsonl"
    for batch in (4096, 64):
        rust = python_bench(python, "gpufeed-rust", batch, f"Rust consumer, batch {batch}")
        py = python_bench(python, "gpufeed-python", batch, f"Python consumer, batch {batch}")
        print(f"{'  Python / Rust':<58} {py / rust:8.3f} x")

    print("== CPU backend, 1 GiB of int32 tokens, stream memory 256 MiB, 2-core VM (scripts/cpu-lz4.sh)")
    lz4 = "cpu-lz4-2026-11-28.jsonl"
    for config in ("lz4", "lz4-off", "lz4-16k", "lz4-16k-off", "raw"):
        in_order = cpu_lz4(lz4, config, "none", f"{config}, dataset order")
        for order_name in ("window", "full"):
            value = cpu_lz4(lz4, config, order_name, f"{config}, {order_name}")
            print(f"{'  / dataset order':<58} {value / in_order:8.3f} x")

    print("== CPU backend, order_bench, 2-core development VM (three invocations pooled)")
    cpu = "cpu-order-2026-11-26-8a2ff53.jsonl"
    cpu_none = cpu_order(cpu, "none", "dataset order")
    for order_name in ("window", "full"):
        value = cpu_order(cpu, order_name, f"{order_name}")
        print(f"{'  / dataset order':<58} {value / cpu_none:8.3f} x")


if __name__ == "__main__":
    main()
