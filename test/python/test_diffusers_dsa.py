"""Sampling a MegaSlide-trained model with diffusers: the stock
WanTransformer3DModel, and with megaslide.diffusers.enable_dsa its 3D-DSA
processor, against megaslide's own forward (Trainer.predict) on the same
weights and inputs.

The tiny preset (2-layer Wan 2.1) at 13 x 96 x 96 pixels: latents
4 x 12 x 12, token grid (4, 6, 6), 144 tokens. 3D-DSA with window
(2, 3, 3), tile (1, 2, 2) and radius 2: the grid exceeds the window along
every axis, so the planner rewrites both self-attentions; windows start at
0..2 in t and 0..3 in y and x, and block matching on random weights picks
non-zero displacements (test_block_matching_is_non_trivial).

Parameters are random and non-trivial as in test_parity.py (diffusers'
zero-initialised proj_out is random here, norm gains are 1 + noise);
timesteps are multiples of 1/8, so 1000 t is exact in float32 on both
sides. No downloads (HF_HUB_OFFLINE).

Tolerance: |diffusers - megaslide| <= 1e-5 max|megaslide| elementwise, in
float32. fp32 has a unit roundoff of 6e-8; the forward chains ~40 ops per
block with reductions over 144 tokens and 256 channels, and torch and
megaslide order their sums differently (GEMM blocking, softmax, norms),
which test_parity.py measured at about 1e-6 of a tensor's scale for the
same model against jax float32. Measured here: 1.0e-6 (global), 1.0e-6
(3D-DSA, megaslide backend) and 1.1e-6 (flex backend) of max|output|; the
bound leaves 10x for another BLAS or thread count, and a semantic slip
moves the output by far more: global attention against the 3D-DSA model
0.11, zero offsets 0.11, negated offsets 0.13 of max|output| (the tests
require more than 1e-3). Two Euler steps of diffusers' flow-matching
scheduler: 1.4e-6 with 3D-DSA, 0.067 with global attention.
"""

from __future__ import annotations

import json
import math
import os
import types

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import megaslide  # noqa: E402
from tiny_wan import randomise  # noqa: E402
import megaslide.diffusers as msd  # noqa: E402

FRAMES, HEIGHT, WIDTH = 13, 96, 96
GRID = (4, 6, 6)
WINDOW, TILE, RADIUS = (2, 3, 3), (1, 2, 2), 2
RTOL = 1e-5
SEED = 3



def make_trainer(attention, frames=FRAMES, height=HEIGHT, width=WIDTH,
                 **options):
    options.setdefault("dsa_window", WINDOW)
    options.setdefault("dsa_tile", TILE)
    options.setdefault("dsa_radius", RADIUS)
    return megaslide.Trainer("tiny", frames, height, width, backend="cpu",
                             precision="f32", attention=attention, seed=0,
                             **options)


def batch_of(trainer, seed):
    shapes = trainer.input_shapes()
    rng = np.random.default_rng(seed)
    B = shapes["latents"][0]
    t = (np.arange(B) % 6 + 2) / 8  # 0.25, 0.375, ...: 1000 t exact
    return dict(
        latents=rng.normal(size=shapes["latents"]).astype(np.float32),
        noise=rng.normal(size=shapes["noise"]).astype(np.float32),
        timesteps=t.astype(np.float32),
        condition=rng.normal(size=shapes["condition"]).astype(np.float32))


def diffusers_forward(transformer, batch):
    """The transformer's velocity at x_t = (1 - t) x0 + t noise, timestep
    1000 t: what a flow-matching sampler calls it with."""
    t = batch["timesteps"]
    tb = t.reshape(-1, 1, 1, 1, 1)
    xt = ((1 - tb) * batch["latents"] + tb * batch["noise"]).astype(np.float32)
    with torch.no_grad():
        out = transformer(hidden_states=torch.from_numpy(xt),
                          timestep=torch.from_numpy(1000 * t),
                          encoder_hidden_states=torch.from_numpy(
                              batch["condition"]),
                          return_dict=False)[0]
    return out.numpy()


