"""megaslide-prepare and megaslide-export on a tiny Wan pipeline built
offline (tiny_wan.py) and synthetic videos written with PyAV.

The references are diffusers' and transformers' own calls: the VAE's
posterior mode normalised with the VAE config's latents_mean/std (the
inverse of WanPipeline's decode step, checked here too), and
WanPipeline._get_t5_prompt_embeds for the captions. Same device (cpu) and
dtype (f32), the same calls: both must be bit-equal. (The reference runs
under torch.no_grad as WanPipeline.__call__ does; with autograd on, torch
picks another SDPA path and the embeddings differ by up to 6e-7.)"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

for module in ("torch", "diffusers", "transformers", "av", "accelerate",
               "tokenizers", "safetensors"):
    pytest.importorskip(module, reason=f"{module} is not installed: "
                        f"pip install -r scripts/requirements-models.txt")

import tiny_wan  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import megaslide  # noqa: E402
from megaslide import export, prepare  # noqa: E402

SIZE = ["--frames", "9", "--height", "32", "--width", "32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base pipeline folder, a second run's weights folder)."""
    root = tmp_path_factory.mktemp("models")
    base_weights = root / "base_weights"
    megaslide.Trainer("tiny", 5, 32, 32, seed=0).save_weights(base_weights)
    base = tiny_wan.build_pipeline(root / "base", base_weights)
    # The base transformer as megaslide wrote it (its config keeps
    # text_len, which prepare takes as the default --text-len).
    shutil.rmtree(base / "transformer")
    shutil.copytree(base_weights, base / "transformer")
    run_weights = root / "run_weights"
    megaslide.Trainer("tiny", 5, 32, 32, seed=7).save_weights(run_weights)
    return base, run_weights


def dataset(folder: pathlib.Path) -> pathlib.Path:
    """a.mp4 (wide, 20 frames), b.webm (tall, 20), c/ (frames, 9 square),
    each with a caption beside it."""
    folder.mkdir()
    tiny_wan.write_video(folder / "a.mp4", tiny_wan.moving_pattern(20, 48, 64))
    (folder / "sub").mkdir()
    tiny_wan.write_video(folder / "sub" / "b.webm",
                         tiny_wan.moving_pattern(20, 64, 48, seed=1))
    tiny_wan.write_frames_folder(folder / "c",
                                 tiny_wan.moving_pattern(9, 32, 32, seed=2))
    tiny_wan.write_captions([(folder / "a.txt", "a red cat  and a dog"),
                             (folder / "sub" / "b.txt", "the bird &amp; "
                              "the tree"),
                             (folder / "c.txt", "sun over the river")])
    return folder


