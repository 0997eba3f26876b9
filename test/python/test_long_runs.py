"""Long runs that lose nothing: megaslide-run under faults (issue 11).

What a practitioner's multi-day run must survive, each as the user would
meet it: outputs that cannot be written (found before compiling), symlinks
in a checkpoint folder, two runs in one folder, a resume that would change
the numbers, non-finite weights, data and losses, a full checkpoint disk,
and SIGINT/SIGTERM at random steps (the resumed run must be bit-identical
to an uninterrupted one). docs/Runtime.md ("Long runs") states the
guarantees these tests hold the code to.
"""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import megaslide
from conftest import tool_path, with_init

SMALL = ["--model", "tiny", "--frames", "5", "--height", "32", "--width", "32"]
CRASH_SIGNS = ("Stack dump", "PLEASE submit a bug report", "Assertion",
               "Segmentation fault", "AddressSanitizer", "runtime error:",
               "terminate called", "LLVM ERROR")


def text(arg):
    return arg if isinstance(arg, str) else (
        os.fspath(arg) if isinstance(arg, os.PathLike) else str(arg))


def run(*args, check=True, timeout=300):
    result = subprocess.run([tool_path("megaslide-run"), "--no-progress",
                             *map(text, with_init(args))],
                            capture_output=True, text=True, timeout=timeout)
    result.out = result.stdout + result.stderr
    for sign in CRASH_SIGNS:
        assert sign not in result.out, result.out
    if check and result.returncode != 0:
        raise AssertionError(result.out)
    return result


def failed(result, message, code=1):
    assert result.returncode == code, result.out
    assert message in result.out, result.out


def started_training(result):
    """Whether the run got as far as compiling and starting its steps."""
    return "on the cpu backend" in result.out


def losses(path):
    """Losses by step; %.9g round-trips float32, so equal means equal bits."""
    out = {}
    for line in pathlib.Path(path).read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def snapshot(folder):
    """Every file under `folder` with its bytes (symlinks not followed)."""
    folder = pathlib.Path(folder)
    return {p.relative_to(folder): (p.read_bytes() if p.is_file() and
                                    not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def shapes():
    return megaslide.Trainer("tiny", frames=5, height=32,
                             width=32).input_shapes()


def write_sample(path, shapes, latents=None, fill=None):
    from safetensors.numpy import save_file
    c, t, h, w = shapes["latents"][1:]
    rng = np.random.default_rng(abs(hash(str(path))) % 2**32)
    x = rng.standard_normal((c, t, h, w)).astype(np.float32)
    if fill is not None:
        x[:] = fill
    cond = rng.standard_normal(shapes["condition"][1:]).astype(np.float32)
    save_file({"latents": x if latents is None else latents,
               "condition": cond}, os.fspath(path))


# ---------------------------------------------------------------------------
# 1. Outputs are checked before compiling
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag,target,reason", [
    ("--save-weights", "/proc/w", "/proc"),
    ("--checkpoint-dir", "/sys/ck", "/sys"),
    ("--save-plan", "/proc/plan.json", "/proc"),
    ("--trace", "/sys/t.json", "/sys"),
    ("--metrics", "/proc/m.jsonl", "/proc"),
])
def test_unwritable_outputs_fail_before_training(flag, target, reason):
    result = run(*SMALL, "--steps", 1000, flag, target, check=False)
    failed(result, target)
    assert flag in result.out
    assert not started_training(result), result.out


def test_output_in_a_missing_read_only_place(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that ignores permissions "
                        "(root without a read-only mount)")
        result = run(*SMALL, "--steps", 1000, "--save-weights", ro / "w",
                     check=False)
        failed(result, "Permission denied")
        assert not started_training(result)
    finally:
        ro.chmod(0o755)


