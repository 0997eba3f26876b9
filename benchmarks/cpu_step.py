#!/usr/bin/env python3
"""Times the cpu backend's f32 training step against torch eager.

One full training step on each side -- forward, backward and the AdamW
update -- of the same Wan 2.1 model on the same weights and inputs:

  megaslide  megaslide.Trainer(model, frames, height, width, backend="cpu",
             precision="f32", attention="global").step(**batch)
  torch      diffusers.WanTransformer3DModel.from_pretrained(the directory
             the Trainer's save_weights wrote), float32, train mode; the
             rectified-flow loss the plan computes (x_t = (1 - t) x0 + t
             noise, target noise - x0, mean squared error over every
             element, model timestep 1000 t); loss.backward();
             torch.optim.AdamW(fused=True) with the hyper-parameters of the
             plan's host_adamw instructions (lr, betas, eps, weight decay)

Configs (--configs): "tiny" (the preset, 17 x 128 x 128 pixels: latents
5 x 16 x 16, 320 tokens) and "mid" (benchmarks/wan-mid.json: dim 512 =
8 heads x 64, ffn 1536, 4 layers, Wan's text encoder width 4096 and 512
text tokens, at 13 x 256 x 256 pixels: latents 4 x 32 x 32, token grid
4 x 16 x 16 = 1,024 tokens). Both use global attention on both sides
(3D-DSA needs a grid larger than its window).

Each side runs in a worker process of its own, so that each has its own
peak RSS (VmHWM of that process: imports, setup and every step; the RSS
after the imports is printed beside it). Before timing, both sides
take --check-steps steps on one batch and their losses must agree: the
first (the same weights and inputs) to --loss-rtol, the later ones (after
one and two AdamW updates: the optimizers must agree too) to
--update-rtol; the script stops with exit status 1 otherwise, so the
figures provably compare the same computation. These steps are the
warm-up. Then --repeat interleaved rounds, each timing one step of each
side (wall time around the call, after --pause s of idle time), in an
order that alternates every round (more rounds for short steps, to fill
--min-seconds). Figures are medians with the best round beside them;
"ms/torch" is megaslide's median over torch's.

megaslide's deferred update (docs/Training.md) keeps the gradients until
the backward ends; Trainer.step applies the update before it returns
(python-bindings/TrainerBindings.cpp reads Session::state(), which
flushes it), so every timed step holds one whole update on both sides.

Per-op-kind breakdown: --breakdown-steps more steps of megaslide with
trace= (one event per instruction, grouped by op kind) and of torch under
torch.profiler (self CPU time per aten op, grouped alike), untimed; each
kind's median over them.

3D-DSA (--dsa-grids): megaslide's CPU 3D-DSA kernels with window = grid
(softmax attention over all tokens) against
torch.nn.functional.scaled_dot_product_attention, forward + backward on the
same q, k, v (B=1, --dsa-heads, head dim 64), in one process, interleaved;
outputs and gradients are checked against each other first.

Threads: one count for both sides (--threads, default
MEGASLIDE_NUM_THREADS, else all cores): MEGASLIDE_NUM_THREADS for the cpu
backend's worker pool (runtime/cpu/WorkerPool.cpp, cpuThreads()) and
torch.set_num_threads.

Usage: benchmarks/cpu_step.py [--configs tiny,mid] [--repeat 7]
                              [--threads N] [--json FILE]
Needs torch and diffusers: pip install -r benchmarks/requirements-bench.txt
(docs/Benchmarks.md, "Host AdamW" and "CPU training step").
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# The same machine line as the AdamW benchmark (this folder is on sys.path
# when a script here runs).
from host_adamw import machine  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (model for megaslide.Trainer, frames, height, width)
CONFIGS = {
    "tiny": ("tiny", 17, 128, 128),
    "mid": (str(ROOT / "benchmarks" / "wan-mid.json"), 13, 256, 256),
}
SEED = 3

INSTALL_HINT = """\
benchmarks/cpu_step.py needs torch and diffusers. Install the benchmark's
requirements (docs/Benchmarks.md, "Host AdamW") and run it with that
interpreter:

    python3 -m venv --system-site-packages ~/megaslide-bench-venv
    ~/megaslide-bench-venv/bin/pip install -r benchmarks/requirements-bench.txt
    ~/megaslide-bench-venv/bin/python benchmarks/cpu_step.py

