"""MegaSlide: plan and run full fine-tuning of very large video DiTs.

Import from a build tree with ``PYTHONPATH=build/python_packages``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from . import _megaslide

__version__: str = _megaslide.__version__

__all__ = ["model_info", "__version__"]


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
    if not isinstance(model, str):
        raise TypeError(f"model must be a str, got {type(model).__name__}")
    sizes = [_positive_int(n, v) for n, v in
             (("frames", frames), ("height", height), ("width", width),
              ("batch", batch))]
    text = 0 if text_len is None else _positive_int("text_len", text_len)
    raw = _megaslide.model_info_json(model, *sizes[:3], bool(latent),
                                     sizes[3], text)
    return json.loads(raw)
