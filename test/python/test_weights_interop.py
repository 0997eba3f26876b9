"""Weights written by megaslide-run open with Python's safetensors under
diffusers' names and shapes, and weights written by Python's safetensors in
diffusers' layout (one file, or shards with an index) load into megaslide-run
bit for bit; a misnamed tensor is refused by name.

The expected state dict is diffusers' WanTransformer3DModel for the tiny
preset, written out here module by module (and checked against
megaslide.model_info's parameter count), not taken from MegaSlide."""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import megaslide
from conftest import tool_path

# A small video keeps one CPU step quick; tiny is a 2-layer Wan 2.1.
RUN_ARGS = ["--model", "tiny", "--backend", "cpu", "--frames", "5",
            "--height", "32", "--width", "32", "--no-progress"]
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def wan_state_dict_shapes(layers=2, dim=64, ffn=256, text_dim=32,
                          channels=16, freq_dim=32, patch=(1, 2, 2)):
    """Names and shapes of diffusers' WanTransformer3DModel.state_dict()
    (text-to-video, qk_norm rms_norm_across_heads, cross_attn_norm)."""
    shapes = {}

    def linear(name, fan_in, fan_out):
        shapes[f"{name}.weight"] = (fan_out, fan_in)
        shapes[f"{name}.bias"] = (fan_out,)

    shapes["patch_embedding.weight"] = (dim, channels, *patch)
    shapes["patch_embedding.bias"] = (dim,)
    linear("condition_embedder.time_embedder.linear_1", freq_dim, dim)
    linear("condition_embedder.time_embedder.linear_2", dim, dim)
    linear("condition_embedder.time_proj", dim, 6 * dim)
    linear("condition_embedder.text_embedder.linear_1", text_dim, dim)
    linear("condition_embedder.text_embedder.linear_2", dim, dim)
    for i in range(layers):
        p = f"blocks.{i}"
        shapes[f"{p}.scale_shift_table"] = (1, 6, dim)
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                linear(f"{p}.{attn}.{proj}", dim, dim)
            shapes[f"{p}.{attn}.norm_q.weight"] = (dim,)
            shapes[f"{p}.{attn}.norm_k.weight"] = (dim,)
        shapes[f"{p}.norm2.weight"] = (dim,)
        shapes[f"{p}.norm2.bias"] = (dim,)
        linear(f"{p}.ffn.net.0.proj", dim, ffn)
        linear(f"{p}.ffn.net.2", ffn, dim)
    shapes["scale_shift_table"] = (1, 2, dim)
    linear("proj_out", dim, channels * patch[0] * patch[1] * patch[2])
    return shapes


def load_diffusers_dir(path: pathlib.Path):
    """The state dict of a diffusers weights directory, as diffusers reads
    it: the index and its shards if there is an index, else the one file."""
    index = path / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            loaded = load_file(path / shard)
            assert all(weight_map[name] == shard for name in loaded), shard
            tensors.update(loaded)
        assert set(tensors) == set(weight_map)
        return tensors
    return load_file(path / WEIGHTS)


def save_diffusers_dir(tensors, path: pathlib.Path, shards: int):
    """Writes `tensors` as diffusers does: one file, or `shards` files
    named -0000i-of-0000N with an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(
        {"_class_name": "WanTransformer3DModel"}))
    if shards == 1:
        save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"diffusion_pytorch_model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, path / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    total = sum(t.nbytes for t in tensors.values())
    (path / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))


def run(tool, *args):
    return subprocess.run([tool, *RUN_ARGS, *map(os.fspath, args)],
                          capture_output=True, text=True, timeout=600)


def bits(array):
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def megaslide_run() -> str:
    return tool_path("megaslide-run")


@pytest.fixture(scope="module")
def trained(megaslide_run, tmp_path_factory):
    """Weights after one CPU training step, as saved by megaslide-run."""
    out = tmp_path_factory.mktemp("trained")
    result = run(megaslide_run, "--steps", "1", "--save-weights", out)
    assert result.returncode == 0, result.stderr
    return out


def test_expected_state_dict_matches_model_info():
    shapes = wan_state_dict_shapes()
    info = megaslide.model_info("tiny", 5, 32, 32)
    assert sum(int(np.prod(s)) for s in shapes.values()) == \
        info["params"]["total"]


def test_saved_weights_are_a_diffusers_directory(trained):
    assert json.loads((trained / "config.json").read_text())
    tensors = load_diffusers_dir(trained)
    expected = wan_state_dict_shapes()
    assert sorted(tensors) == sorted(expected)
    for name, array in tensors.items():
        assert array.shape == expected[name], name
        assert array.dtype == np.float32, name
        assert np.all(np.isfinite(array)), name


@pytest.mark.parametrize("shards", [1, 3])
def test_python_written_weights_round_trip_exactly(megaslide_run, trained,
                                                   tmp_path, shards):
    rng = np.random.default_rng(shards)
    # Values no bf16 or f16 could hold, signed zero and a subnormal: any
    # rounding on the way shows.
    modified = {}
    for name, array in load_diffusers_dir(trained).items():
        noise = rng.standard_normal(array.shape).astype(np.float32)
        modified[name] = (array + noise * np.float32(1e-3)).astype(np.float32)
    first = modified["proj_out.weight"].reshape(-1)
    first[:3] = [-0.0, np.float32(1e-45), np.float32(1 + 2**-20)]
    source, out = tmp_path / "in", tmp_path / "out"
    save_diffusers_dir(modified, source, shards)

    result = run(megaslide_run, "--weights", source, "--steps", "0",
                 "--save-weights", out)
    assert result.returncode == 0, result.stderr
    reloaded = load_diffusers_dir(out)
    assert sorted(reloaded) == sorted(modified)
    for name, array in modified.items():
        assert np.array_equal(bits(reloaded[name]), bits(array)), name


def test_f16_weights_load_exactly(megaslide_run, trained, tmp_path):
    half = {n: a.astype(np.float16) for n, a in
            load_diffusers_dir(trained).items()}
    source, out = tmp_path / "in", tmp_path / "out"
    save_diffusers_dir(half, source, 1)
    result = run(megaslide_run, "--weights", source / WEIGHTS, "--steps", "0",
                 "--save-weights", out)
    assert result.returncode == 0, result.stderr
    reloaded = load_diffusers_dir(out)
    for name, array in half.items():
        assert np.array_equal(bits(reloaded[name]),
                              bits(array.astype(np.float32))), name


def test_renamed_tensor_is_refused_by_name(megaslide_run, trained, tmp_path):
    tensors = load_diffusers_dir(trained)
    tensors["blocks.1.attn1.to_query.weight"] = tensors.pop(
        "blocks.1.attn1.to_q.weight")
    source = tmp_path / "renamed"
    save_diffusers_dir(tensors, source, 1)
    result = run(megaslide_run, "--weights", source, "--steps", "0",
                 "--save-weights", tmp_path / "never")
    assert result.returncode != 0
    assert "blocks.1.attn1.to_q.weight" in result.stderr  # missing
    assert "blocks.1.attn1.to_query.weight" in result.stderr  # unexpected
    assert not (tmp_path / "never").exists()