def run_prepare(capsys, *args):
    code = prepare.main([*map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def load(path):
    with safe_open(str(path), "pt") as f:
        return ({k: f.get_tensor(k) for k in f.keys()}, f.metadata())


def test_latents_and_embeddings_equal_diffusers(models, tmp_path, capsys):
    from diffusers import AutoencoderKLWan, WanPipeline

    base, _ = models
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE)
    assert code == 0, log
    assert "3 prepared, 0 skipped" in log
    vae = AutoencoderKLWan.from_pretrained(base / "vae")
    pipe = WanPipeline.from_pretrained(base)
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    cases = {"a": ("a.mp4", "a red cat  and a dog"),
             "sub__b": ("sub/b.webm", "the bird &amp; the tree"),
             "c": ("c", "sun over the river")}
    for name, (source, caption) in cases.items():
        tensors, meta = load(out / f"{name}.safetensors")
        assert meta["megaslide.format"] == "1"
        assert meta["megaslide.bucket"] == "9x32x32"
        assert meta["megaslide.source"] == source
        assert meta["megaslide.caption"] == caption
        assert meta["megaslide.caption_dropped"] == "0"
        pixels = prepare.load_pixels(str(data / source), 9, 32, 32)
        assert pixels.shape == (1, 3, 9, 32, 32)
        assert pixels.min() >= -1 and pixels.max() <= 1
        with torch.no_grad():
            z = vae.encode(pixels).latent_dist.mode()
        expected = (z - mean) / std
        assert tensors["latents"].shape == (16, 3, 4, 4)
        assert tensors["latents"].dtype == torch.float32
        assert torch.equal(tensors["latents"], expected[0])
        # WanPipeline's decode step, latents / (1 / std) + mean, gives z back.
        assert torch.allclose(tensors["latents"][None] / (1.0 / std) + mean,
                              z, atol=1e-5, rtol=0)
        with torch.no_grad():
            reference = pipe._get_t5_prompt_embeds(
                caption, max_sequence_length=16, device="cpu",
                dtype=torch.float32)[0]
        assert tensors["condition"].shape == (16, 32)
        assert torch.equal(tensors["condition"], reference)
        length = int(meta["megaslide.text_length"])
        # html.unescape (prompt_clean) makes "&amp;" one word: 5 + </s>.
        assert length == {"a": 7, "sub__b": 6, "c": 5}[name]
        assert torch.count_nonzero(tensors["condition"][length:]) == 0
        assert torch.count_nonzero(tensors["condition"][length - 1]) > 0
    buckets = json.loads((out / "buckets.json").read_text())
    assert buckets == {"buckets": [{"frames": 9, "height": 32, "width": 32,
                                    "samples": 3}]}


def test_prepared_samples_train(models, tmp_path, capsys):
    """megaslide-run --data takes what prepare writes (the shapes of the
    tiny preset at 9 x 32 x 32: latents [16, 3, 4, 4], condition [16, 32])."""
    from conftest import tool_path

    run = tool_path("megaslide-run")
    base, _ = models
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE, "--dtype", "bf16")
    assert code == 0, log
    result = subprocess.run([run, "--model", "tiny", "--backend", "cpu",
                             "--frames", "9", "--height", "32", "--width",
                             "32", "--data", str(out), "--steps", "2",
                             "--init", "random", "--no-progress"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stdout + result.stderr


def test_frames_are_sampled_at_the_target_fps(tmp_path):
    import av

    frames = tiny_wan.moving_pattern(12, 32, 32, seed=3)
    video = tiny_wan.write_video(tmp_path / "d.mp4", frames, fps=16)
    with av.open(str(video)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    # At 8 fps every other frame of the 16 fps video, no resize needed.
    pixels = prepare.load_pixels(str(video), 5, 32, 32, fps=8)
    expected = np.stack(decoded[0:10:2]).astype(np.float32) / 127.5 - 1
    got = pixels[0].permute(1, 2, 3, 0).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    # A folder of frames is taken as it is: frame i is file i.
    folder = tiny_wan.write_frames_folder(tmp_path / "f", frames)
    pixels = prepare.load_pixels(str(folder), 5, 32, 32)
    np.testing.assert_allclose(pixels[0].permute(1, 2, 3, 0).numpy(),
                               frames[:5].astype(np.float32) / 127.5 - 1,
                               atol=1e-6, rtol=0)
    # A wide frame covers the target and is centre-cropped.
    assert prepare.load_pixels(str(video), 5, 16, 32).shape == \
        (1, 3, 5, 16, 32)


def test_resume_skips_and_redoes_a_truncated_sample(models, tmp_path, capsys,
                                                    monkeypatch):
    base, _ = models
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    args = (data, "-o", out, "--pipeline", base, *SIZE, "--dtype", "bf16")
    code, log = run_prepare(capsys, *args)
    assert code == 0, log
    files = sorted(out.glob("*.safetensors"))
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    # The second run does no work: it decodes no video (the probe cache)
    # and loads no model.
    def no_work(*_args, **_kwargs):
        raise AssertionError("work done on a second run")
    with monkeypatch.context() as m:
        for name in ("_decode", "_read_frames_folder", "Models"):
            m.setattr(prepare, name, no_work)
        code, log = run_prepare(capsys, *args)
    assert code == 0, log
    assert "0 prepared, 3 skipped" in log
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns)
            for f in files} == before
    victim = out / "a.safetensors"
    victim.write_bytes(before["a.safetensors"][0][:-100])
    code, log = run_prepare(capsys, *args)
    assert code == 0, log
    assert "a.mp4: redoing the sample: unreadable" in log
    assert "1 prepared, 2 skipped" in log
    # Deterministic: the redone sample holds the same tensors and metadata
    # (safetensors may order the metadata differently).
    first = tmp_path / "first.safetensors"
    first.write_bytes(before["a.safetensors"][0])
    (old_tensors, old_meta), (new_tensors, new_meta) = load(first), load(victim)
    assert old_meta == new_meta
    assert all(torch.equal(old_tensors[k], new_tensors[k]) for k in old_tensors)
    # Other settings (here the fps) redo every sample.
    code, log = run_prepare(capsys, *args, "--fps", "12")
    assert code == 0, log
    assert "3 prepared, 0 skipped" in log
    assert "made with other settings" in log
    assert not list(out.glob("*.tmp"))


def test_bad_videos_are_named_and_the_others_written(models, tmp_path,
                                                     capsys):
    base, _ = models
    data = dataset(tmp_path / "videos")
    (data / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(
        range(256)) * 8)
    (data / "corrupt.txt").write_text("a car")
    tiny_wan.write_video(data / "short.mov", tiny_wan.moving_pattern(4, 32, 32))
    (data / "short.txt").write_text("a slow car")
    tiny_wan.write_video(data / "uncaptioned.mp4",
                         tiny_wan.moving_pattern(12, 32, 32))
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE)
    assert code == 1, log
    assert "3 prepared, 0 skipped (already written), 3 failed" in log
    assert "failed: corrupt.mp4: cannot decode" in log
    assert ("failed: short.mov: too short: 4 frames at 16 fps (0.25 s), "
            "needs 9 (0.56 s)") in log
    assert "failed: uncaptioned.mp4: no caption: write it to " \
        "'uncaptioned.txt'" in log
    assert sorted(f.name for f in out.glob("*.safetensors")) == [
        "a.safetensors", "c.safetensors", "sub__b.safetensors"]
    # A sample of a video now gone is named, not silently trained on.
    (data / "a.mp4").unlink()
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE)
    assert code == 1, log
    assert "0 prepared, 2 skipped" in log
    assert f"warning: '{out}' holds 1 sample(s) that no video of this run " \
        "made (a.safetensors)" in log


