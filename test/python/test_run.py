"""End-to-end runs of megaslide-run and megaslide.Trainer on the cpu backend.

The tiny preset trains on the built-in synthetic flow-matching task; these
tests check the acceptance criteria of the runtime: the loss falls to at
most half its first value in 200 steps, planned and measured device peaks
are equal, and a resumed run continues bit-exactly.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import megaslide
from conftest import tool_path


def run(*args, check=True):
    result = subprocess.run([tool_path("megaslide-run"), "--no-progress",
                             *map(str, args)],
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(result.stdout + result.stderr)
    return result


def losses(path):
    # %.9g round-trips float32 exactly, so equal text means equal bits.
    return [json.loads(line)["loss"] for line in open(path)]


def test_tiny_losses_are_bit_identical_at_any_thread_count(tmp_path):
    """The cpu backend splits work into tiles whose summation order does not
    depend on the threads that run them (docs/Runtime.md): the README's
    200-step tiny run (bf16 compute, warmup-cosine, clipping) gives the same
    losses and gradient norms, bit for bit, on 1, 2 and 4 threads."""
    seen = {}
    for threads in (1, 2, 4):
        metrics = tmp_path / f"m{threads}.jsonl"
        result = subprocess.run(
            [tool_path("megaslide-run"), "--no-progress", "--model", "tiny",
             "--steps", "200", "--lr-schedule", "warmup-cosine",
             "--warmup-steps", "20", "--max-grad-norm", "1.0", "--metrics",
             str(metrics)], capture_output=True, text=True,
            env=dict(os.environ, MEGASLIDE_NUM_THREADS=str(threads)))
        assert result.returncode == 0, result.stdout + result.stderr
        records = [json.loads(line) for line in open(metrics)]
        seen[threads] = [(r["loss"], r["grad_norm"]) for r in records]
    assert len(seen[1]) == 200
    assert seen[2] == seen[1] and seen[4] == seen[1]


def test_tiny_trains_and_peaks_match(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = run("--model", "tiny", "--steps", 200, "--metrics", metrics).stdout
    loss = losses(metrics)
    assert len(loss) == 200
    assert loss[-1] <= 0.5 * loss[0], (loss[0], loss[-1])
    # Not a lucky last step: the last 20 steps average well below the first.
    assert np.mean(loss[-20:]) <= 0.5 * loss[0]
    line = next(l for l in out.splitlines() if l.startswith("device memory"))
    numbers = [int(w) for w in line.replace(",", "").replace(";", "").split()
               if w.isdigit()]
    planned_peak, measured_peak, planned_live, measured_live = numbers
    assert planned_peak == measured_peak and planned_live == measured_live


def test_resume_is_bit_exact(tmp_path):
    small = ("--model", "tiny", "--frames", 5, "--height", 32, "--width", 32)
    run(*small, "--steps", 6, "--metrics", tmp_path / "full.jsonl")
    ck = tmp_path / "ck"
    run(*small, "--steps", 3, "--checkpoint-dir", ck, "--metrics",
        tmp_path / "a.jsonl")
    run(*small, "--steps", 3, "--checkpoint-dir", ck, "--resume", "--metrics",
        tmp_path / "b.jsonl")
    assert (losses(tmp_path / "a.jsonl") + losses(tmp_path / "b.jsonl") ==
            losses(tmp_path / "full.jsonl"))


def test_corrupt_checkpoint_keeps_previous_usable(tmp_path):
    small = ("--model", "tiny", "--frames", 5, "--height", 32, "--width", 32)
    ck = tmp_path / "ck"
    run(*small, "--steps", 2, "--checkpoint-dir", ck, "--checkpoint-every", 1)
    latest = ck / (ck / "latest").read_text().strip() / "state.safetensors"
    data = bytearray(latest.read_bytes())
    data[-5] ^= 0xFF
    latest.write_bytes(bytes(data))
    bad = run(*small, "--steps", 1, "--checkpoint-dir", ck, "--resume",
              check=False)
    assert bad.returncode != 0
    assert "corrupt" in bad.stderr and "step-000001" in bad.stderr


def test_trainer_matches_cli_and_reports_memory():
    tr = megaslide.Trainer("tiny", frames=5, height=32, width=32)
    shapes = tr.input_shapes()
    assert shapes["latents"] == (1, 16, 2, 4, 4)
    first = tr.step()
    assert first["step"] == 1 and np.isfinite(first["loss"])
    assert first["planned_peak_bytes"] == first["measured_peak_bytes"]
    assert first["planned_live_bytes"] == first["measured_live_bytes"]
    params = tr.parameters()
    assert len(params) == 69 and all(p.dtype == np.float32
                                     for p in params.values())


def test_trainer_gradients_do_not_update():
    tr = megaslide.Trainer("tiny", frames=5, height=32, width=32,
                           precision="f32")
    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal(v).astype(np.float32)
             for k, v in tr.input_shapes().items()}
    batch["timesteps"] = np.array([0.5], np.float32)
    before = tr.parameters()
    loss1, grads = tr.gradients(**batch)
    loss2, _ = tr.gradients(**batch)
    assert loss1 == loss2 and tr.step_count == 0
    assert set(grads) == set(before) and all(
        np.array_equal(before[k], v) for k, v in tr.parameters().items())


def test_trainer_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        megaslide.Trainer("tiny", backend="tpu")
    tr = megaslide.Trainer("tiny", frames=5, height=32, width=32)
    with pytest.raises(ValueError, match="has shape"):
        tr.load_parameters({"proj_out.bias": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="no parameter"):
        tr.load_parameters({"nope": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="missing step input"):
        tr.step(latents=np.zeros(tr.input_shapes()["latents"], np.float32))


def test_exec_plan_is_documented_json():
    # update=auto defers on this host: version 3 (docs/ExecutionPlan.md);
    # the streaming plan is version 2.
    plan = json.loads(megaslide.exec_plan("tiny", 5, 32, 32))
    assert plan["format"] == "megaslide-exec-plan" and plan["version"] == 3
    streaming = json.loads(
        megaslide.exec_plan("tiny", 5, 32, 32, update="streaming"))
    assert streaming["version"] == 2
    assert plan["runtime_version"] == megaslide.__version__
    assert plan["arena_bytes"] > 0 and plan["instructions"]
    # The arena's budget, checked when planning: gpu_mem less gpu_reserve.
    assert plan["arena_budget_bytes"] == 141_000_000_000 - 2 * 2**30
    small = json.loads(megaslide.exec_plan("tiny", 5, 32, 32, gpu_mem="1GB",
                                           gpu_reserve="0"))
    assert small["arena_budget_bytes"] == 1_000_000_000
    ops = {i["op"] for i in plan["instructions"]}
    assert {"fetch", "h2d", "d2h", "host_adamw", "record", "wait",
            "linear", "flow_matching_loss"} <= ops


def test_report_of_a_run_with_warmup_cosine_and_clipping(tmp_path):
    """megaslide-run --report: the page holds every step's loss, lr and
    gradient norm, and the clipping threshold (docs/Training.md)."""
    from test_training_report import PlotParser
    page = tmp_path / "run.html"
    run("--model", "tiny", "--frames", 9, "--height", 64, "--width", 64,
        "--steps", 12, "--lr-schedule", "warmup-cosine", "--warmup-steps", 3,
        "--max-grad-norm", "1.0", "--report", page, "--metrics",
        tmp_path / "m.jsonl")
    parser = PlotParser()
    parser.feed(page.read_text())
    series = {plot: len(points)
              for (plot, _), points in parser.polylines.items()}
    for plot in ("loss", "lr", "grad_norm"):
        assert series.get(plot) == 12, (plot, sorted(parser.polylines))
    assert 'class="threshold"' in page.read_text()


def test_each_cpu_isa_trains_alike(tmp_path):
    """MEGASLIDE_CPU_ISA forces the cpu kernels' (and oneDNN's) instruction
    set: the variants may differ in the last bits (FMA; cpu/Isa.h) but not
    more, and the report names the one a run used. Levels above this CPU's
    are capped to it, so the test runs everywhere."""
    seen = {}
    for isa in ("generic", "avx2", "avx512"):
        metrics, report = tmp_path / f"{isa}.jsonl", tmp_path / f"{isa}.html"
        result = subprocess.run(
            [tool_path("megaslide-run"), "--no-progress", "--model", "tiny",
             "--steps", "10", "--metrics", str(metrics), "--report",
             str(report)], capture_output=True, text=True,
            env=dict(os.environ, MEGASLIDE_CPU_ISA=isa))
        assert result.returncode == 0, result.stdout + result.stderr
        seen[isa] = losses(metrics)
        assert len(seen[isa]) == 10 and np.all(np.isfinite(seen[isa]))
        if isa == "generic":
            assert "<th>cpu_isa</th><td>generic (GEMM sse41)" in \
                report.read_text()
    for isa in ("avx2", "avx512"):
        np.testing.assert_allclose(seen[isa], seen["generic"], rtol=1e-3)


def test_a_bad_cpu_isa_is_an_error():
    env = dict(os.environ, MEGASLIDE_CPU_ISA="avx3")
    result = subprocess.run(
        [tool_path("megaslide-run"), "--no-progress", "--model", "tiny",
         "--steps", "1"], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "MEGASLIDE_CPU_ISA is 'avx3'; use generic, avx2 or avx512" in \
        result.stderr
    result = subprocess.run([sys.executable, "-c", "import megaslide"],
                            capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "MEGASLIDE_CPU_ISA is 'avx3'" in result.stderr


@pytest.mark.parametrize("value", ["0", "-2", "two", "4x", "99999999999999999999"])
def test_a_bad_thread_count_is_an_error(value):
    env = dict(os.environ, MEGASLIDE_NUM_THREADS=value)
    result = subprocess.run(
        [tool_path("megaslide-run"), "--no-progress", "--model", "tiny",
         "--steps", "1"], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert f"MEGASLIDE_NUM_THREADS is '{value}'; use a whole number" in \
        result.stderr
    result = subprocess.run([sys.executable, "-c", "import megaslide"],
                            capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert f"MEGASLIDE_NUM_THREADS is '{value}'" in result.stderr


def test_weights_of_another_architecture_are_refused(tmp_path):
    """2 heads of 32 and 4 heads of 16 have the same tensor shapes but not
    the same model: the weights' config.json is checked against the plan's
    model, by megaslide-run and by Trainer.load_weights, before anything
    loads; weights of the same model still load."""
    config = json.load(open(os.path.join(os.path.dirname(__file__), "..",
                                         "..", "configs", "tiny.json")))
    config.update(name="tiny-2x32", num_attention_heads=2,
                  attention_head_dim=32)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(config))
    video = ["--frames", "5", "--height", "32", "--width", "32"]
    run("--model", other, "--backend", "cpu", "--steps", "1", *video,
        "--save-weights", tmp_path / "other-weights")
    r = run("--model", "tiny", "--backend", "cpu", "--steps", "1", *video,
            "--weights", tmp_path / "other-weights", check=False)
    assert r.returncode != 0
    assert "are of another model" in r.stderr, r.stderr
    assert "num_attention_heads: weights 2, model 4" in r.stderr
    assert "attention_head_dim: weights 32, model 16" in r.stderr
    trainer = megaslide.Trainer("tiny", 5, 32, 32, backend="cpu")
    with pytest.raises(Exception, match="num_attention_heads: weights 2"):
        trainer.load_weights(str(tmp_path / "other-weights"))
    run("--model", "tiny", "--backend", "cpu", "--steps", "1", *video,
        "--save-weights", tmp_path / "same")
    trainer.load_weights(str(tmp_path / "same"))
