#!/usr/bin/env python3
"""Checks the marked blocks of a Markdown guide against the tree.

A fenced block right after an HTML comment

  <!-- doc-check: excerpt FILE -->  must appear verbatim (whole lines, in
                                    order, contiguous) in FILE, relative to
                                    --src;
  <!-- doc-check: file NAME -->     is written to NAME in --workdir, for the
                                    run blocks after it (e.g. a patch);
  <!-- doc-check: run -->           is run by bash (errexit, pipefail) in
                                    --workdir, after the run blocks before it,
                                    with $MEGASLIDE_SRC set to --src;
  <!-- doc-check: output -->        must equal what the run block before it
                                    printed (stdout and stderr), except the
                                    line and column of a diagnostic
                                    (`file:12:3: remark: ...`);
  <!-- doc-check: output, numbers within R -->  the same, except that each
                                    number may differ from the shown one by
                                    R relative: for figures of a floating
                                    point computation whose last digits
                                    depend on the CPU's instruction set.

The tools given with --tool come first on PATH, so the guide's commands
run the build's binaries exactly as a reader types them.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys

MARKER = re.compile(r"^<!-- doc-check: ((?:excerpt|file) (\S+)|run|"
                    r"output(?:, numbers within (\S+))?) -->$")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
LOCATION = re.compile(r"^(\S+?):\d+:\d+: ", re.M)


def blocks(doc):
    """(kind, argument, text, line number) of every marked block."""
    lines = open(doc, encoding="utf-8").read().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or not lines[j].startswith("```"):
            sys.exit(f"{doc}:{i + 1}: a doc-check marker must precede a fenced block")
        end = next((k for k in range(j + 1, len(lines))
                    if lines[k].startswith("```")), None)
        if end is None:
            sys.exit(f"{doc}:{j + 1}: unterminated fenced block")
        kind = m.group(1).split()[0].rstrip(",")
        argument = m.group(2) if m.group(2) is not None else m.group(3)
        if argument is not None and kind == "output":
            try:
                argument = float(argument)
            except ValueError:
                sys.exit(f"{doc}:{i + 1}: 'numbers within' needs a number, "
                         f"not '{argument}'")
        found.append((kind, argument, "\n".join(lines[j + 1:end]), j + 1))
    return found


def contains(haystack, needle):
    hay, need = haystack.split("\n"), needle.split("\n")
    return any(hay[k:k + len(need)] == need
               for k in range(len(hay) - len(need) + 1))


def same_output(expected, actual, within):
    """Whether `actual` is `expected`, numbers within `within` relative."""
    if within is None:
        return expected == actual
    if NUMBER.split(expected) != NUMBER.split(actual):
        return False
    shown, printed = NUMBER.findall(expected), NUMBER.findall(actual)
    return len(shown) == len(printed) and all(
        abs(float(a) - float(b)) <= within * max(abs(float(a)), abs(float(b)))
        for a, b in zip(shown, printed))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("doc")
    parser.add_argument("--src", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--tool", action="append", default=[])
    args = parser.parse_args()

    env = dict(os.environ)
    tool_dirs = [os.path.dirname(os.path.abspath(t)) for t in args.tool]
    env["PATH"] = os.pathsep.join(tool_dirs + [env.get("PATH", "")])
    env["MEGASLIDE_SRC"] = os.path.abspath(args.src)

    failures = 0
    counts = {"excerpt": 0, "file": 0, "run": 0, "output": 0}
    printed = None  # output of the last run block, until an output block
    for kind, argument, text, line in blocks(args.doc):
        where = f"{args.doc}:{line}"
        counts[kind] += 1
        if kind == "excerpt":
            path = os.path.join(args.src, argument)
            if not contains(open(path, encoding="utf-8").read(), text):
                print(f"{where}: error: block is not an excerpt of {argument}")
                failures += 1
        elif kind == "file":
            with open(os.path.join(args.workdir, argument), "w",
                      encoding="utf-8") as f:
                f.write(text + "\n")
        elif kind == "run":
            print(f"{where}: running:\n{text}")
            ran = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text],
                                 cwd=args.workdir, env=env, text=True,
                                 stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
            printed = ran.stdout
            if ran.returncode != 0:
                print(f"{where}: error: exit code {ran.returncode}; output:\n"
                      f"{printed}")
                return 1  # later blocks depend on this one
        else:
            if printed is None:
                print(f"{where}: error: output block without a run block")
                failures += 1
                continue
            expected = LOCATION.sub(r"\1:L:C: ", text.strip("\n"))
            actual = LOCATION.sub(r"\1:L:C: ", printed.strip("\n"))
            if not same_output(expected, actual, argument):
                print(f"{where}: error: the commands print something else:")
                sys.stdout.writelines(difflib.unified_diff(
                    (expected + "\n").splitlines(True),
                    (actual + "\n").splitlines(True), "documented", "actual"))
                failures += 1
            printed = None
    if counts["run"] == 0:
        print(f"{args.doc}: error: no doc-check run block")
        failures += 1
    print(f"checked {counts['excerpt']} excerpts, {counts['file']} files, "
          f"{counts['run']} run blocks, {counts['output']} outputs: "
          f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
