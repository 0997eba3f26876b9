"""The device check's Python scripts (scripts/compare_steps.py,
scripts/compare_trace_sim.py, scripts/dsa_gpu_check.py), run here without
a GPU: the lent GPU machine is rare and short, so a script that breaks
there wastes it. GPU-only paths of dsa_gpu_check run against a fake
driver whose kernels are the script's own float64 reference."""

import ctypes
import importlib.util
import json
import re
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import tool_path

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def megaslide_run() -> str:
    return tool_path("megaslide-run")


def run_script(name, *args):
    return subprocess.run([sys.executable, str(SCRIPTS / name)] +
                          [str(a) for a in args],
                          capture_output=True, text=True, timeout=120)


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / (name +
                                                                   ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path, losses, seconds=0.1):
    path.write_text("".join(
        json.dumps({"step": i + 1, "loss": loss, "seconds": seconds}) + "\n"
        for i, loss in enumerate(losses)))
    return path


def write_safetensors(path, tensors):
    """tensors: {name: (dtype, float32 array)}, dtype F32, BF16 or F16."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        a = np.asarray(array, np.float32)
        raw = {"F32": lambda: a.astype("<f4").tobytes(),
               "F16": lambda: a.astype("<f2").tobytes(),
               "BF16": lambda: (a.view(np.uint32) >> 16).astype(
                   "<u2").tobytes()}[dtype]()
        header[name] = {"dtype": dtype, "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return path


def gradients(seed=0):
    rng = np.random.default_rng(seed)
    return {"blocks.0.attn1.to_q.weight": rng.standard_normal((8, 8)),
            "blocks.0.attn1.to_q.bias": rng.standard_normal(8) * 1e-2,
            "proj_out.weight": rng.standard_normal((4, 8)) * 1e-5}


# ---------------------------------------------------------------------------
# compare_steps.py
# ---------------------------------------------------------------------------

LOSSES = [2.7741, 2.5980, 2.0194, 1.8]


def test_steps_agree_within_tolerance(tmp_path):
    """bf16-sized differences pass: 0.5% at step 1, 4% later, gradients
    within 4% of each tensor's scale (the tiny tensor within the floor)."""
    want = write_metrics(tmp_path / "cpu.jsonl", LOSSES)
    got = write_metrics(tmp_path / "cuda.jsonl",
                        [LOSSES[0] * 1.005] + [x * 0.96 for x in LOSSES[1:]])
    g = gradients()
    gw = write_safetensors(tmp_path / "cpu.st",
                           {n: ("F32", a) for n, a in g.items()})
    gg = write_safetensors(tmp_path / "cuda.st", {
        n: ("F32", a + 0.04 * max(1e-3, np.abs(a).max()))
        for n, a in g.items()})
    out = tmp_path / "report.json"
    r = run_script("compare_steps.py", want, got, "--steps", 4,
                   "--gradients", gw, gg, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["losses"]) == 4
    assert len(report["gradients"]) == 3
    assert all(0.035 < x["rel"] < 0.045 for x in report["gradients"])


def test_first_step_loss_is_held_tighter(tmp_path):
    """2% at step 1 is past its 1e-2; the same at step 2 is within 5e-2."""
    want = write_metrics(tmp_path / "a.jsonl", LOSSES)
    late = write_metrics(tmp_path / "b.jsonl",
                         [LOSSES[0], LOSSES[1] * 1.02] + LOSSES[2:])
    early = write_metrics(tmp_path / "c.jsonl",
                          [LOSSES[0] * 1.02] + LOSSES[1:])
    assert run_script("compare_steps.py", want, late).returncode == 0
    r = run_script("compare_steps.py", want, early)
    assert r.returncode == 1 and "FAIL" in r.stdout.splitlines()[1]


def test_step_count_and_missing_losses(tmp_path):
    """--steps is enforced, and a null loss on one side only differs."""
    want = write_metrics(tmp_path / "a.jsonl", LOSSES)
    short = write_metrics(tmp_path / "b.jsonl", LOSSES[:3])
    null = write_metrics(tmp_path / "c.jsonl", LOSSES[:3] + [None])
    r = run_script("compare_steps.py", want, short, "--steps", 4)
    assert r.returncode == 1 and "expected 4 steps, the run logged 3" in \
        r.stdout
    assert run_script("compare_steps.py", want, null).returncode == 1


def test_gradients_off_by_ten_percent_fail(tmp_path):
    """One tensor 10% off fails and heads the table, the others pass."""
    metrics = write_metrics(tmp_path / "m.jsonl", LOSSES)
    g = gradients()
    bad = dict(g)
    bad["blocks.0.attn1.to_q.bias"] = g["blocks.0.attn1.to_q.bias"] * 1.1
    gw = write_safetensors(tmp_path / "w.st",
                           {n: ("F32", a) for n, a in g.items()})
    gg = write_safetensors(tmp_path / "g.st",
                           {n: ("F32", a) for n, a in bad.items()})
    out = tmp_path / "report.json"
    r = run_script("compare_steps.py", metrics, metrics, "--gradients", gw,
                   gg, "--json", out)
    assert r.returncode == 1
    rows = json.loads(out.read_text())["gradients"]
    assert rows[0]["name"] == "blocks.0.attn1.to_q.bias"
    assert [x["ok"] for x in rows] == [False, True, True]
    assert "blocks.0.attn1.to_q.bias" in r.stdout and "FAIL" in r.stdout


