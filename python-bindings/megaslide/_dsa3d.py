"""3D Deformable Slide Attention on numpy arrays (the CPU kernels,
runtime/cpu/Dsa3d.cpp)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _megaslide
from ._checks import _within_int64


_QKV_LAYOUT = "(B, H, T, Y, X, D)"


def _array(name: str, value: Any, dtype: Any) -> np.ndarray:
    """``value`` as a C-contiguous array of exactly ``dtype``.

    Other dtypes are rejected rather than cast: a float64 tensor silently
    rounded to float32 would hide a precision mistake in the caller.
    """
    array = np.asarray(value)
    if array.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got "
                        f"{array.dtype}")
    return np.ascontiguousarray(array)


def _triple(name: str, value: Any, what: str) -> Tuple[int, int, int]:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a tuple of 3 ints {what}, got "
                        f"{value!r}") from None
    if len(items) != 3 or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool)
            for v in items):
        raise TypeError(f"{name} must be a tuple of 3 ints {what}, got "
                        f"{value!r}")
    items = tuple(int(v) for v in items)
    if any(v <= 0 for v in items):
        raise ValueError(f"{name} must be positive, got {items}")
    for v in items:
        _within_int64(name, v)
    return items


def _dsa3d_args(q, k, window, tile, **others):
    """Checks q, k (and v, d_out in ``others``) and the window geometry;
    returns (q, k, others, window, tile, grid)."""
    q = _array("q", q, np.float32)
    if q.ndim != 6:
        raise ValueError(f"q must have shape {_QKV_LAYOUT}, got shape "
                         f"{q.shape}")
    if 0 in q.shape:
        raise ValueError(f"q has shape {q.shape}: every dimension of "
                         f"{_QKV_LAYOUT} must be positive")
    checked = {}
    for name, value in [("k", k), *others.items()]:
        array = _array(name, value, np.float32)
        if array.shape != q.shape:
            raise ValueError(f"{name} has shape {array.shape}, expected "
                             f"{q.shape} (the shape of q, {_QKV_LAYOUT})")
        checked[name] = array
    window = _triple("window", window, "(kt, ky, kx)")
    tile = _triple("tile", tile, "(tt, ty, tx)")
    grid = q.shape[2:5]
    for axis, w, g in zip("tyx", window, grid):
        if w > g:
            raise ValueError(f"window {window} exceeds the token grid "
                             f"(T, Y, X) = {grid} along {axis} ({w} > {g}); "
                             f"use a window of at most the grid")
    return q, checked.pop("k"), checked, window, tile, grid


def _offsets_shape(q: np.ndarray, window, tile) -> Tuple[int, ...]:
    B, H, T, Y, X, _ = q.shape
    n = [-(-extent // t) for extent, t in zip((T, Y, X), tile)]
    return (B, H, *n, window[0], 2)


def _check_offsets(offsets, q, window, tile) -> np.ndarray:
    offsets = _array("offsets", offsets, np.int32)
    expected = _offsets_shape(q, window, tile)
    if offsets.shape != expected:
        raise ValueError(
            f"offsets has shape {offsets.shape}, expected {expected} = "
            f"(B, H, ceil(T/tt), ceil(Y/ty), ceil(X/tx), kt, 2) for q "
            f"{q.shape}, window {window} and tile {tile}")
    return offsets


def _scale(scale: Optional[float], head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    return float(scale)


def dsa3d(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    offsets: np.ndarray,
    window: Sequence[int],
    tile: Sequence[int],
    scale: Optional[float] = None,
) -> np.ndarray:
    """3D Deformable Slide Attention forward on the CPU.

    ``q``, ``k``, ``v``: float32 arrays of shape (B, H, T, Y, X, D) over the
    token grid T x Y x X. Queries are tiled by ``tile`` = (tt, ty, tx); all
    queries of a tile attend to the same ``window`` = (kt, ky, kx) keys:
    frames [s_t, s_t + kt) around the tile's centre frame and, per key frame
    j, a spatial window displaced by ``offsets[b, h, it, iy, ix, j]`` =
    (dy, dx) and clamped inside the grid (docs/Dsa3d.md, "Definition").
    ``offsets``: int32 (B, H, ceil(T/tt), ceil(Y/ty), ceil(X/tx), kt, 2),
    e.g. from :func:`dsa3d_offsets` or zeros.

    Returns softmax(scale * q k^T) v over exactly kt * ky * kx keys per
    query, float32 (B, H, T, Y, X, D); ``scale`` defaults to 1/sqrt(D).
    Cost O(N * kt * ky * kx * D) for N = T * Y * X tokens, fp32
    accumulation, multithreaded (MEGASLIDE_NUM_THREADS overrides the
    thread count).

    Raises TypeError for arrays that are not float32 (offsets: int32) — they
    are never cast — and ValueError naming the argument for bad shapes,
    windows larger than the grid, non-positive tiles or windows, or a bad
    scale.
    """
    q, k, rest, window, tile, _ = _dsa3d_args(q, k, window, tile, v=v)
    offsets = _check_offsets(offsets, q, window, tile)
    out, _lse = _megaslide.dsa3d_forward(q, k, rest["v"], offsets, window,
                                         tile, _scale(scale, q.shape[5]))
    return out


def dsa3d_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    offsets: np.ndarray,
    d_out: np.ndarray,
    window: Sequence[int],
    tile: Sequence[int],
    scale: Optional[float] = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dq, dk, dv) of :func:`dsa3d` given ``d_out`` = dL/d out.

    Arguments as for :func:`dsa3d`; ``d_out`` is float32 of the shape of q.
    The forward is recomputed first to obtain the output and the per-query
    log-sum-exp the flash-style backward needs, so a call costs about one
    forward plus the backward proper (nothing quadratic is stored).
    Offsets are integers and carry no gradient. Raises as :func:`dsa3d`.
    """
    q, k, rest, window, tile, _ = _dsa3d_args(q, k, window, tile, v=v,
                                              d_out=d_out)
    offsets = _check_offsets(offsets, q, window, tile)
    scale = _scale(scale, q.shape[5])
    v, d_out = rest["v"], rest["d_out"]
    out, lse = _megaslide.dsa3d_forward(q, k, v, offsets, window, tile, scale)
    dq, dk, dv = _megaslide.dsa3d_backward(q, k, v, offsets, out, d_out, lse,
                                           window, tile, scale)
    return dq, dk, dv


