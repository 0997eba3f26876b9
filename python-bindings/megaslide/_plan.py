"""Planning: model figures, the plan of a training step and its memory plan
with typed fields (the C API, lib/CAPI/MegaSlide.cpp)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

from . import _megaslide
from ._checks import _check_str, _common_args


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