def test_missing_gradient_is_named(tmp_path):
    metrics = write_metrics(tmp_path / "m.jsonl", LOSSES)
    g = gradients()
    gw = write_safetensors(tmp_path / "w.st",
                           {n: ("F32", a) for n, a in g.items()})
    gg = write_safetensors(tmp_path / "g.st", {
        n: ("F32", a) for n, a in g.items() if n != "proj_out.weight"})
    r = run_script("compare_steps.py", metrics, metrics, "--gradients", gw,
                   gg)
    assert r.returncode == 1
    assert "gradient 'proj_out.weight' is missing from the run's file" in \
        r.stdout


def test_reads_bf16_and_f16(tmp_path):
    """16-bit files are widened exactly (values representable in both)."""
    cs = load_script("compare_steps")
    a = np.array([[1.5, -2.25], [0.0078125, 1024.0]], np.float32)
    path = write_safetensors(tmp_path / "h.st",
                             {"b": ("BF16", a), "h": ("F16", a),
                              "f": ("F32", a)})
    t = cs.read_safetensors(path)
    for name in "bhf":
        assert t[name].dtype == np.float32 and np.array_equal(t[name], a)


def test_reads_the_runtime_writer(tmp_path, megaslide_run):
    """A file of the C++ safetensors writer (--save-weights: the writer
    --save-gradients uses) reads, and agrees with itself."""
    subprocess.run([megaslide_run, "--model", "tiny", "--backend", "cpu",
                    "--steps", "1", "--no-progress", "--save-weights",
                    str(tmp_path / "w")], check=True, capture_output=True)
    st = tmp_path / "w" / "diffusion_pytorch_model.safetensors"
    metrics = write_metrics(tmp_path / "m.jsonl", LOSSES)
    out = tmp_path / "r.json"
    r = run_script("compare_steps.py", metrics, metrics, "--gradients", st,
                   st, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(json.loads(out.read_text())["gradients"]) > 10


def test_unreadable_safetensors(tmp_path):
    metrics = write_metrics(tmp_path / "m.jsonl", LOSSES)
    bad = tmp_path / "bad.st"
    bad.write_bytes(struct.pack("<Q", 1000) + b"{}")
    r = run_script("compare_steps.py", metrics, metrics, "--gradients", bad,
                   bad)
    assert r.returncode == 2 and "past the end of the file" in r.stderr


# ---------------------------------------------------------------------------
# compare_trace_sim.py
# ---------------------------------------------------------------------------

def write_trace(path, steps, names=None):
    """steps: per step, a list of (instruction, op name, dur us); spans of
    a step follow the previous step on the time axis, as RunDriver
    writes them."""
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
               "args": {"name": "compute"}}]
    t = 0.0
    for spans in steps:
        for inst, name, dur in spans:
            events.append({"name": (names or {}).get(inst, name), "ph": "X",
                           "pid": 1, "tid": 1, "ts": t, "dur": dur,
                           "args": {"instruction": inst, "bytes": 0,
                                    "flops": 0}})
            t += dur
    path.write_text(json.dumps({"traceEvents": events,
                                "displayTimeUnit": "ms"}))
    return path


PLAN = [(0, "linear", 10.0), (1, "linear", 30.0), (2, "attention", 50.0),
        (3, "fetch blocks.0.w", 5.0), (4, "fetch blocks.0.b", 5.0)]


