"""Resolution and duration buckets in megaslide-run and megaslide-plan.

A dataset of two shapes (docs/Runtime.md, "Buckets") trains on one plan per
bucket over one host state: each plan compiled once and then loaded from
the plan cache, each step's bucket drawn from the run's generator (so a
resumed run continues bit-exactly), a sample in no bucket refused before
the first step, a bucket over its budgets exit code 3, and megaslide-plan's
table of the buckets worst first.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import tool_path, with_init

# The tiny preset: 16 latent channels, 16 text tokens of 32 dimensions.
SMALL, LARGE = (5, 32, 32), (9, 32, 48)


def name(shape):
    return "x".join(map(str, shape))


def latent_shape(shape):
    frames, height, width = shape
    return (16, (frames - 1) // 4 + 1, height // 8, width // 8)


def write_sample(path, shape, seed, metadata=True, latents=None):
    rng = np.random.default_rng(seed)
    tensors = {
        "latents": (latents if latents is not None else
                    rng.standard_normal(latent_shape(shape))).astype(
                        np.float32),
        "condition": rng.standard_normal((16, 32)).astype(np.float32),
    }
    meta = {"megaslide.format": "1", "megaslide.text_length": "16",
            "megaslide.caption": f"sample {seed}",
            "megaslide.source": f"video{seed}.mp4",
            "megaslide.caption_dropped": "0"}
    if metadata:
        meta["megaslide.bucket"] = name(shape)
    save_file(tensors, os.fspath(path), metadata=meta)


def write_buckets(path, shapes, **extra):
    entries = [{"frames": f, "height": h, "width": w} for f, h, w in shapes]
    path.write_text(json.dumps({"buckets": entries, **extra}))


@pytest.fixture
def data(tmp_path):
    """6 samples of SMALL, 4 of LARGE (two without metadata: their shape
    says their bucket), and the folder's buckets.json."""
    folder = tmp_path / "data"
    folder.mkdir()
    for k in range(6):
        write_sample(folder / f"a{k}.safetensors", SMALL, k)
    for k in range(4):
        write_sample(folder / f"b{k}.safetensors", LARGE, 10 + k,
                     metadata=k < 2)
    write_buckets(folder / "buckets.json", [SMALL, LARGE])
    return folder


def run(*args, check=True, cache=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if cache is not None:
        env["MEGASLIDE_CACHE_DIR"] = os.fspath(cache)
    result = subprocess.run([tool_path("megaslide-run"), "--no-progress",
                             *map(str, with_init(args))],
                            capture_output=True, text=True, env=env)
    result.out = result.stdout + result.stderr
    if check and result.returncode != 0:
        raise AssertionError(result.out)
    return result


def plan(*args, check=True):
    result = subprocess.run([tool_path("megaslide-plan"), *map(str, args)],
                            capture_output=True, text=True)
    result.out = result.stdout + result.stderr
    if check and result.returncode != 0:
        raise AssertionError(result.out)
    return result


def records(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text()
            .splitlines()]


def test_each_bucket_compiles_once_and_both_are_drawn(tmp_path, data):
    cache = tmp_path / "cache"
    metrics = tmp_path / "m.jsonl"
    report = tmp_path / "report.html"
    first = run("--model", "tiny", "--data", data, "--steps", 8, "--metrics",
                metrics, "--report", report, cache=cache)
    assert f"buckets: {data / 'buckets.json'}" in first.out
    for shape in (SMALL, LARGE):
        assert f"bucket {name(shape)}: compiled in" in first.out, first.out
    assert "samples per bucket: 5x32x32 6, 9x32x48 4" in first.out
    entries = sorted(p.name for p in (cache / "plans").iterdir())
    assert len([e for e in entries if e.endswith(".plan.json")]) == 2, entries
    assert len([e for e in entries if e.endswith(".figures.json")]) == 2
    steps = records(metrics)
    assert len(steps) == 8
    drawn = {r["bucket"] for r in steps}
    assert drawn == {name(SMALL), name(LARGE)}, drawn
    assert all(np.isfinite(r["loss"]) for r in steps)
    page = report.read_text()
    for shape, count in ((SMALL, 6), (LARGE, 4)):
        assert f"<tr><td>{name(shape)}</td><td>{count}</td>" in page

    again = run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache",
                cache / "plans")
    for shape in (SMALL, LARGE):
        assert f"bucket {name(shape)}: loaded from the plan cache" in again.out
    assert "compiled in" not in again.out
    # A weighted loss is another plan (docs/Training.md, "Loss weighting").
    weighted = run("--model", "tiny", "--data", data, "--steps", 1,
                   "--plan-cache", cache / "plans", "--weighting-scheme",
                   "cosmap")
    for shape in (SMALL, LARGE):
        assert f"bucket {name(shape)}: compiled in" in weighted.out, \
            weighted.out


