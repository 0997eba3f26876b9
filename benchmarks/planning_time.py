#!/usr/bin/env python3
"""Times megaslide-plan as the layer count doubles.

Writes one JSON config per layer count (a base config, by default the
megaslide-105b preset's, with `num_layers` changed), plans each in turn
with the same video and flags, and prints, per row, the ops of the built
module and, for the whole `megaslide-plan --format json` process, its
wall-clock seconds, its CPU seconds (user + system, which other work on a
shared machine disturbs less) and the in-process pipeline seconds, each the
fastest of --repeat runs (the one least disturbed by other work, as
`timeit` reports) and each with its growth from the row before.
Linear-time planning grows about 2x per doubling; the goal is at most 2.2x.

Times on a shared machine scatter; --instructions also counts the
instructions each plan executes (one more run under valgrind's callgrind,
about 50 times slower), a figure that does not depend on the machine's load
or caches.

Usage: benchmarks/planning_time.py [--build-dir build] [--repeat 3]
           [--layers 52,104,208,416,832] [--timeout 600] [--instructions]
           [-- PLAN FLAGS...]
"""

import argparse
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time


def count_instructions(cmd, tmp):
    """Instructions `cmd` executes, as valgrind's callgrind counts them."""
    out = os.path.join(tmp, "callgrind.out")
    run = subprocess.run(["valgrind", "--tool=callgrind",
                          f"--callgrind-out-file={out}", *cmd],
                         capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if run.returncode not in (0, 3) or not found:
        sys.exit(f"valgrind failed ({run.returncode}): {run.stderr[-2000:]}")
    os.remove(out)
    return int(found.group(1))


def main():
    root = pathlib.Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=root / "build", type=pathlib.Path)
    parser.add_argument("--base", default=root / "configs" / "megaslide-105b.json",
                        type=pathlib.Path, help="config whose num_layers changes")
    parser.add_argument("--layers", default="52,104,208,416,832",
                        help="comma-separated layer counts")
    parser.add_argument("--frames", default=81, type=int)
    parser.add_argument("--height", default=720, type=int)
    parser.add_argument("--width", default=1280, type=int)
    parser.add_argument("--repeat", default=3, type=int)
    parser.add_argument("--timeout", default=600, type=float,
                        help="seconds per run; later rows are skipped after one")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions with valgrind")
    parser.add_argument("flags", nargs="*",
                        help="more megaslide-plan flags, after `--`")
    args = parser.parse_args()
    plan = args.build_dir / "bin" / "megaslide-plan"
    base = json.loads(args.base.read_text())
    layers = [int(n) for n in args.layers.split(",")]

    print(f"base {args.base.name}, video {args.frames}x{args.height}x"
          f"{args.width}, flags {' '.join(args.flags) or '(defaults)'}")
    print(f"{'layers':>6} {'ops':>8} {'wall s':>8} {'x':>5} {'cpu s':>8} "
          f"{'x':>5} {'pipeline s':>10} {'x':>5} {'fits':>5}"
          + (f" {'instructions':>15} {'x':>5}" if args.instructions else ""))
    previous = ()
    with tempfile.TemporaryDirectory() as tmp:
        for n in layers:
            config = pathlib.Path(tmp) / f"layers-{n}.json"
            config.write_text(json.dumps(
                {**base, "name": f"{base.get('name', 'model')}-{n}l",
                 "num_layers": n}))
            cmd = [str(plan), "--model", str(config),
                   "--frames", str(args.frames), "--height", str(args.height),
                   "--width", str(args.width), "--format", "json", *args.flags]
            walls, cpus, pipelines = [], [], []
            info = None
            for _ in range(args.repeat):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                try:
                    run = subprocess.run(cmd, capture_output=True, text=True,
                                         timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"{n:>6} {'':>8} {'>' + format(args.timeout, '.0f'):>8}"
                          f"  (timed out; larger counts skipped)")
                    return
                walls.append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpus.append(after.ru_utime - before.ru_utime +
                            after.ru_stime - before.ru_stime)
                if run.returncode not in (0, 3):
                    sys.exit(f"megaslide-plan failed ({run.returncode}) for "
                             f"{n} layers: {run.stderr}")
                info = json.loads(run.stdout)
                pipelines.append(info["ir"]["pipeline_seconds"])
            row = (min(walls), min(cpus), min(pipelines))
            if args.instructions:
                row += (count_instructions(cmd, tmp),)
            growth = [f"{now / then:.2f}" for now, then in zip(row, previous)]
            growth += [""] * (len(row) - len(growth))
            line = (f"{n:>6} {info['ir']['ops']:>8} {row[0]:>8.3f} "
                    f"{growth[0]:>5} {row[1]:>8.3f} {growth[1]:>5} "
                    f"{row[2]:>10.3f} {growth[2]:>5} "
                    f"{'yes' if info['fits'] else 'no':>5}")
            if args.instructions:
                line += f" {row[3]:>15,} {growth[3]:>5}"
            print(line, flush=True)
            previous = row


if __name__ == "__main__":
    main()
