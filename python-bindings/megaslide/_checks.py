"""Checks of the arguments every public function takes (ints the C++ side
can hold, strings without NUL, paths, plan files) before they reach the
native module."""

from __future__ import annotations

import os
import stat
from typing import Any


_INT64_MAX = 2**63 - 1


def _within_int64(name: str, value: int, high: int = _INT64_MAX) -> int:
    """``value`` (already checked to be an int) if the C++ side can hold it:
    a ValueError naming the argument rather than pybind11's TypeError."""
    if value > high:
        bound = "2^63 - 1" if high == _INT64_MAX else "2^64 - 1"
        raise ValueError(f"{name} must be at most {bound}, got {value}")
    return int(value)


def _check_str(name: str, value: Any) -> str:
    """``value`` if it is a str the C++ side reads whole: a NUL character
    would silently cut it short there (``"tiny\\0x"`` read as ``"tiny"``)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if "\0" in value:
        raise ValueError(f"{name} contains a NUL character: {value!r}")
    return value


def _check_path(name: str, value: Any) -> str:
    """A path argument (str or os.PathLike) as a str for the C++ side.
    '' is refused: the C++ side would resolve it as the current folder
    (save_weights('') wrote there) or read it as "not given"."""
    path = os.fspath(value)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if path == "":
        raise ValueError(f"{name} is empty; give a file or folder path "
                         f"('.' for the current folder)")
    return _check_str(name, path)


#: Largest plan file read, as the runtime's loader (kMaxExecPlanBytes in
#: include/megaslide/runtime/support/ReadFile.h, docs/Runtime.md "Limits on
#: input files").
_MAX_PLAN_BYTES = 256 << 20


def _read_plan_file(path: str) -> str:
    """The text of plan file ``path``: a regular file only (open() of a FIFO
    would wait for a writer forever; /dev/zero reads without end) of at
    most _MAX_PLAN_BYTES. ValueError naming the file otherwise."""
    def fail(reason: str) -> ValueError:
        return ValueError(f"cannot read plan file '{path}': {reason}")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise fail("it is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise fail(e.strerror) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise fail("it is not a regular file")
        data = f.read(_MAX_PLAN_BYTES + 1)
    if len(data) > _MAX_PLAN_BYTES:
        raise fail(f"it holds more than {_MAX_PLAN_BYTES} bytes, the limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return _within_int64(name, value)


def _common_args(model, frames, height, width, batch, text_len, latent):
    _check_str("model", model)
    sizes = [_positive_int(n, v) for n, v in
             (("frames", frames), ("height", height), ("width", width),
              ("batch", batch))]
    text = 0 if text_len is None else _positive_int("text_len", text_len)
    return (model, *sizes[:3], bool(latent), sizes[3], text)