def relative_error(a, ref):
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def load_transformer(path):
    return diffusers.WanTransformer3DModel.from_pretrained(
        str(path), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Global and 3D-DSA Trainers on the same random weights, their saved
    weights, and one batch with megaslide's prediction for each."""
    root = tmp_path_factory.mktemp("diffusers_dsa")
    out = {}
    params = None
    for attention in ("global", "dsa"):
        tr = make_trainer(attention)
        if params is None:
            params = randomise(tr.parameters(), SEED)
        tr.load_parameters(params)
        batch = batch_of(tr, SEED)
        path = root / attention
        tr.save_weights(str(path))
        out[attention] = types.SimpleNamespace(
            trainer=tr, path=path, batch=batch,
            predicted=tr.predict(**batch),
            config=json.loads((path / "config.json").read_text()))
    return out


# ---------------------------------------------------------------------------
# Trainer.predict
# ---------------------------------------------------------------------------

def test_predict_leaves_the_state_untouched(runs):
    run = runs["global"]
    before = run.trainer.parameters()
    again = run.trainer.predict(**run.batch)
    np.testing.assert_array_equal(again, run.predicted)  # deterministic
    assert run.trainer.step_count == 0
    after = run.trainer.parameters()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert run.predicted.shape == run.batch["latents"].shape
    assert run.predicted.dtype == np.float32


def test_predict_is_the_prediction_the_loss_reads(runs):
    # flow_matching_loss = mean((pred - (noise - x0))^2): the loss of the
    # same batch, recomputed from predict's output.
    run = runs["global"]
    loss, _ = run.trainer.gradients(**run.batch)
    b = run.batch
    residual = run.predicted.astype(np.float64) - (
        b["noise"].astype(np.float64) - b["latents"])
    assert np.mean(residual ** 2) == pytest.approx(loss, rel=1e-5)


def test_predict_refuses_sim_and_missing_timesteps(runs):
    sim = megaslide.Trainer("tiny", 5, 32, 32, backend="sim")
    with pytest.raises(ValueError, match="backend='cpu'"):
        sim.predict(**{k: np.zeros(s, np.float32)
                       for k, s in sim.input_shapes().items()})
    b = dict(runs["global"].batch)
    del b["timesteps"]
    with pytest.raises(TypeError):
        runs["global"].trainer.predict(**b)


# ---------------------------------------------------------------------------
# The _megaslide record in config.json
# ---------------------------------------------------------------------------

def test_config_records_the_dsa_configuration(runs):
    record = runs["dsa"].config["_megaslide"]
    assert record == {
        "format": 1, "attention": "dsa", "grid": list(GRID),
        "dsa3d": {"window": list(WINDOW), "tile": list(TILE),
                  "radius": RADIUS, "layers": [0, 1]},
        "global_layers": []}
    assert runs["global"].config["_megaslide"] == {
        "format": 1, "attention": "global", "grid": list(GRID),
        "global_layers": [0, 1]}


def test_config_records_attention_the_planner_kept_global(tmp_path):
    # 5 x 32 x 32 pixels: grid (2, 2, 2) is smaller than the window along
    # every axis, so the planner keeps global attention.
    tr = make_trainer("dsa", 5, 32, 32)
    tr.save_weights(str(tmp_path))
    record = json.loads((tmp_path / "config.json").read_text())["_megaslide"]
    assert record["attention"] == "global"
    assert record["global_layers"] == [0, 1]
    assert "dsa3d" not in record
    transformer = load_transformer(tmp_path)
    with pytest.raises(ValueError, match="trained with global attention"):
        msd.enable_dsa(transformer)


def test_saved_config_loads_back(runs, tmp_path):
    # megaslide reads its own config.json (with the key) as a model config,
    # and its weights (with or without the key next to them).
    path = runs["dsa"].path
    tr = megaslide.Trainer(str(path / "config.json"), 5, 32, 32,
                           precision="f32")
    tr.load_weights(str(path))
    np.testing.assert_array_equal(
        tr.parameters()["proj_out.weight"],
        runs["dsa"].trainer.parameters()["proj_out.weight"])
    config = dict(runs["dsa"].config)
    del config["_megaslide"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    megaslide.Trainer(str(tmp_path / "config.json"), 5, 32, 32)


def test_enable_dsa_reads_the_record(runs):
    transformer = load_transformer(runs["dsa"].path)
    settings = msd.enable_dsa(transformer)
    assert (settings.window, settings.tile, settings.radius,
            settings.layers) == (WINDOW, TILE, RADIUS, (0, 1))
    assert all(isinstance(b.attn1.processor, msd.Dsa3dAttnProcessor)
               for b in transformer.blocks)
    assert not any(isinstance(b.attn2.processor, msd.Dsa3dAttnProcessor)
                   for b in transformer.blocks)
    # A pipeline: anything whose .transformer is the model.
    msd.disable_dsa(transformer)
    assert not any(isinstance(b.attn1.processor, msd.Dsa3dAttnProcessor)
                   for b in transformer.blocks)
    msd.enable_dsa(types.SimpleNamespace(transformer=transformer))
    assert all(isinstance(b.attn1.processor, msd.Dsa3dAttnProcessor)
               for b in transformer.blocks)


def test_enable_dsa_without_a_record_needs_arguments(runs, tmp_path):
    for name in ("diffusion_pytorch_model.safetensors",):
        (tmp_path / name).symlink_to(runs["dsa"].path / name)
    config = dict(runs["dsa"].config)
    del config["_megaslide"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    transformer = load_transformer(tmp_path)
    with pytest.raises(ValueError, match="has no '_megaslide' key.*pass "
                                         "window, tile and radius"):
        msd.enable_dsa(transformer)
    with pytest.raises(ValueError, match="together"):
        msd.enable_dsa(transformer, window=WINDOW)
    settings = msd.enable_dsa(transformer, window=WINDOW, tile=TILE,
                              radius=RADIUS)
    assert settings.layers is None
    with pytest.raises(TypeError, match="WanPipeline"):
        msd.enable_dsa(object())
    with pytest.raises(ValueError, match="backend"):
        msd.enable_dsa(transformer, window=WINDOW, tile=TILE, radius=RADIUS,
                       backend="cuda")


@pytest.mark.parametrize("record, message", [
    ([1, 2], "must be an object"),
    ("dsa", "must be an object"),
    ({"format": 1, "attention": "dsa", "dsa3d": {
        "window": [2, 3, 3], "tile": [1, 2, 2], "radius": 2, "layers": [7]}},
     r"layers \[7\] do not name blocks of this transformer \(it has 2\)"),
    ({"format": 1, "attention": "dsa", "dsa3d": {
        "window": [2, 3, 3], "tile": [1, 2, 2], "radius": 2,
        "layers": "01"}}, "layers must be a list of block indices"),
])
def test_enable_dsa_refuses_a_bad_record(runs, tmp_path, record, message):
    """A record that is not megaslide's is an error naming the file, never
    a traceback or a pipeline left on global attention."""
    (tmp_path / "diffusion_pytorch_model.safetensors").symlink_to(
        runs["dsa"].path / "diffusion_pytorch_model.safetensors")
    config = dict(runs["dsa"].config, _megaslide=record)
    (tmp_path / "config.json").write_text(json.dumps(config))
    transformer = load_transformer(tmp_path)
    with pytest.raises(ValueError, match=message):
        msd.enable_dsa(transformer)
    assert not any(isinstance(b.attn1.processor, msd.Dsa3dAttnProcessor)
                   for b in transformer.blocks)
    assert getattr(transformer, "_megaslide_dsa_hook", None) is None


# ---------------------------------------------------------------------------
# Parity with megaslide's forward
# ---------------------------------------------------------------------------

def test_stock_diffusers_equals_megaslide_global(runs):
    run = runs["global"]
    out = diffusers_forward(load_transformer(run.path), run.batch)
    assert out.shape == run.predicted.shape
    assert relative_error(out, run.predicted) <= RTOL


@pytest.mark.parametrize("backend", ["megaslide", "flex"])
def test_dsa_processor_equals_megaslide_dsa(runs, backend):
    run = runs["dsa"]
    transformer = load_transformer(run.path)
    msd.enable_dsa(transformer, backend=backend)
    out = diffusers_forward(transformer, run.batch)
    assert relative_error(out, run.predicted) <= RTOL
    # ... and 3D-DSA is not global attention here, so the check has teeth.
    msd.disable_dsa(transformer)
    stock = diffusers_forward(transformer, run.batch)
    assert relative_error(stock, run.predicted) > 100 * RTOL


def test_offsets_matter(runs, monkeypatch):
    # Sliding windows without block matching (zero offsets) are caught.
    run = runs["dsa"]
    transformer = load_transformer(run.path)
    msd.enable_dsa(transformer, backend="megaslide")
    monkeypatch.setattr(megaslide, "dsa3d_offsets",
                        lambda q, k, window, tile, radius: np.zeros(
                            (*q.shape[:2], *(-(-g // t) for g, t in
                                             zip(q.shape[2:5], tile)),
                             window[0], 2), np.int32))
    out = diffusers_forward(transformer, run.batch)
    assert relative_error(out, run.predicted) > 100 * RTOL


def test_block_matching_is_non_trivial(runs, monkeypatch):
    # The offsets the processor estimates on the model's own queries and
    # keys are not all zero, and the torch estimate (the flex backend's)
    # equals megaslide's kernel on them.
    seen = []
    reference = megaslide.dsa3d_offsets

    def record(q, k, window, tile, radius):
        offsets = reference(q, k, window, tile, radius)
        seen.append((q, k, offsets))
        return offsets

    transformer = load_transformer(runs["dsa"].path)
    msd.enable_dsa(transformer, backend="megaslide")
    monkeypatch.setattr(megaslide, "dsa3d_offsets", record)
    diffusers_forward(transformer, runs["dsa"].batch)
    assert len(seen) == 2  # one per block
    for q, k, offsets in seen:
        assert offsets.shape[2:5] == (4, 3, 3)
        assert np.count_nonzero(offsets) > 0
        ours = msd.dsa3d_offsets_torch(torch.from_numpy(q),
                                       torch.from_numpy(k), WINDOW, TILE,
                                       RADIUS)
        np.testing.assert_array_equal(ours.numpy(), offsets)


@pytest.mark.parametrize("grid,window,tile,radius", [
    ((3, 7, 9), (2, 3, 4), (2, 3, 2), 2),   # partial tiles, clamping
    ((2, 5, 5), (2, 5, 5), (1, 2, 2), 3),   # window = grid: one candidate
    ((4, 6, 8), (3, 2, 3), (3, 4, 5), 9),   # radius beyond the grid
])
def test_torch_offsets_equal_the_kernel(grid, window, tile, radius):
    rng = np.random.default_rng(7)
    q, k = (rng.normal(size=(2, 3, *grid, 8)).astype(np.float32)
            for _ in range(2))
    ours = msd.dsa3d_offsets_torch(torch.from_numpy(q), torch.from_numpy(k),
                                   window, tile, radius)
    np.testing.assert_array_equal(
        ours.numpy(), megaslide.dsa3d_offsets(q, k, window, tile, radius))


def test_sampling_loop_with_dsa_equals_megaslide(runs):
    # Two Euler steps of diffusers' flow-matching scheduler from the same
    # noise, once with the 3D-DSA transformer, once with megaslide's
    # forward as the model (x_t given as latents = noise = x_t).
    from diffusers import FlowMatchEulerDiscreteScheduler
    run = runs["dsa"]
    transformer = load_transformer(run.path)
    msd.enable_dsa(transformer)
    cond = torch.from_numpy(run.batch["condition"])
    finals = []
    for model in ("diffusers", "megaslide"):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
        scheduler.set_timesteps(sigmas=[0.75, 0.5])  # 1000 t exact
        x = torch.from_numpy(run.batch["noise"])
        for t in scheduler.timesteps:
            if model == "diffusers":
                with torch.no_grad():
                    v = transformer(hidden_states=x, timestep=t.reshape(1),
                                    encoder_hidden_states=cond,
                                    return_dict=False)[0]
            else:
                xn = x.numpy()
                v = torch.from_numpy(run.trainer.predict(
                    xn, xn, np.array([t.item() / 1000], np.float32),
                    run.batch["condition"]))
            x = scheduler.step(v, t, x, return_dict=False)[0]
        finals.append(x.numpy())
    assert finals[0].shape == run.batch["latents"].shape
    assert relative_error(finals[0], finals[1]) <= RTOL
    # Sampled with global attention the same loop lands elsewhere.
    msd.disable_dsa(transformer)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    scheduler.set_timesteps(sigmas=[0.75, 0.5])
    x = torch.from_numpy(run.batch["noise"])
    for t in scheduler.timesteps:
        with torch.no_grad():
            v = transformer(hidden_states=x, timestep=t.reshape(1),
                            encoder_hidden_states=cond, return_dict=False)[0]
        x = scheduler.step(v, t, x, return_dict=False)[0]
    assert relative_error(x.numpy(), finals[1]) > 100 * RTOL


@pytest.mark.parametrize("grid,window,tile,radius,block", [
    ((4, 6, 6), (2, 3, 3), (1, 2, 2), 2, 32),   # the model's
    ((3, 7, 9), (2, 3, 4), (2, 3, 2), 2, 16),   # partial tiles, clamping
    ((2, 9, 40), (2, 3, 37), (1, 2, 7), 4, 16),  # a window row over 3 blocks
])
def test_flex_block_mask_and_output(grid, window, tile, radius, block):
    # The block mask built from the window starts is the one
    # create_block_mask finds by evaluating mask_mod everywhere, and flex
    # attention under it is megaslide's kernel.
    from torch.nn.attention.flex_attention import (create_block_mask,
                                                   flex_attention)
    rng = np.random.default_rng(11)
    q, k, v = (rng.normal(size=(2, 3, *grid, 8)).astype(np.float32)
               for _ in range(3))
    B, H, N = 2, 3, math.prod(grid)
    flat = [torch.from_numpy(a).reshape(B, H, N, 8) for a in (q, k, v)]
    mask, mask_mod = msd.dsa3d_block_mask(flat[0], flat[1], grid, window,
                                          tile, radius, block)
    reference = create_block_mask(mask_mod, B, H, N, N, device="cpu",
                                  BLOCK_SIZE=block)
    assert torch.equal(mask.to_dense().bool(), reference.to_dense().bool())
    assert not mask.to_dense().bool().all()  # sparse: blocks are skipped
    out = flex_attention(*flat, block_mask=mask).reshape(q.shape).numpy()
    offsets = megaslide.dsa3d_offsets(q, k, window, tile, radius)
    expected = megaslide.dsa3d(q, k, v, offsets, window, tile)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)


def test_small_grid_keeps_global_attention(runs):
    # Sampling at a grid smaller than the window along t (one latent frame)
    # attends globally, as the planner would plan it: the stock output.
    run = runs["dsa"]
    transformer = load_transformer(run.path)
    batch = {k: v for k, v in run.batch.items()}
    batch["latents"] = batch["latents"][:, :, :1]
    batch["noise"] = batch["noise"][:, :, :1]
    stock = diffusers_forward(transformer, batch)
    msd.enable_dsa(transformer)
    np.testing.assert_array_equal(diffusers_forward(transformer, batch),
                                  stock)