def test_manifest_captions_and_caption_dropout(models, tmp_path, capsys):
    base, _ = models
    data = dataset(tmp_path / "videos")
    manifest = tmp_path / "captions.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in [
        {"video": "a.mp4", "caption": "a blue car"},
        {"video": "sub/b.webm", "caption": "a bird flies"},
        {"video": "c", "caption": "the moon"},
        {"video": "gone.mp4", "caption": "not there"}]) + "\n")
    out = tmp_path / "out"
    args = (data, "-o", out, "--pipeline", base, *SIZE, "--manifest",
            manifest, "--caption-dropout", "0.5", "--seed", "2")
    code, log = run_prepare(capsys, *args)
    assert code == 1, log
    assert "failed: gone.mp4: listed in the manifest but not found" in log
    dropped = {}
    for name, caption in (("a", "a blue car"), ("sub__b", "a bird flies"),
                          ("c", "the moon")):
        tensors, meta = load(out / f"{name}.safetensors")
        drop = prepare.sample_seed_fraction(2, name) < 0.5
        dropped[name] = drop
        assert meta["megaslide.caption_dropped"] == ("1" if drop else "0")
        assert meta["megaslide.caption"] == ("" if drop else caption)
        # An empty prompt is </s> alone, as Wan's negative prompt "".
        assert (meta["megaslide.text_length"] == "1") == drop
    # Seed 2 drops c and keeps a and b (else the check above is weak).
    assert len(set(dropped.values())) == 2


