"""MegaSlide: plan and run full fine-tuning of very large video DiTs.

Import from a build tree with ``PYTHONPATH=build/python_packages``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from . import _megaslide

__version__: str = _megaslide.__version__

__all__ = ["model_info", "plan", "__version__"]


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
    "host_state_policy": str, "attention": str, "buffers": int,
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
    attention (dsa|global), dsa_window and dsa_tile ((t, y, x) in tokens),
    dsa_radius, buffers, prefetch_distance.

    Raises ValueError for bad configs, sizes or options, TypeError for
    arguments of the wrong type.
    """
    args = _common_args(model, frames, height, width, batch, text_len, latent)
    for name, value in (("gpu_mem", gpu_mem), ("host_mem", host_mem)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str such as '141GB', got "
                            f"{type(value).__name__}")
    for name, value in options.items():
        expected = _PLAN_OPTIONS.get(name)
        if expected is None:
            raise TypeError(f"plan() got an unexpected option '{name}'; "
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
    payload = json.dumps(dict(options, gpu_mem=gpu_mem, host_mem=host_mem))
    return json.loads(_megaslide.plan_json(*args, payload))


def _common_args(model, frames, height, width, batch, text_len, latent):
    if not isinstance(model, str):
        raise TypeError(f"model must be a str, got {type(model).__name__}")
    sizes = [_positive_int(n, v) for n, v in
             (("frames", frames), ("height", height), ("width", width),
              ("batch", batch))]
    text = 0 if text_len is None else _positive_int("text_len", text_len)
    return (model, *sizes[:3], bool(latent), sizes[3], text)