def test_corrupt_cache_entry_is_compiled_again(tmp_path, data):
    cache = tmp_path / "cache"
    run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache", cache)
    victim = sorted(cache.glob("*.plan.json"))[0]
    victim.write_text(victim.read_text()[:-50])
    out = run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache",
              cache).out
    assert "the plan cache entry is not usable, so it is compiled again" in out
    assert out.count("compiled in") == 1 and out.count("loaded from") == 1
    # Compiled again and stored whole: the next run loads both.
    out = run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache",
              cache).out
    assert out.count("loaded from the plan cache") == 2, out


def test_swapped_cache_entries_are_compiled_again(tmp_path, data):
    """Two buckets' entries swapped (renamed into each other's keys): each
    entry records the key it was compiled for, so both are compiled again
    with a note rather than run on the other bucket's plan, whose error
    would blame the samples."""
    cache = tmp_path / "cache"
    run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache", cache)
    keys = sorted(p.name[:-len(".plan.json")]
                  for p in cache.glob("*.plan.json"))
    assert len(keys) == 2, keys
    for suffix in (".plan.json", ".figures.json"):
        a, b = (cache / (k + suffix) for k in keys)
        a_text, b_text = a.read_text(), b.read_text()
        a.write_text(b_text)
        b.write_text(a_text)
    out = run("--model", "tiny", "--data", data, "--steps", 4, "--plan-cache",
              cache).out
    assert out.count("the plan cache entry is not usable, so it is compiled "
                     "again") == 2, out
    assert "was compiled for key" in out, out
    assert out.count("compiled in") == 2 and "loaded from" not in out, out
    # A plan swapped under its own figures is refused as well.
    plan_a, plan_b = (cache / (k + ".plan.json") for k in keys)
    a_text = plan_a.read_text()
    plan_a.write_text(plan_b.read_text())
    plan_b.write_text(a_text)
    out = run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache",
              cache).out
    assert out.count("is not the plan its figures were stored with") == 2, out
    out = run("--model", "tiny", "--data", data, "--steps", 1, "--plan-cache",
              cache).out
    assert out.count("loaded from the plan cache") == 2, out


def test_resume_over_buckets_is_bit_exact(tmp_path, data):
    cache = tmp_path / "cache"
    common = ("--model", "tiny", "--data", data, "--plan-cache", cache,
              "--grad-accum", 2)
    run(*common, "--steps", 6, "--metrics", tmp_path / "full.jsonl")
    ck = tmp_path / "ck"
    run(*common, "--steps", 3, "--checkpoint-dir", ck, "--metrics",
        tmp_path / "a.jsonl")
    run(*common, "--steps", 3, "--checkpoint-dir", ck, "--resume",
        "--metrics", tmp_path / "b.jsonl")
    full = records(tmp_path / "full.jsonl")
    parts = records(tmp_path / "a.jsonl") + records(tmp_path / "b.jsonl")
    assert [(r["loss"], r["bucket"]) for r in parts] == \
        [(r["loss"], r["bucket"]) for r in full]
    assert all(len(r["bucket"]) == 2 for r in full)  # one per micro-batch
    # Another set of buckets is another run: refused.
    other = tmp_path / "other.json"
    write_buckets(other, [SMALL])
    moved = tmp_path / "small"
    moved.mkdir()
    for k in range(6):
        write_sample(moved / f"a{k}.safetensors", SMALL, k)
    refused = run("--model", "tiny", "--data", moved, "--plan-cache", cache,
                  "--buckets", other, "--steps", 1, "--checkpoint-dir", ck,
                  "--resume", "--grad-accum", 2, check=False)
    assert refused.returncode == 1, refused.out
    assert "buckets: 5x32x32,9x32x48 in the checkpoint, 5x32x32 now" in \
        refused.out


def test_sample_in_no_bucket_fails_before_training(tmp_path, data):
    stray = data / "stray.safetensors"
    write_sample(stray, (5, 32, 64), 99, metadata=False)
    result = run("--model", "tiny", "--data", data, "--steps", 1,
                 "--plan-cache", tmp_path / "cache", check=False)
    assert result.returncode == 1, result.out
    assert f"'{stray}': its latents [16, 2, 4, 8] are in no bucket" in \
        result.out
    assert "5x32x32 (latents [16, 2, 4, 4]), 9x32x48 (latents [16, 3, 4, 6])" \
        in result.out
    assert "on the cpu backend" not in result.out
    # Metadata that disagrees with the latents is named with both.
    stray.unlink()
    liar = data / "liar.safetensors"
    write_sample(liar, SMALL, 98, latents=np.zeros(latent_shape(LARGE)))
    result = run("--model", "tiny", "--data", data, "--steps", 1,
                 "--plan-cache", tmp_path / "cache", check=False)
    assert result.returncode == 1, result.out
    assert (f"'{liar}': its megaslide.bucket metadata says 5x32x32, whose "
            "latents are [16, 2, 4, 4], but its latents are [16, 3, 4, 6]") \
        in result.out


