"""Malformed input at every entry point: a clear error, never a crash.

One table per entry point: model configs, IR (megaslide-opt and
megaslide-translate), execution plans (megaslide-run --plan, Trainer),
weights (--weights, Trainer.load_weights), checkpoints (--resume), the
command lines of all four tools, and the Python API. Every case asserts

* the exit code docs/ExitCodes.md documents (or the Python exception type),
* a substring of the message that names the field, file or flag and, where
  there is one, the fix,
* no crash: no signal exit, no "Stack dump", no SystemError;

and the cases that write check that the user's files are byte-identical
afterwards (a failed -o, --save-weights, checkpoint or resume damages
nothing).

Inputs are truncated or corrupted copies of artifacts the tools produce
themselves, made once per module from the tiny preset at 5 x 32 x 32.
"""

import contextlib
import hashlib
import json
import os
import re
import pathlib
import shutil
import stat
import struct
import subprocess
import types

import numpy as np
import pytest

import megaslide
from conftest import tool_path

SMALL = ["--frames", "5", "--height", "32", "--width", "32"]
RUN = ["--model", "tiny", *SMALL, "--no-progress"]
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
DEEP = 100_000  # far beyond what a recursive parser survives on 8 MiB

# What crashes leave behind: LLVM's signal handler, assertions, sanitizers.
CRASH_SIGNS = ("Stack dump", "PLEASE submit a bug report", "Assertion",
               "Segmentation fault", "AddressSanitizer", "runtime error:",
               "terminate called", "SystemError")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def run_tool(tool, args, cwd=None, timeout=120, stdin=None):
    result = subprocess.run([tool_path(tool), *map(os.fspath, args)],
                            capture_output=True, cwd=cwd, timeout=timeout,
                            input=stdin)
    result.out = (result.stdout + result.stderr).decode("utf-8", "replace")
    return result


def check_failure(result, code, message):
    """Exit `code` (never a signal), `message` in the output, no crash."""
    text = result.out
    assert result.returncode >= 0, (
        f"killed by signal {-result.returncode}:\n{text}")
    for sign in CRASH_SIGNS:
        assert sign not in text, f"crash signature {sign!r}:\n{text}"
    assert result.returncode == code, (
        f"exit {result.returncode}, expected {code}:\n{text}")
    assert message in text, f"{message!r} not in:\n{text}"


def check_exception(excinfo_value, exc_type, message):
    assert type(excinfo_value) is exc_type, (
        f"{type(excinfo_value).__name__} raised, expected "
        f"{exc_type.__name__}: {excinfo_value}")
    assert message in str(excinfo_value), (
        f"{message!r} not in: {excinfo_value}")


def tree_hashes(*roots):
    """Every file and directory under `roots`, with the SHA-256 of files."""
    out = {}
    for root in map(pathlib.Path, roots):
        if root.is_file():
            out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        if not root.exists():
            out[str(root)] = None
            continue
        for path in sorted(root.rglob("*")):
            out[str(path)] = (hashlib.sha256(path.read_bytes()).hexdigest()
                              if path.is_file() else "dir")
    return out


@contextlib.contextmanager
def read_only(*roots):
    """Makes files and directories unwritable, also for root (chattr +i);
    skips the test where that cannot be done."""
    paths = []
    for root in map(pathlib.Path, roots):
        paths.append(root)
        if root.is_dir():
            paths.extend(root.rglob("*"))
    modes = {p: p.stat().st_mode for p in paths}
    immutable = []
    try:
        for p in paths:
            p.chmod(modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        if os.geteuid() == 0:
            # Root ignores permission bits; the immutable flag binds it.
            for p in paths:
                if subprocess.run(["chattr", "+i", os.fspath(p)],
                                  capture_output=True).returncode != 0:
                    pytest.skip("running as root without chattr +i: cannot "
                                "make a directory read-only")
                immutable.append(p)
        yield
    finally:
        for p in immutable:
            subprocess.run(["chattr", "-i", os.fspath(p)], capture_output=True)
        for p, mode in modes.items():
            p.chmod(mode)


def crc32c(data: bytes) -> str:
    """CRC-32C (Castagnoli) as the checkpoint manifest writes it."""
    table = crc32c.table
    if table is None:
        table = crc32c.table = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return f"{crc ^ 0xFFFFFFFF:08x}"


crc32c.table = None


def read_safetensors(path):
    data = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_safetensors(path, header, payload, raw_header=None):
    text = (raw_header if raw_header is not None else
            json.dumps(header).encode())
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text +
                                   payload)


def deep_json(depth=DEEP):
    return "[" * depth + "]" * depth


# ---------------------------------------------------------------------------
# Artifacts: made once by the tools themselves
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """A plan, weights and two checkpoints of tiny (5 x 32 x 32), its
    config, the module as built and a module with 3D-DSA ops."""
    d = tmp_path_factory.mktemp("artifacts")
    r = run_tool("megaslide-run",
                 [*RUN, "--steps", "2", "--checkpoint-every", "1",
                  "--save-plan", d / "plan.json", "--save-weights",
                  d / "weights", "--checkpoint-dir", d / "ckpt"])
    assert r.returncode == 0, r.out
    r = run_tool("megaslide-plan", ["--model", "tiny", *SMALL, "--emit-mlir",
                                    d / "tiny.mlir", "-o", d / "report.txt"])
    assert r.returncode == 0, r.out
    # A grid large enough for the 3D-DSA window: the planned module has
    # dsa3d ops for the verifier and kernel cases.
    r = run_tool("megaslide-plan",
                 ["--model", "tiny", "--frames", "17", "--height", "128",
                  "--width", "128", "--dsa-window", "3,5,5", "--dsa-tile",
                  "1,4,4", "--emit-plan-mlir", d / "dsa.mlir", "-o",
                  d / "report-dsa.txt"])
    assert r.returncode == 0, r.out
    config = json.loads((d / "weights" / "config.json").read_text())
    return types.SimpleNamespace(
        dir=d, plan=d / "plan.json", plan_text=(d / "plan.json").read_text(),
        weights=d / "weights", ckpt=d / "ckpt", config=config,
        mlir=d / "tiny.mlir", dsa_mlir=d / "dsa.mlir")


def test_artifacts_are_what_the_cases_corrupt(art):
    assert (art.ckpt / "latest").read_text().strip() == "step-000002"
    assert (art.ckpt / "step-000001" / "manifest.json").exists()
    assert (art.weights / WEIGHTS).exists()
    assert "megaslide.dsa3d" in art.dsa_mlir.read_text()
    assert json.loads(art.plan_text)["format"] == "megaslide-exec-plan"


# ---------------------------------------------------------------------------
# Model configs: megaslide-plan --model FILE and megaslide.model_info(FILE)
# ---------------------------------------------------------------------------

def tiny_with(**changes):
    def make(art):
        config = dict(art.config)
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        return json.dumps(config)
    return make


def dit_with(**changes):
    def make(art):
        config = {"architecture": "dit", "hidden_size": 64, "depth": 2,
                  "num_heads": 4, "mlp_ratio": 4.0, "patch_size": 2,
                  "in_channels": 4, "num_classes": 10, "vae_stride": [1, 8, 8]}
        config.update(changes)
        return json.dumps(config)
    return make


# (name, file content or a function of the artifacts, message)
CONFIG_CASES = [
    ("empty file", "", "invalid JSON"),
    ("truncated", lambda art: json.dumps(art.config)[:40], "invalid JSON"),
    ("not an object", "[1, 2]", "a model config must be a JSON object"),
    ("binary", bytes(range(256)) * 4, "invalid JSON"),
    ("nul bytes", b"{\"num_layers\": 2\x00}", "invalid JSON"),
    ("deep nesting", '{"num_layers": ' + deep_json() + "}", "invalid JSON"),
    # JSON has no infinity; llvm::json reads a number beyond double as one.
    ("infinite number", lambda art: json.dumps(art.config).replace(
        '"eps": 1e-06', '"eps": 1e999'),
     "config field 'eps': expected a finite number"),
    ("unknown key, suggestion", tiny_with(num_layer=2),
     "config field 'num_layer': unknown key; did you mean 'num_layers'?"),
    ("run record not an object", tiny_with(_megaslide=[1]),
     "config field '_megaslide': must be an object (what --save-weights "
     "records)"),
    ("unknown key", tiny_with(use_flash_attention=True),
     "config field 'use_flash_attention': unknown key; see "
     "docs/ModelConfig.md"),
    ("wrong type", tiny_with(num_layers="two"),
     "config field 'num_layers': expected an integer"),
    ("fractional integer", tiny_with(num_layers=2.5),
     "config field 'num_layers': expected an integer"),
    ("integer beyond int64", tiny_with(num_layers=10**30),
     "config field 'num_layers': expected an integer"),
    ("zero layers", tiny_with(num_layers=0),
     "config field 'num_layers': must be a positive integer, got 0"),
    ("missing required key", tiny_with(num_layers=None),
     "config field 'num_layers': must be a positive integer, got 0 (missing "
     "keys count as 0)"),
    ("negative heads", tiny_with(num_attention_heads=-4),
     "config field 'num_attention_heads': must be a positive integer, got -4"),
    ("odd head dim", tiny_with(attention_head_dim=15),
     "config field 'attention_head_dim': 15 is odd"),
    ("too many layers", tiny_with(num_layers=10**12),
     "config field 'num_layers': 1000000000000 is larger than 1024"),
    ("heads overflow", tiny_with(num_attention_heads=4_000_000_000),
     "config field 'num_attention_heads': 4000000000 is larger than 131072"),
    ("head dim overflow", tiny_with(attention_head_dim=4 * 10**12),
     "config field 'attention_head_dim': 4000000000000 is larger than 131072"),
    ("model dim too wide", tiny_with(num_attention_heads=65536,
                                     attention_head_dim=64),
     "65536 heads x 64 = model dim 4194304 is larger than 131072"),
    ("ffn int64 max", tiny_with(ffn_dim=2**63 - 1),
     "config field 'ffn_dim': 9223372036854775807 is larger than 131072"),
    ("too many channels", tiny_with(out_channels=10**6),
     "config field 'out_channels': 1000000 is larger than 131072"),
    ("fewer outputs than inputs", tiny_with(out_channels=8),
     "config field 'out_channels': 8 is fewer than in_channels 16"),
    ("text too long", tiny_with(text_len=10**6),
     "config field 'text_len': 1000000 is larger than 131072"),
    ("odd freq dim", tiny_with(freq_dim=31),
     "config field 'freq_dim': 31 must be positive and even"),
    ("huge freq dim", tiny_with(freq_dim=10**6),
     "config field 'freq_dim': 1000000 is larger than 131072"),
    ("patch too large", tiny_with(patch_size=[1, 2_000_000_000, 2]),
     "config field 'patch_size': extent 2000000000 is larger than 64"),
    ("patch of two", tiny_with(patch_size=[1, 2]),
     "config field 'patch_size': expected an integer or a list [t, h, w]"),
    ("patch zero", tiny_with(patch_size=[1, 0, 2]),
     "config field 'patch_size': every extent must be positive"),
    ("stride too large", tiny_with(vae_stride=[4, 8, 2**63 - 1]),
     "config field 'vae_stride': stride 9223372036854775807 is larger than "
     "64"),
    ("negative eps", tiny_with(eps=-1e-6), "config field 'eps': must be "
     "positive"),
    ("eps not a number", tiny_with(eps="small"),
     "config field 'eps': expected a number"),
    ("rope theta", tiny_with(rope_theta=1), "config field 'rope_theta': must "
     "exceed 1"),
    ("image conditioning without its projections", tiny_with(image_dim=1280),
     "config field 'added_kv_proj_dim': missing; image conditioning needs "
     "the cross-attention's image keys and values: set it to the model dim "
     "64"),
    ("DiT key in a Wan config", tiny_with(num_classes=10),
     "config field 'num_classes': only applies to DiT models"),
    ("unsupported class", tiny_with(_class_name="CogVideoXTransformer3DModel"),
     "config field '_class_name': 'CogVideoXTransformer3DModel' is not "
     "supported"),
    ("unknown architecture", tiny_with(architecture="mmdit"),
     "config field 'architecture': must be \"wan\" or \"dit\", got \"mmdit\""),
    ("DiT heads do not divide", dit_with(num_heads=5),
     "config field 'num_attention_heads': 5 heads do not divide hidden_size "
     "64"),
    ("DiT mlp ratio fractional", dit_with(mlp_ratio=2.7),
     "config field 'mlp_ratio': 2.70 x dim 64 is not a positive integer"),
    ("DiT mlp ratio huge", dit_with(mlp_ratio=1e300),
     "config field 'mlp_ratio'"),
    ("DiT temporal patch", dit_with(patch_size=[2, 2, 2]),
     "config field 'patch_size': DiT patches images: use a temporal patch "
     "of 1"),
    ("DiT dropout", dit_with(class_dropout_prob=1.0),
     "config field 'class_dropout_prob': must lie in [0, 1)"),
]


