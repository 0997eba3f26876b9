"""megaslide-prepare: a folder of videos and captions -> sample files for
``megaslide-run --data`` (docs/Data.md "megaslide-prepare").

Each video (mp4/webm/mov, or a folder of frames) becomes one
``OUT/<name>.safetensors`` with ``latents`` [C, T, H, W], Wan's VAE latents
of its first F frames at the target fps (the posterior's mode, so the same
video always gives the same latents), normalised as Wan's pipeline
un-normalises them, and ``condition`` [L, D], the UMT5 embedding of its
caption encoded as ``WanPipeline`` encodes prompts. For an
image-conditioned transformer (Wan 2.1 I2V, FLF2V: its config sets
image_dim) it also holds ``image_embeds`` and ``image_condition``, what
``WanImageToVideoPipeline`` builds from the sample's first frame (and last,
FLF2V) by its own ``encode_image`` and ``prepare_latents``. torch,
diffusers, transformers and PyAV are imported only when a run needs them
(scripts/requirements-models.txt).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import os
import re
import stat
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._datafiles import (REQUIREMENTS, WAN21, Stride, UsageError, auto_buckets,
                         bucket_name, check_shape, choose_bucket,
                         heavy_imports, latent_shape, open_regular,
                         oserror_text, read_bucket_file,
                         read_safetensors_header, write_atomic,
                         write_json_atomic)

TOOL = "megaslide-prepare"
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
#: Bumped when the meaning of a sample's tensors changes, so older samples
#: are redone rather than mixed in.
PREPARE_VERSION = 1
#: Wan's text length (WanPipeline's max_sequence_length).
WAN_TEXT_LEN = 512


class SampleError(Exception):
    """A problem with one video: reported, and the others continue."""


class ImageConditioning:
    """An image-conditioned transformer's needs, from its config: the CLIP
    width ``image_dim``, ``images`` conditioning frames per sample (1: the
    first, I2V; 2: first and last, FLF2V, whose config sets
    pos_embed_seq_len), and the MegaSlide key ``image_len`` when the config
    records it. ``tokens`` (per image) is the image encoder's, filled by
    check_image_encoder."""

    def __init__(self, config: Dict[str, Any], path: str) -> None:
        self.path = path
        self.image_dim = config["image_dim"]
        self.pos_embed_seq_len = config.get("pos_embed_seq_len")
        self.images = 1 if self.pos_embed_seq_len is None else 2
        self.image_len = config.get("image_len")
        self.tokens = 0

    def frames(self) -> str:
        return "first frame" if self.images == 1 else \
            "first and last frame"


class Video:
    """One input: a video file or a folder of frames, and its caption."""

    def __init__(self, root: str, path: str) -> None:
        self.path = path
        self.source = os.path.relpath(path, root).replace(os.sep, "/")
        self.is_frames = os.path.isdir(path)
        self.name = ""
        self.caption: Optional[str] = None
        self.caption_problem = ""
        # Filled by probing: pixel size and frames available at the fps.
        self.width = 0
        self.height = 0
        self.available = 0

    def stamp(self) -> str:
        """Size and modification time: a changed input is prepared again."""
        if self.is_frames:
            files = frame_files(self.path)
            st = [os.stat(f) for f in files]
            return (f"{len(files)}:{sum(s.st_size for s in st)}:"
                    f"{max((s.st_mtime_ns for s in st), default=0)}")
        s = os.stat(self.path)
        return f"{s.st_size}:{s.st_mtime_ns}"


def frame_files(folder: str) -> List[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.lower().endswith(IMAGE_EXTENSIONS)
                  and not f.startswith("."))


def is_frames_folder(folder: str) -> bool:
    """A folder whose (non-hidden) entries are all image files."""
    entries = [e for e in os.listdir(folder) if not e.startswith(".")]
    return bool(entries) and all(
        e.lower().endswith(IMAGE_EXTENSIONS) and
        os.path.isfile(os.path.join(folder, e)) for e in entries)


def stray_files(folder: str) -> List[str]:
    """The entries that keep a folder of images and nothing to walk into
    (no video, no subfolder) from being a frames folder, e.g. notes.txt;
    [] for any other folder."""
    entries = sorted(e for e in os.listdir(folder) if not e.startswith("."))
    images = [e for e in entries if e.lower().endswith(IMAGE_EXTENSIONS)
              and os.path.isfile(os.path.join(folder, e))]
    others = [e for e in entries if e not in images]
    if not images or any(e.lower().endswith(VIDEO_EXTENSIONS) or
                         os.path.isdir(os.path.join(folder, e))
                         for e in others):
        return []
    return others


def discover(root: str, out: str,
             skipped: Optional[List[Tuple[str, str]]] = None) -> List[Video]:
    """Videos and frame folders under ``root`` (recursively), in path
    order; the output folder is skipped when it lies inside. What looks
    like an input but is not read is added to ``skipped`` ((source, why)
    each): a video name that is not a regular file (a FIFO would block the
    decoder for ever), a folder of images with stray files."""
    found = []
    skipped = [] if skipped is None else skipped
    out_real = os.path.realpath(out)

    def rel(path: str) -> str:
        return os.path.relpath(path, root).replace(os.sep, "/")
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        keep = []
        for d in dirs:
            full = os.path.join(folder, d)
            if d.startswith(".") or os.path.realpath(full) == out_real:
                continue
            if is_frames_folder(full):
                found.append(Video(root, full))
                continue
            stray = stray_files(full)
            if stray:
                skipped.append((rel(full), (
                    f"holds images and other files ({', '.join(stray[:3])}"
                    f"{', ...' if len(stray) > 3 else ''}); a frames folder "
                    f"holds only images: move them out")))
            else:
                keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            if f.lower().endswith(VIDEO_EXTENSIONS) and not f.startswith("."):
                full = os.path.join(folder, f)
                # isfile follows links: a link to a video is read.
                if os.path.isfile(full):
                    found.append(Video(root, full))
                else:
                    skipped.append((rel(full), "not a regular file (a FIFO, "
                                    "device or broken link); not read"))
    found.sort(key=lambda v: v.source)
    skipped.sort()
    return found


def assign_names(videos: List[Video]) -> None:
    """File names from the relative paths: folders joined by '__', other
    characters than [A-Za-z0-9._-] as '_'; names that would collide (a.mp4
    and a.webm, or two spellings that sanitise alike) get a hash of their
    path, so every name is unique and stable."""
    def base(v: Video) -> str:
        stem = v.source if v.is_frames else os.path.splitext(v.source)[0]
        return re.sub(r"[^A-Za-z0-9._-]", "_", stem.replace("/", "__"))
    counts: Dict[str, int] = {}
    for v in videos:
        counts[base(v)] = counts.get(base(v), 0) + 1
    for v in videos:
        name = base(v)
        if counts[name] > 1:
            name += "-" + hashlib.sha256(v.source.encode()).hexdigest()[:8]
        v.name = name


def read_manifest(path: str, root: str) -> Dict[str, str]:
    """{source: caption} from a CSV (columns video,caption) or JSONL
    ({"video", "caption"} a line) manifest; paths relative to ``root``."""
    captions: Dict[str, str] = {}
    try:
        # utf-8-sig: a byte order mark (as spreadsheets write CSV) is not
        # part of the first column's name.
        with io.TextIOWrapper(open_regular(path), encoding="utf-8-sig",
                              newline="") as f:
            if path.lower().endswith((".jsonl", ".json")):
                rows = []
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError as e:
                        raise UsageError(f"manifest '{path}': line {n}: "
                                         f"invalid JSON: {e}") from e
                    rows.append((n, row))
            else:
                reader = csv.DictReader(f)
                if not reader.fieldnames or not {"video", "caption"} <= set(
                        reader.fieldnames):
                    raise UsageError(f"manifest '{path}': needs the columns "
                                     f"video,caption (a header line), got "
                                     f"{reader.fieldnames}")
                rows = [(n + 2, row) for n, row in enumerate(reader)]
    except OSError as e:
        raise UsageError(f"cannot read manifest '{path}': "
                         f"{oserror_text(e)}") from e
    except UnicodeDecodeError as e:
        raise UsageError(f"manifest '{path}' is not UTF-8 text (byte "
                         f"{e.start}: {e.reason}); save it as UTF-8") from e
    except csv.Error as e:
        raise UsageError(f"manifest '{path}': not CSV: {e}") from e
    for n, row in rows:
        if (not isinstance(row, dict) or not isinstance(row.get("video"), str)
                or not isinstance(row.get("caption"), str)):
            raise UsageError(f"manifest '{path}': line {n}: expected a video "
                             f"path and a caption (strings)")
        source = os.path.normpath(row["video"]).replace(os.sep, "/")
        # Names read from a file stay inside the folder they name.
        if os.path.isabs(row["video"]) or source == ".." or \
                source.startswith("../"):
            raise UsageError(f"manifest '{path}': line {n}: "
                             f"'{row['video']}' is not inside the input "
                             f"folder; give paths relative to it")
        if source in captions:
            raise UsageError(f"manifest '{path}': line {n}: '{source}' is "
                             f"listed twice")
        captions[source] = row["caption"]
    return captions


def attach_captions(videos: List[Video], root: str,
                    manifest: Optional[str]) -> List[str]:
    """Sets each video's caption; returns the manifest's entries that name
    no video found (each a failure)."""
    if manifest is not None:
        captions = read_manifest(manifest, root)
        by_source = {v.source: v for v in videos}
        for v in videos:
            if v.source in captions:
                v.caption = captions[v.source].lstrip("\ufeff")
            else:
                v.caption_problem = (f"no caption: '{v.source}' is not in "
                                     f"the manifest '{manifest}'; add a line "
                                     f"for it")
        return [s for s in captions if s not in by_source]
    for v in videos:
        txt = (v.path if v.is_frames else os.path.splitext(v.path)[0]) + ".txt"
        try:
            # utf-8-sig: a byte order mark (Notepad writes one) is no
            # part of the caption (it tokenised as a word).
            with open_regular(txt) as f:
                v.caption = f.read().decode("utf-8-sig").strip()
        except FileNotFoundError:
            v.caption_problem = (f"no caption: write it to "
                                 f"'{os.path.relpath(txt, root)}' or give "
                                 f"--manifest")
        except OSError as e:
            v.caption_problem = (f"cannot read caption '{txt}': "
                                 f"{oserror_text(e)}")
        except UnicodeDecodeError as e:
            v.caption_problem = f"cannot read caption '{txt}': {e}"
    return []


def transformer_config(args) -> Dict[str, Any]:
    """``--pipeline``'s transformer/config.json, {} when there is none (or
    it is unreadable: the transformer is not prepare's to load)."""
    if args.pipeline is None:
        return {}
    path = os.path.join(args.pipeline, "transformer", "config.json")
    try:
        with open_regular(path) as f:
            value = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def pipeline_stride(args, dirs: Dict[str, str]) -> Stride:
    """The VAE's stride (its config's scale factors, as the pipelines read
    them, AutoencoderKLWan's defaults where absent: Wan 2.1's 4 and 8; Wan
    2.2's TI2V VAE has 16) and the transformer's spatial patch."""
    try:
        with open_regular(os.path.join(dirs["vae"], "config.json")) as f:
            vae = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read '{dirs['vae']}/config.json': "
                         f"{e}") from e
    patch = transformer_config(args).get("patch_size", [1, 2, 2])
    return Stride(vae.get("scale_factor_temporal") or WAN21.temporal,
                  vae.get("scale_factor_spatial") or WAN21.spatial,
                  patch[1] if isinstance(patch, list) else patch)