def test_csv_manifest(tmp_path):
    manifest = tmp_path / "captions.csv"
    manifest.write_text('video,caption\nsub/b.webm,"a dog, running"\n'
                        'c,the moon\n')
    assert prepare.read_manifest(str(manifest), str(tmp_path)) == {
        "sub/b.webm": "a dog, running", "c": "the moon"}
    manifest.write_text("path,text\nc,the moon\n")
    with pytest.raises(prepare.UsageError, match="needs the columns "
                       "video,caption"):
        prepare.read_manifest(str(manifest), str(tmp_path))
    # A spreadsheet's byte order mark is not part of the first column.
    manifest.write_bytes(b"\xef\xbb\xbfvideo,caption\nc,the moon\n")
    assert prepare.read_manifest(str(manifest), str(tmp_path)) == {
        "c": "the moon"}
    manifest.write_bytes(b"video,caption\nc,\xff\xfe\n")
    with pytest.raises(prepare.UsageError, match="is not UTF-8 text"):
        prepare.read_manifest(str(manifest), str(tmp_path))


def test_pipeline_without_vae_is_refused_before_any_work(models, tmp_path,
                                                         capsys):
    base, _ = models
    data = dataset(tmp_path / "videos")
    broken = tmp_path / "no_vae"
    broken.mkdir()
    for entry in base.iterdir():
        if entry.name != "vae":
            (broken / entry.name).symlink_to(entry)
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", broken,
                            *SIZE)
    assert code == 2, log
    assert f"the pipeline folder '{broken}' has no vae/; give --vae DIR" in log
    assert not out.exists()
    # --vae fixes it.
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", broken,
                            "--vae", base / "vae", *SIZE)
    assert code == 0, log


def test_usage_errors_exit_2(models, tmp_path, capsys):
    base, _ = models
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            "--frames", "8")
    assert code == 2 and "frames must be 4k+1" in log
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE, "--text-len", "32")
    assert code == 2 and "differs from the transformer's text_len 16" in log
    bad = tmp_path / "buckets.json"
    bad.write_text('{"buckets": [{"frames": 9, "height": 30, "width": 32}]}')
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE, "--buckets", bad)
    assert code == 2 and f"bucket file '{bad}': buckets[0]: height must " \
        "be a positive multiple of 16, got 30" in log
    if not torch.cuda.is_available():
        code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                                *SIZE, "--device", "cuda")
        assert code == 2 and "--device cuda: torch sees no CUDA device" in log
    empty = tmp_path / "empty"
    empty.mkdir()
    code, log = run_prepare(capsys, empty, "-o", out, "--pipeline", base)
    assert code == 2 and "no videos" in log
    assert not out.exists()


def test_given_buckets_assign_by_aspect_then_duration(models, tmp_path,
                                                      capsys):
    base, _ = models
    data = dataset(tmp_path / "videos")
    # A square video with 6 frames: only the 5-frame bucket fits it.
    tiny_wan.write_video(data / "e.mp4", tiny_wan.moving_pattern(6, 32, 32))
    (data / "e.txt").write_text("a tree")
    buckets = tmp_path / "buckets.json"
    buckets.write_text(json.dumps({"buckets": [
        {"frames": 9, "height": 32, "width": 48},
        {"frames": 9, "height": 48, "width": 32},
        {"frames": 9, "height": 32, "width": 32},
        {"frames": 5, "height": 32, "width": 32}]}))
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            "--buckets", buckets)
    assert code == 0, log
    expected = {"a": ("9x32x48", (16, 3, 4, 6)),
                "sub__b": ("9x48x32", (16, 3, 6, 4)),
                "c": ("9x32x32", (16, 3, 4, 4)),
                "e": ("5x32x32", (16, 2, 4, 4))}
    for name, (bucket, shape) in expected.items():
        tensors, meta = load(out / f"{name}.safetensors")
        assert meta["megaslide.bucket"] == bucket, name
        assert tuple(tensors["latents"].shape) == shape, name
    written = json.loads((out / "buckets.json").read_text())["buckets"]
    assert [b["samples"] for b in written] == [1, 1, 1, 1]


