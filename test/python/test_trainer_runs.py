"""Python's Trainer runs as megaslide-run does (issue 27 item 2).

Both train through one library (runtime/train/TrainingRun), so a Trainer
with a checkpoint folder, a metrics log and a report writes the same bytes
as the command line, resumes the command line's checkpoints and the
command line resumes its own. Each test compares with megaslide-run on the
same saved plan; docs/Python.md ("Runs") states what they hold.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

import megaslide
from conftest import tool_path

SMALL = ["--model", "tiny", "--frames", "5", "--height", "32", "--width",
         "32"]
RECIPE = ["--lr-schedule", "warmup-cosine", "--warmup-steps", "2",
          "--lr-decay-steps", "12", "--max-grad-norm", "1.0",
          "--ema-decay", "0.9"]
PY_RECIPE = dict(lr_schedule="warmup-cosine", warmup_steps=2,
                 lr_decay_steps=12, max_grad_norm=1.0, ema_decay=0.9)
# Measured, not computed: they differ between any two runs.
TIMING = ("seconds", "samples_per_second", "tokens_per_second",
          "host_rss_bytes")


def cli(*args, check=True):
    result = subprocess.run([tool_path("megaslide-run"), "--no-progress",
                             *map(str, args)], capture_output=True,
                            text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(result.stdout + result.stderr)
    return result


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """The plan both sides run, saved by megaslide-run."""
    path = tmp_path_factory.mktemp("plan") / "tiny.plan.json"
    cli(*SMALL, *RECIPE, "--steps", "0", "--save-plan", path)
    return path


def trainer(plan, **kw):
    return megaslide.Trainer(plan_file=plan, **PY_RECIPE, **kw)


def metrics(path):
    lines = [json.loads(l) for l in pathlib.Path(path).read_text()
             .splitlines()]
    for line in lines:
        for key in TIMING:
            line.pop(key)
    return lines


def files(folder):
    folder = pathlib.Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def same_checkpoints(a, b):
    fa, fb = files(a), files(b)
    assert sorted(fa) == sorted(fb)
    differ = [name for name in fa if fa[name] != fb[name]]
    assert not differ, differ


def test_trainer_writes_what_megaslide_run_writes(plan, tmp_path):
    cli("--plan", plan, *RECIPE, "--steps", "6", "--checkpoint-dir",
        tmp_path / "cli", "--checkpoint-every", "4", "--metrics",
        tmp_path / "cli.jsonl", "--report", tmp_path / "cli.html")
    with trainer(plan, checkpoint_dir=tmp_path / "py", checkpoint_every=4,
                 metrics=tmp_path / "py.jsonl",
                 report=tmp_path / "py.html") as tr:
        out = tr.train(6)
    assert out["steps"] == 6 and out["step"] == 6 and out["skipped"] == 0
    same_checkpoints(tmp_path / "cli", tmp_path / "py")
    assert metrics(tmp_path / "py.jsonl") == metrics(tmp_path / "cli.jsonl")
    assert len(metrics(tmp_path / "py.jsonl")) == 6
    assert "<svg" in (tmp_path / "py.html").read_text()


def test_trainer_resumes_like_megaslide_run(plan, tmp_path):
    # Interrupted at 4 (a checkpoint), resumed for 4 more: by the command
    # line in one folder, by a Trainer in a copy of it.
    cli("--plan", plan, *RECIPE, "--steps", "4", "--checkpoint-dir",
        tmp_path / "cli", "--metrics", tmp_path / "cli.jsonl")
    subprocess.run(["cp", "-a", tmp_path / "cli", tmp_path / "py"],
                   check=True)
    (tmp_path / "py.jsonl").write_bytes((tmp_path / "cli.jsonl").read_bytes())
    cli("--plan", plan, *RECIPE, "--steps", "4", "--resume",
        "--checkpoint-dir", tmp_path / "cli", "--metrics",
        tmp_path / "cli.jsonl")
    with trainer(plan, checkpoint_dir=tmp_path / "py",
                 metrics=tmp_path / "py.jsonl") as tr:
        assert tr.resume() == 4
        assert tr.train(4)["step"] == 8
    same_checkpoints(tmp_path / "cli", tmp_path / "py")
    assert metrics(tmp_path / "py.jsonl") == metrics(tmp_path / "cli.jsonl")
    # And the reverse: the command line continues the Trainer's folder.
    with trainer(plan, checkpoint_dir=tmp_path / "py2") as tr:
        tr.train(4)
    cli("--plan", plan, *RECIPE, "--steps", "4", "--resume",
        "--checkpoint-dir", tmp_path / "py2")
    for name in ("step-000008",):
        same_checkpoints(tmp_path / "cli" / name, tmp_path / "py2" / name)


def test_uninterrupted_equals_resumed(plan, tmp_path):
    with trainer(plan, checkpoint_dir=tmp_path / "whole") as tr:
        tr.train(6)
    with trainer(plan, checkpoint_dir=tmp_path / "parts") as tr:
        tr.train(2)
    with trainer(plan, checkpoint_dir=tmp_path / "parts") as tr:
        tr.resume()
        tr.train(4)
    same_checkpoints(tmp_path / "whole" / "step-000006",
                     tmp_path / "parts" / "step-000006")


def test_a_fresh_trainer_refuses_an_earlier_runs_folder(plan, tmp_path):
    with trainer(plan, checkpoint_dir=tmp_path / "ck") as tr:
        tr.train(1)
    tr = trainer(plan, checkpoint_dir=tmp_path / "ck")
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier "
                       r"run .*Trainer\.resume\(\).*overwrite_checkpoints="
                       r"True"):
        tr.step()
    assert tr.step_count == 0
    tr.close()
    with trainer(plan, checkpoint_dir=tmp_path / "ck",
                 overwrite_checkpoints=True) as tr:
        tr.train(2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()
                  if p.name.startswith("step-")) == ["step-000002"]


def test_two_trainers_never_share_a_folder(plan, tmp_path):
    with trainer(plan, checkpoint_dir=tmp_path / "ck"):
        with pytest.raises(ValueError, match="locked|in use|another"):
            trainer(plan, checkpoint_dir=tmp_path / "ck")
    # Released by close(): a third one opens it.
    trainer(plan, checkpoint_dir=tmp_path / "ck").close()


def test_a_resume_with_other_settings_names_them(plan, tmp_path):
    with trainer(plan, checkpoint_dir=tmp_path / "ck", seed=1) as tr:
        tr.train(1)
    with trainer(plan, checkpoint_dir=tmp_path / "ck", seed=2) as tr:
        with pytest.raises(ValueError) as refused:
            tr.resume()
        text = str(refused.value)
        assert text.startswith("Trainer.resume() from ")
        assert "seed: 1 in the checkpoint, 2 now" in text
        # Python's advice, not megaslide-run's flags.
        assert "give the Trainer the plan, seed" in text
        assert "--" not in text, text
        assert tr.step_count == 0


def test_resume_comes_before_the_first_step(plan, tmp_path):
    with trainer(plan, checkpoint_dir=tmp_path / "ck") as tr:
        tr.train(1)
    with trainer(plan, checkpoint_dir=tmp_path / "ck",
                 overwrite_checkpoints=True) as tr:
        tr.step()
        with pytest.raises(ValueError, match="before the run's first step"):
            tr.resume()


def test_a_closed_trainer_takes_no_step(plan, tmp_path):
    tr = trainer(plan)
    tr.close()
    with pytest.raises(ValueError, match="closed"):
        tr.step()
    assert set(tr.parameters())


def test_ema_weights_as_megaslide_run_saves_them(plan, tmp_path):
    cli("--plan", plan, *RECIPE, "--steps", "3", "--save-weights",
        tmp_path / "cli", "--save-ema")
    tr = trainer(plan)
    tr.train(3)
    tr.save_weights(tmp_path / "py", ema=True)
    assert files(tmp_path / "cli") == files(tmp_path / "py")
    with pytest.raises(ValueError, match="EMA"):
        megaslide.Trainer(plan_file=plan).save_weights(tmp_path / "x",
                                                        ema=True)


def test_ctrl_c_in_train_saves_a_checkpoint(plan, tmp_path):
    # A child process: SIGINT at the second step's boundary (sent by the
    # step's own metrics line appearing), KeyboardInterrupt raised, the
    # state checkpointed; resumed, it equals an uninterrupted run.
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time, megaslide
        # Python's Ctrl-C handler even where SIGINT came ignored (a
        # background job of a non-interactive shell).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        tr = megaslide.Trainer(plan_file={str(plan)!r}, **{PY_RECIPE!r},
                               checkpoint_dir={str(tmp_path / 'ck')!r},
                               metrics={str(tmp_path / 'm.jsonl')!r})
        def interrupt():
            while True:
                try:
                    if len(open({str(tmp_path / 'm.jsonl')!r}).readlines()) >= 2:
                        break
                except FileNotFoundError:
                    pass
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            tr.train(1000)
        except KeyboardInterrupt:
            print("interrupted at", tr.step_count)
            sys.exit(0)
        sys.exit(3)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    stopped = int(result.stdout.split()[-1])
    assert 2 <= stopped < 1000
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir()
                   if p.name.startswith("step-"))
    assert saved == [f"step-{stopped:06d}"]
    with trainer(plan, checkpoint_dir=tmp_path / "ck") as tr:
        tr.resume()
        tr.train(2)
    with trainer(plan, checkpoint_dir=tmp_path / "whole") as tr:
        tr.train(stopped + 2)
    name = f"step-{stopped + 2:06d}"
    same_checkpoints(tmp_path / "whole" / name, tmp_path / "ck" / name)


def test_run_options_are_checked(plan, tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every must be"):
        trainer(plan, checkpoint_dir=tmp_path, checkpoint_every=-1)
    with pytest.raises(ValueError, match="need checkpoint_dir"):
        trainer(plan, checkpoint_every=2)
    with pytest.raises(ValueError, match="val_every needs val_data"):
        trainer(plan, val_every=2)
    with pytest.raises(ValueError, match="sim backend holds no model state"):
        megaslide.Trainer(plan_file=plan, backend="sim",
                          checkpoint_dir=tmp_path / "ck")
    (tmp_path / "notes.txt").write_text("my notes\n")
    with pytest.raises(ValueError, match="not a megaslide metrics log"):
        trainer(plan, metrics=tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


def test_step_keeps_returning_skipped_steps(plan):
    # The non-finite limit is train()'s, as megaslide-run's: step() returns
    # each skipped step, as it always did.
    import numpy as np
    tr = megaslide.Trainer(plan_file=plan)
    shapes = tr.input_shapes()
    nan = {name: np.full(shape, np.nan, np.float32)
           for name, shape in shapes.items() if name != "timesteps"}
    for _ in range(5):
        assert tr.step(**nan)["skipped"]
    assert tr.step_count == 0


def test_train_returns_its_own_figures(plan, tmp_path):
    with trainer(plan, metrics=tmp_path / "m.jsonl") as tr:
        first = tr.train(2)
        second = tr.train(3)
    lines = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text()
             .splitlines()]
    assert (first["steps"], second["steps"], second["step"]) == (2, 3, 5)
    assert first["first_loss"] == pytest.approx(lines[0]["loss"], rel=1e-6)
    assert second["first_loss"] == pytest.approx(lines[2]["loss"], rel=1e-6)
    assert second["last_loss"] == pytest.approx(lines[4]["loss"], rel=1e-6)
    assert second["seconds"] == pytest.approx(
        sum(l["seconds"] for l in lines[2:]), rel=1e-3, abs=1e-5)