({python} could not import {module})
"""

# Op kinds of the breakdown, in print order.
KINDS = ["GEMM (linear)", "attention fwd", "attention bwd", "norms", "GELU",
         "SiLU", "RoPE", "elementwise", "copies, layout", "AdamW",
         "embed, loss", "framework", "other"]

# megaslide trace: the first word of an event's name -> kind.
MEGASLIDE_KINDS = {
    "linear": "GEMM (linear)", "linear_grad_data": "GEMM (linear)",
    "linear_grad_params": "GEMM (linear)",
    "attention": "attention fwd", "attention_grad": "attention bwd",
    "dsa3d": "attention fwd", "dsa3d_grad": "attention bwd",
    "rms_norm": "norms", "rms_norm_grad": "norms", "layer_norm": "norms",
    "layer_norm_grad": "norms",
    "gelu": "GELU", "gelu_grad": "GELU", "silu": "SiLU", "silu_grad": "SiLU",
    "rope3d": "RoPE", "rope3d_grad": "RoPE",
    "add": "elementwise", "bias_add": "elementwise",
    "bias_add_grad": "elementwise", "modulate": "elementwise",
    "modulate_grad": "elementwise", "gate": "elementwise",
    "gate_grad": "elementwise", "flow_interpolate": "elementwise",
    "reshape": "copies, layout", "split": "copies, layout",
    "concat": "copies, layout", "h2d": "copies, layout",
    "d2h": "copies, layout",
    # host_adamw hands the gradient to the host, kept for the deferred
    # update; a fetch would apply a pending update before copying its
    # parameter into the arena, but from Python none is pending: reading
    # the step's report (Session::state()) applies them all right after
    # the step, outside every event ("not in events").
    "fetch": "AdamW", "host_adamw": "AdamW",
    "patch_embed": "embed, loss", "patch_embed_grad": "embed, loss",
    "patchify": "embed, loss", "unpatchify": "embed, loss",
    "timestep_embedding": "embed, loss", "flow_matching_loss": "embed, loss",
    "flow_matching_loss_grad": "embed, loss",
}


# Kinds whose FLOPs are the same work on both sides (GFLOP/s column).
FLOP_KINDS = ("GEMM (linear)", "attention fwd", "attention bwd")


def torch_kind(name):
    """The kind of a torch.profiler event (an aten op or an annotation)."""
    n = name.lower()
    if n.startswith(("optimizer.", "optimizer#")) or "adam" in n:
        return "AdamW"
    if "flash_attention" in n or "scaled_dot_product" in n or "sdpa" in n:
        return "attention bwd" if "backward" in n else "attention fwd"
    if not n.startswith("aten::"):
        return "framework"  # autograd nodes, record_function scopes
    op = n[len("aten::"):]
    if op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv",
              "mv", "dot"):
        return "GEMM (linear)"
    if "norm" in op:
        return "norms"
    if op.startswith("gelu"):
        return "GELU"
    if op.startswith("silu"):
        return "SiLU"
    if "conv" in op or op in ("mse_loss", "mse_loss_backward"):
        return "embed, loss"
    if op in ("copy_", "clone", "contiguous", "cat", "to", "_to_copy",
              "stack", "index_select", "expand", "view", "reshape",
              "transpose", "permute", "unflatten", "flatten", "split",
              "chunk", "unbind", "narrow", "slice", "select", "t",
              "as_strided", "_unsafe_view", "view_as_real",
              "view_as_complex", "squeeze", "unsqueeze", "empty",
              "empty_like", "empty_strided", "zeros", "zeros_like",
              "fill_", "zero_", "resize_", "detach", "alias", "new_zeros",
              "new_empty_strided", "_reshape_alias", "repeat"):
        return "copies, layout"
    return "elementwise"


# ---------------------------------------------------------------------------
# Workers: one process per side, a JSON line in and one out per command
# ---------------------------------------------------------------------------

def status_mib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    return float("nan")


def rss_now_mib():
    return status_mib("VmRSS")


def peak_rss_mib():
    # VmHWM, the high-water mark of this process's memory since its exec.
    # Not getrusage's ru_maxrss: Linux keeps that across execve, so a worker
    # would report the parent's peak at the fork (torch imported) when its
    # own is lower.
    return status_mib("VmHWM")


def minor_faults():
    """Page faults of this process so far that needed no I/O: first
    touches of freshly mapped memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def randomise(params, seed):
    """Non-trivial float32 weights (test/python/test_parity.py's rule):
    linear weights N(0, 1/fan_in), biases N(0, 0.1^2), norm gains
    1 + N(0, 0.1^2), modulation tables N(0, 1/D); proj_out random, not
    zero, so every gradient is non-zero from the first step."""
    rng = np.random.default_rng(seed)
    dim = params["scale_shift_table"].shape[-1]
    out = {}
    for name, value in sorted(params.items()):
        shape = value.shape
        if name.endswith("scale_shift_table"):
            x = rng.normal(0, 1 / math.sqrt(dim), shape)
        elif "norm" in name and name.endswith(".weight"):
            x = 1 + rng.normal(0, 0.1, shape)
        elif name.endswith(".bias"):
            x = rng.normal(0, 0.1, shape)
        else:
            x = rng.normal(0, 1 / math.sqrt(math.prod(shape[1:])), shape)
        out[name] = x.astype(np.float32)
    return out


