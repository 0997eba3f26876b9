"""megaslide-export: a fine-tuned transformer and its base pipeline -> a
complete diffusers Wan pipeline folder (docs/Data.md "megaslide-export").

``OUT/model_index.json`` is the base's, byte for byte; every other
component folder of the base is a symlink to it (``--copy``: a copy); and
``OUT/transformer/`` holds the run's ``config.json`` as written and its
weight files, hard-linked (a copy across file systems, or with
``--copy``). The folder is built beside OUT and renamed into place at the
end, so OUT is complete or absent."""

from __future__ import annotations

import argparse
import errno
import inspect
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import _megaslide
from ._datafiles import UsageError, heavy_imports

TOOL = "megaslide-export"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
PIPELINES = ("WanPipeline",)
#: The WanTransformer3DModel arguments that fix the weights' shapes and
#: the forward's meaning; the others (rope_max_seq_len, ...) do not. One
#: list with the runtime's weight loader (host::architectureKeys).
ARCHITECTURE = tuple(_megaslide.architecture_keys())


def _read_json(path: str, what: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
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
        shards = sorted(set(weight_map.values()))
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


def link_or_copy(src: str, dst: str, copy: bool) -> None:
    if not copy:
        try:
            os.link(src, dst)
            return
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK,
                               errno.ENOTSUP):
                raise
    shutil.copy2(src, dst)


def export(base: str, weights: str, out: str, copy: bool) -> str:
    """Builds the pipeline folder; returns what it did, one line."""
    index = _read_json(os.path.join(base, "model_index.json"), "--pipeline")
    cls = index.get("_class_name")
    if cls not in PIPELINES:
        raise UsageError(f"--pipeline '{base}': model_index.json's "
                         f"_class_name is {cls!r}, not one of "
                         f"{', '.join(PIPELINES)}; give a Wan text-to-video "
                         f"pipeline folder")
    components = [k for k, v in index.items() if not k.startswith("_") and
                  isinstance(v, list) and len(v) == 2 and v[0] is not None]
    if "transformer" not in components:
        raise UsageError(f"--pipeline '{base}': model_index.json lists no "
                         f"transformer; give a pipeline folder that has one "
                         f"(its config is what the weights are checked "
                         f"against)")
    missing = [c for c in components if not os.path.isdir(
        os.path.join(base, c))]
    if missing:
        raise UsageError(f"--pipeline '{base}': model_index.json lists "
                         f"{', '.join(missing)} but the folder has no "
                         f"{', '.join(m + '/' for m in missing)}")
    files = weight_files(weights)
    run_config = _read_json(os.path.join(weights, "config.json"), "--weights")
    base_config = _read_json(os.path.join(base, "transformer", "config.json"),
                             "--pipeline")
    heavy_imports(TOOL)
    ours, theirs = architecture(run_config), architecture(base_config)
    diffs = [f"{k}: {ours[k]!r} in the weights, {theirs[k]!r} in the base"
             for k in ARCHITECTURE if ours[k] != theirs[k]]
    if diffs:
        raise UsageError(
            f"the weights '{weights}' are not of the base pipeline's "
            f"transformer architecture ('{base}/transformer/config.json'):\n"
            + "\n".join("  " + d for d in diffs) +
            "\ngive the base pipeline the run was fine-tuned from")
    check_out(out)

    given = out  # messages name the folder as the user did
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise UsageError(f"output '{out}': the folder '{parent}' does not "
                         f"exist")
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    try:
        os.mkdir(tmp)
        shutil.copy2(os.path.join(base, "model_index.json"),
                     os.path.join(tmp, "model_index.json"))
        for c in components:
            if c == "transformer":
                continue
            src = os.path.realpath(os.path.join(base, c))
            if copy:
                shutil.copytree(src, os.path.join(tmp, c))
            else:
                os.symlink(src, os.path.join(tmp, c),
                           target_is_directory=True)
        transformer = os.path.join(tmp, "transformer")
        os.mkdir(transformer)
        shutil.copyfile(os.path.join(weights, "config.json"),
                        os.path.join(transformer, "config.json"))
        for f in files:
            link_or_copy(os.path.join(weights, f),
                         os.path.join(transformer, f), copy)
        check_out(out)  # still free: nothing else wrote there meanwhile
        # rename(2) replaces an empty folder and refuses a full one.
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    how = "copied" if copy else "linked"
    others = [c for c in components if c != "transformer"]
    return (f"{TOOL}: wrote '{given}': transformer from '{weights}' "
            f"({len(files)} weight file(s)), {', '.join(others)} {how} from "
            f"'{base}'")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """megaslide-export's entry point: 0 when the folder was written, 2 for
    a usage error (nothing written), 1 for an I/O failure (nothing left)."""
    p = argparse.ArgumentParser(
        prog=TOOL, description="Assemble a diffusers Wan pipeline folder "
        "from a base pipeline and a run's fine-tuned transformer "
        "(docs/Data.md).")
    p.add_argument("--pipeline", required=True,
                   help="the base diffusers Wan pipeline folder")
    p.add_argument("--weights", required=True, help="the transformer folder "
                   "megaslide-run --save-weights wrote")
    p.add_argument("-o", "--output", required=True,
                   help="the new pipeline folder (must not exist, or be "
                   "empty)")
    p.add_argument("--copy", action="store_true", help="copy the base's "
                   "components and the weights instead of linking them")
    args = p.parse_args(argv)
    try:
        print(export(args.pipeline, args.weights, args.output, args.copy))
    except UsageError as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{TOOL}: error: {e}; nothing was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
