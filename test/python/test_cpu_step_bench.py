"""benchmarks/cpu_step.py compares the same computation on both sides.

The benchmark times megaslide's cpu training step against torch eager
(diffusers' WanTransformer3DModel on the weights the Trainer saved) and
refuses to print a time unless the two sides' losses agree over its check
steps: the first step's (same weights and inputs), then those after AdamW
updates (same optimizer). These tests run its setup on the tiny preset
with one timed round and show that the check passes as it stands and
stops the benchmark when one side is broken on purpose: a weight of
torch's copy scaled by 1.01 (the first loss moves by 1e-4, ten times
the tolerance), or torch's
learning rate doubled (the first loss agrees, the second does not). No
timing thresholds. Skipped without torch and diffusers (the benchmark's
requirements, benchmarks/requirements-bench.txt).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

import megaslide  # noqa: E402

SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = SOURCE_ROOT / "benchmarks" / "cpu_step.py"
# One round of tiny, no breakdown and no 3D-DSA: the setup and the check.
QUICK = ["--configs", "tiny", "--repeat", "1", "--min-seconds", "0",
         "--check-steps", "2", "--breakdown-steps", "0", "--dsa-grids", "",
         "--threads", "2"]


def start_bench(directory, *extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # The megaslide this suite imports, wherever it comes from.
    package_parent = str(pathlib.Path(megaslide.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        [package_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *QUICK, "--json",
         str(directory / "out.json"), "--build-dir", str(directory), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc):
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                       stderr)


def run_bench(tmp_path, *extra):
    return finish(start_bench(tmp_path, *extra))


def test_losses_agree_and_the_report_is_complete(tmp_path):
    r = run_bench(tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    report = json.loads((tmp_path / "out.json").read_text())
    (tiny,) = report["configs"]
    assert tiny["config"] == "tiny"
    assert [c["step"] for c in tiny["check"]] == [1, 2]
    for c in tiny["check"]:
        assert c["relative"] <= c["rtol"], c
    # The second loss is after an update: it must differ from the first.
    assert tiny["check"][1]["megaslide"] != tiny["check"][0]["megaslide"]
    assert tiny["hyper"]["lr"] == 2e-3  # configs/tiny.json
    for side in ("megaslide", "torch"):
        assert len(tiny["seconds"][side]) == 1
        assert tiny["median"][side] > 0
        rss = tiny["rss_mib"][side]
        assert rss["peak"] >= rss["after_imports"] > 0
    assert report["threads"] == 2
    assert set(report["cpu_flags"]) >= {"avx2", "fma", "avx512f"}
    assert report["torch_cpu_capability"]
    assert "ms/torch" in r.stdout


def test_a_broken_side_fails_the_check(tmp_path):
    # Both broken runs at once: each is mostly imports on one core.
    weight, lr = tmp_path / "weight", tmp_path / "lr"
    weight.mkdir()
    lr.mkdir()
    runs = [start_bench(weight, "--perturb-weight",
                        "blocks.0.ffn.net.0.proj.weight"),
            start_bench(lr, "--torch-lr-scale", "2")]
    perturbed, wrong_lr = (finish(p) for p in runs)

    # A weight scaled by 1.01 in torch's copy: the first loss moves.
    assert perturbed.returncode == 1, perturbed.stdout
    assert "the losses of step 1 differ" in perturbed.stderr
    assert "no time is compared" in perturbed.stderr
    assert not (weight / "out.json").exists()

    # Twice the learning rate: the first loss still agrees, the one after
    # the first update does not.
    assert wrong_lr.returncode == 1, wrong_lr.stdout
    assert "check step 1" in wrong_lr.stdout
    assert "the losses of step 2 differ" in wrong_lr.stderr
    assert not (lr / "out.json").exists()