def megaslide_worker(cmd, state):
    import megaslide
    op = cmd["op"]
    if op == "setup":
        model, frames, height, width = cmd["config"]
        tr = megaslide.Trainer(model, frames, height, width, backend="cpu",
                               precision="f32", attention="global", seed=0)
        params = randomise(tr.parameters(), SEED)
        tr.load_parameters(params)
        shapes = tr.input_shapes()
        rng = np.random.default_rng(SEED + 1)
        B = shapes["latents"][0]
        # Multiples of 1/8: 1000 t is exact in float32 on both sides.
        t = (np.arange(B) % 6 + 2) / 8
        batch = dict(
            latents=rng.normal(size=shapes["latents"]).astype(np.float32),
            noise=rng.normal(size=shapes["noise"]).astype(np.float32),
            timesteps=t.astype(np.float32),
            condition=rng.normal(size=shapes["condition"]).astype(np.float32))
        directory = pathlib.Path(cmd["dir"])
        tr.save_weights(str(directory / "weights"))
        np.savez(directory / "batch.npz", **batch)
        attrs = [i["attrs"] for i in json.loads(tr.plan_json())["instructions"]
                 if i.get("op") == "host_adamw"]
        keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
        hyper = {k: attrs[0][k] for k in keys}
        if any({k: a[k] for k in keys} != hyper for a in attrs):
            raise SystemExit("the plan's host_adamw instructions differ in "
                             "their hyper-parameters; the benchmark gives "
                             "torch one set")
        state.update(trainer=tr, batch=batch)
        return dict(hyper=hyper, deferred=bool(attrs[0].get("deferred")),
                    params=int(sum(v.size for v in params.values())),
                    shapes={k: list(v) for k, v in shapes.items()},
                    isa=megaslide._megaslide.cpu_isa(),
                    gemm_isa=megaslide._megaslide.gemm_isa(),
                    version=megaslide.__version__)
    tr, batch = state["trainer"], state["batch"]
    if op == "step":
        faults = minor_faults()
        start = time.perf_counter()
        r = tr.step(**batch)
        wall = time.perf_counter() - start
        if r["clipped"] or r["skipped"]:
            raise SystemExit(f"megaslide step clipped or skipped: {r}")
        return dict(loss=r["loss"], seconds=wall, runtime_seconds=r["seconds"],
                    lr=r["lr"], minor_faults=minor_faults() - faults,
                    arena_bytes=r["planned_peak_bytes"])
    if op == "trace":
        path = pathlib.Path(cmd["dir"]) / "megaslide-trace.json"
        start = time.perf_counter()
        r = tr.step(trace=str(path), **batch)
        wall = time.perf_counter() - start
        events = [e for e in json.loads(path.read_text())["traceEvents"]
                  if e.get("ph") == "X"]
        kinds, names, flops = {}, {}, {}
        for e in events:
            word = e["name"].split()[0]
            kind = MEGASLIDE_KINDS.get(word, "other")
            kinds[kind] = kinds.get(kind, 0.0) + e["dur"] * 1e-6
            names[word] = names.get(word, 0.0) + e["dur"] * 1e-6
            flops[kind] = flops.get(kind, 0) + e["args"].get("flops", 0)
        return dict(kinds=kinds, names=names, flops=flops, seconds=wall,
                    runtime_seconds=r["seconds"], events=len(events),
                    trace=str(path))
    raise ValueError(op)


