"""A tiny diffusers Wan pipeline folder and synthetic videos, built offline
for the data tests (test_prepare.py, test_prepare_i2v.py): a randomly
initialised AutoencoderKLWan (z_dim 16, megaslide's tiny in_channels), a
UMT5 encoder with d_model 32 (tiny's text_dim), a word-level tokenizer
trained here and saved as a transformers fast tokenizer, UniPC as
WanPipeline uses, and the transformer that megaslide.Trainer(...)
.save_weights writes. An image-conditioned transformer (image_dim set,
image_config) makes it a WanImageToVideoPipeline with a CLIPVisionModel of
width image_dim giving the config's image tokens per image and its
CLIPImageProcessor."""

from __future__ import annotations

import os
import pathlib
from typing import Iterable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

WORDS = ("a red cat and blue dog play in the green garden under sun moon "
         "river car drives fast slow bird flies over house tree").split()
TEXT_LEN = 16  # configs/tiny.json text_len
TEXT_DIM = 32  # configs/tiny.json text_dim
IMAGE_DIM, IMAGE_TOKENS = 24, 5  # a CLIP of width 24, 2 x 2 patches + class
CLIP_SIZE = 32  # CLIP's input: 32 x 32 pixels, patches of 16


def image_config(kind: str) -> dict:
    """configs/tiny.json with Wan 2.1's image conditioning, "i2v" or
    "flf2v": CLIP-like image tokens of width IMAGE_DIM, the 36-channel
    input of WanImageToVideoPipeline (16 latent channels, a 4-channel mask,
    16 channels of conditioning latents), and 512 prompt tokens, which
    diffusers' attention processor requires of an image-conditioned model
    (it takes the last 512 context tokens as the prompt's); or "i2v-a14b",
    Wan 2.2 I2V's: the conditioning latents without CLIP embeddings, any
    prompt length."""
    import json
    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    config = json.loads((root / "tiny.json").read_text())
    if kind == "i2v-a14b":
        config.update(name="tiny-i2v-a14b", in_channels=36, out_channels=16)
        return config
    config.update(name=f"tiny-{kind}", in_channels=36, out_channels=16,
                  image_dim=IMAGE_DIM, added_kv_proj_dim=64, text_len=512,
                  image_len=IMAGE_TOKENS)
    if kind == "flf2v":
        # Two images' tokens, as diffusers views [2B, L, D] as [B, 2L, D].
        config.update(pos_embed_seq_len=2 * IMAGE_TOKENS,
                      image_len=2 * IMAGE_TOKENS)
    return config


def randomise(params: dict, seed: int, small: dict = None) -> dict:
    """test_parity.py's rule over a Trainer's own names and shapes: every
    tensor random and non-trivial (diffusers' zero-initialised proj_out is
    random here, norm gains are 1 + noise), float32. ``small`` maps a name
    suffix to the standard deviation of those tensors (image tests draw
    FLF2V's pos_embed at the image tokens' scale)."""
    import math
    rng = np.random.default_rng(seed)
    dim = params["scale_shift_table"].shape[-1]
    out = {}
    for name, value in sorted(params.items()):
        shape = value.shape
        std = next((v for k, v in (small or {}).items() if name.endswith(k)),
                   None)
        if name.endswith("scale_shift_table"):
            x = rng.normal(0, 1 / math.sqrt(dim), shape)
        elif "norm" in name and name.endswith(".weight"):
            x = 1 + rng.normal(0, 0.1, shape)
        elif std is not None:
            x = rng.normal(0, std, shape)
        elif name.endswith(".bias"):
            x = rng.normal(0, 0.1, shape)
        else:
            x = rng.normal(0, 1 / math.sqrt(math.prod(shape[1:])), shape)
        out[name] = x.astype(np.float32)
    return out


