"""The host AdamW step on numpy arrays (runtime/cpu/AdamW.cpp)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np

from . import _megaslide
from ._checks import _within_int64


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
