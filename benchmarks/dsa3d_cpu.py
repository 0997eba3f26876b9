#!/usr/bin/env python3
"""Times CPU 3D-DSA against dense attention as the token count doubles.

Side by side in one run, so the ratios hold on a noisy machine. Both columns
use the same kernel (megaslide.dsa3d, runtime/cpu/Dsa3d.cpp): "dsa" with a
fixed window, "dense" with the window equal to the grid, which is exactly
softmax attention over all tokens. Figures are the median of --repeat runs
of the forward (or, with --backward, of dsa3d_backward, which recomputes
the forward). Growth is the time ratio to the previous grid, whose token
count is half: about 2 for 3D-DSA (linear), about 4 for dense (quadratic).
Short runs are repeated to fill --min-time seconds, after one uncounted
warm-up run. Dense runs predicted (quadratically, from the previous one) to
exceed --dense-limit seconds are skipped.

Usage: benchmarks/dsa3d_cpu.py [--build-dir build] [--repeat 5] [--backward]
Threads: MEGASLIDE_NUM_THREADS (default: all cores).
"""

import argparse
import math
import os
import pathlib
import statistics
import sys
import time

import numpy as np

GRIDS = [(4, 8, 8), (8, 8, 8), (8, 8, 16), (8, 16, 16), (16, 16, 16),
         (16, 16, 32), (16, 32, 32)]


def triple(text):
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected t,y,x, got {text}")
    return values


def main():
    root = pathlib.Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=root / "build", type=pathlib.Path)
    parser.add_argument("--repeat", default=5, type=int)
    parser.add_argument("--window", default=(3, 7, 7), type=triple)
    parser.add_argument("--tile", default=(1, 7, 7), type=triple)
    parser.add_argument("--heads", default=2, type=int)
    parser.add_argument("--head-dim", default=64, type=int)
    parser.add_argument("--min-time", default=1.0, type=float,
                        help="repeat short runs to fill this many seconds")
    parser.add_argument("--dense-limit", default=30.0, type=float,
                        help="skip dense runs predicted to take longer (s)")
    parser.add_argument("--backward", action="store_true",
                        help="time dsa3d_backward instead of the forward")
    args = parser.parse_args()
    sys.path.insert(0, str(args.build_dir / "python_packages"))
    import megaslide

    def seconds(grid, window):
        rng = np.random.default_rng(0)
        shape = (1, args.heads, *grid, args.head_dim)
        q, k, v, d_out = (rng.standard_normal(shape, dtype=np.float32)
                          for _ in range(4))
        tiles = [-(-g // t) for g, t in zip(grid, args.tile)]
        offsets = rng.integers(-2, 3, (1, args.heads, *tiles, window[0], 2),
                               dtype=np.int32)
        def once():
            start = time.perf_counter()
            if args.backward:
                megaslide.dsa3d_backward(q, k, v, offsets, d_out, window,
                                         args.tile)
            else:
                megaslide.dsa3d(q, k, v, offsets, window, args.tile)
            return time.perf_counter() - start

        # An uncounted warm-up run, then at least --repeat runs and, for
        # short runs, enough of them to fill --min-time: the median of many
        # short runs shrugs off bursts of other work on a shared machine.
        warm = once()
        runs = max(args.repeat, min(200, math.ceil(args.min_time / warm)))
        return statistics.median(once() for _ in range(runs))

    threads = os.environ.get("MEGASLIDE_NUM_THREADS", f"{os.cpu_count()} (all)")
    print(f"{'backward' if args.backward else 'forward'}, B=1 H={args.heads} "
          f"D={args.head_dim}, window {args.window}, tile {args.tile}, "
          f"threads {threads}, median of >= {args.repeat} runs "
          f"(>= {args.min_time:g} s for short ones)")
    print(f"{'grid':>10} {'tokens':>7} {'dsa s':>9} {'dense s':>9} "
          f"{'dense/dsa':>9} {'dsa growth':>10} {'dense growth':>12}")
    previous_dsa = previous_dense = None
    previous_tokens = None
    for grid in GRIDS:
        tokens = grid[0] * grid[1] * grid[2]
        dsa = seconds(grid, args.window)
        dense = None
        predicted = (previous_dense * (tokens / previous_tokens) ** 2
                     if previous_dense else 0.0)
        if previous_tokens is None or (previous_dense is not None and
                                       predicted <= args.dense_limit):
            dense = seconds(grid, grid)
        fmt = lambda x, spec: format(x, spec) if x is not None else "-"
        growth = lambda now, before: (now / before if now is not None and
                                      before is not None else None)
        ratio = dense / dsa if dense is not None else None
        print(f"{'x'.join(map(str, grid)):>10} {tokens:>7} {dsa:>9.4f} "
              f"{fmt(dense, '9.4f'):>9} {fmt(ratio, '9.1f'):>9} "
              f"{fmt(growth(dsa, previous_dsa), '10.2f'):>10} "
              f"{fmt(growth(dense, previous_dense), '12.2f'):>12}"
              + ("" if dense is not None else
                 f"   (dense skipped: predicted {predicted:.0f} s)"))
        previous_dsa, previous_dense, previous_tokens = dsa, dense, tokens


if __name__ == "__main__":
    main()
