"""Leaner AdamW moments on the host (docs/Training.md, "Leaner optimizer
states") and the AdamW hyper-parameter flags.

int8-moments is checked against a numpy reimplementation written here from
bitsandbytes' definitions (create_dynamic_map, block-wise quantization with
blocks of 256 and one absmax each, the 8-bit AdamW update: dequantize, AdamW
in fp32, requantize), not from MegaSlide's C++; factored-moments against
Adafactor's factored second moment (Shazeer & Stern 2018) with AdamW's
first moment and bias corrections. The runs check that both train, resume
bit-exactly, do not depend on the thread count, and that a checkpoint of
one policy is refused by another; --adam-beta2 against torch.optim.AdamW.

Tolerances:
  dynamic map         bitwise equal to torch's float32 create_dynamic_map
  int8 update         (parameters of >= 4096 elements; smaller ones keep
                      fp32 moments, as bitsandbytes' min_8bit_size)
                      the reference does AdamW in float32 with the same
                      operations and coefficients (each formed in double,
                      rounded to float32 once), so masters, codes and absmax
                      are bitwise equal over 5 steps; a tie between two codes
                      (none occurs in this data; the test counts them) goes
                      to the lower code on both sides
  factored update     float64 statistics: rel 1e-6; masters rel 1e-5 + abs
                      1e-6 after 4 steps (m is rounded to bf16 on both sides)
  quality             on tiny, 300 steps, seed 0, lr 2e-3: the mean loss of
                      the last 50 steps within 5 % of fp32 AdamW's (which
                      itself moves by 2.4 % for a 5 % change of lr)
  --adam-beta2        torch.optim.AdamW(betas=(0.9, 0.99), eps=1e-6) from
                      the Trainer's gradients, lr 1e-2: abs 2e-6 after 5
                      steps (measured 3e-8 at lr 1e-3); torch's default
                      beta2 differs by more than 50 times that
"""

import json
import os
import subprocess

import numpy as np
import pytest

import megaslide
from megaslide import _megaslide
from conftest import tool_path

try:
    import torch
except ImportError:  # a benchmark dependency, not a test one
    torch = None

BLOCK = 256
# Of fp32 AdamW's final mean loss; fp32 AdamW itself moves by up to 2.4 %
# when its lr moves by 5 % (measured, docs/Training.md).
QUALITY_MARGIN = 0.05
ADAMW_ATOL = 2e-6


# ---------------------------------------------------------------------------
# The definitions, written from bitsandbytes' functional.py and the paper
# ---------------------------------------------------------------------------

