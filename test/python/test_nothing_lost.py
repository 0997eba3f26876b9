"""Issue 26, "nothing lost and nothing silent": megaslide-run refuses what
would destroy a file or mislead (docs/Runtime.md, "Long runs";
docs/Training.md, "Flags of other trainers")."""

import json
import os
import pathlib
import re
import subprocess

import pytest

from conftest import tool_path

SMALL = ["--model", "tiny", "--frames", "5", "--height", "32", "--width", "32"]
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def run(*args, tool="megaslide-run", check=True, env=None):
    result = subprocess.run([tool_path(tool), "--no-progress",
                             *map(os.fspath, map(str, args))],
                            capture_output=True, text=True, timeout=300,
                            env=env)
    result.out = result.stdout + result.stderr
    for sign in ("Stack dump", "Assertion", "LLVM ERROR"):
        assert sign not in result.out, result.out
    if check and result.returncode != 0:
        raise AssertionError(result.out)
    return result


def refused(result, *messages):
    assert result.returncode == 1, result.out
    for message in messages:
        assert message in result.out, result.out
    # Refused before compiling: no plan, no step.
    assert "on the cpu backend" not in result.out, result.out


def steps(path):
    return [json.loads(l)["step"] for l in path.read_text().splitlines()]


# 3. A corrupt line in the middle of the log is named, not deleted; a file
# that is not a metrics log is never replaced.

def test_resume_refuses_a_corrupt_middle_line(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    run(*SMALL, "--steps", 3, "--checkpoint-dir", ck, "--metrics", metrics)
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:20] + "#garbage"
    before = "\n".join(lines) + "\n"
    metrics.write_text(before)
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--metrics",
                 metrics, "--resume", check=False)
    refused(result, f"line 2 of the metrics log '{metrics}' is corrupt")
    assert metrics.read_text() == before


def test_resume_still_drops_a_line_cut_by_a_kill(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--metrics", metrics)
    with open(metrics, "a") as f:
        f.write('{"step": 3, "lo')
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--metrics", metrics,
        "--resume")
    assert steps(metrics) == [1, 2, 3]


def test_resume_keeps_the_checkpoints_steps_out_of_order(tmp_path):
    # Not a prefix (a later step's line before a kept one): rewritten.
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--metrics", metrics)
    first, second = metrics.read_text().splitlines()
    metrics.write_text(f'{first}\n{{"step": 7, "loss": 1.0}}\n{second}\n')
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--metrics", metrics,
        "--report", tmp_path / "r.html", "--resume")
    assert steps(metrics) == [1, 2, 3]
    assert (tmp_path / "r.html").exists()


@pytest.mark.parametrize("resume", [False, True])
def test_metrics_never_replaces_another_file(tmp_path, resume):
    ck, notes = tmp_path / "ck", tmp_path / "notes.txt"
    if resume:
        run(*SMALL, "--steps", 1, "--checkpoint-dir", ck)
    notes.write_text("my notes\nline two\n")
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--metrics",
                 notes, *(["--resume"] if resume else []), check=False)
    refused(result, f"--metrics '{notes}' is not a megaslide metrics log")
    assert notes.read_text() == "my notes\nline two\n"


