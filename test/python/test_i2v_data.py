"""Wan 2.1 image-to-video (I2V) and first-last-frame (FLF2V) data and
sampling: megaslide-prepare's image tensors, megaslide-export's
WanImageToVideoPipeline folder, and megaslide.diffusers.enable_dsa on it.

Tiny WanImageToVideoPipelines built offline (tiny_wan.py): the tiny VAE,
UMT5 and tokenizer, a CLIPVisionModel of width 24 giving 5 tokens per
image with its CLIPImageProcessor, and a transformer of
tiny_wan.image_config ("i2v", "flf2v").

The references for prepare are transformers' and diffusers' own calls on
the same frames: CLIPImageProcessor and CLIPVisionModel's
hidden_states[-2], AutoencoderKLWan's posterior mode normalised as
WanImageToVideoPipeline.prepare_latents normalises it, the mask built by
hand; and WanImageToVideoPipeline.__call__ itself, whose transformer inputs
are recorded. Same device (cpu) and dtype (f32), the same calls: bit-equal.

The prediction inside the pipeline is compared with Trainer.predict on the
inputs the pipeline gave the transformer, with test_diffusers_dsa.py's
tolerance (1e-5 of max|output|, f32).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

for module in ("torch", "diffusers", "transformers", "av", "accelerate",
               "tokenizers", "safetensors", "ftfy"):
    pytest.importorskip(module, reason=f"{module} is not installed: "
                        f"pip install -r scripts/requirements-models.txt")

import tiny_wan  # noqa: E402
import torch  # noqa: E402

import megaslide  # noqa: E402
import megaslide.diffusers as msd  # noqa: E402
from megaslide import export, prepare  # noqa: E402
from test_prepare import load, run_prepare  # noqa: E402

KINDS = ("i2v", "flf2v")
SIZE = ["--frames", "9", "--height", "32", "--width", "32"]
# Sampling and 3D-DSA: test_diffusers_dsa.py's grid (4, 6, 6) and window.
FRAMES, HEIGHT, WIDTH = 13, 96, 96
WINDOW, TILE, RADIUS = (2, 3, 3), (1, 2, 2), 2
RTOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def base(request, tmp_path_factory):
    """A tiny WanImageToVideoPipeline folder of the kind (its transformer's
    config.json is megaslide's, with image_len 5 or 10)."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    config = root / "config.json"
    config.write_text(json.dumps(tiny_wan.image_config(kind)))
    weights = root / "base_weights"
    megaslide.Trainer(str(config), 5, 32, 32, seed=0).save_weights(weights)
    folder = tiny_wan.build_pipeline(root / "base", weights)
    return kind, folder


def dataset(folder: pathlib.Path) -> pathlib.Path:
    """a.mp4 (48 x 64, 12 frames: resized and cropped) and c/ (frames,
    32 x 32: taken as they are), each with a caption."""
    folder.mkdir()
    tiny_wan.write_video(folder / "a.mp4", tiny_wan.moving_pattern(12, 48, 64))
    tiny_wan.write_frames_folder(folder / "c",
                                 tiny_wan.moving_pattern(9, 32, 32, seed=2))
    tiny_wan.write_captions([(folder / "a.txt", "a red cat"),
                             (folder / "c.txt", "sun over the river")])
    return folder




def rgb8(pixels, index):
    """Frame ``index`` of prepare's pixels [1, 3, F, H, W] in [-1, 1] as
    the 8-bit RGB image a user would pass to the pipeline."""
    from PIL import Image
    frame = ((pixels[0, :, index] + 1) * 127.5).round().clamp(0, 255)
    return Image.fromarray(frame.to(torch.uint8).permute(1, 2, 0).numpy())


def reference(folder, kind, pixels):
    """(image_embeds, image_condition) by transformers' and diffusers' own
    calls, as WanImageToVideoPipeline defines them."""
    from diffusers import AutoencoderKLWan
    from transformers import CLIPImageProcessor, CLIPVisionModel

    frames, height, width = pixels.shape[2:]
    picks = [0] if kind == "i2v" else [0, frames - 1]
    images = [rgb8(pixels, i) for i in picks]
    processor = CLIPImageProcessor.from_pretrained(folder / "image_processor")
    encoder = CLIPVisionModel.from_pretrained(folder / "image_encoder")
    vae = AutoencoderKLWan.from_pretrained(folder / "vae")
    with torch.no_grad():
        inputs = processor(images=images if kind == "flf2v" else images[0],
                           return_tensors="pt")
        embeds = encoder(**inputs, output_hidden_states=True).hidden_states[-2]
        # VaeImageProcessor: x / 255, then 2 x - 1; zeros between.
        video = torch.zeros(1, 3, frames, height, width)
        for i, im in zip(picks, images):
            x = torch.from_numpy(np.asarray(im).astype(np.float32) / 255.0)
            video[0, :, i] = 2.0 * x.permute(2, 0, 1) - 1.0
        z = vae.encode(video).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    latent = (z - mean) * inv_std
    # 1 where a latent frame's pixel frame is given: the first frame four
    # times (latent frame 0), FLF2V's last the last of latent frame T-1.
    mask = torch.zeros(1, 4, *latent.shape[2:])
    mask[:, :, 0] = 1
    if kind == "flf2v":
        mask[:, 3, -1] = 1
    return embeds.reshape(-1, embeds.shape[-1]), torch.cat([mask, latent],
                                                           1)[0]


# ---------------------------------------------------------------------------
# megaslide-prepare
# ---------------------------------------------------------------------------

def test_image_tensors_equal_transformers_and_diffusers(base, tmp_path,
                                                        capsys):
    kind, folder = base
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", folder,
                            *SIZE)
    assert code == 0, log
    assert "2 prepared, 0 skipped" in log
    tokens = 5 if kind == "i2v" else 10
    for name, source in (("a", "a.mp4"), ("c", "c")):
        tensors, meta = load(out / f"{name}.safetensors")
        settings = json.loads(meta["megaslide.prepare"])
        assert settings["image_condition"].startswith(
            "WanImageToVideoPipeline, the first ")
        assert tensors["latents"].shape == (16, 3, 4, 4)
        assert tensors["condition"].shape == (512, 32)  # the config's
        assert tensors["image_embeds"].shape == (tokens, 24)
        assert tensors["image_condition"].shape == (20, 3, 4, 4)
        assert all(t.dtype == torch.float32 for t in tensors.values())
        pixels = prepare.load_pixels(str(data / source), 9, 32, 32)
        embeds, condition = reference(folder, kind, pixels)
        assert torch.equal(tensors["image_embeds"], embeds), name
        assert torch.equal(tensors["image_condition"], condition), name
        if name == "c":
            # No resize: the conditioning image is the first frame itself,
            # and (the VAE is causal) its latents are the video's first
            # latent frame, up to float rounding.
            first = np.asarray(rgb8(pixels, 0))
            assert np.array_equal(first, tiny_wan.moving_pattern(
                9, 32, 32, seed=2)[0])
            torch.testing.assert_close(tensors["image_condition"][4:, 0],
                                       tensors["latents"][:, 0], rtol=0,
                                       atol=1e-5)


