#!/usr/bin/env python3
"""Runs the NVRTC-built 3D-DSA kernels on a GPU: numerics against a float64
NumPy reference of DESIGN.md's semantics, and timings.

    megaslide-translate --emit-dsa-kernels m.mlir -o DIR --cubin sm_90a
    python3 scripts/dsa_gpu_check.py DIR [--check] [--bench] [--batch 2]

Talks to the CUDA driver (libcuda) through ctypes, so it needs no CUDA
Python package; needs NumPy. Without a GPU it prints why and exits 0 (the
device check is then a no-op), so it can run anywhere. Exit status 1 when a
numerics check fails.

A stop-gap until the CUDA runtime backend launches these kernels from an
execution plan: the launch shapes come from DIR/manifest.json.
"""

import argparse
import ctypes
import json
import os
import sys
import time

try:
    import numpy as np
except ImportError:  # pragma: no cover - the device machine may lack numpy
    print("dsa_gpu_check: numpy is not installed; skipped")
    sys.exit(0)

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Cuda:
    """The few driver entry points the check needs."""

    def __init__(self):
        self.lib = None
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                pass
        if self.lib is None:
            raise RuntimeError("libcuda not found (no NVIDIA driver)")
        self.check(self.lib.cuInit(0), "cuInit")
        count = ctypes.c_int(0)
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(count)),
                   "cuDeviceGetCount")
        if count.value == 0:
            raise RuntimeError("no CUDA device")
        self.device = ctypes.c_int(0)
        self.check(self.lib.cuDeviceGet(ctypes.byref(self.device), 0),
                   "cuDeviceGet")
        name = ctypes.create_string_buffer(256)
        self.lib.cuDeviceGetName(name, 256, self.device)
        self.name = name.value.decode()
        self.ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx),
                                                     self.device),
                   "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def check(self, result, what):
        if result != 0:
            msg = ctypes.c_char_p()
            if self.lib is not None:
                self.lib.cuGetErrorString(result, ctypes.byref(msg))
            raise RuntimeError("%s failed: %s (%d)" % (
                what, msg.value.decode() if msg.value else "?", result))

    def alloc(self, nbytes):
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr),
                                          ctypes.c_size_t(max(nbytes, 16))),
                   "cuMemAlloc")
        return ptr

    def free(self, ptr):
        self.lib.cuMemFree_v2(ptr)

    def upload(self, array):
        array = np.ascontiguousarray(array)
        ptr = self.alloc(array.nbytes)
        self.check(self.lib.cuMemcpyHtoD_v2(ptr, array.ctypes.data_as(
            ctypes.c_void_p), ctypes.c_size_t(array.nbytes)), "cuMemcpyHtoD")
        return ptr

    def download(self, ptr, shape, dtype):
        out = np.empty(shape, dtype)
        self.check(self.lib.cuMemcpyDtoH_v2(out.ctypes.data_as(
            ctypes.c_void_p), ptr, ctypes.c_size_t(out.nbytes)),
                   "cuMemcpyDtoH")
        return out

    def zero(self, ptr, nbytes):
        self.check(self.lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0),
                                          ctypes.c_size_t(nbytes)),
                   "cuMemsetD8")

    def module(self, cubin_path):
        image = open(cubin_path, "rb").read()
        mod = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), image),
                   "cuModuleLoadData(%s)" % cubin_path)
        return mod, image  # keep the image alive with the module

    def function(self, mod, name, dynamic_smem):
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod,
                                                name.encode()),
                   "cuModuleGetFunction(%s)" % name)
        if dynamic_smem > 48 * 1024:
            self.check(self.lib.cuFuncSetAttribute(
                fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                int(dynamic_smem)), "cuFuncSetAttribute(%s)" % name)
        return fn

    def launch(self, fn, grid, block, smem, args):
        holders = []
        for a in args:
            if isinstance(a, ctypes.c_uint64):
                holders.append(a)
            elif isinstance(a, float):
                holders.append(ctypes.c_float(a))
            else:
                holders.append(ctypes.c_longlong(a))
        params = (ctypes.c_void_p * len(holders))(
            *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
              for h in holders])
        self.check(self.lib.cuLaunchKernel(
            fn, grid[0], grid[1], grid[2], block, 1, 1, smem, None,
            ctypes.cast(params, ctypes.c_void_p), None), "cuLaunchKernel")

    def sync(self):
        self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


# ---------------------------------------------------------------------------
# 16-bit element types and the reference
# ---------------------------------------------------------------------------

def to_bits(x, elem):
    x = np.asarray(x, np.float32)
    if elem == "f16":
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    return u.astype(np.uint16)


