#!/usr/bin/env python3
"""Plots a hand-off benchmark sweep (examples/handoff_bench.rs JSON lines) as an SVG, with no
dependency beyond the standard library: for each order mode in the file, the median GB/s of input of
the pipeline alone and of the consumer process against the batch size (both axes logarithmic), and
every run as a dot.

    python3 scripts/handoff_plot.py RESULTS.jsonl OUT.svg "title"
"""

import json
import math
import sys

W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 440, 70, 170, 40, 50
COLORS = {"pipeline": "#1f77b4", "consumer": "#d62728"}
DASH = {"none": "", "window": "6,3", "full": "2,3"}


def main():
    path, out, title = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = [json.loads(line) for line in open(path) if line.strip()]
    medians = [r for r in rows if r["kind"] == "median"]
    runs = [r for r in rows if r["kind"] == "run"]
    series = {}
    for r in medians:
        for who in ("pipeline", "consumer"):
            series.setdefault((r["order"], who), []).append(
                (r["batch_size"], r[f"{who}_input_gb_per_s"]))
    xs = [r["batch_size"] for r in rows]
    ys = [r[f"{w}_input_gb_per_s"] for r in rows for w in ("pipeline", "consumer")]
    x0, x1 = math.log2(min(xs)), math.log2(max(xs))
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    if x1 == x0:
        x1 = x0 + 1

    def px(x):
        return LEFT + (math.log2(x) - x0) / (x1 - x0) * (W - LEFT - RIGHT)

    def py(y):
        return H - BOTTOM - (math.log10(y) - y0) / (y1 - y0) * (H - TOP - BOTTOM)

    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    for e in range(y0, y1 + 1):
        for m in (1, 2, 5):
            y = m * 10 ** e
            if 10 ** y0 <= y <= 10 ** y1:
                svg.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>')
                svg.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in sorted(set(xs)):
        svg.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#eee"/>')
        svg.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{x}</text>')
    svg.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 10}" text-anchor="middle">batch size (rows)</text>')
    svg.append(f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">GB/s of input (median of runs)</text>')
    legend = 0
    for (order, who), points in sorted(series.items()):
        points.sort()
        d = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(points))
        svg.append(f'<path d="{d}" fill="none" stroke="{COLORS[who]}" stroke-width="2" stroke-dasharray="{DASH.get(order, "")}"/>')
        y = TOP + 10 + legend * 18
        svg.append(f'<line x1="{W - RIGHT + 10}" x2="{W - RIGHT + 40}" y1="{y}" y2="{y}" stroke="{COLORS[who]}" stroke-width="2" stroke-dasharray="{DASH.get(order, "")}"/>')
        svg.append(f'<text x="{W - RIGHT + 46}" y="{y + 4}">{who}, order {order}</text>')
        legend += 1
    for r in runs:
        for who in ("pipeline", "consumer"):
            svg.append(f'<circle cx="{px(r["batch_size"]):.1f}" cy="{py(r[f"{who}_input_gb_per_s"]):.1f}" r="2" fill="{COLORS[who]}" fill-opacity="0.5"/>')
    svg.append("</svg>")
    open(out, "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
