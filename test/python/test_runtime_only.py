"""The runtime-only build (docs/Runtime.md, "A runtime without MLIR"):
megaslide-exec, megaslide-runtime-tests and the MLIR-free tools
(megaslide-calibrate, megaslide-report) link no shared library beyond
libc, libm, libdl, libpthread, the loader and oneDNN with libgomp, need no newer glibc than
Debian 12's 2.36, and megaslide-exec computes bit for bit what the full
build's megaslide-run computes on the same saved plan.

The binaries are looked up in $MEGASLIDE_RUNTIME_BUILD (default
build-runtime/ next to the build tree, made by `scripts/build.sh
--runtime-only`). Without them the tests skip, unless
MEGASLIDE_REQUIRE_RUNTIME_BUILD=1 (scripts/test.sh sets it): then they fail.
"""

import json
import os
import pathlib
import re
import subprocess

import pytest

from conftest import BUILD_DIR, tool_path

RUNTIME_BUILD = pathlib.Path(os.environ.get(
    "MEGASLIDE_RUNTIME_BUILD", BUILD_DIR.parent / "build-runtime"))
# What a bare Linux node has, and oneDNN with its OpenMP runtime (the cpu
# kernels' GEMM, which the device bundle carries); everything else is
# linked in.
ALLOWED_LIBS = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0",
                "ld-linux-x86-64.so.2", "libdnnl.so.2", "libgomp.so.1"}
MAX_GLIBC = (2, 36)  # Debian 12; Ubuntu 24.04 has 2.39
BINARIES = ["megaslide-exec", "megaslide-runtime-tests", "megaslide-calibrate",
            "megaslide-report"]
# The saved tiny plans of the full build (test/unit/CMakeLists.txt).
PLANS = BUILD_DIR / "test" / "plans"


def runtime_binary(name: str) -> pathlib.Path:
    path = RUNTIME_BUILD / "bin" / name
    if not path.exists():
        message = (f"{path} is not built: run scripts/build.sh --runtime-only "
                   f"or set MEGASLIDE_RUNTIME_BUILD")
        if os.environ.get("MEGASLIDE_REQUIRE_RUNTIME_BUILD") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def needed_libraries(path: pathlib.Path) -> set:
    out = subprocess.run(["readelf", "-d", os.fspath(path)], check=True,
                         capture_output=True, text=True).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


def glibc_versions(path: pathlib.Path) -> list:
    out = subprocess.run(["readelf", "-V", "--wide", os.fspath(path)],
                         check=True, capture_output=True, text=True).stdout
    found = {tuple(int(x) for x in v.split("."))
             for v in re.findall(r"GLIBC_([0-9]+(?:\.[0-9]+)+)", out)}
    return sorted(found)


@pytest.mark.parametrize("name", BINARIES)
def test_links_only_the_c_library(name):
    libs = needed_libraries(runtime_binary(name))
    assert libs, "readelf found no NEEDED entries (a static-pie binary?)"
    assert libs <= ALLOWED_LIBS, f"{name} needs {sorted(libs - ALLOWED_LIBS)}"


@pytest.mark.parametrize("name", BINARIES)
def test_highest_glibc_version(name):
    versions = glibc_versions(runtime_binary(name))
    assert versions, "no GLIBC symbol versions found"
    highest = versions[-1]
    print(f"{name}: highest GLIBC symbol version "
          f"{'.'.join(map(str, highest))}")
    assert highest <= MAX_GLIBC, (
        f"{name} needs GLIBC {'.'.join(map(str, highest))}, newer than "
        f"Debian 12's {'.'.join(map(str, MAX_GLIBC))}")


def run_plan(tool, plan, out, *flags):
    metrics, gradients = out / "metrics.jsonl", out / "gradients.safetensors"
    subprocess.run([os.fspath(tool), "--plan", os.fspath(plan), "--backend",
                    "cpu", "--steps", "2", "--seed", "3", "--no-progress",
                    "--metrics", os.fspath(metrics), "--save-gradients",
                    os.fspath(gradients), *flags],
                   check=True, capture_output=True, text=True)
    losses = [json.loads(line)["loss"]
              for line in metrics.read_text().splitlines()]
    return losses, gradients.read_bytes()


@pytest.mark.parametrize("plan", ["tiny", "tiny-dsa"])
def test_exec_matches_the_full_build_bit_for_bit(plan, tmp_path):
    path = PLANS / f"{plan}.json"
    if not path.exists():
        pytest.skip(f"{path} not saved (build the full configuration)")
    full, static = tmp_path / "full", tmp_path / "static"
    full.mkdir()
    static.mkdir()
    want = run_plan(tool_path("megaslide-run"), path, full)
    got = run_plan(runtime_binary("megaslide-exec"), path, static)
    assert len(want[0]) == 2 and all(isinstance(x, float) for x in want[0])
    assert got[0] == want[0]  # losses as printed with %.9g: every bit
    assert got[1] == want[1]  # the gradients' safetensors, byte for byte


def test_exec_refuses_a_plan_of_another_release(tmp_path):
    path = PLANS / "tiny.json"
    if not path.exists():
        pytest.skip(f"{path} not saved (build the full configuration)")
    plan = json.loads(path.read_text())
    plan["runtime_version"] = "0.0.1"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(plan))
    r = subprocess.run([os.fspath(runtime_binary("megaslide-exec")), "--plan",
                        os.fspath(other), "--steps", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert ("the plan was compiled for MegaSlide runtime 0.0.1, this is "
            "runtime ") in r.stderr
    assert "recompile it" in r.stderr


def test_exec_needs_a_plan():
    r = subprocess.run([os.fspath(runtime_binary("megaslide-exec")),
                        "--steps", "1"], capture_output=True, text=True)
    assert r.returncode == 1
    assert "give --plan FILE" in r.stderr
    assert "--frames" not in subprocess.run(
        [os.fspath(runtime_binary("megaslide-exec")), "--help"],
        capture_output=True, text=True).stdout
