"""3D-DSA CUDA kernels: their sources (lib/Target/Cuda), NVRTC
(runtime/cuda), and which backends run on this machine."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from . import _megaslide
from ._checks import _check_str
from ._compiler import DiagnosticError


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
