"""megaslide.model_info: counts derived from the published architectures,
agreement with megaslide-plan, and clear errors for bad arguments."""

import json
import subprocess

import pytest

import megaslide


def linear(fan_in: int, fan_out: int, bias: bool = True) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def wan_reference_count(layers, dim, ffn, text_dim, channels, freq_dim=256,
                        patch=(1, 2, 2)):
    """Parameters of diffusers' WanTransformer3DModel, module by module."""
    patch_volume = patch[0] * patch[1] * patch[2]
    patch_embedding = channels * patch_volume * dim + dim
    condition_embedder = (linear(freq_dim, dim) + linear(dim, dim)   # time
                          + linear(dim, 6 * dim)                     # proj
                          + linear(text_dim, dim) + linear(dim, dim))  # text
    attention = 4 * linear(dim, dim) + 2 * dim  # q, k, v, out + QK-norm
    block = (2 * attention + 2 * dim + linear(dim, ffn) + linear(ffn, dim)
             + 6 * dim)
    head = linear(dim, channels * patch_volume) + 2 * dim
    return patch_embedding + condition_embedder + layers * block + head


def wan_image_extra_count(layers, dim, channels, image_dim, pos_len=0,
                          mask_channels=4, patch=(1, 2, 2)):
    """What image conditioning adds to WanTransformer3DModel: the image
    embedder (LayerNorm, FeedForward, LayerNorm, FLF2V's position
    embedding), per block add_k_proj, add_v_proj and norm_added_k, and the
    patch embedding's mask and conditioning-latent input channels."""
    patch_volume = patch[0] * patch[1] * patch[2]
    patch_embedding = (mask_channels + channels) * patch_volume * dim
    if not image_dim:  # Wan 2.2 I2V: the conditioning latents only
        return patch_embedding
    embedder = (2 * image_dim + linear(image_dim, image_dim)
                + linear(image_dim, dim) + 2 * dim + pos_len * image_dim)
    block = 2 * linear(dim, dim) + dim
    return embedder + layers * block + patch_embedding


def dit_reference_count(depth, dim, patch, in_ch, out_ch, classes, tokens):
    """Parameters of facebookresearch/DiT's DiT (all nn.Parameters)."""
    x_embedder = in_ch * patch * patch * dim + dim
    t_embedder = linear(256, dim) + linear(dim, dim)
    y_embedder = (classes + 1) * dim  # + the classifier-free-guidance row
    pos_embed = tokens * dim          # fixed sin-cos, requires_grad=False
    block = (linear(dim, 3 * dim) + linear(dim, dim) + linear(dim, 4 * dim)
             + linear(4 * dim, dim) + linear(dim, 6 * dim))
    final = linear(dim, patch * patch * out_ch) + linear(dim, 2 * dim)
    return x_embedder + t_embedder + y_embedder + pos_embed + depth * block + final


@pytest.mark.parametrize("model,video,expected", [
    ("dit-xl-2", (1, 256, 256),
     dit_reference_count(28, 1152, 2, 4, 8, 1000, 256)),
    ("wan2.1-t2v-14b", (81, 480, 832),
     wan_reference_count(40, 5120, 13824, 4096, 16)),
    ("wan2.1-t2v-1.3b", (81, 480, 832),
     wan_reference_count(30, 1536, 8960, 4096, 16)),
    ("megaslide-105b", (81, 720, 1280),
     wan_reference_count(52, 12288, 32768, 4096, 16)),
    ("tiny", (5, 32, 32), wan_reference_count(2, 64, 256, 32, 16, 32)),
    ("wan2.1-i2v-14b-480p", (81, 480, 832),
     wan_reference_count(40, 5120, 13824, 4096, 16)
     + wan_image_extra_count(40, 5120, 16, 1280)),
    ("wan2.1-i2v-14b-720p", (81, 720, 1280),
     wan_reference_count(40, 5120, 13824, 4096, 16)
     + wan_image_extra_count(40, 5120, 16, 1280)),
    ("wan2.1-flf2v-14b", (81, 720, 1280),
     wan_reference_count(40, 5120, 13824, 4096, 16)
     + wan_image_extra_count(40, 5120, 16, 1280, pos_len=514)),
    ("wan2.2-i2v-a14b", (81, 720, 1280),
     wan_reference_count(40, 5120, 13824, 4096, 16)
     + wan_image_extra_count(40, 5120, 16, 0)),
    ("wan2.2-ti2v-5b", (121, 704, 1280),
     wan_reference_count(30, 3072, 14336, 4096, 48)),
])
def test_parameter_counts_match_reference_architectures(model, video, expected):
    info = megaslide.model_info(model, *video)
    assert info["params"]["total"] == expected
    by_category = info["params"]["by_category"]
    assert sum(by_category.values()) == expected
    assert sum(info["params"]["per_block"]) == by_category["blocks"]


def test_published_totals():
    assert megaslide.model_info("dit-xl-2", 1, 256, 256)["params"]["total"] == 675_129_632
    assert megaslide.model_info("wan2.1-t2v-14b", 81, 480, 832)["params"]["total"] == 14_288_491_584
    assert megaslide.model_info("wan2.1-t2v-1.3b", 81, 480, 832)["params"]["total"] == 1_418_996_800
    # diffusers' models built from the official configs on the meta device.
    for preset in ("wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p"):
        assert megaslide.model_info(preset, 81, 480, 832)["params"]["total"] == 16_394_878_784
    assert megaslide.model_info("wan2.1-flf2v-14b", 81, 720, 1280)["params"]["total"] == 16_395_536_704
    assert megaslide.model_info("wan2.2-t2v-a14b", 81, 720, 1280)["params"]["total"] == 14_288_491_584
    assert megaslide.model_info("wan2.2-i2v-a14b", 81, 720, 1280)["params"]["total"] == 14_288_901_184
    assert megaslide.model_info("wan2.2-ti2v-5b", 121, 704, 1280)["params"]["total"] == 4_999_787_712


