#!/usr/bin/env python3
"""Kills and resumes megaslide-run in 30 recipe and data scenarios and
compares every result with an uninterrupted run, bit for bit.

    scripts/resume-scenarios.py [--scenarios NAME ...] [--seed S]
        [--tools DIR] [--repeat K] [--list] [--keep DIR]

Each scenario is a tiny run on the cpu backend (a learning-rate schedule,
accumulation, EMA, clipping, the update mode, precision, validation,
checkpoint cadence, --steps or --max-steps, synthetic data, one shape of
files, or buckets). It runs once uninterrupted (the reference), then K
times interrupted: a kill -9, SIGINT or SIGTERM after a random step (one in
eight while the run plans, before its first step), then the resume, which
may be interrupted again (1 to 3 interruptions in all), until the run is
done. After a signal the resume is the command the run printed (`to
continue: ...`); after kill -9 it is what a user would type (docs/Runtime.md,
"Long runs"): the same command with --resume, and with --steps the steps
the latest checkpoint leaves (with --max-steps, the total, nothing to
change); with no checkpoint yet, the same command again; with no `latest`
(a kill between the first checkpoint and it), `latest` written as the
resume's error says. Then the metrics log (every field but the measured
ones, METRICS_MEASURED), every checkpoint both runs kept (state.safetensors,
trainer.json, manifest.json, latest) and the --save-weights folder (the EMA
with --save-ema) must equal the reference's.

Prints one line per scenario and a summary; exits 1 naming the scenario,
the file, the field or tensor and the step of every difference. The seed
(printed) chooses the interruptions; their timing on a loaded machine
varies, so a failure is reproduced by its scenario and seed, and perhaps a
few --repeat. docs/Testing.md ("Fault injection") has the figures;
test/python/test_resume_scenarios.py runs three scenarios in the suite.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Metrics fields that measure the machine rather than the training: the
# step's wall time and the rates derived from it, the process's resident
# memory (a resumed process has not run the earlier steps, so its heap
# differs) and the measured device arena (a measurement, checked against
# the plan elsewhere). Every other field (loss, lr, grad_norm, clipped,
# skipped, micro_batches, val_loss, bucket, lr_decay_steps) is compared.
METRICS_MEASURED = {"seconds", "samples_per_second", "tokens_per_second",
                    "host_rss_bytes", "device_peak_bytes"}

# trainer.json and its trainer state hold no time, pid or host name: the
# step, the seed, the data generator's state, the EMA's update count, the
# steps run, the previous step's norm and the settings (the data folder by
# its real path, which the two runs share). So no field is left out; a new
# field that legitimately differs goes here, with why.
TRAINER_EXEMPT = set()

# The tiny preset: 16 latent channels, text of 16 tokens of 32 dimensions.
# Steps of this size take tens of milliseconds on the cpu backend, long
# enough for a signal to land inside a run of 12-20 steps.
SHAPE = (17, 96, 96)
BUCKETS = {"b2": [SHAPE, (9, 64, 96)],
           "b3": [SHAPE, (9, 64, 96), (13, 80, 80)]}


def shape_flags(shape):
    return ["--frames", str(shape[0]), "--height", str(shape[1]),
            "--width", str(shape[2])]


@dataclasses.dataclass
class Scenario:
    name: str
    steps: int
    flags: list
    every: int = 4  # --checkpoint-every
    total: bool = False  # --max-steps instead of --steps
    data: str = ""  # "" (synthetic), "one" (files of SHAPE), "b2", "b3"
    val: str = ""  # --val-data: "", "one", "b2", "b3"
    save_ema: bool = False


def _scenarios():
    S = Scenario
    cos = ["--lr-schedule", "warmup-cosine", "--warmup-steps", "2"]
    lin = ["--lr-schedule", "warmup-linear", "--warmup-steps", "2"]
    ema_bf16 = ["--ema-decay", "0.95", "--ema-dtype", "bf16"]
    stream = ["--update", "streaming"]
    return [
        S("constant", 12, []),
        S("constant-max-steps", 14, [], every=3, total=True),
        S("checkpoint-at-end-only", 12, [], every=0),
        S("warmup-constant", 12,
          ["--lr-schedule", "warmup-constant", "--warmup-steps", "4"],
          every=5),
        S("cosine", 16, [*cos, "--min-lr", "1e-4", "--lr-decay-steps", "16"]),
        S("cosine-max-steps", 18, cos, every=3, total=True),
        S("cosine-long-horizon", 15, [*cos, "--lr-decay-steps", "40"]),
        S("linear", 14, [*lin, "--min-lr", "2e-4", "--lr-decay-steps", "14"],
          every=3),
        S("linear-past-horizon", 14, [*lin, "--lr-decay-steps", "10"]),
        S("accum-2", 12, ["--grad-accum", "2"], every=3),
        S("accum-3-cosine", 12,
          ["--grad-accum", "3", *cos, "--lr-decay-steps", "12"]),
        S("ema-f32", 14, ["--ema-decay", "0.9"], save_ema=True),
        S("ema-bf16", 14, ema_bf16, every=3, save_ema=True),
        S("ema-warmup-accum-2", 12,
          ["--ema-decay", "0.999", "--ema-warmup", "--grad-accum", "2"],
          save_ema=True),
        S("clip", 14, ["--max-grad-norm", "0.5"]),
        S("clip-accum-2-cosine", 12,
          ["--max-grad-norm", "2", "--grad-accum", "2", *cos], every=5),
        S("streaming", 14, stream),
        S("streaming-clip", 14, [*stream, "--max-grad-norm", "3"], every=3),
        S("streaming-ema-bf16", 14, [*stream, *ema_bf16], save_ema=True),
        S("f32", 12, ["--precision", "f32"]),
        S("f32-accum-3-ema-max-steps", 12,
          ["--precision", "f32", "--grad-accum", "3", "--ema-decay", "0.9"],
          every=3, total=True, save_ema=True),
        S("timesteps-batch-2", 14,
          ["--timestep-sampling", "logit-normal", "--logit-mean", "0.3",
           "--logit-std", "0.8", "--flow-shift", "3", "--batch", "2",
           "--seed", "5", "--weight-decay", "0.01"]),
        S("data", 14, [], data="one"),
        S("data-val", 14, ["--val-every", "3"], data="one", val="one"),
        S("data-val-linear-max-steps", 16, [*lin, "--val-every", "5"],
          every=3, total=True, data="one", val="one"),
        S("buckets", 16, [], data="b2"),
        S("buckets-3-accum-3", 12, ["--grad-accum", "3"], every=3, data="b3"),
        S("buckets-val", 16, ["--val-every", "4"], every=3, data="b2",
          val="b2"),
        S("buckets-streaming-clip", 14, [*stream, "--max-grad-norm", "0.3"],
          data="b2"),
        S("buckets-everything", 15,
          ["--val-every", "3", "--grad-accum", "2", *cos, "--max-grad-norm",
           "0.3", *ema_bf16, "--precision", "f32"],
          total=True, data="b3", val="b3", save_ema=True),
    ]


SCENARIOS = {s.name: s for s in _scenarios()}


# ---------------------------------------------------------------------------
# Data: prepared samples as megaslide-prepare writes them (docs/Data.md), of
# random values, as test/python/test_buckets.py makes them.
# ---------------------------------------------------------------------------

def write_sample(path, shape, seed):
    import numpy as np
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    frames, height, width = shape
    latents = rng.standard_normal(
        (16, (frames - 1) // 4 + 1, height // 8, width // 8))
    tensors = {"latents": latents.astype(np.float32),
               "condition": rng.standard_normal((16, 32)).astype(np.float32)}
    meta = {"megaslide.format": "1", "megaslide.text_length": "16",
            "megaslide.caption": f"sample {seed}",
            "megaslide.source": f"video{seed}.mp4",
            "megaslide.caption_dropped": "0",
            "megaslide.bucket": "x".join(map(str, shape))}
    save_file(tensors, os.fspath(path), metadata=meta)


def make_data(folder, kind, validation=False):
    """A data folder of `kind` ("one", "b2", "b3"): 8 samples of SHAPE, or
    per bucket 6, 4, 3 samples and buckets.json; fewer, other samples for
    validation."""
    folder.mkdir(parents=True)
    shapes = [SHAPE] if kind == "one" else BUCKETS[kind]
    counts = [3 if validation else n for n in (8, 4, 3)] if kind == "one" \
        else [2 if validation else n for n in (6, 4, 3)]
    seed = 1000 if validation else 0
    for b, (shape, count) in enumerate(zip(shapes, counts)):
        for k in range(count):
            write_sample(folder / f"s{b}-{k}.safetensors", shape, seed)
            seed += 1
    if kind != "one":
        entries = [{"frames": f, "height": h, "width": w}
                   for f, h, w in shapes]
        (folder / "buckets.json").write_text(json.dumps({"buckets": entries}))
    return folder


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------

class Invocation:
    """A megaslide-run process whose console is read as it runs: the last
    step it reported (`step K/N` on stderr with --no-progress)."""

    def __init__(self, cmd, env, cwd):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env=env, cwd=cwd)
        self.out, self.err = [], []
        self.step = None
        self.readers = [threading.Thread(target=self._read, args=a)
                        for a in ((self.proc.stdout, self.out, False),
                                  (self.proc.stderr, self.err, True))]
        for t in self.readers:
            t.start()

    def _read(self, stream, lines, progress):
        for line in stream:
            lines.append(line)
            if progress and line.startswith("step "):
                try:
                    self.step = int(line.split()[1].split("/")[0])
                except ValueError:
                    pass

    def handles_signals(self):
        """Whether the run has installed its SIGINT handler (the caught
        signals of /proc/PID/status), which it does before it plans."""
        try:
            status = pathlib.Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return False
        caught = next(line for line in status.splitlines()
                      if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) >> (signal.SIGINT - 1) & 1)

    def wait_for(self, step, timeout=300):
        """Until the run reported `step` (None: until it handles signals,
        so before its first step), or ended; whether it still runs."""
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            if (self.handles_signals() if step is None else
                    self.step is not None and self.step >= step):
                return True
            time.sleep(0.001)
        return self.proc.poll() is None

    def finish(self, timeout=600):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise Failure(f"hung: {shlex.join(self.cmd)}")
        for t in self.readers:
            t.join()
        return self.proc.returncode

    def text(self):
        return "".join(self.out) + "".join(self.err)


class Failure(Exception):
    pass


def command(s, tools, folder, data):
    """The scenario's command line, writing into `folder`."""
    args = [os.path.abspath(pathlib.Path(tools) / "megaslide-run"),
            "--no-progress",
            "--backend", "cpu", "--model", "tiny"]
    if s.data:
        args += ["--data", os.fspath(data[s.data]), "--init", "random"]
    if s.data in ("", "one"):
        args += shape_flags(SHAPE)
    if s.val:
        args += ["--val-data", os.fspath(data["val-" + s.val])]
    args += [*s.flags, "--max-steps" if s.total else "--steps", str(s.steps),
             "--checkpoint-dir", os.fspath(folder / "ck"),
             "--checkpoint-every", str(s.every),
             "--metrics", os.fspath(folder / "metrics.jsonl"),
             "--save-weights", os.fspath(folder / "weights")]
    if s.save_ema:
        args.append("--save-ema")
    return args