def linspace32(start, end, steps):
    """torch.linspace(start, end, steps) in float32 as ATen's CPU kernel
    computes it: the step in float32, then start + step i (first half) and
    end - step (steps - 1 - i) (second half) each rounded once (a fused
    multiply-add; in float64 here, where the product and the sum are
    exact)."""
    start, end = np.float32(start), np.float32(end)
    step = np.float64((end - start) / np.float32(steps - 1))
    i = np.arange(steps)
    return np.where(i < steps // 2, np.float64(start) + step * i,
                    np.float64(end) - step * (steps - i - 1)
                    ).astype(np.float32)


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes.functional.create_dynamic_map, in numpy float32."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                 else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        b = linspace32(0.1, 1, items)
        means = (b[:-1] + b[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += list(scale * means)
        if signed:
            data += list(-scale * means)
    data += [np.float32(0), np.float32(1)]
    assert len(data) == 2 ** total_bits
    return np.sort(np.array(data, np.float32))


def quantize(x, code):
    """Block-wise: x / absmax of its block, then the nearest code (ties to
    the lower code); a block of zeros has absmax 0 and the code of 0.
    Returns the codes, the absmax and how many values were ties."""
    n = x.size
    blocks = -(-n // BLOCK)
    pad = np.zeros(blocks * BLOCK, np.float32)
    pad[:n] = x
    absmax = np.abs(pad.reshape(blocks, BLOCK)).max(axis=1)
    scale = np.repeat(absmax, BLOCK)[:n]
    y = np.where(scale > 0, x / np.where(scale > 0, scale, 1), 0).astype(
        np.float32)
    hi = np.clip(np.searchsorted(code, y, side="right"), 1, 255)
    lo = hi - 1
    dlo, dhi = y - code[lo], code[hi] - y
    codes = np.where(dlo <= dhi, lo, hi)
    codes = np.where(y <= code[0], 0, np.where(y >= code[255], 255, codes))
    ties = int(np.sum((dlo == dhi) & (y > code[0]) & (y < code[255])))
    return codes.astype(np.uint8), absmax.astype(np.float32), ties


def dequantize(codes, absmax, code):
    return code[codes] * np.repeat(absmax, BLOCK)[:codes.size]


def coefficients(step, beta1, beta2, lr, eps, wd):
    f = np.float32
    return dict(b1=f(beta1), omb1=f(1 - beta1), b2=f(beta2), omb2=f(1 - beta2),
                ibc1=f(1 / (1 - beta1 ** step)),
                ibc2=f(1 / (1 - beta2 ** step)), lr=f(lr), eps=f(eps),
                wd=f(wd))


def adamw32(p, m, v, g, c):
    """AdamW in float32 numpy, operation by operation."""
    m = c["b1"] * m + c["omb1"] * g
    v = c["b2"] * v + c["omb2"] * (g * g)
    m_hat, v_hat = m * c["ibc1"], v * c["ibc2"]
    p = p - c["lr"] * (c["wd"] * p + m_hat / (np.sqrt(v_hat) + c["eps"]))
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)


# ---------------------------------------------------------------------------
# Kernels against the definitions
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bitsandbytes(signed):
    ours = np.frombuffer(_megaslide._dynamic_map(signed), np.float32)
    np.testing.assert_array_equal(ours.view(np.uint32),
                                  create_dynamic_map(signed).view(np.uint32))
    if torch is not None:  # the definition as bitsandbytes runs it
        data = []
        for i in range(7):
            items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
            b = torch.linspace(0.1, 1, items, dtype=torch.float32)
            means = (b[:-1] + b[1:]) / 2.0
            data += (10 ** (-6 + i) * means).tolist()
            if signed:
                data += (-(10 ** (-6 + i)) * means).tolist()
        data += [0, 1.0]
        data.sort()
        np.testing.assert_array_equal(
            ours, torch.tensor(data, dtype=torch.float32).numpy())


def test_int8_update_matches_reference_over_five_steps():
    n = 3 * BLOCK + 41
    rng = np.random.default_rng(7)
    p = rng.uniform(-1, 1, n).astype(np.float32)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01)
    sm, um = create_dynamic_map(True), create_dynamic_map(False)
    zero = np.zeros(n, np.float32)
    mc, ma, _ = quantize(zero, sm)
    vc, va, _ = quantize(zero, um)
    ours = [p.copy(), mc.copy(), ma.copy(), vc.copy(), va.copy()]
    ties = 0
    for step in range(1, 6):
        g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
        _megaslide._adamw8bit_step(*ours, g, step, **hyper)
        c = coefficients(step, hyper["beta1"], hyper["beta2"], hyper["lr"],
                         hyper["eps"], hyper["weight_decay"])
        p, m, v = adamw32(p, dequantize(mc, ma, sm), dequantize(vc, va, um),
                          g, c)
        mc, ma, t1 = quantize(m, sm)
        vc, va, t2 = quantize(v, um)
        ties += t1 + t2
    np.testing.assert_array_equal(ours[0], p)
    np.testing.assert_array_equal(ours[1], mc)
    np.testing.assert_array_equal(ours[2], ma)
    np.testing.assert_array_equal(ours[3], vc)
    np.testing.assert_array_equal(ours[4], va)
    assert ties == 0  # else the comparison would depend on the tie rule


def test_factored_update_matches_adafactor_statistics():
    rows, cols = 19, 45
    rng = np.random.default_rng(4)
    p = rng.uniform(-1, 1, (rows, cols)).astype(np.float32)
    m = np.zeros((rows, cols), np.uint16)
    r, c = np.zeros(rows, np.float32), np.zeros(cols, np.float32)
    ref_p, ref_m = p.astype(np.float64), np.zeros((rows, cols))
    ref_r, ref_c = np.zeros(rows), np.zeros(cols)
    b1, b2, lr, eps = 0.9, 0.999, 1e-2, 1e-8
    for t in range(1, 5):
        g = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        _megaslide._adamw_factored_step(p, m, r, c, g, t, lr, b1, b2, eps,
                                        0.0)
        sq = g.astype(np.float64) ** 2 + 1e-30  # Adafactor's eps1
        ref_r = b2 * ref_r + (1 - b2) * sq.sum(axis=1)
        ref_c = b2 * ref_c + (1 - b2) * sq.sum(axis=0)
        v = np.outer(ref_r, ref_c) / ref_r.sum()
        mi = b1 * ref_m + (1 - b1) * g
        ref_p -= lr * (mi / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        # m is kept in bf16 (round to nearest even), here as in the kernel.
        bits = mi.astype(np.float32).view(np.uint32).astype(np.uint64)
        ref_m = ((((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16)
                 .astype(np.uint32).view(np.float32).astype(np.float64))
    np.testing.assert_allclose(r, ref_r, rtol=1e-6)
    np.testing.assert_allclose(c, ref_c, rtol=1e-6)
    np.testing.assert_allclose(p, ref_p, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------

SMALL = ("--model", "tiny", "--frames", 5, "--height", 32, "--width", 32,
         "--lr", "1e-3")
RECIPE = ("--max-grad-norm", "1.0", "--grad-accum", 2, "--ema-decay", 0.9)


def run(*args, check=True, env=None):
    result = subprocess.run([tool_path("megaslide-run"), "--no-progress",
                             *map(str, args)], capture_output=True, text=True,
                            env=env)
    if check and result.returncode != 0:
        raise AssertionError(result.stdout + result.stderr)
    return result


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


@pytest.mark.parametrize("policy", ["int8-moments", "factored-moments"])
def test_resume_is_bit_exact_and_thread_count_free(tmp_path, policy):
    flags = (*SMALL, *RECIPE, "--host-state-policy", policy)
    env = dict(os.environ, MEGASLIDE_NUM_THREADS="1")
    run(*flags, "--steps", 6, "--metrics", tmp_path / "full.jsonl", env=env)
    ck = tmp_path / "ck"
    run(*flags, "--steps", 3, "--checkpoint-dir", ck, "--metrics",
        tmp_path / "a.jsonl")
    run(*flags, "--steps", 3, "--checkpoint-dir", ck, "--resume",
        "--metrics", tmp_path / "b.jsonl")
    full = losses(tmp_path / "full.jsonl")
    assert losses(tmp_path / "a.jsonl") + losses(tmp_path / "b.jsonl") == full
    # The moments are saved as kept: codes and absmax, or statistics.
    header = (ck / "step-000006" / "state.safetensors").read_bytes()
    length = int.from_bytes(header[:8], "little")
    meta = json.loads(header[8:8 + length])
    assert meta["__metadata__"]["host_state"] == policy
    suffixes = ((".exp_avg.codes", ".exp_avg_sq.absmax")
                if policy == "int8-moments"
                else (".exp_avg_sq.row_stat", ".exp_avg_sq.col_stat"))
    for suffix in suffixes:
        assert "blocks.0.ffn.net.0.proj.weight" + suffix in meta


@pytest.mark.parametrize("policy", ["int8-moments", "factored-moments"])
def test_streaming_updates_are_thread_count_free(tmp_path, policy):
    flags = (*SMALL, "--update", "streaming", "--max-grad-norm", "1.0",
             "--ema-decay", 0.9, "--host-state-policy", policy, "--steps", 4)
    got = []
    for threads in ("1", "2"):
        metrics = tmp_path / f"{threads}.jsonl"
        run(*flags, "--metrics", metrics,
            env=dict(os.environ, MEGASLIDE_NUM_THREADS=threads))
        got.append(losses(metrics))
    assert got[0] == got[1] and all(np.isfinite(got[0]))


def test_a_job_of_several_ranks_is_refused():
    r = subprocess.run([tool_path("megaslide-plan"), "--model", "tiny",
                        "--frames", "5", "--height", "32", "--width", "32",
                        "--gpus-per-node", "2", "--host-state-policy",
                        "int8-moments"], capture_output=True, text=True)
    assert r.returncode != 0
    assert ("'int8-moments' is for a job of one rank" in r.stderr and
            "this job has 2; use master-moments or bf16-moments" in r.stderr), \
        r.stderr


def test_checkpoint_of_another_policy_is_refused(tmp_path):
    ck = tmp_path / "ck"
    run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--host-state-policy",
        "int8-moments")
    bad = run(*SMALL, "--steps", 1, "--checkpoint-dir", ck, "--resume",
              "--host-state-policy", "factored-moments", check=False)
    assert bad.returncode != 0
    assert "host-state-policy" in bad.stderr or "plan" in bad.stderr


def test_each_trains_as_well_as_fp32_adamw(tmp_path):
    final = {}
    for policy in ("master-moments", "int8-moments", "factored-moments"):
        metrics = tmp_path / f"{policy}.jsonl"
        run("--model", "tiny", "--steps", 300, "--lr", "2e-3", "--seed", 0,
            "--host-state-policy", policy, "--metrics", metrics)
        final[policy] = float(np.mean(losses(metrics)[-50:]))
    base = final["master-moments"]
    for policy in ("int8-moments", "factored-moments"):
        assert abs(final[policy] / base - 1) <= QUALITY_MARGIN, final


def test_plan_reports_the_bytes_of_each_policy():
    plan = tool_path("megaslide-plan")
    out = {}
    for policy in ("master-moments", "int8-moments", "factored-moments"):
        r = subprocess.run([plan, "--model", "tiny", "--frames", "17",
                            "--height", "64", "--width", "64",
                            "--host-state-policy", policy, "--format",
                            "json"], capture_output=True, text=True,
                           check=True)
        report = json.loads(r.stdout)
        out[policy] = report
    policies = {p["name"]: p for p in
                out["master-moments"]["memory"]["host_state_policies"]}
    trainable = out["master-moments"]["memory"]["params"]["trainable"] \
        if "params" in out["master-moments"]["memory"] else None
    assert policies["int8-moments"]["bytes_per_param"] == 6
    assert policies["factored-moments"]["bytes_per_param"] == 6
    assert (policies["int8-moments"]["bytes"] <
            policies["bf16-moments"]["bytes"] <
            policies["master-moments"]["bytes"])
    del trainable


# ---------------------------------------------------------------------------
# --adam-beta1, --adam-beta2, --adam-eps
# ---------------------------------------------------------------------------

def torch_adamw(start, grads, names, betas, eps, lr):
    params = [torch.tensor(start[n], dtype=torch.float32, requires_grad=True)
              for n in names]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps,
                            weight_decay=0.0)
    for g in grads:
        for p, n in zip(params, names):
            p.grad = torch.tensor(g[n], dtype=torch.float32)
        opt.step()
    return {n: p.detach().numpy() for p, n in zip(params, names)}


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_adam_beta2_matches_torch_adamw():
    lr, steps = 1e-2, 5
    tr = megaslide.Trainer("tiny", frames=5, height=32, width=32, lr=lr,
                           adam_beta2=0.99, adam_eps=1e-6)
    shapes = tr.input_shapes()
    rng = np.random.default_rng(0)
    start = tr.parameters()
    grads = []
    for _ in range(steps):
        batch = {k: rng.standard_normal(shapes[k]).astype(np.float32)
                 for k in ("latents", "noise", "condition")}
        t = rng.uniform(0.1, 0.9, shapes["timesteps"]).astype(np.float32)
        # parameters() applies the previous step's deferred update, which
        # gradients() would not see otherwise.
        tr.parameters()
        grads.append(tr.gradients(batch["latents"], batch["noise"], t,
                                  batch["condition"])[1])
        tr.step(timesteps=t, **batch)
    names = sorted(grads[0])
    got = tr.parameters()
    want = torch_adamw(start, grads, names, (0.9, 0.99), 1e-6, lr)
    default = torch_adamw(start, grads, names, (0.9, 0.999), 1e-6, lr)
    for n in names:
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=ADAMW_ATOL,
                                   err_msg=n)
    # torch's default beta2 is far outside the tolerance: the flag matters.
    assert max(np.max(np.abs(got[n] - default[n])) for n in names) > \
        50 * ADAMW_ATOL


@pytest.mark.parametrize("flag,value,message", [
    ("--adam-beta1", "1", "--adam-beta1 must be in [0, 1), got 1"),
    ("--adam-beta2", "-0.5", "--adam-beta2 must be in [0, 1), got -0.5"),
    ("--adam-eps", "0", "--adam-eps must be a positive number, got 0"),
])
def test_bad_adam_hyper_parameters_are_refused(flag, value, message):
    r = run(*SMALL, "--steps", 1, flag, value, check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_diffusers_spellings_point_at_the_flags():
    r = run(*SMALL, "--steps", 1, "--adam_beta2", "0.99", check=False)
    assert r.returncode != 0 and "--adam-beta2" in r.stderr, r.stderr
    r = run(*SMALL, "--steps", 1, "--adam_epsilon", "1e-6", check=False)
    assert r.returncode != 0 and "--adam-eps" in r.stderr, r.stderr


def test_python_adam_keywords_are_checked():
    with pytest.raises(ValueError,
                       match=r"adam_beta2.: must be in \[0, 1\)"):
        megaslide.exec_plan("tiny", 5, 32, 32, adam_beta2=1.5)
    with pytest.raises(ValueError, match="adam_eps must be a finite number"):
        megaslide.exec_plan("tiny", 5, 32, 32, adam_eps=float("nan"))
    plan = json.loads(megaslide.exec_plan("tiny", 5, 32, 32, adam_beta1=0.8,
                                          adam_beta2=0.95, adam_eps=1e-6))
    adamw = [i for i in plan["instructions"] if i["op"] == "host_adamw"]
    assert adamw and all(i["attrs"]["beta1"] == 0.8 and
                         i["attrs"]["beta2"] == 0.95 and
                         i["attrs"]["eps"] == 1e-6 for i in adamw)
