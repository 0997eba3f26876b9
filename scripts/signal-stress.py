#!/usr/bin/env python3
"""Stops megaslide-run with one or two signals at random points, many times.

    scripts/signal-stress.py [--trials N] [--tools DIR] [--seed S]

Each trial starts a tiny run with a checkpoint folder, a metrics log and a
report, waits until the log holds a random number of steps (0 to 12, so
compile, steps, checkpoints and the report are all hit), sends SIGINT or
SIGTERM and, in two trials of three, the same signal again 0-80 ms later.
The documented outcomes (docs/Training.md, "Stopping a run") are the only
ones accepted: 128 + signal (the first signal ended the run at a step
boundary) or death by that signal (the second one ended it at once). Also
checked: no sanitizer report on stderr; every metrics line is whole JSON;
no checkpoint folder is half-written (only ".tmp-*" may be left, which the
next run removes); and the newest checkpoint, if any, resumes.

The default tools are the ASan+UBSan build (build-sanitize/, made by
scripts/sanitize.sh), so a race on the stop path shows as a report with a
stack rather than as a rare crash. scripts/sanitize.sh runs a short round;
docs/Testing.md ("Hardening") has the long runs and their figures.
"""

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                   "runtime error:", "corrupted", "double free",
                   "malloc():", "free():")


def trial(run, folder, rng):
    """One run stopped by one or two signals; the problems it shows."""
    metrics, ck = folder / "m.jsonl", folder / "ck"
    args = [run, "--no-progress", "--model", "tiny", "--steps", "40",
            "--checkpoint-dir", ck, "--checkpoint-every", "3",
            "--metrics", metrics, "--report", folder / "r.html"]
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    wait_lines = rng.randrange(0, 13)
    second = rng.random() < 2 / 3
    gap = rng.uniform(0, 0.08)
    proc = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    # Steps are counted by lines; 0 lines: the signal lands while the plan
    # is made or the first step runs (after the handlers are installed,
    # which the banner's first line follows).
    while proc.poll() is None and time.time() < deadline:
        if metrics.exists() and \
                metrics.read_text(errors="replace").count("\n") >= wait_lines:
            break
        time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(sig)
        if second:
            time.sleep(gap)
            if proc.poll() is None:
                proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return [f"hung after {sig.name}"], out, err
    problems = []
    rc = proc.returncode
    if rc not in (0, 128 + sig, -sig):
        problems.append(f"exit {rc} after {sig.name}"
                        f"{' twice' if second else ''}")
    for mark in SANITIZER_MARKS:
        if mark in err:
            problems.append(f"stderr says '{mark}'")
    if metrics.exists():
        for n, line in enumerate(metrics.read_text().splitlines(), 1):
            try:
                json.loads(line)
            except ValueError:
                problems.append(f"metrics line {n} is not JSON: {line[:80]!r}")
    if ck.exists():
        steps = sorted(p for p in ck.iterdir()
                       if p.name.startswith("step-"))
        for p in steps:
            if not (p / "manifest.json").exists():
                problems.append(f"checkpoint {p.name} has no manifest")
        if steps and not problems and rc != 0:
            resumed = subprocess.run(
                [str(run), "--no-progress", "--model", "tiny", "--steps", "1",
                 "--checkpoint-dir", str(ck), "--resume"],
                capture_output=True, text=True, timeout=300)
            if resumed.returncode != 0:
                problems.append("the newest checkpoint does not resume: " +
                                resumed.stderr.strip()[-300:])
    return problems, out, err


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--tools", default=str(ROOT / "build-sanitize/bin"))
    parser.add_argument("--seed", type=int, default=None)
    a = parser.parse_args()
    run = pathlib.Path(a.tools) / "megaslide-run"
    if not os.access(run, os.X_OK):
        sys.exit(f"signal-stress: {run} not found; build it "
                 "(scripts/sanitize.sh builds build-sanitize/)")
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"signal-stress: {a.trials} trials of {run} (seed {seed})",
          flush=True)
    failures, start = 0, time.time()
    for i in range(a.trials):
        folder = pathlib.Path(tempfile.mkdtemp(prefix="megaslide-signal-"))
        try:
            problems, out, err = trial(run, folder, rng)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if problems:
            failures += 1
            print(f"trial {i}: " + "; ".join(problems), flush=True)
            print("  stderr (end): " + err[-2000:].replace("\n", "\n  "),
                  flush=True)
    print(f"signal-stress: {a.trials} trials, {failures} failed "
          f"({time.time() - start:.0f} s)", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