def image_conditioning(args) -> Optional[ImageConditioning]:
    """The pipeline transformer's image conditioning, None for a
    text-to-video one (diffusers writes image_dim null there)."""
    config = transformer_config(args)
    if config.get("image_dim") is None:
        return None
    return ImageConditioning(config, os.path.join(
        args.pipeline, "transformer", "config.json"))


def resolve_models(args, image: Optional[ImageConditioning] = None
                   ) -> Dict[str, str]:
    """The VAE, text encoder and tokenizer folders (and, for an
    image-conditioned transformer, the pipeline's image encoder and image
    processor), checked before any video is read; UsageError naming the
    folder and the flag that fixes it."""
    dirs: Dict[str, str] = {}
    if args.pipeline is not None:
        index = os.path.join(args.pipeline, "model_index.json")
        if not os.path.isfile(index):
            raise UsageError(f"--pipeline '{args.pipeline}' is not a "
                             f"diffusers pipeline folder (no model_index."
                             f"json); give the folder of a Wan pipeline, or "
                             f"--vae, --text-encoder and --tokenizer")
    for key, flag, marker in (("vae", "--vae", "config.json"),
                              ("text_encoder", "--text-encoder",
                               "config.json"),
                              ("tokenizer", "--tokenizer", None)):
        given = getattr(args, key)
        if given is None and args.pipeline is not None:
            path = os.path.join(args.pipeline, key)
            where = f"the pipeline folder '{args.pipeline}' has no {key}/"
        elif given is None:
            raise UsageError(f"no {key}: give --pipeline DIR (a diffusers Wan "
                             f"pipeline folder) or {flag} DIR")
        else:
            path = given
            where = f"{flag} '{given}' is not a folder"
        ok = os.path.isdir(path) and (
            marker is None or os.path.isfile(os.path.join(path, marker)))
        if not ok:
            if os.path.isdir(path) and marker is not None:
                where = f"'{path}' has no {marker}"
            raise UsageError(f"{where}; give {flag} DIR (a diffusers/"
                             f"transformers {key} folder)")
        dirs[key] = os.path.abspath(path)
    if image is not None:
        for key, marker in (("image_encoder", "config.json"),
                            ("image_processor", "preprocessor_config.json")):
            path = os.path.join(args.pipeline, key)
            if not os.path.isfile(os.path.join(path, marker)):
                raise UsageError(
                    f"the pipeline folder '{args.pipeline}' has no {key}/ "
                    f"(with {marker}), but its transformer is "
                    f"image-conditioned (image_dim {image.image_dim} in "
                    f"'{image.path}'): each sample needs the CLIP "
                    f"embedding of its {image.frames()}; give the "
                    f"WanImageToVideoPipeline folder the model comes from")
            dirs[key] = os.path.abspath(path)
    return dirs