def torch_worker(cmd, state):
    import torch
    op = cmd["op"]
    if op == "setup":
        import diffusers
        directory = pathlib.Path(cmd["dir"])
        model = diffusers.WanTransformer3DModel.from_pretrained(
            str(directory / "weights"), torch_dtype=torch.float32)
        model.train()
        for name, p in cmd.get("perturb", {}).items():
            with torch.no_grad():
                dict(model.named_parameters())[name].mul_(p)
        h = cmd["hyper"]
        opt = torch.optim.AdamW(model.parameters(),
                                lr=h["lr"] * cmd.get("lr_scale", 1.0),
                                betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                weight_decay=h["weight_decay"], fused=True)
        with np.load(directory / "batch.npz") as f:
            batch = {k: torch.from_numpy(f[k]) for k in f.files}
        x0, noise, t = batch["latents"], batch["noise"], batch["timesteps"]
        tb = t.reshape(-1, 1, 1, 1, 1)
        inputs = dict(hidden_states=(1 - tb) * x0 + tb * noise,
                      timestep=1000 * t,
                      encoder_hidden_states=batch["condition"])
        target = noise - x0
        channels = x0.shape[1]

        def step():
            opt.zero_grad(set_to_none=True)
            pred = model(**inputs, return_dict=False)[0]
            loss = torch.mean((pred[:, :channels] - target) ** 2)
            loss.backward()
            opt.step()
            return loss.item()

        state.update(step=step)
        return dict(version=torch.__version__,
                    diffusers=diffusers.__version__,
                    capability=torch.backends.cpu.get_cpu_capability(),
                    threads=torch.get_num_threads(),
                    params=int(sum(p.numel() for p in model.parameters())))
    if op == "step":
        faults = minor_faults()
        start = time.perf_counter()
        loss = state["step"]()
        return dict(loss=loss, seconds=time.perf_counter() - start,
                    minor_faults=minor_faults() - faults)
    if op == "trace":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            state["step"]()
            wall = time.perf_counter() - start
        kinds, names = {}, {}
        for e in prof.key_averages():
            s = e.self_cpu_time_total * 1e-6
            kind = torch_kind(e.key)
            kinds[kind] = kinds.get(kind, 0.0) + s
            names[e.key] = names.get(e.key, 0.0) + s
        return dict(kinds=kinds, names=names, seconds=wall)
    raise ValueError(op)


