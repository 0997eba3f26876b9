"""Shared fixtures: the build tree's tools, found next to the Python package."""

import os
import pathlib

import pytest

import megaslide

BUILD_DIR = pathlib.Path(megaslide.__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def megaslide_plan() -> str:
    path = BUILD_DIR / "bin" / "megaslide-plan"
    if not path.exists():
        pytest.fail(f"megaslide-plan not found at {path}; build first")
    return os.fspath(path)