def test_image_tensors_are_what_the_pipeline_builds(base, tmp_path, capsys):
    """WanImageToVideoPipeline.__call__ given the sample's first (and last)
    frame hands its transformer exactly the sample's image_embeds,
    image_condition and condition."""
    from diffusers import WanImageToVideoPipeline

    kind, folder = base
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", folder,
                            *SIZE)
    assert code == 0, log
    tensors, _ = load(out / "a.safetensors")
    pixels = prepare.load_pixels(str(data / "a.mp4"), 9, 32, 32)
    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    last = {"last_image": rgb8(pixels, 8)} if kind == "flf2v" else {}
    pipe(image=rgb8(pixels, 0), prompt="a red cat", height=32, width=32,
         num_frames=9, num_inference_steps=1, guidance_scale=1.0,
         output_type="latent", **last)
    (inputs,) = seen
    image = inputs["encoder_hidden_states_image"]
    assert image.shape == ((1, 5, 24) if kind == "i2v" else (2, 5, 24))
    assert torch.equal(image.reshape(-1, 24), tensors["image_embeds"])
    assert torch.equal(inputs["hidden_states"][0, 16:],
                       tensors["image_condition"])
    assert torch.equal(inputs["encoder_hidden_states"][0],
                       tensors["condition"])


def test_prepared_image_samples_train(base, tmp_path, capsys):
    from conftest import tool_path

    kind, folder = base
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", folder,
                            *SIZE, "--dtype", "bf16")
    assert code == 0, log
    import subprocess
    result = subprocess.run(
        [tool_path("megaslide-run"), "--model",
         str(folder / "transformer" / "config.json"), "--backend", "cpu",
         "--frames", "9", "--height", "32", "--width", "32", "--data",
         str(out), "--steps", "2", "--init", "random", "--no-progress"],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stdout + result.stderr


def test_resume_keeps_and_redoes_image_samples(base, tmp_path, capsys,
                                               monkeypatch):
    from safetensors.torch import save

    kind, folder = base
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    args = (data, "-o", out, "--pipeline", folder, *SIZE)
    code, log = run_prepare(capsys, *args)
    assert code == 0, log
    with monkeypatch.context() as m:
        m.setattr(prepare, "Models", None)  # a second run loads no model
        code, log = run_prepare(capsys, *args)
    assert code == 0 and "0 prepared, 2 skipped" in log, log
    # A sample without its image embedding (all else as written) is redone.
    tensors, meta = load(out / "a.safetensors")
    del tensors["image_embeds"]
    (out / "a.safetensors").write_bytes(save(tensors, metadata=meta))
    code, log = run_prepare(capsys, *args)
    assert code == 0, log
    assert "a.mp4: redoing the sample: has no 'image_embeds'" in log
    assert "1 prepared, 1 skipped" in log
    assert "image_embeds" in load(out / "a.safetensors")[0]


@pytest.mark.parametrize("missing", ["image_encoder", "image_processor"])
def test_pipeline_without_image_encoder_is_refused_before_any_work(
        base, tmp_path, capsys, missing):
    kind, folder = base
    data = dataset(tmp_path / "videos")
    broken = tmp_path / f"no_{missing}"
    broken.mkdir()
    for entry in folder.iterdir():
        if entry.name != missing:
            (broken / entry.name).symlink_to(entry)
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", broken,
                            *SIZE)
    assert code == 2, log
    frames = "first frame" if kind == "i2v" else "first and last frame"
    assert (f"error: the pipeline folder '{broken}' has no {missing}/ "
            f"(with ") in log
    assert (f"but its transformer is image-conditioned (image_dim 24 in "
            f"'{broken}/transformer/config.json'): each sample needs the "
            f"CLIP embedding of its {frames}; give the "
            f"WanImageToVideoPipeline folder the model comes from") in log
    assert len(log.strip().splitlines()) == 1, log
    assert not out.exists()


