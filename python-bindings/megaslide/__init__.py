"""MegaSlide: plan and run full fine-tuning of very large video DiTs.

Import from a build tree with ``PYTHONPATH=build/python_packages``.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from . import _megaslide

__version__: str = _megaslide.__version__

__all__ = ["model_info", "plan", "dsa3d", "dsa3d_backward", "dsa3d_offsets",
           "__version__"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def model_info(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
) -> Dict[str, Any]:
    """Parameter counts, tokens, FLOPs and memory of a training step.

    Returns what ``megaslide-plan --format json`` prints (schema in
    docs/PlanSchema.md). ``model`` is a preset name (``tiny``,
    ``dit-xl-2``, ``wan2.1-t2v-14b``, ``megaslide-105b``) or a path to a
    JSON config. Sizes are pixels unless ``latent`` is true.

    Raises ValueError naming the offending field for bad configs or sizes.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    return json.loads(_megaslide.model_info_json(*args))


_PLAN_OPTIONS = {
    "gpu_reserve": str, "os_allowance": str, "hw": str, "activation_policy": str,
    "host_state_policy": str, "attention": str, "precision": str, "buffers": int,
    "prefetch_distance": int, "dsa_window": tuple, "dsa_tile": tuple,
    "dsa_radius": int,
}


def plan(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    gpu_mem: str = "141GB",
    host_mem: str = "1.5TB",
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    **options: Any,
) -> Dict[str, Any]:
    """Plans a training step: memory, transfers and predicted step time.

    Returns what ``megaslide-plan --format json`` prints (docs/PlanSchema.md),
    including ``fits`` and ``violations``: a plan over budget is a result,
    not an exception. Memory sizes take decimal or binary units ("141GB",
    "1.5TB", "80GiB"). Further options: gpu_reserve (device memory kept
    for the CUDA context and libraries, default "2GiB"), os_allowance, hw (path to a
    hardware JSON), activation_policy (keep|recompute|offload|auto),
    host_state_policy (master-moments|persistent-bf16|bf16-moments),
    attention (dsa|global), precision (bf16|f32: the compute type of
    activations, working weights and gradients; masters and moments are
    fp32 either way), dsa_window and dsa_tile ((t, y, x) in tokens),
    dsa_radius, buffers, prefetch_distance.

    Raises ValueError for bad configs, sizes or options, TypeError for
    arguments of the wrong type.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    payload = _options_payload("plan", options, gpu_mem=gpu_mem,
                               host_mem=host_mem)
    return json.loads(_megaslide.plan_json(*args, payload))


def _options_payload(caller: str, options: Dict[str, Any], **given: Any) -> str:
    """The plan options as the C API's JSON object, type-checked."""
    for name in ("gpu_mem", "host_mem"):
        if not isinstance(given[name], str):
            raise TypeError(f"{name} must be a str such as '141GB', got "
                            f"{type(given[name]).__name__}")
    for name, value in options.items():
        expected = _PLAN_OPTIONS.get(name)
        if expected is None:
            raise TypeError(f"{caller}() got an unexpected option '{name}'; "
                            f"known: {', '.join(sorted(_PLAN_OPTIONS))}")
        if expected is tuple:
            if (not isinstance(value, (tuple, list)) or len(value) != 3 or
                    not all(isinstance(v, int) and not isinstance(v, bool)
                            for v in value)):
                raise TypeError(f"{name} must be three ints (t, y, x), got "
                                f"{value!r}")
            options[name] = list(value)
        elif isinstance(value, bool) or not isinstance(value, expected):
            raise TypeError(f"{name} must be a {expected.__name__}, got "
                            f"{type(value).__name__}")
    return json.dumps(dict(options, **{k: v for k, v in given.items()
                                       if v is not None}))


def _common_args(model, frames, height, width, batch, text_len, latent):
    if not isinstance(model, str):
        raise TypeError(f"model must be a str, got {type(model).__name__}")
    sizes = [_positive_int(n, v) for n, v in
             (("frames", frames), ("height", height), ("width", width),
              ("batch", batch))]
    text = 0 if text_len is None else _positive_int("text_len", text_len)
    return (model, *sizes[:3], bool(latent), sizes[3], text)