def write_config(art, tmp_path, content):
    if callable(content):
        content = content(art)
    if isinstance(content, str):
        content = content.encode()
    path = tmp_path / "model.json"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("name,content,message", CONFIG_CASES,
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_plan(art, tmp_path, name, content, message):
    path = write_config(art, tmp_path, content)
    result = run_tool("megaslide-plan", ["--model", path, *SMALL])
    check_failure(result, 1, message)
    # Every config error starts with the file that has it.
    assert str(path) in result.out


@pytest.mark.parametrize("name,content,message", CONFIG_CASES,
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_python(art, tmp_path, name, content, message):
    path = write_config(art, tmp_path, content)
    with pytest.raises(Exception) as e:
        megaslide.model_info(os.fspath(path), 5, 32, 32)
    check_exception(e.value, ValueError, message)


def test_config_file_problems(tmp_path):
    (tmp_path / "dir.json").mkdir()
    # A directory is a diffusers folder (docs/ModelConfig.md, "Model
    # folders"), whatever its name.
    for path, message in [
            (tmp_path / "missing.json", "cannot read model config"),
            (tmp_path / "dir.json", "it has neither model_index.json (a "
             "diffusers pipeline) nor config.json (a transformer)")]:
        check_failure(run_tool("megaslide-plan", ["--model", path, *SMALL]), 1,
                      message)
        with pytest.raises(ValueError, match=re.escape(message)):
            megaslide.model_info(os.fspath(path), 5, 32, 32)


# ---------------------------------------------------------------------------
# IR: megaslide-opt and megaslide-translate
# ---------------------------------------------------------------------------

def ir_sub(old, new, which="dsa"):
    """The built (or 3D-DSA) module with the first `old` replaced."""
    def make(art):
        text = (art.dsa_mlir if which == "dsa" else art.mlir).read_text()
        assert old in text, old
        return text.replace(old, new, 1)
    return make


def ir_truncated(art):
    text = art.mlir.read_text()
    return text[:len(text) * 3 // 5]


# (name, input text or a function of the artifacts, extra flags, message)
IR_CASES = [
    ("garbage", "garbage{\n", [], "custom op 'garbage' is unknown"),
    ("binary", bytes(range(1, 256)) * 8, [], "unexpected character"),
    ("truncated module", ir_truncated, [],
     "error: expected non-function type"),
    ("deep attribute nesting",
     "module attributes {a = " + deep_json() + "} {}\n", [],
     "brackets nest more than 1000 deep"),
    ("deep region nesting",
     "func.func @f() {\n" + '"test.op"() ({\n' * 3000 +
     "}) : () -> ()\n" * 3000 + "return\n}\n",
     ["--allow-unregistered-dialect"], "brackets nest more than 1000 deep"),
    ("unknown op", ir_sub("megaslide.dsa3d_offsets", "megaslide.nosuch_op"),
     [], "'megaslide.nosuch_op'"),
    ("window of zero", ir_sub("window = array<i64: 3, 5, 5>",
                              "window = array<i64: 0, 5, 5>"), [],
     "grid, window and tile must be positive, got grid [5, 8, 8], window "
     "[0, 5, 5]"),
    ("window beyond grid", ir_sub("window = array<i64: 3, 5, 5>",
                                  "window = array<i64: 30, 5, 5>"), [],
     "window extent 30 along t exceeds the grid extent 5"),
    ("tile of two", ir_sub("tile = array<i64: 1, 4, 4>",
                           "tile = array<i64: 1, 4>"), [],
     "'tile' failed to satisfy constraint: i64 dense array attribute with "
     "exactly 3 elements"),
    ("grid mismatch", ir_sub("grid = array<i64: 5, 8, 8>",
                             "grid = array<i64: 5, 8, 9>"), [],
     "token count 320 does not match grid [5, 8, 9]"),
    ("negative radius", ir_sub("radius = 4 : i64", "radius = -4 : i64"), [],
     "'radius' failed to satisfy constraint"),
    ("budget check before memory planning", ir_sub("", "", "built"),
     ["--megaslide-check-budget"],
     "no device arena: run megaslide-plan-memory first"),
    ("schedule verification out of phase", ir_sub("", "", "built"),
     ["--megaslide-verify-schedule"], "run megaslide-insert-transfers"),
    ("pipeline budget not a size", ir_sub("", "", "built"),
     ["--megaslide-pipeline=gpu-mem=abc"],
     "for the --gpu-mem option: 'abc' is not a memory size"),
    ("pipeline buffers zero", ir_sub("", "", "built"),
     ["--megaslide-pipeline=buffers=0"], "'buffers' (>= 1)"),
    ("pipeline window of two", ir_sub("", "", "built"),
     ["--megaslide-rewrite-attention-to-dsa=window=1,2"],
     "options 'window' and 'tile' need three positive extents"),
    ("unknown pipeline option", ir_sub("", "", "built"),
     ["--megaslide-pipeline=nosuch=1"], "no such option nosuch"),
    ("unknown pass in pipeline", ir_sub("", "", "built"),
     ["--pass-pipeline=builtin.module(nosuch)"],
     "'nosuch' does not refer to a registered pass or pass pipeline"),
]


def write_ir(art, tmp_path, content):
    if callable(content):
        content = content(art)
    if isinstance(content, str):
        content = content.encode()
    path = tmp_path / "input.mlir"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("name,content,flags,message", IR_CASES,
                         ids=[c[0] for c in IR_CASES])
def test_ir_opt(art, tmp_path, name, content, flags, message):
    path = write_ir(art, tmp_path, content)
    # A failed run leaves the output the user had (mlir-opt deletes it).
    out = tmp_path / "out.mlir"
    out.write_text("// the user's earlier output\n")
    before = tree_hashes(tmp_path)
    result = run_tool("megaslide-opt", [path, *flags, "-o", out])
    check_failure(result, 1, message)
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("name,content,flags,message", IR_CASES,
                         ids=[c[0] for c in IR_CASES])
def test_ir_opt_stdin(art, tmp_path, name, content, flags, message):
    # Piped input gets the same checks as a file (the nesting check reads
    # stdin first and hands it back to the parser).
    text = write_ir(art, tmp_path, content).read_bytes()
    result = run_tool("megaslide-opt", ["-", *flags], stdin=text)
    check_failure(result, 1, message)


# The same inputs through megaslide-translate, which parses and verifies
# before it emits kernels (pass flags do not apply).
TRANSLATE_IR_CASES = [c for c in IR_CASES if not c[2]]


@pytest.mark.parametrize("name,content,flags,message", TRANSLATE_IR_CASES,
                         ids=[c[0] for c in TRANSLATE_IR_CASES])
def test_ir_translate(art, tmp_path, name, content, flags, message):
    path = write_ir(art, tmp_path, content)
    out = tmp_path / "kernels"
    result = run_tool("megaslide-translate",
                      ["--emit-dsa-kernels", path, "-o", out])
    check_failure(result, 1, message)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("name,content,flags,message", TRANSLATE_IR_CASES,
                         ids=[c[0] for c in TRANSLATE_IR_CASES])
def test_ir_python(art, name, content, flags, message):
    if not hasattr(megaslide, "parse_module"):
        pytest.skip("this build's megaslide has no parse_module")
    if callable(content):
        content = content(art)
    if isinstance(content, bytes):
        content = content.decode("latin-1")
    with pytest.raises(ValueError) as e:
        megaslide.parse_module(content)
    check_exception(e.value, megaslide.DiagnosticError, message)


def test_ir_opt_success_replaces_output(art, tmp_path):
    out = tmp_path / "out.mlir"
    out.write_text("stale\n")
    result = run_tool("megaslide-opt", [art.mlir, "-o", out])
    assert result.returncode == 0, result.out
    assert out.read_text().startswith("module @tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["out.mlir"]


# ---------------------------------------------------------------------------
# Execution plans: megaslide-run --plan FILE and Trainer(plan_json=...)
# ---------------------------------------------------------------------------

def plan_edit(edit):
    """The plan with `edit(plan_dict)` applied, as JSON text."""
    def make(art):
        plan = json.loads(art.plan_text)
        edit(plan)
        return json.dumps(plan)
    return make


def set_key(key, value):
    def edit(plan):
        plan[key] = value
    return edit


def drop_key(key):
    def edit(plan):
        del plan[key]
    return edit


def first(plan, op):
    return next(i for i in plan["instructions"] if i["op"] == op)


def device_value(plan):
    return next(v for v in plan["values"] if v.get("home") == "device")


def edit_first_device_value(key, value):
    def edit(plan):
        device_value(plan)[key] = value
    return edit


def swap_record_and_wait(plan):
    insts = plan["instructions"]
    w = next(n for n, i in enumerate(insts) if i["op"] == "wait")
    event = insts[w]["event"]
    r = next(n for n, i in enumerate(insts)
             if i["op"] == "record" and i["event"] == event)
    insts[w]["event"], insts[r]["event"] = event, event
    insts.insert(r, insts.pop(w))


def read_undefined_value(plan):
    inst = first(plan, "linear")
    inst["operands"][0] = len(plan["values"]) + 7


def unknown_op(plan):
    first(plan, "gelu")["op"] = "frobnicate"


def fetch_unknown_param(plan):
    first(plan, "fetch")["param"] = "no.such.weight"


def shrink_linear_result(plan):
    inst = first(plan, "linear")
    value = plan["values"][inst["results"][0]]
    value["shape"][-1] //= 2


def adamw_lr_as_text(plan):
    first(plan, "host_adamw")["attrs"]["lr"] = "1e-4"


def rope_grid_as_number(plan):
    first(plan, "rope3d")["attrs"]["grid"] = 4


def overlap_device_values(plan):
    device = [v for v in plan["values"] if v.get("home") == "device"]
    device[1]["offset"] = device[0]["offset"]


def fetched_weight_to_f32(plan):
    """A fetched weight a layer_norm reads, bf16 -> f32 by hand: it still
    fits the arena and ran to exit 4 after writing a checkpoint."""
    fetched = {i["results"][0] for i in plan["instructions"]
               if i["op"] == "fetch"}
    norm = next(i for i in plan["instructions"] if i["op"] == "layer_norm"
                and fetched & set(i["operands"]))
    value = plan["values"][min(fetched & set(norm["operands"]))]
    assert value["dtype"] == "bf16"
    value["dtype"] = "f32"


def split_result_to_f32(plan):
    """One result of a split, bf16 -> f32 by hand: it ran to exit 0."""
    value = plan["values"][first(plan, "split")["results"][0]]
    assert value["dtype"] == "bf16"
    value["dtype"] = "f32"


# (name, plan text or a function of the artifacts, message); {plan} is the
# file (megaslide-run) or "<plan_json>" (Trainer).
PLAN_CASES = [
    ("empty", "", "{plan}: not an execution plan (invalid JSON"),
    ("truncated", lambda art: art.plan_text[:len(art.plan_text) // 2],
     "{plan}: not an execution plan (invalid JSON"),
    ("binary", bytes(range(256)) * 16, "{plan}: not an execution plan"),
    ("deep nesting", '{"format": "megaslide-exec-plan", "x": ' + deep_json() +
     "}", "{plan}: not an execution plan"),
    ("a model config", lambda art: json.dumps(art.config),
     '{plan}: not an execution plan (no "format": "megaslide-exec-plan")'),
    ("newer version", plan_edit(set_key("version", 7)),
     "{plan}: execution plan format version 7 is not supported (this runtime "
     "reads 2 to 6; recompile the plan)"),
    ("version not an integer", plan_edit(set_key("version", "2")),
     "{plan}: expected integer at plan.version"),
    ("another release", plan_edit(set_key("runtime_version", "0.0.1")),
     "{plan}: the plan was compiled for MegaSlide runtime 0.0.1, this is "
     "runtime "),
    ("no release", plan_edit(drop_key("runtime_version")),
     "{plan}: missing value at plan.runtime_version"),
    ("model not a string", plan_edit(set_key("model", 3)),
     "{plan}: expected string at plan.model"),
    ("instructions missing", plan_edit(drop_key("instructions")),
     "{plan}: missing value at plan.instructions"),
    ("batch zero", plan_edit(set_key("batch", 0)),
     "{plan}: invalid execution plan: batch 0 is not positive"),
    ("unknown dtype", plan_edit(edit_first_device_value("dtype", "f8")),
     "{plan}: expected one of bf16, f16, f32, i32, i64 at plan.values["),
    ("negative dimension", plan_edit(edit_first_device_value("shape", [-1])),
     "{plan}: invalid execution plan: value %"),
    ("huge tensor", plan_edit(edit_first_device_value("shape",
                                                       [2**40, 2**40])),
     "{plan}: invalid execution plan: value %"),
    ("value outside the arena",
     plan_edit(edit_first_device_value("offset", 2**40)),
     "{plan}: invalid execution plan: value %"),
    ("operand undefined", plan_edit(read_undefined_value),
     "which is out of range or not yet defined"),
    ("wait before record", plan_edit(swap_record_and_wait),
     "before it is recorded"),
    ("fetch of an unknown parameter", plan_edit(fetch_unknown_param),
     "'no.such.weight'"),
    ("device values overlap", plan_edit(overlap_device_values),
     "share arena bytes"),
    ("learning rate as text", plan_edit(adamw_lr_as_text),
     "('host_adamw'): attribute 'lr' must be a number"),
    ("grid as a number", plan_edit(rope_grid_as_number),
     "('rope3d'): attribute 'grid' must be an integer array"),
    ("unknown op", plan_edit(unknown_op),
     "{plan}: unknown op 'frobnicate' at plan.instructions["),
    ("kernel shape mismatch", plan_edit(shrink_linear_result),
     "step 1: instruction #"),
    ("weight dtype edited", plan_edit(fetched_weight_to_f32),
     "('layer_norm'): operand %"),
    ("activation dtype edited", plan_edit(split_result_to_f32),
     "('split'): result %"),
]


def write_plan(art, tmp_path, content):
    if callable(content):
        content = content(art)
    if isinstance(content, str):
        content = content.encode()
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("name,content,message", PLAN_CASES,
                         ids=[c[0] for c in PLAN_CASES])
def test_plan_run(art, tmp_path, name, content, message):
    path = write_plan(art, tmp_path, content)
    result = run_tool("megaslide-run", ["--plan", path, "--steps", "1",
                                        "--no-progress"])
    check_failure(result, 1, message.format(plan=path))


@pytest.mark.parametrize("edit", [fetched_weight_to_f32, split_result_to_f32])
def test_edited_dtype_is_refused_before_any_work(art, tmp_path, edit):
    """megaslide-exec validates the ops' typing rule before a step: no
    checkpoint, no weights."""
    path = write_plan(art, tmp_path, plan_edit(edit))
    ck, weights = tmp_path / "ck", tmp_path / "weights"
    result = run_tool("megaslide-exec", ["--plan", path, "--backend", "cpu",
                                         "--steps", "2", "--checkpoint-dir",
                                         ck, "--save-weights", weights])
    check_failure(result, 1, "computes in one floating-point type (only "
                  "'cast' converts)")
    assert not ck.exists() and not weights.exists()


@pytest.mark.parametrize("name,content,message", PLAN_CASES,
                         ids=[c[0] for c in PLAN_CASES])
def test_plan_python(art, tmp_path, name, content, message):
    if callable(content):
        content = content(art)
    if isinstance(content, bytes):
        content = content.decode("latin-1")
    with pytest.raises(Exception) as e:
        megaslide.Trainer(plan_json=content).step()
    message = message.format(plan="<plan_json>").replace("step 1: ", "")
    check_exception(e.value, ValueError, message)


def test_plan_file_problems(tmp_path):
    (tmp_path / "dir.json").mkdir()
    for path, message in [
            (tmp_path / "missing.json", "cannot read execution plan"),
            (tmp_path / "dir.json", "cannot read execution plan")]:
        check_failure(run_tool("megaslide-run", ["--plan", path, "--steps",
                                                 "1"]), 1, message)


# ---------------------------------------------------------------------------
# Weights: megaslide-run --weights PATH and Trainer.load_weights(PATH)
# ---------------------------------------------------------------------------

def weights_copy(tmp_path, art):
    path = tmp_path / "w"
    shutil.copytree(art.weights, path)
    return path


def header_edit(edit):
    """The weights directory with the safetensors header edited."""
    def make(art, tmp_path):
        path = weights_copy(tmp_path, art)
        header, payload = read_safetensors(path / WEIGHTS)
        payload = edit(header, payload) or payload
        write_safetensors(path / WEIGHTS, header, payload)
        return path
    return make


def raw_file(content):
    def make(art, tmp_path):
        path = tmp_path / "model.safetensors"
        data = content(art) if callable(content) else content
        path.write_bytes(data)
        return path
    return make


def weights_bytes(art):
    return (art.weights / WEIGHTS).read_bytes()


def raw_header(text):
    """A file whose header is `text` (bytes) and no data."""
    return raw_file(lambda art: struct.pack("<Q", len(text)) + text)


def tensor_names(header):
    return sorted(k for k in header if k != "__metadata__")


def drop_tensor(header, payload):
    del header[tensor_names(header)[0]]


def add_tensor(header, payload):
    header["blocks.99.extra.weight"] = {"dtype": "F32", "shape": [1],
                                        "data_offsets": [len(payload),
                                                         len(payload) + 4]}
    return payload + b"\0" * 4


def reshape_tensor(header, payload):
    name = "patch_embedding.bias"
    header[name]["shape"] = [header[name]["shape"][0] // 2, 2]


def set_dtype(dtype):
    def edit(header, payload):
        header["patch_embedding.bias"]["dtype"] = dtype
    return edit


def bad_offsets(header, payload):
    header["patch_embedding.bias"]["data_offsets"][1] += 4


def overlapping(header, payload):
    a, b = tensor_names(header)[:2]
    size = (header[b]["data_offsets"][1] - header[b]["data_offsets"][0])
    if size == header[a]["data_offsets"][1] - header[a]["data_offsets"][0]:
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    else:  # point b into a, keeping its size
        start = header[a]["data_offsets"][0]
        header[b]["data_offsets"] = [start, start + size]


def duplicate_key(art, tmp_path):
    path = weights_copy(tmp_path, art)
    header, payload = read_safetensors(path / WEIGHTS)
    text = json.dumps(header)
    name = "patch_embedding.bias"
    entry = json.dumps({name: header[name]})[1:-1]
    text = text[:-1] + ", " + entry + "}"
    write_safetensors(path / WEIGHTS, None, payload, raw_header=text.encode())
    return path


def sharded(edit_index=None, edit_files=None):
    """The weights as two shards with an index, then edited."""
    def make(art, tmp_path):
        path = tmp_path / "sharded"
        path.mkdir()
        header, payload = read_safetensors(art.weights / WEIGHTS)
        names = tensor_names(header)
        halves = [names[:len(names) // 2], names[len(names) // 2:]]
        weight_map = {}
        for i, part in enumerate(halves):
            shard = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
            sub, data, offset = {}, b"", 0
            for n in part:
                b, e = header[n]["data_offsets"]
                sub[n] = dict(header[n], data_offsets=[offset,
                                                       offset + e - b])
                data += payload[b:e]
                offset += e - b
                weight_map[n] = shard
            write_safetensors(path / shard, sub, data)
        index = {"metadata": {}, "weight_map": weight_map}
        if edit_index:
            index = edit_index(index)
        text = index if isinstance(index, str) else json.dumps(index)
        (path / INDEX).write_text(text)
        if edit_files:
            edit_files(path)
        return path
    return make


def index_names(file):
    def edit(index):
        first_name = sorted(index["weight_map"])[0]
        index["weight_map"][first_name] = file
        return index
    return edit


def remove_second_shard(path):
    (path / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()


def pipeline_dir(art, tmp_path):
    path = tmp_path / "pipeline"
    shutil.copytree(art.weights, path / "transformer")
    return path


def empty_dir(art, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    return path


def missing(art, tmp_path):
    return tmp_path / "no-such-weights"


# (name, a function (art, tmp_path) -> the weights path, message)
WEIGHTS_CASES = [
    ("missing", missing, "do not exist"),
    ("empty directory", empty_dir,
     "has neither diffusion_pytorch_model.safetensors nor "
     "diffusion_pytorch_model.safetensors.index.json"),
    ("pipeline directory", pipeline_dir,
     "for a diffusers pipeline pass its 'transformer' subdirectory"),
    ("empty file", raw_file(b""),
     "the file is 0 bytes, too short for the 8-byte header length"),
    ("short file", raw_file(b"\x10\0\0"),
     "too short for the 8-byte header length"),
    ("not safetensors", raw_file(b'{"num_layers": 2, "padding": 0}'),
     "(not a safetensors file?)"),
    ("truncated header", raw_file(lambda art: weights_bytes(art)[:1000]),
     "runs past the end of the file"),
    ("truncated data", raw_file(lambda art: weights_bytes(art)[:400_000]),
     "run past the end of the data"),
    ("header not JSON", raw_header(b"{not json}      "),
     "header is not valid JSON"),
    ("header not UTF-8", raw_header(b'{"\xff\xfe": 1}      '),
     "header is not valid UTF-8"),
    ("header an array", raw_header(b"[1, 2, 3]       "),
     "header is not a JSON object"),
    ("header deeply nested", raw_header(
        ('{"a": ' + deep_json() + "}").encode()), "header is not valid JSON"),
    ("unknown dtype", header_edit(set_dtype("F7")), "unknown dtype 'F7'"),
    ("unreadable dtype", header_edit(set_dtype("I32")),
     "with a dtype other than F32/BF16/F16: patch_embedding.bias (I32)"),
    ("offsets do not match the shape", header_edit(bad_offsets),
     "'data_offsets'"),
    ("tensors overlap", header_edit(overlapping), "overlaps tensor"),
    ("duplicate tensor", duplicate_key,
     "tensor 'patch_embedding.bias' appears more than once in the header"),
    ("missing tensor", header_edit(drop_tensor), "1 missing: "),
    ("unexpected tensor", header_edit(add_tensor),
     "1 unexpected (not in the model): blocks.99.extra.weight"),
    ("misshapen tensor", header_edit(reshape_tensor),
     "with a different shape: patch_embedding.bias (file [32, 2], model "
     "[64])"),
    ("index not JSON", sharded(edit_index=lambda i: "{"),
     "diffusion_pytorch_model.safetensors.index.json': not valid JSON"),
    ("index deeply nested",
     sharded(edit_index=lambda i: '{"weight_map": ' + deep_json() + "}"),
     "nested more than 256 levels deep"),
    ("index without weight_map", sharded(edit_index=lambda i: {"x": 1}),
     "no 'weight_map' object"),
    ("index escapes the directory", sharded(index_names("../x.safetensors")),
     "not a file of the directory"),
    ("index names a missing shard",
     sharded(edit_files=remove_second_shard),
     "diffusion_pytorch_model-00002-of-00002.safetensors"),
    ("index maps to the wrong shard",
     sharded(index_names(
         "diffusion_pytorch_model-00002-of-00002.safetensors")),
     "which does not hold it"),
    ("a device", lambda art, tmp_path: pathlib.Path("/dev/null"),
     "not a regular file"),
]


@pytest.mark.parametrize("name,make,message", WEIGHTS_CASES,
                         ids=[c[0] for c in WEIGHTS_CASES])
def test_weights_run(art, tmp_path, name, make, message):
    path = make(art, tmp_path)
    result = run_tool("megaslide-run", [*RUN, "--steps", "1", "--weights",
                                        path])
    check_failure(result, 1, message)


@pytest.mark.parametrize("name,make,message", WEIGHTS_CASES,
                         ids=[c[0] for c in WEIGHTS_CASES])
def test_weights_python(art, tmp_path, trainer, name, make, message):
    if not hasattr(trainer, "load_weights"):
        pytest.skip("this build's Trainer has no load_weights")
    path = make(art, tmp_path)
    before = trainer.parameters()
    with pytest.raises(Exception) as e:
        trainer.load_weights(path)
    check_exception(e.value, ValueError, message)
    # Nothing was loaded.
    after = trainer.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.fixture(scope="module")
def trainer(art):
    return megaslide.Trainer(plan_json=art.plan_text)


# ---------------------------------------------------------------------------
# Checkpoints: megaslide-run --checkpoint-dir D --resume
# ---------------------------------------------------------------------------

def ck_empty(d):
    for path in d.iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def ck_write(rel, content):
    def edit(d):
        (d / rel).write_bytes(content if isinstance(content, bytes)
                              else content.encode())
    return edit


def ck_remove(rel):
    def edit(d):
        path = d / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return edit


def ck_truncate(rel, size):
    def edit(d):
        with open(d / rel, "r+b") as f:
            f.truncate(size)
    return edit


def ck_append(rel):
    def edit(d):
        with open(d / rel, "ab") as f:
            f.write(b"\0")
    return edit


def ck_flip(rel, at):
    def edit(d):
        data = bytearray((d / rel).read_bytes())
        data[at] ^= 1
        (d / rel).write_bytes(bytes(data))
    return edit


def ck_manifest(edit_manifest):
    def edit(d):
        path = d / "step-000002" / "manifest.json"
        manifest = json.loads(path.read_text())
        edit_manifest(manifest)
        path.write_text(json.dumps(manifest))
    return edit


def ck_consistent(rel, content):
    """Replaces step-000002/`rel` and fixes its size and CRC in the manifest,
    so that only the content itself is wrong."""
    def edit(d):
        data = content(d) if callable(content) else content
        if isinstance(data, str):
            data = data.encode()
        (d / "step-000002" / rel).write_bytes(data)
        path = d / "step-000002" / "manifest.json"
        manifest = json.loads(path.read_text())
        for f in manifest["files"]:
            if f["name"] == rel:
                f["bytes"], f["crc32c"] = len(data), crc32c(data)
        path.write_text(json.dumps(manifest))
    return edit


def trainer_json(**changes):
    def content(d):
        data = json.loads((d / "step-000002" / "trainer.json").read_text())
        data.update(changes)
        return json.dumps(data)
    return content


def weights_as_state(d):
    # Masters only: the moments a checkpoint holds are missing.
    return (d.parent / "weights" / WEIGHTS).read_bytes()


def manifest_field(key, value):
    def edit(m):
        m[key] = value
    return edit


PREVIOUS = ("the previous checkpoint is '{d}/step-000001': to resume from it, "
            "write 'step-000001' into '{d}/latest'")
NEWEST = ("the newest complete checkpoint is '{d}/step-000002': to resume "
          "from it, write 'step-000002' into '{d}/latest'")

# (name, edit of a copy of the checkpoint directory, message); {d} is the
# directory.
CHECKPOINT_CASES = [
    ("no checkpoint", ck_empty, "no checkpoint in '{d}' ('{d}/latest' does "
     "not exist)"),
    ("latest garbage", ck_write("latest", "garbage\n"),
     "'{d}/latest' is corrupt (it should name a step-N directory but holds "
     "\"garbage\"); " + NEWEST),
    ("latest binary", ck_write("latest", bytes(range(256))),
     "but holds \"<binary>\")"),
    ("latest names no checkpoint", ck_write("latest", "step-000009\n"),
     "'{d}/step-000009' is not a complete checkpoint: manifest.json is "
     "missing (no such directory); " + NEWEST.replace("newest complete",
                                                      "previous")),
    ("manifest missing", ck_remove("step-000002/manifest.json"),
     "'{d}/step-000002' is not a complete checkpoint: manifest.json is "
     "missing; " + PREVIOUS),
    ("manifest not JSON", ck_write("step-000002/manifest.json", "{"),
     "'{d}/step-000002/manifest.json' is corrupt: not valid JSON"),
    ("manifest deeply nested",
     ck_write("step-000002/manifest.json", '{"files": ' + deep_json() + "}"),
     "nested more than 256 levels deep"),
    ("manifest of something else", ck_manifest(manifest_field("format", "x")),
     "not a MegaSlide checkpoint manifest"),
    ("manifest from the future", ck_manifest(manifest_field("version", 99)),
     "unsupported version (this build reads up to 2)"),
    ("manifest without files", ck_manifest(manifest_field("files", None)),
     "no 'files' array"),
    ("manifest with a bad checksum",
     ck_manifest(lambda m: m["files"][0].update(crc32c="xyz")),
     "a 'files' entry lacks a valid name, bytes or crc32c"),
    ("state truncated", ck_truncate("step-000002/state.safetensors", 1000),
     "'{d}/step-000002/state.safetensors' is 1000 bytes, the manifest records "
     "2183456 (truncated); " + PREVIOUS),
    ("state grown", ck_append("step-000002/state.safetensors"),
     "the manifest records 2183456 (modified)"),
    ("state bit flip", ck_flip("step-000002/state.safetensors", 100_000),
     "'{d}/step-000002/state.safetensors' is corrupt: its CRC-32C is "),
    ("trainer file edited", ck_flip("step-000002/trainer.json", 10),
     "'{d}/step-000002/trainer.json' is corrupt: its CRC-32C is "),
    ("trainer file not a checkpoint",
     ck_consistent("trainer.json", '{"format": "x"}'),
     "'{d}/step-000002/trainer.json' is corrupt: not a MegaSlide checkpoint "
     "trainer file"),
    ("trainer step disagrees", ck_consistent("trainer.json",
                                             trainer_json(step=7)),
     "step 7, the manifest says 2"),
    ("trainer state not JSON", ck_consistent("trainer.json",
                                             trainer_json(trainer_state="{")),
     "trainer state is not JSON"),
    ("trainer state deeply nested",
     ck_consistent("trainer.json", trainer_json(trainer_state=deep_json())),
     "nested more than 256 levels deep"),
    ("state of another tensor set", ck_consistent("state.safetensors",
                                                  weights_as_state),
     "does not match the model"),
]


@pytest.mark.parametrize("name,edit,message", CHECKPOINT_CASES,
                         ids=[c[0] for c in CHECKPOINT_CASES])
def test_checkpoint_resume(art, tmp_path, name, edit, message):
    d = tmp_path / "ckpt"
    shutil.copytree(art.ckpt, d)
    shutil.copytree(art.weights, tmp_path / "weights")
    edit(d)
    # The outputs of the run exist already: a failed resume changes none.
    for output in ("plan.json", "trace.json"):
        (tmp_path / output).write_text("the user's earlier output\n")
    # (A metrics file that is not a metrics log is refused before this.)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = tree_hashes(tmp_path)
    result = run_tool("megaslide-run",
                      [*RUN, "--steps", "1", "--checkpoint-dir", d, "--resume",
                       "--save-plan", tmp_path / "plan.json",
                       "--metrics", tmp_path / "metrics.jsonl",
                       "--trace", tmp_path / "trace.json",
                       "--save-weights", tmp_path / "weights"])
    check_failure(result, 1, message.format(d=d))
    assert tree_hashes(tmp_path) == before


def test_checkpoint_advice_works(art, tmp_path):
    """Following the message of a corrupt latest checkpoint resumes."""
    d = tmp_path / "ckpt"
    shutil.copytree(art.ckpt, d)
    ck_truncate("step-000002/state.safetensors", 1000)(d)
    args = [*RUN, "--steps", "1", "--checkpoint-dir", d, "--resume"]
    check_failure(run_tool("megaslide-run", args), 1, PREVIOUS.format(d=d))
    (d / "latest").write_text("step-000001\n")
    result = run_tool("megaslide-run", args)
    assert result.returncode == 0, result.out
    assert "resumed at step 1" in result.out


def test_missing_latest_resumes_the_newest_complete_checkpoint(art, tmp_path):
    """A save killed between renaming its folder and writing `latest` (a
    second Ctrl-C during the first checkpoint) leaves a complete checkpoint
    nothing names yet: resume takes the newest complete one, and says so."""
    d = tmp_path / "ckpt"
    shutil.copytree(art.ckpt, d)
    ck_remove("latest")(d)
    result = run_tool("megaslide-run", [*RUN, "--steps", "1",
                                        "--checkpoint-dir", d, "--resume"])
    assert result.returncode == 0, result.out
    assert (f"'{d}/latest' is missing (a save was interrupted before it "
            "named its checkpoint); resuming from the newest complete one, "
            "'step-000002'") in result.out, result.out
    assert "resumed at step 2" in result.out, result.out


# ---------------------------------------------------------------------------
# Writes that fail: the user's files stay byte-identical
# ---------------------------------------------------------------------------

def test_save_weights_into_read_only_directory(art, tmp_path):
    w = tmp_path / "weights"
    shutil.copytree(art.weights, w)
    before = tree_hashes(tmp_path)
    with read_only(w):
        result = run_tool("megaslide-run", [*RUN, "--steps", "1",
                                            "--save-weights", w])
    # Found before compiling, not after the last step.
    check_failure(result, 1, f"--save-weights: cannot write in directory '{w}'")
    assert "on the cpu backend" not in result.out
    assert tree_hashes(tmp_path) == before


def test_checkpoint_into_read_only_directory(art, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(art.ckpt, d)
    before = tree_hashes(tmp_path)
    with read_only(d):
        result = run_tool("megaslide-run", [*RUN, "--steps", "1",
                                            "--checkpoint-dir", d])
    check_failure(result, 1,
                  f"--checkpoint-dir: cannot write in directory '{d}'")
    assert "on the cpu backend" not in result.out
    assert tree_hashes(tmp_path) == before


def test_resume_from_read_only_directory_works(art, tmp_path):
    """Reading a checkpoint needs no write access (checkpoints are written
    elsewhere then)."""
    d = tmp_path / "ckpt"
    shutil.copytree(art.ckpt, d)
    before = tree_hashes(tmp_path)
    with read_only(d):
        result = run_tool("megaslide-run", [*RUN, "--steps", "0",
                                            "--checkpoint-dir", d,
                                            "--resume"])
    assert result.returncode == 0, result.out
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("tool,args", [
    ("megaslide-plan", ["--model", "tiny", *SMALL, "-o", "{out}"]),
    ("megaslide-plan", ["--model", "tiny", *SMALL, "--emit-mlir", "{out}"]),
    ("megaslide-run", [*RUN, "--steps", "0", "--save-plan", "{out}"]),
    ("megaslide-run", [*RUN, "--steps", "1", "--metrics", "{out}"]),
    ("megaslide-run", [*RUN, "--steps", "1", "--trace", "{out}"]),
    ("megaslide-opt", ["{mlir}", "-o", "{out}"]),
    ("megaslide-translate", ["--emit-dsa-kernels", "{dsa}", "-o", "{outdir}"]),
], ids=["plan -o", "plan --emit-mlir", "run --save-plan", "run --metrics",
        "run --trace", "opt -o", "translate -o"])
def test_output_into_read_only_directory(art, tmp_path, tool, args):
    d = tmp_path / "out"
    d.mkdir()
    (d / "earlier.txt").write_text("the user's earlier output\n")
    before = tree_hashes(tmp_path)
    fill = dict(out=d / "new.txt", outdir=d / "kernels", mlir=art.mlir,
                dsa=art.dsa_mlir)
    with read_only(d):
        result = run_tool(tool, [a.format(**fill) for a in args])
    check_failure(result, 1, str(d))
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("tool,args", [
    ("megaslide-plan", ["--model", "nosuch", *SMALL, "-o", "{out}"]),
    ("megaslide-plan", ["--model", "tiny", *SMALL, "--gpu-mem", "x",
                        "--emit-mlir", "{out}"]),
    ("megaslide-run", [*RUN, "--steps", "1", "--weights", "{missing}",
                       "--save-plan", "{out}"]),
    ("megaslide-run", [*RUN, "--steps", "1", "--lr", "0", "--metrics",
                       "{out}"]),
    ("megaslide-opt", ["{missing}", "-o", "{out}"]),
    ("megaslide-opt", ["{mlir}", "--megaslide-check-budget", "-o", "{out}"]),
    ("megaslide-translate", ["--emit-dsa-kernels", "{missing}", "-o",
                             "{outdir}"]),
], ids=["plan bad model", "plan bad budget", "run bad weights",
        "run bad lr", "opt missing input", "opt failing pass",
        "translate missing input"])
def test_failed_run_keeps_existing_output(art, tmp_path, tool, args):
    out = tmp_path / "existing.txt"
    out.write_text("the user's earlier output\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "manifest.json").write_text("{}\n")
    before = tree_hashes(tmp_path)
    fill = dict(out=out, outdir=tmp_path / "kernels", mlir=art.mlir,
                missing=tmp_path / "missing")
    result = run_tool(tool, [a.format(**fill) for a in args])
    assert result.returncode == 1, result.out
    assert tree_hashes(tmp_path) == before


def test_python_save_weights_into_read_only_directory(art, tmp_path, trainer):
    if not hasattr(trainer, "save_weights"):
        pytest.skip("this build's Trainer has no save_weights")
    w = tmp_path / "weights"
    shutil.copytree(art.weights, w)
    before = tree_hashes(tmp_path)
    with read_only(w):
        with pytest.raises(ValueError, match=str(w)):
            trainer.save_weights(w)
    assert tree_hashes(tmp_path) == before


# ---------------------------------------------------------------------------
# Command lines of the four tools
# ---------------------------------------------------------------------------

# (name, tool, argv, exit code, message); {tmp} is a fresh directory,
# {dsa} the module with 3D-DSA ops, {file} an existing regular file.
CLI_CASES = [
    # megaslide-plan
    ("plan: no model", "megaslide-plan", [*SMALL], 1,
     "--model is required: one of the presets dit-xl-2, megaslide-105b, tiny, "
     "wan2.1-flf2v-14b, wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p, "
     "wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-i2v-a14b, wan2.2-t2v-a14b, "
     "wan2.2-ti2v-5b, or a path to a .json config"),
    ("plan: unknown flag", "megaslide-plan", ["--model", "tiny", "--nosuch"],
     1, "Unknown command line argument '--nosuch'"),
    ("plan: integer flag not a number", "megaslide-plan",
     ["--model", "tiny", "--frames", "x"], 1,
     "for the --frames option: 'x' value invalid"),
    ("plan: unknown format", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--format", "xml"], 1,
     "for the --format option: Cannot find option named 'xml'"),
    ("plan: no video size", "megaslide-plan", ["--model", "tiny"], 1,
     "--frames, --height and --width are required"),
    ("plan: unknown preset", "megaslide-plan", ["--model", "tinny", *SMALL], 1,
     "unknown model preset 'tinny'; use one of dit-xl-2, megaslide-105b, "
     "tiny, wan2.1-flf2v-14b, wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p, "
     "wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-i2v-a14b, wan2.2-t2v-a14b, "
     "wan2.2-ti2v-5b, or a path to a .json config"),
    ("plan: zero frames", "megaslide-plan",
     ["--model", "tiny", "--frames", "0", "--height", "32", "--width", "32"],
     1, "video field 'frames': must be positive, got 0"),
    ("plan: frames off the VAE grid", "megaslide-plan",
     ["--model", "tiny", "--frames", "6", "--height", "32", "--width", "32"],
     1, "video field 'frames': 6 does not fit the VAE and patch; it must be "
     "1 + 4 k with (k + 1) divisible by the patch 1; use 5 or 9"),
    ("plan: height at int64 max", "megaslide-plan",
     ["--model", "tiny", "--frames", "5", "--height", str(2**63 - 1),
      "--width", "32"], 1,
     "video field 'height': 9223372036854775807 does not fit the VAE and "
     "patch; it must be a multiple of the VAE stride 8 x patch 2; use "
     "9223372036854775792"),
    ("plan: too many tokens", "megaslide-plan",
     ["--model", "tiny", "--frames", "4000000000001", "--height", "1600000",
      "--width", "1600000"], 1, "more than 2^31 tokens per sample"),
    ("plan: DiT video", "megaslide-plan",
     ["--model", "dit-xl-2", *SMALL], 1,
     "video field 'frames': 5 frames given, but DiT models images; use "
     "--frames 1"),
    ("plan: zero batch", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--batch", "0"], 1,
     "option 'batch': must be positive, got 0"),
    ("plan: batch overflow", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--batch", str(2**62)], 1,
     "option 'batch': 4611686018427387904 samples of 16 tokens are more than "
     "2^31 tokens per step"),
    ("plan: zero text length", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--text-len", "0"], 1,
     "option 'text_len': must be positive, got 0"),
    ("plan: text length overflow", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--text-len", str(2**62)], 1,
     "option 'text_len': 4611686018427387904 is larger than 131072"),
    ("plan: text length for DiT", "megaslide-plan",
     ["--model", "dit-xl-2", "--frames", "1", "--height", "256", "--width",
      "256", "--text-len", "8"], 1,
     "option 'text_len': dit-xl-2 is class-conditional and has no text "
     "tokens"),
    ("plan: lr not a number", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--lr", "nan"], 1,
     "--lr must be a positive number"),
    ("plan: negative lr", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--lr", "-1"], 1,
     "--lr must be a positive number"),
    ("plan: negative weight decay", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--weight-decay", "-1"], 1,
     "--weight-decay must be a non-negative number"),
    ("plan: budget not a size", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--gpu-mem", "abc"], 1,
     "option 'gpu-mem': 'abc' is not a memory size; write e.g. 141GB, 1.5TB "
     "(decimal) or 80GiB, 1.5TiB (binary)"),
    ("plan: negative budget", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--host-mem", "-5GB"], 1,
     "option 'host-mem': '-5GB' is not a memory size"),
    ("plan: zero budget", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--gpu-mem", "0"], 1,
     "option 'gpu-mem': a budget must be positive"),
    ("plan: budget beyond 2^63 bytes", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--gpu-mem", "99999999999TB"], 1,
     "option 'gpu-mem': '99999999999TB' is too large: a memory size must be "
     "below 2^63 bytes"),
    ("plan: reserve not a size", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--gpu-reserve", "lots"], 1,
     "option 'gpu-reserve': 'lots' is not a memory size"),
    ("plan: allowance not a size", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--os-allowance", "x"], 1,
     "option 'os-allowance': 'x' is not a memory size"),
    ("plan: unknown activation policy", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--activation-policy", "foo"], 1,
     "option 'activation-policy': unknown value 'foo'; use one of keep, "
     "recompute, offload, auto"),
    ("plan: unknown host-state policy", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--host-state-policy", "foo"], 1,
     "option 'host-state-policy': unknown value 'foo'; use one of "
     "master-moments, persistent-bf16, bf16-moments, int8-moments, "
     "factored-moments"),
    ("plan: unknown attention", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--attention", "foo"], 1,
     "option 'attention': unknown value 'foo'; use one of dsa, global"),
    ("plan: unknown precision", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--precision", "fp8"], 1,
     "option 'precision': unknown value 'fp8'; use one of bf16, f32"),
    ("plan: bf16 copy of an f32 step", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--host-state-policy", "persistent-bf16",
      "--precision", "f32"], 1,
     "option 'host-state-policy': 'persistent-bf16' keeps a bf16 working "
     "copy"),
    ("plan: window of two", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--dsa-window", "1,2"], 1,
     "options 'window' and 'tile' need three positive extents (t,y,x)"),
    ("plan: tile of zero", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--dsa-tile", "0,4,4"], 1,
     "options 'window' and 'tile' need three positive extents (t,y,x)"),
    ("plan: negative radius", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--dsa-radius", "-1"], 1,
     "'radius' must be non-negative"),
    ("plan: zero buffers", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--buffers", "0"], 1,
     "options 'buffers' (>= 1) and 'prefetch-distance' (>= 0) are out of "
     "range"),
    ("plan: negative prefetch", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--prefetch", "-1"], 1,
     "options 'buffers' (>= 1) and 'prefetch-distance' (>= 0) are out of "
     "range"),
    ("plan: hardware file missing", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--hw", "{tmp}/hw.json"], 1,
     "cannot read hardware description '{tmp}/hw.json'"),
    ("plan: hardware file not JSON", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--hw", "{dsa}"], 1, "invalid JSON"),
    ("plan: hardware file deeply nested", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--hw", "{deep}"], 1,
     "nested more than 256 levels deep"),
    ("plan: hardware field unknown", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--hw", "{hw_unknown}"], 1,
     "hardware field 'pcie_bandwith': unknown field; see docs/CostModel.md"),
    ("plan: hardware field infinite", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--hw", "{hw_infinite}"], 1,
     "hardware field 'h2d_bandwidth': expected a finite number in B/s"),
    ("plan: hardware field zero", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--hw", "{hw_zero}"], 1,
     "hardware field 'h2d_bandwidth': expected a positive number in B/s"),
    ("plan: report into a missing directory", "megaslide-plan",
     ["--model", "tiny", *SMALL, "-o", "{tmp}/no/such/dir/r.txt"], 1,
     "cannot write '{tmp}/no/such/dir/r.txt': No such file or directory"),
    ("plan: module into a directory", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--emit-mlir", "{tmp}"], 1,
     "cannot write '{tmp}': Is a directory"),
    ("plan: does not fit", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--gpu-mem", "1KB"], 3,
     "device memory plan needs"),
    # megaslide-run
    ("run: no model", "megaslide-run", ["--steps", "1"], 1,
     "--model is required (a preset name or a .json config), unless --plan "
     "FILE runs a saved execution plan"),
    ("run: unknown flag", "megaslide-run", ["--model", "tiny", "--nosuch"], 1,
     "Unknown command line argument '--nosuch'"),
    ("run: steps not a number", "megaslide-run",
     ["--model", "tiny", "--steps", "abc"], 1,
     "for the --steps option: 'abc' value invalid"),
    ("run: unknown backend", "megaslide-run",
     [*RUN, "--backend", "tpu", "--steps", "1"], 1,
     "unknown backend 'tpu' (use cpu, cuda or sim)"),
    ("run: negative steps", "megaslide-run", [*RUN, "--steps", "-1"], 1,
     "--steps must be non-negative"),
    ("run: negative checkpoint interval", "megaslide-run",
     [*RUN, "--checkpoint-every", "-1"], 1,
     "--checkpoint-every must be non-negative"),
    ("run: resume without a directory", "megaslide-run",
     [*RUN, "--resume"], 1,
     "--resume, --checkpoint-every and --overwrite-checkpoints need "
     "--checkpoint-dir"),
    ("run: part of a video size", "megaslide-run",
     ["--model", "tiny", "--frames", "17"], 1,
     "give all of --frames, --height and --width, or none"),
    ("run: sim holds no state", "megaslide-run",
     [*RUN, "--backend", "sim", "--save-weights", "{tmp}/w"], 1,
     "the sim backend holds no model state"),
    ("run: checkpoint directory is a file", "megaslide-run",
     [*RUN, "--checkpoint-dir", "{file}"], 1,
     "--checkpoint-dir: '{file}' exists and is not a directory"),
    ("run: weights directory is a file", "megaslide-run",
     [*RUN, "--save-weights", "{file}"], 1,
     "--save-weights: '{file}' exists and is not a directory"),
    ("run: plan into a missing directory", "megaslide-run",
     [*RUN, "--steps", "0", "--save-plan", "{tmp}/no/dir/p.json"], 1,
     "cannot write '{tmp}/no/dir/p.json'"),
    ("run: metrics into a missing directory", "megaslide-run",
     [*RUN, "--steps", "1", "--metrics", "{tmp}/no/dir/m.jsonl"], 1,
     "cannot write '{tmp}/no/dir/m.jsonl'"),
    ("run: trace into a missing directory", "megaslide-run",
     [*RUN, "--steps", "1", "--trace", "{tmp}/no/dir/t.json"], 1,
     "{tmp}/no/dir/t.json"),
    ("run: data directory missing", "megaslide-run",
     [*RUN, "--steps", "1", "--data", "{tmp}/no-data", "--init", "random"], 1,
     "{tmp}/no-data"),
    ("run: data sample corrupt", "megaslide-run",
     [*RUN, "--steps", "1", "--data", "{bad_data}", "--init", "random"], 1,
     "sample.safetensors"),
    ("run: lr that diverges", "megaslide-run",
     [*RUN, "--steps", "6", "--lr", "1e30"], 1,
     "3 steps in a row had a non-finite loss"),
    ("run: does not fit", "megaslide-run",
     [*RUN, "--steps", "1", "--gpu-mem", "1KB"], 3,
     "device memory plan needs"),
    # megaslide-opt
    ("opt: unknown flag", "megaslide-opt", ["--nosuch"], 1,
     "Unknown command line argument '--nosuch'"),
    ("opt: missing input", "megaslide-opt", ["{tmp}/missing.mlir"], 1,
     "cannot open input file '{tmp}/missing.mlir': No such file or directory"),
    ("opt: directory as input", "megaslide-opt", ["{tmp}"], 1,
     "cannot open input file '{tmp}': Is a directory"),
    ("opt: pass option not a number", "megaslide-opt",
     ["{dsa}", "--megaslide-pipeline=buffers=x"], 1,
     "for the --buffers option: 'x' value invalid"),
    ("opt: output into a missing directory", "megaslide-opt",
     ["{dsa}", "-o", "{tmp}/no/dir/out.mlir"], 1, "{tmp}/no/dir/out.mlir"),
    # megaslide-translate
    ("translate: nothing to do", "megaslide-translate", ["{dsa}"], 1,
     "nothing to do: pass --emit-dsa-kernels"),
    ("translate: unknown flag", "megaslide-translate", ["--nosuch"], 1,
     "Unknown command line argument '--nosuch'"),
    ("translate: missing input", "megaslide-translate",
     ["--emit-dsa-kernels", "{tmp}/missing.mlir"], 1,
     "cannot open input file '{tmp}/missing.mlir'"),
    ("translate: cubin without a directory", "megaslide-translate",
     ["--emit-dsa-kernels", "{dsa}", "--cubin", "sm_90a"], 1,
     "--cubin needs an output directory (-o DIR)"),
    ("translate: split input with a directory", "megaslide-translate",
     ["--emit-dsa-kernels", "{dsa}", "--split-input-file", "-o", "{tmp}/k"], 1,
     "--split-input-file and --verify-diagnostics write to stdout: drop -o"),
    ("translate: output directory is a file", "megaslide-translate",
     ["--emit-dsa-kernels", "{dsa}", "-o", "{file}"], 1,
     "error: cannot write '{file}/"),
]


@pytest.fixture
def cli_fill(art, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    regular = tmp_path / "a-file.txt"
    regular.write_text("not a directory\n")
    deep = tmp_path / "deep.json"
    deep.write_text('{"name": ' + deep_json() + "}")
    hw_unknown = tmp_path / "hw-unknown.json"
    hw_unknown.write_text('{"pcie_bandwith": 5e10}')
    hw_infinite = tmp_path / "hw-infinite.json"
    hw_infinite.write_text('{"h2d_bandwidth": 1e999}')
    hw_zero = tmp_path / "hw-zero.json"
    hw_zero.write_text('{"h2d_bandwidth": 0}')
    bad_data = tmp_path / "data"
    bad_data.mkdir()
    (bad_data / "sample.safetensors").write_bytes(b"\x05\0\0\0")
    return dict(tmp=work, dsa=art.dsa_mlir, file=regular, deep=deep,
                hw_unknown=hw_unknown, hw_infinite=hw_infinite,
                hw_zero=hw_zero, bad_data=bad_data)


@pytest.mark.parametrize("name,tool,argv,code,message", CLI_CASES,
                         ids=[c[0] for c in CLI_CASES])
def test_cli(cli_fill, name, tool, argv, code, message):
    result = run_tool(tool, [a.format(**cli_fill) for a in argv])
    check_failure(result, code, message.format(**cli_fill))


def test_cli_help_and_version_exit_zero():
    for tool in ("megaslide-opt", "megaslide-plan", "megaslide-run",
                 "megaslide-translate"):
        for flag in ("--help", "--version"):
            result = run_tool(tool, [flag])
            assert result.returncode == 0, (tool, flag, result.out)
            assert "megaslide" in result.out.lower()


def test_cli_run_plan_needs_no_model(art):
    result = run_tool("megaslide-run", ["--plan", art.plan, "--steps", "1",
                                        "--no-progress"])
    assert result.returncode == 0, result.out


def test_cli_translate_nvrtc_failure(art, tmp_path):
    """A bad --cubin architecture is NVRTC's error, exit 1 (or, without
    NVRTC, the reason it is missing)."""
    result = run_tool("megaslide-translate",
                      ["--emit-dsa-kernels", art.dsa_mlir, "-o",
                       tmp_path / "k", "--cubin", "sm_00"])
    check_failure(result, 1, "megaslide-translate: error: ")
    assert ("NVRTC failed to compile" in result.out or
            "--cubin: " in result.out), result.out


# ---------------------------------------------------------------------------
# Python arguments
# ---------------------------------------------------------------------------

Q = np.zeros((1, 1, 2, 4, 4, 8), np.float32)
OFFSETS = np.zeros((1, 1, 2, 2, 2, 1, 2), np.int32)
W3, T3 = (1, 2, 2), (1, 2, 2)


def vec(n=4, dtype=np.float32):
    return np.zeros(n, dtype)


def read_only_array():
    a = vec()
    a.flags.writeable = False
    return a


def adamw(**changes):
    args = dict(master=vec(), exp_avg=vec(), exp_avg_sq=vec(), grad=vec(),
                step=1, lr=1e-3)
    args.update(changes)
    return lambda art: megaslide.adamw_step(**args)


def trainer_call(method, *args, **kwargs):
    def call(art):
        tr = megaslide.Trainer(plan_json=art.plan_text)
        return getattr(tr, method)(*args, **kwargs)
    return call


def step_inputs(**changes):
    def call(art):
        tr = megaslide.Trainer(plan_json=art.plan_text)
        inputs = {k: np.zeros(s, np.float32)
                  for k, s in tr.input_shapes().items()}
        inputs.update(changes)
        inputs = {k: v for k, v in inputs.items() if v is not None}
        return tr.step(**inputs)
    return call


# (name, call taking the artifacts, exception type, message)
PYTHON_CASES = [
    ("model_info: model not a str",
     lambda art: megaslide.model_info(3, 5, 32, 32), TypeError,
     "model must be a str, got int"),
    ("model_info: frames a float",
     lambda art: megaslide.model_info("tiny", 5.0, 32, 32), TypeError,
     "frames must be an int, got float"),
    ("model_info: zero height",
     lambda art: megaslide.model_info("tiny", 5, 0, 32), ValueError,
     "height must be positive, got 0"),
    ("model_info: unknown preset",
     lambda art: megaslide.model_info("tinny", 5, 32, 32), ValueError,
     "unknown model preset 'tinny'"),
    ("model_info: off the VAE grid",
     lambda art: megaslide.model_info("tiny", 6, 32, 32), ValueError,
     "video field 'frames': 6 does not fit the VAE and patch"),
    ("model_info: batch overflow",
     lambda art: megaslide.model_info("tiny", 5, 32, 32, batch=2**62),
     ValueError, "more than 2^31 tokens per step"),
    ("plan: budget not a str",
     lambda art: megaslide.plan("tiny", 5, 32, 32, gpu_mem=80), TypeError,
     "gpu_mem must be a str such as '141GB', got int"),
    ("plan: budget not a size",
     lambda art: megaslide.plan("tiny", 5, 32, 32, gpu_mem="80XB"),
     ValueError, "option 'gpu-mem': '80XB' is not a memory size"),
    ("plan: budget beyond 2^63 bytes",
     lambda art: megaslide.plan("tiny", 5, 32, 32, host_mem="1e30TB"),
     ValueError, "option 'host-mem': '1e30TB' is too large"),
    ("plan: unknown option",
     lambda art: megaslide.plan("tiny", 5, 32, 32, foo=1), TypeError,
     "plan() got an unexpected option 'foo'"),
    ("plan: window of two",
     lambda art: megaslide.plan("tiny", 5, 32, 32, dsa_window=(1, 2)),
     TypeError, "dsa_window must be three ints (t, y, x), got (1, 2)"),
    ("plan: window of zeros",
     lambda art: megaslide.plan("tiny", 5, 32, 32, dsa_window=(0, 0, 0)),
     ValueError, "options 'window' and 'tile' need three positive extents"),
    ("plan: unknown policy",
     lambda art: megaslide.plan("tiny", 5, 32, 32, activation_policy="foo"),
     ValueError, "option 'activation-policy': unknown value 'foo'"),
    ("plan: buffers a str",
     lambda art: megaslide.plan("tiny", 5, 32, 32, buffers="2"), TypeError,
     "buffers must be a int, got str"),
    ("plan: hardware file deeply nested",
     lambda art: megaslide.plan("tiny", 5, 32, 32, hw=os.fspath(
         art.dir / "deep-hw.json")), ValueError,
     "nested more than 256 levels deep"),
    ("exec_plan: lr not a number",
     lambda art: megaslide.exec_plan("tiny", 5, 32, 32, lr=float("nan")),
     ValueError, "lr must be a positive number, got nan"),
    ("exec_plan: over budget",
     lambda art: megaslide.exec_plan("tiny", 5, 32, 32, gpu_mem="1KB"),
     ValueError, "does not fit its budgets"),
    ("Trainer: unknown backend",
     lambda art: megaslide.Trainer("tiny", 5, 32, 32, backend="tpu"),
     ValueError, "backend must be cpu, cuda or sim, got 'tpu'"),
    ("model_info: NUL in the model name",
     lambda art: megaslide.model_info("tiny\0junk", 5, 32, 32), ValueError,
     "model contains a NUL character"),
    ("plan: NUL in a path option",
     lambda art: megaslide.plan("tiny", 5, 32, 32, hw="configs/h200.json\0"),
     ValueError, "hw contains a NUL character"),
    ("parse_module: NUL in the IR",
     lambda art: megaslide.parse_module("module {}\0 garbage"), ValueError,
     "ir contains a NUL character"),
    ("run_pipeline: NUL in an option",
     lambda art: megaslide.run_pipeline("module {}", "megaslide-check-budget",
                                        gpu_mem="1GB\0"), ValueError,
     "pipeline option 'gpu_mem' contains a NUL character"),
    ("Trainer: NUL in the model name",
     lambda art: megaslide.Trainer("tiny\0x", 5, 32, 32), ValueError,
     "model contains a NUL character"),
    ("Trainer: NUL in the plan path",
     lambda art: megaslide.Trainer(plan_file="plan.json\0x"), ValueError,
     "plan_file contains a NUL character"),
    ("model_info: frames beyond int64",
     lambda art: megaslide.model_info("tiny", 2**64, 32, 32), ValueError,
     "frames must be at most 2^63 - 1, got 18446744073709551616"),
    ("plan: text_len beyond int64",
     lambda art: megaslide.plan("tiny", 5, 32, 32, text_len=2**63),
     ValueError, "text_len must be at most 2^63 - 1"),
    ("memory_plan: width beyond int64",
     lambda art: megaslide.memory_plan("tiny", 5, 32, 2**70), ValueError,
     "width must be at most 2^63 - 1"),
    ("Trainer: seed beyond uint64",
     lambda art: megaslide.Trainer("tiny", 5, 32, 32, seed=2**64),
     ValueError, "seed must be at most 2^64 - 1"),
    ("Trainer: negative seed",
     lambda art: megaslide.Trainer("tiny", 5, 32, 32, seed=-1), ValueError,
     "seed must be a non-negative int, got -1"),
    ("Trainer: nothing to run", lambda art: megaslide.Trainer(), ValueError,
     "give a model"),
    ("Trainer: plan as bytes",
     lambda art: megaslide.Trainer(plan_json=art.plan_text.encode()),
     TypeError, "plan_json must be a str, got bytes"),
    ("Trainer: step input missing", step_inputs(noise=None), ValueError,
     "missing step input 'noise'"),
    ("Trainer: step input misshapen",
     step_inputs(latents=np.zeros((1, 2), np.float32)), ValueError,
     "step input 'latents' has shape (1, 2); the plan expects "
     "(1, 16, 2, 4, 4)"),
    ("Trainer: unknown parameter",
     trainer_call("load_parameters", {"nope": vec()}), ValueError,
     "load_parameters: the plan has no parameter 'nope'"),
    ("Trainer: misshapen parameter",
     trainer_call("load_parameters", {"patch_embedding.bias": vec(3)}),
     ValueError,
     "load_parameters: 'patch_embedding.bias' has shape (3,); the plan "
     "expects (64,)"),
    ("dsa3d: float64",
     lambda art: megaslide.dsa3d(Q.astype(np.float64), Q, Q, OFFSETS, W3, T3),
     TypeError, "q must have dtype float32, got float64"),
    ("dsa3d: five dimensions",
     lambda art: megaslide.dsa3d(Q[0], Q[0], Q[0], OFFSETS, W3, T3),
     ValueError, "q must have shape (B, H, T, Y, X, D)"),
    ("dsa3d: empty grid",
     lambda art: megaslide.dsa3d_offsets(Q[:, :, :0], Q[:, :, :0], W3, T3, 1),
     ValueError, "every dimension of (B, H, T, Y, X, D) must be positive"),
    ("dsa3d: k of another shape",
     lambda art: megaslide.dsa3d(Q, Q[:, :, :1], Q, OFFSETS, W3, T3),
     ValueError,
     "k has shape (1, 1, 1, 4, 4, 8), expected (1, 1, 2, 4, 4, 8)"),
    ("dsa3d: window beyond the grid",
     lambda art: megaslide.dsa3d_offsets(Q, Q, (3, 5, 5), T3, 1), ValueError,
     "window (3, 5, 5) exceeds the token grid"),
    ("dsa3d: window beyond int64",
     lambda art: megaslide.dsa3d_offsets(Q, Q, (1, 1, 2**64), T3, 1),
     ValueError, "window must be at most 2^63 - 1"),
    ("dsa3d: radius beyond int64",
     lambda art: megaslide.dsa3d_offsets(Q, Q, W3, T3, 2**63), ValueError,
     "radius must be at most 2^63 - 1"),
    ("dsa3d: window of two",
     lambda art: megaslide.dsa3d(Q, Q, Q, OFFSETS, (1, 2), T3), TypeError,
     "window must be a tuple of 3 ints"),
    ("dsa3d: offsets misshapen",
     lambda art: megaslide.dsa3d(Q, Q, Q, OFFSETS[:, :, :1], W3, T3),
     ValueError, "offsets has shape (1, 1, 1, 2, 2, 1, 2), expected"),
    ("dsa3d: offsets int64",
     lambda art: megaslide.dsa3d(Q, Q, Q, OFFSETS.astype(np.int64), W3, T3),
     TypeError, "offsets must have dtype int32, got int64"),
    ("dsa3d: infinite scale",
     lambda art: megaslide.dsa3d(Q, Q, Q, OFFSETS, W3, T3, scale=float("inf")),
     ValueError, "scale must be positive and finite, got inf"),
    ("dsa3d: negative radius",
     lambda art: megaslide.dsa3d_offsets(Q, Q, W3, T3, -1), ValueError,
     "radius must be non-negative, got -1"),
    ("adamw: read-only master", adamw(master=read_only_array()), ValueError,
     "master must be writeable"),
    ("adamw: aliased buffers",
     lambda art: (lambda m: megaslide.adamw_step(m, m, vec(), vec(), step=1,
                                                 lr=1e-3))(vec()),
     ValueError, "master and exp_avg overlap in memory"),
    ("adamw: step zero", adamw(step=0), ValueError, "step must be >= 1"),
    ("adamw: step beyond int64", adamw(step=2**63), ValueError,
     "step must be at most 2^63 - 1"),
    ("adamw: negative lr", adamw(lr=-1.0), ValueError, "lr must be in [0.0, "),
    ("adamw: beta of one", adamw(beta1=1.0), ValueError,
     "beta1 must be in [0.0, 1.0)"),
    ("adamw: grad float64", adamw(grad=vec(dtype=np.float64)), TypeError,
     "grad must have dtype uint16 or float32, got float64"),
    ("adamw: grad of another shape", adamw(grad=vec(5)), ValueError,
     "grad has shape (5,), expected (4,)"),
    ("adamw: not contiguous", adamw(master=np.zeros(8, np.float32)[::2]),
     ValueError, "master must be C-contiguous"),
    ("adamw: master a list", adamw(master=[0.0] * 4), TypeError,
     "master must be a numpy.ndarray, got list"),
]


@pytest.mark.parametrize("name,call,exc_type,message", PYTHON_CASES,
                         ids=[c[0] for c in PYTHON_CASES])
def test_python(art, name, call, exc_type, message):
    (art.dir / "deep-hw.json").write_text('{"name": ' + deep_json() + "}")
    with pytest.raises(Exception) as e:
        call(art)
    check_exception(e.value, exc_type, message)


def test_python_huge_radius_is_capped():
    """A radius beyond the grid finds the same offsets as one of the grid's
    extent (it used to exhaust memory)."""
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 2, 8, 8, 4)).astype(np.float32)
            for _ in range(2))
    capped = megaslide.dsa3d_offsets(q, k, (1, 3, 3), (1, 4, 4), 8)
    huge = megaslide.dsa3d_offsets(q, k, (1, 3, 3), (1, 4, 4), 2**40)
    assert np.array_equal(capped, huge)


# ---------------------------------------------------------------------------
# Bounded readers: FIFOs, devices and oversized files (issue 11, item 11)
# ---------------------------------------------------------------------------
#
# Every reader opens regular files only, without blocking, and reads at most
# what its format allows (docs/Runtime.md, "Limits"). Before, a FIFO named
# x.safetensors in --data hung the run forever, and `latest` symlinked to
# /dev/zero read until memory ran out. The tools run under a timeout and an
# address-space limit, so a reader that regresses fails its case quickly
# instead of hanging the suite or exhausting the machine.

READER_TIMEOUT = 60  # seconds; a reader blocked on a FIFO never returns
# Address space of the tool: tiny runs in under 1 GiB. malloc's per-thread
# arenas (64 MiB of address space each) are capped so that the limit does
# not depend on the number of cores.
READER_MEMORY = 8 << 30
FIFO = "it is a FIFO (named pipe), not a regular file"


def run_bounded(tool, args):
    def limit_memory():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (READER_MEMORY, READER_MEMORY))
    try:
        result = subprocess.run([tool_path(tool), *map(os.fspath, args)],
                                capture_output=True, timeout=READER_TIMEOUT,
                                preexec_fn=limit_memory,
                                env={**os.environ, "MALLOC_ARENA_MAX": "4"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{tool} did not return within {READER_TIMEOUT} s "
                    f"(blocked on a FIFO?)")
    result.out = (result.stdout + result.stderr).decode("utf-8", "replace")
    return result


def many_tensors_header(n):
    """A header of `n` entries: valid JSON, so only a count made before the
    entries are checked refuses it with the limit's message."""
    return "{" + ",".join(f'"t{i}":0' for i in range(n)) + "}"


def reader_data_fifo(art, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "x.safetensors")
    return ("megaslide-run", [*RUN, "--steps", "1", "--data", data,
                              "--init", "random"],
            f"cannot open '{data}/x.safetensors': {FIFO}")


def reader_plan_fifo(art, tmp_path):
    os.mkfifo(tmp_path / "plan.json")
    return ("megaslide-run", ["--plan", tmp_path / "plan.json", "--steps",
                              "1", "--no-progress"],
            f"cannot read execution plan '{tmp_path}/plan.json': {FIFO}")


def reader_plan_device(art, tmp_path):
    os.symlink("/dev/zero", tmp_path / "plan.json")
    return ("megaslide-run", ["--plan", tmp_path / "plan.json", "--steps",
                              "1", "--no-progress"],
            f"cannot read execution plan '{tmp_path}/plan.json': it is a "
            f"character device, not a regular file")


def reader_plan_too_large(art, tmp_path):
    with open(tmp_path / "plan.json", "wb") as f:
        f.truncate((256 << 20) + 1)  # sparse
    return ("megaslide-run", ["--plan", tmp_path / "plan.json", "--steps",
                              "1", "--no-progress"],
            f"cannot read execution plan '{tmp_path}/plan.json': it is "
            f"268435457 bytes, over the limit of 268435456 bytes")


def reader_hw_fifo(art, tmp_path):
    os.mkfifo(tmp_path / "hw.json")
    return ("megaslide-plan", ["--model", "tiny", *SMALL, "--hw",
                               tmp_path / "hw.json"],
            f"cannot read hardware description '{tmp_path}/hw.json': {FIFO}")


def reader_config_fifo(art, tmp_path):
    os.mkfifo(tmp_path / "model.json")
    return ("megaslide-plan", ["--model", tmp_path / "model.json", *SMALL],
            f"cannot read model config '{tmp_path}/model.json': {FIFO}")


def reader_config_too_large(art, tmp_path):
    with open(tmp_path / "model.json", "wb") as f:
        f.truncate((1 << 20) + 1)
    return ("megaslide-plan", ["--model", tmp_path / "model.json", *SMALL],
            f"cannot read model config '{tmp_path}/model.json': it is "
            f"1048577 bytes, over the limit of 1048576 bytes")


def reader_weights_fifo(art, tmp_path):
    os.mkfifo(tmp_path / "w.safetensors")
    return ("megaslide-run", [*RUN, "--steps", "1", "--weights",
                              tmp_path / "w.safetensors"],
            f"cannot open '{tmp_path}/w.safetensors': {FIFO}")


def reader_weights_index_fifo(art, tmp_path):
    d = tmp_path / "weights"
    shutil.copytree(art.weights, d)
    os.mkfifo(d / INDEX)
    return ("megaslide-run", [*RUN, "--steps", "1", "--weights", d],
            f"cannot read '{d}/{INDEX}': {FIFO}")


def reader_weights_many_tensors(art, tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, None, b"",
                      raw_header=many_tensors_header(200_001).encode())
    return ("megaslide-run", [*RUN, "--steps", "1", "--weights", path],
            f"'{path}': the header lists more than 200000 tensors, the limit")


def reader_latest(make):
    def setup(art, tmp_path):
        d = tmp_path / "ckpt"
        shutil.copytree(art.ckpt, d)
        (d / "latest").unlink()
        make(d / "latest")
        return ("megaslide-run", [*RUN, "--steps", "1", "--checkpoint-dir",
                                  d, "--resume"], f"cannot read '{d}/latest'")
    return setup


def sparse(size):
    def make(path):
        with open(path, "wb") as f:
            f.write(b"step-000002\n")
            f.truncate(size)
    return make


READER_CASES = [
    ("--data sample a FIFO", reader_data_fifo, None),
    ("--plan a FIFO", reader_plan_fifo, None),
    ("--plan /dev/zero", reader_plan_device, None),
    ("--plan over 256 MiB", reader_plan_too_large, None),
    ("--hw a FIFO", reader_hw_fifo, None),
    ("--model config a FIFO", reader_config_fifo, None),
    ("--model config over 1 MiB", reader_config_too_large, None),
    ("--weights file a FIFO", reader_weights_fifo, None),
    ("--weights index a FIFO", reader_weights_index_fifo, None),
    ("--weights header of 200001 tensors", reader_weights_many_tensors, None),
    ("latest symlinked to /dev/zero",
     reader_latest(lambda p: os.symlink("/dev/zero", p)),
     "it is a character device, not a regular file"),
    ("latest a FIFO", reader_latest(os.mkfifo), FIFO),
    ("latest of 64 MiB", reader_latest(sparse(64 << 20)),
     "it is 67108864 bytes, over the limit of 4096 bytes"),
]


@pytest.mark.parametrize("name,setup,reason", READER_CASES,
                         ids=[c[0] for c in READER_CASES])
def test_reader_bounded(art, tmp_path, name, setup, reason):
    tool, args, message = setup(art, tmp_path)
    result = run_bounded(tool, args)
    check_failure(result, 1, message)
    if reason:
        check_failure(result, 1, reason)


def test_reader_python_plan_file_and_weights_fifo(tmp_path):
    """Trainer(plan_file=FIFO) and load_weights(FIFO) raise, not hang; in a
    child process, so that a regression cannot hang the suite."""
    import sys
    os.mkfifo(tmp_path / "plan.json")
    os.mkfifo(tmp_path / "w.safetensors")
    plan = str(tmp_path / "plan.json")
    weights = str(tmp_path / "w.safetensors")
    script = f"""
import megaslide
for call in (lambda: megaslide.Trainer(plan_file={plan!r}),
             lambda: megaslide.Trainer("tiny", 5, 32, 32).load_weights(
                 {weights!r})):
    try:
        call()
        print("no error")
    except ValueError as e:
        print(e)
"""
    try:
        out = subprocess.run([sys.executable, "-c", script], timeout=120,
                             capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail("Trainer blocked on a FIFO")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines == [
        f"cannot read plan file '{tmp_path}/plan.json': it is not a regular "
        f"file",
        f"cannot open '{tmp_path}/w.safetensors': {FIFO}"], out.stdout


# ---------------------------------------------------------------------------
# One validation for flags, configs, plans and hardware (issue 11, items 9,
# 10 and 14)
# ---------------------------------------------------------------------------
#
# The plan loader refuses what the command line refuses: AdamW
# hyper-parameters out of range (one rule, plan/HyperParameters.h), a batch
# beyond the planner's 2^31 tokens per step, an arena offset off the plan's
# alignment, a read of a value written on another stream without the
# record/wait pair ordering it. Hardware values that would make a figure
# non-finite are refused by field, so JSON reports are always valid JSON and
# the sim backend no longer exits 4. Errors for --latent sizes speak of
# latent elements. Before these fixes, every case here was accepted (or
# printed "inf").

def validation_adamw_attr(name, value):
    def edit(plan):
        for inst in plan["instructions"]:
            if inst["op"] == "host_adamw":
                inst.setdefault("attrs", {})[name] = value
    return edit


def validation_misalign_offset(plan):
    value = next(v for v in plan["values"] if v.get("home") == "device" and
                 "view_of" not in v and v["offset"] == 0)
    value["offset"] = plan["alignment"] // 2


def validation_delete_waits(stream=None):
    def edit(plan):
        plan["instructions"] = [
            i for i in plan["instructions"]
            if i["op"] != "wait" or (stream and i["stream"] != stream)]
    return edit


ADAMW = "('host_adamw'): attribute"
UNORDERED = "without waiting for an event recorded after that write"

# (name, plan edit, message)
VALIDATION_PLAN_CASES = [
    ("lr negative", validation_adamw_attr("lr", -1),
     f"{ADAMW} 'lr' must be a positive number, got -1"),
    ("lr zero", validation_adamw_attr("lr", 0),
     f"{ADAMW} 'lr' must be a positive number, got 0"),
    ("beta1 negative", validation_adamw_attr("beta1", -1),
     f"{ADAMW} 'beta1' must be in [0, 1), got -1"),
    ("beta2 above one", validation_adamw_attr("beta2", 1.5),
     f"{ADAMW} 'beta2' must be in [0, 1), got 1.5"),
    ("eps zero", validation_adamw_attr("eps", 0),
     f"{ADAMW} 'eps' must be a positive number, got 0"),
    ("eps negative", validation_adamw_attr("eps", -1e-8),
     f"{ADAMW} 'eps' must be a positive number, got -1e-08"),
    ("weight decay negative", validation_adamw_attr("weight_decay", -0.1),
     f"{ADAMW} 'weight_decay' must be a non-negative number, got -0.1"),
    ("misaligned arena offset", validation_misalign_offset,
     "is not a multiple of the alignment"),
    ("waits deleted", validation_delete_waits(), UNORDERED),
    ("host optimizer's waits deleted", validation_delete_waits("host"),
     f"('host_adamw') on stream host reads %"),
    ("batch of 10^12", set_key("batch", 10**12),
     "batch 1000000000000 of 8 tokens per sample is more than 2^31 tokens "
     "per step"),
]


@pytest.mark.parametrize("name,edit,message", VALIDATION_PLAN_CASES,
                         ids=[c[0] for c in VALIDATION_PLAN_CASES])
def test_validation_plan_run(art, tmp_path, name, edit, message):
    path = write_plan(art, tmp_path, plan_edit(edit))
    result = run_tool("megaslide-run", ["--plan", path, "--steps", "1",
                                        "--no-progress"])
    check_failure(result, 1, f"{path}: invalid execution plan: ")
    check_failure(result, 1, message)


@pytest.mark.parametrize("name,edit,message", VALIDATION_PLAN_CASES,
                         ids=[c[0] for c in VALIDATION_PLAN_CASES])
def test_validation_plan_python(art, name, edit, message):
    with pytest.raises(Exception) as e:
        megaslide.Trainer(plan_json=plan_edit(edit)(art)).step()
    check_exception(e.value, ValueError, message)


def test_validation_saved_plan_is_valid_as_saved(art):
    """The cases above corrupt a plan the loader accepts: the exporter's
    events cover every cross-stream read, offsets are aligned."""
    megaslide.Trainer(plan_json=art.plan_text)
    assert json.loads(art.plan_text)["batch"] == 1


# (name, hardware fields, message)
VALIDATION_HW_CASES = [
    ("bandwidth 1e-308", {"h2d_bandwidth": 1e-308},
     "hardware field 'h2d_bandwidth': expected a number in [1e6, 1e15] B/s, "
     "got 1e-308"),
    ("bandwidth 1e300", {"hbm_bandwidth": 1e300},
     "hardware field 'hbm_bandwidth': expected a number in [1e6, 1e15] B/s, "
     "got 1e+300"),
    ("rate 1e-300", {"vector_flops": 1e-300},
     "hardware field 'vector_flops': expected a number in [1e6, 1e18] "
     "FLOP/s, got 1e-300"),
    ("efficiency 1e-300", {"gemm_efficiency": 1e-300},
     "hardware field 'gemm_efficiency': an efficiency is a fraction in "
     "[0.001, 1], got 1e-300"),
    ("removed field", {"attention_efficiency": 0.55},
     "hardware field 'attention_efficiency': no longer a field: replaced by "
     "one efficiency per kernel family"),
    ("optimizer 1 param/s", {"host_adamw_params_per_second": 1},
     "hardware field 'host_adamw_params_per_second': expected a number in "
     "[1e3, 1e15] params/s, got 1"),
    ("latency of an hour", {"launch_latency": 3600},
     "hardware field 'launch_latency': expected a number in (0, 1] s, "
     "got 3600"),
]


def validation_hw(tmp_path, fields):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(fields))
    return path


def strict_json(text):
    """json.loads that also refuses NaN and Infinity (Python's extension)."""
    def refuse(constant):
        raise ValueError(f"non-finite number {constant} in JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("name,fields,message", VALIDATION_HW_CASES,
                         ids=[c[0] for c in VALIDATION_HW_CASES])
def test_validation_hardware_plan_json(tmp_path, name, fields, message):
    hw = validation_hw(tmp_path, fields)
    result = run_tool("megaslide-plan", ["--model", "tiny", *SMALL, "--hw",
                                         hw, "--format", "json"])
    check_failure(result, 1, f"{hw}: {message}")


@pytest.mark.parametrize("name,fields,message", VALIDATION_HW_CASES,
                         ids=[c[0] for c in VALIDATION_HW_CASES])
def test_validation_hardware_sim_run(tmp_path, name, fields, message):
    """Exit 1 naming the field, not 4 ("measured device memory differs")."""
    hw = validation_hw(tmp_path, fields)
    result = run_tool("megaslide-run", [*RUN, "--backend", "sim", "--steps",
                                        "1", "--hw", hw])
    check_failure(result, 1, f"{hw}: {message}")


@pytest.mark.parametrize("name,fields,message", VALIDATION_HW_CASES,
                         ids=[c[0] for c in VALIDATION_HW_CASES])
def test_validation_hardware_python(tmp_path, name, fields, message):
    """A ValueError naming the field, never json.JSONDecodeError."""
    hw = os.fspath(validation_hw(tmp_path, fields))
    with pytest.raises(Exception) as e:
        megaslide.plan("tiny", 5, 32, 32, hw=hw)
    check_exception(e.value, ValueError, message)
    with pytest.raises(Exception) as e:
        megaslide.Trainer("tiny", 5, 32, 32, backend="sim", hw=hw)
    check_exception(e.value, ValueError, message)


def validation_extreme_hw(low):
    fields = {}
    for key in megaslide.plan("tiny", 5, 32, 32)["hardware"]:
        if key == "name":
            continue
        fields[key] = (
            (1e-3 if low else 1) if key.endswith("efficiency") else
            (1e-9 if low else 1) if key.endswith("latency") else
            (1e3 if low else 1e15) if key == "host_adamw_params_per_second"
            else (1e6 if low else 1e18) if key.endswith("flops") else
            (1e6 if low else 1e15))
    return fields


@pytest.mark.parametrize("low", [True, False], ids=["lowest", "highest"])
def test_validation_hardware_at_the_ends_of_the_ranges(tmp_path, low):
    """Every field at the end of its range: valid JSON with finite figures,
    and the sim backend measures the planned memory (exit 0, not 4)."""
    hw = validation_hw(tmp_path, validation_extreme_hw(low))
    result = run_tool("megaslide-plan", ["--model", "tiny", *SMALL, "--hw",
                                         hw, "--format", "json"])
    assert result.returncode == 0, result.out
    report = strict_json(result.stdout.decode())
    assert 0 < report["step"]["predicted_seconds"] < float("inf")
    planned = strict_json(json.dumps(megaslide.plan("tiny", 5, 32, 32,
                                                    hw=os.fspath(hw))))
    assert planned["step"] == report["step"]
    result = run_tool("megaslide-run", [*RUN, "--backend", "sim", "--steps",
                                        "1", "--hw", hw])
    assert result.returncode == 0, result.out


# (name, tool, arguments, message)
VALIDATION_CLI_CASES = [
    ("plan: lr zero", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--lr", "0"],
     "--lr must be a positive number, got 0"),
    ("plan: lr infinite", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--lr", "inf"],
     "--lr must be a positive number, got inf"),
    ("run: weight decay negative", "megaslide-run",
     [*RUN, "--steps", "1", "--weight-decay", "-0.5"],
     "--weight-decay must be a non-negative number, got -0.5"),
    ("plan: batch of 10^12", "megaslide-plan",
     ["--model", "tiny", *SMALL, "--batch", str(10**12)],
     "more than 2^31 tokens per step"),
    ("plan: latent size off the patch", "megaslide-plan",
     ["--model", "tiny", "--latent", "--frames", "2", "--height", "9",
      "--width", "8"],
     "video field 'height': 9 latent elements do not fit the patch; it must "
     "be a multiple of the patch 2; use 8 or 10"),
    ("plan: latent size beyond 2^31 tokens", "megaslide-plan",
     ["--model", "tiny", "--latent", "--frames", "2000000", "--height",
      "100000", "--width", "100000"],
     "video: 2000000 x 100000 x 100000 latent elements give more than 2^31 "
     "tokens per sample"),
]


@pytest.mark.parametrize("name,tool,argv,message", VALIDATION_CLI_CASES,
                         ids=[c[0] for c in VALIDATION_CLI_CASES])
def test_validation_cli(name, tool, argv, message):
    result = run_tool(tool, argv)
    check_failure(result, 1, message)
    assert "pixels" not in result.out, result.out


def test_validation_config_learning_rate(art, tmp_path):
    path = write_config(art, tmp_path, tiny_with(learning_rate=-1))
    check_failure(run_tool("megaslide-plan", ["--model", path, *SMALL]), 1,
                  "config field 'learning_rate': must be a positive number, "
                  "got -1")
    with pytest.raises(Exception) as e:
        megaslide.model_info(os.fspath(path), 5, 32, 32)
    check_exception(e.value, ValueError,
                    "config field 'learning_rate': must be a positive "
                    "number, got -1")


def test_validation_python_latent_sizes():
    with pytest.raises(Exception) as e:
        megaslide.model_info("tiny", 2, 9, 8, latent=True)
    check_exception(e.value, ValueError, "9 latent elements do not fit")
    assert "pixels" not in str(e.value)


def test_validation_python_lr():
    for lr in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(Exception) as e:
            megaslide.exec_plan("tiny", 5, 32, 32, lr=lr)
        check_exception(e.value, ValueError,
                        f"lr must be a positive number, got {lr!r}")


EMPTY_PATH_CALLS = [
    ("save_weights", lambda art: megaslide.Trainer(
        plan_json=art.plan_text).save_weights(""), "directory"),
    ("load_weights", lambda art: megaslide.Trainer(
        plan_json=art.plan_text).load_weights(""), "path"),
    ("save_plan", lambda art: megaslide.Trainer(
        plan_json=art.plan_text).save_plan(""), "path"),
    ("step trace", lambda art: megaslide.Trainer(
        plan_json=art.plan_text).step(trace=""), "trace"),
    ("plan_file", lambda art: megaslide.Trainer(plan_file=""), "plan_file"),
    ("hw", lambda art: megaslide.Trainer("tiny", 5, 32, 32, hw=""), "hw"),
    ("val_data", lambda art: megaslide.Trainer(
        plan_json=art.plan_text, val_data=""), "val_data"),
]


@pytest.mark.parametrize("name,call,arg", EMPTY_PATH_CALLS,
                         ids=[c[0] for c in EMPTY_PATH_CALLS])
def test_empty_path_is_an_error(art, tmp_path, monkeypatch, name, call, arg):
    """'' is no path (issue 26): save_weights('') used to write into the
    current folder, over a config.json there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text('{"mine": true}\n')
    before = tree_hashes(tmp_path)
    with pytest.raises(ValueError) as e:
        call(art)
    check_exception(e.value, ValueError, f"{arg} is empty")
    assert tree_hashes(tmp_path) == before
