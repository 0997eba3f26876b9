"""Compares a deferred and a streaming execution plan of one step (argv:
their files): the deferred one is version 3 with every host_adamw
`deferred` and, per updated parameter, its first fetch (of the master or
its `.bf16` copy) `applies_update`; the streaming one is version 2 without
marks; without the marks and the version the two are the same plan.
"""

import json
import sys

deferred, streaming = (json.load(open(path)) for path in sys.argv[1:3])
params = {p["name"]: p for p in deferred["params"]}


def updated(fetched):
    p = params.get(fetched)
    if p and p["role"] == "weight" and p.get("of"):
        p = params.get(p["of"])
    return p["name"] if p and p["role"] == "master" else None


updates = [i for i in deferred["instructions"] if i["op"] == "host_adamw"]
marked = [i for i in updates if i.get("attrs", {}).get("deferred") == 1]
seen, applying, first_ok = set(), 0, True
for inst in deferred["instructions"]:
    if inst["op"] != "fetch":
        continue
    master = updated(inst["param"])
    applies = inst.get("attrs", {}).get("applies_update") == 1
    applying += applies
    first = master is not None and master not in seen
    if master:
        seen.add(master)
    first_ok &= applies == (first and master in {u["param"] for u in updates})
print(f"deferred: version {deferred['version']}, {len(marked)} of "
      f"{len(updates)} host_adamw deferred, {applying} fetches apply, "
      f"first fetches: {first_ok}")


def strip(plan):
    plan = json.loads(json.dumps(plan))
    plan["version"] = None
    for inst in plan["instructions"]:
        attrs = inst.get("attrs", {})
        attrs.pop("deferred", None)
        attrs.pop("applies_update", None)
        if "attrs" in inst and not attrs:
            del inst["attrs"]
    return plan


marks = sum(k in i.get("attrs", {}) for i in streaming["instructions"]
            for k in ("deferred", "applies_update"))
print(f"streaming: version {streaming['version']}, {marks} marks")
print("same without the marks" if strip(deferred) == strip(streaming)
      else "the plans differ beyond the marks")
