#!/usr/bin/env python3
"""Are a build's plans byte-identical to another build's?

A refactoring that must not change behaviour is checked by planning every
preset at its reference size, under each policy, with two builds: the JSON
reports, the planned modules and the exported execution plans must match
byte for byte (docs/Testing.md).

  scripts/plan_identity.py --build build-old --out /tmp/old
  scripts/plan_identity.py --build build --out /tmp/new --compare /tmp/old

The wall-clock fields (`ir.build_seconds`, `ir.pipeline_seconds`, the
text report's "in N s"; docs/PlanSchema.md) are masked before comparing;
nothing else is.

Exit status: 0 identical, 1 some output differs or a command failed.
"""
import argparse
import difflib
import os
import re
import subprocess
import sys
import time

# Each preset at the size its docs and tests use.
PRESETS = [
    ("tiny", []),
    ("dit-xl-2", ["--frames", "1", "--height", "256", "--width", "256"]),
    ("wan2.1-t2v-14b", ["--frames", "81", "--height", "480", "--width", "832"]),
    ("megaslide-105b", ["--frames", "81", "--height", "720", "--width", "1280"]),
]
# Planning choices, each a variation of the defaults.
VARIANTS = [
    ("default", []),
    ("keep", ["--activation-policy", "keep"]),
    ("recompute", ["--activation-policy", "recompute"]),
    ("offload", ["--activation-policy", "offload"]),
    ("persistent-bf16", ["--host-state-policy", "persistent-bf16"]),
    ("bf16-moments", ["--host-state-policy", "bf16-moments"]),
    ("global", ["--attention", "global"]),
    ("f32", ["--precision", "f32"]),
    ("small-gpu", ["--gpu-mem", "40GB", "--buffers", "3", "--prefetch", "2"]),
]
TINY_SIZE = ["--frames", "17", "--height", "64", "--width", "64"]
WALL_CLOCK = [
    (re.compile(rb'("(?:build|pipeline)_seconds": )[0-9.e+-]+'), rb"\1<wall>"),
    (re.compile(rb"(analysed [0-9,]+ ops in )[0-9.]+ s"), rb"\1<wall> s"),
]


def masked(path):
    with open(path, "rb") as f:
        data = f.read()
    for pattern, repl in WALL_CLOCK:
        data = pattern.sub(repl, data)
    return data


def cases():
    """(name, tool, args, outputs): outputs are the files the tool writes."""
    for model, size in PRESETS:
        size = size or TINY_SIZE
        for variant, flags in VARIANTS:
            base = f"{model}.{variant}"
            args = ["--model", model, *size, *flags]
            yield (f"{base}.plan", "megaslide-plan",
                   args + ["--format", "json", "-o", "{out}/" + base + ".json",
                           "--emit-plan-mlir", "{out}/" + base + ".mlir"])
            yield (f"{base}.text", "megaslide-plan",
                   args + ["-o", "{out}/" + base + ".txt"])
        # The exported execution plan (sim holds no state, so any size).
        yield (f"{model}.exec", "megaslide-run",
               ["--model", model, *size, "--backend", "sim", "--steps", "0",
                "--no-progress", "--save-plan", "{out}/" + model + ".exec.json"])
    # The saved test plans: tiny with 3D-DSA self-attention.
    yield ("tiny-dsa.exec", "megaslide-run",
           ["--model", "tiny", "--backend", "sim", "--steps", "0",
            "--no-progress", "--dsa-window", "3,4,4", "--dsa-tile", "1,2,2",
            "--dsa-radius", "1", "--save-plan", "{out}/tiny-dsa.exec.json"])


def show_difference(old, new, most=8):
    """The first differing lines; JSON strings (kernel sources) split too."""
    def lines(path):
        return masked(path).replace(b"\\n", b"\n").decode(
            errors="replace").split("\n")
    diff = [d for d in difflib.unified_diff(lines(old), lines(new), n=0,
                                            lineterm="")
            if d[:1] in "+-" and d[:3] not in ("---", "+++")]
    for d in diff[:most]:
        print("    " + d[:200])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="build directory (bin/)")
    ap.add_argument("--out", required=True, help="directory to write into")
    ap.add_argument("--compare", help="outputs of another build to compare with")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    failed = 0
    for name, tool, args in cases():
        argv = [os.path.join(a.build, "bin", tool)] + [
            x.replace("{out}", a.out) for x in args]
        t = time.time()
        r = subprocess.run(argv, capture_output=True, text=True)
        # 3 is "does not fit": its report is still written and compared.
        if r.returncode not in (0, 3):
            print(f"FAIL {name}: exit {r.returncode}\n{r.stderr}")
            failed += 1
            continue
        with open(os.path.join(a.out, name + ".exit"), "w") as f:
            f.write(f"{r.returncode}\n")
        print(f"ran {name} ({time.time() - t:.1f} s)", flush=True)
    if a.compare:
        mine, theirs = sorted(os.listdir(a.out)), sorted(os.listdir(a.compare))
        if mine != theirs:
            print("FAIL different files:",
                  sorted(set(mine) ^ set(theirs)))
            failed += 1
        same = 0
        for f in sorted(set(mine) & set(theirs)):
            if masked(os.path.join(a.out, f)) == masked(
                    os.path.join(a.compare, f)):
                same += 1
            else:
                print(f"FAIL {f} differs:")
                show_difference(os.path.join(a.compare, f),
                                os.path.join(a.out, f))
                failed += 1
        print(f"{same} of {len(theirs)} files byte-identical to {a.compare}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
