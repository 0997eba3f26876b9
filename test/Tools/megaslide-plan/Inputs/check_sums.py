"""Checks that the totals of a megaslide-plan JSON report add up.

Reads the report on stdin; exits non-zero naming the first sum that does
not match its parts.
"""

import json
import sys

plan = json.load(sys.stdin)
params, flops = plan["params"], plan["flops"]
checks = {
    "params.total = sum(params.by_category)":
        (params["total"], sum(params["by_category"].values())),
    "params.by_category.blocks = sum(params.per_block)":
        (params["by_category"]["blocks"], sum(params["per_block"])),
    "params.total = trainable + frozen":
        (params["total"], params["trainable"] + params["frozen"]),
    "flops.total = forward + backward + optimizer":
        (flops["total"],
         flops["forward"] + flops["backward"] + flops["optimizer"]),
    "flops.forward = sum(forward_by_kind)":
        (flops["forward"], flops["forward_by_kind"]["total"]),
    "flops.backward = sum(backward_by_kind)":
        (flops["backward"], flops["backward_by_kind"]["total"]),
}
for kind in ("forward", "backward"):
    parts = flops[f"{kind}_by_kind"]
    checks[f"{kind}_by_kind.total = matmul + attention + other"] = (
        parts["total"], parts["matmul"] + parts["attention"] + parts["other"])
for name, (total, parts) in checks.items():
    if total != parts:
        sys.exit(f"{name}: {total} != {parts}")
print("sums ok")