def test_trace_kinds_against_prediction(tmp_path):
    """Measured per kind is the mean of the steps after the first (its
    warm-up spans are 100x and must not count); ratios follow."""
    warm = [(i, n, d * 100) for i, n, d in PLAN]
    fast = [(i, n, d * 2) for i, n, d in PLAN]
    slow = [(i, n, d * 4) for i, n, d in PLAN]
    measured = write_trace(tmp_path / "m.json", [warm, fast, slow])
    predicted = write_trace(tmp_path / "p.json", [PLAN, PLAN])
    out = tmp_path / "r.json"
    r = run_script("compare_trace_sim.py", measured, predicted, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    kinds = {k["kind"]: k for k in report["kinds"]}
    assert set(kinds) == {"linear", "attention", "fetch"}
    assert kinds["linear"]["count"] == 2
    assert kinds["linear"]["measured_s"] == pytest.approx(120e-6)
    assert kinds["linear"]["predicted_s"] == pytest.approx(40e-6)
    assert kinds["attention"]["ratio"] == pytest.approx(3.0)
    assert report["step"]["ratio"] == pytest.approx(3.0)
    assert report["warmup"] == 1 and report["measured_steps"] == 2


def test_trace_of_another_plan_fails(tmp_path):
    measured = write_trace(tmp_path / "m.json", [PLAN, PLAN],
                           names={2: "dsa3d"})
    predicted = write_trace(tmp_path / "p.json", [PLAN])
    r = run_script("compare_trace_sim.py", measured, predicted)
    assert r.returncode == 1
    assert "#2  measured 'dsa3d', predicted 'attention'" in r.stdout


def test_real_cpu_and_sim_traces(tmp_path, megaslide_run):
    """The cpu backend (standing in for cuda) and the sim backend name
    every span of the same plan alike."""
    for backend, steps in (("cpu", 2), ("sim", 1)):
        subprocess.run([megaslide_run, "--model", "tiny", "--backend",
                        backend, "--steps", str(steps), "--no-progress",
                        "--trace", str(tmp_path / (backend + ".json"))],
                       check=True, capture_output=True)
    out = tmp_path / "r.json"
    r = run_script("compare_trace_sim.py", tmp_path / "cpu.json",
                   tmp_path / "sim.json", "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert not report["renamed"] and not report["only_measured"]
    kinds = {k["kind"]: k for k in report["kinds"]}
    assert kinds["linear"]["count"] == kinds["linear"]["predicted_count"] > 0
    assert all(k["measured_s"] > 0 for k in kinds.values()
               if k["kind"] != "reshape")


# ---------------------------------------------------------------------------
# dsa_gpu_check.py
# ---------------------------------------------------------------------------

def test_dsa_self_test():
    r = run_script("dsa_gpu_check.py", "--self-test")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "self-test passed" in r.stdout
    assert r.stdout.count("equals the full one") == 2


class FakeCuda:
    """The driver primitives of dsa_gpu_check.Cuda (mixed in before it, so
    its own upload, download and fill_periodic run): device memory in host
    arrays; each kernel is the script's float64 reference rounded like the
    real outputs, so a run checks everything around the kernels:
    arguments, layouts, fills, sampling, downloads. `fault` breaks one
    output, which the check must catch."""

    def __init__(self, dsa, configs, fault=None):
        self.dsa, self.fault, self.name = dsa, fault, "fake GPU"
        self.configs = {k["name"]: c for c in configs for k in c["kernels"]}
        self.mem, self.top = {}, 1 << 16
        self.o = {}  # Delta buffer address -> the output it was formed from

    def alloc(self, nbytes):
        ptr = self.top
        self.mem[ptr] = np.zeros(max(nbytes, 16), np.uint8)
        self.top += max(nbytes, 16) + 4096
        return ctypes.c_uint64(ptr)

    def span(self, addr, nbytes):
        for base, buf in self.mem.items():
            if base <= addr < base + buf.size:
                assert addr - base + nbytes <= buf.size, "past an allocation"
                return buf[addr - base:addr - base + nbytes]
        raise AssertionError("address %#x outside every allocation" % addr)

    def free(self, ptr):
        del self.mem[ptr.value]

    def write(self, ptr, array, offset=0):
        a = np.ascontiguousarray(array)
        self.span(ptr.value + offset, a.nbytes)[:] = a.reshape(-1).view(
            np.uint8)

    def read(self, ptr, out, offset=0):
        out.reshape(-1).view(np.uint8)[:] = self.span(ptr.value + offset,
                                                      out.nbytes)
        return out

    def copy(self, dst, src, nbytes):
        self.span(dst, nbytes)[:] = self.span(src, nbytes)

    def zero(self, ptr, nbytes):
        self.span(ptr.value, nbytes)[:] = 0

    def module(self, path):
        return None, None

    def function(self, mod, name, smem):
        return name

    def sync(self):
        pass

    def time_ms(self, body, warmup, reps):
        body()
        return 1.0

    def launch(self, fn, grid, block, smem, args):
        d = self.dsa
        cfg = self.configs[fn]
        kind = fn[len(cfg["name"]) + 1:]
        elem = cfg["element_type"]
        geo = d.Geometry(cfg)
        shape = (grid[2], cfg["tokens"], cfg["heads"], cfg["head_dim"])
        off_shape = shape[:1] + (cfg["heads"], geo.nt, geo.ny, geo.nx,
                                 geo.kt, 2)

        def tensor(ptr):
            return d.Dense(d.from_bits(self.download(ptr, shape, np.uint16),
                                       elem))
        src = {n: tensor(p) for n, p in zip("qk", args[:2])}
        if kind == "offsets":
            off = np.zeros(off_shape, np.int32)
            for b in range(shape[0]):
                for h in range(shape[2]):
                    for t, (idx, _, _) in enumerate(geo.tiles()):
                        for j, (c, _) in enumerate(
                                d.tile_offsets_reference(geo, src, b, h, t)):
                            off[(b, h) + idx + (j,)] = c
            self.write(args[2], off)
            return
        offsets = self.download(args[3], off_shape, np.int32)
        src["v"] = tensor(args[2])
        src["do"] = (tensor(args[5]) if kind == "bwd" else
                     tensor(args[4]) if kind == "bwd_keys" else src["v"])
        scale = args[-1]
        if kind == "fwd":
            o, lse = d.reference(geo, src, offsets, scale)[:2]
            if self.fault == "corner out":
                o[:, geo.tiles()[0][2]] += 0.5
            self.write(args[4], d.to_bits(o, elem))
            self.write(args[5], lse.astype(np.float32))
            return
        if kind == "bwd":
            # (q, k, v, offsets, o, do, lse, dq, delta, scale)
            o = tensor(args[4])
            _, _, dq, dk, dv = d.reference(geo, src, offsets, scale, o)
            self.write(args[7], d.to_bits(dq, elem))
            # Delta = rowsum(dO * O), [B, H, N]: the dK/dV kernel's input.
            self.o[args[8].value] = o
            return
        # bwd_keys: (q, k, v, offsets, do, lse, delta, dk, dv, scale); the
        # fake keeps the forward output the backward's Delta came from.
        _, _, dq, dk, dv = d.reference(geo, src, offsets, scale,
                                       self.o[args[6].value])
        if self.fault == "dk":
            dk *= 1.1
        self.write(args[7], d.to_bits(dk, elem))
        self.write(args[8], d.to_bits(dv, elem))


def fake_run(tmp_path, monkeypatch, fault=None):
    """dsa_gpu_check --check --bench on the fake driver: the self-test's
    two configurations, the second above --max-check-tokens (sampled and
    timed, as the 105B one is on the GPU)."""
    dsa = load_script("dsa_gpu_check")
    configs = []
    for cfg in dsa.SELF_TEST_CONFIGS:
        cfg = dict(cfg)
        cfg["kernels"] = [
            {"kind": kind, "name": cfg["name"] + suffix,
             "grid_for_batch_1": [dsa.Geometry(cfg).ntiles, cfg["heads"], 1],
             "block": [256, 1, 1], "dynamic_shared_bytes": 0}
            for kind, suffix in (("forward", "_fwd"), ("backward", "_bwd"),
                                 ("backward_keys", "_bwd_keys"),
                                 ("offsets", "_offsets"))]
        configs.append(cfg)
    (tmp_path / "manifest.json").write_text(json.dumps({"configs": configs}))
    driver = type("FakeDriver", (FakeCuda, dsa.Cuda), {})
    monkeypatch.setattr(dsa, "Cuda", lambda: driver(dsa, configs, fault))
    monkeypatch.setattr(dsa, "PERIOD", 4099)
    out = tmp_path / "dsa.json"
    monkeypatch.setattr(sys, "argv", [
        "dsa_gpu_check.py", str(tmp_path), "--check", "--bench", "--batch",
        "1", "--max-check-tokens", "700", "--json", str(out)])
    return dsa.main(), json.loads(out.read_text())


def test_dsa_check_on_fake_gpu(tmp_path, monkeypatch):
    rc, report = fake_run(tmp_path, monkeypatch)
    assert rc == 0 and report["ok"]
    whole, sampled = report["configs"]
    assert whole["mode"] == "whole" and sampled["mode"] == "sampled"
    assert sampled["inputs_match"] and sampled["keys"] == [4, 4]
    assert sampled["offsets"]["checked"] > 0
    assert all(c["ok"] for c in sampled["checks"].values())
    assert report["timings"][0]["ms"]["forward"] == 1.0


@pytest.mark.parametrize("fault,quantity", [("dk", "dk"),
                                            ("corner out", "out")])
def test_dsa_check_catches_faults(tmp_path, monkeypatch, fault, quantity):
    """A gradient 10% off everywhere, or a wrong corner tile (sampled
    first), fails the whole and the sampled check."""
    rc, report = fake_run(tmp_path, monkeypatch, fault)
    assert rc == 1 and not report["ok"]
    for rec in report["configs"]:
        assert not rec["checks"][quantity]["ok"], rec["name"]


# ---------------------------------------------------------------------------
# dsa_processor_gpu_check.py
# ---------------------------------------------------------------------------

def test_processor_check_runs_on_the_cpu_and_can_fail(tmp_path):
    """--device cpu: the GPU check's comparisons with eager FlexAttention
    pass; with the processor's attention made global they fail."""
    pytest.importorskip("torch")
    r = run_script("dsa_processor_gpu_check.py", "--device", "cpu",
                   "--json", str(tmp_path / "out.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    cases = json.loads((tmp_path / "out.json").read_text())["cases"]
    assert len(cases) == 3 and all(c["ok"] for c in cases)
    check = load_script("dsa_processor_gpu_check")
    real = check.load_processor_module

    def global_attention():
        module = real()
        from torch.nn.attention.flex_attention import flex_attention
        module._dsa_flex = lambda q, k, v, *settings: flex_attention(q, k, v)
        return module

    check.load_processor_module = global_attention
    check.CASES = check.CASES[:1]
    sys_argv = sys.argv
    try:
        sys.argv = ["dsa_processor_gpu_check.py", "--device", "cpu"]
        assert check.main() == 1
    finally:
        sys.argv = sys_argv


# ---------------------------------------------------------------------------
# device-check.sh on a fake GPU machine
# ---------------------------------------------------------------------------

# The plans of scripts/device-bundle.sh, calibration ones last.
BUNDLE_PLANS = ["tiny", "tiny-dsa", "dit-xl-2-256", "wan-1block",
                "105b-1block"]

# megaslide-runtime-tests with a device present, as device-check.sh's GPU
# step runs it: tests outside the GPU suites that need no device skip, one
# of them with "Gpu" in its name (the name CudaBackendTest's no-device test
# had), and the GPU suites pass.
GTEST_WITH_DEVICE = """\
Note: Google Test filter = {filter}
[==========] Running 7 tests from 4 test suites.
[----------] Global test environment set-up.
[----------] 3 tests from CudaApiTest
[ RUN      ] CudaApiTest.NoDeviceGivesAClearError
test/unit/runtime/cuda/CudaBackendTest.cpp:105: Skipped
a CUDA device is present

[  SKIPPED ] CudaApiTest.NoDeviceGivesAClearError (0 ms)
[ RUN      ] CudaApiTest.StubDriverResolvesEverySymbol
[       OK ] CudaApiTest.StubDriverResolvesEverySymbol (2 ms)
[ RUN      ] CudaApiTest.CublasLtResolvesEverySymbol
[       OK ] CudaApiTest.CublasLtResolvesEverySymbol (40 ms)
[----------] 3 tests from CudaApiTest (42 ms total)

[----------] 1 test from CudaBackendTest
[ RUN      ] CudaBackendTest.CreateWithoutGpuSaysWhy
test/unit/runtime/cuda/CudaBackendTest.cpp:1229: Skipped
a CUDA device is present (covered by CudaBackendGpuTest)

[  SKIPPED ] CudaBackendTest.CreateWithoutGpuSaysWhy (0 ms)
[----------] 1 test from CudaBackendTest (0 ms total)

[----------] 1 test from CudaBackendGpuTest
[ RUN      ] CudaBackendGpuTest.HandBuiltPlanMatchesCpuBackend
{handbuilt}
[----------] 1 test from CudaBackendGpuTest (1520 ms total)

[----------] 2 tests from GlobalAndDsaAttention/CudaBackendGpuTinyTest
[ RUN      ] GlobalAndDsaAttention/CudaBackendGpuTinyTest.MatchesCpuBackend/0
[       OK ] GlobalAndDsaAttention/CudaBackendGpuTinyTest.MatchesCpuBackend/0 (2310 ms)
[ RUN      ] GlobalAndDsaAttention/CudaBackendGpuTinyTest.MatchesCpuBackend/1
[       OK ] GlobalAndDsaAttention/CudaBackendGpuTinyTest.MatchesCpuBackend/1 (2402 ms)
[----------] 2 tests from GlobalAndDsaAttention/CudaBackendGpuTinyTest (4712 ms total)

[----------] Global test environment tear-down
[==========] 7 tests from 4 test suites ran. (6274 ms total)
[  PASSED  ] {passed} tests.
[  SKIPPED ] {skipped} tests, listed below:
[  SKIPPED ] CudaApiTest.NoDeviceGivesAClearError
[  SKIPPED ] CudaBackendTest.CreateWithoutGpuSaysWhy
{listed}"""

HANDBUILT_OK = ("[       OK ] CudaBackendGpuTest.HandBuiltPlanMatchesCpuBackend "
                "(1520 ms)")
HANDBUILT_SKIPPED = (
    "test/unit/runtime/cuda/CudaBackendTest.cpp:1912: Skipped\n"
    "no CUDA driver: libcuda.so.1 not found\n\n"
    "[  SKIPPED ] CudaBackendGpuTest.HandBuiltPlanMatchesCpuBackend (0 ms)")

GTEST_COMPILE = """\
Note: Google Test filter = {filter}
[==========] Running 4 tests from 2 test suites.
[ RUN      ] CudaKernelsTest.EveryKernelCompilesForSm90aWithoutSpills
[       OK ] CudaKernelsTest.EveryKernelCompilesForSm90aWithoutSpills (800 ms)
[ RUN      ] CudaKernelsTest.AttentionOnTensorCoresCompilesToMmaWithoutSpills
[       OK ] CudaKernelsTest.AttentionOnTensorCoresCompilesToMmaWithoutSpills (90 ms)
[ RUN      ] GlobalAndDsaAttention/CudaTinyPlanTest.PreparesAndCompiles/0
[       OK ] GlobalAndDsaAttention/CudaTinyPlanTest.PreparesAndCompiles/0 (50 ms)
[ RUN      ] GlobalAndDsaAttention/CudaTinyPlanTest.PreparesAndCompiles/1
[       OK ] GlobalAndDsaAttention/CudaTinyPlanTest.PreparesAndCompiles/1 (60 ms)
[==========] 4 tests from 2 test suites ran. (1000 ms total)
[  PASSED  ] 4 tests.
"""

# The fakes read $FAKE_SCENARIO (JSON): "gtest_gpu_skip": a GPU test skips;
# "sleep": {"BACKEND PLAN STEPS": s}; "fail": ["BACKEND PLAN", "dsa-bench", ...];
# "miss": [plans whose modules miss the cache]; "nvrtc": NVRTC's version;
# "sanitizer_errors": ["TOOL PLAN"].
FAKE_EXEC = r'''
import json, os, shutil, sys, time
args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default
scenario = json.loads(os.environ.get("FAKE_SCENARIO", "{}"))
plan_path = opt("--plan")
plan = os.path.basename(plan_path)[:-len(".json")]
bundle = os.path.dirname(os.path.dirname(plan_path))
arch = opt("--precompile-kernels")
if arch:
    for module in ("megaslide_dense.cu", plan + "_dsa.cu"):
        print("%s: 1000 B cubin in 0.01 s%s" % (
            module, "" if plan in scenario.get("miss", []) else " (cached)"))
    print("2 modules for %s in %s (NVRTC %s)" % (
        arch, os.environ["MEGASLIDE_KERNEL_CACHE"],
        scenario.get("nvrtc", "13.0")))
    sys.exit(0)
backend = opt("--backend")
key = backend + " " + plan
steps = int(opt("--steps"))
time.sleep(scenario.get("sleep", {}).get("%s %d" % (key, steps), 0))
if key in scenario.get("fail", []):
    sys.exit("fake failure of " + key)
if backend == "cuda":
    print("megaslide: cuda backend: pinned %d bytes of host memory in "
          "1.000 s (0 bytes kept from the previous backend)" % (4 << 30),
          file=sys.stderr)
reference = os.path.join(bundle, "reference", plan)
if opt("--metrics"):
    if os.path.exists(reference + ".losses.jsonl"):
        lines = open(reference + ".losses.jsonl").readlines()[:steps]
    else:
        lines = [json.dumps({"step": i + 1, "loss": 1.0, "seconds": 0.1})
                 + "\n" for i in range(steps)]
    open(opt("--metrics"), "w").writelines(lines)
if opt("--save-gradients"):
    shutil.copy(reference + ".gradients.safetensors",
                opt("--save-gradients"))
if opt("--trace"):
    scale = 2.0 if backend == "cuda" else 1.0
    events, t = [], 0.0
    for _ in range(steps):
        for inst, (name, dur) in enumerate([("linear", 10.0),
                                            ("attention", 30.0)]):
            events.append({"name": name, "ph": "X", "pid": 1, "tid": 1,
                           "ts": t, "dur": dur * scale,
                           "args": {"instruction": inst}})
            t += dur * scale
    json.dump({"traceEvents": events}, open(opt("--trace"), "w"))
'''

FAKE_TESTS = r'''
import json, os, sys
scenario = json.loads(os.environ.get("FAKE_SCENARIO", "{}"))
flt = [a for a in sys.argv[1:] if a.startswith("--gtest_filter=")][0]
flt = flt[len("--gtest_filter="):]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(flt + "\n")
texts = json.loads(os.environ["FAKE_GTEST"])
if "Gpu" in flt:
    skip = scenario.get("gtest_gpu_skip")
    print(texts["gpu"].format(
        filter=flt, handbuilt=texts["skipped" if skip else "ok"],
        passed=4 if skip else 5, skipped=3 if skip else 2,
        listed="[  SKIPPED ] CudaBackendGpuTest.HandBuiltPlanMatchesCpuBackend"
        if skip else ""))
else:
    print(texts["compile"].format(filter=flt))
'''

FAKE_SANITIZER = r'''
import json, os, subprocess, sys
scenario = json.loads(os.environ.get("FAKE_SCENARIO", "{}"))
args = sys.argv[1:]
tool = args[args.index("--tool") + 1]
cmd = args[args.index("--error-exitcode") + 2:]
plan = os.path.basename(cmd[cmd.index("--plan") + 1])[:-len(".json")]
rc = subprocess.call(cmd)
errors = 2 if tool + " " + plan in scenario.get("sanitizer_errors", []) else 0
print("========= COMPUTE-SANITIZER")
if tool == "racecheck":
    print("========= RACECHECK SUMMARY: %d hazards displayed (%d errors, 0 "
          "warnings)" % (errors, errors))
else:
    print("========= ERROR SUMMARY: %d errors" % errors)
sys.exit(9 if errors else rc)
'''

FAKE_DSA = r'''
import json, os, sys
scenario = json.loads(os.environ.get("FAKE_SCENARIO", "{}"))
args = sys.argv[1:]
out = args[args.index("--json") + 1] if "--json" in args else None
if "--self-test" in args:
    print("self-test passed")
    sys.exit(0)
bench = "--bench" in args
if bench:
    report = {"timings": [{"name": "dsa_105b", "ms": {"forward": 2.0,
              "forward_backward": 7.0}, "flex": {"ratio_forward": 0.5,
              "ratio_forward_backward": 0.7}}]}
else:
    report = {"configs": [{"name": "dsa_small", "ok": True, "checks": {
        "out": {"max_err": 1e-3, "atol": 1e-2, "ok": True}}}], "ok": True}
if out:
    json.dump(report, open(out, "w"))
failed = ("dsa-bench" if bench else "dsa") in scenario.get("fail", [])
print("FAIL" if failed else "ok")
sys.exit(1 if failed else 0)
'''

FAKE_PROCESSOR = r'''
import json, os, sys
scenario = json.loads(os.environ.get("FAKE_SCENARIO", "{}"))
args = sys.argv[1:]
json.dump({"timing": {"dsa_ms": 1.0, "sdpa_ms": 3.0,
                      "ratio_sdpa_over_dsa": 3.0}},
          open(args[args.index("--json") + 1], "w"))
sys.exit(1 if "dsa-processor" in scenario.get("fail", []) else 0)
'''


def write_tool(path, body):
    path.write_text("#!%s\n%s" % (sys.executable, body))
    path.chmod(0o755)


@pytest.fixture
def fake_gpu(tmp_path):
    """A copy of the repository's device-check.sh beside the real
    comparison scripts and fake GPU ones, a fake bundle, and fakes of
    nvidia-smi and compute-sanitizer on PATH. Returns run(scenario,
    seconds) -> (exit status, summary text, output folder)."""
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    for name in ("device-check.sh", "compare_steps.py",
                 "compare_trace_sim.py"):
        (root / "scripts" / name).write_bytes((SCRIPTS / name).read_bytes())
    write_tool(root / "scripts" / "dsa_gpu_check.py", FAKE_DSA)
    write_tool(root / "scripts" / "dsa_processor_gpu_check.py",
               FAKE_PROCESSOR)
    bundle = tmp_path / "bundle"
    for d in ("bin", "lib", "plans", "reference", "kernel-cache",
              "dsa-kernels"):
        (bundle / d).mkdir(parents=True)
    write_tool(bundle / "bin" / "megaslide-exec", FAKE_EXEC)
    write_tool(bundle / "bin" / "megaslide-runtime-tests", FAKE_TESTS)
    (bundle / "kernel-cache" / "0123456789abcdef.mskc").write_bytes(b"")
    for plan in BUNDLE_PLANS:
        (bundle / "plans" / (plan + ".json")).write_text("{}")
    losses = [2.77 - 0.05 * i for i in range(20)]
    for plan in ("tiny", "tiny-dsa"):
        write_metrics(bundle / "reference" / (plan + ".losses.jsonl"),
                      losses)
        write_metrics(bundle / "reference" / (plan + ".step1.jsonl"),
                      losses[:1])
        write_safetensors(bundle / "reference" /
                          (plan + ".gradients.safetensors"),
                          {n: ("F32", a) for n, a in gradients().items()})
    (bundle / "manifest.json").write_text(json.dumps(
        {"commit": "fake", "nvrtc_version": "13.0", "kernel_arch": "sm_90a"},
        indent=2))
    path = tmp_path / "path"
    path.mkdir()
    (path / "python3").symlink_to(sys.executable)
    (path / "nvidia-smi").write_text(
        "#!/bin/sh\ncase $1 in -L) echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)';;"
        " *) echo 'NVIDIA H200, 570.00, 143771 MiB';; esac\n")
    (path / "nvidia-smi").chmod(0o755)
    write_tool(path / "compute-sanitizer", FAKE_SANITIZER)
    # The machine probe's torch: absent, so that the probe is quick.
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text(
        "raise ImportError('no torch on the fake machine')\n")
    log = tmp_path / "gtest-filters.txt"

    def run(scenario=None, seconds=None):
        out = tmp_path / "out"
        env = dict(os.environ, OUT=str(out), FAKE_LOG=str(log),
                   FAKE_SCENARIO=json.dumps(scenario or {}),
                   FAKE_GTEST=json.dumps({"gpu": GTEST_WITH_DEVICE,
                                          "compile": GTEST_COMPILE,
                                          "ok": HANDBUILT_OK,
                                          "skipped": HANDBUILT_SKIPPED}),
                   PATH=str(path) + os.pathsep + os.environ["PATH"],
                   PYTHONPATH=str(tmp_path / "site"))
        env.pop("DEVICE_CHECK_SECONDS", None)
        if seconds is not None:
            env["DEVICE_CHECK_SECONDS"] = str(seconds)
        r = subprocess.run(["bash", str(root / "scripts" / "device-check.sh"),
                            str(bundle)], env=env, capture_output=True,
                           text=True, timeout=300)
        summary = (out / "1-summary.txt").read_text()
        return r.returncode, summary, out

    run.filters = log
    return run


def step_line(summary, name):
    return next((line.strip() for line in summary.splitlines()
                 if line.strip().startswith(name + ":")), None)


def test_device_check_passes_on_a_gpu_where_no_device_tests_skip(fake_gpu):
    """With a device, tests outside the GPU suites that skip (even one
    named ...Gpu...) do not fail the check; the GPU suites ran; every
    figure is in the summary."""
    rc, summary, out = fake_gpu()
    assert rc == 0, summary
    assert "== device check: passed" in summary
    assert "GPU tests SKIPPED" not in summary
    assert "skipped where a device exists, as they should: " \
        "CudaApiTest.NoDeviceGivesAClearError " \
        "CudaBackendTest.CreateWithoutGpuSaysWhy" in summary
    figures = summary[summary.index("== figures"):]
    def figure(label):
        return next((line[25:] for line in figures.splitlines()
                     if line[:25].strip() == label), None)
    assert figure("GPU").startswith("NVIDIA H200")
    assert figure("kernel cache").startswith("10 of 10 modules hit (NVRTC "
                                             "13.0")
    assert figure("gtest GPU") == "5 passed, 0 failed, 2 skipped (3 in the " \
        "GPU suites)"
    assert figure("gtest compile") == "4 passed, 0 failed, 0 skipped"
    for plan in ("tiny", "tiny-dsa"):
        assert figure("cpu " + plan) == "bit-identical to the reference"
        assert figure("parity " + plan) == "losses max rel 0.00e+00 over 20 " \
            "steps; gradients max err/scale 0.00e+00 over 3 tensors: ok"
        assert figure("sanitizer " + plan) == "memcheck 0 errors; racecheck " \
            "0 hazards (0 errors, 0 warnings); synccheck 0 errors"
    assert figure("dsa kernels") == "dsa_small ok (max err 0.10 of tol)"
    for plan in BUNDLE_PLANS[2:]:
        assert figure("pinning " + plan) == "4.00 GiB in 1.00 s (4.0 GiB/s)"
        assert figure("calibration " + plan).endswith(
            "= 2.00; attention 2.00, linear 2.00")
    assert figure("bench dsa_105b") == "forward 2.000 ms, forward_backward " \
        "7.000 ms; FlexAttention/ours fwd 2.00, fwd+bwd 1.43"
    assert figure("bench processor") == "1.00 ms, SDPA 3.00 ms " \
        "(SDPA/processor 3.00)"
    assert len(figures.splitlines()) <= 30
    # The GPU tests, then the compile-everything tests in a step of their own.
    filters = fake_gpu.filters.read_text().split()
    assert len(filters) == 2 and "CudaKernelsTest" not in filters[0]
    assert "CudaKernelsTest.*" in filters[1].split(":")


def test_device_check_required_failures_fail_it(fake_gpu):
    """Each a failure of the check: a skip in a GPU suite, a cache miss with
    the bundle's NVRTC, a sanitizer error, the 3D-DSA check failing, a
    required step past its own time limit."""
    rc, summary, _ = fake_gpu({"gtest_gpu_skip": True, "miss": ["wan-1block"],
                               "sanitizer_errors": ["racecheck tiny-dsa"],
                               "fail": ["dsa"],
                               "sleep": {"cuda tiny-dsa 20": 60}})
    assert rc == 1, summary
    assert "GPU tests SKIPPED on the GPU machine, a failure: " \
        "CudaBackendGpuTest.HandBuiltPlanMatchesCpuBackend" in summary
    assert "NVRTC 13.0, as in the bundle: 8 of 10 modules cached" in summary
    assert "kernel cache: 2 misses with the bundle's NVRTC" in summary
    # Its time is the machine's (1 s under load): not part of the check.
    assert re.fullmatch(r"sanitizer-racecheck-tiny-dsa: FAILED \(exit 9\) "
                        r"in \d+ s",
                        step_line(summary, "sanitizer-racecheck-tiny-dsa"))
    assert "sanitizer tiny-dsa       memcheck 0 errors; racecheck FAILED 2 " \
        "hazards (2 errors, 0 warnings); synccheck 0 errors" in summary
    assert step_line(summary, "dsa").startswith("dsa: FAILED (exit 1)")
    assert step_line(summary, "cuda-tiny-dsa") == \
        "cuda-tiny-dsa: TIMED OUT at its limit of 20 s"
    assert "== device check: FAILED" in summary


def test_device_check_deadline_skips_and_cuts_but_does_not_fail(fake_gpu):
    """A step stopped by the deadline is cut short, the steps after it are
    skipped for time: the verdict is incomplete (3), not failed."""
    rc, summary, _ = fake_gpu({"sleep": {"cuda tiny 20": 60}}, seconds=14)
    assert rc == 3, summary
    assert "FAILED" not in summary and "TIMED OUT" not in summary
    line = step_line(summary, "cuda-tiny")
    assert line.startswith("cuda-tiny: cut short by the deadline after") or \
        line.startswith("cuda-tiny: skipped: needs 8 s,"), line
    assert step_line(summary, "sanitizer-memcheck-tiny").startswith(
        "sanitizer-memcheck-tiny: skipped: needs 8 s, ")
    assert step_line(summary, "sim-dit-xl-2-256").startswith(
        "sim-dit-xl-2-256: skipped: needs 3 s, ")
    verdict = summary.splitlines()[-1]
    assert verdict.startswith("== device check: INCOMPLETE (") and \
        " cuda-tiny " in verdict, verdict
    assert "gtest compile            not run to the end" in summary


def test_device_check_optional_failures_and_another_nvrtc_pass(fake_gpu):
    """Benchmarks and calibration failing never fail the check; with
    another NVRTC than the bundle's, cache misses are expected and only
    reported."""
    rc, summary, _ = fake_gpu({"fail": ["dsa-bench", "dsa-processor",
                                        "cuda wan-1block", "sim 105b-1block"],
                               "miss": BUNDLE_PLANS, "nvrtc": "13.1"})
    assert rc == 0, summary
    assert step_line(summary, "dsa-bench").startswith(
        "dsa-bench: FAILED (exit 1)")
    assert "(optional: does not fail the check)" in step_line(
        summary, "cuda-wan-1block")
    assert "kernel cache             0 of 10 modules hit (NVRTC 13.1 here, " \
        "13.0 in the bundle: misses expected)" in summary
    assert "== device check: passed" in summary

