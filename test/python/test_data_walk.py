"""docs/Data.md's walk from videos to a sampled video, run as written.

Every block of the page marked for doc-check (test/Docs/Inputs/check_doc.py
says how) runs in a fresh folder holding what the page says is there:
``wan-tiny/``, a diffusers Wan pipeline of tiny random models
(tiny_wan.py), ``wan-i2v-tiny/``, a WanImageToVideoPipeline of the same
with a tiny CLIP image encoder and an image-conditioned transformer
(tiny_wan.image_config("i2v")), ``wan22-tiny/``, a Wan 2.2 A14B-shaped
WanPipeline whose two experts (transformer, transformer_2, boundary_ratio
0.875) are tiny's, and ``videos/``, four 16-frame clips with
captions, two 96 x 96 and two 96 x 128. The page's commands run the build's
megaslide-plan and megaslide-run, and megaslide-prepare and
megaslide-export as ``python -m`` of the package under test; what the
page shows them printing must be what they print. The progress bars and
the warnings of diffusers and transformers are turned off by their own
environment variables (TQDM_DISABLE, DIFFUSERS_VERBOSITY,
TRANSFORMERS_VERBOSITY), since they go to the same output.

Afterwards the files the walk leaves are checked: the runs trained with
3D-DSA and recorded it, the exported pipelines hold the runs' weights,
sample.mp4 and sample-i2v.mp4 decode to the frames the pipelines made,
and the Wan 2.2 export holds each expert's run.
"""

import json
import os
import pathlib
import stat
import subprocess
import sys

import numpy as np
import pytest

from conftest import tool_path

for _module in ("torch", "diffusers", "transformers", "av"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: "
                        f"pip install -r scripts/requirements-models.txt")

import megaslide  # noqa: E402
import tiny_wan  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "Data.md"
CHECK_DOC = REPO / "test" / "Docs" / "Inputs" / "check_doc.py"
CLIPS = (("cat.mp4", 96, 96, "a red cat play in the garden"),
         ("dog.mp4", 96, 96, "a blue dog under the sun"),
         ("car.mp4", 96, 128, "a car drives fast"),
         ("bird.webm", 96, 128, "a bird flies over the house"))


def _wrapper(folder: pathlib.Path, name: str, command: str) -> pathlib.Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\nexec {command} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _setup(work: pathlib.Path) -> None:
    base = work.parent / "base-weights"
    megaslide.Trainer("tiny", 13, 96, 96, precision="f32").save_weights(
        str(base))
    tiny_wan.build_pipeline(work / "wan-tiny", base)
    # Wan 2.2 A14B's shape: the same tiny transformer as both experts.
    tiny_wan.build_pipeline(work / "wan22-tiny", base, weights_dir_2=base,
                            boundary_ratio=0.875)
    config = work.parent / "i2v.json"
    config.write_text(json.dumps(tiny_wan.image_config("i2v")))
    image_base = work.parent / "base-weights-i2v"
    megaslide.Trainer(str(config), 13, 96, 96, precision="f32").save_weights(
        str(image_base))
    tiny_wan.build_pipeline(work / "wan-i2v-tiny", image_base)
    videos = work / "videos"
    videos.mkdir()
    for i, (name, height, width, caption) in enumerate(CLIPS):
        tiny_wan.write_video(videos / name,
                             tiny_wan.moving_pattern(16, height, width, i))
        (videos / name).with_suffix(".txt").write_text(caption + "\n")


def test_the_walk_runs_as_written(tmp_path):
    run, plan = tool_path("megaslide-run"), tool_path("megaslide-plan")
    work = tmp_path / "work"
    work.mkdir()
    _setup(work)
    tools = tmp_path / "bin"
    tools.mkdir()
    python = sys.executable
    given = [_wrapper(tools, "megaslide-prepare", f"{python} -m megaslide.prepare"),
             _wrapper(tools, "megaslide-export", f"{python} -m megaslide.export"),
             _wrapper(tools, "python3", python)]
    package = pathlib.Path(megaslide.__file__).resolve().parents[1]
    env = dict(os.environ, TQDM_DISABLE="1", DIFFUSERS_VERBOSITY="error",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1",
               MEGASLIDE_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(
                   [str(package)] + [p for p in os.environ.get(
                       "PYTHONPATH", "").split(os.pathsep) if p]))
    args = [python, str(CHECK_DOC), str(DOC), "--src", str(REPO),
            "--workdir", str(work), "--tool", run, "--tool", plan]
    for path in given:
        args += ["--tool", str(path)]
    checked = subprocess.run(args, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=900)
    assert checked.returncode == 0, checked.stdout
    assert "run blocks" in checked.stdout.splitlines()[-1]

    import av
    from safetensors.numpy import load_file
    for run_dir, export_dir, sample in (("run", "my-wan", "sample.mp4"),
                                        ("run-i2v", "my-wan-i2v",
                                         "sample-i2v.mp4")):
        # The run trained with 3D-DSA and says so where enable_dsa reads it.
        record = json.loads((work / run_dir / "weights/config.json")
                            .read_text())
        assert record["_megaslide"]["attention"] == "dsa"
        assert record["_megaslide"]["dsa3d"]["window"] == [2, 3, 3]
        # The exported transformer holds the run's weights.
        weights = "diffusion_pytorch_model.safetensors"
        ours = load_file(work / run_dir / "weights" / weights)
        theirs = load_file(work / export_dir / "transformer" / weights)
        assert ours.keys() == theirs.keys()
        assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
        # The video on disk is the one sampled: 13 frames of 96 x 96.
        with av.open(str(work / sample)) as container:
            frames = [f.to_ndarray(format="rgb24")
                      for f in container.decode(video=0)]
        assert len(frames) == 13 and frames[0].shape == (96, 96, 3)
    # Wan 2.2: each expert's run is its pipeline component, and the two
    # runs trained apart (their weights differ).
    weights = "diffusion_pytorch_model.safetensors"
    experts = {}
    for run_dir, component in (("run22/high", "transformer"),
                               ("run22/low", "transformer_2")):
        ours = load_file(work / run_dir / weights)
        theirs = load_file(work / "my-wan22" / component / weights)
        assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
        experts[component] = ours
    assert not np.array_equal(experts["transformer"]["proj_out.weight"],
                              experts["transformer_2"]["proj_out.weight"])
    assert (work / "sample22.mp4").stat().st_size > 0