def mount_tmpfs(path, options):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                        os.fspath(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def umount(path):
    subprocess.run(["umount", "-l", os.fspath(path)], capture_output=True)


def test_read_only_filesystem_found_before_training(tmp_path):
    mnt = tmp_path / "ro"
    mount_tmpfs(mnt, "size=1m,ro")
    try:
        for flag in ("--save-weights", "--checkpoint-dir"):
            result = run(*SMALL, "--steps", 1000, flag, mnt / "out",
                         check=False)
            failed(result, "Read-only file system")
            assert not started_training(result)
    finally:
        umount(mnt)


def test_failed_run_leaves_no_folder_it_made(tmp_path, shapes):
    data = tmp_path / "data"
    data.mkdir()
    write_sample(data / "a.safetensors", shapes, fill=np.nan)
    out = tmp_path / "new" / "weights"
    ck = tmp_path / "newck"
    result = run(*SMALL, "--steps", 3, "--data", data, "--save-weights", out,
                 "--checkpoint-dir", ck, check=False)
    failed(result, "a.safetensors")
    assert not (tmp_path / "new").exists()
    assert not ck.exists()


# ---------------------------------------------------------------------------
# 3. Pruning never follows symlinks
# ---------------------------------------------------------------------------

def test_pruning_leaves_symlinked_folder_alone(tmp_path):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--checkpoint-every", 1)
    # The user keeps step 1 on another disk: a complete checkpoint of
    # theirs, linked back into the folder.
    import shutil
    mine = tmp_path / "archive"
    shutil.move(ck / "step-000001", mine)
    (mine / "thesis.txt").write_text("years of work")
    (ck / "step-000001").symlink_to(mine, target_is_directory=True)
    run(*SMALL, "--steps", 3, "--checkpoint-dir", ck, "--checkpoint-every", 1,
        "--resume")
    assert (mine / "thesis.txt").read_text() == "years of work"
    assert (mine / "manifest.json").exists()
    assert (ck / "step-000001").is_symlink()


def test_save_refuses_to_replace_a_symlinked_step(tmp_path):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    (ck / "step-000002").symlink_to(mine, target_is_directory=True)
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
                 check=False)
    failed(result, "step-000002")
    assert (mine / "keep.txt").read_text() == "x"


# ---------------------------------------------------------------------------
# 4. One run per checkpoint folder; no silent replacement
# ---------------------------------------------------------------------------

def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck)
    before = snapshot(ck)
    result = run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, check=False)
    failed(result, "--overwrite-checkpoints")
    assert "--resume" in result.out
    assert not started_training(result)
    assert snapshot(ck) == before


def test_overwrite_checkpoints_replaces_them_after_the_first_save(tmp_path):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 5, "--checkpoint-dir", ck)
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--seed", 3,
        "--overwrite-checkpoints")
    steps = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-000002"]
    assert (ck / "latest").read_text().strip() == "step-000002"


def test_second_run_in_a_locked_folder_names_the_holder(tmp_path):
    ck = tmp_path / "ck"
    first = subprocess.Popen(
        [tool_path("megaslide-run"), "--no-progress", *SMALL, "--steps",
         "100000", "--checkpoint-dir", os.fspath(ck)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (ck / ".lock").exists() or not (ck / ".lock").read_text():
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.05)
        result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck,
                     "--overwrite-checkpoints", check=False)
        failed(result, f"pid {first.pid}")
        result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
                     check=False)
        failed(result, "in use by another run")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    assert not (ck / ".lock").exists()  # released and removed


# ---------------------------------------------------------------------------
# 5. A resume keeps the checkpoint's settings
# ---------------------------------------------------------------------------

def test_resume_uses_the_stored_seed(tmp_path):
    run(*SMALL, "--steps", 4, "--seed", 7, "--metrics", tmp_path / "full")
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 2, "--seed", 7, "--checkpoint-dir", ck,
        "--metrics", tmp_path / "m")
    # --seed left out: the checkpoint's seed, not the default 0.
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--resume",
        "--metrics", tmp_path / "m")
    assert losses(tmp_path / "m") == losses(tmp_path / "full")


def test_cadences_count_global_steps_across_resumes(tmp_path, shapes):
    """--val-every and --checkpoint-every count the run's steps, not the
    steps since the last resume: an interrupted run (2 steps, then 2 and 2
    more) validates and saves at the steps an uninterrupted one does, with
    the same numbers."""
    val = tmp_path / "val"
    val.mkdir()
    for k in range(2):
        write_sample(val / f"v{k}.safetensors", shapes)
    common = [*SMALL, "--val-data", val, "--val-every", 3,
              "--checkpoint-every", 4]
    full = tmp_path / "full.jsonl"
    run(*common, "--steps", 6, "--metrics", full,
        "--checkpoint-dir", tmp_path / "ck-full")
    parts = tmp_path / "parts.jsonl"
    ck = tmp_path / "ck"
    run(*common, "--steps", 2, "--metrics", parts, "--checkpoint-dir", ck)
    for _ in range(2):
        run(*common, "--steps", 2, "--metrics", parts, "--checkpoint-dir",
            ck, "--resume")
    a = [json.loads(l) for l in full.read_text().splitlines()]
    b = [json.loads(l) for l in parts.read_text().splitlines()]
    assert [r["step"] for r in b] == [r["step"] for r in a]
    # Every run validates at its end too: the parts' runs end at 2 and 4.
    val_full = [r["step"] for r in a if "val_loss" in r]
    val_parts = [r["step"] for r in b if "val_loss" in r]
    assert val_full == [3, 6]
    assert set(val_full) <= set(val_parts)
    assert 3 in val_parts, val_parts
    assert [r.get("val_loss") for r in a if r["step"] in (3, 6)] == \
        [r.get("val_loss") for r in b if r["step"] in (3, 6)]
    # Checkpoints at 4 (the cadence) and at each run's end.
    saved = lambda d: sorted(p.name for p in d.iterdir()
                             if p.name.startswith("step-"))
    assert "step-000004" in saved(ck)


