"""`pip wheel .` gives a wheel with libkvshim.so that works in a fresh
virtualenv with no Go toolchain on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


@pytest.mark.skipif(shutil.which("go") is None, reason="building the wheel needs the Go toolchain")
def test_wheel_installs_and_runs_without_go(repo_root: Path, tmp_path: Path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(repo_root)],
                   check=True, capture_output=True, timeout=600)
    (whl,) = wheels.glob("kvshim-*.whl")
    assert "linux_x86_64" in whl.name or "linux_aarch64" in whl.name, whl.name
    assert "kvshim/libkvshim.so" in zipfile.ZipFile(whl).namelist()

    # The fresh environment sees neither the source tree nor the built library.
    env = {k: v for k, v in os.environ.items() if k not in ("KVSHIM_LIBRARY", "PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=env)
    subprocess.run([venv / "bin" / "pip", "install", "--no-deps", "--quiet", str(whl)], check=True, timeout=300, env=env)
    go_dirs = [p for p in env["PATH"].split(":") if Path(p, "go").exists()]
    assert not go_dirs, f"go is still on PATH: {go_dirs}"

    r = subprocess.run([venv / "bin" / "kvshim", "doctor"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "verdict      ready" in r.stdout
    code = ("import json, kvshim.native as n; print(n.library_path());"
            "h = n.Handle(json.dumps({'role': 'skeleton', 'block_bytes': 8, 'block_tokens': 1, 'chunk_tokens': 1})); h.close();"
            "print(n.version())")
    r = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lib_path, version = r.stdout.split()
    assert lib_path.startswith(str(venv)), lib_path
    assert version.startswith((repo_root / "VERSION").read_text().strip())