def build_tokenizer(folder: pathlib.Path):
    """A word-level tokenizer with T5's special tokens (pad 0, eos 1, unk
    2) that appends </s> as T5 does; AutoTokenizer loads it offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(
        special_tokens=["<pad>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return fast


def build_image_encoder(width: int, tokens: int):
    """A CLIPVisionModel of hidden size ``width`` whose hidden states hold
    ``tokens`` tokens per image (a square of patches and the class token),
    and the CLIPImageProcessor that feeds it (CLIP's defaults: bicubic
    resize of the shortest edge, centre crop, OpenAI's mean and std)."""
    import math

    from transformers import (CLIPImageProcessor, CLIPVisionConfig,
                              CLIPVisionModel)
    side = math.isqrt(tokens - 1)
    assert side * side == tokens - 1, f"{tokens} tokens: not n^2 + 1"
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=4, image_size=CLIP_SIZE,
        patch_size=CLIP_SIZE // side, projection_dim=width))
    processor = CLIPImageProcessor(
        size={"shortest_edge": CLIP_SIZE},
        crop_size={"height": CLIP_SIZE, "width": CLIP_SIZE})
    return encoder, processor


def build_pipeline(folder: pathlib.Path, weights_dir: pathlib.Path,
                   seed: int = 0, weights_dir_2: pathlib.Path = None,
                   boundary_ratio: float = None,
                   ti2v: bool = False) -> pathlib.Path:
    """Writes a WanPipeline folder (model_index.json, vae/, text_encoder/,
    tokenizer/, scheduler/, transformer/) at ``folder``; the transformer is
    the one in ``weights_dir`` (a megaslide save_weights folder). An
    image-conditioned transformer makes it a WanImageToVideoPipeline, with
    image_encoder/ and image_processor/ too. ``weights_dir_2`` and
    ``boundary_ratio``: Wan 2.2 A14B's second expert, transformer_2.
    ``ti2v``: Wan 2.2 TI2V-5B's layout, the Wan 2.2 VAE (48 latent
    channels, 4x16x16, patchified input) and expand_timesteps."""
    import json
    import shutil

    import torch
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler,
                           WanImageToVideoPipeline, WanPipeline,
                           WanTransformer3DModel)
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    if ti2v:
        vae = AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1],
            num_res_blocks=1, temperal_downsample=[False, True, True],
            is_residual=True, in_channels=12, out_channels=12, patch_size=2,
            scale_factor_temporal=4, scale_factor_spatial=16,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1],
                               num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    build_tokenizer(folder / "_tokenizer_src")
    tokenizer = AutoTokenizer.from_pretrained(folder / "_tokenizer_src")
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=64, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=3.0)
    transformer = WanTransformer3DModel.from_pretrained(weights_dir)
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                 scheduler=scheduler, transformer=transformer)
    if weights_dir_2 is not None:
        parts.update(transformer_2=WanTransformer3DModel.from_pretrained(
            weights_dir_2), boundary_ratio=boundary_ratio)
    config = transformer.config
    if ti2v:
        pipe = WanPipeline(**parts, expand_timesteps=True)
    elif config.image_dim is None:
        pipe = WanPipeline(**parts)
    else:
        images = 2 if config.pos_embed_seq_len is not None else 1
        saved = json.loads((pathlib.Path(weights_dir) /
                            "config.json").read_text())
        tokens = saved.get("image_len", images * IMAGE_TOKENS) // images
        encoder, processor = build_image_encoder(config.image_dim, tokens)
        pipe = WanImageToVideoPipeline(**parts, image_encoder=encoder,
                                       image_processor=processor)
    pipe.save_pretrained(folder)
    shutil.rmtree(folder / "_tokenizer_src")
    if config.image_dim is not None:
        # megaslide's config.json, which records image_len: the tiny
        # CLIP's tokens are not the default of Wan's (257).
        shutil.copyfile(pathlib.Path(weights_dir) / "config.json",
                        folder / "transformer" / "config.json")
    return folder


def moving_pattern(frames: int, height: int, width: int,
                   seed: int = 0) -> np.ndarray:
    """[F, H, W, 3] uint8: a bright square moving over a gradient, so
    consecutive frames differ and encoders see structure."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3)
    yy, xx = np.mgrid[0:height, 0:width]
    out = np.empty((frames, height, width, 3), np.uint8)
    side = max(2, min(height, width) // 4)
    for f in range(frames):
        img = np.stack([(xx * 255 // max(1, width - 1) + base[0]) % 256,
                        (yy * 255 // max(1, height - 1) + base[1]) % 256,
                        np.full_like(xx, (base[2] + 9 * f) % 256)], axis=-1)
        top = (3 * f) % max(1, height - side)
        left = (5 * f) % max(1, width - side)
        img[top:top + side, left:left + side] = 255
        out[f] = img
    return out


def write_video(path: pathlib.Path, frames: np.ndarray, fps: int = 16,
                codec: str = "") -> pathlib.Path:
    """Writes ``frames`` ([F, H, W, 3] uint8) with PyAV: mp4 as h264 (or
    mpeg4), webm as vp9 (or vp8), mov as mpeg4; lossless where the codec
    allows, so decoded pixels stay near the written ones."""
    import av

    suffix = path.suffix.lower()
    if not codec:
        codec = {".mp4": "libx264", ".webm": "libvpx-vp9",
                 ".mov": "mpeg4"}[suffix]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "preset": "ultrafast"}
        for image in frames:
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frames_folder(folder: pathlib.Path,
                        frames: np.ndarray) -> pathlib.Path:
    from PIL import Image

    folder.mkdir(parents=True)
    for i, image in enumerate(frames):
        Image.fromarray(image).save(folder / f"{i:04d}.png")
    return folder


def write_captions(pairs: Iterable[Sequence]) -> None:
    for path, caption in pairs:
        pathlib.Path(path).write_text(caption + "\n")
