"""Wan 2.2 TI2V-5B's model and how MegaSlide learns its VAE's stride.

TI2V's transformer is Wan 2.1's block on the 48 latent channels of the Wan
2.2 VAE, which compresses 4x16x16; its pipeline gives every token its own
timestep (``expand_timesteps``). For text-to-video every token has the
sample's time, so the compiled step (one time per sample) must equal
diffusers' WanTransformer3DModel given the per-token timesteps
WanPipeline builds: checked in f32 on a tiny TI2V-shaped config with the
tolerances of test_wan_i2v.py (loss rtol 1e-5; gradients 1e-4 |r| + 1e-4
max|r|; velocity 1e-5 max|r|).

The stride comes from the pipeline folder's vae/config.json; a config
whose channels contradict its stride, or a VAE whose z_dim is not the
transformer's latent channels, is refused before any work.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import megaslide  # noqa: E402
from conftest import tool_path  # noqa: E402
from test_wan_i2v import (GRAD_ATOL_OF_MAX, GRAD_RTOL, LOSS_RTOL,  # noqa: E402
                          VELOCITY_RTOL, diffusers_model, randomise)

# 9 frames of 128 x 128 pixels: latents 3 x 8 x 8 at 4x16x16, 48 tokens.
FRAMES, HEIGHT, WIDTH = 9, 128, 128


def tiny_ti2v_config():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    with open(os.path.join(root, "tiny.json")) as f:
        config = json.load(f)
    config.update(name="tiny-ti2v", in_channels=48, out_channels=48,
                  vae_stride=[4, 16, 16])
    return config


def write_pipeline(folder, transformer, z_dim=48, spatial=16):
    """model_index.json, transformer/config.json and vae/config.json of a
    WanPipeline folder: what the planner reads of one."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "vae").mkdir()
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "WanPipeline", "expand_timesteps": True}))
    (folder / "transformer" / "config.json").write_text(
        json.dumps(transformer))
    (folder / "vae" / "config.json").write_text(json.dumps(
        {"_class_name": "AutoencoderKLWan", "z_dim": z_dim,
         "scale_factor_temporal": 4, "scale_factor_spatial": spatial}))
    return folder


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    config = tiny_ti2v_config()
    path = tmp_path_factory.mktemp("ti2v") / "ti2v.json"
    path.write_text(json.dumps(config))
    trainer = megaslide.Trainer(str(path), FRAMES, HEIGHT, WIDTH,
                                backend="cpu", precision="f32",
                                attention="global", seed=0, batch=2)
    params = randomise(trainer.parameters(), 5)
    trainer.load_parameters(params)
    rng = np.random.default_rng(3)
    shapes = trainer.input_shapes()
    batch = {name: rng.normal(size=shape).astype(np.float32)
             for name, shape in shapes.items() if name != "timesteps"}
    batch["timesteps"] = np.array([0.25, 0.625], np.float32)
    model = diffusers_model(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    return dict(trainer=trainer, batch=batch, model=model, config=config)


def expanded_velocity(model, batch):
    """diffusers' forward as WanPipeline calls it with expand_timesteps:
    one timestep per token ([B, tokens]), all the sample's for T2V."""
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    t = as64["timesteps"]
    xt = (1 - t.reshape(-1, 1, 1, 1, 1)) * as64["latents"] + \
        t.reshape(-1, 1, 1, 1, 1) * as64["noise"]
    T, H, W = xt.shape[2:]
    tokens = T * (H // 2) * (W // 2)
    per_token = (1000 * t)[:, None].expand(-1, tokens)
    return model(hidden_states=xt, timestep=per_token,
                 encoder_hidden_states=as64["condition"],
                 return_dict=False)[0]


def test_ti2v_shapes(ti2v):
    shapes = ti2v["trainer"].input_shapes()
    assert shapes["latents"] == (2, 48, 3, 8, 8)
    info = megaslide.model_info("wan2.2-ti2v-5b", 121, 704, 1280)
    assert info["latent"]["shape"] == [31, 44, 80]
    assert info["tokens"] == 27_280


def test_ti2v_f32_step_equals_diffusers_with_per_token_timesteps(ti2v):
    model, batch = ti2v["model"], ti2v["batch"]
    model.zero_grad()
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    pred = expanded_velocity(model, batch)
    loss = torch.mean((pred - (as64["noise"] - as64["latents"])) ** 2)
    loss.backward()
    got_loss, grads = ti2v["trainer"].gradients(**batch)
    assert math.isclose(got_loss, loss.item(), rel_tol=LOSS_RTOL)
    for name, p in model.named_parameters():
        r = p.grad.numpy()
        bound = GRAD_RTOL * np.abs(r) + GRAD_ATOL_OF_MAX * np.abs(r).max()
        assert (np.abs(grads[name] - r) <= bound).all(), name
    ref = pred.detach().numpy()
    got = ti2v["trainer"].predict(**batch)
    assert np.abs(got - ref).max() <= VELOCITY_RTOL * np.abs(ref).max()


def test_pipeline_folder_gives_the_vae_stride(tmp_path):
    config = tiny_ti2v_config()
    del config["vae_stride"]
    folder = write_pipeline(tmp_path / "pipe", config)
    info = megaslide.model_info(str(folder), FRAMES, HEIGHT, WIDTH)
    assert info["latent"]["vae_stride"] == [4, 16, 16]
    assert info["latent"]["shape"] == [3, 8, 8]


@pytest.mark.parametrize("edit,vae,message", [
    # A TI2V transformer config alone: the default stride is Wan 2.1's.
    (dict(vae_stride=None), None,
     "config field 'vae_stride': 4x8x8 (the default, as the key is absent), "
     "but the 48 latent channels are the Wan 2.2 VAE's, whose stride is "
     "4x16x16"),
    (dict(vae_stride=[4, 8, 8]), None,
     "config field 'vae_stride': 4x8x8, but the 48 latent channels are the "
     "Wan 2.2 VAE's"),
    (dict(in_channels=16, out_channels=16), None,
     "config field 'vae_stride': 4x16x16, but the 16 latent channels are "
     "the Wan 2.1 VAE's, whose stride is 4x8x8"),
    (dict(vae_stride=[4, 16, 16]), dict(spatial=8, z_dim=48),
     "sets vae_stride [4,16,16], but the VAE's scale factors are 4x8x8"),
    (dict(vae_stride=None), dict(z_dim=16),
     "the VAE makes latents of z_dim 16 channels, but the transformer's "
     "latents have 48 (out_channels)"),
])
def test_mismatched_stride_is_refused_before_any_work(tmp_path, edit, vae,
                                                      message):
    config = tiny_ti2v_config()
    for key, value in edit.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    if vae is None:
        model = tmp_path / "ti2v.json"
        model.write_text(json.dumps(config))
    else:
        model = write_pipeline(tmp_path / "pipe", config, **vae)
    r = subprocess.run([tool_path("megaslide-run"), "--model", str(model),
                        "--backend", "cpu", "--frames", str(FRAMES),
                        "--height", str(HEIGHT), "--width", str(WIDTH),
                        "--steps", "1", "--no-progress", "--checkpoint-dir",
                        str(tmp_path / "ck")], capture_output=True, text=True)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------------
# TI2V image-to-video: the clean first frame
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ti2v_i2v(tmp_path_factory):
    config = dict(tiny_ti2v_config(), name="tiny-ti2v-i2v",
                  first_frame_conditioning=True)
    path = tmp_path_factory.mktemp("ti2v_i2v") / "ti2v_i2v.json"
    path.write_text(json.dumps(config))
    trainer = megaslide.Trainer(str(path), FRAMES, HEIGHT, WIDTH,
                                backend="cpu", precision="f32",
                                attention="global", seed=0, batch=2)
    params = randomise(trainer.parameters(), 6)
    trainer.load_parameters(params)
    rng = np.random.default_rng(4)
    batch = {name: rng.normal(size=shape).astype(np.float32)
             for name, shape in trainer.input_shapes().items()
             if name != "timesteps"}
    batch["timesteps"] = np.array([0.375, 0.75], np.float32)
    model = diffusers_model(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    return dict(trainer=trainer, batch=batch, model=model)


def first_frame_velocity(model, batch):
    """WanImageToVideoPipeline with expand_timesteps: the first latent
    frame is the clean image's (here the sample's own first frame), its
    tokens at timestep 0, the others at 1000 t."""
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    t = as64["timesteps"]
    x0, noise = as64["latents"], as64["noise"]
    xt = (1 - t.reshape(-1, 1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1, 1) * noise
    mask = torch.ones_like(x0[:1, :1])
    mask[:, :, 0] = 0
    xt = (1 - mask) * x0 + mask * xt
    per_token = (mask[0, 0][:, ::2, ::2].flatten()[None] * 1000 * t[:, None])
    return model(hidden_states=xt, timestep=per_token,
                 encoder_hidden_states=as64["condition"],
                 return_dict=False)[0]


def test_first_frame_conditioning_equals_diffusers(ti2v_i2v):
    model, batch = ti2v_i2v["model"], ti2v_i2v["batch"]
    model.zero_grad()
    as64 = {k: torch.from_numpy(v).double() for k, v in batch.items()}
    pred = first_frame_velocity(model, batch)[:, :, 1:]
    target = (as64["noise"] - as64["latents"])[:, :, 1:]
    loss = torch.mean((pred - target) ** 2)  # the clean frame is not trained
    loss.backward()
    got_loss, grads = ti2v_i2v["trainer"].gradients(**batch)
    assert math.isclose(got_loss, loss.item(), rel_tol=LOSS_RTOL), (
        got_loss, loss.item())
    for name, p in model.named_parameters():
        r = p.grad.numpy()
        bound = GRAD_RTOL * np.abs(r) + GRAD_ATOL_OF_MAX * np.abs(r).max()
        assert (np.abs(grads[name] - r) <= bound).all(), name
    ref = pred.detach().numpy()
    got = ti2v_i2v["trainer"].predict(**batch)
    assert got.shape == ref.shape == (2, 48, 2, 8, 8)
    assert np.abs(got - ref).max() <= VELOCITY_RTOL * np.abs(ref).max()


def test_first_frame_needs_a_frame_after_it(tmp_path):
    config = dict(tiny_ti2v_config(), first_frame_conditioning=True)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="conditions on its first latent "
                       "frame, so the video needs at least 2 latent frames"):
        megaslide.model_info(str(path), 1, HEIGHT, WIDTH)


# ---------------------------------------------------------------------------
# Wan 2.2 A14B's two experts: export, 3D-DSA, sampling
# ---------------------------------------------------------------------------

A14B_BOUNDARY = 0.875
EXPORT = [sys.executable, "-m", "megaslide.export"]
A14B_VIDEO = (13, 96, 96)  # token grid (4, 6, 6): 3D-DSA applies


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """Two tiny experts (random weights of their own, 3D-DSA), a base
    WanPipeline with transformer_2 and boundary_ratio, and the export of the
    two into it."""
    import tiny_wan
    from test_diffusers_dsa import RADIUS, TILE, WINDOW
    from tiny_wan import randomise as randomise_tiny
    root = tmp_path_factory.mktemp("experts")
    out = {}
    for i, name in enumerate(("high", "low")):
        tr = megaslide.Trainer("tiny", *A14B_VIDEO, backend="cpu",
                               precision="f32", attention="dsa", seed=i,
                               dsa_window=WINDOW, dsa_tile=TILE,
                               dsa_radius=RADIUS,
                               min_timestep=A14B_BOUNDARY if i == 0 else 0.0,
                               max_timestep=1.0 if i == 0 else A14B_BOUNDARY)
        tr.load_parameters(randomise_tiny(tr.parameters(), 10 + i))
        tr.save_weights(str(root / name))
        out[name] = tr
    base = tiny_wan.build_pipeline(root / "base", root / "high",
                                   weights_dir_2=root / "high",
                                   boundary_ratio=A14B_BOUNDARY)
    r = subprocess.run([*EXPORT, "--pipeline",
                        str(base), "--weights", str(root / "high"),
                        "--weights-2", str(root / "low"), "-o",
                        str(root / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dict(out, root=root, base=base, pipeline=root / "out",
                message=r.stdout)


def test_export_writes_both_experts(experts):
    pipe = diffusers.WanPipeline.from_pretrained(
        str(experts["pipeline"]), torch_dtype=torch.float32)
    assert pipe.config.boundary_ratio == A14B_BOUNDARY
    for module, name in ((pipe.transformer, "high"),
                         (pipe.transformer_2, "low")):
        state = module.state_dict()
        for key, value in experts[name].parameters().items():
            assert np.array_equal(state[key].numpy(), value), (name, key)
    assert "transformer from" in experts["message"]
    assert "transformer_2 from" in experts["message"]


def test_one_expert_exported_keeps_the_bases_other(experts, tmp_path):
    r = subprocess.run([*EXPORT, "--pipeline",
                        str(experts["base"]), "--weights-2",
                        str(experts["root"] / "low"), "-o",
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pipe = diffusers.WanPipeline.from_pretrained(str(tmp_path / "out"))
    high = experts["high"].parameters()
    assert np.array_equal(pipe.transformer.state_dict()[
        "proj_out.weight"].numpy(), high["proj_out.weight"])


def test_second_expert_needs_a_two_expert_base(experts, tmp_path):
    import tiny_wan
    base = tiny_wan.build_pipeline(tmp_path / "t2v", experts["root"] / "high")
    r = subprocess.run([*EXPORT, "--pipeline",
                        str(base), "--weights-2",
                        str(experts["root"] / "low"), "-o",
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2
    assert ("model_index.json lists no transformer_2; it is not a "
            "two-expert (Wan 2.2 A14B) pipeline") in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_sampling_routes_each_step_to_its_expert_with_dsa(experts):
    # The exported pipeline with 3D-DSA on both experts: every transformer
    # call at timestep >= boundary_ratio * 1000 goes to the high-noise
    # expert, the others to transformer_2, and each call's velocity is its
    # expert's megaslide forward (Trainer.predict at x_t, given as latents
    # = noise = x_t) within test_diffusers_dsa.py's bound.
    import megaslide.diffusers as msd
    from test_diffusers_dsa import RTOL
    pipe = diffusers.WanPipeline.from_pretrained(
        str(experts["pipeline"]), torch_dtype=torch.float32)
    settings = msd.enable_dsa(pipe)
    assert settings.window == (2, 3, 3)
    calls = []
    for module, name in ((pipe.transformer, "high"),
                         (pipe.transformer_2, "low")):
        assert all(type(b.attn1.processor).__name__ == "Dsa3dAttnProcessor"
                   for b in module.blocks), name

        def hook(mod, args, kwargs, output, name=name):
            calls.append((name, kwargs["hidden_states"].clone(),
                          kwargs["timestep"].clone(),
                          kwargs["encoder_hidden_states"].clone(),
                          output[0].clone()))
        module.register_forward_hook(hook, with_kwargs=True)
    frames, height, width = A14B_VIDEO
    pipe("a red cat", num_frames=frames, height=height, width=width,
         num_inference_steps=4, guidance_scale=1.0, guidance_scale_2=1.0,
         max_sequence_length=16,  # the tiny model's text_len
         output_type="latent", generator=torch.Generator().manual_seed(0))
    assert {c[0] for c in calls} == {"high", "low"}
    for name, x, t, text, v in calls:
        assert (t.item() >= A14B_BOUNDARY * 1000) == (name == "high"), (
            name, t.item())
        xn = x.numpy()
        got = experts[name].predict(xn, xn, (t.numpy() / 1000).astype(
            np.float32), text.numpy())
        ref = v.numpy()
        assert np.abs(got - ref).max() <= RTOL * np.abs(ref).max(), name


# ---------------------------------------------------------------------------
# TI2V: data from the Wan 2.2 VAE, and sampling its pipeline with 3D-DSA
# ---------------------------------------------------------------------------

TI2V_VIDEO = (13, 64, 64)  # latents 4 x 4 x 4 at 4x16x16


def test_ti2v_prepare_and_sample(ti2v, tmp_path, capsys):
    # megaslide-prepare with a TI2V pipeline: its VAE's stride (16) and 48
    # channels, latents bit-equal to the VAE's own; a height that the 16x
    # VAE and 2x2 patches do not take is refused; the exported pipeline
    # (expand_timesteps) samples with 3D-DSA on the trained model.
    import tiny_wan
    from diffusers import AutoencoderKLWan, WanPipeline
    from megaslide import export, prepare
    weights = tmp_path / "weights"
    ti2v["trainer"].save_weights(str(weights))
    base = tiny_wan.build_pipeline(tmp_path / "ti2v", weights, ti2v=True)
    videos = tmp_path / "videos"
    videos.mkdir()
    tiny_wan.write_video(videos / "a.mp4", tiny_wan.moving_pattern(16, 64, 64))
    (videos / "a.txt").write_text("a red cat\n")
    frames, height, width = TI2V_VIDEO
    size = ["--frames", frames, "--height", height, "--width", width]
    code = prepare.main([str(videos), "-o", str(tmp_path / "bad"),
                         "--pipeline", str(base), "--frames", "13",
                         "--height", "48", "--width", "64", "--no-progress"])
    assert code == 2
    assert "height must be a positive multiple of 32, got 48" in \
        capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    code = prepare.main([str(videos), "-o", str(tmp_path / "data"),
                         "--pipeline", str(base), *map(str, size),
                         "--no-progress"])
    assert code == 0, capsys.readouterr()
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "data" / "a.safetensors"))
    vae = AutoencoderKLWan.from_pretrained(base / "vae")
    pixels = prepare.load_pixels(str(videos / "a.mp4"), *TI2V_VIDEO)
    with torch.no_grad():
        z = vae.encode(pixels).latent_dist.mode()
    assert tensors["latents"].shape == (48, 4, 4, 4)
    assert torch.equal(tensors["latents"], z[0])  # mean 0, std 1

    out = tmp_path / "pipe"
    assert export.main(["--pipeline", str(base), "--weights", str(weights),
                        "-o", str(out)]) == 0
    import megaslide.diffusers as msd
    pipe = WanPipeline.from_pretrained(str(out), torch_dtype=torch.float32)
    assert pipe.config.expand_timesteps
    msd.enable_dsa(pipe, window=(2, 1, 1), tile=(1, 1, 1), radius=1)
    video = pipe("a red cat", num_frames=frames, height=height, width=width,
                 num_inference_steps=2, max_sequence_length=16,
                 output_type="np").frames[0]
    assert video.shape == (frames, height, width, 3)


def test_ti2v_image_to_video_pipeline_samples_as_megaslide(ti2v_i2v,
                                                           tmp_path):
    # The first-frame-conditioned TI2V model, saved and put in a TI2V
    # pipeline folder, loads as WanImageToVideoPipeline (expand_timesteps:
    # the image's latents in the first frame, its tokens at timestep 0);
    # sampling an image, each transformer call's velocity of the later
    # frames is megaslide's forward at that input (Trainer.predict, x_t
    # given as latents = noise; the model attends globally, as trained).
    import PIL.Image
    import tiny_wan
    trainer = ti2v_i2v["trainer"]
    weights = tmp_path / "weights"
    trainer.save_weights(str(weights))
    folder = tiny_wan.build_pipeline(tmp_path / "ti2v", weights, ti2v=True)
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(
        str(folder), torch_dtype=torch.float32)
    assert pipe.config.expand_timesteps
    calls = []

    def hook(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"].clone(),
                      kwargs["timestep"].clone(),
                      kwargs["encoder_hidden_states"].clone(),
                      output[0].clone()))
    pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    image = PIL.Image.fromarray(tiny_wan.moving_pattern(1, HEIGHT, WIDTH)[0])
    pipe(image=image, prompt="a red cat", num_frames=FRAMES, height=HEIGHT,
         width=WIDTH, num_inference_steps=2, guidance_scale=1.0,
         max_sequence_length=16, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    assert len(calls) == 2
    from test_diffusers_dsa import RTOL
    for x, t, text, v in calls:
        tokens = t.reshape(-1)
        first = (HEIGHT // 32) * (WIDTH // 32)
        assert (tokens[:first] == 0).all() and (tokens[first:] > 0).all()
        # One-sample plan of batch 2: the call's sample twice.
        xn = np.repeat(x.numpy(), 2, axis=0)
        got = trainer.predict(
            xn, xn, np.full(2, tokens[-1].item() / 1000, np.float32),
            np.repeat(text.numpy(), 2, axis=0))[0]
        ref = v.numpy()[0, :, 1:]
        assert np.abs(got - ref).max() <= RTOL * np.abs(ref).max()
