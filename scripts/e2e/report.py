"""Tabulates and plots the end-to-end benchmark's measurements (the e2e.jsonl of scripts/gpu-e2e.sh).

    python3 scripts/e2e/report.py --table-only e2e.jsonl          # markdown table on stdout (stdlib only)
    python3 scripts/e2e/report.py e2e.jsonl --out-dir docs/benchmarks --date 2026-11-23 \
        --device "NVIDIA H100 80GB HBM3" --command "bash scripts/gpu-e2e.sh"   # needs matplotlib

The second form writes, under --out-dir (refusing to replace an existing file without --force, so
that a hand-written analysis is not lost):
- e2e-DATE-throughput-KIND-TEMPERATURE.png: GB/s of input delivered against batch size, one line per
  loader (dd iflag=direct drawn flat where measured);
- e2e-DATE-peers-KIND.png: every loader at its best batch size, cold and warm side by side;
- e2e-DATE.md: device, date, commands, definitions, the table, the ratios the issue's targets name and
  the figures, to which the analysis is then added by hand;
- e2e-DATE.jsonl: the raw lines, when a single file was given.

Aggregation: `warmup` runs, failed and skipped ones are left out. Runs of one loader, kind, temperature
and batch size are grouped by their variant (DataLoader workers, KvikIO read-ahead depth); each group's
median is taken, and the best variant is shown, with the number of runs behind it.
"""
import argparse
import json
import os
import shutil
import statistics
import sys

LOADER_ORDER = ["gpufeed", "kvikio-read", "kvikio", "torch", "dali", "dd-direct"]
LOADER_LABEL = {
    "gpufeed": "gpufeed",
    "kvikio-read": "KvikIO read alone",
    "kvikio": "KvikIO + CuPy astype",
    "torch": "PyTorch DataLoader",
    "dali": "DALI numpy reader",
    "dd-direct": "dd iflag=direct",
}


DEFINITIONS = """\
- **GB/s in**: bytes of the input payload as the .npy holds it (before any compression) delivered per
  second; **GB/s out**: bytes of the batches delivered (fp32 batches are twice their fp16 input).
- **seconds**: gpufeed: the consumer's, from opening its stream to the last batch; peers: from the
  loader's start (DataLoader workers' start-up included) to a device synchronize after the last batch.
- **host cores**: gpufeed: the daemon's CPU seconds (/proc/PID/stat) plus the consumer process's, over
  the consumer process's wall time; peers: the process's CPU seconds with its joined workers' (rusage),
  over `seconds`.
- **GPU busy %**: nvidia-smi utilization.gpu sampled every 100 ms during the run (the share of time a
  kernel ran; DMA copies alone do not count); – where a run was shorter than one sample.
- **cold**: page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before the run; **warm**:
  gpufeed: after one unmeasured run of the same configuration; peers: after reading the file once.
  Warm figures are the median of the runs shown; each loader's variant (DataLoader workers, KvikIO
  read-ahead depth) is the fastest tried."""

# One colour per loader in every figure.
LOADER_COLOR = {"gpufeed": "tab:blue", "kvikio-read": "tab:orange", "kvikio": "tab:green",
                "torch": "tab:red", "dali": "tab:purple", "dd-direct": "tab:gray"}


