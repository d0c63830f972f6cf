"""pytest setup for the vLLM integration tests (tests/vllm).

Run with the venv from python/requirements-test.txt:
    python -m pytest tests/vllm -q
The whole directory is skipped when vLLM is not installed.
"""

import os
import sys
from pathlib import Path

# No network to the Hugging Face hub: fail fast instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_HERE = Path(__file__).resolve().parent
_PYTHON_DIR = _HERE.parent.parent / "python"
for p in (str(_PYTHON_DIR), str(_HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import importlib.util  # noqa: E402

import pytest  # noqa: E402

# Without vLLM installed, skip this directory. (Note: with tests/ on sys.path,
# "vllm" also resolves to this directory as a namespace package, origin None.)
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # pragma: no cover - environment
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A local model directory holding only a tiny Llama config.json."""
    from harness import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def kv(tiny_model_dir):
    """Factory of (harness, runner) pairs over the embedded server; closes
    them after the test. vLLM's own prefix cache is off unless asked for."""
    from harness import ModelRunner, SchedulerHarness, kvshim_config, make_kv_cache_config

    made = []

    def make(num_blocks: int = 128, layout: str | None = None, **cfg_kw):
        cfg_kw.setdefault("enable_prefix_caching", False)
        cfg = kvshim_config(tiny_model_dir, **cfg_kw)
        cfg.cache_config.kv_cache_layout = layout  # None: LBNHC, FlashAttention's first
        kvc = make_kv_cache_config(num_blocks=num_blocks)
        h = SchedulerHarness(cfg, kvc)
        h.runners = [ModelRunner(cfg, kvc)]
        made.append(h)
        return h, h.runners[0]

    yield make
    for h in made:
        h.close()


@pytest.fixture(autouse=True)
def kvshim_log(caplog):
    """caplog sees the connector's log: its logger (kvshim.vllm.LOGGER_NAME,
    "vllm.kvshim") is a child of vLLM's `vllm` logger so that its lines reach
    vLLM's log, and vLLM stops that tree from propagating to the root logger,
    where caplog listens."""
    import logging

    lg = logging.getLogger("vllm.kvshim")
    lg.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        lg.removeHandler(caplog.handler)