WAN_PRESETS = ["tiny", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "megaslide-105b",
               "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p",
               "wan2.1-flf2v-14b", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b",
               "wan2.2-ti2v-5b"]


@pytest.mark.parametrize("preset", WAN_PRESETS)
def test_wan_presets_declare_diffusers_parameters(preset, megaslide_plan,
                                                  tmp_path):
    # diffusers' own model, built on the meta device from the preset's
    # config (keys it does not take are ignored), against the parameters
    # the builder declares: every name with its shape.
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    import pathlib
    import re
    config = json.loads((pathlib.Path(__file__).parents[2] / "configs"
                         / f"{preset}.json").read_text())
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(config)
    want = {n: list(t.shape) for n, t in model.state_dict().items()}
    module = tmp_path / "step.mlir"
    subprocess.run([megaslide_plan, "--model", preset, "--frames", "1",
                    "--height", "32", "--width", "32", "--emit-mlir",
                    module], check=True, capture_output=True)
    got = {m[1]: [int(d) for d in m[2].split("x")] for m in re.finditer(
        r"megaslide\.param (?:master|frozen) \S+ @([\w.]+) : "
        r"tensor<([\dx]+)xf32>", module.read_text())}
    assert got == want


def test_105b_tokens_and_flops():
    info = megaslide.model_info("megaslide-105b", 81, 720, 1280)
    assert info["tokens"] == 21 * 45 * 80
    assert info["latent"]["shape"] == [21, 90, 160]
    flops = info["flops"]
    assert flops["forward"] == sum(
        v for k, v in flops["forward_by_kind"].items() if k != "total")
    # Dense GEMMs, 2 FLOPs per multiply-add: per video token every block
    # GEMM but the cross-attention K/V projections, which run per text token.
    n, text, d, ffn, layers = info["tokens"], 512, 12288, 32768, 52
    blocks = layers * (n * (6 * d * d + 2 * d * ffn) + text * 2 * d * d)
    embeddings = (n * 16 * 4 * d                     # patch embedding
                  + 256 * d + d * d + d * 6 * d      # time, one sample
                  + text * (4096 * d + d * d))       # text projection
    head = n * d * 16 * 4
    assert flops["forward_by_kind"]["matmul"] == 2 * (blocks + embeddings + head)
    # Global attention: QK^T and PV per head, self over N, cross over text.
    assert flops["forward_by_kind"]["attention"] == 2 * 2 * layers * d * n * (n + text)
    assert flops["backward"] > flops["forward"]


def test_matches_megaslide_plan_json(megaslide_plan):
    args = ["--model", "wan2.1-t2v-14b", "--frames", "17", "--height", "240",
            "--width", "416", "--batch", "2", "--text-len", "77"]
    tool = json.loads(subprocess.run([megaslide_plan, *args, "--format", "json"],
                                     check=True, capture_output=True,
                                     text=True).stdout)
    py = megaslide.model_info("wan2.1-t2v-14b", 17, 240, 416, batch=2,
                              text_len=77)
    for result in (tool, py):
        result["ir"].pop("build_seconds")
    # model_info is the model part of the plan report.
    assert {k: tool[k] for k in py if k != "ir"} == {k: v for k, v in py.items() if k != "ir"}
    assert tool["ir"]["ops"] == py["ir"]["ops"]
    assert py["video"]["batch"] == 2 and py["video"]["text_len"] == 77


def test_latent_units_and_config_files(tmp_path):
    config = tmp_path / "small.json"
    config.write_text(json.dumps({
        "_class_name": "WanTransformer3DModel", "num_layers": 1,
        "num_attention_heads": 2, "attention_head_dim": 8, "ffn_dim": 32,
        "in_channels": 4, "text_dim": 8, "patch_size": [1, 2, 2]}))
    info = megaslide.model_info(str(config), 3, 4, 6, latent=True)
    assert info["grid"] == [3, 2, 3]
    assert info["video"]["units"] == "latent"
    assert info["params"]["total"] == wan_reference_count(1, 16, 32, 8, 4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(model="nope"), "unknown model preset 'nope'"),
    (dict(frames=80), "video field 'frames'"),
    (dict(height=724), "video field 'height'"),
])
def test_bad_input_raises_value_error_naming_the_field(kwargs, message):
    args = dict(model="megaslide-105b", frames=81, height=720, width=1280)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        megaslide.model_info(**args)


def test_bad_config_names_the_field(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text('{"num_layers": 2, "num_attention_head": 4}')
    with pytest.raises(ValueError, match="'num_attention_head'.*did you mean"):
        megaslide.model_info(str(config), 5, 32, 32)


@pytest.mark.parametrize("kwargs,error", [
    (dict(frames=0), ValueError),
    (dict(batch=-1), ValueError),
    (dict(frames=81.0), TypeError),
    (dict(model=3), TypeError),
    (dict(text_len=True), TypeError),
])
def test_argument_types_are_checked(kwargs, error):
    args = dict(model="tiny", frames=5, height=32, width=32)
    args.update(kwargs)
    with pytest.raises(error):
        megaslide.model_info(**args)


def test_version():
    assert megaslide.__version__.count(".") == 2
