"""Compares the plans of one step built with bf16 and with f32 compute.

Usage: compare_precision.py BF16.json F32.json. Prints one line per figure
that f32 compute should double: `<figure>: x2` when the f32 figure is twice
the bf16 one (activations: within 0.1%, as the fp32 loss, log-sum-exps and
int offsets are the same size in both), else `<figure>: <bf16> -> <f32>`.
"""

import json
import sys

bf16, f32 = (json.load(open(path)) for path in sys.argv[1:3])


def figure(plan, path):
    for key in path.split("."):
        plan = plan[key]
    return plan


for path, exact in (("device.by_category.activations", False),
                    ("device.by_category.weights", True),
                    ("transfers.h2d_by_kind.weights", True),
                    ("transfers.d2h_by_kind.gradients", True),
                    ("host.by_category.fp32 master weights", None),
                    ("host.by_category.AdamW moments", None)):
    a, b = figure(bf16, path), figure(f32, path)
    if exact is None:  # persistent state: fp32 either way
        print(f"{path}: {'same' if a == b else f'{a} -> {b}'}")
    elif b == 2 * a if exact else abs(b - 2 * a) <= 1e-3 * b:
        print(f"{path}: x2")
    else:
        print(f"{path}: {a} -> {b}")