def environment(work):
    # The buckets' plan cache in the work folder, not the user's.
    return dict(os.environ, MEGASLIDE_CACHE_DIR=os.fspath(work / "cache"),
                HF_HUB_OFFLINE="1")


def reference(s, tools, work, data):
    folder = work / s.name / "reference"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    run = Invocation(command(s, tools, folder, data), environment(work),
                     folder)
    if run.finish() != 0:
        raise Failure(f"the reference run failed "
                      f"(exit {run.proc.returncode}):\n{run.text()[-3000:]}")
    return folder


def steps_run(ck):
    """The steps the checkpoint a resume takes holds, or None: `latest`'s,
    or where a kill came before `latest` was first written, the newest
    complete one (docs/Runtime.md, "Checkpoints")."""
    latest = ck / "latest"
    if latest.exists():
        folder = ck / latest.read_text().strip()
    else:
        complete = sorted(p for p in ck.glob("step-*")
                          if (p / "manifest.json").exists())
        if not complete:
            return None
        folder = complete[-1]
    trainer = json.loads((folder / "trainer.json").read_text())
    state = json.loads(trainer["trainer_state"])
    return state.get("steps_run", state["step"])


def after_kill(s, cmd, ck, env):
    """What a user runs after kill -9: the same command, resumed from the
    latest checkpoint, with the steps it leaves (--steps), or afresh when
    there is none yet."""
    args = [a for a in cmd if a != "--resume"]
    done = steps_run(ck)
    if done is None:
        return args
    if not s.total:
        args[args.index("--steps") + 1] = str(s.steps - done)
    return args + ["--resume"]


