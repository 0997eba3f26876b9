#!/usr/bin/env python3
"""Compares a run (the cuda backend) with the cpu backend's reference: the
losses of every step and, optionally, the gradients of the last step.

    python3 scripts/compare_steps.py WANT.jsonl GOT.jsonl [--steps N]
        [--gradients WANT.safetensors GOT.safetensors] [--json FILE]

Metrics files are megaslide-run/megaslide-exec --metrics output, one line
per step: {"step": N, "loss": L, "seconds": S} (loss null when the step
was skipped or the backend computes none). Gradient files are
--save-gradients output (safetensors, one tensor per parameter).

Rules (the same weights and data; only bf16 rounding and summation order
differ, and AdamW amplifies those a little over the steps):
  loss: |got - want| / max(|want|, 1e-6) <= --loss-tol-first (1e-2) at
        the first step, <= --loss-tol (5e-2) at every later one;
  gradients: per tensor, max|got - want| <= --grad-tol (5e-2, bf16
        compute) * max(--grad-floor (1e-3), max|want|).
Exit status 0 when everything agrees, 1 when something differs or is
missing, 2 for unreadable input.
"""

import argparse
import json
import math
import struct
import sys

import numpy as np


class InputError(Exception):
    pass


def read_metrics(path):
    """{step: (loss or None, seconds)} of a metrics JSONL file."""
    steps = {}
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise InputError("%s: %s" % (path, e.strerror))
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
            loss = rec.get("loss")
            steps[step] = (None if loss is None else float(loss),
                           float(rec.get("seconds", math.nan)))
        except (ValueError, KeyError, TypeError) as e:
            raise InputError("%s:%d: not a metrics line (%s)" % (path, i, e))
    return steps


DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype("<u2")}