def test_auto_buckets_choose_two_for_a_mix_of_aspect_ratios(models, tmp_path,
                                                            capsys):
    base, _ = models
    data = tmp_path / "videos"
    data.mkdir()
    for name, (h, w) in {"wide1": (32, 96), "wide2": (32, 96),
                         "square": (48, 48), "tall": (96, 32)}.items():
        tiny_wan.write_video(data / f"{name}.mp4",
                             tiny_wan.moving_pattern(10, h, w))
        (data / f"{name}.txt").write_text(name)
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE, "--auto-buckets", "2")
    assert code == 0, log
    written = json.loads((out / "buckets.json").read_text())["buckets"]
    # Candidates of area ~32x32: 16x64 gets both wide videos' votes; the
    # tie between 32x32 and 64x16 (one vote each) goes to the lower
    # height; the tall video then takes the nearer of the two kept.
    assert written == [{"frames": 9, "height": 16, "width": 64, "samples": 2},
                       {"frames": 9, "height": 32, "width": 32, "samples": 2}]
    for name, bucket in (("wide1", "9x16x64"), ("wide2", "9x16x64"),
                         ("square", "9x32x32"), ("tall", "9x32x32")):
        assert load(out / f"{name}.safetensors")[1]["megaslide.bucket"] == \
            bucket