@pytest.mark.parametrize("flag,value,name", [
    ("--seed", "8", "seed"),
    ("--lr", "0.001", "lr"),
    ("--weight-decay", "0.1", "weight_decay"),
    ("--precision", "f32", "precision"),
    ("--batch", "2", "batch"),
])
def test_resume_refuses_other_settings(tmp_path, flag, value, name):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--seed", 7, "--checkpoint-dir", ck)
    before = snapshot(ck)
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
                 flag, value, check=False)
    failed(result, f"{name}: ")
    assert "in the checkpoint" in result.out
    assert snapshot(ck) == before


@pytest.mark.parametrize("resume_flags,name", [
    (["--ema-decay", "0.99", "--ema-dtype", "bf16"], "ema_dtype"),
    (["--ema-decay", "0.99", "--ema-dtype", "f32"], None),
    ([], "ema_decay"),
])
def test_resume_checks_the_ema_by_name(tmp_path, resume_flags, name):
    """The EMA is part of the recipe a resume must repeat: another dtype,
    or none, is refused by the setting's name before any state loads (not
    as a checkpoint that does not match the model); the same EMA resumes."""
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--ema-decay", "0.99", "--ema-dtype", "f32",
        "--checkpoint-dir", ck)
    before = snapshot(ck)
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
                 *resume_flags, check=False)
    if name is None:
        assert result.returncode == 0, result.out
        return
    failed(result, f"{name}: ")
    assert "in the checkpoint" in result.out
    assert "does not match" not in result.out
    assert snapshot(ck) == before


def test_resume_refuses_other_data(tmp_path, shapes):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        write_sample(d / "s.safetensors", shapes)
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--data", a, "--checkpoint-dir", ck)
    result = run(*SMALL, "--steps", 1, "--data", b, "--checkpoint-dir", ck,
                 "--resume", check=False)
    failed(result, "data: ")
    # Left out, the checkpoint's data folder is used.
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume")


def test_resume_refuses_changed_samples(tmp_path, shapes):
    """The data folder's samples are part of the run: one added, removed or
    replaced (another header) between a run and its resume is refused by
    name."""
    data = tmp_path / "data"
    data.mkdir()
    for k in range(3):
        write_sample(data / f"s{k}.safetensors", shapes)
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--data", data, "--checkpoint-dir", ck)
    before = snapshot(ck)
    write_sample(data / "s3.safetensors", shapes)
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
                 check=False)
    failed(result, "data_samples: 3 samples, ")
    assert "4 samples, " in result.out
    assert snapshot(ck) == before
    (data / "s3.safetensors").unlink()
    # Replaced by a sample of another header (f16 latents).
    c, t, h, w = shapes["latents"][1:]
    write_sample(data / "s0.safetensors", shapes,
                 latents=np.zeros((c, t, h, w), np.float16))
    failed(run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
               check=False), "data_samples: ")


# ---------------------------------------------------------------------------
# 6. Non-finite values
# ---------------------------------------------------------------------------

def test_nan_weights_name_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file
    w = tmp_path / "w"
    run(*SMALL, "--steps", 1, "--save-weights", w)
    path = w / "diffusion_pytorch_model.safetensors"
    tensors = load_file(os.fspath(path))
    name = sorted(tensors)[3]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[1] = np.inf
    save_file(tensors, os.fspath(path))
    result = run(*SMALL, "--steps", 1, "--weights", w, check=False)
    failed(result, f"tensor '{name}' holds INF at element 1")
    assert "diffusion_pytorch_model.safetensors" in result.out


def test_nan_data_sample_names_the_file(tmp_path, shapes):
    data = tmp_path / "data"
    data.mkdir()
    write_sample(data / "good.safetensors", shapes)
    write_sample(data / "bad.safetensors", shapes, fill=np.nan)
    result = run(*SMALL, "--steps", 20, "--data", data, check=False)
    failed(result, "bad.safetensors': tensor 'latents' holds nan")


def test_non_finite_loss_skips_then_stops(tmp_path, shapes):
    # Finite samples so large that the loss overflows to inf.
    data = tmp_path / "data"
    data.mkdir()
    write_sample(data / "huge.safetensors", shapes, fill=3e38)
    ck = tmp_path / "ck"
    result = run(*SMALL, "--steps", 20, "--data", data, "--metrics",
                 tmp_path / "m", "--checkpoint-dir", ck,
                 "--max-nonfinite-steps", 4, check=False)
    failed(result, "4 steps in a row had a non-finite loss")
    assert result.out.count("the step is skipped") == 4
    lines = [json.loads(l) for l in (tmp_path / "m").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 1, 1, 1]
    assert all(l["skipped"] and l["loss"] is None for l in lines)
    # Nothing was updated, so there is nothing to checkpoint: the folder
    # the run made is gone again.
    assert not ck.exists()


