"""MegaSlide: plan and run full fine-tuning of very large video DiTs.

Install with ``pip install .`` from the repository root (into a virtual
environment: docs/Python.md), or import from a build tree with
``PYTHONPATH=build/python_packages``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import stat
from typing import (Any, Dict, Iterable, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import numpy as np

from . import _megaslide

__version__: str = _megaslide.__version__

__all__ = ["model_info", "plan", "dsa3d", "dsa3d_backward", "dsa3d_offsets",
           "__version__"]


_INT64_MAX = 2**63 - 1


def _within_int64(name: str, value: int, high: int = _INT64_MAX) -> int:
    """``value`` (already checked to be an int) if the C++ side can hold it:
    a ValueError naming the argument rather than pybind11's TypeError."""
    if value > high:
        bound = "2^63 - 1" if high == _INT64_MAX else "2^64 - 1"
        raise ValueError(f"{name} must be at most {bound}, got {value}")
    return int(value)


def _check_str(name: str, value: Any) -> str:
    """``value`` if it is a str the C++ side reads whole: a NUL character
    would silently cut it short there (``"tiny\\0x"`` read as ``"tiny"``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{name} contains a NUL character: {value!r}")
    return value


def _check_path(name: str, value: Any) -> str:
    """A path argument (str or os.PathLike) as a str for the C++ side.
    '' is refused: the C++ side would resolve it as the current folder
    (save_weights('') wrote there) or read it as "not given"."""
    path = os.fspath(value)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if path == "":
        raise ValueError(f"{name} is empty; give a file or folder path "
                         f"('.' for the current folder)")
    return _check_str(name, path)


#: Largest plan file read, as the runtime's loader (kMaxExecPlanBytes in
#: include/megaslide/runtime/support/ReadFile.h, docs/Runtime.md "Limits on
#: input files").
_MAX_PLAN_BYTES = 256 << 20


def _read_plan_file(path: str) -> str:
    """The text of plan file ``path``: a regular file only (open() of a FIFO
    would wait for a writer forever; /dev/zero reads without end) of at
    most _MAX_PLAN_BYTES. ValueError naming the file otherwise."""
    def fail(reason: str) -> ValueError:
        return ValueError(f"cannot read plan file '{path}': {reason}")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise fail("it is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise fail(e.strerror) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise fail("it is not a regular file")
        data = f.read(_MAX_PLAN_BYTES + 1)
    if len(data) > _MAX_PLAN_BYTES:
        raise fail(f"it holds more than {_MAX_PLAN_BYTES} bytes, the limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return _within_int64(name, value)


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


#: The plan options, by keyword: each a dict with ``name`` (the pipeline
#: option), ``type`` (``str``, ``int``, ``bool`` or ``triple``: three ints
#: (t, y, x)), ``help``, ``default`` and, for enums, ``choices``. Read from
#: the C API, which derives them from their one declaration
#: (include/megaslide/Pipelines/PipelineOptions.def); listed in
#: docs/reference/PipelineOptions.md.
PLAN_OPTIONS: Dict[str, Dict[str, Any]] = {
    o["key"]: o for o in json.loads(_megaslide.plan_options_json())}
__all__ += ["PLAN_OPTIONS"]
_OPTION_TYPES = {"str": str, "int": int, "bool": bool, "triple": tuple}


def plan(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    **options: Any,
) -> Dict[str, Any]:
    """Plans a training step: memory, transfers and predicted step time.

    Returns what ``megaslide-plan --format json`` prints (docs/PlanSchema.md),
    including ``fits`` and ``violations``: a plan over budget is a result,
    not an exception. ``options`` are the keywords of :data:`PLAN_OPTIONS`
    (docs/reference/PipelineOptions.md), e.g. ``gpu_mem="80GiB"``,
    ``host_mem="1.5TB"`` (memory sizes take decimal or binary units),
    ``activation_policy="offload"``, ``dsa_window=(3, 5, 8)``, ``hw`` (path
    to a hardware JSON) and ``precision`` (bf16|f32: the compute type of
    activations, working weights and gradients; masters and moments are
    fp32 either way); each defaults to its declared default.

    Raises ValueError for bad configs, sizes or options, TypeError for
    arguments of the wrong type.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    payload = _options_payload("plan", options)
    return json.loads(_megaslide.plan_json(*args, payload))


def _options_payload(caller: str, options: Dict[str, Any], **given: Any) -> str:
    """The plan options as the C API's JSON object, type-checked."""
    for name, value in options.items():
        option = PLAN_OPTIONS.get(name)
        if option is None:
            raise TypeError(f"{caller}() got an unexpected option '{name}'; "
                            f"known: {', '.join(sorted(PLAN_OPTIONS))}")
        expected = _OPTION_TYPES[option["type"]]
        if expected is str and option["default"] and not isinstance(value, str):
            raise TypeError(f"{name} must be a str such as "
                            f"'{option['default']}', got "
                            f"{type(value).__name__}")
        if expected is tuple:
            if (not isinstance(value, (tuple, list)) or len(value) != 3 or
                    not all(isinstance(v, int) and not isinstance(v, bool)
                            for v in value)):
                raise TypeError(f"{name} must be three ints (t, y, x), got "
                                f"{value!r}")
            options[name] = list(value)
        elif ((isinstance(value, bool) and expected is not bool) or
              not isinstance(value, expected)):
            raise TypeError(f"{name} must be a {expected.__name__}, got "
                            f"{type(value).__name__}")
        elif expected is str:
            _check_str(name, value)
    return json.dumps(dict(options, **{k: v for k, v in given.items()
                                       if v is not None}))