def test_console_entry_points(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(megaslide.__file__))] +
        os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    for module in ("megaslide.prepare", "megaslide.export"):
        result = subprocess.run([sys.executable, "-m", module, "--help"],
                                env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert "docs/Data.md" in result.stdout


def run_export(capsys, *args):
    code = export.main([*map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_export_loads_and_samples(models, tmp_path, capsys):
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    base, run_weights = models
    weights = tmp_path / "weights"
    shutil.copytree(run_weights, weights)
    config = json.loads((weights / "config.json").read_text())
    config["_megaslide"] = {"attention": "global"}
    (weights / "config.json").write_text(json.dumps(config))
    out = tmp_path / "exported"
    code, log = run_export(capsys, "--pipeline", base, "--weights", weights,
                           "-o", out)
    assert code == 0, log
    assert (out / "model_index.json").read_bytes() == \
        (base / "model_index.json").read_bytes()
    # Files of its own, no links into the base or the run
    # (test_saving_the_export_never_writes_the_base).
    assert not [p for p in out.rglob("*") if p.is_symlink() or
                (p.is_file() and p.stat().st_nlink > 1)]
    assert (out / "transformer" / "config.json").read_bytes() == \
        (weights / "config.json").read_bytes()
    assert not list(tmp_path.glob(".exported.tmp-*"))
    pipe = WanPipeline.from_pretrained(out)
    expected = load_file(run_weights / "diffusion_pytorch_model.safetensors")
    state = pipe.transformer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    result = pipe("a red cat", num_inference_steps=2, height=32, width=32,
                  num_frames=5, max_sequence_length=16, guidance_scale=1.0,
                  output_type="np", generator=torch.Generator().manual_seed(0))
    assert result.frames.shape == (1, 5, 32, 32, 3)
    assert np.isfinite(result.frames).all()

    # --copy (no reflinks): the same pipeline; an empty folder may be
    # the output.
    copied = tmp_path / "copied"
    copied.mkdir()
    code, log = run_export(capsys, "--pipeline", base, "--weights", weights,
                           "-o", copied, "--copy")
    assert code == 0, log
    assert not (copied / "vae").is_symlink() and (copied / "vae").is_dir()
    WanPipeline.from_pretrained(copied)


def test_export_refuses_an_existing_folder_and_other_architectures(
        models, tmp_path, capsys):
    base, run_weights = models
    out = tmp_path / "exported"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, log = run_export(capsys, "--pipeline", base, "--weights",
                           run_weights, "-o", out)
    assert code == 2, log
    assert f"output '{out}' already exists" in log and "give a new -o" in log
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"

    other = tmp_path / "other_weights"
    shutil.copytree(run_weights, other)
    config = json.loads((other / "config.json").read_text())
    config.update(num_layers=3, ffn_dim=128)
    (other / "config.json").write_text(json.dumps(config))
    fresh = tmp_path / "fresh"
    code, log = run_export(capsys, "--pipeline", base, "--weights", other,
                           "-o", fresh)
    assert code == 2, log
    assert "num_layers: 3 in the weights, 2 in the base" in log
    assert "ffn_dim: 128 in the weights, 256 in the base" in log
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "exported", "other_weights"]

    not_wan = tmp_path / "not_wan"
    not_wan.mkdir()
    (not_wan / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    code, log = run_export(capsys, "--pipeline", not_wan, "--weights",
                           run_weights, "-o", fresh)
    assert code == 2 and "not one of WanPipeline" in log


def tree_bytes(root):
    """{relative path: bytes} of every file under ``root`` (links
    followed), to prove a folder unchanged."""
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flags", [[], ["--copy"]], ids=["default", "copy"])
def test_saving_the_export_never_writes_the_base(models, tmp_path, capsys,
                                                 flags):
    """Issue 26: save_pretrained(bf16) into an export rewrote the base's
    vae/text_encoder through the export's symlinks (and would rewrite the
    run's weights through hard links)."""
    from diffusers import WanPipeline

    base = tmp_path / "base"
    shutil.copytree(models[0], base, symlinks=True)
    weights = tmp_path / "weights"
    shutil.copytree(models[1], weights)
    before = tree_bytes(base), tree_bytes(weights)
    out = tmp_path / "my-wan"
    code, log = run_export(capsys, "--pipeline", base, "--weights", weights,
                           "-o", out, *flags)
    assert code == 0, log
    WanPipeline.from_pretrained(out).to(torch.bfloat16).save_pretrained(out)
    changed = [f"{name}/{f}" for name, folder, old in
               (("base", base, before[0]), ("weights", weights, before[1]))
               for f, data in tree_bytes(folder).items()
               if old.get(f) != data]
    assert not changed, f"the save wrote through the export: {changed}"
    assert (tree_bytes(base), tree_bytes(weights)) == before
    # The save did land in the export (bf16: other bytes).
    vae = "vae/diffusion_pytorch_model.safetensors"
    assert tree_bytes(out)[vae] != before[0][vae]


def test_export_confines_names_read_from_files(models, tmp_path, capsys):
    """Issue 26: a weight_map naming '../../victimdir/victim.txt' made
    export --copy overwrite a file outside the output folder; a
    model_index.json component '../x' would do the same."""
    base, run_weights = models
    victim = tmp_path / "o" / "victimdir" / "victim.txt"
    victim.parent.mkdir(parents=True)
    victim.write_text("precious")
    (tmp_path / "victimdir").mkdir()
    (tmp_path / "victimdir" / "victim.txt").write_text("attacker's")
    weights = tmp_path / "a" / "weights"
    shutil.copytree(run_weights, weights)
    index = {"metadata": {}, "weight_map": {
        "x": "../../victimdir/victim.txt",
        "y": "diffusion_pytorch_model.safetensors"}}
    (weights / export.INDEX).write_text(json.dumps(index))
    out = tmp_path / "o" / "out"
    for flags in ([], ["--copy"]):
        code, log = run_export(capsys, "--pipeline", base, "--weights",
                               weights, "-o", out, *flags)
        assert code == 2, log
        assert "'../../victimdir/victim.txt'" in log and export.INDEX in log
        assert victim.read_text() == "precious"
        assert not out.exists()

    evil = tmp_path / "evil_base"
    shutil.copytree(base, evil, symlinks=True)
    model_index = json.loads((evil / "model_index.json").read_text())
    model_index["../victimdir"] = ["diffusers", "AutoencoderKLWan"]
    (evil / "model_index.json").write_text(json.dumps(model_index))
    (tmp_path / "victimdir" / "config.json").write_text("{}")
    code, log = run_export(capsys, "--pipeline", evil, "--weights",
                           run_weights, "-o", out, "--copy")
    assert code == 2, log
    assert "'../victimdir'" in log and "model_index.json" in log
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]
    assert not out.exists()


def test_export_removes_a_dead_exports_temporary(models, tmp_path, capsys):
    """Issue 26: kill -9 during export --copy left '.OUT.tmp-PID' (537 MB)
    for ever; the next export of OUT removes it when PID is gone."""
    base, run_weights = models
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".exported.tmp-{dead.pid}"
    (stale / "vae").mkdir(parents=True)
    (stale / "vae" / "weights").write_bytes(b"\0" * 1024)
    alive = tmp_path / f".exported.tmp-{os.getppid()}"
    alive.mkdir()
    code, log = run_export(capsys, "--pipeline", base, "--weights",
                           run_weights, "-o", tmp_path / "exported")
    assert code == 0, log
    assert not stale.exists()
    assert f"removed '{stale}'" in log
    # A live process's temporary is left alone, and named.
    assert alive.is_dir()
    assert f"'{alive}'" in log and "still running" in log


class FifoWatch:
    """Connects a writer to each FIFO as soon as something opens it for
    reading (which blocks until then) and records that it did: a reader
    never hangs, and an open is always seen."""

    def __init__(self, *fifos):
        import threading
        self.fifos = [str(f) for f in fifos]
        self.opened = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def watch(self):
        while not self.stop.is_set():
            for f in self.fifos:
                try:
                    # ENXIO until a reader has it open.
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
                    self.opened.append(os.path.basename(f))
                except OSError:
                    pass
            self.stop.wait(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_fifos_are_not_read(models, tmp_path, capsys):
    """Issue 26: a FIFO named fifo.mp4 (or a caption that is one) made
    prepare wait for a writer for ever."""
    base, _ = models
    data = dataset(tmp_path / "videos")
    os.mkfifo(data / "fifo.mp4")
    (data / "fifo.txt").write_text("a pipe")
    (data / "c.txt").unlink()
    os.mkfifo(data / "c.txt")
    out = tmp_path / "out"
    with FifoWatch(data / "fifo.mp4", data / "c.txt") as watch:
        code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                                *SIZE)
    assert watch.opened == [], log
    assert code == 1, log
    assert "fifo.mp4" in log and "not a regular file" in log
    assert "failed: c: cannot read caption" in log
    assert sorted(f.name for f in out.glob("*.safetensors")) == [
        "a.safetensors", "sub__b.safetensors"]


@pytest.mark.parametrize("name", ["buckets.json", "prepare.json"])
def test_an_output_file_that_is_a_folder_is_refused_first(models, tmp_path,
                                                          capsys, name):
    """Issue 26: OUT/buckets.json a folder gave a traceback after all the
    work; now one line before any."""
    base, _ = models
    data = dataset(tmp_path / "videos")
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE)
    assert code == 2, log
    assert f"'{out / name}' is not a regular file" in log
    assert "Traceback" not in log and len(log.strip().splitlines()) == 1
    assert not list(out.glob("*.safetensors"))


def test_caption_bom_blank_captions_and_stray_files(models, tmp_path, capsys):
    """Issue 26: a UTF-8 BOM in a caption became a token, a whitespace-only
    caption silently an unconditional sample, and a frames folder with a
    stray notes.txt was silently dropped."""
    base, _ = models
    data = dataset(tmp_path / "videos")
    (data / "a.txt").write_bytes("\ufeffa red cat".encode())
    (data / "sub" / "b.txt").write_text("  \n\t\n")
    (data / "c" / "notes.txt").write_text("shot on a phone")
    out = tmp_path / "out"
    code, log = run_prepare(capsys, data, "-o", out, "--pipeline", base,
                            *SIZE)
    assert code == 0, log
    _, meta = load(out / "a.safetensors")
    assert meta["megaslide.caption"] == "a red cat"
    assert "blank caption: sub/b.webm" in log
    assert "skipped folder: c: holds images and other files (notes.txt)" \
        in log
    assert "2 prepared" in log


def test_manifest_paths_stay_in_the_input_folder(tmp_path):
    """Names read from a manifest are confined to the input folder."""
    for bad in ("../outside.mp4", "/etc/x.mp4", "a/../../x.mp4"):
        manifest = tmp_path / "captions.jsonl"
        manifest.write_text(json.dumps({"video": "a.mp4", "caption": "x"}) +
                            "\n" + json.dumps({"video": bad, "caption": "y"})
                            + "\n")
        with pytest.raises(prepare.UsageError) as e:
            prepare.read_manifest(str(manifest), str(tmp_path))
        assert f"manifest '{manifest}': line 2: '{bad}' is not inside the " \
            "input folder" in str(e.value)