KINDS = {"kill": signal.SIGKILL, "SIGINT": signal.SIGINT,
         "SIGTERM": signal.SIGTERM}


def interrupted(s, tools, work, data, rng, step_seconds, repeat, events):
    """The scenario interrupted and resumed until done; its folder. Appends
    to `events` the interruptions as (kind, the step the run had reported,
    the step it resumes from), with kind "late" where the run ended before
    the interruption landed."""
    folder = work / s.name / f"run-{repeat}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = environment(work)
    cmd = first = command(s, tools, folder, data)
    how = "the first run"
    budget = rng.randint(1, 3)  # interruptions of this run
    sent = 0
    for _ in range(2 * budget + 4):
        done = steps_run(folder / "ck") or 0
        run = Invocation(cmd, env, folder)
        kind = None
        if sent < budget and done < s.steps - 1:
            sent += 1
            kind = rng.choice(list(KINDS))
            # One in eight while the plan is made (the handlers installed,
            # no step taken), else after a step (its checkpoint's save
            # included, for kill -9).
            target = None if rng.random() < 1 / 8 else \
                rng.randint(done + 1, s.steps - 1)
            if run.wait_for(target):
                if kind == "kill":
                    time.sleep(rng.uniform(0, 1.5 * step_seconds))
                if run.proc.poll() is None:
                    run.proc.send_signal(KINDS[kind])
        rc = run.finish()
        seen = run.step
        if kind is not None:
            events.append((kind if rc != 0 else "late", seen,
                           steps_run(folder / "ck") or 0))
        if rc == 0:
            return folder
        sig = KINDS.get(kind)
        if kind in ("SIGINT", "SIGTERM") and rc == 128 + sig:
            lines = [line[len("to continue: "):] for line in run.out
                     if line.startswith("to continue: ")]
            if len(lines) != 1:
                raise Failure(f"stopped by {kind} without one 'to continue' "
                              f"line:\n{run.text()[-3000:]}")
            cmd = shlex.split(lines[0])
            how = f"the command printed after {kind} at step {seen}"
        elif kind is not None and rc == -sig:
            # kill -9, or a signal before the handlers were installed.
            cmd = after_kill(s, first, folder / "ck", env)
            how = f"the command after {kind} at step {seen}"
        else:
            raise Failure(f"exit {rc} of {how}: {shlex.join(run.cmd)}\n"
                          f"{run.text()[-3000:]}")
    raise Failure(f"not done after {sent} interruptions")


