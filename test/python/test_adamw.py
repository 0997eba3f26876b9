"""megaslide.adamw_step (the host AdamW kernel, runtime/cpu/AdamW.cpp)
against a float64 numpy reference written here from the update's
definition, against torch.optim.AdamW when torch is importable, and its
argument checking.

Tolerances (the kernel computes in float32, with its per-call coefficients
formed in double and rounded to float32; the reference in float64 from the
same float32 inputs and the same hyper-parameters):
  master, exp_avg, exp_avg_sq:  |got - ref| <= 1e-7 + 1e-6 |ref|
  working bf16:                 exactly the round-to-nearest-even bf16 of
                                the kernel's new float32 master
  torch.optim.AdamW (float32):  rtol 1e-6, atol 1e-7 after five steps
                                (torch computes in float32 too, from
                                float64 Python scalars, in another order
                                of operations)
"""

import numpy as np
import pytest

import megaslide

try:
    import torch
except ImportError:  # torch is a benchmark dependency, not a test one
    torch = None

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
TOL = dict(rtol=1e-6, atol=1e-7)


def bf16_bits(x):
    """Round-to-nearest-even bf16 bit patterns of finite float32 x."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reference_step(p, m, v, g, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in float64, in place on float64 arrays."""
    wd = weight_decay
    g = g.astype(np.float64)
    m[:] = beta1 * m + (1 - beta1) * g
    v[:] = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** step)
    v_hat = v / (1 - beta2 ** step)
    p[:] = p - lr * (wd * p + m_hat / (np.sqrt(v_hat) + eps))


def state(n, seed):
    rng = np.random.default_rng(seed)
    master = rng.uniform(-1, 1, n).astype(np.float32)
    return master, np.zeros(n, np.float32), np.zeros(n, np.float32), rng


def assert_close(got, ref, what):
    err = np.abs(got.astype(np.float64) - ref)
    bad = err > 1e-7 + 1e-6 * np.abs(ref)
    assert not bad.any(), (f"{what}: {bad.sum()} of {got.size} off, worst "
                           f"{err.max():.3g} at {int(err.argmax())}")


@pytest.mark.parametrize("n", [1, 17, 4099, 70001, 300007])
@pytest.mark.parametrize("grad_kind", ["bf16", "float32"])
@pytest.mark.parametrize("with_working", [False, True])
def test_matches_float64_reference(n, grad_kind, with_working):
    master, m, v, rng = state(n, seed=n)
    ref = [master.astype(np.float64), np.zeros(n), np.zeros(n)]
    working = np.full(n, 0xFFFF, np.uint16) if with_working else None
    for step in range(1, 6):
        g32 = rng.uniform(-2, 2, n).astype(np.float32)
        if grad_kind == "bf16":
            grad = bf16_bits(g32)
            g_ref = bf16_value(grad)
        else:
            grad = g_ref = g32
        megaslide.adamw_step(master, m, v, grad, step=step, working=working,
                             **HYPER)
        reference_step(*ref, g_ref, step, **HYPER)
        assert_close(m, ref[1], f"exp_avg at step {step}")
        assert_close(v, ref[2], f"exp_avg_sq at step {step}")
        assert_close(master, ref[0], f"master at step {step}")
        if with_working:
            np.testing.assert_array_equal(working, bf16_bits(master))


def test_accepts_any_shape():
    shape = (2, 3, 4)
    master, m, v, rng = state(24, seed=3)
    master, m, v = (a.reshape(shape) for a in (master, m, v))
    g = rng.uniform(-1, 1, shape).astype(np.float32)
    ref = [master.astype(np.float64), np.zeros(shape), np.zeros(shape)]
    working = np.zeros(shape, np.uint16)
    megaslide.adamw_step(master, m, v, g, step=1, working=working, **HYPER)
    reference_step(*ref, g, 1, **HYPER)
    assert_close(master, ref[0], "master")
    np.testing.assert_array_equal(working, bf16_bits(master))


def test_ml_dtypes_bfloat16_grad_is_read_as_its_bits():
    ml_dtypes = pytest.importorskip("ml_dtypes")  # comes with jax
    n = 1000
    master0, _, _, rng = state(n, seed=4)
    g = rng.uniform(-1, 1, n).astype(np.float32).astype(ml_dtypes.bfloat16)
    out = []
    for grad in (g, g.view(np.uint16)):
        master, m, v = master0.copy(), np.zeros(n, np.float32), np.zeros(
            n, np.float32)
        megaslide.adamw_step(master, m, v, grad, step=1, **HYPER)
        out.append(master)
    np.testing.assert_array_equal(out[0], out[1])


def test_step_and_hyper_parameters_are_used():
    # At step 1 with zero moments, m_hat = g and v_hat = g^2, so the step
    # is lr (wd p + sign(g) / (1 + eps / |g|)): about lr per element.
    n = 1000
    master, m, v, _ = state(n, seed=1)
    before = master.copy()
    g = np.full(n, 0.5, np.float32)
    megaslide.adamw_step(master, m, v, g, step=1, lr=1e-3)
    # |master| < 1: rounding the new master costs at most 2^-25 < 1e-7.
    np.testing.assert_allclose(before - master, 1e-3, rtol=1e-6, atol=1e-7)
    # 1 - beta is formed in double: no 1.3e-5 error from fp32(0.999).
    np.testing.assert_allclose(m, 0.05, rtol=3e-7)
    np.testing.assert_allclose(v, 0.00025, rtol=3e-7)


