"""The compiler and runtime API of the megaslide package: IR parsing,
named pipelines with options, the memory plan, 3D-DSA kernel sources (and
NVRTC when present), the sim backend with predicted traces, plan files and
weights, and the type stubs. Error cases check the exception type and that
its message names what is wrong.

Everything runs on the tiny preset at 5 x 32 x 32 (token grid 2 x 2 x 2);
3D-DSA is forced with a (2, 2, 2) window, since the default window is
larger than that grid. Comparisons with the command-line tools skip when
the tools are not built (an installed package has none)."""

import _thread
import ast
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import threading

import numpy as np
import pytest

import megaslide
from conftest import tool_path

VIDEO = (5, 32, 32)
DSA = dict(window=(2, 2, 2), tile=(1, 2, 2))
PLAN_DSA = dict(dsa_window=(2, 2, 2), dsa_tile=(1, 2, 2))
BAD_IR = "func.func @f() {\n  %0 = megaslide.bogus\n}\n"


@pytest.fixture(scope="module")
def tiny_ir() -> str:
    return megaslide.build_module("tiny", *VIDEO)


@pytest.fixture(scope="module")
def dsa_ir(tiny_ir) -> str:
    return megaslide.run_pipeline(tiny_ir,
                                  "megaslide-rewrite-attention-to-dsa",
                                  **DSA).ir


# ---------------------------------------------------------------------------
# Building and parsing IR
# ---------------------------------------------------------------------------


def test_build_module_is_the_unplanned_training_step(tiny_ir):
    assert "func.func @train_step" in tiny_ir
    assert "megaslide.attention" in tiny_ir and "msched." not in tiny_ir
    f32 = megaslide.build_module("tiny", *VIDEO, precision="f32")
    assert "bf16" in tiny_ir and "bf16" not in f32


def test_build_module_matches_megaslide_plan_emit_mlir(tiny_ir, tmp_path):
    out = tmp_path / "tiny.mlir"
    subprocess.run([tool_path("megaslide-plan"), "--model", "tiny",
                    "--frames", "5", "--height", "32", "--width", "32",
                    "--emit-mlir", out, "-o", tmp_path / "report.txt"],
                   check=True, capture_output=True)
    assert out.read_text() == tiny_ir


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(model="no-such-model"), ValueError, "no-such-model"),
    (dict(precision="f8"), ValueError, "f8"),
    (dict(precision=16), TypeError, "precision"),
    (dict(frames=0), ValueError, "frames"),
])
def test_build_module_errors(kwargs, error, message):
    args = dict(model="tiny", frames=5, height=32, width=32)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        megaslide.build_module(args.pop("model"), args.pop("frames"),
                               args.pop("height"), args.pop("width"), **args)


def test_parse_module_round_trips(tiny_ir):
    assert megaslide.parse_module(tiny_ir) == tiny_ir
    # Top-level ops are wrapped in a module, as megaslide-opt does.
    printed = megaslide.parse_module("func.func @f() {\n  return\n}\n")
    assert printed.startswith("module {") and "func.func @f()" in printed


def test_parse_error_is_an_exception_with_the_diagnostic():
    with pytest.raises(megaslide.DiagnosticError) as info:
        megaslide.parse_module(BAD_IR, source_name="bad.mlir")
    error = info.value
    assert isinstance(error, ValueError)
    assert str(error) == ("bad.mlir:2:8: error: custom op 'megaslide.bogus' "
                          "is unknown")
    assert error.diagnostics == [str(error)] and error.ir is None


def test_verifier_error_names_the_op_and_position():
    ir = ("func.func @f(%a: tensor<2x3xf32>) -> tensor<3x2xf32> {\n"
          "  return %a : tensor<2x3xf32>\n}\n")
    with pytest.raises(megaslide.DiagnosticError,
                       match=r"^<string>:2:3: error: type of return operand "
                             r"0 \('tensor<2x3xf32>'\) doesn't match"):
        megaslide.parse_module(ir)


def test_parse_argument_types():
    with pytest.raises(TypeError, match="ir must be a str"):
        megaslide.parse_module(b"module {}")
    with pytest.raises(TypeError, match="source_name"):
        megaslide.parse_module("module {}", source_name=3)


# ---------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------


