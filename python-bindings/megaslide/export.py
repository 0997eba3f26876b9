"""megaslide-export: a fine-tuned transformer and its base pipeline -> a
complete diffusers Wan pipeline folder (docs/Data.md "megaslide-export"):
a ``WanPipeline``, or for an image-conditioned transformer (Wan 2.1 I2V,
FLF2V) a ``WanImageToVideoPipeline`` with the base's image encoder.

``OUT/model_index.json`` is the base's, byte for byte; every other
component folder of the base is copied into OUT; and ``OUT/transformer/``
holds the run's ``config.json`` as written and its weight files. Every
file of OUT is its own: a reflink (a copy-on-write clone, free on btrfs,
XFS, ...) where the file system makes one, else a copy (``--copy``:
always a copy). Never a symlink or a hard link: diffusers'
``save_pretrained`` into OUT opens the existing names for writing, which
would rewrite the base (or the run's weights) through them. The folder is
built beside OUT and renamed into place at the end, so OUT is complete or
absent; a temporary left by an export that was killed is removed by the
next export of the same OUT."""

from __future__ import annotations

import argparse
import errno
import inspect
import json
import os
import re
import shutil
import stat
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import _megaslide
from ._datafiles import UsageError, heavy_imports

TOOL = "megaslide-export"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
#: Wan 2.2 A14B's two experts: transformer runs at t >= boundary_ratio,
#: transformer_2 below.
EXPERTS = ("transformer", "transformer_2")
PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
#: The components an image-conditioned transformer samples with: the CLIP
#: image encoder and its processor (WanImageToVideoPipeline.encode_image).
IMAGE_COMPONENTS = ("image_encoder", "image_processor")
#: The WanTransformer3DModel arguments that fix the weights' shapes and
#: the forward's meaning; the others (rope_max_seq_len, ...) do not. One
#: list with the runtime's weight loader (host::architectureKeys).
ARCHITECTURE = tuple(_megaslide.architecture_keys())


#: FICLONE from linux/fs.h: dst shares src's extents until either is
#: written (copy-on-write).
FICLONE = 0x40049409