def _common_args(model, frames, height, width, batch, text_len, latent):
    _check_str("model", model)
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
                          _within_int64("step", step), **hyper)


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
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    lr: Optional[float] = None,
    weight_decay: Optional[float] = None,
    **options: Any,
) -> str:
    """The execution plan of a training step as JSON text.

    This is what ``megaslide-run --save-plan`` writes (docs/ExecutionPlan.md).
    Options are those of :func:`plan`; ``lr`` overrides the config's
    learning rate, ``weight_decay`` is AdamW's decoupled weight decay
    (default 0, as ``--weight-decay``). Raises ValueError for bad input or
    a plan over budget.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    # JSON cannot carry nan or inf to the C API, which checks the range
    # (plan/HyperParameters.h) with the same words.
    if lr is not None and (isinstance(lr, bool) or
                           not isinstance(lr, numbers.Real) or
                           not math.isfinite(lr) or not lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if weight_decay is not None and (
            isinstance(weight_decay, bool) or
            not isinstance(weight_decay, numbers.Real) or
            not math.isfinite(weight_decay) or weight_decay < 0):
        raise ValueError(f"weight_decay must be a non-negative number, got "
                         f"{weight_decay!r}")
    payload = _options_payload(
        "exec_plan", options, lr=None if lr is None else float(lr),
        weight_decay=None if weight_decay is None else float(weight_decay))
    return _megaslide.exec_plan_json(*args, payload)


#: The training recipe's keyword arguments (docs/Training.md) and their
#: types: megaslide-run's --lr-schedule, --warmup-steps, ... with '_' for '-'.
RECIPE_OPTIONS: Dict[str, type] = {
    "lr_schedule": str, "warmup_steps": int, "min_lr": float,
    "lr_decay_steps": int, "max_grad_norm": float, "grad_accum": int,
    "ema_decay": float, "ema_warmup": bool, "timestep_sampling": str,
    "logit_mean": float, "logit_std": float, "flow_shift": float,
}


#: Planning options the recipe follows too: the plan accounts their host
#: memory, the Trainer accumulates and keeps the EMA as they say.
_PLANNED_RECIPE_OPTIONS = ("grad_accum", "ema_dtype")


def _recipe_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """Takes the recipe's keys out of ``options``, type checked; the
    planned ones (grad_accum, ema_dtype) stay for the plan as well."""
    recipe = {}
    if options.get("ema_decay") and "ema_dtype" not in options:
        options["ema_dtype"] = "f32"  # as megaslide-plan and -run do
    if "ema_dtype" in options:
        dtype = options["ema_dtype"]
        if dtype not in ("none", "f32", "bf16"):
            raise ValueError(f"ema_dtype must be none, f32 or bf16, got "
                             f"{dtype!r}")
        recipe["ema_bf16"] = dtype == "bf16"
    for name, kind in RECIPE_OPTIONS.items():
        if name not in options:
            continue
        value = (options.get if name in _PLANNED_RECIPE_OPTIONS
                 else options.pop)(name)
        if kind is float and isinstance(value, numbers.Real) and \
                not isinstance(value, bool):
            value = float(value)
        elif kind is int and isinstance(value, numbers.Integral) and \
                not isinstance(value, bool):
            value = _within_int64(name, int(value))
        elif not isinstance(value, kind) or \
                (kind is not bool and isinstance(value, bool)):
            raise TypeError(f"{name} must be a {kind.__name__}, got "
                            f"{value!r}")
        recipe[name] = value
    return recipe


def sample_sigmas(seed: int, step: int, count: int, *,
                  timestep_sampling: str = "uniform", logit_mean: float = 0.0,
                  logit_std: float = 1.0,
                  flow_shift: float = 1.0) -> np.ndarray:
    """The flow-matching times a Trainer (and megaslide-run) with this seed
    and sampling uses at optimizer step ``step`` (0-based), ``count`` of
    them (micro-batch m, sample b at index m B + b): float32 in [0, 1], a
    function of (seed, step) only (docs/Training.md, "Timesteps")."""
    recipe = _recipe_options(dict(timestep_sampling=timestep_sampling,
                                  logit_mean=logit_mean, logit_std=logit_std,
                                  flow_shift=flow_shift))
    for name, value in (("seed", seed), ("step", step), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got "
                             f"{value!r}")
    return _megaslide.sample_sigmas(_within_int64("seed", seed, 2**64 - 1),
                                    _within_int64("step", step),
                                    _within_int64("count", count), recipe)


__all__ += ["sample_sigmas", "RECIPE_OPTIONS"]


class Trainer:
    """A training run on the cpu, cuda or sim backend, numpy arrays in and out.

    Compiles the model's training step (or takes an execution plan:
    ``plan_json`` text, or ``plan_file``, e.g. what ``megaslide-run
    --save-plan`` or :meth:`save_plan` wrote) and, on cpu and cuda, keeps
    the host state: fp32 masters, AdamW moments and the optimizer step.

    ``backend``: ``cpu`` (reference numerics, everywhere), ``cuda`` (needs a
    GPU: :func:`backends` says whether this machine has one) or ``sim``
    (replays the schedule under the hardware model ``hw``, default H200:
    steps return the predicted time and no loss; it holds no model state,
    so parameters, gradients and weights raise ValueError). ``hw`` is a
    hardware JSON (docs/CostModel.md) used for planning and by sim.

    The training recipe (docs/Training.md) takes megaslide-run's flags as
    keywords (RECIPE_OPTIONS): lr_schedule, warmup_steps, min_lr,
    lr_decay_steps, max_grad_norm, grad_accum, ema_decay, ema_warmup,
    timestep_sampling, logit_mean, logit_std, flow_shift; ``val_data`` is
    a folder of validation samples for :meth:`validation_loss`.

    Threads: calls on one Trainer are serialised (a lock per Trainer; the
    GIL is released while a step computes), so two threads stepping one
    Trainer take every step in turn, each whole. Ctrl-C during a step is
    honoured at the step boundary: the step runs to its end, then
    KeyboardInterrupt is raised with the step applied (``step_count`` says
    so); a pending Ctrl-C raises before a step starts, with nothing
    applied. A step is never left half done (docs/Python.md).

    >>> tr = Trainer("tiny", frames=17, height=128, width=128, precision="f32")
    >>> loss, grads = tr.gradients(**batch)   # no update
    >>> tr.step()["loss"]                     # one step on synthetic data
    >>> Trainer("megaslide-105b", 81, 720, 1280, backend="sim").step(
    ...     trace="105b.json")["seconds"]     # predicted step, Perfetto trace
    """

    def __init__(self, model: Optional[str] = None, frames: int = 17,
                 height: int = 128, width: int = 128, *, backend: str = "cpu",
                 seed: int = 0, plan_json: Optional[str] = None,
                 plan_file: Optional[Union[str, os.PathLike]] = None,
                 hw: Optional[Union[str, os.PathLike]] = None,
                 val_data: Optional[Union[str, os.PathLike]] = None,
                 **plan_options: Any) -> None:
        recipe = _recipe_options(plan_options)
        val = "" if val_data is None else _check_path("val_data", val_data)
        if backend not in ("cpu", "cuda", "sim"):
            raise ValueError(f"backend must be cpu, cuda or sim, got "
                             f"{backend!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        _within_int64("seed", seed, high=2**64 - 1)
        if plan_json is not None and plan_file is not None:
            raise ValueError("give plan_json or plan_file, not both")
        if plan_json is not None or plan_file is not None:
            # A given plan was accounted when it was compiled; the recipe
            # still follows these.
            for name in _PLANNED_RECIPE_OPTIONS:
                plan_options.pop(name, None)
        if plan_options and (plan_json is not None or plan_file is not None):
            raise TypeError(f"plan options ({', '.join(sorted(plan_options))})"
                            f" only apply when compiling a model, not to a "
                            f"given plan")
        if backend == "cuda":
            # Say why before compiling a plan that cannot run here.
            status = backends()["cuda"]
            if not status.available:
                raise RuntimeError(f"backend 'cuda' is not available: "
                                   f"{status.reason}")
        hardware = "" if hw is None else _check_path("hw", hw)
        if plan_file is not None:
            path = _check_path("plan_file", plan_file)
            plan_json = _read_plan_file(path)
            source = path
        elif plan_json is None:
            if model is None:
                raise ValueError("give a model, plan_json or plan_file")
            if hw is not None:
                plan_options["hw"] = hardware
            plan_json = exec_plan(model, frames, height, width, **plan_options)
            source = f"<{model}>"
        else:
            source = "<plan_json>"
        if not isinstance(plan_json, str):
            raise TypeError(f"plan_json must be a str, got "
                            f"{type(plan_json).__name__}")
        self._native = _megaslide.Trainer(plan_json, source, backend, seed,
                                          hardware, recipe, val)

    @property
    def backend(self) -> str:
        """The backend's name: cpu, cuda or sim."""
        return self._native.backend

    @property
    def computes_loss(self) -> bool:
        """Whether steps compute the loss and hold model state (not sim)."""
        return self._native.computes_loss

    def plan_json(self) -> str:
        """The execution plan being run, as JSON text (docs/ExecutionPlan.md)."""
        return self._native.plan_json()

    def save_plan(self, path: Union[str, os.PathLike]) -> None:
        """Writes the execution plan to ``path`` (``Trainer(plan_file=path)``
        and ``megaslide-run --plan`` read it). Raises ValueError naming the
        file when it cannot be written."""
        self._native.save_plan(_check_path("path", path))

    def load_weights(self, path: Union[str, os.PathLike]) -> None:
        """Loads model weights into the fp32 masters, as ``megaslide-run
        --weights`` does: a diffusers transformer directory (config.json and
        diffusion_pytorch_model.safetensors, or shards with their index) or
        one .safetensors file; F32, BF16 and F16 are read (docs/Runtime.md).

        Names and shapes are checked against the plan before anything is
        read: missing, unexpected and misshapen tensors are listed together
        in one ValueError and nothing is loaded. AdamW moments are not
        touched. Raises ValueError on the sim backend."""
        self._native.load_weights(_check_path("path", path))

    def save_weights(self, directory: Union[str, os.PathLike], *,
                     dtype: str = "f32",
                     max_shard_bytes: int = 5_000_000_000) -> None:
        """Writes the model weights as a diffusers transformer directory
        (created if needed): config.json (the plan's model config) and
        diffusion_pytorch_model.safetensors, or shards of at most
        ``max_shard_bytes`` with an index, as ``megaslide-run
        --save-weights`` does. ``dtype``: "f32" or "bf16" (rounded to
        nearest even). Files are replaced atomically; weight files of an
        earlier save that this one does not produce are removed. Raises
        ValueError for a bad dtype or shard size, an unwritable directory,
        or the sim backend."""
        if (isinstance(max_shard_bytes, bool) or
                not isinstance(max_shard_bytes, numbers.Integral) or
                max_shard_bytes <= 0):
            raise ValueError(f"max_shard_bytes must be a positive int, got "
                             f"{max_shard_bytes!r}")
        self._native.save_weights(
            _check_path("directory", directory), dtype,
            _within_int64("max_shard_bytes", max_shard_bytes))

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

        The state is not updated. Arrays are checked as for :meth:`step`.
        """
        return self._native.gradients(dict(latents=latents, noise=noise,
                                           timesteps=timesteps,
                                           condition=condition))

    def predict(self, latents: np.ndarray, noise: np.ndarray,
                timesteps: np.ndarray, condition: np.ndarray) -> np.ndarray:
        """The model's velocity prediction at x_t = (1 - t) x0 + t noise
        (x0 the latents; model timestep 1000 t), float32 [B, C, T, H, W]:
        the forward of one step, read where the loss takes it.

        The state is not updated (as :meth:`gradients`: the step runs
        without its update, so it costs a forward and a backward).
        Arrays are checked as for :meth:`step`;
        ``timesteps`` is required. The cpu backend only (ValueError on
        cuda and sim). The tests compare it with diffusers'
        WanTransformer3DModel on the same weights (docs/Dsa3d.md,
        "Sampling with diffusers").
        """
        return self._native.predict(dict(latents=latents, noise=noise,
                                         timesteps=timesteps,
                                         condition=condition))

    def step(self, *, trace: Optional[Union[str, os.PathLike]] = None,
             **inputs: np.ndarray) -> Dict[str, Any]:
        """One optimizer step of the recipe (docs/Training.md).

        Without arrays it draws the next ``grad_accum`` batches; otherwise
        give latents, noise, condition and optionally timesteps, each a
        numpy array of the shape input_shapes() gives with its first
        dimension times ``grad_accum`` (the micro-batches in order), of
        dtype float32 (an integer dtype for DiT's class-label condition):
        nothing is cast, so float64, int64 or a list raise TypeError, and so
        does an unknown keyword. ``timesteps`` must lie in [0, 1], the
        flow-matching time t of x_t = (1 - t) x0 + t noise (ValueError
        otherwise, NaN included); left out, they are the recipe's
        (:func:`sample_sigmas` of this seed and step_count).

        Returns loss (the mean over micro-batches; None on sim), grad_norm
        (the global L2 norm of the averaged gradient before clipping; None
        on sim), lr (the step's), clipped, skipped, micro_batches, seconds
        (measured; on sim the predicted step time), step and the planned
        and measured device peaks (planned_peak_bytes, measured_peak_bytes,
        planned_live_bytes, measured_live_bytes).

        ``skipped``: the loss, or with the deferred update any gradient, was
        NaN or infinite, so no update was applied and the state
        (parameters, moments, EMA, step_count) is bitwise as before. With
        the streaming update a non-finite gradient with a finite loss
        raises ValueError naming the parameter: earlier parameters of that
        step may already be updated, so the Trainer refuses further steps
        (docs/Runtime.md, "Non-finite values").

        ``trace``: also write the step as Chrome trace-event JSON to this
        path (open it in Perfetto): one track per stream, one event per
        instruction with its layer, bytes and FLOPs, measured on cpu and
        cuda and predicted on sim — the format of ``megaslide-run --trace``.
        """
        path = "" if trace is None else _check_path("trace", trace)
        return self._native.step(inputs if inputs else None, path)

    def optimizer_state(self) -> Dict[str, Dict[str, np.ndarray]]:
        """Copies of the AdamW moments: {name: {"exp_avg", "exp_avg_sq"}}."""
        return self._native.optimizer_state()

    def validation_loss(self) -> float:
        """The mean loss over ``val_data``'s samples, each with the noise
        and time drawn for it once (the same at every call); updates
        nothing and draws no training data (docs/Training.md)."""
        return self._native.validation_loss()

    def ema_parameters(self) -> Dict[str, np.ndarray]:
        """Copies of the EMA of the trainable weights (ValueError without
        ``ema_decay``)."""
        return self._native.ema_parameters()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return self._native.step_count


# ---------------------------------------------------------------------------
# Compiler: MLIR text in, text out (the C API, lib/CAPI/MegaSlide.cpp)
# ---------------------------------------------------------------------------

__all__ += ["DiagnosticError", "PipelineResult", "build_module",
            "parse_module", "run_pipeline", "PIPELINES"]

#: The named pipelines of megaslide-opt: the whole planning pipeline and its
#: three phases. They share the planning options (those of PLAN_OPTIONS,
#: under their ``name``, and the pipeline-only ones of
#: docs/AddingAnOption.md). Any other registered pass runs by name too.
PIPELINES: Tuple[str, ...] = ("megaslide-pipeline", "megaslide-graph-pipeline",
                              "megaslide-schedule-pipeline",
                              "megaslide-memory-pipeline")


class DiagnosticError(ValueError):
    """The compiler rejected its input: IR that does not parse or verify, an
    invalid pass pipeline (unknown pass or option, bad option value), a
    pass that failed, or a 3D-DSA configuration the kernels do not support.

    ``str(error)`` is the diagnostic text as megaslide-opt prints it
    (``<source>:<line>:<col>: error: <message>``, notes on indented lines).
    ``diagnostics`` holds one entry per diagnostic (its notes included);
    after a failed pipeline, ``remarks`` and ``warnings`` hold what the
    passes reported before, and ``ir`` the module where it stopped.
    """

    def __init__(self, message: str, *, remarks: Sequence[str] = (),
                 warnings: Sequence[str] = (), ir: Optional[str] = None,
                 split: bool = True) -> None:
        super().__init__(message)
        self.diagnostics: List[str] = (_split_diagnostics(message) if split
                                       else [message])
        self.remarks: List[str] = list(remarks)
        self.warnings: List[str] = list(warnings)
        self.ir: Optional[str] = ir


def _split_diagnostics(text: str) -> List[str]:
    """Diagnostics of the C API's text: each starts on an unindented line;
    its notes follow on lines indented by two spaces."""
    entries: List[str] = []
    for line in text.splitlines():
        if entries and line.startswith("  "):
            entries[-1] += "\n" + line
        else:
            entries.append(line)
    return entries


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """What :func:`run_pipeline` returns."""

    #: The module after the pipeline, as megaslide-opt prints it.
    ir: str
    #: Remarks of the passes, in emission order (e.g. why an optimisation
    #: did not fire), each ``<source>:<line>:<col>: remark: <message>``.
    remarks: List[str]
    #: Warnings of the passes, formatted like the remarks.
    warnings: List[str]


def build_module(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    precision: Optional[str] = None,
) -> str:
    """The training-step module of a model as MLIR text, before planning.

    What ``megaslide-plan --emit-mlir`` writes: forward, loss, backward and
    AdamW as ``megaslide`` graph ops, the input of :func:`run_pipeline`.
    Arguments as for :func:`model_info`; ``precision`` is "bf16" (default)
    or "f32". Raises ValueError naming the field for bad configs, sizes or
    a bad precision.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    if precision is not None:
        _check_str("precision", precision)
    rc, ir, error = _megaslide.build_module(*args, precision or "")
    if rc != 0:
        raise ValueError(error)
    return ir


def parse_module(ir: str, *, source_name: str = "<string>") -> str:
    """Parses and verifies MLIR text with the MegaSlide dialects.

    Returns the module as megaslide-opt prints it (generic and custom forms
    alike come back in custom form; top-level ops without a module are
    wrapped in one). ``source_name`` names the text in diagnostics.

    Raises DiagnosticError with the parser's or verifier's diagnostics,
    e.g. ``<string>:3:10: error: 'megaslide.linear' op ...``.
    """
    _check_str("ir", ir)
    _check_str("source_name", source_name)
    rc, printed, error = _megaslide.parse_module(ir, source_name)
    if rc != 0:
        raise DiagnosticError(error)
    return printed


def _option_text(name: str, value: Any) -> str:
    """``value`` as a pass option's text: lists comma-joined, booleans
    true/false, strings with special characters quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                   for v in value):
            raise TypeError(f"pipeline option '{name}' must be a str, int, "
                            f"bool or a list of ints, got {value!r}")
        return ",".join(str(int(v)) for v in value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if not isinstance(value, str):
        raise TypeError(f"pipeline option '{name}' must be a str, int, bool "
                        f"or a list of ints, got {type(value).__name__}")
    _check_str(f"pipeline option '{name}'", value)
    if any(c in value for c in " ,{}='\""):
        if '"' in value:
            raise ValueError(f"pipeline option '{name}': a value may not "
                             f"contain '\"', got {value!r}")
        return f'"{value}"'
    return value


def _pipeline_text(pipeline: str, options: Mapping[str, Any]) -> str:
    """The textual pipeline megaslide-opt's --pass-pipeline takes."""
    _check_str("pipeline", pipeline)
    text = pipeline.strip()
    if not text:
        raise ValueError("pipeline must name a pass or pipeline, e.g. "
                         "'megaslide-pipeline'")
    if options:
        if any(c in text for c in "(){},"):
            raise TypeError("pipeline options apply to a single pass or "
                            "pipeline name; put them inside the textual "
                            f"pipeline instead: {pipeline!r}")
        items = " ".join(f"{name.replace('_', '-')}="
                         f"{_option_text(name, value)}"
                         for name, value in options.items())
        text = f"{text}{{{items}}}"
    if not text.startswith(("builtin.module(", "any(")):
        text = f"builtin.module({text})"
    return text


def run_pipeline(ir: str, pipeline: str = "megaslide-pipeline", *,
                 source_name: str = "<string>",
                 **options: Any) -> PipelineResult:
    """Runs a named pipeline or pass on MLIR text, as megaslide-opt would.

    ``pipeline`` is a registered name — one of :data:`PIPELINES`, any
    ``megaslide-*`` pass, or an upstream transform such as ``canonicalize``
    — with ``options`` as keyword arguments (underscores become dashes:
    ``gpu_mem="24GB"`` is ``gpu-mem=24GB``; lists and tuples are joined by
    commas: ``dsa_window=(2, 2, 2)``), or a whole textual pipeline such as
    ``"builtin.module(megaslide-graph-pipeline,canonicalize)"`` without
    options. Names and options are those of ``megaslide-opt --help`` and
    docs/Pipeline.md.

    Returns a :class:`PipelineResult`: the module's text after the
    pipeline, and the passes' remarks and warnings.

    Raises DiagnosticError: for IR that does not parse or verify (the
    parser's diagnostics); for an unknown pass or pipeline name, an unknown
    option or a bad option value (MLIR's message, naming it); and when a
    pass fails, e.g. a plan over its memory budget (the diagnostics with
    their notes; ``remarks``, ``warnings`` and ``ir`` as far as the
    pipeline got). TypeError for arguments of the wrong type.
    """
    _check_str("ir", ir)
    _check_str("source_name", source_name)
    text = _pipeline_text(pipeline, options)
    rc, payload, error = _megaslide.run_pipeline(ir, source_name, text)
    if rc == 1:
        # An invalid pipeline's message carries MLIR's caret display, so it
        # is kept whole.
        raise DiagnosticError(error,
                              split=not error.startswith("invalid pass "))
    result = json.loads(payload)
    if rc != 0:
        raise DiagnosticError(error, remarks=result["remarks"],
                              warnings=result["warnings"], ir=result["ir"])
    return PipelineResult(ir=result["ir"], remarks=result["remarks"],
                          warnings=result["warnings"])


# ---------------------------------------------------------------------------
# Memory plan: the report with typed fields and the per-buffer device plan
# ---------------------------------------------------------------------------

__all__ += ["DeviceBuffer", "MemoryPlan", "memory_plan"]


@dataclasses.dataclass(frozen=True)
class DeviceBuffer:
    """One buffer of the device arena of a planned training step."""

    #: e.g. "weights blocks.0.attn1.to_q.weight of block 0 [64, 64] bf16".
    what: str
    #: weights, activations, checkpoints, gradients, attention workspace,
    #: data batch, ... (docs/MemoryAccounting.md).
    category: str
    #: Block index, or None outside the transformer blocks.
    layer: Optional[int]
    #: Byte offset in the arena; -1 when the plan stopped before memory
    #: was packed.
    offset: int
    #: Size in bytes.
    bytes: int
    #: First and last program-order step (op of the planned @train_step)
    #: at which the buffer is live, inclusive.
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The memory plan of a training step: :func:`plan`'s report with typed
    accessors for the figures most asked for, and every device buffer."""

    #: The full report of :func:`plan` (docs/PlanSchema.md).
    report: Dict[str, Any]
    #: Device buffers with offsets and live ranges, in creation order.
    buffers: List[DeviceBuffer]
    #: Ops of the planned step (the range of DeviceBuffer.start/end).
    num_steps: int

    @property
    def fits(self) -> bool:
        """True when no budget is exceeded."""
        return bool(self.report["fits"])

    @property
    def violations(self) -> List[str]:
        """One message per exceeded budget, with notes naming the largest
        consumers; empty when the plan fits."""
        return list(self.report["violations"])

    @property
    def remarks(self) -> List[str]:
        """Why passes did not do something (no source locations)."""
        return list(self.report["remarks"])

    @property
    def device_peak_bytes(self) -> int:
        """The device arena's size: the planned device peak."""
        return int(self.report["device"]["peak_bytes"])

    @property
    def device_by_category(self) -> Dict[str, int]:
        """Bytes live at the device peak by category (plus alignment)."""
        return dict(self.report["device"]["by_category"])

    @property
    def host_bytes(self) -> int:
        """Host memory of the plan, all categories."""
        return int(self.report["host"]["total_bytes"])

    @property
    def host_by_category(self) -> Dict[str, int]:
        """Host bytes by category (masters, moments, staging, ...)."""
        return dict(self.report["host"]["by_category"])

    @property
    def predicted_seconds(self) -> float:
        """Predicted step time under the hardware model."""
        return float(self.report["step"]["predicted_seconds"])

    def live_at(self, step: int) -> List[DeviceBuffer]:
        """The buffers live at program-order ``step``, largest first."""
        live = [b for b in self.buffers if b.start <= step <= b.end]
        return sorted(live, key=lambda b: -b.bytes)


def memory_plan(
    model: str,
    frames: int,
    height: int,
    width: int,
    *,
    batch: int = 1,
    text_len: Optional[int] = None,
    latent: bool = False,
    **options: Any,
) -> MemoryPlan:
    """Plans a training step like :func:`plan` and returns a
    :class:`MemoryPlan`: the same report plus every device buffer with its
    arena offset, size and live range. Arguments, options and errors as
    for :func:`plan`; a plan over budget is a result (``fits`` False)."""
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    payload = _options_payload("memory_plan", options)
    rc, text, error = _megaslide.memory_plan_json(*args, payload)
    if rc != 0:
        raise ValueError(error)
    result = json.loads(text)
    return MemoryPlan(report=result["report"],
                      buffers=[DeviceBuffer(**b)
                               for b in result["device_buffers"]],
                      num_steps=int(result["num_steps"]))


# ---------------------------------------------------------------------------
# 3D-DSA CUDA kernels: sources (lib/Target/Cuda) and NVRTC (runtime/cuda)
# ---------------------------------------------------------------------------

__all__ += ["DsaKernelSource", "KernelResources", "CompiledKernels",
            "Availability", "emit_dsa_kernels", "plan_dsa_kernels",
            "compile_dsa_kernels", "nvrtc_status", "backends"]


@dataclasses.dataclass(frozen=True)
class DsaKernelSource:
    """The CUDA C++ of one 3D-DSA configuration (forward, backward, its
    finalisation and offset estimation kernels)."""

    #: e.g. "dsa3d_g2x2x2_w2x2x2_t1x2x2_h4_d16_bf16_r4" (also the file stem
    #: megaslide-translate writes).
    name: str
    #: e.g. "grid (2,2,2) window (2,2,2) tile (1,2,2) heads 4 head-dim 16
    #: bf16 radius 4".
    description: str
    #: The CUDA C++ source.
    source: str
    #: Its manifest: {"configs": [one configuration with its "kernels":
    #: name, kind, grid, block, dynamic_shared_bytes, arguments]}, as
    #: manifest.json and an execution plan's kernel_modules have it.
    manifest: Dict[str, Any]

    @property
    def kernels(self) -> List[Dict[str, Any]]:
        """Launch shapes of the kernels of this source."""
        return list(self.manifest["configs"][0]["kernels"])


def emit_dsa_kernels(ir: str, *,
                     source_name: str = "<string>") -> List[DsaKernelSource]:
    """The 3D-DSA CUDA sources of a module, as ``megaslide-translate
    --emit-dsa-kernels`` emits them: one per distinct configuration of its
    ``dsa3d``, ``dsa3d_grad`` and ``dsa3d_offsets`` ops, sorted; empty when
    the module has none (run ``megaslide-rewrite-attention-to-dsa`` or the
    graph pipeline first).

    Raises DiagnosticError for IR that does not parse or verify, or a
    configuration the kernels do not support (reported on its op, e.g. an
    f32 element type or a head dim outside [16, 256]).
    """
    _check_str("ir", ir)
    _check_str("source_name", source_name)
    rc, text, error = _megaslide.emit_dsa_kernels(ir, source_name)
    if rc != 0:
        raise DiagnosticError(error)
    return [DsaKernelSource(**k) for k in json.loads(text)["kernels"]]


def _describe_config(config: Mapping[str, Any]) -> str:
    """DsaConfig::describe() from a manifest's configuration."""
    def triple(key: str) -> str:
        return "(" + ",".join(str(v) for v in config[key]) + ")"
    return (f"grid {triple('grid')} window {triple('window')} tile "
            f"{triple('tile')} heads {config['heads']} head-dim "
            f"{config['head_dim']} {config['element_type']} radius "
            f"{config['radius']}")


def plan_dsa_kernels(plan_json: str) -> List[DsaKernelSource]:
    """The 3D-DSA CUDA sources an execution plan carries (its
    ``kernel_modules``: what the cuda backend compiles), e.g. from
    :func:`exec_plan` or :meth:`Trainer.plan_json`. An f32 plan carries
    none. Raises ValueError for text that is not an execution plan."""
    _check_str("plan_json", plan_json)
    try:
        plan = json.loads(plan_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"plan_json is not JSON: {e}") from None
    if not isinstance(plan, dict) or plan.get("format") != "megaslide-exec-plan":
        raise ValueError("plan_json is not an execution plan (its 'format' "
                         "is not 'megaslide-exec-plan')")
    kernels = []
    for module in plan.get("kernel_modules", []):
        manifest = json.loads(module["manifest"])
        kernels.append(DsaKernelSource(
            name=module["name"],
            description=_describe_config(manifest["configs"][0]),
            source=module["source"], manifest=manifest))
    return kernels


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether something optional (NVRTC, a backend) can be used here."""

    available: bool
    #: Why not (what was tried), or "" when available.
    reason: str = ""
    #: Its version when known and available (NVRTC: "major.minor").
    version: str = ""

    def __bool__(self) -> bool:
        return self.available


def nvrtc_status() -> Availability:
    """Whether NVRTC can be loaded (it is dlopen'ed: $MEGASLIDE_NVRTC_LIBRARY,
    libnvrtc.so, $CUDA_HOME/lib64, /usr/local/cuda/lib64). No GPU is needed
    to compile."""
    available, reason, version = _megaslide.nvrtc_status()
    return Availability(available, reason, version)


def backends() -> Dict[str, Availability]:
    """The runtime backends and whether each can run here: cpu and sim
    always; cuda when the driver loads and finds a device."""
    cuda_ok, cuda_why = _megaslide.cuda_device_status()
    return {"cpu": Availability(True), "sim": Availability(True),
            "cuda": Availability(cuda_ok, cuda_why)}


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """One compiled kernel's resources (ptxas -v) and its theoretical
    occupancy on one H100/H200 SM at its launch shape."""

    kernel: str
    registers: int
    shared_bytes: int
    dynamic_shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    threads: int
    blocks_per_sm: int
    occupancy: float
    #: What limits the occupancy, e.g. "registers".
    limiter: str


@dataclasses.dataclass(frozen=True)
class CompiledKernels:
    """One 3D-DSA source compiled by NVRTC."""

    name: str
    arch: str
    #: SASS for a real architecture (sm_XX); empty for compute_XX.
    cubin: bytes
    ptx: str
    #: NVRTC's log, including the ptxas resource lines.
    log: str
    #: Whether the on-disk kernel cache ($MEGASLIDE_KERNEL_CACHE, "off" to
    #: disable) answered.
    from_cache: bool
    resources: List[KernelResources]

    @property
    def spill_bytes(self) -> int:
        """Spill stores plus loads over all kernels (0 is the goal)."""
        return sum(r.spill_stores + r.spill_loads for r in self.resources)


def compile_dsa_kernels(kernels: Iterable[DsaKernelSource], *,
                        arch: str = "sm_90a",
                        options: Sequence[str] = ()) -> List[CompiledKernels]:
    """Compiles 3D-DSA sources with NVRTC, as ``megaslide-translate
    --cubin ARCH`` does (C++17, ptxas -v, the CUDA include directory, then
    ``options``), through the on-disk kernel cache the cuda backend uses.
    No GPU is needed; wgmma needs ``sm_90a``. Takes 0.1-2 s per source.

    Raises RuntimeError when NVRTC is not available (see
    :func:`nvrtc_status`) or a source does not compile (with NVRTC's log,
    which names the line of the source).
    """
    _check_str("arch", arch)
    status = nvrtc_status()
    if not status.available:
        raise RuntimeError(f"NVRTC is not available: {status.reason}")
    compiled = []
    for k in kernels:
        if not isinstance(k, DsaKernelSource):
            raise TypeError(f"kernels must be DsaKernelSource objects, got "
                            f"{type(k).__name__}")
        r = _megaslide.compile_cuda(k.source, k.name + ".cu", arch,
                                    [_check_str("options", o)
                                     for o in options])
        if r["error"]:
            raise RuntimeError(f"NVRTC failed to compile {k.name}.cu for "
                               f"{arch}:\n{r['error']}")
        launches = {l["name"]: l for l in k.kernels}
        resources = []
        for res in r["resources"]:
            launch = launches.get(res["kernel"], {})
            threads = int(launch.get("block", [0])[0])
            dynamic = int(launch.get("dynamic_shared_bytes", 0))
            occ = _megaslide.occupancy_sm90(res["registers"],
                                            res["shared_bytes"], threads,
                                            dynamic) if threads else {
                "blocks_per_sm": 0, "fraction": 0.0,
                "limiter": "launch shape unknown"}
            resources.append(KernelResources(
                kernel=res["kernel"], registers=res["registers"],
                shared_bytes=res["shared_bytes"], dynamic_shared_bytes=dynamic,
                stack_bytes=res["stack_bytes"],
                spill_stores=res["spill_stores"],
                spill_loads=res["spill_loads"], threads=threads,
                blocks_per_sm=occ["blocks_per_sm"],
                occupancy=occ["fraction"], limiter=occ["limiter"]))
        compiled.append(CompiledKernels(
            name=k.name, arch=arch, cubin=r["cubin"], ptx=r["ptx"],
            log=r["log"], from_cache=r["from_cache"], resources=resources))
    return compiled
