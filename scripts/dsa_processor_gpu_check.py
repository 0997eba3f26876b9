#!/usr/bin/env python3
"""The diffusers 3D-DSA processor's GPU path, checked on the GPU.

    python3 scripts/dsa_processor_gpu_check.py [--json FILE] [--device cpu]

megaslide.diffusers (docs/Dsa3d.md, "Sampling with diffusers") runs 3D-DSA
on CUDA tensors as torch.compile'd FlexAttention with a block mask built
from the offsets it estimates in torch. On the CPU the same path (eager
FlexAttention) is checked against megaslide's own kernels by
test/python/test_diffusers_dsa.py; this script checks what only a GPU runs:
the offsets estimated on the GPU equal those estimated on the CPU from the
same float32 q and k, and the compiled FlexAttention output equals a
float64 reference, dense attention masked by the processor's mask_mod,
evaluated from the same offsets (f32: max |diff| <= 2e-5 max |ref|, the
f32 accumulation over at most a few thousand keys with margin; bf16
inputs: 2e-2). It then times the compiled path on a Wan 2.1 1.3B-sized
layer (81 x 480 x 832: 21 x 30 x 52 tokens, 12 heads of 128) against
torch's SDPA over all tokens, both in bf16 (ratio; medians of 5).

Loads python-bindings/megaslide/diffusers.py as a file, so it needs torch
and NumPy but neither the megaslide extension nor diffusers: the device
machine has torch and no MLIR. Without a CUDA device it exits 0 saying so.
``--device cpu`` runs the same checks with eager FlexAttention and no
timing, so that the script itself is tested where there is no GPU
(test/python/test_device_scripts.py).
"""

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# name, grid, window, tile, radius, heads, head dim, dtype: one
# torch.compile per case on the GPU (tens of seconds each), so few.
CASES = (
    ("small", (4, 6, 6), (2, 3, 3), (1, 2, 2), 2, 2, 16, "float32"),
    ("partial tiles", (5, 9, 13), (3, 5, 6), (2, 3, 4), 3, 2, 32, "bfloat16"),
    ("default window", (9, 16, 26), (9, 15, 24), (3, 5, 8), 4, 2, 64,
     "float32"),
)
BOUNDS = {"float32": 2e-5, "bfloat16": 2e-2}
WAN_1_3B = ((21, 30, 52), (9, 15, 24), (3, 5, 8), 4, 12, 128)


def load_processor_module():
    path = ROOT / "python-bindings" / "megaslide" / "diffusers.py"
    spec = importlib.util.spec_from_file_location("megaslide_diffusers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_reference(torch, mask_mod, q, k, v):
    """softmax(q k^T / sqrt(D), masked) v in float64, one head at a time."""
    B, H, N, D = q.shape
    idx = torch.arange(N, device=q.device)
    out = torch.empty(B, H, N, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        for h in range(H):
            allowed = mask_mod(torch.tensor(b, device=q.device),
                               torch.tensor(h, device=q.device),
                               idx[:, None], idx[None, :])
            s = q[b, h].double() @ k[b, h].double().T / D ** 0.5
            s = s.masked_fill(~allowed, float("-inf"))
            out[b, h] = torch.softmax(s, -1) @ v[b, h].double()
    return out


def median_ms(torch, body, reps=5):
    body()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        body()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (torch %s)" % torch.__version__)
        return 0
    device = torch.device(args.device)
    dsa = load_processor_module()
    gen = torch.Generator().manual_seed(0)
    results, failures = [], 0
    for name, grid, window, tile, radius, heads, dim, dtype_name in CASES:
        dtype, bound = getattr(torch, dtype_name), BOUNDS[dtype_name]
        n = grid[0] * grid[1] * grid[2]
        q, k, v = (torch.randn(1, heads, n, dim, generator=gen)
                   for _ in range(3))
        q, k, v = (x.to(dtype) for x in (q, k, v))
        six = (1, heads, *grid, dim)
        cpu = dsa.dsa3d_offsets_torch(q.float().reshape(six),
                                      k.float().reshape(six), window,
                                      tile, radius)
        qc, kc, vc = (x.to(device) for x in (q, k, v))
        gpu = dsa.dsa3d_offsets_torch(qc.float().reshape(six),
                                      kc.float().reshape(six), window,
                                      tile, radius)
        same_offsets = bool(torch.equal(cpu, gpu.cpu()))
        out = dsa._dsa_flex(qc, kc, vc, grid, window, tile, radius)
        _, mask_mod = dsa.dsa3d_block_mask(qc, kc, grid, window, tile,
                                           radius)
        ref = dense_reference(torch, mask_mod, qc, kc, vc)
        err = ((out.double() - ref).abs().max() /
               ref.abs().max()).item()
        ok = same_offsets and err <= bound
        failures += not ok
        results.append({"case": name, "dtype": str(dtype), "grid": grid,
                        "window": window, "tile": tile, "radius": radius,
                        "offsets_equal_cpu": same_offsets,
                        "max_rel_err": err, "bound": bound, "ok": ok})
        print("%-15s %-15s offsets %s, max |diff| / max |ref| %.2e "
              "(bound %.0e): %s" % (name, str(dtype), "equal" if
                                    same_offsets else "DIFFER", err,
                                    bound, "ok" if ok else "FAIL"))
    timing = None
    if device.type == "cuda":
        grid, window, tile, radius, heads, dim = WAN_1_3B
        n = grid[0] * grid[1] * grid[2]
        q, k, v = (torch.randn(1, heads, n, dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        dsa_ms = median_ms(torch, lambda: dsa._dsa_flex(q, k, v, grid, window,
                                                        tile, radius))
        sdpa_ms = median_ms(torch, lambda:
                            torch.nn.functional.scaled_dot_product_attention(
                                q, k, v))
        timing = {"grid": grid, "window": window, "tile": tile, "heads": heads,
                  "head_dim": dim, "dsa_ms": dsa_ms, "sdpa_ms": sdpa_ms,
                  "ratio_sdpa_over_dsa": sdpa_ms / dsa_ms}
        print("Wan 1.3B layer, %d tokens, bf16: processor (offsets + block mask "
              "+ FlexAttention) %.2f ms, SDPA over all tokens %.2f ms, ratio "
              "%.2f" % (n, dsa_ms, sdpa_ms, sdpa_ms / dsa_ms))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"torch": torch.__version__, "cases": results, "timing": timing},
            indent=1, default=list))
    print("FAIL: %d case(s)" % failures if failures else "ok: every case")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