# ---------------------------------------------------------------------------
# 3D Deformable Slide Attention (CPU kernels, runtime/cpu/Dsa3d.cpp)
# ---------------------------------------------------------------------------

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
    (dy, dx) and clamped inside the grid (DESIGN.md, "3D Deformable Slide
    Attention"). ``offsets``: int32 (B, H, ceil(T/tt), ceil(Y/ty),
    ceil(X/tx), kt, 2), e.g. from :func:`dsa3d_offsets` or zeros.

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
    return _megaslide.dsa3d_offsets(q, k, window, tile, int(radius))


# ---------------------------------------------------------------------------
# Host AdamW (runtime/cpu/AdamW.cpp)
# ---------------------------------------------------------------------------

__all__ += ["adamw_step"]


def _adamw_buffer(name: str, value: Any, dtypes: Tuple[Any, ...],
                  shape: Optional[Tuple[int, ...]]) -> np.ndarray:
    """``value`` as it is: an ndarray of one of ``dtypes``, C-contiguous, of
    ``shape`` when given. Never copied or cast, because the step writes
    into these arrays (a converted copy would take the update and be
    dropped) and reads gradients at memory speed."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got "
                        f"{type(value).__name__}")
    if value.dtype.name == "bfloat16" and np.dtype(np.uint16) in dtypes:
        value = value.view(np.uint16)  # ml_dtypes.bfloat16: same bits
    if value.dtype not in dtypes:
        names = " or ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}, got {value.dtype}")
    if shape is not None and value.shape != shape:
        raise ValueError(f"{name} has shape {value.shape}, expected {shape} "
                         f"(the shape of master)")
    if not value.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (it is used in place; "
                         f"pass np.ascontiguousarray(...) and keep it)")
    return value


def _adamw_real(name: str, value: Any, low: float, high: float,
                high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or value < low or above:
        bound = ")" if high_open else "]"
        raise ValueError(f"{name} must be in [{low}, {high}{bound}, got "
                         f"{value}")
    return value


def adamw_step(
    master: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    grad: np.ndarray,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    working: Optional[np.ndarray] = None,
) -> None:
    """One fused AdamW step on the host, in place (the runtime's optimizer).

    With t = ``step`` (1-based: the first update uses 1) and g = grad::

        exp_avg    = beta1 exp_avg + (1 - beta1) g
        exp_avg_sq = beta2 exp_avg_sq + (1 - beta2) g^2
        master    -= lr (weight_decay master
                         + (exp_avg / (1 - beta1^t))
                           / (sqrt(exp_avg_sq / (1 - beta2^t)) + eps))

    which is ``torch.optim.AdamW`` (decoupled weight decay) and the graph op
    ``megaslide.adamw``. ``master``, ``exp_avg`` and ``exp_avg_sq`` are
    float32 arrays of one shape, C-contiguous and writeable; they are
    updated in place. ``grad`` has their shape and is either bf16 bit
    patterns as uint16 (or an ``ml_dtypes.bfloat16`` array) or float32.
    ``working``, if given, is a uint16 array of that shape that receives the
    round-to-nearest-even bf16 of the new master (the bf16 working copy).

    Arithmetic is float32; the per-call coefficients (1 - beta, the bias
    corrections) are formed in double from the hyper-parameters and each
    rounded to float32 once. One pass over
    memory, multithreaded (MEGASLIDE_NUM_THREADS overrides the thread
    count); the result does not depend on the thread count. Releases the
    GIL while it runs.

    Raises TypeError naming the argument for non-arrays, wrong dtypes (never
    cast or copied: an update into a copy would be lost) or non-numeric
    hyper-parameters; ValueError for shape mismatches, non-contiguous or
    read-only arrays, arrays sharing memory, step < 1, or hyper-parameters
    outside lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0.
    """
    master = _adamw_buffer("master", master, (np.float32,), None)
    exp_avg = _adamw_buffer("exp_avg", exp_avg, (np.float32,), master.shape)
    exp_avg_sq = _adamw_buffer("exp_avg_sq", exp_avg_sq, (np.float32,),
                               master.shape)
    grad = _adamw_buffer("grad", grad, (np.uint16, np.float32), master.shape)
    if working is not None:
        working = _adamw_buffer("working", working, (np.uint16,),
                                master.shape)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the first update is step 1), "
                         f"got {step}")
    inf = math.inf
    hyper = dict(lr=_adamw_real("lr", lr, 0.0, inf, high_open=True),
                 beta1=_adamw_real("beta1", beta1, 0.0, 1.0, high_open=True),
                 beta2=_adamw_real("beta2", beta2, 0.0, 1.0, high_open=True),
                 eps=_adamw_real("eps", eps, 0.0, inf, high_open=True),
                 weight_decay=_adamw_real("weight_decay", weight_decay, 0.0,
                                          inf, high_open=True))
    _megaslide.adamw_step(master, exp_avg, exp_avg_sq, grad, working,
                          int(step), **hyper)


# ---------------------------------------------------------------------------
# Training (runtime/train/Session: the same runs as megaslide-run)
# ---------------------------------------------------------------------------

__all__ += ["exec_plan", "Trainer"]


def exec_plan(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    gpu_mem: str = "141GB",
    host_mem: str = "1.5TB",
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    lr: Optional[float] = None,
    **options: Any,
) -> str:
    """The execution plan of a training step as JSON text.

    This is what ``megaslide-run --save-plan`` writes (docs/ExecutionPlan.md).
    Options are those of :func:`plan`; ``lr`` overrides the config's
    learning rate. Raises ValueError for bad input or a plan over budget.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    if lr is not None and (isinstance(lr, bool) or
                           not isinstance(lr, numbers.Real) or not lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    payload = _options_payload("exec_plan", options, gpu_mem=gpu_mem,
                               host_mem=host_mem,
                               lr=None if lr is None else float(lr))
    return _megaslide.exec_plan_json(*args, payload)


class Trainer:
    """A training run on the cpu (or sim) backend, numpy arrays in and out.

    Compiles the model's training step (or takes ``plan_json``, e.g. read
    from a file ``megaslide-run --save-plan`` wrote) and keeps the host
    state: fp32 masters, AdamW moments and the optimizer step.

    >>> tr = Trainer("tiny", frames=17, height=128, width=128, precision="f32")
    >>> loss, grads = tr.gradients(**batch)   # no update
    >>> tr.step()["loss"]                     # one step on synthetic data
    """

    def __init__(self, model: Optional[str] = None, frames: int = 17,
                 height: int = 128, width: int = 128, *, backend: str = "cpu",
                 seed: int = 0, plan_json: Optional[str] = None,
                 **plan_options: Any) -> None:
        if backend not in ("cpu", "cuda", "sim"):
            raise ValueError(f"backend must be cpu, cuda or sim, got "
                             f"{backend!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if plan_json is None:
            if model is None:
                raise ValueError("give a model or plan_json")
            plan_json = exec_plan(model, frames, height, width, **plan_options)
            source = f"<{model}>"
        else:
            source = "<plan_json>"
        self._native = _megaslide.Trainer(plan_json, source, backend, seed)

    def input_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shapes of the step inputs: latents, noise, timesteps, condition."""
        return self._native.input_shapes()

    def parameters(self) -> Dict[str, np.ndarray]:
        """Copies of the fp32 masters (and frozen buffers) by diffusers name."""
        return self._native.parameters()

    def load_parameters(self, params: Dict[str, np.ndarray]) -> None:
        """Replaces the named masters; shapes must match the plan's."""
        self._native.load_parameters(params)

    def gradients(self, latents: np.ndarray, noise: np.ndarray,
                  timesteps: np.ndarray, condition: np.ndarray
                  ) -> Tuple[float, Dict[str, np.ndarray]]:
        """Loss and every trainable parameter's gradient on one batch.

        The state is not updated. Arrays are float32 in input_shapes().
        """
        return self._native.gradients(dict(latents=latents, noise=noise,
                                           timesteps=timesteps,
                                           condition=condition))

    def step(self, **inputs: np.ndarray) -> Dict[str, Any]:
        """One training step (with the AdamW update).

        Without arguments it draws the next synthetic batch; otherwise give
        latents, noise, timesteps and condition. Returns loss, seconds,
        step and the planned and measured device peaks.
        """
        return self._native.step(inputs if inputs else None)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._native.step_count