def test_skipped_step_changes_no_state(tmp_path, shapes):
    """A skip leaves masters and moments bit for bit as they were."""
    good, mixed = tmp_path / "good", tmp_path / "mixed"
    good.mkdir()
    write_sample(good / "a.safetensors", shapes)
    w0, w1 = tmp_path / "w0", tmp_path / "w1"
    run(*SMALL, "--steps", 0, "--save-weights", w0)
    mixed.mkdir()
    write_sample(mixed / "a.safetensors", shapes, fill=3e38)
    run(*SMALL, "--steps", 2, "--data", mixed, "--save-weights", w1,
        "--max-nonfinite-steps", 3)
    a = (w0 / "diffusion_pytorch_model.safetensors").read_bytes()
    b = (w1 / "diffusion_pytorch_model.safetensors").read_bytes()
    assert a == b


def test_trainer_nan_inputs_leave_state_unchanged():
    tr = megaslide.Trainer("tiny", frames=5, height=32, width=32,
                           precision="f32")
    shapes = tr.input_shapes()
    rng = np.random.default_rng(0)
    batch = {k: rng.standard_normal(v).astype(np.float32)
             for k, v in shapes.items() if k != "timesteps"}
    batch["timesteps"] = np.full(shapes["timesteps"], 0.5, np.float32)
    batch["latents"][0, 0, 0, 0, 0] = np.nan
    before = tr.parameters()
    moments = tr.optimizer_state()
    result = tr.step(**batch)
    assert result["skipped"] and not np.isfinite(result["loss"])
    assert tr.step_count == 0
    for name, m in tr.optimizer_state().items():
        np.testing.assert_array_equal(m["exp_avg"], moments[name]["exp_avg"])
        np.testing.assert_array_equal(m["exp_avg_sq"],
                                      moments[name]["exp_avg_sq"])
    after = tr.parameters()
    assert after.keys() == before.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    batch["latents"][0, 0, 0, 0, 0] = 0.0
    assert np.isfinite(tr.step(**batch)["loss"]) and tr.step_count == 1


# ---------------------------------------------------------------------------
# 7. Host memory is checked as a whole
# ---------------------------------------------------------------------------

def test_memory_check_adds_up_the_parts(tmp_path):
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max",
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(open(limit).read()))
        except (OSError, ValueError):
            pass
    # Two layers of the 14B model: fp32 state of 0.94 B parameters x 12 B
    # = 11.2 GB; with every activation kept, the arena grows with the video.
    config = json.loads((pathlib.Path(__file__).parents[2] / "configs" /
                         "wan2.1-t2v-14b.json").read_text())
    config.pop("name", None)
    config["num_layers"] = 2
    path = tmp_path / "m.json"
    path.write_text(json.dumps(config))
    args = ["--model", path, "--precision", "f32", "--activation-policy",
            "keep", "--gpu-mem", "100TB", "--host-mem", "100TB"]
    for frames, side in ((17, 256), (33, 256), (33, 384), (65, 256),
                         (65, 384), (65, 512), (129, 512)):
        video = ["--frames", frames, "--height", side, "--width", side]
        plan = subprocess.run([tool_path("megaslide-plan"), *map(text, args),
                               *map(text, video), "--format", "json"],
                              capture_output=True, text=True)
        assert plan.returncode == 0, plan.stderr
        report = json.loads(plan.stdout)
        state = 12 * report["params"]["trainable"]
        arena = report["device"]["peak_bytes"]
        if state < total and arena < total < state + arena:
            break
    else:
        pytest.skip(f"no size where state and arena each fit {total} B "
                    f"but together do not")
    result = run(*args, *video, "--steps", 1, check=False)
    failed(result, "of host memory, but this machine has")
    for part in ("host state", "device arena", "host buffers", "data"):
        assert part in result.out, result.out


# ---------------------------------------------------------------------------
# 8. Signals: stop at a step boundary, checkpoint, resume bit-exactly
# ---------------------------------------------------------------------------

