#!/usr/bin/env python3
"""Runs the NVRTC-built 3D-DSA kernels on a GPU: numerics against a float64
NumPy reference of docs/Dsa3d.md's semantics, timings, and a FlexAttention
baseline of the same attention.

    megaslide-translate --emit-dsa-kernels m.mlir -o DIR --cubin sm_90a
    python3 scripts/dsa_gpu_check.py DIR [--check] [--bench] [--flex]
        [--batch 2] [--seconds 60] [--json FILE]
    python3 scripts/dsa_gpu_check.py --self-test

--check: configurations of up to --max-check-tokens tokens x heads are
checked whole (offsets, out, lse, dQ, dK, dV). Bigger ones (the 105B layer)
run whole on the GPU and are checked on a seeded sample: out, lse, dQ and
the offsets of --sample-tiles query tiles (corner tiles first), dK and dV
of --sample-keys keys, each summed over every query tile whose window holds
it; the host's float64 work stops taking new samples after --seconds.
--bench: the big configurations timed with CUDA events (median of --reps).
--flex: FlexAttention (torch) with a block mask of the same windows:
checked against the reference on a small configuration, timed beside the
kernels under --bench, and compared with the kernels' output over the whole
big tensors. --self-test needs no GPU: the sampled reference against the
full one (bit for bit), the FlexAttention mask against 3D-DSA's key sets,
and with torch, eager FlexAttention in float64 against the reference.

Talks to the CUDA driver (libcuda) through ctypes, so it needs no CUDA
Python package; needs NumPy, and torch for --flex. A part whose GPU or
torch is missing is skipped and said so (exit status 0); 1 when a check
fails.
"""

import argparse
import ctypes
import json
import math
import os
import sys
import time
import traceback
import warnings

try:
    import numpy as np
except ImportError:  # pragma: no cover - the device machine may lack numpy
    print("dsa_gpu_check: numpy is not installed; skipped")
    sys.exit(0)

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
INPUTS = ("q", "k", "v", "do")
# Big inputs repeat a random block of this prime length: rows of one head
# never coincide (the row stride H*D is below it), and the host computes
# any row without holding the multi-GB tensors.
PERIOD = 4194301
FLEX_BLOCK = 128


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
        # The primary context: torch (--flex) uses the same one.
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx),
                                                     self.device),
                   "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuEventElapsedTime.argtypes = [
            ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]

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

    def write(self, ptr, array, offset=0):
        array = np.ascontiguousarray(array)
        self.check(self.lib.cuMemcpyHtoD_v2(
            ctypes.c_uint64(ptr.value + offset),
            array.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_size_t(array.nbytes)), "cuMemcpyHtoD")

    def upload(self, array):
        ptr = self.alloc(array.nbytes)
        self.write(ptr, array)
        return ptr

    def read(self, ptr, out, offset=0):
        self.check(self.lib.cuMemcpyDtoH_v2(
            out.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_uint64(ptr.value + offset), ctypes.c_size_t(out.nbytes)),
                   "cuMemcpyDtoH")
        return out

    def download(self, ptr, shape, dtype):
        return self.read(ptr, np.empty(shape, dtype))

    def copy(self, dst, src, nbytes):
        """Device to device, raw addresses."""
        self.check(self.lib.cuMemcpyDtoD_v2(
            ctypes.c_uint64(dst), ctypes.c_uint64(src),
            ctypes.c_size_t(nbytes)), "cuMemcpyDtoD")

    def fill_periodic(self, bits, count):
        """A new tensor of `count` 16-bit values, element i = bits[i mod
        len(bits)]: one upload, then copies of whole periods (doubling)."""
        ptr = self.alloc(count * 2)
        done = min(bits.size, count)
        self.write(ptr, bits[:done])
        while done < count:
            n = min(done, count - done)  # done is a multiple of the period
            self.copy(ptr.value + 2 * done, ptr.value, 2 * n)
            done += n
        return ptr

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

    def time_ms(self, body, warmup, reps):
        """Median CUDA-event time of body() on the default stream, ms."""
        for _ in range(warmup):
            body()
        events = []
        for _ in range(2 * reps):
            ev = ctypes.c_void_p()
            self.check(self.lib.cuEventCreate(ctypes.byref(ev), 0),
                       "cuEventCreate")
            events.append(ev)
        for i in range(reps):
            self.check(self.lib.cuEventRecord(events[2 * i], None),
                       "cuEventRecord")
            body()
            self.check(self.lib.cuEventRecord(events[2 * i + 1], None),
                       "cuEventRecord")
        self.sync()
        times = []
        for i in range(reps):
            ms = ctypes.c_float()
            self.check(self.lib.cuEventElapsedTime(
                ctypes.byref(ms), events[2 * i], events[2 * i + 1]),
                       "cuEventElapsedTime")
            times.append(ms.value)
        for ev in events:
            self.lib.cuEventDestroy_v2(ev)
        return float(np.median(times))


# ---------------------------------------------------------------------------
# 16-bit element types, inputs, geometry and the reference
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


class Dense:
    """Rows of a whole [B, N, H, D] array."""

    def __init__(self, array):
        self.array = array

    def rows(self, b, tokens, h):
        return self.array[b, tokens, h]


class Periodic:
    """A [B, N, H, D] tensor whose flat element i is block[i mod period]
    (16-bit random normals): what Cuda.fill_periodic writes."""

    def __init__(self, rng, elem, shape, period=None):
        self.shape = shape
        self.bits = to_bits(rng.standard_normal(period or PERIOD).astype(
            np.float32), elem)
        self.values = from_bits(self.bits, elem)

    def rows(self, b, tokens, h):
        _, N, H, D = self.shape
        base = ((b * N + np.asarray(tokens, np.int64)) * H + h) * D
        return self.values[(base[:, None] + np.arange(D)) % self.bits.size]

    def materialize(self):
        return np.resize(self.bits, int(np.prod(self.shape))).reshape(
            self.shape)