def test_an_image_encoder_that_does_not_fit_is_refused(base, tmp_path,
                                                       capsys):
    kind, folder = base
    data = dataset(tmp_path / "videos")
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "image_encoder" / "config.json").read_text())
    config.update(hidden_size=32, patch_size=8)  # 17 tokens of width 32
    (other / "image_encoder" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", other,
                            *SIZE)
    assert code == 2, log
    assert (f"the image encoder '{other}/image_encoder' does not fit the "
            f"transformer ('{other}/transformer/config.json'): its "
            f"hidden_size 32 is not the transformer's image_dim 24") in log
    if kind == "i2v":
        assert ("its 17 tokens per image x 1 (first frame) = 17 differ from "
                "the transformer's image_len 5") in log
    else:
        assert ("its 17 tokens per image x 2 (first and last frame) = 34 "
                "differ from the transformer's pos_embed_seq_len 10") in log
    assert not out.exists()


# ---------------------------------------------------------------------------
# megaslide-export, from_pretrained, enable_dsa and sampling
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """A run's weights: the kind's model with 3D-DSA at 13 x 96 x 96 (grid
    (4, 6, 6), both self-attentions rewritten), random and non-trivial
    (test_wan_i2v.py's rule), saved with their _megaslide record; and the
    Trainer that predicts with them."""
    from test_wan_i2v import randomise

    kind, folder = base
    root = tmp_path_factory.mktemp(f"{kind}_run")
    trainer = megaslide.Trainer(
        str(folder / "transformer" / "config.json"), FRAMES, HEIGHT, WIDTH,
        backend="cpu", precision="f32", attention="dsa", dsa_window=WINDOW,
        dsa_tile=TILE, dsa_radius=RADIUS, seed=0)
    trainer.load_parameters(randomise(trainer.parameters(), 5))
    trainer.save_weights(str(root / "weights"))
    return trainer, root / "weights"


