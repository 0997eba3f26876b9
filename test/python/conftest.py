"""Shared fixtures: the command-line tools, found next to the Python package
in a build tree, or in $MEGASLIDE_TOOLS_DIR.

Tests that compare with the tools skip when the tools are not there, so
the suite also runs against a `pip install .`ed package
(scripts/pip-install-check.sh), which has the module but no tools.
"""

import os
import pathlib

import pytest

import megaslide

BUILD_DIR = pathlib.Path(megaslide.__file__).resolve().parents[2]
TOOLS_DIR = pathlib.Path(os.environ.get("MEGASLIDE_TOOLS_DIR",
                                        BUILD_DIR / "bin"))


def tool_path(name: str) -> str:
    """The path of tool `name` (megaslide-plan, megaslide-run, ...); skips
    the calling test when it is not built."""
    path = TOOLS_DIR / name
    if not path.exists():
        pytest.skip(f"{name} not found at {path}; build the tools or set "
                    f"MEGASLIDE_TOOLS_DIR")
    return os.fspath(path)


def with_init(args):
    """These runs train on samples from random weights on purpose: a run
    with --data and no --weights says so (--init random), as the tool asks
    (test_data_without_weights_needs_init_random)."""
    a = list(map(str, args))
    if "--data" in a and not {"--weights", "--resume", "--init",
                              "--steps=0"} & set(a):
        a += ["--init", "random"]
    return a


@pytest.fixture(scope="session")
def megaslide_plan() -> str:
    return tool_path("megaslide-plan")
