"""Wan 2.2's two experts in one run (docs/Training.md, "Two experts in one
run"): megaslide-run --boundary on tiny (cpu), its metrics, checkpoints
holding both experts and resuming bit for bit, the refusals of a resume
across one and two experts or boundaries, the pipeline layout of
--save-weights loading in diffusers, and the planner counting both host
states.
"""

import json
import pathlib
import re
import subprocess

import pytest

from conftest import tool_path

safetensors = pytest.importorskip("safetensors.numpy")

COMMON = ["--model", "tiny", "--backend", "cpu", "--frames", "5",
          "--height", "32", "--width", "32", "--no-progress",
          "--ema-decay", "0.9", "--grad-accum", "2", "--update", "deferred"]
# The median of uniform times: both experts step within a few steps.
BOUNDARY = ["--boundary", "0.5"]


def run(args, check=True):
    r = subprocess.run([tool_path("megaslide-run"), *COMMON, *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def files(folder):
    return {p.relative_to(folder): p.read_bytes()
            for p in pathlib.Path(folder).rglob("*") if p.is_file()}


def metrics(path):
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    for m in lines:  # measured, not computed
        for k in ("seconds", "samples_per_second", "tokens_per_second",
                  "host_rss_bytes"):
            m.pop(k, None)
    return lines


def latest(ck):
    step = (ck / "latest").read_text().strip()
    return ck / step


def test_two_experts_train_checkpoint_and_resume_bit_for_bit(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    run([*BOUNDARY, "--steps", "8", "--checkpoint-dir", full / "ck",
         "--metrics", full / "m.jsonl", "--save-weights", full / "w"])
    m = metrics(full / "m.jsonl")
    assert [r["step"] for r in m] == list(range(1, 9))
    experts = [r["expert"] for r in m]
    assert set(experts) == {"high", "low"}, experts
    assert all(r["loss"] == r["loss"] and abs(r["loss"]) < 1e3 for r in m)
    # Interrupted after 3 steps (a checkpoint), resumed to 8.
    run([*BOUNDARY, "--steps", "3", "--checkpoint-dir", split / "ck",
         "--metrics", split / "m.jsonl"])
    r = run([*BOUNDARY, "--steps", "5", "--resume", "--checkpoint-dir",
             split / "ck", "--metrics", split / "m.jsonl", "--save-weights",
             split / "w"])
    assert "resumed at step 3" in r.stdout, r.stdout
    assert metrics(split / "m.jsonl") == m
    a, b = latest(full / "ck"), latest(split / "ck")
    assert a.name == b.name == "step-000008"
    assert (a / "state.safetensors").read_bytes() == \
        (b / "state.safetensors").read_bytes()
    assert files(full / "w") == files(split / "w")
    # The checkpoint holds both experts' masters, moments and EMA, each
    # expert's optimizer steps its own.
    state = safetensors.load_file(str(a / "state.safetensors"))
    names = {n for n in state if not n.startswith("transformer_2.")}
    assert {f"transformer_2.{n}" for n in names} == set(state) - names
    assert any(n.endswith(".ema") for n in names)
    trainer = json.loads(json.loads((a / "trainer.json").read_text())
                         ["trainer_state"])
    steps = [e["step"] for e in trainer["experts"]]
    assert steps == [experts.count("high"), experts.count("low")]
    assert trainer["step"] == 8 and trainer["settings"]["experts"] == \
        "2, boundary 0.5"


def test_a_resume_across_one_and_two_experts_is_refused(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    run([*BOUNDARY, "--steps", "2", "--checkpoint-dir", two])
    run(["--steps", "2", "--checkpoint-dir", one])
    cases = [
        (two, [], "experts: 2, boundary 0.5 in the checkpoint, 1 now"),
        (two, ["--boundary", "0.9"],
         "experts: 2, boundary 0.5 in the checkpoint, 2, boundary 0.9 now"),
        (one, BOUNDARY, "experts: 1 in the checkpoint, 2, boundary 0.5 now"),
    ]
    for ck, flags, message in cases:
        before = files(ck)
        r = run([*flags, "--steps", "4", "--resume", "--checkpoint-dir", ck],
                check=False)
        assert r.returncode != 0
        assert message in r.stderr, r.stderr
        assert "step 3" not in r.stdout
        assert files(ck) == before


def test_boundary_with_a_timestep_range_is_refused(tmp_path):
    r = run([*BOUNDARY, "--min-timestep", "0.5", "--steps", "1"],
            check=False)
    assert r.returncode != 0
    assert "--boundary trains both experts" in r.stderr, r.stderr
    r = run(["--boundary", "1.5", "--steps", "1"], check=False)
    assert "--boundary must be in (0, 1), got 1.5" in r.stderr, r.stderr


def test_saved_experts_load_in_diffusers_as_a_pipelines_transformers(
        tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    run([*BOUNDARY, "--steps", "6", "--checkpoint-dir", tmp_path / "ck",
         "--save-weights", tmp_path / "w"])
    state = safetensors.load_file(
        str(latest(tmp_path / "ck") / "state.safetensors"))
    loaded = {}
    for folder, prefix in (("transformer", ""),
                           ("transformer_2", "transformer_2.")):
        model = diffusers.WanTransformer3DModel.from_pretrained(
            str(tmp_path / "w" / folder), torch_dtype=torch.float32)
        loaded[folder] = model.state_dict()
        for name, value in loaded[folder].items():
            assert torch.equal(value, torch.from_numpy(state[prefix + name])), \
                (folder, name)
    # Two experts trained apart: their weights differ.
    assert any(not torch.equal(v, loaded["transformer_2"][n])
               for n, v in loaded["transformer"].items())
    # And back: --weights takes the pipeline folder, one expert per folder.
    r = run([*BOUNDARY, "--steps", "0", "--weights", tmp_path / "w",
             "--save-weights", tmp_path / "again"])
    assert files(tmp_path / "again") == files(tmp_path / "w")


def host_memory(text):
    """The host-memory report's parts, in bytes, by name."""
    parts = {}
    block = text.split("\nHost memory: ")[1].split("\n\n")[0]
    for line in block.splitlines()[1:]:
        m = re.match(r"\s+(.+?)\s+([\d.]+) (B|kB|MB|GB|TB)\b", line)
        scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
        parts[m.group(1)] = float(m.group(2)) * scale[m.group(3)]
    return parts


def test_the_planner_counts_both_experts_host_states(megaslide_plan):
    video = ["--model", "wan2.2-t2v-a14b", "--frames", "81", "--height",
             "720", "--width", "1280", "--gpu-mem", "80GB"]

    def plan(*flags):
        return subprocess.run([megaslide_plan, *video, *flags],
                              capture_output=True, text=True, timeout=300)

    one, two = plan("--host-mem", "512GB"), plan("--host-mem", "512GB",
                                                  "--boundary", "0.875")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    a, b = host_memory(one.stdout), host_memory(two.stdout)
    assert "second expert's state" not in a
    own = a["fp32 master weights"] + a["AdamW moments"]
    assert b["second expert's state"] == pytest.approx(own, rel=1e-3)
    assert {k: v for k, v in b.items() if k != "second expert's state"} == a
    # 350 GB (21.88 GB of it the OS allowance) holds one expert's state
    # and not two.
    assert plan("--host-mem", "350GB").returncode == 0
    r = plan("--host-mem", "350GB", "--boundary", "0.875")
    assert r.returncode != 0
    assert "host memory plan needs" in r.stderr, r.stderr
    assert "second expert's state" in host_memory(r.stdout)
    # bf16 moments narrow both experts' states: they fit again.
    assert plan("--host-mem", "350GB", "--boundary", "0.875",
                "--host-state-policy", "bf16-moments").returncode == 0
