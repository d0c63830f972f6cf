"""Fixtures of the end-to-end tests (see README.md here).

`procs` (one per test module) starts real `vllm serve` and `kvshim serve`
processes and stops every one of them when the module ends; a failing test's
report shows the end of each one's log. `tiny_model` is the locally made
model (tiny_model.py). They run in the CPU build's venv:
`build/test.sh e2e` (make test-e2e) makes it and the library first.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Processes, kvshim_binary
from tiny_model import model_dir

_by_module: dict[str, Processes] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    vllm = Path(sys.executable).parent / "vllm"
    if not vllm.exists() and any("tests/e2e" in str(i.path) for i in items):
        pytest.exit(f"{vllm} is missing: tests/e2e run in the CPU build's venv (build/test.sh e2e, make test-e2e)",
                    returncode=2)
    if not kvshim_binary().exists() and any("tests/e2e" in str(i.path) for i in items):
        pytest.exit(f"{kvshim_binary()} is missing: run `make` first", returncode=2)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return model_dir()


@pytest.fixture(scope="module")
def procs(request: pytest.FixtureRequest, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    """The module's servers: p = procs.start_vllm(...), procs.start_kvshim(...);
    all stopped at the module's end (SIGTERM, then SIGKILL after 30 s)."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    ps = Processes(tmp_path_factory.mktemp(name), tiny_model)
    _by_module[request.node.nodeid] = ps
    try:
        yield ps
    finally:
        ps.close()
        _by_module.pop(request.node.nodeid, None)
        shutil.rmtree(ps.runtime_dir, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    if rep.failed:
        ps = next((p for k, p in _by_module.items() if item.nodeid.startswith(k + "::")), None)
        if ps is not None:
            for name, tail in ps.tails():
                rep.sections.append((f"log of {name} (last 80 lines; whole file in {ps.workdir})", tail))
    return rep