def worker_main(side, threads):
    os.environ["MEGASLIDE_NUM_THREADS"] = str(threads)
    if side == "torch":
        import torch
        torch.set_num_threads(threads)
        import diffusers  # noqa: F401  (counted in the RSS after imports)
        serve = torch_worker
    else:
        import megaslide  # noqa: F401
        serve = megaslide_worker
    state = {}
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not reach the pipe
    print(json.dumps(dict(ready=True, rss_after_imports_mib=rss_now_mib())),
          file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            reply = dict(peak_rss_mib=peak_rss_mib(),
                         rss_mib=rss_now_mib())
        else:
            reply = serve(cmd, state)
        print(json.dumps(reply), file=out, flush=True)
        if cmd["op"] == "quit":
            return


class Worker:
    def __init__(self, side, threads, env):
        self.side = side
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", side, "--threads",
             str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env)
        self.ready = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise SystemExit(f"the {self.side} worker died (exit status "
                             f"{code}); its messages are above")
        return json.loads(line)

    def __call__(self, op, **args):
        self.proc.stdin.write(json.dumps(dict(op=op, **args)) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        reply = self("quit")
        self.proc.wait()
        return reply


# ---------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------

def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def run_config(name, args, env, tmp):
    directory = pathlib.Path(tmp) / name
    directory.mkdir()
    ms = Worker("megaslide", args.threads, env)
    th = Worker("torch", args.threads, env)
    try:
        setup = ms("setup", config=list(CONFIGS[name]), dir=str(directory))
        perturb = {n: 1.0 + args.perturb_scale for n in args.perturb_weight}
        tsetup = th("setup", dir=str(directory), hyper=setup["hyper"],
                    lr_scale=args.torch_lr_scale, perturb=perturb)
        if tsetup["params"] != setup["params"]:
            raise SystemExit(f"{name}: torch has {tsetup['params']:,} "
                             f"parameters, megaslide {setup['params']:,}")

        # The same computation on both sides, or no figures at all.
        check = []
        for k in range(args.check_steps):
            a, b = ms("step"), th("step")
            rtol = args.loss_rtol if k == 0 else args.update_rtol
            rel = relative(a["loss"], b["loss"])
            check.append(dict(step=k + 1, megaslide=a["loss"],
                              torch=b["loss"], relative=rel, rtol=rtol))
            print(f"  {name} check step {k + 1}: loss megaslide "
                  f"{a['loss']:.7g}, torch {b['loss']:.7g}, relative "
                  f"difference {rel:.1e} (rtol {rtol:g})", flush=True)
            if not rel <= rtol:
                raise LossMismatch(
                    f"{name}: the losses of step {k + 1} differ by {rel:.2e} "
                    f"relative (megaslide {a['loss']!r}, torch "
                    f"{b['loss']!r}; rtol {rtol:g}): the two sides do not "
                    f"compute the same step, so no time is compared")

        times = {"megaslide": [], "torch": []}
        faults = {"megaslide": [], "torch": []}
        runtime_seconds = []
        sides = [("megaslide", ms), ("torch", th)]
        # Short steps: enough rounds to fill --min-seconds, so that the
        # median of a small config shrugs off bursts of other work too.
        per_round = a["seconds"] + b["seconds"] + 2 * args.pause
        rounds = max(args.repeat,
                     min(200, math.ceil(args.min_seconds / per_round)))
        for r in range(rounds):
            for side, worker in sides[r % 2:] + sides[:r % 2]:
                # torch's OpenMP threads spin a while after each parallel
                # region; the pause keeps them off the other side's cores.
                time.sleep(args.pause)
                reply = worker("step")
                times[side].append(reply["seconds"])
                faults[side].append(reply["minor_faults"])
                if side == "megaslide":
                    runtime_seconds.append(reply["runtime_seconds"])

        breakdown = None
        if args.breakdown_steps:
            traces = {"megaslide": [], "torch": []}
            for _ in range(args.breakdown_steps):
                time.sleep(args.pause)
                traces["megaslide"].append(ms("trace", dir=str(directory)))
                time.sleep(args.pause)
                traces["torch"].append(th("trace"))
            breakdown = {side: median_trace(t) for side, t in traces.items()}
    finally:
        mrss = ms.close() if ms.proc.poll() is None else {}
        trss = th.close() if th.proc.poll() is None else {}
    return dict(
        config=name, model=CONFIGS[name][0], video=list(CONFIGS[name][1:]),
        input_shapes=setup["shapes"], params=setup["params"],
        hyper=setup["hyper"], deferred_update=setup["deferred"],
        check=check, seconds=times, megaslide_runtime_seconds=runtime_seconds,
        minor_faults_per_step={s: statistics.median(f)
                               for s, f in faults.items()},
        megaslide_arena_bytes=a["arena_bytes"],
        median={s: statistics.median(t) for s, t in times.items()},
        best={s: min(t) for s, t in times.items()},
        rss_mib=dict(
            megaslide=dict(after_imports=ms.ready["rss_after_imports_mib"],
                           peak=mrss.get("peak_rss_mib")),
            torch=dict(after_imports=th.ready["rss_after_imports_mib"],
                       peak=trss.get("peak_rss_mib"))),
        breakdown=breakdown, megaslide_info=setup, torch_info=tsetup)


def median_trace(traces):
    """Per kind (and name), the median over the traced steps of its time:
    a burst of other work in one of them moves no kind far."""
    out = dict(traces[0])
    for key in ("kinds", "names", "flops"):
        if key in out:
            names = set().union(*(t[key] for t in traces))
            out[key] = {n: statistics.median(t[key].get(n, 0)
                                             for t in traces)
                        for n in names}
    for key in ("seconds", "runtime_seconds"):
        if key in out:
            out[key] = statistics.median(t[key] for t in traces)
    out["steps"] = len(traces)
    return out


class LossMismatch(Exception):
    pass


def dsa_run(grid, args):
    """megaslide's 3D-DSA forward + backward with window = grid against
    torch SDPA forward + backward, interleaved, on the same q, k, v."""
    import megaslide
    import torch
    torch.set_num_threads(args.threads)
    native = megaslide._megaslide
    rng = np.random.default_rng(SEED)
    shape = (1, args.dsa_heads, *grid, 64)
    q, k, v, d_out = (rng.standard_normal(shape, dtype=np.float32)
                      for _ in range(4))
    tile = tuple(min(t, g) for t, g in zip(args.dsa_tile, grid))
    tiles = [-(-g // t) for g, t in zip(grid, tile)]
    offsets = np.zeros((1, args.dsa_heads, *tiles, grid[0], 2), np.int32)
    scale = 1 / math.sqrt(64)
    n = math.prod(grid)

    def ours():
        # A training step's pair: the forward (saving out and the
        # log-sum-exp), then the backward. megaslide.dsa3d_backward would
        # recompute the forward; these are the two kernels it calls.
        out, lse = native.dsa3d_forward(q, k, v, offsets, grid, tile, scale)
        grads = native.dsa3d_backward(q, k, v, offsets, out, d_out, lse,
                                      grid, tile, scale)
        return out, grads

    flat = lambda a: torch.from_numpy(a.reshape(1, args.dsa_heads, n, 64))
    tq, tk, tv = (flat(a).clone().requires_grad_() for a in (q, k, v))
    td = flat(d_out)

    def theirs():
        for t in (tq, tk, tv):
            t.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
        out.backward(td)
        return out, (tq.grad, tk.grad, tv.grad)

    # Same results first (f32; sums over n keys in another order).
    (o1, g1), (o2, g2) = ours(), theirs()
    worst = 0.0
    for a, b in zip((o1, *g1), (o2, *g2)):
        b = b.detach().numpy().reshape(a.shape)
        worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
    if not worst <= 1e-4:
        raise LossMismatch(f"3D-DSA {grid}: megaslide and SDPA differ by "
                           f"{worst:.2e} of max|SDPA|")
    times = {"megaslide dsa3d": [], "torch sdpa": []}
    sides = [("megaslide dsa3d", ours), ("torch sdpa", theirs)]
    for r in range(args.repeat):
        for side, fn in sides[r % 2:] + sides[:r % 2]:
            time.sleep(args.pause)
            start = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - start)
    return dict(grid=list(grid), tokens=n, heads=args.dsa_heads, head_dim=64,
                tile=list(tile), max_relative_difference=worst,
                seconds=times,
                median={s: statistics.median(t) for s, t in times.items()},
                best={s: min(t) for s, t in times.items()})


def cpu_flags():
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_bf16",
                                    "amx_bf16")}


