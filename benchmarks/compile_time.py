#!/usr/bin/env python3
"""Times building, verifying and planning each preset's training step.

Side by side in one run, so the ratios between presets hold on a noisy
machine. Figures per preset, median of --repeat runs:
  build      in-process build + verify + analysis (`ir.build_seconds`)
  pipeline   in-process `megaslide-pipeline` (`ir.pipeline_seconds`)
  plan       whole `megaslide-plan --emit-mlir` process (build, pipeline,
             report, printing)
  reparse    `megaslide-opt` parsing and re-verifying the emitted module

Usage: benchmarks/compile_time.py [--build-dir build] [--repeat 5]
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

PRESETS = [
    ("tiny", (5, 32, 32)),
    ("dit-xl-2", (1, 256, 256)),
    ("wan2.1-t2v-14b", (81, 720, 1280)),
    ("megaslide-105b", (81, 720, 1280)),
]


def timed(cmd, ok_codes=(0,)):
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode not in ok_codes:
        raise SystemExit(f"{cmd[0]} failed ({run.returncode}): {run.stderr}")
    return time.perf_counter() - start, run.stdout


def main():
    root = pathlib.Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=root / "build", type=pathlib.Path)
    parser.add_argument("--repeat", default=5, type=int)
    args = parser.parse_args()
    plan = args.build_dir / "bin" / "megaslide-plan"
    opt = args.build_dir / "bin" / "megaslide-opt"

    print(f"{'preset':<16} {'video':>14} {'ops':>8} {'MB':>6} "
          f"{'build s':>8} {'pipeline s':>10} {'plan s':>8} {'reparse s':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (f, h, w) in PRESETS:
            mlir = pathlib.Path(tmp) / f"{name}.mlir"
            builds, pipelines, plans, reparses = [], [], [], []
            for _ in range(args.repeat):
                seconds, out = timed([plan, "--model", name, "--frames", str(f),
                                      "--height", str(h), "--width", str(w),
                                      "--format", "json", "--emit-mlir", mlir],
                                     ok_codes=(0, 3))
                info = json.loads(out)
                plans.append(seconds)
                builds.append(info["ir"]["build_seconds"])
                pipelines.append(info["ir"]["pipeline_seconds"])
                reparses.append(timed([opt, mlir, "-o", "/dev/null"])[0])
            print(f"{name:<16} {f'{f}x{h}x{w}':>14} {info['ir']['ops']:>8} "
                  f"{mlir.stat().st_size / 1e6:>6.1f} "
                  f"{statistics.median(builds):>8.3f} "
                  f"{statistics.median(pipelines):>10.3f} "
                  f"{statistics.median(plans):>8.3f} "
                  f"{statistics.median(reparses):>9.3f}")


if __name__ == "__main__":
    main()
