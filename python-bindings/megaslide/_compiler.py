"""The compiler: MLIR text in, text out (the C API, lib/CAPI/MegaSlide.cpp)."""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from . import _megaslide
from ._checks import _check_str, _common_args


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
