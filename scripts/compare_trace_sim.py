#!/usr/bin/env python3
"""Per-op-kind times of a measured run (the cuda backend's Chrome trace)
against the sim backend's prediction for the same plan.

    python3 scripts/compare_trace_sim.py MEASURED.json PREDICTED.json
        [--warmup N] [--json FILE]

Both traces come from megaslide-run/megaslide-exec --trace FILE
(runtime/trace/ChromeTrace.cpp): complete events ("ph": "X") named
"OP" or "OP PARAM" (PARAM: a parameter name for fetch/host_adamw/...),
ts and dur in microseconds, one tid per stream, args.instruction = the
plan instruction. Steps follow each other on the time axis; the k-th span
of an instruction belongs to step k. The kind of a span is OP.

Per kind: spans per step, measured and predicted time per step (sums of
span durations, so overlapping streams count in full), and their ratio;
then the step's extent (first start to last end). The measured trace's
first --warmup steps are dropped (default 1 when it has >= 2 steps); the
prediction is the mean of its steps (sim steps are identical).

Exit status 1 when the two traces disagree on the name of some
instruction (not the same plan), 2 for unusable input, else 0.
"""

import argparse
import collections
import json
import sys


class InputError(Exception):
    pass


def read_trace(path):
    """Steps of a trace: a list of {instruction: (name, stream, dur s)},
    and each step's extent in seconds."""
    try:
        events = json.load(open(path))["traceEvents"]
    except OSError as e:
        raise InputError("%s: %s" % (path, e.strerror))
    except (ValueError, KeyError, TypeError) as e:
        raise InputError("%s: not a Chrome trace (%s)" % (path, e))
    streams = {e.get("tid"): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps, seen = [], collections.Counter()
    bounds = []
    for e in events:
        if e.get("ph") != "X":
            continue
        try:
            inst = int(e["args"]["instruction"])
            start, dur = float(e["ts"]) * 1e-6, float(e["dur"]) * 1e-6
        except (KeyError, TypeError, ValueError):
            raise InputError("%s: span without args.instruction, ts or dur: "
                             "%s" % (path, json.dumps(e)[:200]))
        k = seen[inst]
        seen[inst] += 1
        if k == len(steps):
            steps.append({})
            bounds.append([start, start + dur])
        steps[k][inst] = (e["name"], streams.get(e.get("tid"), e.get("tid")),
                          dur)
        bounds[k] = [min(bounds[k][0], start), max(bounds[k][1], start + dur)]
    if not steps:
        raise InputError("%s: no spans (was the run traced?)" % path)
    return steps, [hi - lo for lo, hi in bounds]


def kind_of(name):
    return name.split(" ", 1)[0]


def per_kind(steps):
    """{kind: (spans per step, seconds per step)}, means over `steps`."""
    count, total = collections.Counter(), collections.Counter()
    for step in steps:
        for name, _, dur in step.values():
            count[kind_of(name)] += 1
            total[kind_of(name)] += dur
    n = len(steps)
    return {k: (count[k] / n, total[k] / n) for k in count}


def name_differences(measured, predicted):
    """Instructions whose names differ, and those only one trace has."""
    renamed = [(i, measured[i][0], predicted[i][0])
               for i in sorted(set(measured) & set(predicted))
               if measured[i][0] != predicted[i][0]]
    only_measured = sorted(set(measured) - set(predicted))
    only_predicted = sorted(set(predicted) - set(measured))
    return renamed, only_measured, only_predicted


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("measured", help="trace of the run (cuda)")
    parser.add_argument("predicted", help="trace of the sim backend")
    parser.add_argument("--warmup", type=int,
                        help="measured steps to drop (default: 1 when there "
                             "are >= 2)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    try:
        measured, m_extent = read_trace(args.measured)
        predicted, p_extent = read_trace(args.predicted)
    except InputError as e:
        print("compare_trace_sim: %s" % e, file=sys.stderr)
        return 2
    warmup = args.warmup if args.warmup is not None else \
        (1 if len(measured) >= 2 else 0)
    if warmup >= len(measured):
        print("compare_trace_sim: --warmup %d leaves none of the %d measured "
              "steps" % (warmup, len(measured)), file=sys.stderr)
        return 2
    kept = measured[warmup:]

    renamed, only_m, only_p = name_differences(kept[0], predicted[0])
    if renamed:
        print("span names differ at %d instructions (not the same plan?), "
              "e.g.:" % len(renamed))
        for i, m, p in renamed[:5]:
            print("  #%d  measured '%s', predicted '%s'" % (i, m, p))
    for label, insts, trace in (("measured", only_m, kept[0]),
                                ("predicted", only_p, predicted[0])):
        if insts:
            print("%d instructions only in the %s trace, e.g. %s" % (
                len(insts), label, ", ".join("#%d %s" % (i, trace[i][0])
                                             for i in insts[:3])))

    m, p = per_kind(kept), per_kind(predicted)
    rows = []
    for kind in sorted(set(m) | set(p),
                       key=lambda k: -max(m.get(k, (0, 0))[1],
                                          p.get(k, (0, 0))[1])):
        mc, mt = m.get(kind, (0, 0.0))
        pc, pt = p.get(kind, (0, 0.0))
        rows.append({"kind": kind, "count": mc, "predicted_count": pc,
                     "measured_s": mt, "predicted_s": pt,
                     "ratio": mt / pt if pt > 0 else None})
    extent = sum(m_extent[warmup:]) / len(kept)
    predicted_extent = sum(p_extent) / len(p_extent)
    step = {"measured_s": extent, "predicted_s": predicted_extent,
            "ratio": extent / predicted_extent if predicted_extent > 0
            else None,
            "busy_measured_s": sum(r["measured_s"] for r in rows),
            "busy_predicted_s": sum(r["predicted_s"] for r in rows)}

    def ratio(x):
        return "%9s" % ("-" if x is None else "%.2f" % x)
    print("per step, measured: mean of %d step(s) after %d warm-up; "
          "predicted: %d sim step(s)" % (len(kept), warmup, len(predicted)))
    print("%-26s %7s %12s %12s %9s" % ("kind", "count", "measured ms",
                                       "predicted ms", "ratio"))
    for r in rows:
        count = ("%g" % r["count"] if r["count"] == r["predicted_count"]
                 else "%g/%g" % (r["count"], r["predicted_count"]))
        print("%-26s %7s %12.4f %12.4f %s" % (
            r["kind"], count, r["measured_s"] * 1e3, r["predicted_s"] * 1e3,
            ratio(r["ratio"])))
    print("%-26s %7s %12.4f %12.4f %s" % (
        "sum of spans", "", step["busy_measured_s"] * 1e3,
        step["busy_predicted_s"] * 1e3,
        ratio(step["busy_measured_s"] / step["busy_predicted_s"]
              if step["busy_predicted_s"] > 0 else None)))
    print("%-26s %7s %12.4f %12.4f %s" % (
        "step (first start-last end)", "", extent * 1e3,
        predicted_extent * 1e3, ratio(step["ratio"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"warmup": warmup, "measured_steps": len(kept),
                       "predicted_steps": len(predicted), "kinds": rows,
                       "step": step,
                       "renamed": [{"instruction": i, "measured": a,
                                    "predicted": b} for i, a, b in renamed],
                       "only_measured": only_m, "only_predicted": only_p},
                      f, indent=1)
    return 1 if renamed else 0


if __name__ == "__main__":
    sys.exit(main())