def grids(text):
    out = []
    for part in text.split(";") if text else []:
        values = tuple(int(v) for v in part.split(","))
        if len(values) != 3 or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected t,y,x[;t,y,x...], "
                                             f"got {text}")
        out.append(values)
    return out


def print_report(report):
    print()
    cfgs = report["configs"]
    if cfgs:
        header = (f"{'config':6} {'tokens':>6} {'params':>11} {'rounds':>6} "
                  f"{'megaslide s':>11} {'(best)':>7} {'torch s':>8} "
                  f"{'(best)':>7} {'ms/torch':>8} {'(best)':>7} "
                  f"{'ms RSS MiB':>10} {'torch RSS MiB':>13}")
        print(header)
        print("-" * len(header))
        for c in cfgs:
            m, t = c["median"], c["best"]
            tokens = math.prod(c["input_shapes"]["latents"][2:]) // 4
            rss = c["rss_mib"]
            print(f"{c['config']:6} {tokens:>6} {c['params']:>11,} "
                  f"{len(c['seconds']['torch']):>6} "
                  f"{m['megaslide']:11.3f} {t['megaslide']:7.3f} "
                  f"{m['torch']:8.3f} {t['torch']:7.3f} "
                  f"{m['megaslide'] / m['torch']:7.2f}x "
                  f"{t['megaslide'] / t['torch']:6.2f}x "
                  f"{rss['megaslide']['peak']:10.0f} "
                  f"{rss['torch']['peak']:13.0f}")
        print("\nseconds: wall time of one step (forward, backward, AdamW), "
              "median of the rounds (best round);\nms/torch: megaslide's "
              "over torch's; RSS: peak of each side's worker process "
              "(VmHWM), after imports:")
        for c in cfgs:
            rss = c["rss_mib"]
            print(f"  {c['config']:6} megaslide "
                  f"{rss['megaslide']['after_imports']:.0f} MiB, torch "
                  f"{rss['torch']['after_imports']:.0f} MiB "
                  f"(torch + diffusers)")
        print("megaslide's own step time (the step report's seconds: from "
              "the first to the last\ninstruction) and the rest of the "
              "wall time; minor page faults per step (medians):")
        for c in cfgs:
            own = statistics.median(c["megaslide_runtime_seconds"])
            f = c["minor_faults_per_step"]
            print(f"  {c['config']:6} {own:.3f} s + "
                  f"{c['median']['megaslide'] - own:.3f} s; faults "
                  f"megaslide {f['megaslide']:,.0f} (arena "
                  f"{c['megaslide_arena_bytes'] / 2**20:.0f} MiB = "
                  f"{c['megaslide_arena_bytes'] / 4096:,.0f} pages of 4 KiB)"
                  f", torch {f['torch']:,.0f}")
    for c in cfgs:
        b = c["breakdown"]
        if not b:
            continue
        ms, th = b["megaslide"], b["torch"]
        print(f"\n{c['config']}: per op kind, median of {ms['steps']} "
              f"untimed steps each (megaslide: trace events;\ntorch: "
              f"torch.profiler self CPU time)")
        print(f"  {'kind':16} {'megaslide s':>11} {'%':>4} "
              f"{'torch s':>8} {'%':>4} {'ms/torch':>8} "
              f"{'GFLOP/s ms':>10} {'torch':>6}")
        ms_total = ms["seconds"]
        th_total = th["seconds"]
        rest_ms = ms_total - sum(ms["kinds"].values())
        rest_th = th_total - sum(th["kinds"].values())
        rows = [(k, ms["kinds"].get(k, 0.0), th["kinds"].get(k, 0.0))
                for k in KINDS]
        rows.append(("not in events", rest_ms, rest_th))
        rows.append(("step (wall)", ms_total, th_total))
        for kind, a, t in rows:
            if a == 0 and t == 0:
                continue
            ratio = f"{a / t:7.2f}x" if t > 1e-6 and a > 0 else ""
            rate = ""
            if kind in FLOP_KINDS and ms["flops"].get(kind):
                f = ms["flops"][kind]
                rate = f"{f / a / 1e9:10.1f} {f / t / 1e9:6.1f}"
            print(f"  {kind:16} {a:11.3f} {a / ms_total:4.0%} {t:8.3f} "
                  f"{t / th_total:4.0%} {ratio:>8} {rate}")
        print("  (GFLOP/s: the trace's FLOPs of that kind over each side's "
              "time; the same work on\n  both sides, so torch's at "
              "megaslide's count)")
        others = sorted((s, n) for n, s in ms["names"].items()
                        if MEGASLIDE_KINDS.get(n, "other") == "other")
        if others:
            print("  megaslide 'other': " +
                  ", ".join(f"{n} {s:.3f}" for s, n in reversed(others)))
    for d in report["dsa"]:
        if d is report["dsa"][0]:
            print(f"\n3D-DSA, window = grid, forward + backward, B=1 "
                  f"H={d['heads']} D={d['head_dim']}, median (best) of "
                  f"{len(d['seconds']['torch sdpa'])} interleaved rounds")
            print(f"  {'grid':>9} {'tokens':>6} {'tile':>7} "
                  f"{'dsa3d s':>8} {'(best)':>7} {'sdpa s':>8} {'(best)':>7}"
                  f" {'dsa/sdpa':>8} {'max diff':>8}")
        m, b = d["median"], d["best"]
        print(f"  {'x'.join(map(str, d['grid'])):>9} {d['tokens']:>6} "
              f"{'x'.join(map(str, d['tile'])):>7} "
              f"{m['megaslide dsa3d']:8.4f} {b['megaslide dsa3d']:7.4f} "
              f"{m['torch sdpa']:8.4f} {b['torch sdpa']:7.4f} "
              f"{m['megaslide dsa3d'] / m['torch sdpa']:7.2f}x "
              f"{d['max_relative_difference']:8.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,mid",
                        help=f"comma-separated, of {', '.join(CONFIGS)} "
                        "(default tiny,mid; 'none' for only 3D-DSA)")
    parser.add_argument("--repeat", default=7, type=int,
                        help="timed rounds (median reported; default 7)")
    parser.add_argument("--threads", type=int,
                        default=int(os.environ.get("MEGASLIDE_NUM_THREADS",
                                                   0)) or os.cpu_count(),
                        help="threads for both sides (default "
                        "MEGASLIDE_NUM_THREADS, else all cores)")
    parser.add_argument("--min-seconds", default=10.0, type=float,
                        help="more rounds than --repeat where they fill no "
                        "more than this many seconds (at most 200; "
                        "default 10)")
    parser.add_argument("--pause", default=0.1, type=float,
                        help="idle seconds before each timed step")
    parser.add_argument("--check-steps", default=3, type=int,
                        help="steps whose losses are compared before timing")
    # test/python/test_parity.py's f32 loss tolerance against a float64
    # reference; the two sides agree to about 1e-7 (a float32 ulp).
    parser.add_argument("--loss-rtol", default=1e-5, type=float,
                        help="relative tolerance of the first step's losses")
    parser.add_argument("--update-rtol", default=1e-4, type=float,
                        help="relative tolerance of the later check steps' "
                        "losses (after AdamW updates)")
    parser.add_argument("--dsa-grids", default="4,16,16;8,16,16", type=grids,
                        help="token grids t,y,x;... of the 3D-DSA run "
                        "(default 4,16,16;8,16,16; '' for none)")
    parser.add_argument("--dsa-heads", default=8, type=int)
    parser.add_argument("--dsa-tile", default=(3, 5, 8),
                        type=lambda s: tuple(int(v) for v in s.split(",")),
                        help="query tile of the 3D-DSA kernel (default the "
                        "pipeline's 3,5,8)")
    parser.add_argument("--breakdown-steps", default=3, type=int,
                        help="traced (megaslide) and profiled (torch) steps "
                        "of the per-op-kind breakdown, medians per kind "
                        "(default 3; 0 for none)")
    parser.add_argument("--json", type=pathlib.Path,
                        help="also write every figure to this file")
    parser.add_argument("--build-dir", default=ROOT / "build",
                        type=pathlib.Path,
                        help="where python_packages/megaslide is, if not "
                        "already importable (default build/)")
    # To show that the loss check bites (test/python/test_cpu_step_bench.py).
    parser.add_argument("--torch-lr-scale", default=1.0, type=float,
                        help=argparse.SUPPRESS)
    parser.add_argument("--perturb-weight", default=[], action="append",
                        help=argparse.SUPPRESS)
    parser.add_argument("--perturb-scale", default=1e-2, type=float,
                        help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("megaslide", "torch"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads <= 0 or args.repeat <= 0 or args.check_steps <= 0:
        parser.error("--threads, --repeat and --check-steps must be positive")

    packages = args.build_dir / "python_packages"
    env = dict(os.environ, MEGASLIDE_NUM_THREADS=str(args.threads),
               HF_HUB_OFFLINE="1")
    if (packages / "megaslide").is_dir():
        sys.path.insert(0, str(packages))
        env["PYTHONPATH"] = os.pathsep.join(
            [str(packages)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if args.worker:
        return worker_main(args.worker, args.threads)

    os.environ.update(MEGASLIDE_NUM_THREADS=str(args.threads),
                      HF_HUB_OFFLINE="1")
    # Found, not imported: the workers import them, and the 3D-DSA run
    # imports torch here only when it runs (an import of torch and
    # diffusers takes seconds).
    import importlib.util
    for module in ("megaslide", "torch", "diffusers"):
        if importlib.util.find_spec(module) is None:
            sys.exit(INSTALL_HINT.format(python=sys.executable, module=module))
    names = [] if args.configs == "none" else args.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}; use {', '.join(CONFIGS)}")

    started = time.time()
    load_before = os.getloadavg()
    print(f"cpu training step, f32, {args.threads} thread(s), "
          f"{args.check_steps} check steps, median of >= {args.repeat} "
          f"interleaved rounds (>= {args.min_seconds:g} s for short steps)",
          flush=True)
    report = dict(configs=[], dsa=[])
    try:
        with tempfile.TemporaryDirectory(prefix="cpu_step.") as tmp:
            for name in names:
                report["configs"].append(run_config(name, args, env, tmp))
        for grid in args.dsa_grids:
            report["dsa"].append(dsa_run(grid, args))
    except LossMismatch as e:
        sys.exit(f"cpu_step.py: {e}")
    load_after = os.getloadavg()

    import megaslide
    if report["configs"]:
        info = report["configs"][0]["torch_info"]
        versions = dict(torch=info["version"], diffusers=info["diffusers"],
                        torch_cpu_capability=info["capability"])
    else:
        import diffusers
        import torch
        versions = dict(
            torch=torch.__version__, diffusers=diffusers.__version__,
            torch_cpu_capability=torch.backends.cpu.get_cpu_capability())
    flags = cpu_flags()
    report.update(
        date=datetime.datetime.fromtimestamp(
            started, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        wall_seconds=time.time() - started,
        load_average=dict(before=load_before[0], after=load_after[0]),
        machine=machine(), cpu_flags=flags, threads=args.threads,
        megaslide_isa=megaslide._megaslide.cpu_isa(),
        megaslide_gemm_isa=megaslide._megaslide.gemm_isa(),
        **versions, megaslide=megaslide.__version__, python=platform.python_version(),
        repeat=args.repeat, pause=args.pause)
    print(f"machine: {report['machine']}")
    print(f"ISA: " + ", ".join(f"{f} {'yes' if v else 'no'}"
                               for f, v in flags.items()) +
          f"; megaslide loops {report['megaslide_isa']} (MEGASLIDE_CPU_ISA "
          f"{os.environ.get('MEGASLIDE_CPU_ISA', 'unset')}), GEMM "
          f"{report['megaslide_gemm_isa']}; torch CPU capability "
          f"{report['torch_cpu_capability']}")
    print(f"torch {report['torch']}, diffusers {report['diffusers']}, "
          f"megaslide {megaslide.__version__}, python "
          f"{report['python']}")
    print(f"date: {report['date']}, {report['wall_seconds']:.0f} s; load "
          f"average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for c in report["configs"]:
        h = c["hyper"]
        print(f"{c['config']}: {pathlib.Path(c['model']).name} at "
              f"{'x'.join(map(str, c['video']))} px, latents "
              f"{'x'.join(map(str, c['input_shapes']['latents'][2:]))}, "
              f"{c['params']:,} params; AdamW lr {h['lr']:g}, betas "
              f"{h['beta1']:g}/{h['beta2']:g}, eps {h['eps']:g}, wd "
              f"{h['weight_decay']:g}; losses agree over "
              f"{len(c['check'])} steps (worst "
              f"{max(x['relative'] for x in c['check']):.1e} relative)")
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