def read_records(paths):
    records, skipped = [], []
    for path in paths:
        with open(path) as lines:
            for number, line in enumerate(lines, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    print(f"{path}:{number}: not JSON, left out", file=sys.stderr)
                    continue
                if "skipped" in record:
                    skipped.append(record)
                elif ("error" in record or record.get("temperature") == "warmup"
                      or record.get("gb_per_s_in") is None):
                    continue
                else:
                    records.append(record)
    return records, skipped


def variant_of(record):
    if record["loader"] == "torch":
        return f"workers {record.get('workers')}"
    if record["loader"].startswith("kvikio"):
        return f"depth {record.get('depth')}"
    return ""


def median_of(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def aggregate(records):
    """One row per (loader, kind, temperature, batch_size): the best variant's medians."""
    groups = {}
    for record in records:
        key = (record["loader"], record.get("kind"), record["temperature"], record.get("batch_size"))
        groups.setdefault(key, {}).setdefault(variant_of(record), []).append(record)
    rows = []
    for (loader, kind, temperature, batch_size), variants in groups.items():
        best = None
        for variant, runs in variants.items():
            row = {
                "loader": loader, "kind": kind, "temperature": temperature, "batch_size": batch_size,
                "variant": variant, "runs": len(runs),
                "variants_tried": len(variants),
            }
            for key in ("gb_per_s_in", "gb_per_s_out", "samples_per_s", "cores", "gpu_busy_pct",
                        "daemon_cores", "seconds"):
                row[key] = median_of(runs, key)
            if best is None or row["gb_per_s_in"] > best["gb_per_s_in"]:
                best = row
        rows.append(best)

    def order(row):
        loader = LOADER_ORDER.index(row["loader"]) if row["loader"] in LOADER_ORDER else len(LOADER_ORDER)
        return (row["kind"] or "", row["temperature"], loader, row["batch_size"] or 0)

    return sorted(rows, key=order)


def fmt(value, digits=2):
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(rows):
    lines = [
        "| kind | temperature | loader | batch | variant | samples/s | GB/s in | GB/s out | host cores | GPU busy % | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append("| " + " | ".join([
            row["kind"] or "", row["temperature"], LOADER_LABEL.get(row["loader"], row["loader"]),
            fmt(row["batch_size"]), row["variant"] or "", fmt(row["samples_per_s"], 0),
            fmt(row["gb_per_s_in"]), fmt(row["gb_per_s_out"]), fmt(row["cores"]),
            fmt(row["gpu_busy_pct"], 0), fmt(row["runs"]),
        ]) + " |")
    return "\n".join(lines)


def best_row(rows, loader, kind, temperature):
    candidates = [r for r in rows if r["loader"] == loader and r["kind"] == kind
                  and r["temperature"] == temperature]
    return max(candidates, key=lambda r: r["gb_per_s_in"]) if candidates else None


def targets(rows, records):
    """The ratios the issue's targets name, computed; no verdict beyond the comparison itself."""
    lines = []

    def ratio(a, b):
        return a / b if a is not None and b else None

    gpufeed_warm = best_row(rows, "gpufeed", "emb", "warm")
    gpufeed_cold = best_row(rows, "gpufeed", "emb", "cold")
    if gpufeed_warm:
        rate, cores = gpufeed_warm["gb_per_s_in"], gpufeed_warm["cores"]
        lines.append(f"- warm fp16 input delivered as fp32 (best batch size {gpufeed_warm['batch_size']}): "
                     f"{fmt(rate)} GB/s (target ≥ 50), host cores {fmt(cores)} (target ≤ 1)")
        for loader, target in (("kvikio-read", 1.5), ("kvikio", None), ("torch", 10.0)):
            peer = best_row(rows, loader, "emb", "warm")
            if peer:
                goal = f" (target ≥ {target}×)" if target else ""
                lines.append(f"- warm, gpufeed / {LOADER_LABEL[loader]} (its best batch size "
                             f"{peer['batch_size']}, {fmt(peer['gb_per_s_in'])} GB/s): "
                             f"{fmt(ratio(rate, peer['gb_per_s_in']))}×{goal}")
    dd = [r["gb_per_s_in"] for r in records if r["loader"] == "dd-direct"]
    if gpufeed_cold and dd:
        lines.append(f"- cold, gpufeed (batch size {gpufeed_cold['batch_size']}) "
                     f"{fmt(gpufeed_cold['gb_per_s_in'])} GB/s against dd iflag=direct "
                     f"{', '.join(fmt(v) for v in dd)} GB/s: "
                     f"{fmt(ratio(gpufeed_cold['gb_per_s_in'], statistics.median(dd)))}× the median (target ≥ 0.95×)")
    return "\n".join(lines)


