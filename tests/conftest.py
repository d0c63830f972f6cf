"""Shared fixtures: the repo root and the built library.

build/test.sh builds out/libkvshim.so and points KVSHIM_LIBRARY at it before
pytest starts; running pytest alone needs `make` first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session", autouse=True)
def _library_built() -> None:
    lib = Path(os.environ.get("KVSHIM_LIBRARY", ROOT / "out" / "libkvshim.so"))
    if not lib.exists():
        pytest.exit(f"{lib} is missing: run `make` (or `make test`) first", returncode=2)
    os.environ["KVSHIM_LIBRARY"] = str(lib)