def test_megaslide_pipeline_plans_and_reports_remarks(tiny_ir):
    result = megaslide.run_pipeline(tiny_ir, "megaslide-pipeline")
    assert isinstance(result, megaslide.PipelineResult)
    assert "msched.pack" in result.ir and "msched.fetch" in result.ir
    # The default 3D-DSA window does not fit a 2x2x2 token grid.
    assert any("remark: kept global attention: the token grid (2, 2, 2)" in r
               for r in result.remarks)
    assert all(r.startswith("<string>:") for r in result.remarks)
    assert result.warnings == []


def test_pipeline_options_reach_the_passes(tiny_ir):
    result = megaslide.run_pipeline(tiny_ir, "megaslide-pipeline",
                                    prefetch_distance=0, dsa_window=(2, 2, 2),
                                    dsa_tile=(1, 2, 2))
    assert "megaslide.dsa3d" in result.ir
    assert not any("kept global attention" in r for r in result.remarks)
    assert any("not prefetched ahead of their use: prefetch-distance is 0"
               in r for r in result.remarks)


def test_phases_in_sequence_equal_the_whole_pipeline(tiny_ir):
    whole = megaslide.run_pipeline(tiny_ir, "megaslide-pipeline", **PLAN_DSA)
    ir = tiny_ir
    for phase in ("megaslide-graph-pipeline", "megaslide-schedule-pipeline",
                  "megaslide-memory-pipeline"):
        assert phase in megaslide.PIPELINES
        ir = megaslide.run_pipeline(ir, phase, **PLAN_DSA).ir
    assert ir == whole.ir
    # The same as one textual pipeline.
    text = ",".join(f"{p}{{dsa-window=2,2,2 dsa-tile=1,2,2}}"
                    for p in megaslide.PIPELINES[1:])
    assert megaslide.run_pipeline(
        tiny_ir, f"builtin.module({text})").ir == whole.ir


def test_pipeline_matches_megaslide_opt(tiny_ir, tmp_path):
    source = tmp_path / "tiny.mlir"
    source.write_text(tiny_ir)
    pipeline = "builtin.module(megaslide-pipeline{buffers=3},canonicalize)"
    cli = subprocess.run([tool_path("megaslide-opt"), source,
                          f"--pass-pipeline={pipeline}"],
                         check=True, capture_output=True, text=True)
    # megaslide-opt ends its output with one more newline.
    assert megaslide.run_pipeline(tiny_ir, pipeline).ir == cli.stdout[:-1]


def test_upstream_passes_run_by_name(tiny_ir):
    assert "megaslide.param" in megaslide.run_pipeline(tiny_ir, "cse").ir


def test_unknown_pipeline_is_named():
    with pytest.raises(megaslide.DiagnosticError,
                       match="'megaslide-no-such-pipeline' does not refer to "
                             "a registered pass or pass pipeline"):
        megaslide.run_pipeline("module {}", "megaslide-no-such-pipeline")


@pytest.mark.parametrize("pipeline, options, message", [
    ("megaslide-pipeline", dict(gpu_memory="1GB"), "no such option gpu-memory"),
    ("megaslide-memory-pipeline", dict(buffers="two"),
     "for the --buffers option: 'two' value invalid"),
    ("megaslide-graph-pipeline", dict(attention="sparse"),
     "for the --attention option: unknown value 'sparse'; use one of dsa, global"),
    # Sizes are parsed where given, also in a phase that does not read them.
    ("megaslide-graph-pipeline", dict(host_mem="lots"),
     "for the --host-mem option: 'lots' is not a memory size"),
    ("megaslide-check-budget", dict(gpu_mem="0"),
     "for the --gpu-mem option: a budget must be positive"),
    ("megaslide-plan-memory", dict(bogus=1), "no such option bogus"),
    ("canonicalize", dict(max_iterations="x"), "max-iterations"),
])
def test_bad_options_are_named(pipeline, options, message):
    with pytest.raises(megaslide.DiagnosticError, match=message) as info:
        megaslide.run_pipeline("module {}", pipeline, **options)
    assert "invalid pass pipeline" in str(info.value)
    assert pipeline in str(info.value)


