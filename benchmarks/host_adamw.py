#!/usr/bin/env python3
"""Times the host AdamW step against torch.optim.AdamW and the memory bound.

Side by side in one process, with one thread count for all (our kernel's
MEGASLIDE_NUM_THREADS and torch.set_num_threads), on --params parameters
held as --tensors equal flat tensors:

  megaslide bf16          megaslide.adamw_step, bf16 gradients (the
                          runtime's case: gradients stream back as bf16)
  megaslide bf16+working  the same, also writing the bf16 working copy
  megaslide fp32          megaslide.adamw_step with fp32 gradients: the
                          same traffic as torch's, for a like-for-like ratio
  torch foreach           torch.optim.AdamW(foreach=True), fp32 params/grads
  torch fused             torch.optim.AdamW(fused=True), fp32 params/grads
  torch fused, bf16 g     the runtime's task done with torch: bf16 gradients
                          widened into the fp32 .grad (torch's fused step
                          needs the param's dtype), then the fused step
  torch fused, bf16 g+w   the same, then the bf16 working copy cast from the
                          updated params (Tensor.copy_)

Each megaslide variant is compared with torch fused and with the torch
variant doing the same task ("vs same task": bf16 with "torch fused, bf16
g", bf16+working with "torch fused, bf16 g+w", fp32 with "torch fused").

Every variant gets one uncounted warm-up step (torch allocates its moments
then), then --repeat interleaved rounds, each timing one step of every
variant (after a --pause of idle time) and one run of the bandwidth probe
in a rotating order, so a burst
of other work on a shared machine hits all of them alike. Figures are
medians, with the best round beside them. The bound of each variant is its
bytes per parameter (what it must read and write at least, counted as
STREAM counts: no write-allocate traffic) divided by the bandwidth that
benchmarks/membw.cpp (megaslide-membw) measures for the same access
pattern -- three fp32 arrays updated in place plus one read -- with the
same threads, taken as the median of its interleaved runs, so that "of
bound" compares medians measured under the same conditions. (On a shared
virtual machine single runs of both reach twice the median now and then;
the best probe run is printed too.)

Usage: benchmarks/host_adamw.py [--params 64M] [--threads N] [--repeat 9]
                                [--pause 0.1]
Needs torch: pip install -r benchmarks/requirements-bench.txt (see
docs/Benchmarks.md, "Host AdamW").
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

# What each variant reads and writes per parameter, and the least number of
# bytes that implies. torch foreach runs one pass per foreach op
# (torch/optim/adam.py, _multi_tensor_adam, weight_decay != 0, not
# capturable): p *= 1 - lr wd (8 B), lerp m (12), v *= b2 (8),
# v += (1 - b2) g g (12), s = sqrt(v) into a new tensor (8), s /= sqrt(bc2)
# (8), s += eps (8), p += step_size m / s (16): 80 B/param in 8 passes.
TRAFFIC = {
    "megaslide bf16": ("reads p,m,v f32 + g bf16; writes p,m,v f32", 26, 26),
    "megaslide bf16+working": (
        "reads p,m,v f32 + g bf16; writes p,m,v f32 + working bf16", 28, 28),
    "megaslide fp32": ("reads p,m,v,g f32; writes p,m,v f32", 28, 28),
    "torch foreach": (
        "reads p,m,v,g f32; writes p,m,v f32; 8 passes, 1 temporary", 28, 80),
    "torch fused": ("reads p,m,v,g f32; writes p,m,v f32; 1 pass", 28, 28),
    # Widening the gradient reads 2 B and writes 4 B more, which the step
    # then reads back; the cast of the working copy reads p (4) again.
    "torch fused, bf16 g": (
        "g bf16 -> f32 (1 pass); then as torch fused", 26, 34),
    "torch fused, bf16 g+w": (
        "as torch fused, bf16 g; then p f32 -> working bf16 (1 pass)", 28, 40),
}

# The torch variant that does the same work as each megaslide variant.
SAME_TASK = {
    "megaslide bf16": "torch fused, bf16 g",
    "megaslide bf16+working": "torch fused, bf16 g+w",
    "megaslide fp32": "torch fused",
}

INSTALL_HINT = """\
torch is not installed for {python}.
Install the pinned benchmark requirements (about 3 GB of wheels: PyPI's
Linux torch is the CUDA build and does not import without its nvidia-*
libraries, even for CPU work; see docs/Benchmarks.md, "Host AdamW"):

    {python} -m venv --system-site-packages ~/megaslide-bench-venv
    ~/megaslide-bench-venv/bin/pip install -r benchmarks/requirements-bench.txt
    ~/megaslide-bench-venv/bin/python benchmarks/host_adamw.py
"""


def count(text):
    """'64M' -> 67108864 (K, M, G are binary: 2^10, 2^20, 2^30)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    try:
        if text and text[-1] in scale:
            value = int(float(text[:-1]) * scale[text[-1]])
        else:
            value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 64M, got "
                                         f"{text}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive count, got "
                                         f"{text}")
    return value