def start(args):
    return subprocess.Popen([tool_path("megaslide-run"), "--no-progress",
                             *map(text, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def interrupt_after(proc, metrics, steps_done, sig):
    """Sends `sig` once `metrics` has `steps_done` lines."""
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        if metrics.exists() and \
                metrics.read_text().count("\n") >= steps_done:
            break
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return out, err


def resume_line(out):
    lines = [l for l in out.splitlines() if l.startswith("to continue: ")]
    assert len(lines) == 1, out
    return lines[0][len("to continue: "):]


def resume_args(line):
    import shlex
    args = shlex.split(line)
    assert os.path.basename(args[0]) == "megaslide-run"
    return args[1:]


def test_sigint_at_random_steps_resumes_bit_exactly(tmp_path):
    steps = 12
    reference = tmp_path / "ref.jsonl"
    run(*SMALL, "--steps", steps, "--metrics", reference)
    want = losses(reference)
    rng = random.Random(11)
    interrupted = 0
    for trial in range(20):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        metrics, trace = d / "m.jsonl", d / "t.json"
        sig = signal.SIGINT if trial % 2 == 0 else signal.SIGTERM
        args = [*SMALL, "--steps", steps, "--checkpoint-dir", d / "ck",
                "--metrics", metrics, "--trace", trace]
        proc = start(args)
        out, err = interrupt_after(proc, metrics, rng.randrange(0, steps - 1),
                                   sig)
        if proc.returncode == 0:
            continue  # the run ended before the signal landed
        assert proc.returncode == 128 + sig, out + err
        interrupted += 1
        json.loads(trace.read_text())  # a valid, finished trace
        result = run(*resume_args(resume_line(out)))
        assert losses(metrics) == want, (trial, out + err + result.out)
    assert interrupted >= 15, interrupted


def test_acceptance_sigint_on_the_default_200_steps(tmp_path):
    reference = tmp_path / "ref.jsonl"
    run("--model", "tiny", "--steps", 200, "--metrics", reference)
    metrics = tmp_path / "m.jsonl"
    proc = start(["--model", "tiny", "--steps", 200, "--checkpoint-dir",
                  tmp_path / "ck", "--metrics", metrics])
    out, err = interrupt_after(proc, metrics, random.randrange(1, 190),
                               signal.SIGINT)
    assert proc.returncode == 130, out + err
    line = resume_line(out)
    assert "--resume" in line and "--steps" in line
    run(*resume_args(line))
    assert losses(metrics) == losses(reference)


def test_second_signal_aborts_at_once(tmp_path):
    # Steps of about a second, so that both signals land in one step.
    metrics = tmp_path / "m.jsonl"
    proc = start(["--model", "tiny", "--frames", 33, "--height", 256,
                  "--width", 256, "--steps", 1000, "--checkpoint-dir",
                  tmp_path / "ck", "--metrics", metrics])
    deadline = time.time() + 300
    while not metrics.exists() or not metrics.read_text():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    assert proc.poll() is None  # the first one only asks for a stop
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT



def catches_sigint(proc):
    """Whether `proc` has installed its SIGINT handler (SigCgt of
    /proc/PID/status), which megaslide-run does before it plans."""
    try:
        status = pathlib.Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return False
    caught = [l for l in status.splitlines() if l.startswith("SigCgt:")]
    return bool(int(caught[0].split()[1], 16) >> (signal.SIGINT - 1) & 1)


@pytest.mark.parametrize("old_checkpoints", [False, True])
def test_signal_before_the_first_step_prints_the_command_as_given(
        tmp_path, old_checkpoints):
    """A fresh run stopped while it plans has no checkpoint to resume: the
    command it prints is the one given (with --overwrite-checkpoints, which
    --resume would have turned into a resume of the old run), and running
    it gives the uninterrupted run's losses (found by
    scripts/resume-scenarios.py)."""
    reference = tmp_path / "ref.jsonl"
    run(*SMALL, "--steps", 3, "--seed", 2, "--metrics", reference)
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    extra = ["--overwrite-checkpoints"] if old_checkpoints else []
    for attempt in range(20):
        if old_checkpoints:
            run(*SMALL, "--steps", 1, "--checkpoint-dir", ck,
                "--overwrite-checkpoints")
        proc = start([*SMALL, "--steps", 3, "--seed", 2, "--checkpoint-dir",
                      ck, "--metrics", metrics, *extra])
        deadline = time.time() + 120
        while proc.poll() is None and not catches_sigint(proc):
            assert time.time() < deadline
            time.sleep(0.0005)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if "after 0 of 3 steps" in err:
            break
    else:
        pytest.skip("no SIGINT landed before the first step in 20 runs")
    assert proc.returncode == 130, out + err
    line = resume_line(out)
    assert "--resume" not in line, line
    assert ("--overwrite-checkpoints" in line) == old_checkpoints, line
    run(*resume_args(line))
    assert losses(metrics) == losses(reference)

def test_failing_run_keeps_existing_trace_and_metrics(tmp_path, shapes):
    data = tmp_path / "data"
    data.mkdir()
    write_sample(data / "bad.safetensors", shapes, fill=np.nan)
    trace, metrics = tmp_path / "t.json", tmp_path / "m.jsonl"
    trace.write_text('{"traceEvents": []}')
    metrics.write_text('{"step": 1, "loss": 1.0, "seconds": 1.0}\n')
    result = run(*SMALL, "--steps", 3, "--data", data, "--trace", trace,
                 "--metrics", metrics, check=False)
    failed(result, "bad.safetensors")
    assert trace.read_text() == '{"traceEvents": []}'
    assert metrics.read_text() == '{"step": 1, "loss": 1.0, "seconds": 1.0}\n'


def test_metrics_are_appended_on_resume(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--metrics", metrics)
    # A line of a step the checkpoint does not hold (a kill after it).
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 9.0, "seconds": 0.1}\n{"step": 4, "lo')
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--metrics", metrics,
        "--resume")
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert losses(metrics)[3] != 9.0


# ---------------------------------------------------------------------------
# 14. Smaller
# ---------------------------------------------------------------------------

def test_full_checkpoint_disk_found_before_training(tmp_path):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=64k")
    try:
        result = run(*SMALL, "--steps", 1000, "--checkpoint-dir", mnt / "ck",
                     check=False)
        failed(result, "not enough space for a checkpoint")
        assert "MiB" in result.out and not started_training(result)
    finally:
        umount(mnt)


def test_leftovers_of_a_killed_save_are_cleaned(tmp_path):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck)
    # A pid that is not alive: above the kernel's pid_max.
    dead = 4194305
    (ck / f".old-step-000001-{dead}").mkdir()
    (ck / f".old-step-000001-{dead}" / "state.safetensors").write_bytes(b"x")
    (ck / f".tmp-step-000002-{dead}").mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "f").write_text("keep")
    (ck / f".tmp-step-000009-{dead}").symlink_to(mine)
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume")
    names = {p.name for p in ck.iterdir()}
    assert f".old-step-000001-{dead}" not in names
    assert f".tmp-step-000002-{dead}" not in names
    assert (mine / "f").read_text() == "keep"


def test_skip_message_names_the_global_step_after_resume(tmp_path, shapes):
    data = tmp_path / "data"
    data.mkdir()
    write_sample(data / "s.safetensors", shapes)
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 3, "--data", data, "--checkpoint-dir", ck)
    write_sample(data / "s.safetensors", shapes, fill=3e38)
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
                 "--max-nonfinite-steps", 1, check=False)
    failed(result, "step 4: the loss (")


