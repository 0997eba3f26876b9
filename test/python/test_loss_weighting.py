"""Loss weighting (--weighting-scheme, docs/Training.md "Loss weighting")
against diffusers: the weights of compute_loss_weighting_for_sd3
(sigma_sqrt, cosmap), the logit-normal density of torch.distributions,
and the weighted loss of diffusers' training scripts,

    torch.mean((weighting * (model_pred - target) ** 2)
               .reshape(target.shape[0], -1), 1).mean()

differentiated by torch autograd through diffusers' WanTransformer3DModel
(the tiny preset, float64, on the float32 values both sides see). The
tolerances are test_parity.py's f32 ones: loss rtol 1e-5, gradient
|g - r| <= 1e-4 |r| + 1e-4 max|r| elementwise. Measured: losses within
1.8e-7 relative, gradients within 1.3e-5 of their max; the weights within
5.8e-8 relative (one fp32 rounding).

Then what carries the weights: they follow the timesteps wherever those
come from (the recipe's sampling, the caller's, each grad-accum
micro-batch), the step reports the unweighted loss beside the weighted
one, validation stays unweighted, checkpoints refuse another scheme, a
plan and a recipe that disagree are refused, and a bad scheme is named.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from diffusers.training_utils import compute_loss_weighting_for_sd3  # noqa

import megaslide  # noqa: E402
from tiny_wan import randomise  # noqa: E402
from conftest import tool_path  # noqa: E402

SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[2]
FRAMES, HEIGHT, WIDTH, BATCH = 9, 64, 64, 3  # latents 3 x 8 x 8
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL_OF_MAX = 1e-5, 1e-4, 1e-4
# Far from 0 and 1 and from each other: every scheme weighs them apart.
TIMES = np.array([0.125, 0.5, 0.875], np.float32)
LOGIT = dict(logit_mean=0.3, logit_std=0.8)
SCHEMES = ["none", "sigma_sqrt", "cosmap", "logit-normal"]


def recipe(scheme):
    return dict(weighting_scheme=scheme,
                **(LOGIT if scheme == "logit-normal" else {}))


def reference_weights(scheme, sigmas):
    """Independent of MegaSlide: diffusers' function, or the logit-normal
    density as torch derives it (a normal pushed through the sigmoid)."""
    s = torch.as_tensor(np.asarray(sigmas), dtype=torch.float64)
    if scheme == "logit-normal":
        normal = torch.distributions.Normal(torch.tensor(LOGIT["logit_mean"],
                                                         dtype=torch.float64),
                                            LOGIT["logit_std"])
        density = torch.distributions.TransformedDistribution(
            normal, [torch.distributions.transforms.SigmoidTransform()])
        return density.log_prob(s).exp()
    return compute_loss_weighting_for_sd3(scheme, s)


def tiny_config():
    return json.loads((SOURCE_ROOT / "configs" / "tiny.json").read_text())



@pytest.fixture(scope="module")
def params():
    tr = megaslide.Trainer("tiny", FRAMES, HEIGHT, WIDTH, precision="f32",
                           attention="global", batch=BATCH)
    return randomise(tr.parameters(), 5)


@pytest.fixture(scope="module")
def model(params):
    import inspect
    keys = inspect.signature(
        diffusers.WanTransformer3DModel.__init__).parameters
    m = diffusers.WanTransformer3DModel(
        **{k: v for k, v in tiny_config().items() if k in keys})
    m = m.to(torch.float64)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    return m


def trainer(params, scheme="none", **options):
    tr = megaslide.Trainer("tiny", FRAMES, HEIGHT, WIDTH, precision="f32",
                           attention="global", batch=BATCH, seed=3,
                           **recipe(scheme), **options)
    tr.load_parameters(params)
    return tr


def batch_of(shapes, seed, micro_batches=1):
    rng = np.random.default_rng(seed)
    out = {name: rng.normal(size=(shape[0] * micro_batches, *shape[1:]))
           .astype(np.float32)
           for name, shape in shapes.items() if name != "timesteps"}
    out["timesteps"] = np.tile(TIMES, micro_batches)
    return out


def reference(model, batch, weights):
    """diffusers' weighted loss and its gradients (float64), and the
    unweighted loss."""
    model.zero_grad()
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    t = as64["timesteps"].reshape(-1, 1, 1, 1, 1)
    xt = (1 - t) * as64["latents"] + t * as64["noise"]
    pred = model(hidden_states=xt, timestep=1000 * as64["timesteps"],
                 encoder_hidden_states=as64["condition"],
                 return_dict=False)[0]
    target = as64["noise"] - as64["latents"]
    weighting = weights.reshape(-1, 1, 1, 1, 1)
    loss = torch.mean((weighting * (pred - target) ** 2).reshape(
        target.shape[0], -1), 1).mean()
    loss.backward()
    unweighted = torch.mean((pred - target) ** 2).item()
    return loss.item(), unweighted, {n: p.grad.numpy()
                                     for n, p in model.named_parameters()}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_are_diffusers(scheme):
    sigmas = np.linspace(0.001, 0.999, 999, dtype=np.float32)
    got = megaslide.loss_weights(sigmas, **recipe(scheme))
    ref = reference_weights(scheme, sigmas).numpy()
    assert got.dtype == np.float32 and got.shape == sigmas.shape
    # fp32 results of float64 arithmetic: one rounding apart.
    np.testing.assert_allclose(got, ref, rtol=2e-7, atol=0)


def test_weights_at_the_ends():
    ends = np.array([0.0, 1.0], np.float32)
    # sigma_sqrt is infinite at 0 (a step there is skipped as non-finite);
    # the density vanishes at both ends.
    assert megaslide.loss_weights(ends, weighting_scheme="sigma_sqrt")[0] \
        == np.inf
    assert list(megaslide.loss_weights(ends, weighting_scheme="cosmap")) == \
        list(reference_weights("cosmap", ends).float().numpy())
    assert list(megaslide.loss_weights(
        ends, weighting_scheme="logit-normal")) == [0.0, 0.0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_f32_weighted_loss_and_gradients_equal_diffusers(params, model,
                                                         scheme):
    tr = trainer(params, scheme)
    batch = batch_of(tr.input_shapes(), 7)
    loss, unweighted, ref = reference(
        model, batch, reference_weights(scheme, batch["timesteps"]))
    got_loss, grads = tr.gradients(**batch)
    assert math.isclose(got_loss, loss, rel_tol=LOSS_RTOL), (got_loss, loss)
    assert set(grads) == set(ref)
    failures = []
    for name, r in ref.items():
        g = np.asarray(grads[name], np.float64)
        bound = GRAD_RTOL * np.abs(r) + GRAD_ATOL_OF_MAX * np.abs(r).max()
        if not (np.abs(g - r) <= bound).all():
            failures.append(f"{name}: max error {np.abs(g - r).max():.3g}, "
                            f"max|r| {np.abs(r).max():.3g}")
    assert not failures, "\n".join(failures)
    # A step on the caller's timesteps: the weighted loss, and beside it
    # the unweighted one (None for an unweighted run).
    step = tr.step(**batch)
    assert step["loss"] == got_loss
    if scheme == "none":
        assert step["unweighted_loss"] is None
    else:
        assert not math.isclose(loss, unweighted, rel_tol=1e-3)
        assert math.isclose(step["unweighted_loss"], unweighted,
                            rel_tol=LOSS_RTOL), (step, unweighted)


def test_weights_follow_the_recipes_timesteps(params):
    # Left out, the timesteps are the recipe's (sample_sigmas), and so are
    # the weights; two micro-batches (grad_accum) each get their own.
    tr = trainer(params, "cosmap", grad_accum=2)
    shapes = tr.input_shapes()
    batch = batch_of(shapes, 8, micro_batches=2)
    del batch["timesteps"]
    step = tr.step(**batch)
    sigmas = megaslide.sample_sigmas(3, 0, 2 * BATCH)
    halves = []
    for k in range(2):
        twin = trainer(params, "cosmap")
        half = {n: v[k * BATCH:(k + 1) * BATCH] for n, v in batch.items()}
        half["timesteps"] = sigmas[k * BATCH:(k + 1) * BATCH]
        halves.append(twin.gradients(**half)[0])
    assert math.isclose(step["loss"], sum(halves) / 2, rel_tol=1e-6), (
        step["loss"], halves)


def test_validation_and_metrics(params, tmp_path):
    from safetensors.numpy import save_file
    val = tmp_path / "val"
    val.mkdir()
    rng = np.random.default_rng(11)
    shapes = trainer(params).input_shapes()
    for k in range(BATCH):
        save_file({n: rng.normal(size=shapes[n][1:]).astype(np.float32)
                   for n in ("latents", "condition")},
                  str(val / f"{k}.safetensors"))
    losses = {}
    for scheme in ("none", "sigma_sqrt"):
        metrics = tmp_path / f"{scheme}.jsonl"
        tr = trainer(params, scheme, val_data=val, metrics=metrics)
        losses[scheme] = tr.validation_loss()
        tr.step()
        tr.close()
        line = json.loads(metrics.read_text().splitlines()[0])
        # The unweighted loss is logged beside a weighted one only.
        assert ("unweighted_loss" in line) == (scheme != "none"), line
    # Validation is unweighted whatever the scheme: comparable across runs.
    assert losses["sigma_sqrt"] == losses["none"], losses


def test_resume_with_another_scheme_is_refused(params, tmp_path):
    with trainer(params, "cosmap", checkpoint_dir=tmp_path) as tr:
        tr.train(1)
    with trainer(params, "sigma_sqrt", checkpoint_dir=tmp_path) as tr:
        with pytest.raises(ValueError,
                           match="weighting_scheme: cosmap in the checkpoint, "
                                 "sigma_sqrt now"):
            tr.resume()


def test_plans(params):
    plain = json.loads(megaslide.exec_plan("tiny", 5, 32, 32))
    weighted = json.loads(megaslide.exec_plan("tiny", 5, 32, 32,
                                              weighted_loss=True))
    names = [[p["values"][i]["name"] for i in p["inputs"]]
             for p in (plain, weighted)]
    assert "loss_weights" not in names[0] and "loss_weights" in names[1]
    # Plans of an unweighted loss are the versions they were; a weighted
    # one is version 5 and returns the unweighted loss too.
    assert plain["version"] < 5 and len(plain["outputs"]) == 1
    assert weighted["version"] == 5 and len(weighted["outputs"]) == 2
    # The weights are the session's, never the caller's.
    tr = megaslide.Trainer(plan_json=json.dumps(weighted),
                           weighting_scheme="cosmap")
    assert "loss_weights" not in tr.input_shapes()
    with pytest.raises(ValueError, match="weights the loss per sample .*"
                                         "this run's is none"):
        megaslide.Trainer(plan_json=json.dumps(weighted))
    with pytest.raises(ValueError, match="--weighting-scheme cosmap weights "
                                         "the loss per sample, but the plan "
                                         "was compiled without loss weights"):
        megaslide.Trainer(plan_json=json.dumps(plain),
                          weighting_scheme="cosmap")


def test_a_bad_scheme_is_named(tmp_path):
    message = ("must be none, sigma_sqrt, cosmap or logit-normal, got "
               "'logit_normal'")
    with pytest.raises(ValueError, match="weighting_scheme " + message):
        megaslide.Trainer("tiny", 5, 32, 32, weighting_scheme="logit_normal")
    for tool in ("megaslide-run", "megaslide-plan"):
        result = subprocess.run(
            [tool_path(tool), "--model", "tiny", "--frames", "5", "--height",
             "32", "--width", "32", "--weighting-scheme", "logit_normal"],
            capture_output=True, text=True)
        assert result.returncode == 1, result.stderr
        assert ("--weighting-scheme: unknown scheme 'logit_normal'; use none, "
                "sigma_sqrt, cosmap or logit-normal") in result.stderr, \
            result.stderr