def test_failing_pass_raises_with_diagnostics_remarks_and_ir(tiny_ir):
    with pytest.raises(megaslide.DiagnosticError) as info:
        megaslide.run_pipeline(tiny_ir, "megaslide-pipeline", gpu_mem="1MB")
    error = info.value
    assert "error: device memory plan needs" in error.diagnostics[0]
    assert "\n  <string>:" in error.diagnostics[0]  # its notes
    assert "note: largest consumer" in str(error)
    assert error.ir is not None and "msched.pack" in error.ir
    assert any("kept global attention" in r for r in error.remarks)


def test_bad_ir_in_a_pipeline_is_the_parse_diagnostic():
    with pytest.raises(megaslide.DiagnosticError,
                       match=r"<string>:2:8: error: custom op"):
        megaslide.run_pipeline(BAD_IR, "megaslide-pipeline")


def test_pipeline_argument_errors(tiny_ir):
    with pytest.raises(TypeError, match="single pass or pipeline name"):
        megaslide.run_pipeline(tiny_ir, "builtin.module(cse)", buffers=2)
    with pytest.raises(ValueError, match="must name a pass"):
        megaslide.run_pipeline(tiny_ir, " ")
    with pytest.raises(TypeError, match="pipeline option 'buffers'"):
        megaslide.run_pipeline(tiny_ir, "megaslide-pipeline", buffers=[1.5])
    with pytest.raises(TypeError, match="pipeline must be a str"):
        megaslide.run_pipeline(tiny_ir, None)


# ---------------------------------------------------------------------------
# Memory plan
# ---------------------------------------------------------------------------


def test_memory_plan_buffers_are_the_packed_arena():
    mp = megaslide.memory_plan("tiny", *VIDEO)
    report = megaslide.plan("tiny", *VIDEO)
    assert mp.fits and mp.violations == []
    assert mp.device_peak_bytes == report["device"]["peak_bytes"]
    assert mp.host_bytes == report["host"]["total_bytes"]
    assert mp.predicted_seconds == report["step"]["predicted_seconds"]
    assert mp.device_by_category == report["device"]["by_category"]
    assert mp.remarks == report["remarks"]
    buffers = mp.buffers
    assert buffers and all(isinstance(b, megaslide.DeviceBuffer)
                           for b in buffers)
    assert {b.category for b in buffers} >= {"weights", "activations",
                                             "gradients", "data batch"}
    assert all(0 <= b.start <= b.end < mp.num_steps and b.bytes > 0 and
               b.offset >= 0 for b in buffers)
    assert max(b.offset + b.bytes for b in buffers) == mp.device_peak_bytes
    # No two buffers live at the same time share a byte.
    for i, a in enumerate(buffers):
        for b in buffers[i + 1:]:
            if a.start <= b.end and b.start <= a.end:
                assert (a.offset + a.bytes <= b.offset or
                        b.offset + b.bytes <= a.offset), (a, b)
    # The live bytes at the worst step are what the report breaks down.
    live = max(sum(b.bytes for b in mp.live_at(s))
               for s in range(mp.num_steps))
    by_category = dict(mp.device_by_category)
    by_category.pop("alignment and fragmentation", None)
    assert live == sum(by_category.values())
    at = mp.live_at(buffers[0].start)
    assert [b.bytes for b in at] == sorted((b.bytes for b in at),
                                           reverse=True)


def test_memory_plan_over_budget_is_a_result():
    mp = megaslide.memory_plan("tiny", *VIDEO, gpu_mem="1MB")
    assert not mp.fits and "device memory plan needs" in mp.violations[0]
    assert mp.buffers


def test_memory_plan_errors():
    with pytest.raises(TypeError, match="unexpected option 'buffer'"):
        megaslide.memory_plan("tiny", *VIDEO, buffer=2)
    with pytest.raises(ValueError, match="gpu-mem"):
        megaslide.memory_plan("tiny", *VIDEO, gpu_mem="lots")


# ---------------------------------------------------------------------------
# 3D-DSA kernel sources and NVRTC
# ---------------------------------------------------------------------------

TINY_KERNELS = "dsa3d_g2x2x2_w2x2x2_t1x2x2_h4_d16_bf16_r4"


def test_emit_dsa_kernels(dsa_ir):
    (kernel,) = megaslide.emit_dsa_kernels(dsa_ir)
    assert kernel.name == TINY_KERNELS
    assert kernel.description == ("grid (2,2,2) window (2,2,2) tile (1,2,2) "
                                  "heads 4 head-dim 16 bf16 radius 4")
    kinds = {k["kind"]: k["name"] for k in kernel.kernels}
    assert set(kinds) == {"forward", "backward", "backward_keys",
                          "offsets"}
    for name in kinds.values():
        assert f'extern "C" __global__' in kernel.source and name in \
            kernel.source


