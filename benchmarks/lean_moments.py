#!/usr/bin/env python3
"""Does AdamW with leaner moments train as well as fp32 AdamW?

Trains the tiny preset and benchmarks/lean-moments-mid.json (4.8 M
parameters) on the cpu backend with the synthetic task, once per host-state
policy (master-moments: fp32 m and v; int8-moments; factored-moments), same
seed, same data, and writes the loss curves side by side (an SVG of the
running mean over 20 steps) and a markdown table of the mean loss of the
first and last 50 steps (docs/Training.md, "Leaner optimizer states").

  benchmarks/lean_moments.py --build build --steps 300 \\
      --svg docs/lean-moments-loss.svg
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ["master-moments", "int8-moments", "factored-moments"]
COLORS = {"master-moments": "#1f77b4", "int8-moments": "#d62728",
          "factored-moments": "#2ca02c"}
MODELS = [("tiny", "tiny", 2e-3),
          ("mid (4.8 M)", os.path.join(ROOT, "benchmarks",
                                       "lean-moments-mid.json"), 1e-3)]
WINDOW = 50
SMOOTH = 20


def train(build, model, lr, policy, steps, seed, tmp):
    metrics = os.path.join(tmp, f"{os.path.basename(model)}-{policy}.jsonl")
    subprocess.run([os.path.join(build, "bin", "megaslide-run"),
                    "--no-progress", "--model", model, "--backend", "cpu",
                    "--steps", str(steps), "--lr", str(lr), "--seed",
                    str(seed), "--host-state-policy", policy, "--metrics",
                    metrics], check=True, capture_output=True)
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f]


def running_mean(xs, k):
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= k:
            total -= xs[i - k]
        out.append(total / min(i + 1, k))
    return out


def svg(curves, steps):
    """One panel per model, a polyline per policy."""
    w, h, pad = 360, 220, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w}" '
             f'height="{h + 30}" font-family="sans-serif" font-size="11">']
    for panel, (name, by_policy) in enumerate(curves.items()):
        x0 = panel * w
        ys = [y for c in by_policy.values() for y in c]
        lo, hi = min(ys), max(ys)
        parts.append(f'<text x="{x0 + w / 2}" y="14" text-anchor="middle">'
                     f'{name}: loss, running mean of {SMOOTH} steps</text>')
        parts.append(f'<rect x="{x0 + pad}" y="20" width="{w - 2 * pad}" '
                     f'height="{h - pad}" fill="none" stroke="#999"/>')
        for v in (lo, hi):
            y = 20 + (h - pad) * (hi - v) / (hi - lo)
            parts.append(f'<text x="{x0 + pad - 4}" y="{y + 4}" '
                         f'text-anchor="end">{v:.2f}</text>')
        parts.append(f'<text x="{x0 + w - pad}" y="{h - 5}" '
                     f'text-anchor="end">step {steps}</text>')
        for policy, c in by_policy.items():
            pts = " ".join(
                f"{x0 + pad + (w - 2 * pad) * i / (len(c) - 1):.1f},"
                f"{20 + (h - pad) * (hi - y) / (hi - lo):.1f}"
                for i, y in enumerate(c))
            parts.append(f'<polyline fill="none" stroke="{COLORS[policy]}" '
                         f'stroke-width="1.2" points="{pts}"/>')
    for i, policy in enumerate(POLICIES):
        x = 60 + i * 200
        parts.append(f'<rect x="{x}" y="{h + 12}" width="12" height="4" '
                     f'fill="{COLORS[policy]}"/><text x="{x + 16}" '
                     f'y="{h + 18}">{policy}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--svg", help="write the loss curves here")
    args = ap.parse_args()
    curves = {}
    print(f"| model | policy | mean loss, steps 1-{WINDOW} | "
          f"mean loss, last {WINDOW} | vs fp32 |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, lr in MODELS:
            curves[name] = {}
            base = None
            for policy in POLICIES:
                loss = train(args.build, model, lr, policy, args.steps,
                             args.seed, tmp)
                curves[name][policy] = running_mean(loss, SMOOTH)
                first = sum(loss[:WINDOW]) / WINDOW
                last = sum(loss[-WINDOW:]) / WINDOW
                base = last if base is None else base
                print(f"| {name} | {policy} | {first:.4f} | {last:.4f} | "
                      f"{100 * (last / base - 1):+.2f} % |", flush=True)
    if args.svg:
        with open(args.svg, "w") as f:
            f.write(svg(curves, args.steps))


if __name__ == "__main__":
    sys.exit(main())