def from_bits(bits, elem):
    if elem == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


class Geometry:
    def __init__(self, cfg):
        self.T, self.Y, self.X = cfg["grid"]
        self.kt, self.ky, self.kx = cfg["window"]
        self.tt, self.ty, self.tx = cfg["tile"]
        self.nt, self.ny, self.nx = cfg["tile_counts"]
        self.radius = cfg["radius"]

    def tiles(self):
        for it in range(self.nt):
            for iy in range(self.ny):
                for ix in range(self.nx):
                    lo = (it * self.tt, iy * self.ty, ix * self.tx)
                    hi = (min(lo[0] + self.tt, self.T),
                          min(lo[1] + self.ty, self.Y),
                          min(lo[2] + self.tx, self.X))
                    centre = [(lo[a] + hi[a] - 1) // 2 for a in range(3)]
                    queries = [(t * self.Y + y) * self.X + x
                               for t in range(lo[0], hi[0])
                               for y in range(lo[1], hi[1])
                               for x in range(lo[2], hi[2])]
                    yield (it, iy, ix), centre, np.array(queries)

    def key_start(self, centre):
        return min(max(centre[0] - self.kt // 2, 0), self.T - self.kt)

    def spatial(self, centre, dy, dx):
        sy = min(max(centre[1] + dy - self.ky // 2, 0), self.Y - self.ky)
        sx = min(max(centre[2] + dx - self.kx // 2, 0), self.X - self.kx)
        return sy, sx

    def frame_keys(self, frame, sy, sx):
        return np.array([(frame * self.Y + sy + yy) * self.X + sx + xx
                         for yy in range(self.ky) for xx in range(self.kx)])

    def keys(self, centre, offs):
        st = self.key_start(centre)
        return np.concatenate([
            self.frame_keys(st + j, *self.spatial(centre, *offs[j]))
            for j in range(self.kt)])


def reference(geo, q, k, v, do, offsets, scale, o_dev):
    """Forward and backward in float64; D_i uses the kernel's own output."""
    B, N, H, D = q.shape
    o = np.zeros_like(q)
    lse = np.zeros((B, H, N))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(B):
        for h in range(H):
            for (it, iy, ix), centre, qs in geo.tiles():
                ks = geo.keys(centre, offsets[b, h, it, iy, ix])
                Q, K, V, dO = q[b, qs, h], k[b, ks, h], v[b, ks, h], do[b, qs, h]
                S = scale * Q @ K.T
                m = S.max(axis=1, keepdims=True)
                E = np.exp(S - m)
                l = E.sum(axis=1, keepdims=True)
                P = E / l
                o[b, qs, h] = P @ V
                lse[b, h, qs] = (m + np.log(l))[:, 0]
                dP = dO @ V.T
                Di = (dO * o_dev[b, qs, h]).sum(axis=1, keepdims=True)
                dS = P * (dP - Di)
                dq[b, qs, h] = scale * dS @ K
                np.add.at(dk[b, :, h], ks, scale * dS.T @ Q)
                np.add.at(dv[b, :, h], ks, P.T @ dO)
    return o, lse, dq, dk, dv


def reference_offsets(geo, q, k):
    """Block matching with the tie rule; also the score gap to the runner-up
    choice so that near-ties can be told from errors."""
    B, N, H, D = q.shape
    R = geo.radius
    cands = sorted([(dy, dx) for dy in range(-R, R + 1)
                    for dx in range(-R, R + 1)],
                   key=lambda c: (abs(c[0]) + abs(c[1]), c[0], c[1]))
    out = {}
    for b in range(B):
        for h in range(H):
            for (it, iy, ix), centre, qs in geo.tiles():
                qbar = q[b, qs, h].mean(axis=0)
                st = geo.key_start(centre)
                for j in range(geo.kt):
                    scores = {}
                    for dy, dx in cands:
                        win = geo.frame_keys(st + j,
                                             *geo.spatial(centre, dy, dx))
                        scores[(dy, dx)] = float(qbar @ k[b, win, h].mean(0))
                    best = max(scores.values())
                    choice = next(c for c in cands if scores[c] == best)
                    out[(b, h, it, iy, ix, j)] = (choice, scores)
    return out


def compare(name, got, want, atol, rtol):
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    worst = float(err.max()) if err.size else 0.0
    ok = not bad.any()
    print("  %-8s max |err| %.3e  %s" % (name, worst,
                                          "ok" if ok else
                                          "FAIL (%d of %d)" % (bad.sum(),
                                                               bad.size)))
    return ok


# ---------------------------------------------------------------------------
# Per configuration
# ---------------------------------------------------------------------------

class Kernels:
    def __init__(self, cuda, directory, cfg):
        self.cfg = cfg
        self.mod, self.image = cuda.module(
            os.path.join(directory, cfg["name"] + ".cubin"))
        self.launches = {}
        for kern in cfg["kernels"]:
            fn = cuda.function(self.mod, kern["name"],
                               kern["dynamic_shared_bytes"])
            self.launches[kern["kind"]] = (fn, kern)

    def run(self, cuda, kind, batch, args):
        fn, kern = self.launches[kind]
        grid = list(kern["grid_for_batch_1"])
        if kind == "backward_finalize":
            grid[0] *= batch  # grid-stride: any x covers the count
        else:
            grid[2] = batch
        cuda.launch(fn, grid, kern["block"][0], kern["dynamic_shared_bytes"],
                    args)


def check_config(cuda, directory, cfg, batch, rng):
    geo = Geometry(cfg)
    elem = cfg["element_type"]
    H, D, N = cfg["heads"], cfg["head_dim"], cfg["tokens"]
    shape = (batch, N, H, D)
    scale = 1.0 / np.sqrt(D)
    print("%s (batch %d)" % (cfg["name"], batch))
    kern = Kernels(cuda, directory, cfg)

    def rand_bits():
        return to_bits(rng.standard_normal(shape).astype(np.float32), elem)

    qb, kb, vb, dob = rand_bits(), rand_bits(), rand_bits(), rand_bits()
    q, k, v, do = (from_bits(x, elem) for x in (qb, kb, vb, dob))
    ok = True

    # Offsets: the GPU estimate, checked against block matching.
    off_shape = (batch, H, geo.nt, geo.ny, geo.nx, geo.kt, 2)
    dq_ = cuda.upload(qb)
    dk_ = cuda.upload(kb)
    doff = cuda.alloc(int(np.prod(off_shape)) * 4)
    kern.run(cuda, "offsets", batch, [dq_, dk_, doff])
    cuda.sync()
    offsets = cuda.download(doff, off_shape, np.int32)
    ref = reference_offsets(geo, q, k)
    mismatches = near_ties = 0
    for key, (choice, scores) in ref.items():
        got = tuple(int(x) for x in offsets[key])
        if got != choice:
            gap = abs(scores[choice] - scores.get(got, -np.inf))
            if gap <= 1e-5 * (abs(scores[choice]) + 1):
                near_ties += 1
            else:
                mismatches += 1
    print("  offsets  %d of %d differ from block matching beyond fp32 "
          "near-ties (%d near-ties)  %s" % (mismatches, len(ref), near_ties,
                                            "ok" if not mismatches else
                                            "FAIL"))
    ok &= mismatches == 0

    # Random displacements exercise the clamping more than estimated ones.
    R = max(geo.radius, 2)
    offsets = rng.integers(-R, R + 1, off_shape).astype(np.int32)
    cuda.free(doff)
    doff = cuda.upload(offsets)
    dv_, ddo = cuda.upload(vb), cuda.upload(dob)
    dout = cuda.alloc(qb.nbytes)
    dlse = cuda.alloc(batch * H * N * 4)
    kern.run(cuda, "forward", batch,
             [dq_, dk_, dv_, doff, dout, dlse, float(scale)])
    cuda.sync()
    o_bits = cuda.download(dout, shape, np.uint16)
    o_dev = from_bits(o_bits, elem)
    lse_dev = cuda.download(dlse, (batch, H, N), np.float32)

    ddq = cuda.alloc(qb.nbytes)
    dk32, dv32 = cuda.alloc(q.size * 4), cuda.alloc(q.size * 4)
    cuda.zero(dk32, q.size * 4)
    cuda.zero(dv32, q.size * 4)
    ddk, ddv = cuda.alloc(qb.nbytes), cuda.alloc(qb.nbytes)
    kern.run(cuda, "backward", batch, [dq_, dk_, dv_, doff, dout, ddo, dlse,
                                       ddq, dk32, dv32, float(scale)])
    kern.run(cuda, "backward_finalize", batch,
             [dk32, dv32, ddk, ddv, int(q.size)])
    cuda.sync()
    got = {"dq": cuda.download(ddq, shape, np.uint16),
           "dk": cuda.download(ddk, shape, np.uint16),
           "dv": cuda.download(ddv, shape, np.uint16)}
    o, lse, dq, dk, dv = reference(geo, q, k, v, do, offsets, scale, o_dev)
    # 16-bit outputs: a few units in the last place of bf16 (2^-8).
    tol = 2e-2 if elem == "bf16" else 4e-3
    ok &= compare("out", o_dev, o, tol, tol)
    ok &= compare("lse", lse_dev.astype(np.float64), lse, 1e-3, 1e-4)
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
        scale_ = max(1.0, float(np.abs(want).max()))
        ok &= compare(name, from_bits(got[name], elem), want,
                      tol * scale_, 2 * tol)
    for p in (dq_, dk_, dv_, ddo, doff, dout, dlse, ddq, dk32, dv32, ddk, ddv):
        cuda.free(p)
    return ok


def bench_config(cuda, directory, cfg, batch, reps):
    H, D, N = cfg["heads"], cfg["head_dim"], cfg["tokens"]
    W = cfg["window_keys"]
    print("%s (batch %d): timing" % (cfg["name"], batch))
    kern = Kernels(cuda, directory, cfg)
    elems = batch * N * H * D
    # Inputs: a repeated random block (uploading GBs of randomness is slow).
    rng = np.random.default_rng(1)
    block = to_bits(rng.standard_normal(1 << 20).astype(np.float32),
                    cfg["element_type"])
    ptrs = []

    def filled(nelems):
        p = cuda.alloc(nelems * 2)
        for start in range(0, nelems, block.size):
            n = min(block.size, nelems - start)
            cuda.check(cuda.lib.cuMemcpyHtoD_v2(
                ctypes.c_uint64(p.value + 2 * start),
                block.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(2 * n)),
                "cuMemcpyHtoD")
        ptrs.append(p)
        return p

    q, k, v, do = filled(elems), filled(elems), filled(elems), filled(elems)
    geo = Geometry(cfg)
    offs = cuda.alloc(batch * H * geo.nt * geo.ny * geo.nx * geo.kt * 2 * 4)
    out, dq = cuda.alloc(elems * 2), cuda.alloc(elems * 2)
    dk, dv = cuda.alloc(elems * 2), cuda.alloc(elems * 2)
    lse = cuda.alloc(batch * H * N * 4)
    dk32, dv32 = cuda.alloc(elems * 4), cuda.alloc(elems * 4)
    ptrs += [offs, out, dq, dk, dv, lse, dk32, dv32]
    scale = 1.0 / np.sqrt(D)

    def timed(label, body, flops):
        body()
        cuda.sync()
        start = time.perf_counter()
        for _ in range(reps):
            body()
        cuda.sync()
        ms = (time.perf_counter() - start) * 1e3 / reps
        rate = " %.0f TFLOP/s" % (flops / ms / 1e9) if flops else ""
        print("  %-9s %9.3f ms%s" % (label, ms, rate))

    fwd_flops = 4.0 * batch * H * N * W * D
    timed("offsets", lambda: kern.run(cuda, "offsets", batch, [q, k, offs]),
          0)
    timed("forward", lambda: kern.run(cuda, "forward", batch,
                                      [q, k, v, offs, out, lse, float(scale)]),
          fwd_flops)

    def backward():
        cuda.zero(dk32, elems * 4)
        cuda.zero(dv32, elems * 4)
        kern.run(cuda, "backward", batch, [q, k, v, offs, out, do, lse, dq,
                                           dk32, dv32, float(scale)])
        kern.run(cuda, "backward_finalize", batch,
                 [dk32, dv32, dk, dv, int(elems)])
    timed("backward", backward, 2.5 * fwd_flops)
    for p in ptrs:
        cuda.free(p)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="megaslide-translate -o DIR --cubin ...")
    parser.add_argument("--check", action="store_true",
                        help="numerics of configurations up to "
                             "--max-check-tokens tokens x heads")
    parser.add_argument("--bench", action="store_true",
                        help="time configurations above that size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-check-tokens", type=int, default=1 << 12)
    args = parser.parse_args()
    try:
        cuda = Cuda()
    except (RuntimeError, OSError) as e:
        print("dsa_gpu_check: no GPU (%s); skipped" % e)
        return 0
    print("dsa_gpu_check on %s" % cuda.name)
    manifest = json.load(open(os.path.join(args.dir, "manifest.json")))
    rng = np.random.default_rng(0)
    ok = True
    for cfg in manifest["configs"]:
        small = cfg["tokens"] * cfg["heads"] <= args.max_check_tokens
        if small and args.check:
            ok &= check_config(cuda, args.dir, cfg, args.batch, rng)
        elif not small and args.bench:
            bench_config(cuda, args.dir, cfg, 1, args.reps)
    print("dsa_gpu_check: %s" % ("all checks passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
