"""MegaSlide: plan and run full fine-tuning of very large video DiTs.

Install with ``pip install .`` from the repository root (into a virtual
environment: docs/Python.md), or import from a build tree with
``PYTHONPATH=build/python_packages``.
"""

from __future__ import annotations

# Resolve the annotations of the classes below, whose __module__ is this
# package (typing.get_type_hints looks them up here).
from typing import Any, Dict, List, Optional  # noqa: F401

from . import _megaslide
from ._adamw import adamw_step
from ._compiler import (PIPELINES, DiagnosticError, PipelineResult,
                        build_module, parse_module, run_pipeline)
from ._cuda import (Availability, CompiledKernels, DsaKernelSource,
                    KernelResources, backends, compile_dsa_kernels,
                    emit_dsa_kernels, nvrtc_status, plan_dsa_kernels)
from ._dsa3d import dsa3d, dsa3d_backward, dsa3d_offsets
from ._plan import (PLAN_OPTIONS, DeviceBuffer, MemoryPlan, memory_plan,
                    model_info, plan)
from ._trainer import (RECIPE_OPTIONS, Trainer, exec_plan, loss_weights,
                       sample_sigmas)

__version__: str = _megaslide.__version__

__all__ = ["model_info", "plan", "dsa3d", "dsa3d_backward", "dsa3d_offsets",
           "__version__", "PLAN_OPTIONS", "adamw_step", "exec_plan",
           "Trainer", "sample_sigmas", "RECIPE_OPTIONS", "DiagnosticError",
           "PipelineResult", "build_module", "parse_module", "run_pipeline",
           "PIPELINES", "DeviceBuffer", "MemoryPlan", "memory_plan",
           "DsaKernelSource", "KernelResources", "CompiledKernels",
           "Availability", "emit_dsa_kernels", "plan_dsa_kernels",
           "compile_dsa_kernels", "nvrtc_status", "backends", "loss_weights"]

# The public classes and functions are megaslide.X wherever they are
# defined: in reprs, tracebacks, pickles and help().
for _name in __all__:
    _value = globals()[_name]
    if callable(_value):
        _value.__module__ = __name__
del _name, _value