def test_plan_kernels_equal_the_emitted_ones(dsa_ir):
    emitted = megaslide.emit_dsa_kernels(dsa_ir)
    planned = megaslide.plan_dsa_kernels(
        megaslide.exec_plan("tiny", *VIDEO, **PLAN_DSA))
    assert planned == emitted
    # An f32 step has no CUDA kernels.
    assert megaslide.plan_dsa_kernels(megaslide.exec_plan(
        "tiny", *VIDEO, precision="f32", **PLAN_DSA)) == []


def test_emit_matches_megaslide_translate(dsa_ir, tmp_path):
    source = tmp_path / "dsa.mlir"
    source.write_text(dsa_ir)
    cli = subprocess.run([tool_path("megaslide-translate"),
                          "--emit-dsa-kernels", source],
                         check=True, capture_output=True, text=True)
    (kernel,) = megaslide.emit_dsa_kernels(dsa_ir)
    assert cli.stdout == f"//--- {kernel.name}.cu\n{kernel.source}"


def test_module_without_dsa_has_no_kernels(tiny_ir):
    assert megaslide.emit_dsa_kernels(tiny_ir) == []


def test_unsupported_configuration_is_reported_on_its_op():
    ir = megaslide.run_pipeline(
        megaslide.build_module("tiny", *VIDEO, precision="f32"),
        "megaslide-rewrite-attention-to-dsa", **DSA).ir
    with pytest.raises(megaslide.DiagnosticError,
                       match=r"<string>:\d+:\d+: error: 3D-DSA CUDA kernels "
                             r"take bf16 or f16 q/k/v .*got f32"):
        megaslide.emit_dsa_kernels(ir)


def test_kernel_errors():
    with pytest.raises(megaslide.DiagnosticError, match="custom op"):
        megaslide.emit_dsa_kernels(BAD_IR)
    with pytest.raises(ValueError, match="not JSON"):
        megaslide.plan_dsa_kernels("{")
    with pytest.raises(ValueError, match="not an execution plan"):
        megaslide.plan_dsa_kernels('{"format": "something else"}')


def test_availability_reports():
    status = megaslide.nvrtc_status()
    assert isinstance(status, megaslide.Availability)
    assert bool(status) == status.available
    assert (status.version != "") == status.available
    assert status.available or "nvrtc" in status.reason.lower()
    backends = megaslide.backends()
    assert set(backends) == {"cpu", "sim", "cuda"}
    assert backends["cpu"] and backends["sim"]
    assert backends["cuda"].available or backends["cuda"].reason


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASLIDE_KERNEL_CACHE", os.fspath(tmp_path / "kc"))


def test_compile_dsa_kernels_with_nvrtc(dsa_ir, kernel_cache):
    if not megaslide.nvrtc_status():
        with pytest.raises(RuntimeError, match="NVRTC is not available"):
            megaslide.compile_dsa_kernels(megaslide.emit_dsa_kernels(dsa_ir))
        pytest.skip("NVRTC not available: "
                    + megaslide.nvrtc_status().reason)
    kernels = megaslide.emit_dsa_kernels(dsa_ir)
    (compiled,) = megaslide.compile_dsa_kernels(kernels)
    assert compiled.name == TINY_KERNELS and compiled.arch == "sm_90a"
    assert compiled.cubin[:4] == b"\x7fELF" and not compiled.from_cache
    launches = {k["name"]: k for k in kernels[0].kernels}
    assert {r.kernel for r in compiled.resources} == set(launches)
    for r in compiled.resources:
        assert r.registers > 0 and r.threads == launches[r.kernel]["block"][0]
        assert 0 < r.occupancy <= 1 and r.blocks_per_sm > 0
    assert compiled.spill_bytes == 0
    (again,) = megaslide.compile_dsa_kernels(kernels)
    assert again.from_cache and again.cubin == compiled.cubin