def default_threads():
    env = os.environ.get("MEGASLIDE_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return os.cpu_count() or 1


def membw(binary, threads, mib, repeat):
    """The bandwidth table of one megaslide-membw run, by kernel name."""
    out = subprocess.run([str(binary), "--threads", str(threads), "--mib",
                          str(mib), "--repeat", str(repeat), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return {k["name"]: k for k in json.loads(out)["kernels"]}


def to_bf16_bits(x):
    """Round-to-nearest-even bf16 bit patterns of float32 x (finite)."""
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def anon_huge_gib():
    """GiB of this process's memory on transparent huge pages, or None."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def machine():
    model = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    return f"{model}, {os.cpu_count()} cores{mem}, {platform.platform()}"


def main():
    root = pathlib.Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=count("64M"), type=count,
                        help="parameters in all (K/M/G = 2^10/2^20/2^30; "
                        "default 64M)")
    parser.add_argument("--tensors", default=1, type=int,
                        help="split the parameters into this many tensors")
    parser.add_argument("--threads", default=default_threads(), type=int,
                        help="threads for every variant (default "
                        "MEGASLIDE_NUM_THREADS, else all cores)")
    parser.add_argument("--repeat", default=9, type=int,
                        help="timed rounds (median reported)")
    parser.add_argument("--pause", default=0.1, type=float,
                        help="idle seconds before each timed step, so that "
                        "no variant's threads still spin from the one "
                        "before (default 0.1)")
    parser.add_argument("--membw-mib", default=256, type=int,
                        help="array size of the bandwidth runs, MiB")
    parser.add_argument("--build-dir", default=root / "build",
                        type=pathlib.Path)
    args = parser.parse_args()
    if args.tensors <= 0 or args.threads <= 0 or args.repeat <= 0:
        parser.error("--tensors, --threads and --repeat must be positive")
    if args.pause < 0:
        parser.error("--pause must not be negative")

    # Our kernel reads MEGASLIDE_NUM_THREADS at every call.
    os.environ["MEGASLIDE_NUM_THREADS"] = str(args.threads)
    # numpy asks for transparent huge pages for large arrays, and so does
    # megaslide-membw; torch's own allocations (its moments) do so only with
    # this set. Without it torch alone would pay 4 KiB-page TLB misses.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    try:
        import torch
    except ImportError:
        sys.exit(INSTALL_HINT.format(python=sys.executable))
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.build_dir / "python_packages"))
    import megaslide

    membw_bin = args.build_dir / "bin" / "megaslide-membw"
    if not membw_bin.exists():
        sys.exit(f"{membw_bin} not found: build it with\n"
                 f"    cmake --build {args.build_dir} --target megaslide-membw")

    load_before = os.getloadavg()
    started = time.time()
    probes = [membw(membw_bin, args.threads, args.membw_mib, 5)]

    # The same data for every variant: fp32 params, N(0, 1) gradients (fp32,
    # and their bf16 rounding).
    n = args.params
    sizes = [n // args.tensors + (i < n % args.tensors)
             for i in range(args.tensors)]
    rng = np.random.default_rng(0)
    params0 = [rng.standard_normal(s, dtype=np.float32) for s in sizes]
    grads32 = [rng.standard_normal(s, dtype=np.float32) for s in sizes]
    grads16 = [to_bf16_bits(g) for g in grads32]

    def megaslide_variant(grads, working):
        state = [(p.copy(), np.zeros_like(p), np.zeros_like(p),
                  np.zeros(p.shape, np.uint16) if working else None)
                 for p in params0]
        step = [0]

        def run():
            step[0] += 1
            for (p, m, v, w), g in zip(state, grads):
                megaslide.adamw_step(p, m, v, g, step=step[0], working=w,
                                     **HYPER)
        return run

    def torch_variant(bf16_grads=False, working=False, **flavour):
        params = [torch.from_numpy(p.copy()).requires_grad_() for p in params0]
        for p, g in zip(params, grads32):
            p.grad = torch.from_numpy(g.copy())
        opt = torch.optim.AdamW(params, lr=HYPER["lr"],
                                betas=(HYPER["beta1"], HYPER["beta2"]),
                                eps=HYPER["eps"],
                                weight_decay=HYPER["weight_decay"], **flavour)
        if not bf16_grads:
            return opt.step
        g16 = [torch.from_numpy(g.copy()).view(torch.bfloat16)
               for g in grads16]
        out = [torch.empty(p.shape, dtype=torch.bfloat16) if working else None
               for p in params]

        def run():
            for p, g in zip(params, g16):
                p.grad.copy_(g)
            opt.step()
            for p, w in zip(params, out):
                if w is not None:
                    w.copy_(p)
        return run

    variants = {
        "megaslide bf16": megaslide_variant(grads16, False),
        "megaslide bf16+working": megaslide_variant(grads16, True),
        "megaslide fp32": megaslide_variant(grads32, False),
        "torch foreach": torch_variant(foreach=True),
        "torch fused": torch_variant(fused=True),
        "torch fused, bf16 g": torch_variant(bf16_grads=True, fused=True),
        "torch fused, bf16 g+w": torch_variant(bf16_grads=True, working=True,
                                               fused=True),
    }
    names = list(variants)
    times = {name: [] for name in names}
    probe = "bandwidth probe"
    with torch.no_grad():
        for name in names:
            variants[name]()  # warm-up: first touch, torch's lazy state
        slots = names + [probe]
        for r in range(args.repeat):
            for name in slots[r % len(slots):] + slots[:r % len(slots)]:
                if name == probe:
                    probes.append(membw(membw_bin, args.threads,
                                        args.membw_mib, 2))
                    continue
                # torch's OpenMP threads spin for a while after each
                # parallel region; the pause keeps them off the next
                # variant's cores (measured: without it a megaslide step
                # after a torch one ran ~5% slower, and the reverse not).
                time.sleep(args.pause)
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)

    load_after = os.getloadavg()
    huge = anon_huge_gib()
    kernels = ("copy", "triad", "update3+1")
    best_bw = {k: max(p[k]["best_gbs"] for p in probes) for k in kernels}
    median_bw = {k: statistics.median(p[k]["best_gbs"] for p in probes)
                 for k in kernels}
    bandwidth = median_bw["update3+1"]

    # Report.
    print(f"host AdamW, {n:,} params ({n / 2**20:g} Mi) in {args.tensors} "
          f"tensor(s), {args.threads} thread(s), median of {args.repeat} "
          f"interleaved rounds")
    print(f"machine: {machine()}")
    print(f"megaslide AdamW loop: {megaslide._megaslide.cpu_isa()}; "
          f"torch {torch.__version__} (CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads), numpy {np.__version__}, "
          f"python {platform.python_version()}")
    print(f"date: {datetime.datetime.fromtimestamp(started, datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, "
          f"{time.time() - started:.0f} s; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"hyper-parameters: {HYPER}")
    if huge is not None:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        print(f"transparent huge pages ({thp.strip()}): {huge:.2f} GiB of "
              f"this process's memory")
    print()
    print(f"memory bandwidth (megaslide-membw, {args.threads} thread(s), "
          f"{len(probes)} runs; best / median run; GB = 1e9 B):")
    for kernel in kernels:
        print(f"  {kernel:10} {best_bw[kernel]:6.2f} / {median_bw[kernel]:6.2f}"
              f" GB/s  ({probes[0][kernel]['what']})")
    print(f"  bound: update3+1 (the optimizer's access pattern), median run: "
          f"{bandwidth:.2f} GB/s")
    print()
    median = {name: n / statistics.median(t) for name, t in times.items()}
    best = {name: n / min(t) for name, t in times.items()}
    header = (f"{'variant':23} {'ms/step':>7} {'Mparam/s':>8} {'(best)':>7} "
              f"{'B/param':>7} {'bound':>6} {'of bound':>8} "
              f"{'GB/s':>5} {'vs foreach':>10} {'vs fused':>8} "
              f"{'vs same task':>12}")
    print(header)
    print("-" * len(header))
    for name in names:
        _, least, moved = TRAFFIC[name]
        bound = bandwidth * 1e9 / least  # params/s
        vs = ""
        if name.startswith("megaslide"):
            vs = (f"{median[name] / median['torch foreach']:9.2f}x "
                  f"{median[name] / median['torch fused']:7.2f}x "
                  f"{median[name] / median[SAME_TASK[name]]:11.2f}x")
        bytes_col = f"{least}" if least == moved else f"{least}({moved})"
        print(f"{name:23} {n / median[name] * 1e3:7.1f} "
              f"{median[name] / 1e6:8.1f} {best[name] / 1e6:7.1f} "
              f"{bytes_col:>7} {bound / 1e6:6.1f} "
              f"{median[name] / bound:8.0%} "
              f"{median[name] * moved / 1e9:5.2f} {vs}")
    print()
    print("Mparam/s: median round (best round); B/param: least bytes read + "
          "written per parameter\n(in brackets: what the variant actually "
          "moves); bound: median update3+1 bandwidth / B/param, Mparam/s;\n"
          "of bound: median Mparam/s over bound; GB/s: achieved traffic of "
          "the median, actual bytes;\nvs foreach / vs fused / vs same task: "
          "megaslide's median Mparam/s over torch's (same task: the torch\n"
          "variant doing the same work). Reads and writes:")
    for name in names:
        print(f"  {name:23} {TRAFFIC[name][0]}")


if __name__ == "__main__":
    main()
