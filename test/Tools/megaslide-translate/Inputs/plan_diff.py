"""Names the top-level keys in which two execution plans differ, one
`differs KEY` line each (sorted), or `identical`."""
import json
import sys

a, b = (json.load(open(path)) for path in sys.argv[1:3])
keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
print("\n".join(f"differs {k}" for k in keys) or "identical")
