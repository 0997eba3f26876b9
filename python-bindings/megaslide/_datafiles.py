"""Helpers shared by megaslide-prepare and megaslide-export: atomic writes,
the sample files' header check and the bucket file, with no heavy import
(docs/Data.md)."""

from __future__ import annotations

import io
import json
import math
import os
import stat
import struct
import tempfile
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

#: The pip requirement file that brings torch, diffusers, transformers and
#: PyAV (relative to the repository root).
REQUIREMENTS = "scripts/requirements-models.txt"

class Stride(NamedTuple):
    """Pixels per latent element of a VAE (frames after the first, height
    and width) and the transformer's spatial patch: a bucket's height and
    width are multiples of spatial * patch, its frames 1 + k temporal."""
    temporal: int = 4
    spatial: int = 8
    patch: int = 2

    @property
    def step(self) -> int:
        return self.spatial * self.patch


#: Wan 2.1's VAE (and Wan 2.2 A14B's) with 2x2 patches: buckets of 16 px.
WAN21 = Stride()

#: Largest safetensors header read when verifying a sample (its JSON only).
MAX_HEADER_BYTES = 1 << 24


class UsageError(Exception):
    """A bad flag or input that stops the whole run (exit code 2)."""


def open_regular(path: str) -> io.BufferedReader:
    """``path`` opened for reading in binary, a regular file only: OSError
    (ENXIO style, "not a regular file") for a FIFO, device or folder, which
    open() would block on (a FIFO waits for a writer) or read without
    end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"'{path}' is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def oserror_text(e: OSError) -> str:
    return e.strerror or str(e)


def heavy_imports(tool: str):
    """torch, diffusers and transformers, or a UsageError naming the
    requirement file that installs them."""
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UsageError(f"{tool} needs torch, diffusers, transformers and "
                         f"av ({e}); install them with `pip install -r "
                         f"{REQUIREMENTS}`") from e


def write_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file in the same
    folder and a rename, so a reader sees the old file or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp", dir=folder)
    try:
        # mkstemp makes the file 0600; give it what open() would (umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, value: Any) -> None:
    write_atomic(path, (json.dumps(value, indent=2, sort_keys=False) +
                        "\n").encode())


def read_safetensors_header(path: str) -> Tuple[Dict[str, Any],
                                                 Dict[str, str]]:
    """The tensors ({name: {"dtype", "shape"}}) and ``__metadata__`` of a
    safetensors file, after checking that the data the header describes is
    all there (a truncated file is refused). Raises ValueError saying why."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"header length {n} does not fit the file "
                             f"({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    end = 0
    for name, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            info["shape"] = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor '{name}' has a malformed entry") from e
        end = max(end, int(stop))
    if 8 + n + end != size:
        raise ValueError(f"the tensors need {8 + n + end} bytes, the file "
                         f"has {size} (truncated or padded)")
    return header, metadata


def bucket_name(frames: int, height: int, width: int) -> str:
    return f"{frames}x{height}x{width}"


