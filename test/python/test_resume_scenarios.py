"""Three kill-and-resume scenarios of scripts/resume-scenarios.py.

The script's 30 scenarios (docs/Testing.md, "Fault injection") take a
few minutes; these three cover the most between them: buckets with
validation, accumulation, a cosine schedule, clipping, a bf16 EMA exported
with --save-ema, f32 and --max-steps; streaming clipping, which resumes
from the previous step's norm; validation over one shape of files with
--steps. Each run is interrupted (kill -9, SIGINT or SIGTERM, as the seed
chooses), resumed until done, and compared bit for bit with an
uninterrupted one. A last test shows that the comparison names what
differs.
"""

import importlib.util
import json
import pathlib
import shutil
import struct

import pytest

from conftest import tool_path

pytest.importorskip("safetensors")

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "resume_scenarios", ROOT / "scripts" / "resume-scenarios.py")
rs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rs)

# Its first interruptions: kill -9 in buckets-everything, SIGINT in
# streaming-clip, SIGTERM in data-val (their timing is the machine's).
SEED = 7


def tools():
    return pathlib.Path(tool_path("megaslide-run")).parent


@pytest.mark.parametrize("name", ["buckets-everything", "streaming-clip",
                                  "data-val"])
def test_an_interrupted_run_equals_the_uninterrupted_one(tmp_path, name):
    s = rs.SCENARIOS[name]
    data = rs.make_all_data(tmp_path, [s])
    [result] = rs.run_scenario(s, tools(), tmp_path, data, SEED)
    assert not result.diffs, "\n".join(result.diffs)
    assert any(kind in rs.KINDS for kind, _, _ in result.events), \
        result.events
    assert result.steps == s.steps and result.checkpoints >= 1


def flip(path, offset):
    """Changes one byte of the tensor data of a safetensors file."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_the_comparison_names_the_file_the_field_and_the_step(tmp_path):
    s = rs.SCENARIOS["ema-f32"]
    ref = rs.reference(s, tools(), tmp_path, {})
    got = tmp_path / "changed"
    shutil.copytree(ref, got)
    assert rs.compare(ref, got)[0] == []
    lines = (got / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[4])
    record["grad_norm"] *= 1 + 2 ** -20
    record["seconds"] = 99.0  # measured: not compared
    lines[4] = json.dumps(record)
    (got / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    final = got / "ck" / (got / "ck" / "latest").read_text().strip()
    trainer = json.loads((final / "trainer.json").read_text())
    state = json.loads(trainer["trainer_state"])
    state["data_state"] = "1"
    trainer["trainer_state"] = json.dumps(state)
    (final / "trainer.json").write_text(json.dumps(trainer))
    flip(final / "state.safetensors", 8)
    flip(got / "weights" / "diffusion_pytorch_model.safetensors", 4)
    diffs = rs.compare(ref, got)[0]
    text = "\n".join(diffs)
    assert len(diffs) == 4, text
    assert "metrics step 5 field grad_norm: reference" in diffs[0], text
    assert "step-000014/state.safetensors: tensor " in text, text
    assert "element 2: reference" in text, text
    assert "step-000014/trainer.json.trainer_state.data_state: reference" \
        in text, text
    assert "weights/diffusion_pytorch_model.safetensors: tensor " in text