def test_sim_metrics_count_steps(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run(*SMALL, "--backend", "sim", "--steps", 3, "--metrics", metrics)
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
    assert all(l["loss"] is None for l in lines)


# ---------------------------------------------------------------------------
# 9. The training recipe resumes bit-exactly (docs/Training.md, "Resume")
# ---------------------------------------------------------------------------

RECIPE = ["--lr", "1e-3", "--lr-schedule", "warmup-cosine", "--warmup-steps",
          "2", "--min-lr", "1e-4", "--lr-decay-steps", "8",
          "--max-grad-norm", "0.5", "--ema-decay", "0.8",
          "--timestep-sampling", "logit-normal", "--flow-shift", "3"]


@pytest.mark.parametrize("update", ["deferred", "streaming"])
def test_recipe_resumes_bit_exactly(tmp_path, update):
    plan = ["--update", update]
    whole, half = tmp_path / "whole", tmp_path / "half"
    for d in (whole, half):
        d.mkdir()
    run(*SMALL, *RECIPE, *plan, "--steps", 8, "--checkpoint-dir",
        whole / "ck", "--metrics", whole / "m.jsonl", "--save-weights",
        whole / "w", "--save-ema")
    run(*SMALL, *RECIPE, *plan, "--steps", 4, "--checkpoint-dir", half / "ck",
        "--metrics", half / "m.jsonl")
    run(*SMALL, *RECIPE, *plan, "--steps", 4, "--checkpoint-dir", half / "ck",
        "--resume", "--metrics", half / "m.jsonl", "--save-weights",
        half / "w", "--save-ema")
    lines = [[json.loads(l) for l in (d / "m.jsonl").read_text().splitlines()]
             for d in (whole, half)]
    keys = ("step", "loss", "lr", "grad_norm", "clipped", "skipped")
    assert [[r[k] for k in keys] for r in lines[0]] == \
        [[r[k] for k in keys] for r in lines[1]]
    assert any(r["clipped"] for r in lines[0])
    for name in ("ck/latest", "w/diffusion_pytorch_model.safetensors"):
        if name == "ck/latest":
            a = (whole / "ck" / (whole / name).read_text().strip())
            b = (half / "ck" / (half / name).read_text().strip())
            assert (a / "state.safetensors").read_bytes() == \
                (b / "state.safetensors").read_bytes()
        else:
            assert (whole / name).read_bytes() == (half / name).read_bytes()


def test_deferred_update_skips_a_nan_gradient_exactly(tmp_path):
    """A finite loss with one NaN gradient (injected through the
    MEGASLIDE_FAULT_NAN_GRADIENT seam): the deferred update skips the step
    with masters, moments and EMA bitwise as before it."""
    env = dict(os.environ,
               MEGASLIDE_FAULT_NAN_GRADIENT="blocks.0.attn1.to_q.weight@3")
    args = [*SMALL, "--lr", "1e-3", "--ema-decay", "0.9", "--max-grad-norm",
            "1", "--checkpoint-dir", tmp_path / "ck"]
    run(*args, "--steps", 2, "--checkpoint-every", 1)
    before = (tmp_path / "ck" / "step-000002" / "state.safetensors")
    before = before.read_bytes()
    result = subprocess.run(
        [tool_path("megaslide-run"), "--no-progress",
         *map(text, [*args, "--steps", 1, "--resume", "--metrics",
                     tmp_path / "m.jsonl"])],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the gradient norm is not finite" in result.stderr
    line = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert line["skipped"] and line["grad_norm"] is None
    assert np.isfinite(line["loss"])
    # Nothing moved: the checkpoint after the skipped step is step 2's.
    latest = (tmp_path / "ck" / "latest").read_text().strip()
    assert latest == "step-000002"
    assert (tmp_path / "ck" / latest / "state.safetensors").read_bytes() == \
        before


def test_validation_is_fixed_and_touches_no_training_state(tmp_path, shapes):
    """Validation loss: the same inputs at every call (so the same loss for
    the same weights), and neither the optimizer nor the training data
    moves: a run with --val-data follows the same losses as one without."""
    val = tmp_path / "val"
    val.mkdir()
    for k in range(3):
        write_sample(val / f"v{k}.safetensors", shapes)
    tr = megaslide.Trainer("tiny", frames=5, height=32, width=32,
                           precision="f32", val_data=val)
    first = tr.validation_loss()
    assert np.isfinite(first) and tr.validation_loss() == first
    before = tr.parameters()
    tr.validation_loss()
    for name, p in tr.parameters().items():
        np.testing.assert_array_equal(p, before[name])
    assert tr.step_count == 0
    tr.step()
    assert tr.validation_loss() != first  # the weights moved

    plain, with_val = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(*SMALL, "--steps", 4, "--metrics", plain)
    run(*SMALL, "--steps", 4, "--metrics", with_val, "--val-data", val,
        "--val-every", 2)
    a = [json.loads(l) for l in plain.read_text().splitlines()]
    b = [json.loads(l) for l in with_val.read_text().splitlines()]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert ["val_loss" in r for r in b] == [False, True, False, True]
    assert "val_loss" not in a[-1]


def test_grad_accum_is_bounded_and_streams_its_micro_batches(tmp_path):
    """An optimizer step draws its micro-batches one at a time: a step of
    200 holds no more memory than a step of 1 (tiny at its default 17 x 128
    x 128: each micro-batch held at once was ~160 KB, 30 MB more peak RSS
    for 200), and --grad-accum beyond the bound is one error before any
    work instead of an out-of-memory kill."""
    def peak(accum):
        script = ("import resource, subprocess, sys; "
                  "subprocess.run(sys.argv[1:], check=True, "
                  "capture_output=True); "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN)"
                  ".ru_maxrss)")
        r = subprocess.run(
            [sys.executable, "-c", script, tool_path("megaslide-run"),
             "--no-progress", "--model", "tiny", "--steps", "1",
             "--grad-accum",
             str(accum), "--update", "deferred"],
            capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return int(r.stdout) * 1024  # KiB
    one, many = peak(1), peak(200)
    assert many - one < 12 << 20, (one, many)

    result = run(*SMALL, "--steps", 1, "--grad-accum", 100000000000,
                 check=False)
    failed(result, "option 'grad-accum': 100000000000 micro-batches per "
           "optimizer step; give 1 to 1048576")
    assert not started_training(result)


def test_resume_past_the_lr_horizon_warns_and_can_extend_it(tmp_path):
    """A resume beyond the first run's decay horizon says that its steps run
    at the schedule's floor; one that gives --lr-decay-steps moves the
    horizon (said, and logged in the metrics) and decays towards it;
    --max-steps counts the run's total across resumes, and the same command
    resumed after the total runs nothing."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    common = [*SMALL, "--lr-schedule", "warmup-cosine", "--warmup-steps", 1,
              "--checkpoint-dir", ck, "--metrics", m]
    run(*common, "--steps", 4)
    r = run(*common, "--steps", 2, "--resume")
    assert "warning: steps 5..6 run at the schedule's floor (lr 0): its " \
        "horizon is step 4" in r.out
    assert [json.loads(l)["lr"] for l in m.read_text().splitlines()][4:] \
        == [0, 0]
    r = run(*common, "--max-steps", 10, "--lr-decay-steps", 10, "--resume")
    assert "the learning-rate horizon moves from step 4 (the checkpoint's) " \
        "to 10 (--lr-decay-steps)" in r.out
    assert "warning" not in r.out
    lines = [json.loads(l) for l in m.read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, 11))
    assert lines[6]["lr_decay_steps"] == 10
    assert all(l["lr"] > 0 for l in lines[6:])
    r = run(*common, "--max-steps", 10, "--lr-decay-steps", 10, "--resume")
    assert "--max-steps 10: nothing left to run" in r.out
    assert len(m.read_text().splitlines()) == 10
    failed(run(*common, "--steps", 1, "--max-steps", 3, check=False),
           "not both")



def test_warmup_constant_resumes_with_fewer_steps_left_than_its_warmup(
        tmp_path):
    """warmup-constant has no horizon: a resume with fewer steps left than
    its warmup is no "--lr-decay-steps below --warmup-steps" (the printed
    command after a signal failed so; found by
    scripts/resume-scenarios.py), and continues bit-exactly."""
    common = [*SMALL, "--lr-schedule", "warmup-constant", "--warmup-steps", 4]
    run(*common, "--steps", 6, "--metrics", tmp_path / "ref.jsonl")
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    run(*common, "--steps", 5, "--checkpoint-dir", ck, "--metrics", m)
    run(*common, "--steps", 1, "--checkpoint-dir", ck, "--metrics", m,
        "--resume")
    lr = [[json.loads(l)["lr"] for l in p.read_text().splitlines()]
          for p in (tmp_path / "ref.jsonl", m)]
    assert lr[0] == lr[1]
    assert losses(m) == losses(tmp_path / "ref.jsonl")

def test_data_without_weights_needs_init_random(tmp_path, shapes):
    """Training on samples from random weights (the base model's --weights
    forgotten) is refused before any work unless --init random says it is
    meant; the banner says where the weights and the samples come from."""
    data = tmp_path / "data"
    data.mkdir()
    write_sample(data / "s.safetensors", shapes)
    r = subprocess.run([tool_path("megaslide-run"), "--no-progress", *SMALL,
                        "--steps", "1", "--data", text(data)],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "no --weights were given" in r.stderr and "--init random" in r.stderr
    assert "on the cpu backend" not in r.stdout + r.stderr
    r = run(*SMALL, "--steps", 1, "--data", data, "--init", "random")
    assert "initial weights: random (seed 0)" in r.out
    assert f"data: {data} (1 samples, 1 bucket)" in r.out
    assert "recipe: lr 0.002, beta1 0.9, beta2 0.999" in r.out
    assert "attention: " in r.out
    weights = tmp_path / "w"
    run(*SMALL, "--steps", 1, "--save-weights", weights)
    r = run(*SMALL, "--steps", 1, "--data", data, "--weights", weights)
    assert f"initial weights: {weights}" in r.out
    r = run(*SMALL, "--steps", 1)
    assert "data: synthetic task (seed 0)" in r.out
    assert "backend: cpu (--backend auto: no GPU" in r.out


def test_saved_plan_carries_the_recipe_facts_exec_needs(tmp_path):
    """--grad-accum and --ema-dtype are recorded in the saved plan's header:
    megaslide-exec runs such a plan with 3 micro-batches a step and a bf16
    EMA, continuing megaslide-run's checkpoints bit for bit."""
    plan, ck, m = tmp_path / "p.json", tmp_path / "ck", tmp_path / "m.jsonl"
    recipe = ["--ema-decay", "0.99"]
    run(*SMALL, "--grad-accum", 3, "--ema-dtype", "bf16", *recipe,
        "--steps", 4, "--metrics", tmp_path / "full.jsonl")
    run(*SMALL, "--grad-accum", 3, "--ema-dtype", "bf16", *recipe,
        "--steps", 2, "--save-plan", plan, "--checkpoint-dir", ck,
        "--metrics", m)
    header = json.loads(plan.read_text())
    assert header["grad_accum"] == 3 and header["ema_dtype"] == "bf16"
    r = subprocess.run([tool_path("megaslide-exec"), "--no-progress",
                        "--plan", text(plan), *recipe, "--steps", "2",
                        "--checkpoint-dir", text(ck), "--resume",
                        "--metrics", text(m)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(l) for l in m.read_text().splitlines()]
    assert [l["micro_batches"] for l in lines] == [3, 3, 3, 3]
    assert losses(m) == losses(tmp_path / "full.jsonl")