def latent_shape(frames: int, height: int, width: int, channels: int,
                 stride: Stride = WAN21) -> List[int]:
    """The VAE latent shape [C, T, H, W] of a bucket's pixel shape."""
    return [channels, (frames - 1) // stride.temporal + 1,
            height // stride.spatial, width // stride.spatial]


def check_shape(what: str, frames: int, height: int, width: int,
                stride: Stride = WAN21) -> None:
    """Raises UsageError unless the shape is one the VAE and the patches
    take: frames 4k+1, height and width positive multiples of the step
    (16 for Wan 2.1's VAE, 32 for Wan 2.2's 16x one)."""
    if frames < 1 or (frames - 1) % stride.temporal:
        raise UsageError(f"{what}: frames must be {stride.temporal}k+1 (1, "
                         f"{1 + stride.temporal}, {1 + 2 * stride.temporal}, "
                         f"...), got {frames}")
    for axis, value in (("height", height), ("width", width)):
        if value < stride.step or value % stride.step:
            raise UsageError(f"{what}: {axis} must be a positive multiple of "
                             f"{stride.step}, got {value}")


def read_bucket_file(path: str,
                     stride: Stride = WAN21) -> List[Dict[str, int]]:
    """The buckets of a bucket file ({"buckets": [{"frames", "height",
    "width", "samples"?}, ...]}), checked; UsageError naming the file."""
    try:
        with open_regular(path) as f:
            doc = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read bucket file '{path}': "
                         f"{oserror_text(e)}") from e
    except ValueError as e:
        raise UsageError(f"bucket file '{path}' is not JSON: {e}") from e
    entries = doc.get("buckets") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"bucket file '{path}': expected {{\"buckets\": "
                         f"[{{\"frames\": 17, \"height\": 128, \"width\": "
                         f"128}}, ...]}} with at least one bucket")
    buckets = []
    seen = set()
    for i, entry in enumerate(entries):
        where = f"bucket file '{path}': buckets[{i}]"
        if not isinstance(entry, dict):
            raise UsageError(f"{where} is not an object")
        unknown = set(entry) - {"frames", "height", "width", "samples"}
        if unknown:
            raise UsageError(f"{where}: unknown key(s) "
                             f"{', '.join(sorted(unknown))}; a bucket has "
                             f"frames, height, width and optional samples")
        values = []
        for key in ("frames", "height", "width"):
            v = entry.get(key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise UsageError(f"{where}: '{key}' must be an integer, got "
                                 f"{v!r}")
            values.append(v)
        check_shape(where, *values, stride=stride)
        name = bucket_name(*values)
        if name in seen:
            raise UsageError(f"{where}: bucket {name} is given twice")
        seen.add(name)
        buckets.append(dict(zip(("frames", "height", "width"), values)))
    return buckets


def log_aspect(width: int, height: int) -> float:
    return math.log(width / height)


def choose_bucket(buckets: List[Dict[str, int]], width: int, height: int,
                  available: int) -> Optional[Dict[str, int]]:
    """The bucket of a video of ``width`` x ``height`` with ``available``
    frames at the target fps: among the buckets it has frames for, the
    nearest aspect ratio in log(w/h), then the longest, then the nearest
    area; None when it is shorter than every bucket."""
    fits = [b for b in buckets if b["frames"] <= available]
    if not fits:
        return None
    aspect = log_aspect(width, height)

    def key(b):
        # Rounded so aspect ties do not hinge on the last bit.
        return (round(abs(log_aspect(b["width"], b["height"]) - aspect), 9),
                -b["frames"], abs(b["width"] * b["height"] - width * height),
                b["height"], b["width"])
    return min(fits, key=key)


def auto_buckets(videos: List[Tuple[int, int, int]], count: int, frames: int,
                 height: int, width: int,
                 stride: Stride = WAN21) -> List[Dict[str, int]]:
    """At most ``count`` buckets chosen from ``videos`` ((width, height,
    available frames) each), as docs/Data.md "Buckets" describes.

    Candidate shapes: for every height h that is a multiple of the step
    (16 with Wan 2.1's VAE), the width w, a multiple of the step, that
    makes h*w nearest to height*width
    (aspect ratios 1:4 to 4:1). Candidate durations: 4k+1 up to
    ``frames``. Each video votes for its nearest candidate shape (log
    aspect) and the longest candidate duration it has frames for; the
    ``count`` candidates with most votes are kept (ties: longer, larger,
    then smaller height first)."""
    area = height * width
    shapes = []
    step = stride.step
    h = step
    while True:
        w = max(step, int(round(area / h / step)) * step)
        if w * 4 < h:
            break
        if h * 4 >= w:
            shapes.append((h, w))
        h += step
    votes: Dict[Tuple[int, int, int], int] = {}
    for vw, vh, available in videos:
        if available < 1:
            continue
        duration = min(frames, (available - 1) // stride.temporal *
                       stride.temporal + 1)
        aspect = log_aspect(vw, vh)
        sh, sw = min(shapes, key=lambda s: (
            round(abs(log_aspect(s[1], s[0]) - aspect), 9),
            abs(s[0] * s[1] - area), s[0]))
        votes[(duration, sh, sw)] = votes.get((duration, sh, sw), 0) + 1
    ranked = sorted(votes.items(), key=lambda kv: (
        -kv[1], -kv[0][0], -kv[0][1] * kv[0][2], kv[0][1]))
    return [{"frames": f, "height": h, "width": w}
            for (f, h, w), _ in ranked[:count]]