def dsa3d_offsets(
    q: np.ndarray,
    k: np.ndarray,
    window: Sequence[int],
    tile: Sequence[int],
    radius: int,
) -> np.ndarray:
    """Block-matching window displacements for :func:`dsa3d`.

    For each query tile and key frame j, the displacement (dy, dx) in
    [-radius, radius]^2 that maximises the dot product of the mean-pooled
    query tile and the mean-pooled keys of the displaced (clamped) window at
    frame s_t + j; ties go to the smallest |dy| + |dx|, then the smallest
    dy, then dx. ``q``, ``k``: float32 (B, H, T, Y, X, D). Returns int32
    (B, H, ceil(T/tt), ceil(Y/ty), ceil(X/tx), kt, 2). Cost
    O(N * D + tiles * kt * (2 radius + 1)^2 * D) with summed-area tables.

    Raises TypeError for non-float32 arrays or a non-int radius, ValueError
    for bad shapes, windows larger than the grid, non-positive tiles or a
    negative radius.
    """
    q, k, _, window, tile, _ = _dsa3d_args(q, k, window, tile)
    if isinstance(radius, bool) or not isinstance(radius, numbers.Integral):
        raise TypeError(f"radius must be an int, got {type(radius).__name__}")
    if radius < 0:
        raise ValueError(f"radius must be non-negative, got {radius}")
    return _megaslide.dsa3d_offsets(q, k, window, tile,
                                    _within_int64("radius", radius))