def read_safetensors(path):
    """{name: float32 array} of a safetensors file (F32, BF16, F16):
    8-byte little-endian header length, JSON header, raw data."""
    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise InputError("%s: %s" % (path, e.strerror))
    if len(data) < 8:
        raise InputError("%s: too short for a safetensors file" % path)
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise InputError("%s: header of %d bytes past the end of the file"
                         % (path, n))
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise InputError("%s: header is not JSON (%s)" % (path, e))
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise InputError("%s: tensor '%s' has dtype %s (F32, BF16 or F16 "
                             "expected)" % (path, name, info.get("dtype")))
        shape = [int(d) for d in info["shape"]]
        begin, end = (int(x) for x in info["data_offsets"])
        count = int(np.prod(shape))
        if not 0 <= begin <= end <= len(body) or \
                end - begin != count * dtype.itemsize:
            raise InputError("%s: tensor '%s': data_offsets %s do not hold "
                             "%s %s" % (path, name, [begin, end], shape,
                                        info["dtype"]))
        raw = np.frombuffer(body[begin:end], dtype)
        if info["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.astype(np.float32).reshape(shape)
    return tensors


def compare_losses(want, got, steps, tol_first, tol):
    """Rows (step, want, got, rel, tol, ok) and problems."""
    problems = []
    if steps is not None:
        for label, m in (("reference", want), ("run", got)):
            if len(m) != steps:
                problems.append("expected %d steps, the %s logged %d"
                                % (steps, label, len(m)))
    if sorted(want) != sorted(got):
        problems.append("the step numbers differ: reference %s, run %s"
                        % (sorted(want), sorted(got)))
    rows = []
    common = sorted(set(want) & set(got))
    for i, step in enumerate(common):
        w, g = want[step][0], got[step][0]
        limit = tol_first if i == 0 else tol
        if w is None or g is None:
            ok = w is None and g is None  # both skipped the step
            rel = None
        else:
            rel = abs(g - w) / max(abs(w), 1e-6)
            ok = rel <= limit
        rows.append({"step": step, "want": w, "got": g, "rel": rel,
                     "tol": limit, "ok": ok})
    if common and all(r["want"] is None for r in rows):
        problems.append("no step has a loss to compare")
    if not common:
        problems.append("no step to compare")
    return rows, problems


def compare_gradients(want, got, tol, floor):
    """Rows per tensor (worst first) and problems."""
    problems = []
    for name in sorted(set(want) - set(got)):
        problems.append("gradient '%s' is missing from the run's file" % name)
    for name in sorted(set(got) - set(want)):
        problems.append("gradient '%s' is not in the reference file" % name)
    rows = []
    for name in sorted(set(want) & set(got)):
        w, g = want[name], got[name]
        if w.shape != g.shape:
            problems.append("gradient '%s': shape %s, the reference's %s"
                            % (name, list(g.shape), list(w.shape)))
            continue
        peak = float(np.abs(w).max()) if w.size else 0.0
        scale = max(floor, peak)
        finite = bool(np.isfinite(g).all())
        err = float(np.abs(g.astype(np.float64) - w).max()) if w.size else 0.0
        rows.append({"name": name, "shape": list(w.shape), "max_want": peak,
                     "max_err": err if finite else None,
                     "rel": err / scale if finite else None,
                     "ok": finite and err / scale <= tol})
    rows.sort(key=lambda r: -math.inf if r["rel"] is None else -r["rel"])
    return rows, problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("want", help="reference metrics (cpu backend)")
    parser.add_argument("got", help="metrics of the run to check (cuda)")
    parser.add_argument("--steps", type=int,
                        help="both must have logged exactly this many steps")
    parser.add_argument("--gradients", nargs=2, metavar=("WANT", "GOT"),
                        help="safetensors gradients of the last step")
    parser.add_argument("--loss-tol-first", type=float, default=1e-2)
    parser.add_argument("--loss-tol", type=float, default=5e-2)
    parser.add_argument("--grad-tol", type=float, default=5e-2)
    parser.add_argument("--grad-floor", type=float, default=1e-3)
    parser.add_argument("--top", type=int, default=20,
                        help="gradient rows printed (failures always)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    try:
        want, got = read_metrics(args.want), read_metrics(args.got)
        grads = None
        if args.gradients:
            grads = [read_safetensors(p) for p in args.gradients]
    except InputError as e:
        print("compare_steps: %s" % e, file=sys.stderr)
        return 2

    rows, problems = compare_losses(want, got, args.steps,
                                    args.loss_tol_first, args.loss_tol)

    def fmt(x):
        return "%12s" % ("null" if x is None else "%.6f" % x)
    print("step  %12s %12s %9s  %7s" % ("want", "got", "rel", "tol"))
    for r in rows:
        print("%4d  %s %s %9s  %7.0e  %s" % (
            r["step"], fmt(r["want"]), fmt(r["got"]),
            "-" if r["rel"] is None else "%.2e" % r["rel"], r["tol"],
            "ok" if r["ok"] else "FAIL"))
    times = {label: [m[s][1] for s in sorted(m)[1:]]
             for label, m in (("want", want), ("got", got))}
    if times["want"] and times["got"]:
        print("mean step after the first: want %.4f s, got %.4f s" % (
            np.mean(times["want"]), np.mean(times["got"])))
    report = {"losses": rows, "problems": problems,
              "tolerances": {"loss_first": args.loss_tol_first,
                             "loss": args.loss_tol, "grad": args.grad_tol,
                             "grad_floor": args.grad_floor}}
    ok = not problems and all(r["ok"] for r in rows)

    if grads is not None:
        grows, gproblems = compare_gradients(grads[0], grads[1],
                                             args.grad_tol, args.grad_floor)
        problems += gproblems
        print("\n%-48s %14s %10s %10s %9s" % ("gradient (worst first)",
                                              "shape", "max|want|",
                                              "max|err|", "err/scale"))
        for i, r in enumerate(grows):
            if i >= args.top and r["ok"]:
                continue
            print("%-48s %14s %10.3e %10s %9s  %s" % (
                r["name"], "x".join(map(str, r["shape"])), r["max_want"],
                "non-finite" if r["max_err"] is None else
                "%.3e" % r["max_err"],
                "-" if r["rel"] is None else "%.2e" % r["rel"],
                "ok" if r["ok"] else "FAIL"))
        bad = sum(not r["ok"] for r in grows)
        print("%d gradients, %d beyond max|err| <= %g * max(%g, max|want|)"
              % (len(grows), bad, args.grad_tol, args.grad_floor))
        report["gradients"] = grows
        ok &= not gproblems and bad == 0
    for p in problems:
        print("compare_steps: %s" % p)
    print("compare_steps: %s" % ("agree" if ok else "DIFFER"))
    report["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
