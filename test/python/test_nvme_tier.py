"""The NVMe tier in runs (docs/Runtime.md, "NVMe tier").

A plan that keeps the AdamW moments and the EMA on NVMe (`host_tier`) must
train exactly as one that keeps them in RAM: the same losses, checkpoints
and weights bit for bit, in the deferred and the streaming update, with
accumulation, clipping and either EMA dtype; a run killed (-9) at random
points, its tier's writes included, and resumed equals the uninterrupted
RAM run; and the refusals say why before anything is written.
"""

import json
import os
import pathlib
import random
import re
import signal
import struct
import subprocess
import time

import pytest

from conftest import tool_path

STEPS = 8


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def plans(tmp_path, flags):
    """The tiny model's plan for `flags`, and the same plan keeping the
    moments and the EMA in the tier."""
    ram = tmp_path / "ram.json"
    r = run([tool_path("megaslide-run"), "--model", "tiny", "--steps", "1",
             "--no-progress", *flags, "--save-plan", str(ram)],
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(ram.read_text())
    plan["version"] = 6
    plan["host_tier"] = {"roles": ["moment", "ema"],
                         "window_bytes": 64 << 20, "drives": 1}
    tier = tmp_path / "tier.json"
    tier.write_text(json.dumps(plan))
    return ram, tier


def execute(plan, folder, flags, tier=None, steps=STEPS, extra=()):
    args = [tool_path("megaslide-exec"), "--plan", str(plan), "--no-progress",
            "--steps", str(steps), *flags,
            "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "2",
            "--metrics", str(folder / "metrics.jsonl"), *extra]
    if tier:
        args += ["--nvme", str(tier)]
    return args


def losses(folder):
    return [json.loads(line)["loss"]
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def final_files(folder):
    ck = folder / "ck"
    last = ck / (ck / "latest").read_text().strip()
    return {p.name: p.read_bytes() for p in sorted(last.iterdir())}


RECIPES = {
    "deferred-ema-f32": ["--ema-decay", "0.9"],
    "streaming-ema-bf16-clip": ["--update", "streaming", "--ema-decay", "0.9",
                                "--ema-dtype", "bf16", "--max-grad-norm",
                                "0.5"],
    "accum-2-clip": ["--grad-accum", "2", "--max-grad-norm", "1"],
    "bf16-moments": ["--host-state-policy", "bf16-moments"],
}
# What megaslide-exec must be told again (the plan carries the rest).
RUN_ONLY = {"--max-grad-norm", "--ema-decay"}


def exec_flags(flags):
    out = []
    for i, f in enumerate(flags):
        if f in RUN_ONLY:
            out += [f, flags[i + 1]]
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_tier_trains_bit_for_bit_as_ram(tmp_path, name):
    flags = RECIPES[name]
    ram, tier = plans(tmp_path, flags)
    extra = ["--save-weights"]
    for kind, plan in (("ram", ram), ("tier", tier)):
        folder = tmp_path / kind
        folder.mkdir()
        drive = None
        if kind == "tier":
            drive = tmp_path / "nvme"
            drive.mkdir()
        r = run(execute(plan, folder, exec_flags(flags), drive,
                        extra=[*extra, str(folder / "weights"),
                               *(["--save-ema"] if "--ema-decay" in flags
                                 else [])]))
        assert r.returncode == 0, r.stderr
    assert losses(tmp_path / "ram") == losses(tmp_path / "tier")
    a, b = final_files(tmp_path / "ram"), final_files(tmp_path / "tier")
    assert a.keys() == b.keys()
    assert a["state.safetensors"] == b["state.safetensors"]
    w = "diffusion_pytorch_model.safetensors"
    assert ((tmp_path / "ram" / "weights" / w).read_bytes()
            == (tmp_path / "tier" / "weights" / w).read_bytes())
    # The tier's files went with the process.
    assert list((tmp_path / "nvme").iterdir()) == []


def test_killed_and_resumed_on_the_tier_equals_ram(tmp_path):
    """kill -9 at random moments of a tier run (its writes behind
    included), then --resume on the tier until done: the uninterrupted
    RAM run's losses and final checkpoint, bit for bit."""
    flags = RECIPES["deferred-ema-f32"]
    ram, tier = plans(tmp_path, flags)
    reference = tmp_path / "reference"
    reference.mkdir()
    r = run(execute(ram, reference, exec_flags(flags), steps=12))
    assert r.returncode == 0, r.stderr
    drive = tmp_path / "nvme"
    drive.mkdir()
    folder = tmp_path / "killed"
    folder.mkdir()
    rng = random.Random(3)
    kills = 0
    for attempt in range(40):
        resume = ["--resume"] if (folder / "ck" / "latest").exists() else []
        steps = 12
        if resume:
            done = json.loads(json.loads(
                ((folder / "ck") / (folder / "ck" / "latest").read_text()
                 .strip() / "trainer.json").read_text())["trainer_state"])
            steps = 12 - done["step"]
            if steps == 0:
                break
        args = execute(tier, folder, exec_flags(flags), drive, steps=steps,
                       extra=resume)
        # Each attempt's metrics go to a file of its own, then are joined
        # by step: the killed attempt's lines past its checkpoint repeat.
        args[args.index("--metrics") + 1] = str(folder / f"m{attempt}.jsonl")
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        if kills < 3:
            time.sleep(rng.uniform(0.05, 0.6))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills += 1
        _, err = p.communicate()
        assert p.returncode in (0, -signal.SIGKILL), err
    assert kills >= 1
    by_step = {}
    for path in sorted(folder.glob("m*.jsonl"),
                       key=lambda p: int(p.stem[1:])):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step[record["step"]] = record["loss"]
    assert [by_step[s] for s in sorted(by_step)] == losses(reference)
    a, b = final_files(reference), final_files(folder)
    assert a["state.safetensors"] == b["state.safetensors"]
    assert a["trainer.json"] == b["trainer.json"]
    assert list(drive.iterdir()) == []


def test_refusals_before_anything_is_written(tmp_path):
    _, tier = plans(tmp_path, [])
    folder = tmp_path / "run"
    folder.mkdir()
    r = run(execute(tier, folder, []))
    assert r.returncode == 1
    assert ("the plan keeps the moment and ema tensors on NVMe (host_tier): "
            "give their drives' directories with --nvme DIR[,DIR...]"
            in r.stderr)
    assert not (folder / "ck").exists()
    if pathlib.Path("/dev/shm").is_dir():
        r = run(execute(tier, folder, [], pathlib.Path("/dev/shm")))
        assert r.returncode == 1
        assert "/dev/shm is in RAM (tmpfs)" in r.stderr, r.stderr
        assert "--nvme-force" in r.stderr
        assert not (folder / "ck").exists()
    drive = tmp_path / "nvme"
    drive.mkdir()
    # A drive without room for the tier (the test-only write limit stands
    # for a full disk): refused before the first step.
    r = run(execute(tier, folder, [], drive),
            env=dict(os.environ, MEGASLIDE_FAULT_WRITE_LIMIT="100000"))
    assert r.returncode == 1
    assert "for its share of the tier, 100.00 KB" in r.stderr, r.stderr
    assert not (folder / "ck").exists()
    assert list(drive.iterdir()) == []
    r = run(execute(tier, folder, [], drive / "missing"))
    assert r.returncode == 1
    assert "cannot use it as an NVMe tier: No such file or directory" \
        in r.stderr, r.stderr


MID = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "wan-mid.json"


def test_the_tier_is_required_and_bounded_by_its_window(tmp_path):
    """megaslide-run plans the tier itself: on a host too small for the
    state (--host-mem), the run without drives is refused, with --nvme it
    keeps the moments there and trains as the RAM run does, bit for bit;
    and what the tier keeps resident is at most its planned window (the
    tier run's peak RSS less the RAM run's without its moments)."""
    run_tool = tool_path("megaslide-run")
    common = ["--model", str(MID), "--frames", "5", "--height", "64",
              "--width", "64", "--os-allowance", "0", "--update", "deferred",
              "--steps", "3", "--no-progress"]
    small = ["--host-mem", "250MB", "--nvme-window", "64MiB"]
    r = run([run_tool, *common, *small], cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert "host memory plan needs" in r.stderr
    drive = tmp_path / "nvme"
    drive.mkdir()
    r = run([run_tool, *common, *small, "--nvme", str(drive), "--save-plan",
             str(tmp_path / "tier.json"), "--metrics",
             str(tmp_path / "tier.jsonl")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "tier.json").read_text())
    assert plan["host_tier"] == {"roles": ["moment"], "drives": 1,
                                 "window_bytes": 64 << 20}
    r = run([run_tool, *common, "--host-mem", "1GB", "--metrics",
             str(tmp_path / "ram.jsonl")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    tier = [json.loads(line) for line in
            (tmp_path / "tier.jsonl").read_text().splitlines()]
    ram = [json.loads(line) for line in
           (tmp_path / "ram.jsonl").read_text().splitlines()]
    assert [t["loss"] for t in tier] == [t["loss"] for t in ram]
    moments = sum(4 * _numel(p["shape"]) for p in plan["params"]
                  if p["role"] == "moment")
    assert moments > 2 * plan["host_tier"]["window_bytes"]
    resident = tier[-1]["host_rss_bytes"] - (ram[-1]["host_rss_bytes"]
                                             - moments)
    # The window's slots are all touched (a deferred run measures about 62
    # MB of its 67 MB); two processes' peak RSS differ by a few MB besides
    # (the allocator, shared libraries' pages), hence 16 MiB of slack.
    # Moments kept in RAM as well would show 150 MB more.
    window = plan["host_tier"]["window_bytes"]
    assert resident <= window + (16 << 20), (
        resident, tier[-1]["host_rss_bytes"], ram[-1]["host_rss_bytes"])


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_bf16_moments_are_kept_in_bf16(tmp_path):
    """bf16-moments keeps m and v in bf16 on the host, as the plan counts
    them (8 B/param): its checkpoint holds them as BF16 and its host state
    is the masters' 4 B/param and the moments' 4 (the run's memory check
    lists it)."""
    r = run([tool_path("megaslide-run"), "--model", "tiny", "--steps", "2",
             "--no-progress", "--host-state-policy", "bf16-moments",
             "--checkpoint-dir", str(tmp_path / "ck")], cwd=tmp_path,
            env=dict(os.environ, MEGASLIDE_HOST_MEMORY="1MB"))
    assert r.returncode == 1
    state = re.search(r"([\d.]+) (kB|KB|MB) \([\d.]+ [KM]iB\)  host state",
                      r.stderr)
    assert state, r.stderr
    r = run([tool_path("megaslide-run"), "--model", "tiny", "--steps", "2",
             "--no-progress", "--host-state-policy", "bf16-moments",
             "--checkpoint-dir", str(tmp_path / "ck")], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ck = tmp_path / "ck"
    data = (ck / (ck / "latest").read_text().strip() /
            "state.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    moments = [v["dtype"] for k, v in header.items()
               if k.endswith((".exp_avg", ".exp_avg_sq"))]
    masters = [v["dtype"] for k, v in header.items()
               if k != "__metadata__" and not k.endswith(
                   (".exp_avg", ".exp_avg_sq"))]
    assert moments and set(moments) == {"BF16"}
    assert set(masters) == {"F32"}
    params = sum(_numel(v["shape"]) for k, v in header.items()
                 if k != "__metadata__" and not k.endswith(
                     (".exp_avg", ".exp_avg_sq")))
    unit = {"kB": 1e3, "KB": 1e3, "MB": 1e6}[state[2]]
    assert float(state[1]) * unit == pytest.approx(8 * params, rel=2e-3)