def run_export(capsys, *args):
    code = export.main([*map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def relative_error(a, ref):
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def test_export_samples_with_dsa_as_megaslide_predicts(base, run, tmp_path,
                                                       capsys):
    from diffusers import WanImageToVideoPipeline
    from diffusers.models.transformers.transformer_wan import \
        WanAttnProcessor
    from safetensors.torch import load_file

    kind, folder = base
    trainer, weights = run
    out = tmp_path / "my-wan-i2v"
    code, log = run_export(capsys, "--pipeline", folder, "--weights",
                           weights, "-o", out)
    assert code == 0, log
    assert (f"image_encoder, image_processor, scheduler, text_encoder, "
            f"tokenizer, vae copied from '{folder}'") in log, log
    assert (out / "model_index.json").read_bytes() == \
        (folder / "model_index.json").read_bytes()
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    expected = load_file(weights / "diffusion_pytorch_model.safetensors")
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())

    settings = msd.enable_dsa(pipe)
    assert (settings.window, settings.tile, settings.radius) == (
        WINDOW, TILE, RADIUS)
    for block in pipe.transformer.blocks:
        assert isinstance(block.attn1.processor, msd.Dsa3dAttnProcessor)
        # The cross-attention with the image keys keeps diffusers' own.
        assert block.attn2.add_k_proj is not None
        assert type(block.attn2.processor) is WanAttnProcessor

    calls = []

    def record(module, args, kwargs, output):
        calls.append(({k: v for k, v in kwargs.items()
                       if isinstance(v, torch.Tensor)}, output[0]))
    hook = pipe.transformer.register_forward_hook(record, with_kwargs=True)
    frames = tiny_wan.moving_pattern(FRAMES, HEIGHT, WIDTH, seed=4)
    from PIL import Image
    last = {"last_image": Image.fromarray(frames[-1])} \
        if kind == "flf2v" else {}
    video = pipe(image=Image.fromarray(frames[0]), prompt="a red cat",
                 height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                 num_inference_steps=2, guidance_scale=1.0,
                 output_type="np", **last).frames
    hook.remove()
    assert video.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    assert np.isfinite(video).all()
    assert len(calls) == 2

    def predict(inputs):
        x = inputs["hidden_states"].numpy()
        image = inputs["encoder_hidden_states_image"]
        return trainer.predict(
            latents=x[:, :16], noise=x[:, :16],
            timesteps=(inputs["timestep"] / 1000).numpy(),
            condition=inputs["encoder_hidden_states"].numpy(),
            image_embeds=image.reshape(1, -1, image.shape[-1]).numpy(),
            image_condition=x[:, 16:])

    errors = []
    for inputs, output in calls:
        ours = predict(inputs)
        errors.append(relative_error(output.numpy(), ours))
        assert errors[-1] <= RTOL, errors
    # Teeth: the same inputs with global attention, or without the image
    # tokens, give another prediction.
    inputs, output = calls[0]
    ours = predict(inputs)
    msd.disable_dsa(pipe)
    with torch.no_grad():
        stock = pipe.transformer(**inputs, return_dict=False)[0].numpy()
        msd.enable_dsa(pipe)
        blind = pipe.transformer(**dict(
            inputs, encoder_hidden_states_image=torch.zeros_like(
                inputs["encoder_hidden_states_image"])),
            return_dict=False)[0].numpy()
    assert relative_error(stock, ours) > 100 * RTOL
    assert relative_error(blind, ours) > 100 * RTOL
    print(f"{kind}: prediction inside the pipeline vs Trainer.predict: "
          f"{', '.join(f'{e:.2g}' for e in errors)} of max|output|; global "
          f"attention {relative_error(stock, ours):.2g}, no image tokens "
          f"{relative_error(blind, ours):.2g}")


def test_export_refuses_an_image_model_on_a_text_to_video_base(
        base, run, tmp_path, capsys):
    kind, folder = base
    _, weights = run
    # The base's model_index.json as a WanPipeline's, and with the image
    # encoder missing from the list.
    for edit, message in (
            (lambda m: m.update(_class_name="WanPipeline"),
             "but the base is a WanPipeline;"),
            (lambda m: m.update(image_encoder=[None, None]),
             "but the base is a WanImageToVideoPipeline whose "
             "model_index.json lists no image_encoder;")):
        other = tmp_path / "other"
        shutil.copytree(folder, other, symlinks=True)
        index = json.loads((other / "model_index.json").read_text())
        edit(index)
        (other / "model_index.json").write_text(json.dumps(index))
        out = tmp_path / "out"
        code, log = run_export(capsys, "--pipeline", other, "--weights",
                               weights, "-o", out)
        assert code == 2, log
        assert (f"--pipeline '{other}': the transformer is image-conditioned "
                f"(image_dim 24), {message} give the "
                f"WanImageToVideoPipeline folder") in log, log
        assert not out.exists()
        shutil.rmtree(other)
