"""Prints every scalar of a JSON document on stdin as `path = value`.

Keys are joined with '.', list elements as [i], so FileCheck can pin one
field of megaslide-plan's --format json report per line.
"""

import json
import sys


def walk(path, value):
    if isinstance(value, dict):
        for key, item in value.items():
            walk(f"{path}.{key}" if path else key, item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            walk(f"{path}[{i}]", item)
    else:
        print(f"{path} = {json.dumps(value)}")


walk("", json.load(sys.stdin))
