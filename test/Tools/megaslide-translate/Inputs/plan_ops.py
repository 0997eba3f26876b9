"""Prints an execution plan's (stdin) instructions per op, then those
marked `ranks` (a job's), one `op N` line each, sorted."""
import collections
import json
import sys

plan = json.load(sys.stdin)
ops = collections.Counter(i["op"] for i in plan["instructions"])
ranks = collections.Counter(i["op"] for i in plan["instructions"]
                            if "ranks" in i.get("attrs", {}))
for op in sorted(ops):
    print(f"{op} {ops[op]}")
for op in sorted(ranks):
    print(f"ranks {op} {ranks[op]}")