def check_image_encoder(dirs: Dict[str, str],
                        image: ImageConditioning) -> None:
    """The image encoder's width against the transformer's image_dim, and
    its tokens per image against what the transformer takes (FLF2V's
    pos_embed_seq_len, MegaSlide's image_len): read from the configs, before
    any model loads. Sets ``image.tokens``."""
    from transformers import CLIPVisionConfig

    folder = dirs["image_encoder"]
    try:
        config = CLIPVisionConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the image encoder's config in "
                         f"'{folder}': {e}") from e
    image.tokens = (config.image_size // config.patch_size) ** 2 + 1
    problems = []
    if config.hidden_size != image.image_dim:
        problems.append(f"its hidden_size {config.hidden_size} is not the "
                        f"transformer's image_dim {image.image_dim}")
    total = image.tokens * image.images
    for key, value in (("pos_embed_seq_len", image.pos_embed_seq_len),
                       ("image_len", image.image_len)):
        if value is not None and value != total:
            problems.append(f"its {image.tokens} tokens per image x "
                            f"{image.images} ({image.frames()}) = {total} "
                            f"differ from the transformer's {key} {value}")
    if problems:
        raise UsageError(f"the image encoder '{folder}' does not fit the "
                         f"transformer ('{image.path}'): "
                         f"{'; '.join(problems)}")


def model_text_len(args) -> Optional[int]:
    """The transformer's text length when its config records one (MegaSlide
    configs do as text_len; diffusers' Wan configs do not)."""
    value = transformer_config(args).get("text_len")
    return value if isinstance(value, int) else None


def config_digest(folder: str) -> str:
    """sha256 of a model folder's config files and of its other files'
    names, sizes and modification times: a model swapped for another, or
    its weights replaced, changes the settings recorded in every sample
    (without reading gigabytes of weights to notice)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
        elif os.path.isfile(path):
            st = os.stat(path)
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def sample_seed_fraction(seed: int, name: str) -> float:
    """A uniform draw in [0, 1) fixed by the seed and the sample's name (not
    its position, so adding videos changes no other sample's draw)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64


# --- video decoding --------------------------------------------------------

def _decode(path: str, fps: float, want: int, keep: bool):
    """The first ``want`` frames of a video file at ``fps``: each target
    time i/fps takes the frame shown then (the last one whose timestamp is
    at or before it). Returns (width, height, frames available up to want,
    the frames as HxWx3 uint8 arrays if ``keep``)."""
    import av

    picked: List[Any] = []
    count = 0
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise SampleError("has no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or fps)
            width = stream.codec_context.width
            height = stream.codec_context.height
            start = None
            previous = None
            last_time = 0.0
            index = 0
            for frame in container.decode(stream):
                t = frame.time if frame.time is not None else index / rate
                index += 1
                if start is None:
                    start = t
                t -= start
                # The previous frame is shown until this one's time.
                while previous is not None and count < want and \
                        count / fps < t - 1e-9:
                    if keep:
                        picked.append(previous)
                    count += 1
                if count >= want:
                    break
                previous = frame.to_ndarray(format="rgb24") if keep else True
                width, height = frame.width, frame.height
                last_time = t
            else:
                # The last frame is shown for one frame period.
                while previous is not None and count < want and \
                        count / fps < last_time + 1.0 / rate - 1e-9:
                    if keep:
                        picked.append(previous)
                    count += 1
    except SampleError:
        raise
    except Exception as e:  # PyAV raises its own error classes
        raise SampleError(f"cannot decode ({type(e).__name__}: {e})") from e
    if index == 0:
        raise SampleError("has no decodable frame")
    return width, height, count, picked


def _read_frames_folder(folder: str, want: int, keep: bool):
    """A folder of frames: its images in name order, taken to be at the
    target fps already."""
    from PIL import Image

    files = frame_files(folder)
    picked = []
    try:
        with Image.open(files[0]) as im:
            width, height = im.size
        if keep:
            import numpy as np
            for f in files[:want]:
                with Image.open(f) as im:
                    if im.size != (width, height):
                        raise SampleError(
                            f"frame '{os.path.basename(f)}' is {im.size[0]}x"
                            f"{im.size[1]}, the first is {width}x{height}")
                    picked.append(np.asarray(im.convert("RGB")))
    except SampleError:
        raise
    except Exception as e:
        raise SampleError(f"cannot read frames ({type(e).__name__}: "
                          f"{e})") from e
    return width, height, min(len(files), want), picked


def probe(video: Video, fps: float, want: int) -> None:
    """Size and frames available (up to ``want``) without keeping pixels."""
    read = _read_frames_folder if video.is_frames else \
        lambda p, w, k: _decode(p, fps, w, k)
    video.width, video.height, video.available, _ = read(video.path, want,
                                                         False)


def load_pixels(path: str, frames: int, height: int, width: int,
                fps: float = 16.0):
    """The first ``frames`` frames of a video file or frames folder at
    ``fps``, resized (bilinear, antialiased) so they cover height x width,
    centre-cropped, as a float32 tensor [1, 3, F, H, W] in [-1, 1]."""
    import numpy as np
    import torch

    if os.path.isdir(path):
        _, _, count, picked = _read_frames_folder(path, frames, True)
    else:
        _, _, count, picked = _decode(path, fps, frames, True)
    if count < frames:
        raise SampleError(f"has {count} frames at {fps:g} fps, needs "
                          f"{frames}")
    x = torch.from_numpy(np.stack(picked)).permute(0, 3, 1, 2).float()
    h, w = x.shape[-2:]
    scale = max(height / h, width / w)
    rh = max(height, int(round(h * scale)))
    rw = max(width, int(round(w * scale)))
    if (rh, rw) != (h, w):
        x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bilinear",
                                            align_corners=False,
                                            antialias=True)
    top = (rh - height) // 2
    left = (rw - width) // 2
    x = x[:, :, top:top + height, left:left + width]
    x = (x / 127.5 - 1.0).clamp(-1.0, 1.0)
    return x.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


# --- models ----------------------------------------------------------------

class Models:
    """The Wan VAE and text encoder (and for an image-conditioned model the
    CLIP image encoder and its processor), in f32 on one device."""

    def __init__(self, dirs: Dict[str, str], device: str,
                 progress: bool = True,
                 image: Optional[ImageConditioning] = None,
                 stride: Stride = WAN21) -> None:
        """``stride``: the VAE's, as pipeline_stride read it."""
        import diffusers
        import torch
        import transformers
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        if not progress:
            # Their loading bars would break --no-progress's quiet output.
            diffusers.utils.logging.disable_progress_bar()
            transformers.utils.logging.disable_progress_bar()

        self.torch = torch
        self.device = torch.device(device)
        self.vae = AutoencoderKLWan.from_pretrained(
            dirs["vae"], torch_dtype=torch.float32).to(self.device).eval()
        self.text_encoder = UMT5EncoderModel.from_pretrained(
            dirs["text_encoder"], torch_dtype=torch.float32).to(
                self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(dirs["tokenizer"])
        cfg = self.vae.config
        self.channels = cfg.z_dim
        self.stride = stride
        shape = (1, cfg.z_dim, 1, 1, 1)
        self.mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(
            shape).to(self.device)
        self.std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(
            shape).to(self.device)
        self.text_dim = self.text_encoder.config.d_model
        self.image = image
        if image is not None:
            from diffusers import WanImageToVideoPipeline
            from transformers import CLIPImageProcessor, CLIPVisionModel

            # The pipeline itself, without scheduler or transformer: its
            # encode_image and prepare_latents are the definitions.
            self.pipe = WanImageToVideoPipeline(
                tokenizer=self.tokenizer, text_encoder=self.text_encoder,
                vae=self.vae, scheduler=None,
                image_processor=CLIPImageProcessor.from_pretrained(
                    dirs["image_processor"]),
                image_encoder=CLIPVisionModel.from_pretrained(
                    dirs["image_encoder"], torch_dtype=torch.float32).to(
                        self.device).eval())

    def encode_video(self, pixels):
        """Normalised latents [C, T, H, W] of pixels [1, 3, F, H, W]: the
        posterior's mode, (z - latents_mean) / latents_std, the inverse of
        WanPipeline's ``latents / (1 / std) + mean`` before decoding."""
        with self.torch.no_grad():
            z = self.vae.encode(pixels.to(self.device)).latent_dist.mode()
            return ((z - self.mean) / self.std)[0]

    def encode_images(self, pixels):
        """``image_embeds`` [images x tokens, D] and ``image_condition``
        [vae_stride[0] + C, T, H, W] of pixels [1, 3, F, H, W], as
        WanImageToVideoPipeline.__call__ builds them from ``image`` (and
        ``last_image``, FLF2V) at F x H x W: the conditioning frames are
        the sample's first (and last) frame as 8-bit RGB images, what a
        user passes; encode_image gives their CLIP hidden_states[-2] (FLF2V:
        [2, tokens, D], which the transformer reads as one row of 2 x
        tokens), and prepare_latents the mask and the normalised latents of
        the video holding them, zeros elsewhere."""
        import PIL.Image

        torch = self.torch
        _, _, frames, height, width = pixels.shape
        picks = [0] if self.image.images == 1 else [0, frames - 1]
        images = [PIL.Image.fromarray(
            ((pixels[0, :, i] + 1) * 127.5).round().clamp(0, 255).to(
                torch.uint8).permute(1, 2, 0).numpy()) for i in picks]
        pipe = self.pipe
        with torch.no_grad():
            embeds = pipe.encode_image(
                images[0] if len(images) == 1 else images, self.device)
            conditioning = [pipe.video_processor.preprocess(
                im, height=height, width=width).to(self.device,
                                                   torch.float32)
                for im in images]
            lat = latent_shape(frames, height, width, self.channels,
                               self.stride)
            _, condition = pipe.prepare_latents(
                conditioning[0], 1, self.channels, height, width, frames,
                torch.float32, self.device, None,
                torch.zeros([1] + lat, device=self.device),
                conditioning[1] if len(images) == 2 else None)
        return embeds.reshape(-1, embeds.shape[-1]), condition[0]

    def encode_text(self, caption: str, text_len: int):
        """Condition [L, D] and the true token count, as WanPipeline's
        _get_t5_prompt_embeds: prompt_clean, padding to max_length with
        truncation, the attention mask, last_hidden_state, rows after the
        true length zeroed."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        inputs = self.tokenizer([prompt_clean(caption)], padding="max_length",
                                max_length=text_len, truncation=True,
                                add_special_tokens=True,
                                return_attention_mask=True,
                                return_tensors="pt")
        ids, mask = inputs.input_ids, inputs.attention_mask
        length = int(mask.gt(0).sum(dim=1)[0])
        with self.torch.no_grad():
            hidden = self.text_encoder(ids.to(self.device),
                                       mask.to(self.device)).last_hidden_state
        condition = hidden[0].clone()
        condition[length:] = 0
        return condition, length


# --- the run ---------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]):
    p = argparse.ArgumentParser(
        prog=TOOL,
        description="Encode a folder of videos and captions into sample "
                    "files for megaslide-run --data (docs/Data.md).")
    p.add_argument("input", help="folder of videos (mp4/webm/mov, "
                   "recursively) and folders of frames")
    p.add_argument("-o", "--output", required=True,
                   help="output folder of <name>.safetensors samples")
    p.add_argument("--manifest", help="CSV (video,caption) or JSONL "
                   "({\"video\", \"caption\"}) of captions, paths relative "
                   "to the input folder; default: <video stem>.txt beside "
                   "each video")
    p.add_argument("--pipeline", help="a diffusers Wan pipeline folder "
                   "(model_index.json, vae/, text_encoder/, tokenizer/; "
                   "for an image-conditioned transformer also "
                   "image_encoder/ and image_processor/)")
    p.add_argument("--vae", help="AutoencoderKLWan folder (overrides "
                   "--pipeline's)")
    p.add_argument("--text-encoder", dest="text_encoder",
                   help="UMT5EncoderModel folder (overrides --pipeline's)")
    p.add_argument("--tokenizer", help="tokenizer folder (overrides "
                   "--pipeline's)")
    p.add_argument("--frames", type=int, default=17,
                   help="frames per sample, 4k+1 (default 17)")
    p.add_argument("--height", type=int, default=128,
                   help="pixel height, a multiple of the VAE stride x the "
                   "patch: 16 with Wan 2.1's VAE, 32 with Wan 2.2's "
                   "(default 128)")
    p.add_argument("--width", type=int, default=128,
                   help="pixel width, as --height (default 128)")
    p.add_argument("--fps", type=float, default=16.0,
                   help="frames are sampled at this rate (default 16, Wan's)")
    p.add_argument("--text-len", dest="text_len", type=int,
                   help="text tokens per caption; default: the "
                   "transformer config's text_len, else 512 (Wan's)")
    p.add_argument("--caption-dropout", dest="caption_dropout", type=float,
                   default=0.0, help="probability that a sample's caption "
                   "is replaced by \"\" (classifier-free guidance)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the caption dropout draws (default 0)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--buckets", help="bucket file ({\"buckets\": "
                       "[{\"frames\", \"height\", \"width\"}, ...]})")
    group.add_argument("--auto-buckets", dest="auto_buckets", type=int,
                       help="choose at most N buckets from the data")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                   help="stored dtype of latents and condition (default f32)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   default="auto", help="auto: cuda when available")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    return p.parse_args(argv)


def check_args(args) -> None:
    if not os.path.isdir(args.input):
        raise UsageError(f"input '{args.input}' is not a folder")
    if not args.fps > 0 or not math.isfinite(args.fps):
        raise UsageError(f"--fps must be a positive number, got {args.fps}")
    if not 0.0 <= args.caption_dropout <= 1.0:
        raise UsageError(f"--caption-dropout must lie in [0, 1], got "
                         f"{args.caption_dropout}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    if args.auto_buckets is not None and args.auto_buckets < 1:
        raise UsageError(f"--auto-buckets must be at least 1, got "
                         f"{args.auto_buckets}")
    if args.text_len is not None and args.text_len < 1:
        raise UsageError(f"--text-len must be positive, got {args.text_len}")
    if args.manifest is not None and not os.path.isfile(args.manifest):
        raise UsageError(f"manifest '{args.manifest}' is not a file")


def check_writable(out: str) -> None:
    """Creates the output folder and proves it takes a file, and that the
    files written at the end can replace what has their names, before any
    model loads."""
    for name in ("buckets.json", "prepare.json"):
        path = os.path.join(out, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise UsageError(f"cannot check '{path}': {oserror_text(e)}; give "
                             f"another -o") from e
        # rename() replaces a file or a link, not a folder (a FIFO read
        # as the old state would block).
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise UsageError(f"'{path}' is not a regular file; it is written "
                             f"at the end of the run: remove it or give "
                             f"another -o")
    try:
        os.makedirs(out, exist_ok=True)
        write_atomic(os.path.join(out, ".megaslide-write-check"), b"")
        os.unlink(os.path.join(out, ".megaslide-write-check"))
    except OSError as e:
        raise UsageError(f"cannot write to output folder '{out}': "
                         f"{e.strerror or e}; give a writable -o") from e


def run(args) -> int:
    check_args(args)
    out = args.output
    skipped_inputs: List[Tuple[str, str]] = []
    videos = discover(args.input, out, skipped_inputs)
    if not videos:
        raise UsageError(f"no videos (mp4/webm/mov) or frame folders under "
                         f"'{args.input}'")
    assign_names(videos)
    missing_sources = attach_captions(videos, args.input, args.manifest)
    image = image_conditioning(args)
    dirs = resolve_models(args, image)
    stride = pipeline_stride(args, dirs)
    check_shape("--frames/--height/--width", args.frames, args.height,
                args.width, stride)
    text_len = args.text_len
    model_len = model_text_len(args)
    if text_len is None:
        text_len = model_len if model_len is not None else WAN_TEXT_LEN
    elif model_len is not None and model_len != text_len:
        raise UsageError(f"--text-len {text_len} differs from the "
                         f"transformer's text_len {model_len} "
                         f"('{args.pipeline}/transformer/config.json'); "
                         f"omit --text-len or give {model_len}")
    if args.buckets is not None:
        buckets = read_bucket_file(args.buckets, stride)
    else:
        buckets = None
    # Checked before any model loads: torch and friends, and the output.
    heavy_imports(TOOL)
    try:
        import av  # noqa: F401
    except ImportError as e:
        raise UsageError(f"{TOOL} needs PyAV to decode videos; install it "
                         f"with `pip install -r {REQUIREMENTS}`") from e
    import torch
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device; use "
                         "--device cpu or auto")
    if image is not None:
        check_image_encoder(dirs, image)
    check_writable(out)

    failures: List[Tuple[str, str]] = [
        (s, "listed in the manifest but not found under the input folder")
        for s in missing_sources]
    state_path = os.path.join(out, "prepare.json")
    try:
        with open_regular(state_path) as f:
            state = json.loads(f.read().decode("utf-8"))
        probes = state.get("probes", {}) if isinstance(state, dict) else {}
    except (OSError, ValueError):
        probes = {}

    # Probe pass: size and frames available, cached by the input's stamp.
    want = args.frames if buckets is None else max(b["frames"]
                                                   for b in buckets)
    usable: List[Video] = []
    new_probes: Dict[str, Any] = {}
    from tqdm.auto import tqdm
    for v in tqdm(videos, desc="probing", unit="video", leave=False,
                  disable=not args.progress, file=sys.stderr):
        if v.caption is None:
            failures.append((v.source, v.caption_problem))
            continue
        try:
            stamp = v.stamp()
            cached = probes.get(v.source)
            key = [stamp, args.fps]
            if (isinstance(cached, dict) and cached.get("key") == key and
                    all(isinstance(cached.get(k), int) for k in (
                        "width", "height", "available", "want")) and
                    (cached["available"] < cached["want"] or
                     cached["want"] >= want)):
                v.width, v.height = cached["width"], cached["height"]
                v.available = min(cached["available"], want)
            else:
                probe(v, args.fps, want)
            new_probes[v.source] = {"key": key, "width": v.width,
                                    "height": v.height,
                                    "available": v.available, "want": want}
        except (SampleError, OSError) as e:
            failures.append((v.source, str(e)))
            continue
        usable.append(v)

    if buckets is None:
        if args.auto_buckets is not None:
            buckets = auto_buckets([(v.width, v.height, v.available)
                                    for v in usable], args.auto_buckets,
                                   args.frames, args.height, args.width,
                                   stride)
            if not buckets:
                buckets = [{"frames": args.frames, "height": args.height,
                            "width": args.width}]
        else:
            buckets = [{"frames": args.frames, "height": args.height,
                        "width": args.width}]
    shortest = min(b["frames"] for b in buckets)

    settings = {
        "version": PREPARE_VERSION,
        "vae": dirs["vae"], "vae_config": config_digest(dirs["vae"]),
        "text_encoder": dirs["text_encoder"],
        "text_encoder_config": config_digest(dirs["text_encoder"]),
        "tokenizer": dirs["tokenizer"],
        "fps": args.fps, "text_len": text_len, "dtype": args.dtype,
        "caption_dropout": args.caption_dropout, "seed": args.seed,
        "latents": "posterior mode, (z - latents_mean) / latents_std",
        "resize": "cover, bilinear antialiased, centre crop",
    }
    if image is not None:
        settings.update({
            "image_encoder": dirs["image_encoder"],
            "image_encoder_config": config_digest(dirs["image_encoder"]),
            "image_processor": dirs["image_processor"],
            "image_processor_config": config_digest(
                dirs["image_processor"]),
            "image_condition": f"WanImageToVideoPipeline, the "
                               f"{image.frames()} as 8-bit RGB"})
    settings_text = json.dumps(settings, sort_keys=True)

    plan = []  # (video, bucket, caption used, dropped)
    for v in usable:
        bucket = choose_bucket(buckets, v.width, v.height, v.available)
        if bucket is None:
            need = shortest
            failures.append((v.source, (
                f"too short: {v.available} frames at {args.fps:g} fps "
                f"({v.available / args.fps:.2f} s), needs {need} "
                f"({need / args.fps:.2f} s) for the shortest bucket")))
            continue
        dropped = sample_seed_fraction(args.seed, v.name) < \
            args.caption_dropout
        plan.append((v, bucket, "" if dropped else v.caption, dropped))

    # Resume: a sample already written with these settings is kept.
    models: Optional[Models] = None
    todo = []
    skipped = 0
    redone: List[Tuple[str, str]] = []
    for v, bucket, caption, dropped in plan:
        path = os.path.join(out, v.name + ".safetensors")
        meta = sample_metadata(v, bucket, caption, dropped, settings_text)
        # The text length is known only after tokenising: verify_sample
        # checks that it is a count within the condition's rows.
        expected = {k: meta[k] for k in meta if k != "megaslide.text_length"}
        why = verify_sample(path, expected, bucket, text_len, stride,
                            args.dtype,
                            image)
        if not why:
            skipped += 1
            continue
        if why != "missing":
            redone.append((v.source, why))
        todo.append((v, bucket, caption, dropped, path, meta))

    for source, why in redone:
        print(f"{TOOL}: {source}: redoing the sample: {why}", file=sys.stderr)
    # megaslide-run trains on every sample in the folder: say which ones
    # this run did not make (an earlier run's, of videos gone or failing).
    names = {v.name + ".safetensors" for v, *_ in plan}
    stale = sorted(f for f in os.listdir(out) if f.endswith(".safetensors")
                   and f not in names)
    if stale:
        print(f"{TOOL}: warning: '{out}' holds {len(stale)} sample(s) that "
              f"no video of this run made ({', '.join(stale[:5])}"
              f"{', ...' if len(stale) > 5 else ''}); megaslide-run --data "
              f"would train on them: remove them or give a new -o",
              file=sys.stderr)

    prepared = 0
    if todo:
        models = Models(dirs, device, args.progress, image, stride)
        from safetensors.torch import save

        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        bar = tqdm(todo, desc=TOOL, unit="video", disable=not args.progress,
                   file=sys.stderr)
        for v, bucket, caption, dropped, path, meta in bar:
            try:
                pixels = load_pixels(v.path, bucket["frames"],
                                     bucket["height"], bucket["width"],
                                     args.fps)
                latents = models.encode_video(pixels)
                condition, length = models.encode_text(caption, text_len)
                extra = {}
                if image is not None:
                    extra["image_embeds"], extra["image_condition"] = \
                        models.encode_images(pixels)
            except SampleError as e:
                failures.append((v.source, str(e)))
                continue
            except Exception as e:  # a model error on one video (memory)
                failures.append((v.source, f"cannot encode "
                                 f"({type(e).__name__}: {e})"))
                continue
            meta["megaslide.text_length"] = str(length)
            tensors = {name: t.to(dtype).cpu().contiguous() for name, t in
                       dict(latents=latents, condition=condition,
                            **extra).items()}
            try:
                # Through write_atomic: fsynced, renamed into place, and no
                # temporary file left by a failure or Ctrl-C.
                write_atomic(path, save(tensors, metadata=meta))
            except OSError as e:
                failures.append((v.source, f"cannot write '{path}': {e}"))
                continue
            prepared += 1

    counts: Dict[str, int] = {}
    failed = {source for source, _ in failures}
    for v, bucket, *_ in plan:
        if v.source not in failed:
            name = bucket_name(bucket["frames"], bucket["height"],
                               bucket["width"])
            counts[name] = counts.get(name, 0) + 1
    write_json_atomic(os.path.join(out, "buckets.json"), {"buckets": [
        dict(b, samples=counts.get(bucket_name(b["frames"], b["height"],
                                               b["width"]), 0))
        for b in buckets]})
    write_json_atomic(state_path, {
        "settings": settings,
        "samples": {v.source: v.name for v, *_ in plan},
        "probes": new_probes,
    })

    print(f"{TOOL}: {prepared} prepared, {skipped} skipped (already "
          f"written), {len(failures)} failed; output in '{out}'")
    for source, why in failures:
        print(f"  failed: {source}: {why}")
    for source, why in skipped_inputs:
        kind = "folder" if os.path.isdir(os.path.join(args.input, source)) \
            else "file"
        print(f"  skipped {kind}: {source}: {why}")
    # An empty caption is how a sample is made unconditional: one that is
    # blank by accident would silently be one.
    for v, _, caption, dropped in plan:
        if not dropped and not caption.strip() and v.source not in failed:
            print(f"  blank caption: {v.source} (trained as unconditional; "
                  f"write a caption, or leave it blank on purpose)")
    return 1 if failures else 0


def sample_metadata(v: Video, bucket: Dict[str, int], caption: str,
                    dropped: bool, settings_text: str) -> Dict[str, str]:
    return {
        "megaslide.format": "1",
        "megaslide.bucket": bucket_name(bucket["frames"], bucket["height"],
                                        bucket["width"]),
        "megaslide.text_length": "",
        "megaslide.caption": caption,
        "megaslide.source": v.source,
        "megaslide.caption_dropped": "1" if dropped else "0",
        "megaslide.source_stamp": v.stamp(),
        "megaslide.prepare": settings_text,
    }


def verify_sample(path: str, expected: Dict[str, str],
                  bucket: Dict[str, int], text_len: int, stride: Stride,
                  dtype: str,
                  image: Optional[ImageConditioning] = None) -> str:
    """'' if the sample at ``path`` is complete and was made with these
    settings at ``bucket``'s shapes, else why it must be redone. The
    channel counts come from the file (the VAE's z_dim and UMT5's d_model
    are checked through the models' config digests in the settings); an
    image-conditioned model's samples hold image_embeds and
    image_condition too."""
    if not os.path.exists(path):
        return "missing"
    try:
        tensors, metadata = read_safetensors_header(path)
    except (OSError, ValueError) as e:
        return f"unreadable ({e})"
    try:
        channels = tensors["latents"]["shape"][0]
        dim = tensors["condition"]["shape"][1]
    except (KeyError, IndexError):
        return "has no latents [C, T, H, W] and condition [L, D]"
    shapes = {"latents": latent_shape(bucket["frames"], bucket["height"],
                                      bucket["width"], channels, stride),
              "condition": [text_len, dim]}
    if image is not None:
        shapes["image_embeds"] = [image.tokens * image.images,
                                  image.image_dim]
        shapes["image_condition"] = latent_shape(
            bucket["frames"], bucket["height"], bucket["width"],
            stride.temporal + channels, stride)
    stored = {"f32": "F32", "bf16": "BF16"}[dtype]
    for name, shape in shapes.items():
        if name not in tensors:
            return f"has no '{name}'"
        info = tensors[name]
        if info["shape"] != shape or info.get("dtype") != stored:
            return (f"'{name}' is {info.get('dtype')} {info['shape']}, "
                    f"expected {stored} {shape}")
    for key, value in expected.items():
        if metadata.get(key) != value:
            return f"made with other settings ({key} differs)"
    length = metadata.get("megaslide.text_length", "")
    if not length.isdigit() or not 1 <= int(length) <= text_len:
        return f"megaslide.text_length {length!r} is not a token count"
    return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """megaslide-prepare's entry point: 0 when every video was prepared (or
    already was), 1 when some failed (the others are written), 2 for a
    usage error or nothing to do."""
    args = parse_args(argv)
    start = time.monotonic()
    try:
        code = run(args)
    except UsageError as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{TOOL}: interrupted; samples written so far are kept and "
              f"the next run continues", file=sys.stderr)
        return 130
    if args.progress:
        print(f"{TOOL}: {time.monotonic() - start:.1f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
