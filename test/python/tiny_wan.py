"""A tiny diffusers Wan pipeline folder and synthetic videos, built offline
for the data tests (test_prepare.py): a randomly initialised
AutoencoderKLWan (z_dim 16, megaslide's tiny in_channels), a UMT5 encoder
with d_model 32 (tiny's text_dim), a word-level tokenizer trained here and
saved as a transformers fast tokenizer, UniPC as WanPipeline uses, and the
transformer that megaslide.Trainer("tiny").save_weights writes."""

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


def build_pipeline(folder: pathlib.Path, weights_dir: pathlib.Path,
                   seed: int = 0) -> pathlib.Path:
    """Writes a WanPipeline folder (model_index.json, vae/, text_encoder/,
    tokenizer/, scheduler/, transformer/) at ``folder``; the transformer is
    the one in ``weights_dir`` (a megaslide save_weights folder)."""
    import torch
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler,
                           WanPipeline, WanTransformer3DModel)
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
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
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder,
                       vae=vae, scheduler=scheduler, transformer=transformer)
    pipe.save_pretrained(folder)
    import shutil
    shutil.rmtree(folder / "_tokenizer_src")
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
