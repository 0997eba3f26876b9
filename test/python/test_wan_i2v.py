"""Wan 2.1 image-to-video (I2V) and first-last-frame (FLF2V) models against
diffusers' WanTransformer3DModel with ``image_dim``, ``added_kv_proj_dim``
and (FLF2V) ``pos_embed_seq_len``, and Wan 2.2's I2V experts (the 36
input channels without image embeddings): parameters name by name, the
f32 loss, every gradient and the velocity, and weights both ways bit for
bit.

The models are tiny's blocks with image conditioning (tiny_wan.image_config,
no downloads): CLIP-like image tokens of width 24, the 36-channel input of
WanImageToVideoPipeline (16 latent channels, a 4-channel mask, 16 channels
of conditioning latents), and 512 prompt tokens, which diffusers' attention
processor requires of an image-conditioned model (it takes the last 512
context tokens as the prompt's).

Reference: diffusers' module cast to float64 under torch autograd, on the
float32 values both sides see (its FP32LayerNorms and block norms still
compute in float32, as diffusers defines them). Tolerances are
test_parity.py's f32 ones: loss rtol 1e-5; gradient |g - r| <= 1e-4 |r| +
1e-4 max|r| elementwise; the velocity within 1e-5 max|r|
(test_diffusers_dsa.py's bound). Measured: loss 1.3e-7 (I2V) and 8.0e-8
(FLF2V) relative, gradients within 7.6e-6 of their max, velocity 1.4e-6
and 1.2e-6 of its max. Semantic slips of the image path fail: the tanh
instead of the exact GELU in the image embedder moves the velocity by
1.7e-4 of its max, its LayerNorms' epsilon of 1e-6 instead of nn.LayerNorm's
1e-5 by 1.1e-2 (hence image tokens of a small scale, IMAGE_SCALE).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import megaslide  # noqa: E402
from tiny_wan import IMAGE_DIM, IMAGE_TOKENS  # noqa: E402
from tiny_wan import image_config as tiny_image_config  # noqa: E402
from tiny_wan import randomise as randomise_tiny  # noqa: E402

FRAMES, HEIGHT, WIDTH = 9, 64, 64  # latents 3 x 8 x 8, 48 tokens
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL_OF_MAX, VELOCITY_RTOL = 1e-5, 1e-4, 1e-4, 1e-5
# Image tokens (and FLF2V's position embedding) of a small scale, so that
# the image embedder's LayerNorm epsilon (nn.LayerNorm's 1e-5, not the
# model's 1e-6) is resolved by the tolerances.
IMAGE_SCALE = 0.01


def randomise(params, seed):
    """tiny_wan.randomise, FLF2V's position embedding at the image tokens'
    scale."""
    return randomise_tiny(params, seed, small={"pos_embed": IMAGE_SCALE})


def diffusers_model(config, dtype=torch.float64):
    import inspect
    keys = inspect.signature(
        diffusers.WanTransformer3DModel.__init__).parameters
    model = diffusers.WanTransformer3DModel(
        **{k: v for k, v in config.items() if k in keys and k != "self"})
    return model.to(dtype)



def batch_of(shapes, seed, batch=2):
    rng = np.random.default_rng(seed)
    t = (np.arange(batch) % 6 + 2) / 8  # 1000 t exact in float32
    normal = {name: rng.normal(size=shape).astype(np.float32)
              for name, shape in shapes.items() if name != "timesteps"}
    if "image_embeds" in normal:
        normal["image_embeds"] *= np.float32(IMAGE_SCALE)
    return dict(normal, timesteps=t.astype(np.float32))


def velocity(model, batch, kind):
    """diffusers' forward as WanImageToVideoPipeline calls it: the noisy
    latents beside the mask and conditioning latents, timestep 1000 t, the
    image embeddings ([2B, L/2, D] for FLF2V: one row per image)."""
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    t = as64["timesteps"].reshape(-1, 1, 1, 1, 1)
    xt = (1 - t) * as64["latents"] + t * as64["noise"]
    image = as64.get("image_embeds")
    if kind == "flf2v":
        image = image.reshape(-1, image.shape[1] // 2, image.shape[2])
    return model(hidden_states=torch.cat([xt, as64["image_condition"]], 1),
                 timestep=1000 * as64["timesteps"],
                 encoder_hidden_states=as64["condition"],
                 encoder_hidden_states_image=image, return_dict=False)[0]


@pytest.fixture(scope="module", params=["i2v", "flf2v", "i2v-a14b"])
def case(request, tmp_path_factory):
    kind = request.param
    config = tiny_image_config(kind)
    path = tmp_path_factory.mktemp(kind) / "config.json"
    path.write_text(json.dumps(config))
    trainer = megaslide.Trainer(str(path), FRAMES, HEIGHT, WIDTH,
                                backend="cpu", precision="f32",
                                attention="global", seed=0, batch=2)
    params = randomise(trainer.parameters(), 5)
    trainer.load_parameters(params)
    batch = batch_of(trainer.input_shapes(), 7)
    model = diffusers_model(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    return dict(kind=kind, config=config, trainer=trainer, params=params,
                batch=batch, model=model)


def test_inputs_are_the_pipelines(case):
    shapes = case["trainer"].input_shapes()
    assert shapes["latents"] == (2, 16, 3, 8, 8)
    assert shapes["image_condition"] == (2, 20, 3, 8, 8)
    if case["kind"] == "i2v-a14b":
        assert "image_embeds" not in shapes
        assert shapes["condition"] == (2, 16, 32)
        return
    tokens = IMAGE_TOKENS * (2 if case["kind"] == "flf2v" else 1)
    assert shapes["image_embeds"] == (2, tokens, IMAGE_DIM)
    assert shapes["condition"] == (2, 512, 32)


def test_parameters_are_diffusers(case):
    ours = {k: v.shape for k, v in case["params"].items()}
    ref = {k: tuple(v.shape) for k, v in case["model"].state_dict().items()}
    assert ours == ref


def test_f32_loss_and_gradients_equal_diffusers(case):
    model, batch = case["model"], case["batch"]
    model.zero_grad()
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    target = as64["noise"] - as64["latents"]
    loss = torch.mean((velocity(model, batch, case["kind"]) - target) ** 2)
    loss.backward()
    ref = {n: p.grad.numpy() for n, p in model.named_parameters()}
    got_loss, grads = case["trainer"].gradients(**batch)
    assert math.isclose(got_loss, loss.item(), rel_tol=LOSS_RTOL), (
        got_loss, loss.item())
    assert set(grads) == set(ref)
    failures = []
    for name, r in ref.items():
        g = np.asarray(grads[name], np.float64)
        bound = GRAD_RTOL * np.abs(r) + GRAD_ATOL_OF_MAX * np.abs(r).max()
        if not (np.abs(g - r) <= bound).all():
            failures.append(f"{name}: max error "
                            f"{np.abs(g - r).max():.3g}, max|r| "
                            f"{np.abs(r).max():.3g}")
    assert not failures, "\n".join(failures)
    # Every image-path gradient is exercised (none is zero).
    for name, r in ref.items():
        if "image" in name or "add_" in name:
            assert np.abs(r).max() > 0, name


def test_velocity_equals_diffusers(case):
    batch = case["batch"]
    with torch.no_grad():
        ref = velocity(case["model"], batch, case["kind"]).numpy()
    got = case["trainer"].predict(**batch)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= VELOCITY_RTOL, err


def test_the_image_changes_the_velocity(case):
    # The image path is live: other image embeddings or conditioning move
    # the prediction far beyond the tolerance.
    batch = dict(case["batch"])
    base = case["trainer"].predict(**batch)
    for name in ("image_embeds", "image_condition"):
        if name not in batch:
            continue
        other = dict(batch, **{name: batch[name][::-1].copy()})
        moved = case["trainer"].predict(**other)
        assert np.abs(moved - base).max() > 1e-2 * np.abs(base).max(), name


@pytest.mark.parametrize("dtype,shard", [("f32", 5_000_000_000),
                                         ("bf16", 20000)])
def test_weights_round_trip_both_ways(case, tmp_path, dtype, shard):
    trainer = case["trainer"]
    out = tmp_path / "saved"
    trainer.save_weights(str(out), dtype=dtype, max_shard_bytes=shard)
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    loaded = diffusers.WanTransformer3DModel.from_pretrained(
        str(out), torch_dtype=torch_dtype)
    assert loaded.config.image_dim == case["config"].get("image_dim")
    state = loaded.state_dict()
    for name, value in case["params"].items():
        expected = torch.from_numpy(value).to(torch_dtype)
        assert torch.equal(state[name], expected), name
    # And back: diffusers' save_pretrained, loaded by megaslide.
    back = tmp_path / "back"
    loaded.to(torch.float32).save_pretrained(str(back))
    other = megaslide.Trainer(str(out / "config.json"), FRAMES, HEIGHT,
                              WIDTH, backend="cpu", precision="f32",
                              attention="global", seed=1, batch=2)
    other.load_weights(str(back))
    for name, value in other.parameters().items():
        expected = torch.from_numpy(case["params"][name]).to(torch_dtype)
        assert np.array_equal(value, expected.float().numpy()), name


# ---------------------------------------------------------------------------
# megaslide-run on image-conditioned samples
# ---------------------------------------------------------------------------

def write_samples(folder, config, count, drop=None):
    """`count` sample files of the shapes the tiny I2V run needs at 5 x 32 x
    32 (latents 16 x 2 x 4 x 4), without tensor `drop` in the last one."""
    from safetensors.numpy import save_file
    folder.mkdir()
    rng = np.random.default_rng(11)
    for k in range(count):
        tensors = {
            "latents": rng.normal(size=(16, 2, 4, 4)),
            "condition": rng.normal(size=(512, 32)),
            "image_embeds": IMAGE_SCALE * rng.normal(
                size=(config["image_len"], IMAGE_DIM)),
            "image_condition": rng.normal(size=(20, 2, 4, 4))}
        if drop and k == count - 1:
            del tensors[drop]
        save_file({n: v.astype(np.float32) for n, v in tensors.items()},
                  str(folder / f"{k:03d}.safetensors"))


@pytest.fixture(scope="module")
def i2v_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("i2v_run") / "i2v.json"
    path.write_text(json.dumps(tiny_image_config("i2v")))
    return path


def run_tool(args):
    import subprocess
    from conftest import tool_path, with_init
    return subprocess.run([tool_path("megaslide-run"), *with_init(args)],
                          capture_output=True, text=True)


def test_run_trains_on_image_samples(i2v_config_file, tmp_path):
    config = json.loads(i2v_config_file.read_text())
    write_samples(tmp_path / "data", config, 3)
    r = run_tool(["--model", str(i2v_config_file), "--backend", "cpu",
                  "--frames", "5", "--height", "32", "--width", "32",
                  "--steps", "2", "--data", str(tmp_path / "data"),
                  "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")])
    assert r.returncode == 0, r.stderr
    assert "loss: first" in r.stdout


def test_sample_without_its_image_embedding_is_refused(i2v_config_file,
                                                       tmp_path):
    config = json.loads(i2v_config_file.read_text())
    write_samples(tmp_path / "data", config, 3, drop="image_embeds")
    r = run_tool(["--model", str(i2v_config_file), "--backend", "cpu",
                  "--frames", "5", "--height", "32", "--width", "32",
                  "--steps", "2", "--data", str(tmp_path / "data"),
                  "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")])
    assert r.returncode != 0
    assert ("002.safetensors' has no tensor 'image_embeds'; an "
            "image-conditioned model needs each sample's image_embeds and "
            "image_condition") in r.stderr, r.stderr
    assert "step 1" not in r.stdout
    assert not (tmp_path / "ck").exists() or not any(
        (tmp_path / "ck").iterdir())