def test_fresh_run_replaces_an_earlier_metrics_log(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run(*SMALL, "--steps", 3, "--metrics", metrics)
    run(*SMALL, "--steps", 2, "--metrics", metrics)
    assert steps(metrics) == [1, 2]


# 4. Two outputs on one file.

@pytest.mark.parametrize("first,second", [
    ("--metrics", "--report"), ("--trace", "--save-plan"),
    ("--metrics", "--save-gradients"), ("--report", "--trace")])
def test_two_outputs_on_one_file_are_refused(tmp_path, first, second):
    path = tmp_path / "out"
    (tmp_path / "sub").mkdir()
    # The same file reached by another spelling.
    other = tmp_path / "sub" / ".." / "out"
    result = run(*SMALL, "--steps", 1, first, path, second, other,
                 check=False)
    refused(result, f"{first} '{path}'", f"{second} '{other}'",
            "are the same file")
    assert not path.exists()


@pytest.mark.parametrize("weights,output", [
    ("base", "base"), ("base/", "./base"),
    ("base/diffusion_pytorch_model.safetensors", "base")])
def test_an_output_over_an_input_is_refused(tmp_path, weights, output):
    base = tmp_path / "base"
    run(*SMALL, "--steps", 1, "--save-weights", base)
    def snapshot(folder):
        return {p.name: (p.stat().st_ino, p.read_bytes())
                for p in sorted(folder.iterdir())}

    before = snapshot(base)
    result = run(*SMALL, "--steps", 1, "--weights", tmp_path / weights,
                 "--save-weights", tmp_path / output, check=False)
    refused(result, "--save-weights", "would overwrite the --weights input")
    assert snapshot(base) == before


def test_outputs_through_a_symlink_are_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = run(*SMALL, "--steps", 1, "--checkpoint-dir", tmp_path / "real",
                 "--save-weights", tmp_path / "link", check=False)
    refused(result, "--checkpoint-dir", "--save-weights", "are the same file")


# 16. The log's size does not limit a resume.

def test_resume_reads_a_log_of_any_size(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    run(*SMALL, "--steps", 2, "--checkpoint-dir", ck, "--metrics", metrics)
    # Past 1 GiB: a tail of NULs (a crash on a filesystem that had grown
    # the file but not written it), sparse, so no disk is used.
    size = metrics.stat().st_size
    os.truncate(metrics, (1 << 30) + 4096)
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--metrics", metrics,
        "--resume")
    assert steps(metrics) == [1, 2, 3]
    assert metrics.stat().st_size < size * 2


# 21. Numbers in messages are printed in units that show them.

@pytest.mark.parametrize("tool,value,message", [
    ("megaslide-run", "1", "--min-lr must be in [0, lr = 0.0001], got 1"),
    # megaslide-exec knows the lr only from the plan, read later.
    ("megaslide-exec", "-1",
     "--min-lr must be a finite number in [0, lr], got -1")])
def test_min_lr_bound_is_printed_readably(tmp_path, tool, value, message):
    args = ([*SMALL, "--lr", "1e-4"] if tool == "megaslide-run" else
            ["--plan", tmp_path / "unread.json"])
    result = run(*args, "--steps", 1, "--lr-schedule", "warmup-cosine",
                 "--min-lr", value, tool=tool, check=False)
    assert result.returncode == 1, result.out
    assert message in result.out, result.out
    assert "lr = 0.00]" not in result.out, result.out
    assert "INF" not in result.out, result.out


def test_host_memory_parts_show_their_size():
    env = dict(os.environ, MEGASLIDE_HOST_MEMORY="1MB")
    result = run(*SMALL, "--steps", 1, env=env, check=False)
    assert result.returncode == 1, result.out
    assert "this machine has 1.00 MB (0.95 MiB)" in result.out, result.out
    assert "0.00 GiB" not in result.out, result.out


# 24. Other trainers' flags get their equivalent; nothing that deletes work
# is suggested by spelling.

@pytest.mark.parametrize("flag,answer", [
    ("--gradient_checkpointing",
     "MegaSlide's equivalent is --activation-policy recompute"),
    ("--resume-from-checkpoint", "MegaSlide's equivalent is --resume"),
    ("--resume_from_checkpoint=latest", "MegaSlide's equivalent is --resume"),
    ("--learning_rate", "MegaSlide's equivalent is --lr"),
    ("--network_dim", "not supported: LoRA is not supported"),
    ("--num_processes", "not supported: one process per GPU"),
    ("--max_grad_norm", "MegaSlide spells it --max-grad-norm"),
    # diffusers' logit_normal samples the times; MegaSlide's weighs.
    ("--weighting_scheme=logit_normal", "MegaSlide's equivalent is "
     "--weighting-scheme sigma_sqrt or cosmap (diffusers' logit_normal is "
     "--timestep-sampling logit-normal)")])
def test_ecosystem_flags_are_answered(flag, answer):
    result = run(*SMALL, "--steps", 1, flag, "1e-4", check=False)
    assert result.returncode == 1, result.out
    assert answer in result.out, result.out
    assert "overwrite" not in result.out, result.out


@pytest.mark.parametrize("flag,answer", [
    ("--train_batch_size", "MegaSlide's equivalent is --batch\n"),
    ("--gradient_checkpointing",
     "MegaSlide's equivalent is --activation-policy recompute"),
    ("--learning_rate", "MegaSlide's equivalent is --lr\n"),
    ("--checkpointing_steps", "MegaSlide's equivalent is --checkpoint-every "
     "(a flag of megaslide-run, not of megaslide-plan)"),
    ("--num_processes", "not supported: one process per GPU")])
def test_planner_answers_ecosystem_flags_too(flag, answer):
    result = subprocess.run(
        [tool_path("megaslide-plan"), "--model", "tiny", "--frames", "5",
         "--height", "64", "--width", "64", flag, "2"],
        capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert answer in result.stderr, result.stderr


@pytest.mark.parametrize("flag", ["--overwrite-checkpoint",
                                  "--overwrite_checkpoints",
                                  "--rewrite-checkpoints"])
def test_no_destructive_suggestion_by_spelling(flag):
    result = run(*SMALL, "--steps", 1, flag, check=False)
    assert result.returncode == 1, result.out
    assert "Unknown command line argument" in result.out, result.out
    assert "--overwrite-checkpoints" not in result.out, result.out


def test_values_that_look_like_flags_are_values():
    result = run(*SMALL, "--steps", 1, "--min-lr", "-1", check=False)
    assert "--min-lr must be" in result.out, result.out


def test_ecosystem_table_is_documented_and_names_real_flags():
    table = run("--print-ecosystem-flags").stdout
    assert table.count("\n") > 40
    assert table in (DOCS / "Training.md").read_text()
    help_text = run("--help-hidden").stdout
    targets = re.findall(r"\| `--([a-z0-9-]+)`[^|]*\|$", table, re.M)
    assert len(targets) > 25
    for target in targets:
        assert re.search(rf"--{target}\b", help_text), target