def test_compile_error_carries_the_nvrtc_log(dsa_ir, kernel_cache):
    if not megaslide.nvrtc_status():
        pytest.skip("NVRTC not available")
    (kernel,) = megaslide.emit_dsa_kernels(dsa_ir)
    broken = dataclasses.replace(kernel, source=kernel.source + "\nnot cuda;")
    with pytest.raises(RuntimeError, match=rf"{TINY_KERNELS}\.cu.*error"):
        megaslide.compile_dsa_kernels([broken])
    with pytest.raises(TypeError, match="DsaKernelSource"):
        megaslide.compile_dsa_kernels([kernel.source])


# ---------------------------------------------------------------------------
# Trainer: sim backend, traces, plan files, weights
# ---------------------------------------------------------------------------


def check_trace(path, backend):
    trace = json.loads(pathlib.Path(path).read_text())
    events = trace["traceEvents"]
    threads = {e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "h2d", "d2h", "host"} <= threads
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert trace["otherData"]["backend"] == backend
    return trace


def test_sim_backend_predicts_the_planned_step(tmp_path):
    trainer = megaslide.Trainer("tiny", *VIDEO, backend="sim")
    assert trainer.backend == "sim" and not trainer.computes_loss
    result = trainer.step(trace=tmp_path / "sim.json")
    planned = megaslide.plan("tiny", *VIDEO)
    assert result["loss"] is None
    # The planner replays the same tasks (sim::buildTasks) of the plan
    # before its JSON round trip: the figures are equal, not close.
    assert result["seconds"] == planned["step"]["predicted_seconds"]
    assert result["planned_peak_bytes"] == result["measured_peak_bytes"] == \
        planned["device"]["peak_bytes"]
    trace = check_trace(tmp_path / "sim.json", "sim")
    assert trace["otherData"]["step_seconds"] == result["seconds"]


def test_sim_backend_uses_the_hardware_description(tmp_path):
    hardware = dict(megaslide.plan("tiny", *VIDEO)["hardware"])
    hardware["name"] = "slow PCIe"
    hardware["h2d_bandwidth"] /= 100
    hw = tmp_path / "slow.json"
    hw.write_text(json.dumps(hardware))
    slow = megaslide.Trainer("tiny", *VIDEO, backend="sim", hw=hw).step()
    fast = megaslide.Trainer("tiny", *VIDEO, backend="sim").step()
    assert slow["seconds"] > fast["seconds"]
    assert slow["seconds"] == megaslide.plan(
        "tiny", *VIDEO, hw=os.fspath(hw))["step"]["predicted_seconds"]
    with pytest.raises(ValueError, match="missing.json"):
        megaslide.Trainer("tiny", *VIDEO, backend="sim",
                          hw=tmp_path / "missing.json")


def test_sim_backend_holds_no_state(tmp_path):
    trainer = megaslide.Trainer("tiny", *VIDEO, backend="sim")
    calls = [trainer.parameters,
             lambda: trainer.load_parameters({}),
             lambda: trainer.gradients(**{
                 k: np.zeros(s, np.float32)
                 for k, s in trainer.input_shapes().items()}),
             lambda: trainer.load_weights(tmp_path),
             lambda: trainer.save_weights(tmp_path / "w")]
    for call in calls:
        with pytest.raises(ValueError, match="sim backend holds no model "
                                             "state"):
            call()


def test_cuda_backend_says_why_it_is_unavailable():
    status = megaslide.backends()["cuda"]
    if status.available:
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available"):
        megaslide.Trainer("tiny", *VIDEO, backend="cuda")


def test_cpu_trace_and_unwritable_trace(tmp_path):
    trainer = megaslide.Trainer("tiny", *VIDEO)
    result = trainer.step(trace=tmp_path / "cpu.json")
    assert np.isfinite(result["loss"])
    check_trace(tmp_path / "cpu.json", "cpu")
    with pytest.raises(ValueError, match="no-such-dir"):
        trainer.step(trace=tmp_path / "no-such-dir" / "t.json")
    assert trainer.step_count == 1


def test_plan_file_round_trip(tmp_path):
    first = megaslide.Trainer("tiny", *VIDEO, seed=3)
    path = tmp_path / "plan.json"
    first.save_plan(path)
    assert json.loads(path.read_text()) == json.loads(first.plan_json())
    again = megaslide.Trainer(plan_file=path, seed=3)
    assert again.input_shapes() == first.input_shapes()
    # Same plan, seed and data: the same first loss, bit for bit.
    assert again.step()["loss"] == first.step()["loss"]
    sim = megaslide.Trainer(plan_file=path, backend="sim")
    assert sim.step()["seconds"] > 0