def _read_json(path: str, what: str) -> Dict[str, Any]:
    try:
        # O_NONBLOCK: a FIFO given as the file must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{what}: '{path}' is not a regular file")
            value = json.load(f)
    except FileNotFoundError as e:
        raise UsageError(f"{what}: '{path}' does not exist") from e
    except OSError as e:
        raise UsageError(f"{what}: cannot read '{path}': {e.strerror}") from e
    except ValueError as e:
        raise UsageError(f"{what}: '{path}' is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise UsageError(f"{what}: '{path}' is not a JSON object")
    return value


def weight_files(weights: str) -> List[str]:
    """The weight files of a diffusers transformer folder: the index and
    its shards, or the one file; UsageError when some are missing."""
    index = os.path.join(weights, INDEX)
    if os.path.isfile(index):
        weight_map = _read_json(index, "--weights").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UsageError(f"--weights: '{index}' has no weight_map")
        shards = sorted(set(weight_map.values()), key=str)
        for s in shards:
            # A shard lies beside its index: a path could read, and (the
            # copy into OUT joins it too) write, outside both folders.
            if not is_plain_name(s):
                raise UsageError(f"--weights: '{index}' names the shard "
                                 f"{s!r}, which is not a file name in its "
                                 f"folder; shards must lie beside the index "
                                 f"(no '/', '..' or absolute path)")
        missing = [s for s in shards
                   if not os.path.isfile(os.path.join(weights, s))]
        if missing:
            raise UsageError(f"--weights: '{index}' names shards that are "
                             f"not there: {', '.join(missing)}")
        return [INDEX] + shards
    if os.path.isfile(os.path.join(weights, WEIGHTS)):
        return [WEIGHTS]
    raise UsageError(f"--weights '{weights}' has neither {WEIGHTS} nor "
                     f"{INDEX}; give the folder megaslide-run --save-weights "
                     f"wrote")


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` (read from a file) names an entry of the folder it
    is joined to, and nothing beyond it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and
            "/" not in name and os.sep not in name and
            (os.altsep is None or os.altsep not in name) and
            "\0" not in name)


def architecture(config: Dict[str, Any]) -> Dict[str, Any]:
    """The ARCHITECTURE values diffusers builds from ``config``: its keys
    over WanTransformer3DModel's defaults, lists for tuples, out_channels
    defaulting to in_channels as the model does."""
    from diffusers import WanTransformer3DModel

    defaults = {name: p.default for name, p in inspect.signature(
        WanTransformer3DModel.__init__).parameters.items()}
    values = {}
    for key in ARCHITECTURE:
        value = config.get(key, defaults.get(key))
        values[key] = list(value) if isinstance(value, (list, tuple)) \
            else value
    if values["out_channels"] is None:
        values["out_channels"] = values["in_channels"]
    return values


def check_out(out: str) -> None:
    if os.path.lexists(out) and not (os.path.isdir(out) and
                                     not os.path.islink(out) and
                                     not os.listdir(out)):
        raise UsageError(f"output '{out}' already exists; exporting over it "
                         f"could mix two models: give a new -o, or remove "
                         f"'{out}' first")


def clone_or_copy(src: str, dst: str, clone: bool = True) -> str:
    """Makes ``dst`` (new) a file of its own with ``src``'s bytes: a reflink
    when ``clone`` and the file system can, else a copy. Returns
    "cloned" or "copied"."""
    how = "copied"
    # O_NONBLOCK: a FIFO among the files must be refused, not waited on.
    with os.fdopen(os.open(src, os.O_RDONLY | os.O_NONBLOCK), "rb") as fin:
        if not stat.S_ISREG(os.fstat(fin.fileno()).st_mode):
            raise UsageError(f"'{src}' is not a regular file")
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as fout:
            if clone and sys.platform.startswith("linux"):
                import fcntl
                try:
                    fcntl.ioctl(fd, FICLONE, fin.fileno())
                    how = "cloned"
                except OSError as e:
                    # No reflinks here (ext4, tmpfs, across file systems).
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOTTY,
                                       errno.EXDEV, errno.EINVAL,
                                       errno.ENOSYS, errno.EPERM):
                        raise
            if how == "copied":
                shutil.copyfileobj(fin, fout, 16 << 20)
    shutil.copystat(src, dst)
    return how


def remove_stale_temporaries(out: str) -> List[str]:
    """Removes the temporary folders ('.OUT.tmp-PID') that exports of
    ``out`` killed before their rename left; returns what it did, a line
    each. A PID still running on this machine keeps its folder (named)."""
    parent, name = os.path.split(out)
    pattern = re.compile(re.escape(f".{name}.tmp-") + r"([0-9]+)")
    notes = []
    for entry in sorted(os.listdir(parent)):
        m = pattern.fullmatch(entry)
        path = os.path.join(parent, entry)
        if not m or os.path.islink(path) or not os.path.isdir(path):
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except (PermissionError, OverflowError):
            alive = True  # another user's live process
        if alive:
            notes.append(f"{TOOL}: note: '{path}' is the temporary of an "
                         f"export still running (pid {pid}); left alone")
            continue
        shutil.rmtree(path, ignore_errors=True)
        notes.append(f"{TOOL}: removed '{path}', left by an export that "
                     f"was killed (pid {pid})")
    return notes


def check_expert(base: str, cls: str, components: List[str], component: str,
                 weights: str) -> None:
    """UsageError unless ``weights`` is a transformer of the architecture of
    the base's ``component``, in a pipeline that can run it."""
    flag = "--weights" if component == "transformer" else "--weights-2"
    run_config = _read_json(os.path.join(weights, "config.json"), flag)
    base_config = _read_json(os.path.join(base, component, "config.json"),
                             "--pipeline")
    ours, theirs = architecture(run_config), architecture(base_config)
    diffs = [f"{k}: {ours[k]!r} in the weights, {theirs[k]!r} in the base"
             for k in ARCHITECTURE if ours[k] != theirs[k]]
    if diffs:
        raise UsageError(
            f"the weights '{weights}' are not of the base pipeline's "
            f"{component} architecture ('{base}/{component}/config.json'):\n"
            + "\n".join("  " + d for d in diffs) +
            "\ngive the base pipeline the run was fine-tuned from")
    if ours["image_dim"] is not None:
        # Without them from_pretrained loads, and sampling fails.
        lacking = [c for c in IMAGE_COMPONENTS if c not in components]
        if cls != "WanImageToVideoPipeline" or lacking:
            raise UsageError(
                f"--pipeline '{base}': the transformer is image-conditioned "
                f"(image_dim {ours['image_dim']}), but the base is a {cls}"
                + (f" whose model_index.json lists no "
                   f"{' and no '.join(lacking)}" if lacking else "") +
                f"; give the WanImageToVideoPipeline folder (with its image "
                f"encoder and image processor) the run was fine-tuned from")


def expert_weights(weights: Optional[str],
                   weights_2: Optional[str]) -> Dict[str, str]:
    """The pipeline component each given transformer folder becomes:
    ``transformer`` (Wan 2.2's high-noise expert) and ``transformer_2``
    (its low-noise one); a folder holding both as subfolders (a two-expert
    run's --save-weights) gives both."""
    if weights is None and weights_2 is None:
        raise UsageError("give --weights (the transformer) or --weights-2 "
                         "(a Wan 2.2 pipeline's transformer_2), or both")
    if (weights is not None and weights_2 is None and
            not os.path.isfile(os.path.join(weights, "config.json")) and
            os.path.isdir(os.path.join(weights, "transformer"))):
        both = {c: os.path.join(weights, c) for c in EXPERTS
                if os.path.isdir(os.path.join(weights, c))}
        return both
    given = {"transformer": weights, "transformer_2": weights_2}
    return {c: w for c, w in given.items() if w is not None}


def export(base: str, weights: Optional[str], out: str, copy: bool,
           weights_2: Optional[str] = None) -> str:
    """Builds the pipeline folder; returns what it did, one line."""
    index = _read_json(os.path.join(base, "model_index.json"), "--pipeline")
    cls = index.get("_class_name")
    if cls not in PIPELINES:
        raise UsageError(f"--pipeline '{base}': model_index.json's "
                         f"_class_name is {cls!r}, not one of "
                         f"{', '.join(PIPELINES)}; give a Wan "
                         f"pipeline folder")
    components = [k for k, v in index.items() if not k.startswith("_") and
                  isinstance(v, list) and len(v) == 2 and v[0] is not None]
    for c in components:
        # Joined to the base (read) and to OUT (written).
        if not is_plain_name(c):
            raise UsageError(f"--pipeline '{base}': model_index.json names "
                             f"the component {c!r}, which is not a folder "
                             f"name in the pipeline folder; fix "
                             f"model_index.json")
    experts = expert_weights(weights, weights_2)
    for c in experts:
        if c not in components:
            raise UsageError(
                f"--pipeline '{base}': model_index.json lists no {c}; "
                + ("give a pipeline folder that has one (its config is what "
                   "the weights are checked against)" if c == "transformer"
                   else "it is not a two-expert (Wan 2.2 A14B) pipeline, so "
                   "there is no low-noise expert to replace"))
    missing = [c for c in components if not os.path.isdir(
        os.path.join(base, c))]
    if missing:
        raise UsageError(f"--pipeline '{base}': model_index.json lists "
                         f"{', '.join(missing)} but the folder has no "
                         f"{', '.join(m + '/' for m in missing)}")
    files = {c: weight_files(w) for c, w in experts.items()}
    heavy_imports(TOOL)
    for c, w in experts.items():
        check_expert(base, cls, components, c, w)
    check_out(out)

    given = out  # messages name the folder as the user did
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise UsageError(f"output '{out}': the folder '{parent}' does not "
                         f"exist")
    notes = remove_stale_temporaries(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")

    def put(src: str, dst: str) -> None:
        clone_or_copy(src, dst, clone=not copy)
    try:
        os.mkdir(tmp)
        shutil.copy2(os.path.join(base, "model_index.json"),
                     os.path.join(tmp, "model_index.json"))
        for c in components:
            if c in experts:
                continue
            # Links inside (a Hugging Face cache's blobs) are followed:
            # OUT holds files of its own.
            shutil.copytree(os.path.join(base, c), os.path.join(tmp, c),
                            copy_function=put)
        for c, w in experts.items():
            folder = os.path.join(tmp, c)
            os.mkdir(folder)
            shutil.copyfile(os.path.join(w, "config.json"),
                            os.path.join(folder, "config.json"))
            for f in files[c]:
                put(os.path.join(w, f), os.path.join(folder, f))
        check_out(out)  # still free: nothing else wrote there meanwhile
        # rename(2) replaces an empty folder and refuses a full one.
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    others = [c for c in components if c not in experts]
    written = ", ".join(f"{c} from '{w}' ({len(files[c])} weight file(s))"
                        for c, w in experts.items())
    return "".join(n + "\n" for n in notes) + (
            f"{TOOL}: wrote '{given}': {written}, {', '.join(others)} copied "
            f"from '{base}'")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """megaslide-export's entry point: 0 when the folder was written, 2 for
    a usage error (nothing written), 1 for an I/O failure (nothing left)."""
    p = argparse.ArgumentParser(
        prog=TOOL, description="Assemble a diffusers Wan pipeline folder "
        "from a base pipeline and a run's fine-tuned transformer "
        "(docs/Data.md).")
    p.add_argument("--pipeline", required=True,
                   help="the base diffusers Wan pipeline folder")
    p.add_argument("--weights", help="the transformer folder megaslide-run "
                   "--save-weights wrote (Wan 2.2 A14B: the high-noise "
                   "expert; a two-expert run's folder gives both)")
    p.add_argument("--weights-2", dest="weights_2",
                   help="Wan 2.2 A14B: the low-noise expert's folder, the "
                   "pipeline's transformer_2 (the expert not given is the "
                   "base's)")
    p.add_argument("-o", "--output", required=True,
                   help="the new pipeline folder (must not exist, or be "
                   "empty)")
    p.add_argument("--copy", action="store_true", help="copy every file, "
                   "even where the file system could clone it (reflink); "
                   "either way OUT shares nothing writable with the base")
    args = p.parse_args(argv)
    try:
        print(export(args.pipeline, args.weights, args.output, args.copy,
                     args.weights_2))
    except UsageError as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{TOOL}: error: {e}; nothing was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