# ---------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------

def metrics_diffs(ref, got):
    def read(path):
        return {r["step"]: r for r in map(json.loads,
                                           path.read_text().splitlines())}
    a, b = read(ref), read(got)
    diffs = []
    if sorted(a) != sorted(b):
        diffs.append(f"metrics: steps {sorted(set(a) ^ set(b))} are in only "
                     f"one log (reference {len(a)} lines, resumed {len(b)})")
    for step in sorted(set(a) & set(b)):
        for field in sorted((set(a[step]) | set(b[step])) - METRICS_MEASURED):
            x, y = a[step].get(field, "(absent)"), b[step].get(field,
                                                              "(absent)")
            if x != y:
                diffs.append(f"metrics step {step} field {field}: "
                             f"reference {x}, resumed {y}")
    return diffs, len(set(a) & set(b))


def read_safetensors(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return header, data[8 + n:]


def element(dtype, raw):
    if dtype == "F32":
        return repr(struct.unpack("<f", raw)[0])
    if dtype == "BF16":
        return repr(struct.unpack("<f", b"\0\0" + raw)[0])
    return raw.hex()


SIZES = {"F64": 8, "F32": 4, "I64": 8, "BF16": 2, "F16": 2, "I32": 4,
         "U8": 1}


def safetensors_diff(ref, got):
    """The first difference between two safetensors files, or None."""
    if ref.read_bytes() == got.read_bytes():
        return None
    (ha, da), (hb, db) = read_safetensors(ref), read_safetensors(got)
    if ha.get("__metadata__") != hb.get("__metadata__"):
        return "its metadata differs"
    ha.pop("__metadata__", None)
    hb.pop("__metadata__", None)
    if set(ha) != set(hb):
        return f"tensors in only one: {sorted(set(ha) ^ set(hb))[:5]}"
    for name in sorted(ha):
        ea, eb = ha[name], hb[name]
        if (ea["dtype"], ea["shape"]) != (eb["dtype"], eb["shape"]):
            return (f"tensor {name}: {ea['dtype']} {ea['shape']} against "
                    f"{eb['dtype']} {eb['shape']}")
        xa = da[slice(*ea["data_offsets"])]
        xb = db[slice(*eb["data_offsets"])]
        if xa != xb:
            size = SIZES.get(ea["dtype"], 1)
            byte = next(i for i in range(len(xa)) if xa[i] != xb[i])
            k = byte // size
            count = sum(xa[i:i + size] != xb[i:i + size]
                        for i in range(0, len(xa), size))
            return (f"tensor {name} element {k}: reference "
                    f"{element(ea['dtype'], xa[k * size:(k + 1) * size])}, "
                    f"resumed "
                    f"{element(ea['dtype'], xb[k * size:(k + 1) * size])} "
                    f"({count} of {len(xa) // size} elements differ)")
    return "the bytes differ outside the tensors (layout)"


def json_diffs(a, b, where, exempt=()):
    diffs = []
    for key in sorted((set(a) | set(b)) - set(exempt)):
        x, y = a.get(key, "(absent)"), b.get(key, "(absent)")
        if isinstance(x, dict) and isinstance(y, dict):
            diffs += json_diffs(x, y, f"{where}.{key}", exempt)
        elif x != y:
            diffs.append(f"{where}.{key}: reference {x}, resumed {y}")
    return diffs


def trainer_fields(path):
    trainer = json.loads(path.read_text())
    trainer["trainer_state"] = json.loads(trainer["trainer_state"])
    return trainer


def folder_diffs(ref, got, where):
    """Every file of two output folders (a checkpoint, --save-weights)."""
    diffs = []
    names = {p.name for p in ref.iterdir()} | {p.name for p in got.iterdir()}
    for name in sorted(names):
        a, b = ref / name, got / name
        if not (a.is_file() and b.is_file()):
            diffs.append(f"{where}/{name} is in only one of the runs")
        elif name.endswith(".safetensors"):
            d = safetensors_diff(a, b)
            if d:
                diffs.append(f"{where}/{name}: {d}")
        elif name == "trainer.json":
            diffs += json_diffs(trainer_fields(a), trainer_fields(b),
                                f"{where}/{name}", TRAINER_EXEMPT)
        elif name.endswith(".json"):
            diffs += json_diffs(json.loads(a.read_text()),
                                json.loads(b.read_text()), f"{where}/{name}")
        elif a.read_bytes() != b.read_bytes():
            diffs.append(f"{where}/{name} differs")
    return diffs


def compare(ref, got):
    """The differences of a resumed run's outputs from the reference's, and
    the steps and checkpoints compared."""
    diffs, steps = metrics_diffs(ref / "metrics.jsonl", got / "metrics.jsonl")
    a, b = ref / "ck", got / "ck"
    if (a / "latest").read_text() != (b / "latest").read_text():
        diffs.append(f"ck/latest: reference {(a / 'latest').read_text()}, "
                     f"resumed {(b / 'latest').read_text()}")
    kept = sorted({p.name for p in a.glob("step-*")} &
                  {p.name for p in b.glob("step-*")})
    if (a / "latest").read_text().strip() not in kept:
        diffs.append("the final checkpoint is missing from the resumed run")
    for name in kept:
        diffs += folder_diffs(a / name, b / name, f"ck/{name}")
    diffs += folder_diffs(ref / "weights", got / "weights", "weights")
    return diffs, steps, len(kept)


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    name: str
    diffs: list
    events: list
    steps: int = 0
    checkpoints: int = 0
    seconds: float = 0.0


def make_all_data(work, scenarios):
    data = {}
    for s in scenarios:
        for key, kind, val in ((s.data, s.data, False),
                               ("val-" + s.val, s.val, True)):
            if kind and key not in data:
                data[key] = make_data(work / "data" / key, kind, val)
    return data


def run_scenario(s, tools, work, data, seed, repeats=1):
    """The scenario's reference and `repeats` interrupted runs; one Result
    per interrupted run."""
    start = time.time()
    ref = reference(s, tools, work, data)
    step_seconds = statistics.median(
        json.loads(line)["seconds"]
        for line in (ref / "metrics.jsonl").read_text().splitlines())
    results = []
    for r in range(repeats):
        rng = random.Random(f"{seed}:{s.name}:{r}")
        result = Result(s.name if repeats == 1 else f"{s.name}#{r}", [], [])
        try:
            got = interrupted(s, tools, work, data, rng, step_seconds, r,
                              result.events)
            result.diffs, result.steps, result.checkpoints = compare(ref, got)
        except Failure as e:
            result.diffs = [str(e)]
        result.seconds = time.time() - start
        start = time.time()
        results.append(result)
    return results


def describe(events):
    """kill@7>4: killed after step 7 was reported, resumed from step 4."""
    return ", ".join(f"{k}@{'start' if s is None else s}>{c}"
                     for k, s, c in events)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", metavar="NAME",
                        choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--tools", default=os.fspath(ROOT / "build/bin"))
    parser.add_argument("--repeat", type=int, default=1, metavar="K")
    parser.add_argument("--list", action="store_true",
                        help="print the scenarios and exit")
    parser.add_argument("--keep", metavar="DIR",
                        help="work in DIR and keep it (default: a temporary "
                        "folder, removed)")
    a = parser.parse_args()
    if a.list:
        for s in SCENARIOS.values():
            args = (["--data", s.data] if s.data else []) + \
                (["--val-data", s.val] if s.val else []) + s.flags + \
                ["--max-steps" if s.total else "--steps", str(s.steps),
                 "--checkpoint-every", str(s.every)] + \
                (["--save-ema"] if s.save_ema else [])
            print(f"{s.name}: {shlex.join(args)}")
        return
    if not os.access(pathlib.Path(a.tools) / "megaslide-run", os.X_OK):
        sys.exit(f"resume-scenarios: no megaslide-run in {a.tools}; build it "
                 "or give --tools")
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    work = pathlib.Path(a.keep or tempfile.mkdtemp(prefix="megaslide-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    scenarios = [SCENARIOS[n] for n in a.scenarios]
    print(f"resume-scenarios: {len(scenarios)} scenarios x {a.repeat} "
          f"(seed {seed}) in {work}", flush=True)
    start = time.time()
    results = []
    try:
        data = make_all_data(work, scenarios)
        for s in scenarios:
            for r in run_scenario(s, a.tools, work, data, seed, a.repeat):
                results.append(r)
                print(f"{'FAIL' if r.diffs else 'ok  '} {r.name}: {r.steps} "
                      f"steps, {r.checkpoints} checkpoints compared; "
                      f"{describe(r.events) or 'not interrupted'} "
                      f"({r.seconds:.1f} s)", flush=True)
                for d in r.diffs[:20]:
                    print(f"     {r.name}: {d}", flush=True)
                if len(r.diffs) > 20:
                    print(f"     {r.name}: and {len(r.diffs) - 20} more "
                          "differences", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    kinds = {k: 0 for k in [*KINDS, "late"]}
    for r in results:
        for k, _, _ in r.events:
            kinds[k] += 1
    failed = [r.name for r in results if r.diffs]
    print(f"resume-scenarios: {len(results)} runs, {len(failed)} failed; "
          f"interruptions: " + ", ".join(f"{k} {kinds[k]}" for k in KINDS) +
          f" (landed after the end {kinds['late']}); "
          f"{sum(r.steps for r in results)} steps and "
          f"{sum(r.checkpoints for r in results)} checkpoints compared; "
          f"{time.time() - start:.0f} s (seed {seed})", flush=True)
    if failed:
        print("failed: " + " ".join(failed), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