def plot(rows, records, out_dir, date):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    dd = [r["gb_per_s_in"] for r in records if r["loader"] == "dd-direct"]
    kinds = sorted({r["kind"] for r in rows if r["loader"] != "dd-direct"})
    kind_title = {"emb": "fp16 embeddings → fp32", "tokens": "zipf int32 tokens"}
    for kind in kinds:
        for temperature in ("cold", "warm"):
            selected = [r for r in rows if r["kind"] == kind and r["temperature"] == temperature
                        and r["loader"] != "dd-direct"]
            if not selected:
                continue
            figure, axes = plt.subplots(figsize=(7, 4.5))
            for loader in LOADER_ORDER:
                points = sorted((r["batch_size"], r["gb_per_s_in"]) for r in selected if r["loader"] == loader)
                if points:
                    axes.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                              color=LOADER_COLOR[loader], label=LOADER_LABEL[loader])
            if temperature == "cold" and kind == "emb" and dd:
                axes.axhline(statistics.median(dd), color="grey", linestyle="--",
                             label=f"dd iflag=direct (median of {len(dd)})")
            axes.set_xscale("log", base=2)
            batch_sizes = sorted({r["batch_size"] for r in selected})
            axes.set_xticks(batch_sizes)
            axes.set_xticklabels([str(b) for b in batch_sizes])
            axes.set_xlabel("batch size (samples)")
            axes.set_ylabel("GB/s of input delivered")
            axes.set_ylim(bottom=0)
            axes.set_title(f"{kind_title.get(kind, kind)}, {temperature}")
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize="small")
            figure.tight_layout()
            path = os.path.join(out_dir, f"e2e-{date}-throughput-{kind}-{temperature}.png")
            figure.savefig(path, dpi=110)
            plt.close(figure)
            written.append(path)

        loaders = [l for l in LOADER_ORDER if l != "dd-direct"
                   and any(r["loader"] == l and r["kind"] == kind for r in rows)]
        if kind == "emb" and dd:
            loaders.append("dd-direct")
        figure, axes = plt.subplots(figsize=(8, 4.5))
        width = 0.38
        for offset, temperature in ((-width / 2, "cold"), (width / 2, "warm")):
            values, labels = [], []
            for loader in loaders:
                if loader == "dd-direct":
                    value = statistics.median(dd) if temperature == "cold" else None
                    label = ""
                else:
                    row = best_row(rows, loader, kind, temperature)
                    value = row["gb_per_s_in"] if row else None
                    label = f"B={row['batch_size']}" if row else ""
                values.append(value or 0.0)
                labels.append((value, label))
            bars = axes.bar([i + offset for i in range(len(loaders))], values, width, label=temperature)
            for bar, (value, label) in zip(bars, labels):
                if value:
                    axes.annotate(f"{value:.1f}\n{label}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                  ha="center", va="bottom", fontsize="x-small")
        axes.set_xticks(range(len(loaders)))
        axes.set_xticklabels([LOADER_LABEL[l] for l in loaders], rotation=15, fontsize="small")
        axes.set_ylabel("GB/s of input delivered (best batch size)")
        axes.set_title(f"{kind_title.get(kind, kind)}: each loader at its best batch size")
        axes.margins(y=0.15)
        axes.legend()
        figure.tight_layout()
        path = os.path.join(out_dir, f"e2e-{date}-peers-{kind}.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--table-only", action="store_true", help="print the table and ratios only")
    parser.add_argument("--out-dir", default="docs/benchmarks")
    parser.add_argument("--date", help="YYYY-MM-DD for the file names (default: the runs' date)")
    parser.add_argument("--device", default="", help="the device, for the markdown")
    parser.add_argument("--command", action="append", default=[], help="a command run (repeatable)")
    parser.add_argument("--force", action="store_true", help="replace existing e2e-DATE.md and .jsonl")
    args = parser.parse_args()
    records, skipped = read_records(args.jsonl)
    rows = aggregate(records)
    text = [table(rows), "", targets(rows, records)]
    for record in skipped:
        text.append(f"- {record.get('loader')} ({record.get('kind', '')}): skipped: {record['skipped']}")
    if args.table_only:
        print("\n".join(text))
        return
    date = args.date or min((r["date"][:10] for r in records if r.get("date")), default="undated")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"e2e-{date}.md")
    raw_path = os.path.join(args.out_dir, f"e2e-{date}.jsonl")
    for existing in (path, raw_path):
        if os.path.exists(existing) and not args.force:
            raise SystemExit(f"{existing} exists; pass --force to replace it")
    written = plot(rows, records, args.out_dir, date)
    markdown = [f"# End-to-end benchmark ({date}), generated by scripts/e2e/report.py", ""]
    if args.device:
        markdown += [f"**Device**: {args.device}", ""]
    markdown += [f"**Date**: {date}", ""]
    if args.command:
        markdown += ["**Commands**:", "", "```", *args.command, "```", ""]
    markdown += [DEFINITIONS, ""]
    if len(args.jsonl) == 1:
        shutil.copyfile(args.jsonl[0], raw_path)
        markdown += [f"Raw lines: `{os.path.basename(raw_path)}`.", ""]
        written.append(raw_path)
    markdown += ["\n".join(text), ""]
    markdown += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in written if p.endswith(".png")]
    with open(path, "w") as out:
        out.write("\n".join(markdown) + "\n")
    for p in written + [path]:
        print(p)


if __name__ == "__main__":
    main()