@pytest.mark.skipif(torch is None, reason="torch not installed "
                    "(benchmarks/requirements-bench.txt)")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw(weight_decay):
    n = 10007
    hyper = dict(HYPER, weight_decay=weight_decay)
    master, m, v, rng = state(n, seed=7)
    param = torch.nn.Parameter(torch.from_numpy(master.copy()))
    opt = torch.optim.AdamW([param], lr=hyper["lr"],
                            betas=(hyper["beta1"], hyper["beta2"]),
                            eps=hyper["eps"], weight_decay=weight_decay,
                            foreach=False)
    for step in range(1, 6):
        g = bf16_value(bf16_bits(rng.uniform(-2, 2, n).astype(np.float32)))
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        megaslide.adamw_step(master, m, v, bf16_bits(g), step=step, **hyper)
    st = opt.state[param]
    np.testing.assert_allclose(m, st["exp_avg"].numpy(), **TOL)
    np.testing.assert_allclose(v, st["exp_avg_sq"].numpy(), **TOL)
    np.testing.assert_allclose(master, param.detach().numpy(), **TOL)


def test_thread_count_does_not_change_bits(monkeypatch):
    n = 300007
    master0, _, _, rng = state(n, seed=5)
    grad = bf16_bits(rng.uniform(-1, 1, n).astype(np.float32))
    results = []
    for threads in ("1", "3"):
        monkeypatch.setenv("MEGASLIDE_NUM_THREADS", threads)
        master, m, v = master0.copy(), np.zeros(n, np.float32), np.zeros(
            n, np.float32)
        working = np.zeros(n, np.uint16)
        for step in (1, 2):
            megaslide.adamw_step(master, m, v, grad, step=step, lr=1e-3,
                                 working=working)
        results.append((master, m, v, working))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ---------------------------------------------------------------------------
# Argument checking: errors name the argument
# ---------------------------------------------------------------------------

def buffers(n=8):
    return (np.zeros(n, np.float32), np.zeros(n, np.float32),
            np.zeros(n, np.float32), np.zeros(n, np.uint16))


@pytest.mark.parametrize("index,name", [(0, "master"), (1, "exp_avg"),
                                        (2, "exp_avg_sq")])
def test_rejects_state_of_wrong_dtype(index, name):
    args = list(buffers())
    args[index] = args[index].astype(np.float64)
    with pytest.raises(TypeError, match=f"^{name} must have dtype float32"):
        megaslide.adamw_step(*args, step=1, lr=1e-3)


def test_rejects_grad_of_wrong_dtype():
    p, m, v, _ = buffers()
    with pytest.raises(TypeError, match="^grad must have dtype uint16 or "
                       "float32, got float64"):
        megaslide.adamw_step(p, m, v, np.zeros(8), step=1, lr=1e-3)


def test_rejects_working_of_wrong_dtype():
    p, m, v, g = buffers()
    with pytest.raises(TypeError, match="^working must have dtype uint16"):
        megaslide.adamw_step(p, m, v, g, step=1, lr=1e-3,
                             working=np.zeros(8, np.float32))


@pytest.mark.parametrize("index,name", [(1, "exp_avg"), (2, "exp_avg_sq"),
                                        (3, "grad")])
def test_rejects_shape_mismatch(index, name):
    args = list(buffers())
    args[index] = args[index][:7].copy()
    with pytest.raises(ValueError, match=f"^{name} has shape \\(7,\\), "
                       "expected \\(8,\\)"):
        megaslide.adamw_step(*args, step=1, lr=1e-3)


@pytest.mark.parametrize("index,name", [(0, "master"), (2, "exp_avg_sq"),
                                        (3, "grad")])
def test_rejects_non_contiguous(index, name):
    args = list(buffers())
    args[index] = np.zeros(16, args[index].dtype)[::2]
    with pytest.raises(ValueError, match=f"^{name} must be C-contiguous"):
        megaslide.adamw_step(*args, step=1, lr=1e-3)


def test_rejects_lists_and_read_only_and_aliasing():
    p, m, v, g = buffers()
    with pytest.raises(TypeError, match="^exp_avg must be a numpy.ndarray"):
        megaslide.adamw_step(p, [0.0] * 8, v, g, step=1, lr=1e-3)
    m.flags.writeable = False
    with pytest.raises(ValueError, match="^exp_avg must be writeable"):
        megaslide.adamw_step(p, m, v, g, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="^master and exp_avg_sq overlap"):
        megaslide.adamw_step(p, np.zeros(8, np.float32), p, g, step=1,
                             lr=1e-3)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(step=0), ValueError, "^step must be >= 1"),
    (dict(step=1.0), TypeError, "^step must be an int"),
    (dict(step=True), TypeError, "^step must be an int"),
    (dict(lr=-1.0), ValueError, "^lr must be in"),
    (dict(lr="1e-3"), TypeError, "^lr must be a float"),
    (dict(beta1=1.0), ValueError, "^beta1 must be in"),
    (dict(beta2=-0.1), ValueError, "^beta2 must be in"),
    (dict(eps=float("nan")), ValueError, "^eps must be in"),
    (dict(weight_decay=-0.1), ValueError, "^weight_decay must be in"),
])
def test_rejects_bad_scalars(kwargs, error, message):
    args = dict(step=1, lr=1e-3)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        megaslide.adamw_step(*buffers(), **args)


def test_update_is_in_place_and_returns_none():
    p, m, v, _ = buffers()
    g = np.ones(8, np.float32)
    assert megaslide.adamw_step(p, m, v, g, step=1, lr=1e-3) is None
    assert (p < 0).all() and (m > 0).all() and (v > 0).all()