def test_plan_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read plan file .*missing"):
        megaslide.Trainer(plan_file=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "megaslide-exec-plan", "version": 99}')
    with pytest.raises(ValueError, match="bad.json"):
        megaslide.Trainer(plan_file=bad)
    with pytest.raises(ValueError, match="not both"):
        megaslide.Trainer(plan_json="{}", plan_file=bad)
    with pytest.raises(TypeError, match="only apply when compiling"):
        megaslide.Trainer(plan_file=bad, buffers=3)
    with pytest.raises(ValueError, match="give a model"):
        megaslide.Trainer()


def test_weights_save_and_load_round_trip(tmp_path):
    trained = megaslide.Trainer("tiny", *VIDEO, seed=1)
    trained.step()
    trained.save_weights(tmp_path / "f32")
    files = sorted(os.listdir(tmp_path / "f32"))
    assert files == ["config.json", "diffusion_pytorch_model.safetensors"]
    fresh = megaslide.Trainer("tiny", *VIDEO, seed=2)
    fresh.load_weights(tmp_path / "f32")
    want, got = trained.parameters(), fresh.parameters()
    assert want.keys() == got.keys()
    assert all(np.array_equal(want[k], got[k]) for k in want)
    # bf16, sharded: every value rounds to the nearest bf16.
    trained.save_weights(tmp_path / "bf16", dtype="bf16",
                         max_shard_bytes=20_000)
    names = os.listdir(tmp_path / "bf16")
    assert "diffusion_pytorch_model.safetensors.index.json" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    fresh.load_weights(tmp_path / "bf16")
    for name, value in fresh.parameters().items():
        bits = value.view(np.uint32)
        assert not (bits & 0xFFFF).any(), name
        assert np.allclose(value, want[name], rtol=2 ** -8, atol=0)


def test_weights_errors(tmp_path):
    trainer = megaslide.Trainer("tiny", *VIDEO)
    with pytest.raises(ValueError, match="dtype must be 'f32' or 'bf16'"):
        trainer.save_weights(tmp_path, dtype="f16")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        trainer.save_weights(tmp_path, max_shard_bytes=0)
    with pytest.raises(ValueError, match="missing"):
        trainer.load_weights(tmp_path / "missing")
    safetensors = pytest.importorskip("safetensors.numpy")
    params = trainer.parameters()
    params["blocks.0.not_a_weight"] = np.zeros(3, np.float32)
    del params["proj_out.bias"]
    path = tmp_path / "wrong.safetensors"
    safetensors.save_file(params, os.fspath(path))
    before = trainer.parameters()
    with pytest.raises(ValueError) as info:
        trainer.load_weights(path)
    assert "blocks.0.not_a_weight" in str(info.value)
    assert "proj_out.bias" in str(info.value)
    after = trainer.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------
# Documentation and type stubs
# ---------------------------------------------------------------------------


def test_public_api_is_documented():
    for name in megaslide.__all__:
        if name.startswith("__") or name == "PIPELINES":
            continue
        obj = getattr(megaslide, name)
        assert obj.__doc__ and len(obj.__doc__) > 20, name
    for name in ("step", "load_weights", "save_weights", "save_plan",
                 "plan_json"):
        assert getattr(megaslide.Trainer, name).__doc__, name


