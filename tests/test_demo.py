"""`kvshim demo`: the library's restore measured against the copy engine
alone in the same run (the demo's CPU target), the torch tensor path the
CUDA demo uses, and `--device cuda` refused in one line where there is no
CUDA (this machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SMALL = ["--requests", "4", "--doc-tokens", "512", "--l1-size-gb", "1"]


def demo(repo_root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvshim", "demo", *args], capture_output=True, text=True, timeout=300,
                          cwd=repo_root, env=env)


def last_json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr[-3000:]
    result: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return result


def check_measured(result: dict[str, Any]) -> None:
    assert result["verified_ok"] is True and result["engine_verified_ok"] is True
    assert result["hit_tokens"] > 0 and result["bytes_restored"] > 0
    assert result["restore_gbps"] > 0 and result["engine_restore_gbps"] > 0
    assert 0 < result["restore_ratio"] < 2, result
    assert result["restore_ratio"] == pytest.approx(result["restore_gbps"] / result["engine_restore_gbps"], abs=2e-3)
    assert result["save_gbps"] > 0 and result["engine_save_gbps"] > 0 and 0 < result["save_ratio"] < 2
    assert result["first_save_ms"] > 0
    phases = result["phase_ms"]
    assert set(phases) == {"lookup", "restore", "engine_copy", "restore_minus_engine_copy"}
    assert phases["lookup"] > 0 and phases["restore"] > 0 and phases["engine_copy"] > 0
    assert phases["restore_minus_engine_copy"] == pytest.approx(phases["restore"] - phases["engine_copy"], abs=0.02)
    assert "library_phase_ms" in result


def test_demo_measures_the_engine_alone_on_the_same_chunks(repo_root):
    result = last_json(demo(repo_root, *SMALL))
    check_measured(result)
    assert result["device"] == "cpu" and result["layout"] == "LBNHC" and result["tensors"] == "numpy"
    assert result["requests"] == 4 and result["lookup_p50_us"] > 0
    assert "engine_restore_gbps" in result["ratio_basis"]


def test_demo_torch_tensors_blnhc(repo_root):
    # The code path of --device cuda (torch tensors, batched fills and
    # torch.equal checks, BLNHC views), on CPU tensors.
    pytest.importorskip("torch")
    result = last_json(demo(repo_root, *SMALL, "--tensors", "torch", "--layout", "BLNHC"))
    check_measured(result)
    assert result["tensors"] == "torch" and result["layout"] == "BLNHC"


def refused(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_demo_cuda_refused_in_one_line_without_cuda(repo_root):
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed here (the next test covers that case)")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = refused(demo(repo_root, "--device", "cuda"))
    assert line.startswith("kvshim demo: --device cuda: no CUDA here"), line
    assert "torch.cuda.is_available() is False" in line


def test_demo_cuda_refused_in_one_line_without_torch(repo_root, tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    line = refused(demo(repo_root, "--device", "cuda:0", env=env))
    assert line == "kvshim demo: --device cuda:0 needs PyTorch with CUDA: import torch failed (torch hidden by the test)"


def test_demo_refuses_a_bad_device_and_numpy_on_cuda(repo_root):
    assert refused(demo(repo_root, "--device", "tpu")) == "kvshim demo: --device 'tpu': want cpu, cuda or cuda:N"
    line = refused(demo(repo_root, "--device", "cuda", "--tensors", "numpy"))
    assert "--tensors torch" in line


def test_demo_sh_runs_cuda_under_the_plain_interpreter(repo_root):
    # build/demo.sh --device cuda uses $PYTHON as it is (a GPU machine has
    # torch and no network for a venv), not the numpy-only demo venv: the
    # refusal comes from torch itself (no CUDA here), not from its absence.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run([str(repo_root / "build" / "demo.sh"), "--device", "cuda"], capture_output=True, text=True,
                       timeout=120, cwd=repo_root, env=env)
    line = refused(r)
    assert line.startswith("kvshim demo: --device cuda: no CUDA here"), line