def peaks(buckets, *flags):
    table = json.loads(plan("--model", "tiny", "--buckets", buckets,
                            "--format", "json", *flags).stdout)
    return {b["name"]: b["device_peak_bytes"] for b in table["buckets"]}


def test_plan_lists_buckets_worst_first(tmp_path):
    buckets = tmp_path / "buckets.json"
    write_buckets(buckets, [SMALL, LARGE])
    table = json.loads(plan("--model", "tiny", "--buckets", buckets,
                            "--format", "json").stdout)
    rows = table["buckets"]
    assert [r["name"] for r in rows] == [name(LARGE), name(SMALL)]
    assert rows[0]["device_peak_bytes"] > rows[1]["device_peak_bytes"] > 0
    assert all(r["predicted_step_seconds"] > 0 and r["fits"] for r in rows)
    text = plan("--model", "tiny", "--buckets", buckets).stdout
    lines = [l.split()[0] for l in text.splitlines()
             if l.strip().startswith(("5x", "9x"))]
    assert lines == [name(LARGE), name(SMALL)], text


def test_bucket_over_budget_exits_3_naming_it(tmp_path, data):
    policy = ("--activation-policy", "keep", "--gpu-reserve", "0")
    peak = peaks(data / "buckets.json", *policy)
    budget = (peak[name(SMALL)] + peak[name(LARGE)]) // 2
    over = ("--gpu-mem", f"{budget}B", *policy)
    result = plan("--model", "tiny", "--buckets", data / "buckets.json", *over,
                  check=False)
    assert result.returncode == 3, result.out
    assert f"error: bucket {name(LARGE)}:" in result.out
    assert f"bucket {name(SMALL)}:" not in result.stderr
    result = run("--model", "tiny", "--data", data, "--steps", 1,
                 "--plan-cache", tmp_path / "cache", *over, check=False)
    assert result.returncode == 3, result.out
    assert f"\n  bucket {name(LARGE)}:" in result.out
    assert f"\n  bucket {name(SMALL)}:" not in result.out
    assert "on the cpu backend" not in result.out


@pytest.mark.parametrize("content, message", [
    ({"buckets": []}, "the \"buckets\" list is empty"),
    ({"buckets": [{"frames": 5, "height": 32, "width": 32}] * 2},
     "bucket 5x32x32 is listed twice"),
    ({"buckets": [{"frames": 6, "height": 32, "width": 32}]},
     "frames must be 4k+1"),
    ({"buckets": [{"frames": 5, "height": 32, "width": 32, "fps": 8}]},
     "unknown key 'fps'"),
    ({"buckets": [{"frames": 5, "height": 0, "width": 32}]},
     "\"height\" must be a positive integer"),
    ({"shapes": []}, "unknown key 'shapes'"),
])
def test_bad_bucket_files(tmp_path, content, message):
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps(content))
    for result in (plan("--model", "tiny", "--buckets", path, check=False),
                   run("--model", "tiny", "--buckets", path, check=False)):
        assert result.returncode == 1, result.out
        assert f"bucket file '{path}'" in result.out and message in result.out


def test_bucket_the_model_cannot_take_is_named(tmp_path):
    path = tmp_path / "buckets.json"
    write_buckets(path, [SMALL, (5, 32, 36)])
    result = plan("--model", "tiny", "--buckets", path, check=False)
    assert result.returncode == 1, result.out
    assert "bucket 5x32x36: " in result.out


def test_buckets_exclude_the_video_flags(tmp_path, data):
    result = run("--model", "tiny", "--buckets", data / "buckets.json",
                 "--frames", 5, check=False)
    assert result.returncode == 1
    assert "--buckets gives the video shapes" in result.out
    # Given video flags, the folder's bucket file is not used.
    result = run("--model", "tiny", "--data", data, "--frames", 5,
                 "--height", 32, "--width", 32, "--steps", 1, check=False)
    assert "buckets:" not in result.out
    assert "tensor 'latents' has shape [16, 3, 4, 6]" in result.out


def test_validation_goes_bucket_by_bucket(tmp_path, data):
    val = tmp_path / "val"
    val.mkdir()
    for k in range(2):
        write_sample(val / f"a{k}.safetensors", SMALL, 50 + k)
        write_sample(val / f"b{k}.safetensors", LARGE, 60 + k)
    metrics = tmp_path / "m.jsonl"
    run("--model", "tiny", "--data", data, "--val-data", val, "--steps", 2,
        "--val-every", 1, "--metrics", metrics, "--plan-cache",
        tmp_path / "cache")
    steps = records(metrics)
    # Each validation batch runs on its own bucket's plan (a wrong plan is
    # a shape error); the weights move between the two evaluations.
    assert all(np.isfinite(r["val_loss"]) for r in steps), steps
    assert len({r["val_loss"] for r in steps}) == 2