def test_stubs_cover_the_native_module():
    package = pathlib.Path(megaslide.__file__).parent
    assert (package / "py.typed").exists()
    stub = ast.parse((package / "_megaslide.pyi").read_text())
    functions = {n.name for n in stub.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    native = megaslide._megaslide
    public = {n for n in dir(native) if not n.startswith("_")}
    assert public == functions | set(classes)
    methods = {n.name for n in classes["Trainer"].body
               if isinstance(n, ast.FunctionDef) and n.name != "__init__"}
    assert {n for n in dir(native.Trainer) if not n.startswith("_")} == \
        methods


# ---------------------------------------------------------------------------
# Trainer: one call at a time, checked step inputs, Ctrl-C between steps
# (issue 11, item 12)
# ---------------------------------------------------------------------------


def trained(steps, seed):
    """Parameters and step count of a Trainer that took `steps` steps alone."""
    tr = megaslide.Trainer("tiny", *VIDEO, seed=seed)
    for _ in range(steps):
        tr.step()
    return tr


def assert_same_parameters(a, b):
    pa, pb = a.parameters(), b.parameters()
    assert pa.keys() == pb.keys()
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name


def test_trainer_steps_from_two_threads_are_serialised():
    """Two threads stepping one Trainer 15 times each take 30 whole steps:
    the result is bit-identical to 30 steps taken by one thread (it used to
    count 15 and corrupt the parameters)."""
    shared = megaslide.Trainer("tiny", *VIDEO, seed=5)
    errors = []

    def run():
        try:
            for _ in range(15):
                shared.step()
        except Exception as e:  # reported below, with the thread's error
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert shared.step_count == 30
    assert_same_parameters(shared, trained(30, seed=5))


def test_trainer_ctrl_c_leaves_whole_steps():
    """KeyboardInterrupt arrives at a step boundary while another thread
    steps too: every step taken is whole, and the Trainer goes on."""
    tr = megaslide.Trainer("tiny", *VIDEO, seed=7)

    def work():
        for _ in range(3):
            tr.step()
        # Interrupted while the main thread steps: after the worker's steps,
        # not after a time, so that a loaded machine does not let the main
        # thread take thousands of steps first (which the check replays).
        _thread.interrupt_main()
    worker = threading.Thread(target=work)
    # interrupt_main does nothing where SIGINT is ignored, as it is for a
    # background job of a non-interactive shell (`./scripts/test.sh &`):
    # the loop below would never end.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.start()
            while True:
                tr.step()
    finally:
        signal.signal(signal.SIGINT, previous)
    worker.join()
    alone = trained(tr.step_count, seed=7)
    assert_same_parameters(tr, alone)
    assert tr.step()["loss"] == alone.step()["loss"]


def step_batch(tr, **changes):
    """Valid step inputs, with `changes` (key: value or function of the
    key's shape) applied."""
    shapes = tr.input_shapes()
    batch = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    batch["timesteps"] = np.full(shapes["timesteps"], 0.5, np.float32)
    for key, value in changes.items():
        batch[key] = value(shapes[key]) if callable(value) else value
    return batch


@pytest.mark.parametrize("changes, error, message", [
    (dict(latents=np.zeros), TypeError,
     "step input 'latents' must have dtype float32, got float64"),
    (dict(noise=lambda s: np.zeros(s, np.int64)), TypeError,
     "step input 'noise' must have dtype float32, got int64"),
    (dict(timesteps=[0.5]), TypeError,
     "step input 'timesteps' must be a numpy.ndarray, got list"),
    (dict(foo=np.zeros(1, np.float32)), TypeError,
     "step() got an unexpected input 'foo'; the plan takes latents, noise, "
     "timesteps, condition"),
    (dict(timesteps=np.array([1.5], np.float32)), ValueError,
     "step input 'timesteps' must be in [0, 1]"),
    (dict(timesteps=np.array([-0.25], np.float32)), ValueError,
     "got -0.25 at index 0"),
    (dict(timesteps=np.array([np.nan], np.float32)), ValueError,
     "got nan at index 0"),
])
def test_trainer_step_inputs_are_not_cast(changes, error, message):
    """float64, int64 and lists are refused, not cast; unknown keywords
    too; timesteps outside [0, 1]. Nothing is applied."""
    tr = megaslide.Trainer("tiny", *VIDEO)
    before = tr.parameters()
    with pytest.raises(error) as e:
        tr.step(**step_batch(tr, **changes))
    assert message in str(e.value)
    if "foo" not in changes:  # gradients() takes the four by name
        with pytest.raises(error) as e:
            tr.gradients(**step_batch(tr, **changes))
        assert message in str(e.value)
    assert tr.step_count == 0
    assert all(np.array_equal(before[k], v)
               for k, v in tr.parameters().items())


def test_trainer_timesteps_zero_and_one_are_accepted():
    tr = megaslide.Trainer("tiny", *VIDEO)
    for t in (0.0, 1.0):
        batch = step_batch(tr, timesteps=np.full(
            tr.input_shapes()["timesteps"], t, np.float32))
        assert np.isfinite(tr.step(**batch)["loss"])
    assert tr.step_count == 2
