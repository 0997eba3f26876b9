"""Data parallelism on the cpu backend under mpirun (issue 28).

A job of N ranks, each taking K micro-batches of a step, is the same run as
one process taking N K (--grad-accum): the same global batches in the same
order, the gradient summed over the ranks before the one deferred decision.
With N = 2 the sums are of two terms, so the job is bit-identical to one
process; with N = 4 the ranks' partial sums may be added in another order
than one process adds its micro-batches, so the figures agree within f32
rounding (stated below). docs/Distributed.md states what these tests hold.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import megaslide
from conftest import tool_path

SMALL = ["--model", "tiny", "--frames", "5", "--height", "32", "--width",
         "32", "--backend", "cpu", "--no-progress", "--max-grad-norm", "1"]
# Open MPI refuses root unless told; oversubscribed: more ranks than cores.
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
# N = 4 against --grad-accum 4: f32 sums in another order.
RTOL = 1e-5


def mpirun():
    path = shutil.which("mpirun")
    plugin = pathlib.Path(tool_path("megaslide-run")).parents[1] / "lib" / \
        "libMegaSlideMpi.so"
    missing = [what for what, ok in (("mpirun", path),
                                     ("the MPI plugin", plugin.exists()))
               if not ok]
    if missing:
        if os.environ.get("MEGASLIDE_REQUIRE_MPI") == "1":
            pytest.fail(f"{' and '.join(missing)} missing (install-deps.sh "
                        f"installs Open MPI)")
        pytest.skip(f"{' and '.join(missing)} missing")
    return path


def run(*args, ranks=1, check=True, timeout=300):
    cmd = [tool_path("megaslide-run"), *map(str, args)]
    if ranks > 1:
        cmd = [mpirun(), "-np", str(ranks), *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV,
                            timeout=timeout)
    result.out = result.stdout + result.stderr
    if check and result.returncode != 0:
        raise AssertionError(result.out)
    return result


def metrics(path):
    return [(l["step"], l["loss"], l["grad_norm"], l["clipped"])
            for l in map(json.loads, pathlib.Path(path).read_text()
                         .splitlines())]


def weights(folder):
    return (pathlib.Path(folder) / "diffusion_pytorch_model.safetensors") \
        .read_bytes()


def tensors(folder):
    from safetensors.numpy import load_file
    return load_file(pathlib.Path(folder) /
                     "diffusion_pytorch_model.safetensors")


def test_two_ranks_are_one_process_with_grad_accum_2(tmp_path):
    mpirun()
    run(*SMALL, "--steps", "6", "--grad-accum", "2", "--metrics",
        tmp_path / "one.jsonl", "--save-weights", tmp_path / "one")
    job = run(*SMALL, "--steps", "6", "--metrics", tmp_path / "two.jsonl",
              "--save-weights", tmp_path / "two", ranks=2)
    # The EMA (and the schedule) follow the one decision on every rank.
    ema = ["--ema-decay", "0.9", "--lr-schedule", "warmup-cosine",
           "--warmup-steps", "2", "--save-ema"]
    run(*SMALL, *ema, "--steps", "4", "--grad-accum", "2", "--save-weights",
        tmp_path / "ema-one")
    run(*SMALL, *ema, "--steps", "4", "--save-weights", tmp_path / "ema-two",
        ranks=2)
    assert weights(tmp_path / "ema-two") == weights(tmp_path / "ema-one")
    assert metrics(tmp_path / "two.jsonl") == metrics(tmp_path / "one.jsonl")
    assert weights(tmp_path / "two") == weights(tmp_path / "one")
    # Rank 0 speaks for the job: one banner, one progress line per step.
    assert job.stdout.count("on the cpu backend") == 1, job.out
    assert job.stderr.count("step 6/6") == 1, job.out


def test_four_ranks_agree_with_grad_accum_4_and_repeat_bitwise(tmp_path):
    mpirun()
    run(*SMALL, "--steps", "5", "--grad-accum", "4", "--metrics",
        tmp_path / "one.jsonl", "--save-weights", tmp_path / "one")
    for name, ranks, accum in (("four", 4, 1), ("again", 4, 1),
                               ("two-by-two", 2, 2)):
        run(*SMALL, "--steps", "5", "--grad-accum", accum, "--metrics",
            tmp_path / f"{name}.jsonl", "--save-weights", tmp_path / name,
            ranks=ranks)
    one = metrics(tmp_path / "one.jsonl")
    for name in ("four", "two-by-two"):
        job = metrics(tmp_path / f"{name}.jsonl")
        assert [m[0] for m in job] == [m[0] for m in one]
        np.testing.assert_allclose([m[1:3] for m in job],
                                   [m[1:3] for m in one], rtol=RTOL)
        a, b = tensors(tmp_path / "one"), tensors(tmp_path / name)
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=RTOL, atol=1e-7,
                                       err_msg=key)
    assert metrics(tmp_path / "again.jsonl") == \
        metrics(tmp_path / "four.jsonl")
    assert weights(tmp_path / "again") == weights(tmp_path / "four")


def test_a_jobs_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    mpirun()
    run(*SMALL, "--steps", "6", "--grad-accum", "2", "--checkpoint-dir",
        tmp_path / "whole")
    run(*SMALL, "--steps", "3", "--checkpoint-dir", tmp_path / "parts",
        ranks=2)
    # One process continues the 2-rank job with its global batch.
    run(*SMALL, "--steps", "3", "--grad-accum", "2", "--resume",
        "--checkpoint-dir", tmp_path / "parts")
    for f in (tmp_path / "whole" / "step-000006").iterdir():
        assert f.read_bytes() == \
            (tmp_path / "parts" / "step-000006" / f.name).read_bytes(), f.name
    # Another global batch is another run: named, not resumed.
    other = run(*SMALL, "--steps", "1", "--resume", "--checkpoint-dir",
                tmp_path / "parts", check=False)
    assert other.returncode == 1
    assert "grad_accum: 2 in the checkpoint, 1 now" in other.out, other.out


def test_ranks_given_different_commands_refuse(tmp_path):
    tool = tool_path("megaslide-run")
    cmd = [mpirun(), "-np", "1", tool, *SMALL, "--steps", "2", ":",
           "-np", "1", tool, *SMALL, "--steps", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV,
                            timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the ranks of this job disagree on the command line: rank 1 on" \
        in out, out


def test_a_job_plans_its_collectives_on_sim_and_cuda_not_cpu(tmp_path):
    # The sim and cuda backends plan the launcher's job (its collectives
    # on the devices); the cpu backend one rank's step.
    mpirun()
    plans = {}
    for backend in ("sim", "cpu"):
        path = tmp_path / f"{backend}.json"
        args = [a for a in SMALL if a not in ("--backend", "cpu")]
        run(*args, "--backend", backend, "--steps", "0", "--save-plan", path,
            ranks=2)
        plans[backend] = json.loads(path.read_text())
    ops = {b: [i["op"] for i in p["instructions"]] for b, p in plans.items()}
    assert ops["sim"].count("all_gather") == ops["sim"].count("fetch") > 0
    assert ops["sim"].count("reduce_scatter") > 0
    assert "all_gather" not in ops["cpu"] and "reduce_scatter" not in ops["cpu"]
    for inst in plans["sim"]["instructions"]:
        if inst["op"] in ("all_gather", "reduce_scatter"):
            assert inst["cost"]["ranks"] == 2 and inst["cost"]["nodes"] == 1
    # The model's fields, which megaslide-translate cannot fill in.
    assert plans["sim"]["model"] == "tiny" and plans["sim"]["grid"]


def test_what_a_job_cannot_do_is_said(tmp_path):
    mpirun()
    # Each rank plans the job's step and fails alone, without a GPU, and
    # tells the others, who do not wait for it.
    cuda = run(*SMALL, "--backend", "cuda", "--steps", "1", ranks=2,
               check=False)
    assert cuda.returncode != 0
    assert "rank 0 on" in cuda.out and "rank 1 on" in cuda.out, cuda.out
    assert "CUDA" in cuda.out, cuda.out
    grads = run(*SMALL, "--steps", "1", "--save-gradients", tmp_path / "g",
                ranks=2, check=False)
    assert "--save-gradients writes one process's gradients" in grads.out
    env = dict(ENV, MEGASLIDE_MPI_PLUGIN=str(tmp_path / "none.so"))
    result = subprocess.run([mpirun(), "-np", "2", tool_path("megaslide-run"),
                             *SMALL, "--steps", "1"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "the MPI plugin cannot be loaded" in result.stdout + result.stderr


def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    # mpirun turns its SIGINT into SIGTERM to the ranks; they agree on the
    # step to stop at, rank 0 saves it and prints the launch to continue.
    launcher = subprocess.Popen(
        [mpirun(), "-np", "2", tool_path("megaslide-run"), *SMALL,
         "--steps", "100000", "--checkpoint-dir", tmp_path / "ck",
         "--metrics", tmp_path / "m.jsonl"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and (
            not (tmp_path / "m.jsonl").exists() or
            len((tmp_path / "m.jsonl").read_text().splitlines()) < 5):
        time.sleep(0.05)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=120)
    # Rank 0 alone speaks: one warning, with the command that continues.
    warnings = [l for l in err.splitlines() if "stopped by SIGTERM" in l]
    assert len(warnings) == 1, out + err
    assert "to continue (with the launcher's own options too): mpirun " \
        "-np 2 " in warnings[0], warnings
    saved = [p.name for p in (tmp_path / "ck").iterdir()
             if p.name.startswith("step-")]
    assert len(saved) == 1, saved
    step = int(saved[0].split("-")[1])
    assert metrics(tmp_path / "m.jsonl")[-1][0] == step


def test_a_killed_rank_ends_the_job_and_its_checkpoint_resumes(tmp_path):
    launcher = subprocess.Popen(
        [mpirun(), "-np", "2", tool_path("megaslide-run"), *SMALL,
         "--steps", "100000", "--checkpoint-dir", tmp_path / "ck",
         "--checkpoint-every", "20", "--metrics", tmp_path / "m.jsonl"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "ck" / "latest").exists():
        time.sleep(0.05)
    ranks = subprocess.run(["pgrep", "-P", str(launcher.pid)],
                           capture_output=True, text=True).stdout.split()
    assert len(ranks) == 2, ranks
    killed = time.time()
    os.kill(int(ranks[-1]), signal.SIGKILL)
    out, err = launcher.communicate(timeout=60)
    # Open MPI ends the others at once and names the rank and node.
    assert time.time() - killed < 30
    assert launcher.returncode != 0
    assert "exited on signal 9" in out + err, out + err
    resumed = run(*SMALL, "--steps", "2", "--resume", "--checkpoint-dir",
                  tmp_path / "ck", ranks=2)
    assert "resumed at step" in resumed.out


def test_the_trainer_refuses_to_be_a_rank(tmp_path):
    script = ("import megaslide\n"
              "try:\n"
              "    megaslide.Trainer('tiny', 5, 32, 32)\n"
              "except RuntimeError as e:\n"
              "    print('refused:', e)\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([mpirun(), "-np", "2", sys.executable, "-c",
                             script], capture_output=True, text=True,
                            env=env, timeout=120)
    out = result.stdout + result.stderr
    assert out.count("refused: megaslide.Trainer runs in one process, and "
                     "this is rank") == 2, out


def test_a_hung_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    # Rank 1 hangs before step 3 (a test-only fault): rank 0 waits in its
    # next collective, its watchdog ends it after --collective-timeout with
    # exit 5, and the launcher ends the hung rank.
    env = dict(ENV, MEGASLIDE_FAULT_HANG="1@3")
    started = time.time()
    result = subprocess.run(
        [mpirun(), "-np", "2", tool_path("megaslide-run"), *SMALL,
         "--steps", "10", "--collective-timeout", "2", "--checkpoint-dir",
         tmp_path / "ck", "--checkpoint-every", "1"],
        capture_output=True, text=True, env=env, timeout=120)
    out = result.stdout + result.stderr
    assert time.time() - started < 60, out
    assert result.returncode != 0, out
    assert "rank 0 on " in out and "has waited 2 s for the other ranks " \
        "(--collective-timeout 2): a rank has hung or died" in out, out
    # The steps before the hang are checkpointed and resume.
    assert (tmp_path / "ck" / "step-000002").is_dir()


def host_need(out):
    """The bytes a failed host-memory check says a process needs."""
    import re
    found = re.search(r"needs ([\d.]+) (KB|MB)", out)
    assert found, out
    return float(found[1]) * {"KB": 1e3, "MB": 1e6}[found[2]]


def test_the_host_memory_check_counts_every_rank_on_the_node(tmp_path):
    # Each rank holds a quarter of the state but its own buffers of the
    # step: 4 ranks need less than 4 processes, more than one, and a node
    # with room for one but not for the 4 says so.
    def need(ranks, limit):
        cmd = [tool_path("megaslide-run"), *SMALL, "--steps", "1"]
        if ranks > 1:
            cmd = [mpirun(), "-np", str(ranks), *cmd]
        return subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(ENV, MEGASLIDE_HOST_MEMORY=limit),
                              timeout=120)
    need_one = host_need(need(1, "1KB").stderr)
    tiny_node = need(4, "1KB")
    need_job = host_need(tiny_node.stdout + tiny_node.stderr)
    assert need_one < need_job < 4 * need_one, (need_one, need_job)
    between = f"{int((need_one + need_job) / 2)}"
    assert need(1, between).returncode == 0
    job = need(4, between)
    out = job.stdout + job.stderr
    assert job.returncode != 0
    assert "(4 ranks on this node, this one " in out and \
        "the state is sharded, the buffers of the step are every rank's), " \
        "but this machine has" in out, out


def write_samples(folder, count, seed):
    from safetensors.numpy import save_file
    shapes = megaslide.Trainer("tiny", frames=5, height=32,
                               width=32).input_shapes()
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for k in range(count):
        save_file({"latents": rng.standard_normal(shapes["latents"][1:])
                   .astype(np.float32),
                   "condition": rng.standard_normal(shapes["condition"][1:])
                   .astype(np.float32)},
                  os.fspath(folder / f"s{k}.safetensors"))


def one_and_two_ranks(common, tmp_path):
    """The metrics records of `common` in one process with --grad-accum 2
    and in a job of 2 ranks."""
    run(*common, "--grad-accum", 2, "--metrics", tmp_path / "one.jsonl")
    run(*common, "--metrics", tmp_path / "two.jsonl", ranks=2)
    return [[json.loads(l) for l in (tmp_path / f"{n}.jsonl").read_text()
             .splitlines()] for n in ("one", "two")]


def test_file_data_logit_normal_times_and_shared_validation(tmp_path):
    # Samples from files, times with two draws each (logit-normal) and a
    # validation set of 5 batches split 3 + 2 over the ranks: the job is
    # the one process again.
    mpirun()
    write_samples(tmp_path / "data", 6, seed=1)
    write_samples(tmp_path / "val", 5, seed=2)
    common = [*SMALL, "--data", tmp_path / "data", "--init", "random",
              "--val-data", tmp_path / "val", "--val-every", 2,
              "--timestep-sampling", "logit-normal", "--steps", 4]
    one, two = one_and_two_ranks(common, tmp_path)
    assert metrics(tmp_path / "two.jsonl") == metrics(tmp_path / "one.jsonl")
    vals = [(l["step"], l.get("val_loss")) for l in one]
    assert [v for _, v in vals if v is not None], vals
    np.testing.assert_allclose([l.get("val_loss") or 0 for l in two],
                               [l.get("val_loss") or 0 for l in one],
                               rtol=1e-6)


def test_a_weighted_loss_is_the_one_process_too(tmp_path):
    # Each rank weighs its micro-batches by their own times
    # (--weighting-scheme); the job's loss and unweighted loss are the one
    # process's.
    mpirun()
    common = [*SMALL, "--weighting-scheme", "sigma_sqrt", "--steps", 3]
    one, two = one_and_two_ranks(common, tmp_path)
    assert metrics(tmp_path / "two.jsonl") == metrics(tmp_path / "one.jsonl")
    assert [l["unweighted_loss"] for l in two] == \
        [l["unweighted_loss"] for l in one]
    assert all(l["unweighted_loss"] != l["loss"] for l in one), one


def test_one_ranks_failure_ends_the_job_at_once(tmp_path):
    # Rank 0 alone finds the checkpoint folder of an earlier run: the job
    # ends with its message, not after the others time out waiting for it.
    run(*SMALL, "--steps", "1", "--checkpoint-dir", tmp_path / "ck")
    started = time.time()
    job = run(*SMALL, "--steps", "2", "--checkpoint-dir", tmp_path / "ck",
              "--collective-timeout", "60", ranks=2, check=False)
    assert time.time() - started < 30, job.out
    assert job.returncode == 1, job.out
    assert "rank 0 on " in job.out and "holds checkpoints of an earlier " \
        "run" in job.out, job.out
    assert "has waited" not in job.out, job.out
    # And mid-run: rank 0's checkpoint disk fills up at step 2.
    env = dict(ENV, MEGASLIDE_FAULT_WRITE_LIMIT="3000000")
    started = time.time()
    result = subprocess.run(
        [mpirun(), "-np", "2", "-x", "MEGASLIDE_FAULT_WRITE_LIMIT",
         tool_path("megaslide-run"), *SMALL, "--steps", "20",
         "--checkpoint-dir", tmp_path / "full", "--checkpoint-every", "1",
         "--collective-timeout", "60"],
        capture_output=True, text=True, env=env, timeout=120)
    out = result.stdout + result.stderr
    assert time.time() - started < 30, out
    assert result.returncode != 0, out
    assert "No space left on device" in out or "ENOSPC" in out, out
    assert "has waited" not in out, out


def test_buckets_and_the_runtime_only_executor(tmp_path):
    # Micro-batches of two shapes drawn over the ranks (each rank's source
    # reads ahead its own), and megaslide-exec running a saved plan as a
    # rank: the job is the one process again.
    mpirun()
    from test_buckets import LARGE, SMALL as SHAPE, write_buckets, \
        write_sample
    data = tmp_path / "data"
    data.mkdir()
    for k in range(6):
        write_sample(data / f"a{k}.safetensors", SHAPE, k)
    for k in range(4):
        write_sample(data / f"b{k}.safetensors", LARGE, 10 + k)
    write_buckets(data / "buckets.json", [SHAPE, LARGE])
    common = ["--model", "tiny", "--backend", "cpu", "--no-progress",
              "--data", data, "--init", "random", "--plan-cache",
              tmp_path / "cache", "--steps", 5]
    one, two = one_and_two_ranks(common, tmp_path)
    assert [(l["loss"], l["grad_norm"]) for l in two] == \
        [(l["loss"], l["grad_norm"]) for l in one]
    # Both shapes were drawn, and rank 0 logs its own micro-batch's.
    assert {b for l in one for b in l["bucket"]} == {"5x32x32", "9x32x48"}
    assert [l["bucket"] for l in two] == [l["bucket"][0] for l in one]

    exec_tool = pathlib.Path(tool_path("megaslide-exec"))
    run(*SMALL, "--steps", "0", "--save-plan", tmp_path / "plan.json")
    run(*SMALL, "--steps", "4", "--grad-accum", "2", "--metrics",
        tmp_path / "run.jsonl")
    result = subprocess.run(
        [mpirun(), "-np", "2", exec_tool, "--plan", tmp_path / "plan.json",
         "--backend", "cpu", "--no-progress", "--max-grad-norm", "1",
         "--steps", "4", "--metrics", tmp_path / "exec.jsonl"],
        capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert metrics(tmp_path / "exec.jsonl") == metrics(tmp_path / "run.jsonl")


def test_checkpoints_reshard_over_any_number_of_ranks(tmp_path):
    # One run of 8 steps at a global batch of 4 micro-batches, continued by
    # jobs of 1 -> 4 -> 2 -> 1 ranks: each rank reads its shard of the state
    # from the files of whatever job wrote the checkpoint, and the run is
    # the uninterrupted one's.
    mpirun()
    run(*SMALL, "--steps", "8", "--grad-accum", "4", "--metrics",
        tmp_path / "ref.jsonl", "--save-weights", tmp_path / "ref")
    ck = ["--checkpoint-dir", tmp_path / "ck", "--metrics",
          tmp_path / "m.jsonl"]
    run(*SMALL, "--steps", "2", "--grad-accum", "4", *ck)
    for ranks, accum in ((4, 1), (2, 2)):
        run(*SMALL, "--steps", "2", "--grad-accum", accum, "--resume", *ck,
            ranks=ranks)
        step = tmp_path / "ck" / f"step-{2 + 2 * (4 // ranks):06d}"
        assert sorted(p.name for p in step.iterdir()) == sorted(
            ["manifest.json", "trainer.json"] +
            [f"state-rank-{r:05d}-of-{ranks:05d}.safetensors"
             for r in range(ranks)]), step
        manifest = json.loads((step / "manifest.json").read_text())
        assert (manifest["version"], manifest["ranks"]) == (2, ranks)
    run(*SMALL, "--steps", "2", "--grad-accum", "4", "--resume", *ck,
        "--save-weights", tmp_path / "end")
    got, ref = metrics(tmp_path / "m.jsonl"), metrics(tmp_path / "ref.jsonl")
    assert [m[0] for m in got] == list(range(1, 9))
    np.testing.assert_allclose([m[1:3] for m in got], [m[1:3] for m in ref],
                               rtol=RTOL)
    a, b = tensors(tmp_path / "ref"), tensors(tmp_path / "end")
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=RTOL, atol=1e-7,
                                   err_msg=key)


def host_parts(out):
    """The parts of a failed host-memory check: {what: bytes}."""
    import re
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return {m[3]: float(m[1]) * units[m[2]] for m in re.finditer(
        r"^\s+([\d.]+) (B|KB|MB|GB) \([^)]*\)  (.+)$", out, re.M)}


def test_each_rank_holds_its_share_of_the_state(tmp_path):
    # The check's accounting: masters, moments and EMA are 1/N per rank.
    def parts(ranks):
        cmd = [tool_path("megaslide-run"), *SMALL, "--steps", "1",
               "--ema-decay", "0.9"]
        if ranks > 1:
            cmd = [mpirun(), "-np", str(ranks), *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True,
                                env=dict(ENV, MEGASLIDE_HOST_MEMORY="1KB"),
                                timeout=120)
        return host_parts(result.stdout + result.stderr)
    one, four = parts(1), parts(4)
    state_one = one["host state (fp32 masters, AdamW moments)"]
    state_four = four["host state (this rank's shard of the fp32 masters "
                      "and AdamW moments)"]
    ema_one, ema_four = one["EMA of the weights"], four["EMA of the weights"]
    # Rank 0's shard is the largest: a quarter, rounded up to 16 elements
    # per tensor (the sizes are printed to 3 digits).
    assert 0.249 <= state_four / state_one < 0.27, (state_one, state_four)
    assert 0.249 <= ema_four / ema_one < 0.27, (ema_one, ema_four)


def test_a_rank_killed_while_checkpointing_leaves_no_partial_checkpoint(
        tmp_path):
    # A checkpoint every step, rank 1 killed at a random moment: every
    # step folder is complete (its manifest lists files that all load),
    # `latest` names one, and the run continues from it as the
    # uninterrupted run does.
    import random
    rng = random.Random(28)
    run(*SMALL, "--steps", "40", "--grad-accum", "2", "--metrics",
        tmp_path / "ref.jsonl")
    ref = metrics(tmp_path / "ref.jsonl")
    killed = 0
    for trial in range(3):
        ck = tmp_path / f"ck{trial}"
        launcher = subprocess.Popen(
            [mpirun(), "-np", "2", tool_path("megaslide-run"), *SMALL,
             "--steps", "40", "--checkpoint-dir", ck, "--checkpoint-every",
             "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=ENV)
        deadline = time.time() + 120
        while time.time() < deadline and not (ck / "latest").exists():
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 1.0))
        ranks = subprocess.run(["pgrep", "-P", str(launcher.pid)],
                               capture_output=True, text=True).stdout.split()
        if len(ranks) == 2:
            os.kill(int(ranks[-1]), signal.SIGKILL)
        launcher.communicate(timeout=60)
        killed += launcher.returncode != 0
        steps = sorted(p for p in ck.iterdir() if p.name.startswith("step-"))
        assert steps, list(ck.iterdir())
        for step in steps:
            manifest = json.loads((step / "manifest.json").read_text())
            for f in manifest["files"]:
                assert (step / f["name"]).stat().st_size == f["bytes"]
        latest = (ck / "latest").read_text().strip()
        assert (ck / latest / "manifest.json").exists()
        done = int(latest.split("-")[1])
        if done >= 40:
            continue
        # The one process continues the job (its global batch).
        run(*SMALL, "--steps", "2", "--grad-accum", "2", "--resume",
            "--checkpoint-dir", ck, "--metrics", tmp_path / f"r{trial}.jsonl")
        assert metrics(tmp_path / f"r{trial}.jsonl") == \
            ref[done:done + 2], (trial, done)
    assert killed, "every job ended before its rank was killed"


def test_a_bf16_ema_is_sharded_checkpointed_and_saved(tmp_path):
    # The EMA kept in bf16 is sharded like its master: a 2-rank job's
    # checkpoint continued in one process saves the uninterrupted run's EMA
    # weights, bit for bit.
    mpirun()
    ema = ["--ema-decay", "0.9", "--ema-dtype", "bf16", "--save-ema"]
    run(*SMALL, *ema, "--steps", "4", "--grad-accum", "2", "--save-weights",
        tmp_path / "ref")
    ck = ["--checkpoint-dir", tmp_path / "ck"]
    run(*SMALL, "--ema-decay", "0.9", "--ema-dtype", "bf16", "--steps", "2",
        *ck, ranks=2)
    run(*SMALL, *ema, "--steps", "2", "--grad-accum", "2", "--resume", *ck,
        "--save-weights", tmp_path / "end")
    assert weights(tmp_path / "end") == weights(tmp_path / "ref")


def mid_config(path):
    config = json.loads((pathlib.Path(__file__).parents[2] / "configs" /
                         "tiny.json").read_text())
    config.update(name="mid", num_layers=4, num_attention_heads=8,
                  attention_head_dim=64, ffn_dim=4096, text_dim=512)
    path.write_text(json.dumps(config))
    return path


def test_a_mid_config_job_is_one_process(tmp_path):
    # A 27.7M-parameter config (benchmarks/dp_host_memory.sh's): 2 and 4
    # ranks against one process at the same global batch of 4.
    mpirun()
    model = ["--model", mid_config(tmp_path / "mid.json"), *SMALL[2:]]
    run(*model, "--steps", "3", "--grad-accum", "4", "--metrics",
        tmp_path / "one.jsonl", "--save-weights", tmp_path / "one")
    for ranks in (2, 4):
        run(*model, "--steps", "3", "--grad-accum", 4 // ranks, "--metrics",
            tmp_path / f"{ranks}.jsonl", "--save-weights",
            tmp_path / f"w{ranks}", ranks=ranks)
        job, one = metrics(tmp_path / f"{ranks}.jsonl"), \
            metrics(tmp_path / "one.jsonl")
        np.testing.assert_allclose([m[1:3] for m in job],
                                   [m[1:3] for m in one], rtol=RTOL)
        a, b = tensors(tmp_path / "one"), tensors(tmp_path / f"w{ranks}")
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=RTOL, atol=1e-7,
                                       err_msg=key)