def make_config(name, grid, window, tile, heads, head_dim, elem, radius):
    """A configuration as manifest.json describes it (self-test)."""
    return {"name": name, "grid": grid, "window": window, "tile": tile,
            "heads": heads, "head_dim": head_dim, "element_type": elem,
            "radius": radius, "tokens": int(np.prod(grid)),
            "window_keys": int(np.prod(window)),
            "tile_counts": [-(-g // t) for g, t in zip(grid, tile)]}


class Geometry:
    def __init__(self, cfg):
        self.T, self.Y, self.X = cfg["grid"]
        self.kt, self.ky, self.kx = cfg["window"]
        self.tt, self.ty, self.tx = cfg["tile"]
        self.nt, self.ny, self.nx = cfg["tile_counts"]
        self.radius = cfg["radius"]
        self.N = self.T * self.Y * self.X
        self.ntiles = self.nt * self.ny * self.nx
        self.tile_list = list(self._tiles())
        self.centre = np.array([c for _, c, _ in self.tile_list])
        self.start = np.array([self.key_start(c) for c in self.centre])

    def _tiles(self):
        """(it, iy, ix), centre, query tokens; in tile-id order."""
        for it in range(self.nt):
            for iy in range(self.ny):
                for ix in range(self.nx):
                    lo = (it * self.tt, iy * self.ty, ix * self.tx)
                    hi = (min(lo[0] + self.tt, self.T),
                          min(lo[1] + self.ty, self.Y),
                          min(lo[2] + self.tx, self.X))
                    centre = [(lo[a] + hi[a] - 1) // 2 for a in range(3)]
                    t, y, x = np.meshgrid(*[np.arange(lo[a], hi[a])
                                            for a in range(3)],
                                          indexing="ij")
                    yield ((it, iy, ix), centre,
                           ((t * self.Y + y) * self.X + x).ravel())

    def tiles(self):
        return self.tile_list

    def key_start(self, centre):
        return min(max(centre[0] - self.kt // 2, 0), self.T - self.kt)

    def spatial(self, centre, dy, dx):
        sy = min(max(centre[1] + dy - self.ky // 2, 0), self.Y - self.ky)
        sx = min(max(centre[2] + dx - self.kx // 2, 0), self.X - self.kx)
        return sy, sx

    def frame_keys(self, frame, sy, sx):
        yy = np.arange(sy, sy + self.ky)[:, None]
        xx = np.arange(sx, sx + self.kx)[None, :]
        return ((frame * self.Y + yy) * self.X + xx).ravel()

    def keys(self, centre, offs):
        st = self.key_start(centre)
        return np.concatenate([
            self.frame_keys(st + j, *self.spatial(centre, *offs[j]))
            for j in range(self.kt)])

    def window_starts(self, offsets):
        """Spatial starts (sy, sx) of every (b, h, tile, key frame) window:
        int arrays [B, H, tiles, kt]."""
        B, H = offsets.shape[:2]
        off = offsets.reshape(B, H, self.ntiles, self.kt, 2).astype(np.int64)
        sy = np.clip(self.centre[:, 1, None] + off[..., 0] - self.ky // 2,
                     0, self.Y - self.ky)
        sx = np.clip(self.centre[:, 2, None] + off[..., 1] - self.kx // 2,
                     0, self.X - self.kx)
        return sy, sx

    def contributors(self, sy, sx, n):
        """Ids, ascending, of the tiles whose window holds token n, given
        the (sy, sx) of one (b, h) from window_starts."""
        t, y, x = n // (self.Y * self.X), (n // self.X) % self.Y, n % self.X
        j = t - self.start
        jc = np.clip(j, 0, self.kt - 1)
        rows = np.arange(self.ntiles)
        wy, wx = sy[rows, jc], sx[rows, jc]
        inside = ((j >= 0) & (j < self.kt) & (wy <= y) & (y < wy + self.ky)
                  & (wx <= x) & (x < wx + self.kx))
        return np.nonzero(inside)[0]


def tile_reference(geo, src, offsets, scale, b, h, t, o_dev):
    """Forward and backward of one query tile in float64: queries, keys,
    out, lse, dQ and the tile's dK/dV contributions (one row per key).
    D_i = rowsum(dO * O) uses the kernel's own output (o_dev rows) when
    given, as the kernel does."""
    (it, iy, ix), centre, qs = geo.tiles()[t]
    ks = geo.keys(centre, offsets[b, h, it, iy, ix])
    Q, K = src["q"].rows(b, qs, h), src["k"].rows(b, ks, h)
    V, dO = src["v"].rows(b, ks, h), src["do"].rows(b, qs, h)
    S = scale * Q @ K.T
    m = S.max(axis=1, keepdims=True)
    E = np.exp(S - m)
    total = E.sum(axis=1, keepdims=True)
    P = E / total
    o = P @ V
    dP = dO @ V.T
    o_used = o if o_dev is None else o_dev.rows(b, qs, h)
    dS = P * (dP - (dO * o_used).sum(axis=1, keepdims=True))
    return (qs, ks, o, (m + np.log(total))[:, 0], scale * dS @ K,
            scale * dS.T @ Q, P.T @ dO)


def reference(geo, src, offsets, scale, o_dev=None):
    """The whole forward and backward: out, lse, dq, dk, dv."""
    B, N, H, D = src["q"].array.shape
    o, dq = np.zeros((B, N, H, D)), np.zeros((B, N, H, D))
    dk, dv = np.zeros((B, N, H, D)), np.zeros((B, N, H, D))
    lse = np.zeros((B, H, N))
    for b in range(B):
        for h in range(H):
            for t in range(geo.ntiles):
                qs, ks, to, tl, tdq, tdk, tdv = tile_reference(
                    geo, src, offsets, scale, b, h, t, o_dev)
                o[b, qs, h], lse[b, h, qs], dq[b, qs, h] = to, tl, tdq
                np.add.at(dk[b, :, h], ks, tdk)
                np.add.at(dv[b, :, h], ks, tdv)
    return o, lse, dq, dk, dv


def sampled_reference(geo, src, offsets, scale, tiles, keys, seconds,
                      o_dev=None):
    """The reference of a sample, bit for bit what reference() gives there:
    out, lse and dQ of query tiles `tiles` ((b, h, tile id)); dK and dV of
    `keys` ((b, h, token)), each summed over every tile whose window holds
    the key, in tile order as reference() sums. Takes no new tile after
    `seconds`; a key counts only when all its tiles were computed.
    Returns (tiles computed with (qs, o, lse, dq), keys with (dk, dv))."""
    deadline = time.monotonic() + seconds
    sy, sx = geo.window_starts(offsets)
    wanted = {}
    for b, h, n in keys:
        wanted.setdefault((b, h), set()).add(n)
    cache = {}

    def tile(b, h, t):
        if (b, h, t) not in cache:
            if time.monotonic() > deadline:
                return None
            qs, ks, o, lse, dq, dk, dv = tile_reference(
                geo, src, offsets, scale, b, h, t, o_dev)
            where = {n: i for i, n in enumerate(ks)
                     if n in wanted.get((b, h), ())}
            cache[(b, h, t)] = (qs, o, lse, dq,
                                {n: (dk[i], dv[i]) for n, i in where.items()})
        return cache[(b, h, t)]

    done_keys = []

    def result():
        return [(key, r[:4]) for key, r in cache.items()], done_keys
    for b, h, t in tiles:
        if tile(b, h, t) is None:
            return result()
    D = src["q"].rows(0, [0], 0).shape[1]
    for b, h, n in keys:
        dk, dv = np.zeros(D), np.zeros(D)
        for t in geo.contributors(sy[b, h], sx[b, h], n):
            r = tile(b, h, t)
            if r is None:
                return result()
            dk, dv = dk + r[4][n][0], dv + r[4][n][1]
        done_keys.append(((b, h, n), dk, dv))
    return result()


def tile_offsets_reference(geo, src, b, h, t):
    """Block matching of one tile with the tie rule, per key frame: the
    choice and every candidate's score (so that near-ties can be told from
    errors)."""
    R = geo.radius
    cands = sorted([(dy, dx) for dy in range(-R, R + 1)
                    for dx in range(-R, R + 1)],
                   key=lambda c: (abs(c[0]) + abs(c[1]), c[0], c[1]))
    _, centre, qs = geo.tiles()[t]
    qbar = src["q"].rows(b, qs, h).mean(axis=0)
    st = geo.key_start(centre)
    out = []
    for j in range(geo.kt):
        scores = {}
        for dy, dx in cands:
            win = geo.frame_keys(st + j, *geo.spatial(centre, dy, dx))
            scores[(dy, dx)] = float(qbar @ src["k"].rows(b, win, h).mean(0))
        best = max(scores.values())
        out.append((next(c for c in cands if scores[c] == best), scores))
    return out


def check_offsets(geo, src, offsets, items, seconds):
    """The kernel's offsets of (b, h, tile) items against block matching;
    a difference is a near-tie when the two scores are within fp32
    rounding."""
    deadline = time.monotonic() + seconds
    mismatches = near_ties = checked = 0
    for b, h, t in items:
        if time.monotonic() > deadline:
            break
        it, iy, ix = geo.tiles()[t][0]
        for j, (choice, scores) in enumerate(
                tile_offsets_reference(geo, src, b, h, t)):
            got = tuple(int(x) for x in offsets[b, h, it, iy, ix, j])
            checked += 1
            if got != choice:
                gap = abs(scores[choice] - scores.get(got, -np.inf))
                if gap <= 1e-5 * (abs(scores[choice]) + 1):
                    near_ties += 1
                else:
                    mismatches += 1
    ok = mismatches == 0 and checked > 0
    print("  offsets  %d of %d tile frames differ from block matching "
          "beyond fp32 near-ties (%d near-ties)  %s" % (
              mismatches, checked, near_ties, "ok" if ok else "FAIL"))
    return ok, {"checked": checked, "mismatches": mismatches,
                "near_ties": near_ties, "ok": ok}


def compare(name, got, want, atol, rtol):
    """|got - want| <= atol + rtol |want| everywhere; prints one line."""
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    worst = float(err.max()) if err.size else 0.0
    ok = bool(err.size) and not bad.any()
    print("  %-8s max |err| %.3e  (tol %.1e + %.1e |want|)  %s" % (
        name, worst, atol, rtol,
        "ok" if ok else "FAIL (%d of %d)" % (bad.sum(), bad.size)))
    return ok, {"max_err": worst, "atol": atol, "rtol": rtol,
                "bad": int(bad.sum()), "count": int(err.size), "ok": ok}


def compare_all(pairs, elem, scaled):
    """out, lse, dq, dk, dv with the check's tolerances. 16-bit outputs: a
    few units in the last place (bf16 2^-8, f16 2^-10) of the values'
    scale: max(1, max|want|) for gradients of the small configurations
    (values O(1)); max|want| of each quantity when `scaled` (3240-key
    windows make outputs and gradients ~0.03)."""
    tol = 2e-2 if elem == "bf16" else 4e-3
    ok, rec = True, {}
    for name, got, want in pairs:
        peak = float(np.abs(want).max()) if want.size else 0.0
        if name == "lse":
            atol, rtol = 1e-3, 1e-4
        elif scaled:
            atol, rtol = tol * peak, tol if name == "out" else 2 * tol
        elif name == "out":
            atol, rtol = tol, tol
        else:
            atol, rtol = tol * max(1.0, peak), 2 * tol
        good, rec[name] = compare(name, got, want, atol, rtol)
        ok &= good
    return ok, rec


def choose_samples(geo, batch, heads, rng, ntiles, nkeys):
    """Seeded sample: the corner tiles first (their windows clamp on every
    axis), then random tiles, each with a random sample and head. Keys:
    the grid's first and last token (seen only by clamped windows) in the
    (b, h) of the first two corner tiles, then random queries of the last
    (random, mostly interior) tiles, in their (b, h), so that the tiles
    computed for a key are shared with the query sample."""
    corners = []
    for it, iy, ix in [(0, 0, 0), (1, 1, 1), (0, 1, 1), (1, 0, 0),
                       (0, 0, 1), (1, 1, 0), (0, 1, 0), (1, 0, 1)]:
        t = ((it * (geo.nt - 1)) * geo.ny + iy * (geo.ny - 1)) * geo.nx + \
            ix * (geo.nx - 1)
        if t not in corners:
            corners.append(t)
    order = corners + [t for t in rng.permutation(geo.ntiles)
                       if t not in corners]
    total = min(ntiles, geo.ntiles * batch * heads)
    tiles, seen = [], set()
    while len(tiles) < total:
        t = order[len(tiles) % len(order)]
        item = (int(rng.integers(batch)), int(rng.integers(heads)), int(t))
        if item not in seen:
            seen.add(item)
            tiles.append(item)
    keys = []
    for i in range(min(nkeys, len(tiles))):
        b, h, t = tiles[i if i < 2 else 1 - i]
        n = 0 if i == 0 else geo.N - 1 if i == 1 else \
            int(rng.choice(geo.tiles()[t][2]))
        keys.append((b, h, n))
    return tiles, keys


# ---------------------------------------------------------------------------
# 3D-DSA as a FlexAttention block mask
# ---------------------------------------------------------------------------

class FlexLayout:
    """3D-DSA as FlexAttention sees it. Tokens are put in tile-major order,
    each tile padded to a multiple of 128, so that every 128-block of
    queries lies in one tile: a block of the mask is a (query tile, key
    tile) pair, kept when the tile's window touches the key tile. The
    per-frame windows are displaced by data-dependent offsets, so every
    kept block is partial: mask_mod reads the window starts of each
    (b, h, tile, key frame) from a table (the exact 3D-DSA key set)."""

    def __init__(self, geo, offsets):
        self.geo = geo
        B, H = offsets.shape[:2]
        sizes = [len(qs) for _, _, qs in geo.tiles()]
        self.P = -(-max(sizes) // FLEX_BLOCK) * FLEX_BLOCK
        self.length = geo.ntiles * self.P
        perm = np.full(self.length, -1, np.int64)
        for t, (_, _, qs) in enumerate(geo.tiles()):
            perm[t * self.P:t * self.P + len(qs)] = qs
        self.pos = np.nonzero(perm >= 0)[0]  # padded positions of tokens
        self.tok = perm[self.pos]  # ... and their tokens
        tok = np.maximum(perm, 0)
        # Window starts per key frame; outside the window's frames, and in
        # the extra frame T of the padding keys, a start no key can reach
        # (sy + ky = -1).
        sy, sx = geo.window_starts(offsets)
        SY = np.full((B, H, geo.ntiles, geo.T + 1), -geo.ky - 1, np.int32)
        SX = np.full((B, H, geo.ntiles, geo.T + 1), -geo.kx - 1, np.int32)
        frames = geo.start[:, None] + np.arange(geo.kt)
        SY[:, :, np.arange(geo.ntiles)[:, None], frames] = sy
        SX[:, :, np.arange(geo.ntiles)[:, None], frames] = sx
        self.tables = {
            "tile": np.repeat(np.arange(geo.ntiles, dtype=np.int32), self.P),
            "frame": np.where(perm >= 0, tok // (geo.Y * geo.X),
                              geo.T).astype(np.int32),
            "y": ((tok // geo.X) % geo.Y).astype(np.int32),
            "x": (tok % geo.X).astype(np.int32), "sy": SY, "sx": SX}
        # Key tiles each window touches.
        dense = np.zeros((B, H, geo.ntiles, geo.ntiles), bool)
        ftile = (frames // geo.tt)[None, None]
        for a in range(-(-geo.ky // geo.ty) + 1):
            yt = sy // geo.ty + a
            for c in range(-(-geo.kx // geo.tx) + 1):
                xt = sx // geo.tx + c
                ok = ((yt * geo.ty < sy + geo.ky) & (yt < geo.ny)
                      & (xt * geo.tx < sx + geo.kx) & (xt < geo.nx))
                ids = (ftile * geo.ny + yt) * geo.nx + xt
                b, h, t, j = np.nonzero(ok)
                dense[b, h, t, ids[b, h, t, j]] = True
        per = self.P // FLEX_BLOCK
        self.blocks = dense.repeat(per, axis=2).repeat(per, axis=3)
        self.density = float(self.blocks.sum()) * FLEX_BLOCK ** 2 / (
            B * H * geo.N * geo.kt * geo.ky * geo.kx)

    def mask_mod(self, tables):
        """The exact key set; `tables` numpy or torch (the same code)."""
        g = self.geo
        tile, frame, ty, tx, SY, SX = (tables[n] for n in (
            "tile", "frame", "y", "x", "sy", "sx"))

        def mask(b, h, q, kv):
            t, f, y, x = tile[q], frame[kv], ty[kv], tx[kv]
            sy, sx = SY[b, h, t, f], SX[b, h, t, f]
            return (y >= sy) & (y < sy + g.ky) & (x >= sx) & (x < sx + g.kx)
        return mask

    def block_mask(self, torch, device):
        from torch.nn.attention.flex_attention import BlockMask
        dense = torch.from_numpy(self.blocks).to(device)
        num = dense.sum(-1, dtype=torch.int32)
        idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True,
                            stable=True).to(torch.int32)
        tables = {n: torch.from_numpy(a).to(device)
                  for n, a in self.tables.items()}
        return BlockMask.from_kv_blocks(
            num, idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=self.mask_mod(tables),
            seq_lengths=(self.length, self.length))

    def to_flex(self, torch, x):
        """[B, N, H, D] -> padded tile-major [B, H, L, D]."""
        pos, tok = (torch.from_numpy(a).to(x.device)
                    for a in (self.pos, self.tok))
        y = x.new_zeros((x.shape[0], self.length) + tuple(x.shape[2:]))
        y[:, pos] = x[:, tok]
        return y.transpose(1, 2).contiguous()

    def from_flex(self, torch, y, lse=False):
        """Back to [B, N, H, D] (or lse [B, H, L] to [B, H, N])."""
        pos, tok = (torch.from_numpy(a).to(y.device)
                    for a in (self.pos, self.tok))
        if lse:
            out = y.new_empty(y.shape[:2] + (self.geo.N,))
            out[:, :, tok] = y[:, :, pos]
            return out
        y = y.transpose(1, 2)
        out = y.new_empty((y.shape[0], self.geo.N) + tuple(y.shape[2:]))
        out[:, tok] = y[:, pos]
        return out


def check_flex_mask(geo, offsets, layout):
    """The mask, evaluated with numpy on every (query, key) pair, is
    exactly 3D-DSA's key set for every real query, and lies inside the
    kept blocks."""
    mask = layout.mask_mod(layout.tables)
    i = np.arange(layout.length)
    where = np.empty(geo.N, np.int64)
    where[layout.tok] = layout.pos
    B, H = offsets.shape[:2]
    for b in range(B):
        for h in range(H):
            m = mask(b, h, i[:, None], i[None, :])
            outside = m & ~layout.blocks[b, h].repeat(FLEX_BLOCK, 0).repeat(
                FLEX_BLOCK, 1)
            if outside.any():
                return False
            for t, ((it, iy, ix), centre, qs) in enumerate(geo.tiles()):
                want = np.zeros(layout.length, bool)
                want[where[geo.keys(centre, offsets[b, h, it, iy, ix])]] = True
                rows = m[t * layout.P:t * layout.P + len(qs)]
                if not (rows == want).all():
                    return False
    return True


def flex_forward_backward(torch, flex, layout, xs, scale, block_mask,
                          backward=True):
    """FlexAttention on graph-layout q, k, v, dO (torch): out, lse and,
    with `backward` (not on the CPU, where FlexAttention has none), dq,
    dk, dv, in the graph layout. `scale` must be a Python float: a NumPy
    scalar makes torch.compile's flex_attention fail."""
    from torch.nn.attention.flex_attention import AuxRequest
    q, k, v = (layout.to_flex(torch, x).requires_grad_(backward)
               for x in xs[:3])
    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale,
                    return_aux=AuxRequest(lse=True))
    result = [layout.from_flex(torch, out.detach()),
              layout.from_flex(torch, aux.lse.detach(), lse=True)]
    if backward:
        grads = torch.autograd.grad(out, (q, k, v),
                                    layout.to_flex(torch, xs[3]))
        result += [layout.from_flex(torch, g) for g in grads]
    return result


def load_torch(device):
    """torch with FlexAttention, or None and why not."""
    try:
        import torch
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        return None, None, "torch with FlexAttention not installed (%s)" % e
    if device == "cuda" and not torch.cuda.is_available():
        return None, None, "torch sees no GPU"
    return torch, flex_attention, None


def torch_time_ms(torch, body, warmup, reps):
    """Median CUDA-event time of body(), ms."""
    for _ in range(warmup):
        body()
    events = [(torch.cuda.Event(enable_timing=True),
               torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        body()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([a.elapsed_time(b) for a, b in events]))


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
        grid[2] = batch
        cuda.launch(fn, grid, kern["block"][0], kern["dynamic_shared_bytes"],
                    args)


class Run:
    """A configuration's device tensors (graph layout) and its launches.
    Inputs are 16-bit bit patterns, or Periodic (filled on the device)."""

    def __init__(self, cuda, directory, cfg, batch, inputs):
        self.cuda, self.cfg, self.batch = cuda, cfg, batch
        self.kern = Kernels(cuda, directory, cfg)
        self.geo = Geometry(cfg)
        self.elem = cfg["element_type"]
        H, D, N = cfg["heads"], cfg["head_dim"], cfg["tokens"]
        self.shape = (batch, N, H, D)
        self.elems = int(np.prod(self.shape))
        g = self.geo
        self.off_shape = (batch, H, g.nt, g.ny, g.nx, g.kt, 2)
        self.inputs = inputs
        self.ptr = {}
        for name in INPUTS:
            x = inputs[name]
            self.ptr[name] = (cuda.fill_periodic(x.bits, self.elems)
                              if isinstance(x, Periodic) else cuda.upload(x))
        for name in ("out", "dq", "dk", "dv"):
            self.ptr[name] = cuda.alloc(self.elems * 2)
        # lse and the backward's scratch Delta = rowsum(dO * O), [B, H, N].
        self.ptr["lse"] = cuda.alloc(batch * H * N * 4)
        self.ptr["delta"] = cuda.alloc(batch * H * N * 4)
        self.ptr["offsets"] = cuda.alloc(int(np.prod(self.off_shape)) * 4)

    def launch(self, kind, names, *extra):
        self.kern.run(self.cuda, kind, self.batch,
                      [self.ptr[n] for n in names] + list(extra))

    def offsets(self):
        self.launch("offsets", ("q", "k", "offsets"))

    def forward(self, scale):
        self.launch("forward", ("q", "k", "v", "offsets", "out", "lse"),
                    float(scale))

    def backward(self, scale):
        # dQ and Delta by query tiles, then dK and dV by key tiles.
        self.launch("backward", ("q", "k", "v", "offsets", "out", "do", "lse",
                                 "dq", "delta"), float(scale))
        self.launch("backward_keys", ("q", "k", "v", "offsets", "do", "lse",
                                      "delta", "dk", "dv"), float(scale))

    def get_offsets(self):
        return self.cuda.download(self.ptr["offsets"], self.off_shape,
                                  np.int32)

    def set_offsets(self, offsets):
        self.cuda.write(self.ptr["offsets"], offsets.astype(np.int32))

    def whole(self, name):
        """A 16-bit tensor as float64."""
        return from_bits(self.cuda.download(self.ptr[name], self.shape,
                                            np.uint16), self.elem)

    def lse(self, b, h):
        _, N, H, _ = self.shape
        return self.cuda.read(self.ptr["lse"], np.empty(N, np.float32),
                              (b * H + h) * N * 4).astype(np.float64)

    def source(self, name):
        """Rows of a device tensor, downloaded as runs of consecutive
        tokens (all heads of a token are contiguous)."""
        run = self

        class Rows:
            def rows(self, b, tokens, h):
                _, N, H, D = run.shape
                tokens = np.asarray(tokens)
                out = np.empty((len(tokens), D), np.uint16)
                i = 0
                while i < len(tokens):
                    j = i + 1
                    while j < len(tokens) and tokens[j] == tokens[j - 1] + 1:
                        j += 1
                    block = run.cuda.read(
                        run.ptr[name], np.empty((j - i, H, D), np.uint16),
                        (b * N + int(tokens[i])) * H * D * 2)
                    out[i:j] = block[:, h]
                    i = j
                return from_bits(out, run.elem)
        return Rows()

    def free(self):
        for p in self.ptr.values():
            self.cuda.free(p)


def check_config(cuda, directory, cfg, batch, rng):
    """A small configuration, whole: offsets, then out, lse and the
    gradients with random offsets (they exercise clamping more)."""
    geo = Geometry(cfg)
    elem, H, D, N = (cfg["element_type"], cfg["heads"], cfg["head_dim"],
                     cfg["tokens"])
    shape = (batch, N, H, D)
    scale = D ** -0.5
    print("%s (batch %d)" % (cfg["name"], batch))
    bits = {n: to_bits(rng.standard_normal(shape).astype(np.float32), elem)
            for n in INPUTS}
    src = {n: Dense(from_bits(b, elem)) for n, b in bits.items()}
    run = Run(cuda, directory, cfg, batch, bits)
    run.offsets()
    cuda.sync()
    items = [(b, h, t) for b in range(batch) for h in range(H)
             for t in range(geo.ntiles)]
    ok, off_rec = check_offsets(geo, src, run.get_offsets(), items, math.inf)

    R = max(geo.radius, 2)
    offsets = rng.integers(-R, R + 1, run.off_shape).astype(np.int32)
    run.set_offsets(offsets)
    run.forward(scale)
    run.backward(scale)
    cuda.sync()
    o_dev = run.whole("out")
    lse_dev = cuda.download(run.ptr["lse"], (batch, H, N), np.float32)
    o, lse, dq, dk, dv = reference(geo, src, offsets, scale, Dense(o_dev))
    good, rec = compare_all(
        [("out", o_dev, o), ("lse", lse_dev.astype(np.float64), lse),
         ("dq", run.whole("dq"), dq), ("dk", run.whole("dk"), dk),
         ("dv", run.whole("dv"), dv)], elem, scaled=False)
    run.free()
    ok &= good
    return ok, {"name": cfg["name"], "mode": "whole", "batch": batch,
                "offsets": off_rec, "checks": rec, "ok": ok}


def check_sampled(run, args, rng):
    """A big configuration run whole on the GPU (offsets, forward,
    backward), checked on a sample of tiles and keys."""
    cuda, cfg, geo = run.cuda, run.cfg, run.geo
    scale = cfg["head_dim"] ** -0.5
    print("%s (batch %d): sampled check" % (cfg["name"], run.batch))
    run.offsets()
    run.forward(scale)
    run.backward(scale)
    cuda.sync()
    offsets = run.get_offsets()
    tiles, keys = choose_samples(geo, run.batch, cfg["heads"], rng,
                                 args.sample_tiles, args.sample_keys)
    # The device holds what the host generator says (fill_periodic).
    b, h, t = tiles[0]
    qs = geo.tiles()[t][2]
    same = all(np.array_equal(run.source(n).rows(b, qs, h),
                              run.inputs[n].rows(b, qs, h)) for n in INPUTS)
    print("  inputs   device rows %s the host generator's" % (
        "equal" if same else "DIFFER from"))
    start = time.monotonic()
    ok, off_rec = check_offsets(geo, run.inputs, offsets, tiles,
                                args.seconds / 4)
    ok &= same
    done, done_keys = sampled_reference(
        geo, run.inputs, offsets, scale, tiles, keys,
        args.seconds - (time.monotonic() - start), run.source("out"))
    host_s = time.monotonic() - start
    out, dq = run.source("out"), run.source("dq")
    got, want = ({n: [] for n in ("out", "lse", "dq")} for _ in range(2))
    for (b, h, t), (qs, o, lse, tdq) in done:
        got["out"].append(out.rows(b, qs, h))
        got["lse"].append(run.lse(b, h)[qs])
        got["dq"].append(dq.rows(b, qs, h))
        for n, w in (("out", o), ("lse", lse), ("dq", tdq)):
            want[n].append(w)
    dk, dv = run.source("dk"), run.source("dv")
    for n, src in (("dk", dk), ("dv", dv)):
        got[n] = [src.rows(b, [key], h)[0] for (b, h, key), _, _ in done_keys]
    want["dk"] = [w for _, w, _ in done_keys]
    want["dv"] = [w for _, _, w in done_keys]
    computed = dict(done)
    sampled = sum(1 for item in tiles if item in computed)
    print("  sample   %d of %d query tiles, %d of %d keys (%d tiles "
          "computed in all), %.1f s of float64 host work (budget %g s)" % (
              sampled, len(tiles), len(done_keys), len(keys), len(done),
              host_s, args.seconds))
    good, rec = compare_all(
        [(n, np.concatenate(got[n]) if got[n] else np.zeros(0),
          np.concatenate(want[n]) if want[n] else np.zeros(0))
         for n in ("out", "lse", "dq")] +
        [(n, np.array(got[n]).reshape(-1), np.array(want[n]).reshape(-1))
         for n in ("dk", "dv")], cfg["element_type"], scaled=True)
    ok &= good
    return ok, {"name": cfg["name"], "mode": "sampled", "batch": run.batch,
                "inputs_match": same, "offsets": off_rec, "checks": rec,
                "query_tiles": [sampled, len(tiles)],
                "keys": [len(done_keys), len(keys)],
                "tiles_computed": len(done), "host_seconds": host_s,
                "budget_seconds": args.seconds, "ok": ok}


def bench_config(run, args):
    """CUDA-event times of the big kernels (median of --reps)."""
    cuda, cfg = run.cuda, run.cfg
    scale = cfg["head_dim"] ** -0.5
    W, B = cfg["window_keys"], run.batch
    H, D, N = cfg["heads"], cfg["head_dim"], cfg["tokens"]
    fwd_flops = 4.0 * B * H * N * W * D
    print("%s (batch %d): timing, median of %d after %d warm-up" % (
        cfg["name"], B, args.reps, args.warmup))
    ms = {
        "offsets": cuda.time_ms(run.offsets, args.warmup, args.reps),
        "forward": cuda.time_ms(lambda: run.forward(scale), args.warmup,
                                args.reps),
        "backward": cuda.time_ms(lambda: run.backward(scale), args.warmup,
                                 args.reps)}
    ms["forward_backward"] = cuda.time_ms(
        lambda: (run.forward(scale), run.backward(scale)), args.warmup,
        args.reps)
    flops = {"forward": fwd_flops, "backward": 2.5 * fwd_flops,
             "forward_backward": 3.5 * fwd_flops}
    tflops = {k: flops[k] / ms[k] / 1e9 for k in flops}
    for k, v in ms.items():
        print("  %-16s %9.3f ms%s" % (k, v, " %.0f TFLOP/s" % tflops[k]
                                      if k in tflops else ""))
    return {"name": cfg["name"], "batch": B, "reps": args.reps, "ms": ms,
            "tflops": tflops}


def bench_flex(run, args, flex, ms):
    """FlexAttention on the kernels' own inputs and offsets (torch copies
    of the device tensors), compiled: times, ratios MegaSlide / Flex
    (`ms`: bench_config's), and its output against the kernels' over the
    whole tensors. Returns (agrees, record)."""
    torch, flex_attention = flex
    cuda, geo = run.cuda, run.geo
    scale = run.cfg["head_dim"] ** -0.5
    cuda.sync()
    layout = FlexLayout(geo, run.get_offsets())
    dtype = torch.bfloat16 if run.elem == "bf16" else torch.float16

    def copy(name):
        t = torch.empty(run.shape, dtype=dtype, device="cuda")
        cuda.copy(t.data_ptr(), run.ptr[name].value, run.elems * 2)
        return t
    cuda.sync()
    xs = [copy(n) for n in INPUTS]
    ours = copy("out")
    cuda.sync()
    compiled = torch.compile(flex_attention, dynamic=False)
    bm = layout.block_mask(torch, "cuda")
    q, k, v = (layout.to_flex(torch, x).requires_grad_() for x in xs[:3])
    do = layout.to_flex(torch, xs[3])
    del xs

    def forward():
        return compiled(q, k, v, block_mask=bm, scale=scale)

    def forward_backward():
        torch.autograd.grad(forward(), (q, k, v), do)
    compile_start = time.monotonic()
    with torch.no_grad():
        forward()
    forward_backward()
    torch.cuda.synchronize()
    compile_s = time.monotonic() - compile_start
    with torch.no_grad():
        fwd = torch_time_ms(torch, forward, args.warmup, args.reps)
        theirs = layout.from_flex(torch, forward())
    fwd_bwd = torch_time_ms(torch, forward_backward, args.warmup, args.reps)
    # The whole output, theirs against ours: both round to 16 bits.
    tol = 2e-2 if run.elem == "bf16" else 4e-3
    peak = float(ours.abs().max())
    worst, bad = 0.0, 0
    for h in range(0, ours.shape[2], 8):  # fp32 copies of 8 heads at a time
        a, b = theirs[:, :, h:h + 8].float(), ours[:, :, h:h + 8].float()
        err = (a - b).abs()
        worst = max(worst, float(err.max()))
        bad += int((err > tol * peak + tol * b.abs()).sum())
    agree = bad == 0
    rec = {"forward_ms": fwd, "forward_backward_ms": fwd_bwd,
           "ratio_forward": ms["forward"] / fwd,
           "ratio_forward_backward": ms["forward_backward"] / fwd_bwd,
           "compile_seconds": compile_s, "block_density": layout.density,
           "out_vs_megaslide": {"max_err": worst, "atol": tol * peak,
                                "rtol": tol, "bad": bad, "ok": agree}}
    print("  FlexAttention (torch %s; tile-major tokens, tiles padded to %d,"
          " %.2fx the window's keys in kept blocks; compile %.0f s)" % (
              torch.__version__, layout.P, layout.density, compile_s))
    print("  %-16s %9.3f ms   MegaSlide/Flex %.2f" % (
        "flex forward", fwd, rec["ratio_forward"]))
    print("  %-16s %9.3f ms   MegaSlide/Flex %.2f" % (
        "flex fwd+bwd", fwd_bwd, rec["ratio_forward_backward"]))
    print("  flex out vs MegaSlide out, all %d values: max |diff| %.3e "
          "(tol %.1e + %.1e |ours|)  %s" % (
              ours.numel(), worst, tol * peak, tol,
              "ok" if agree else "FAIL (%d)" % bad))
    return agree, rec


def check_flex(flex, cfg, batch, rng, device):
    """FlexAttention with FlexLayout's mask computes 3D-DSA: on `device`
    (cuda: compiled, 16-bit inputs, the kernels' tolerances), against the
    float64 reference, with random offsets."""
    torch, flex_attention = flex
    geo = Geometry(cfg)
    elem, H, D, N = (cfg["element_type"], cfg["heads"], cfg["head_dim"],
                     cfg["tokens"])
    shape = (batch, N, H, D)
    scale = D ** -0.5
    print("%s (batch %d): FlexAttention against the reference" % (
        cfg["name"], batch))
    src = {n: Dense(from_bits(to_bits(rng.standard_normal(shape), elem),
                              elem)) for n in INPUTS}
    R = max(geo.radius, 2)
    offsets = rng.integers(-R, R + 1, (batch, H, geo.nt, geo.ny, geo.nx,
                                       geo.kt, 2)).astype(np.int32)
    layout = FlexLayout(geo, offsets)
    want = reference(geo, src, offsets, scale)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[elem]
    fn = torch.compile(flex_attention, dynamic=False)
    xs = [torch.from_numpy(src[n].array).to(device=device, dtype=dtype)
          for n in INPUTS]
    got = [g.double().cpu().numpy() for g in flex_forward_backward(
        torch, fn, layout, xs, scale, layout.block_mask(torch, device))]
    ok, rec = compare_all(list(zip(("out", "lse", "dq", "dk", "dv"), got,
                                   want)), elem, scaled=False)
    return ok, {"name": cfg["name"], "batch": batch, "checks": rec, "ok": ok}


# ---------------------------------------------------------------------------
# Without a GPU
# ---------------------------------------------------------------------------

SELF_TEST_CONFIGS = [
    # partial border tiles, f16, the grid's clamps on every axis
    make_config("borders", [5, 7, 9], [3, 3, 5], [2, 3, 4], 2, 16, "f16", 1),
    # 256-query tiles: two FlexAttention blocks per tile
    make_config("qblocks", [4, 16, 16], [2, 8, 8], [2, 8, 16], 1, 16,
                "bf16", 1),
]


def self_test(args):
    """The reference logic without a GPU: the sampled reference (on
    Periodic inputs, as the big check uses) equals the full one (on their
    materialized arrays) bit for bit on every sampled tile and key; the
    FlexAttention mask is 3D-DSA's; with torch, eager FlexAttention in
    float64 matches the reference."""
    flex = load_torch("cpu")
    ok = True
    for cfg in SELF_TEST_CONFIGS:
        rng = np.random.default_rng(args.seed)
        geo = Geometry(cfg)
        B, H, D = 2, cfg["heads"], cfg["head_dim"]
        shape = (B, geo.N, H, D)
        scale = D ** -0.5
        gen = {n: Periodic(rng, cfg["element_type"], shape, period=4099)
               for n in INPUTS}
        dense = {n: Dense(from_bits(g.materialize(), cfg["element_type"]))
                 for n, g in gen.items()}
        offsets = rng.integers(-2, 3, (B, H, geo.nt, geo.ny, geo.nx, geo.kt,
                                       2)).astype(np.int32)
        o_dev = Dense(dense["v"].array[:, :, ::-1])  # any "kernel output"
        o, lse, dq, dk, dv = reference(geo, dense, offsets, scale, o_dev)
        tiles, keys = choose_samples(geo, B, H, rng, 6, 4)
        done, done_keys = sampled_reference(geo, gen, offsets, scale, tiles,
                                            keys, math.inf, o_dev)
        exact = len(done_keys) == len(keys) and all(
            np.array_equal(to, o[b, qs, h]) and
            np.array_equal(tl, lse[b, h, qs]) and
            np.array_equal(tdq, dq[b, qs, h])
            for (b, h, _), (qs, to, tl, tdq) in done) and all(
            np.array_equal(tdk, dk[b, n, h]) and
            np.array_equal(tdv, dv[b, n, h])
            for (b, h, n), tdk, tdv in done_keys)
        print("%s: sampled reference (%d tiles, %d keys) %s the full one" % (
            cfg["name"], len(done), len(done_keys),
            "equals" if exact else "DIFFERS from"))
        layout = FlexLayout(geo, offsets)
        mask_ok = check_flex_mask(geo, offsets, layout)
        print("%s: FlexAttention mask %s 3D-DSA's key sets (%.2fx the keys "
              "in kept blocks)" % (cfg["name"], "is" if mask_ok else
                                   "is NOT", layout.density))
        ok &= exact and mask_ok
        if flex[0] is None:
            continue
        torch = flex[0]
        xs = [torch.from_numpy(dense[n].array) for n in INPUTS]
        with warnings.catch_warnings():  # "called without torch.compile()"
            warnings.simplefilter("ignore", UserWarning)
            got = flex_forward_backward(torch, flex[1], layout, xs, scale,
                                        layout.block_mask(torch, "cpu"),
                                        backward=False)
        want = reference(geo, dense, offsets, scale)[:2]
        worst = max(float(np.abs(g.numpy() - w).max() /
                          max(1.0, np.abs(w).max()))
                    for g, w in zip(got, want))
        print("%s: eager FlexAttention forward in float64 (out, lse), max "
              "relative error "
              "%.1e  %s" % (cfg["name"], worst,
                            "ok" if worst < 1e-9 else "FAIL"))
        ok &= worst < 1e-9
    if flex[0] is None:
        print("eager FlexAttention check skipped: %s" % flex[2])
    print("self-test %s" % ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?",
                        help="megaslide-translate -o DIR --cubin ...")
    parser.add_argument("--check", action="store_true",
                        help="numerics: small configurations whole, big ones "
                             "on a sample")
    parser.add_argument("--bench", action="store_true",
                        help="time the configurations above "
                             "--max-check-tokens")
    parser.add_argument("--flex", action="store_true",
                        help="FlexAttention baseline (torch): checked on a "
                             "small configuration, timed with --bench")
    parser.add_argument("--batch", type=int, default=2,
                        help="batch of the small configurations (big: 1)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-check-tokens", type=int, default=1 << 12)
    parser.add_argument("--sample-tiles", type=int, default=16)
    parser.add_argument("--sample-keys", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="budget of the sampled check's float64 host "
                             "work per big configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE",
                        help="write every figure here")
    parser.add_argument("--self-test", action="store_true",
                        help="the reference and mask logic, no GPU needed")
    args = parser.parse_args()
    if args.self_test:
        return self_test(args)
    if not args.dir:
        parser.error("DIR is required (or --self-test)")
    report = {"configs": [], "timings": [], "skipped": []}

    def finish(ok, message=None):
        report["ok"] = ok
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        print("dsa_gpu_check: %s" % (message or ("all checks passed" if ok
                                                 else "FAILED")))
        return 0 if ok else 1

    try:
        cuda = Cuda()
    except (RuntimeError, OSError) as e:
        report["skipped"].append("no GPU (%s)" % e)
        return finish(True, "no GPU (%s); skipped" % e)
    print("dsa_gpu_check on %s" % cuda.name)
    report["device"] = cuda.name
    manifest = json.load(open(os.path.join(args.dir, "manifest.json")))
    configs = manifest["configs"]
    flex = None
    if args.flex:
        torch, flex_attention, why = load_torch("cuda")
        if torch is None:
            print("FlexAttention baseline skipped: %s" % why)
            report["skipped"].append("FlexAttention: %s" % why)
        else:
            flex = (torch, flex_attention)
    rng = np.random.default_rng(args.seed)
    ok = True

    def small(cfg):
        return cfg["tokens"] * cfg["heads"] <= args.max_check_tokens

    def guarded(what, body):
        """body() -> (ok, record); an exception (a failed launch, a
        FlexAttention that does not compile) fails this part only, and the
        report still gets written."""
        try:
            return body()
        except Exception as e:  # noqa: BLE001 - reported, and fails the run
            traceback.print_exc()
            print("%s: FAILED with %s: %s" % (what, type(e).__name__, e))
            return False, {"name": what, "error": "%s: %s" % (
                type(e).__name__, e), "ok": False}

    def big(cfg):
        inputs = {n: Periodic(rng, cfg["element_type"],
                              (1, cfg["tokens"], cfg["heads"],
                               cfg["head_dim"])) for n in INPUTS}
        run = Run(cuda, args.dir, cfg, 1, inputs)
        try:
            good, recs = True, {}
            if args.check:
                good, recs["check"] = check_sampled(run, args, rng)
            if args.bench:
                recs["timing"] = bench_config(run, args)
                if flex:
                    flex_ok, recs["timing"]["flex"] = guarded(
                        cfg["name"] + " FlexAttention",
                        lambda: bench_flex(run, args, flex,
                                           recs["timing"]["ms"]))
                    good &= flex_ok
            return good, recs
        finally:
            run.free()
    for cfg in configs:
        if small(cfg) and args.check:
            good, rec = guarded(cfg["name"], lambda: check_config(
                cuda, args.dir, cfg, args.batch, rng))
            report["configs"].append(rec)
        elif not small(cfg) and (args.check or args.bench):
            good, recs = guarded(cfg["name"], lambda: big(cfg))
            if "error" in recs:
                report["configs"].append(recs)
            else:
                report["configs"] += [recs["check"]] if "check" in recs \
                    else []
                report["timings"] += [recs["timing"]] if "timing" in recs \
                    else []
        else:
            continue
        ok &= good
    if flex:
        # The small configuration closest to the big ones' head dim.
        big_d = max([c["head_dim"] for c in configs if not small(c)] or [0])
        candidates = [c for c in configs if small(c)]
        if candidates:
            cfg = min(candidates, key=lambda c: (abs(c["head_dim"] - big_d),
                                                 -c["tokens"]))
            good, report["flex_check"] = guarded(
                cfg["name"] + " FlexAttention check",
                lambda: check_flex(flex, cfg, args.batch, rng, "cuda"))
            ok &= good
    return finish(ok)


if __name__ == "__main__":
    sys.exit(main())
