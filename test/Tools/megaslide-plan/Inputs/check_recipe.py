"""Checks that the training recipe's figures in megaslide-plan's --format
json report (stdin) follow from the parameter count: each host buffer is
the trainable parameters times its bytes per parameter, is in the host
categories when the plan keeps it, and the deferred mode needs what it
retains plus the EMA. argv: the gradients' and the EMA's bytes per
parameter. Prints "recipe ok" or the first mismatch.
"""

import json
import sys

plan = json.load(sys.stdin)
grad_bytes, ema_bytes = int(sys.argv[1]), int(sys.argv[2])
recipe = plan["recipe"]
params = recipe["trainable_params"]
b = recipe["bytes"]
host = plan["host"]["by_category"]
accum = recipe["grad_accum"] > 1


def expect(what, got, want):
    if got != want:
        sys.exit(f"{what}: {got}, expected {want}")


expect("trainable params", params, plan["params"]["trainable"])
expect("retained gradients", b["retained_gradients"], params * grad_bytes)
expect("gradient accumulator", b["gradient_accumulator"],
       params * 4 if accum else 0)
expect("ema", b["ema"], params * ema_bytes)
deferred = b["gradient_accumulator"] if accum else b["retained_gradients"]
expect("deferred", b["deferred"], deferred)
expect("deferred mode host bytes", recipe["modes"]["deferred"]["host_bytes"],
       deferred + b["ema"])
expect("streaming mode host bytes", recipe["modes"]["streaming"]["host_bytes"],
       b["ema"])
if recipe["update"] == "deferred":
    name = ("gradient accumulator (fp32)" if accum else "retained gradients")
    expect(f"host category '{name}'", host.get(name), deferred)
else:
    expect("host category 'retained gradients'",
           host.get("retained gradients"), None)
if ema_bytes:
    ema = "f32" if ema_bytes == 4 else "bf16"
    expect("host category EMA", host.get(f"EMA weights ({ema})"), b["ema"])
expect("device accumulation", recipe["device_accumulation_bytes"], params * 4)
print("recipe ok")
