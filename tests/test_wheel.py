"""The wheel: one `pip wheel .` gives kvshim-VERSION-py3-none-manylinux_2_NN_ARCH.whl
whose libkvshim.so is `make lib`'s (header check, VERSION+commit stamp), whose
tag names the newest glibc the .so really needs, and which installs and runs in
a fresh virtualenv with no Go toolchain, on the build's Python and on every
other CPython 3.10-3.13 found on this machine."""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging import tags
from packaging.utils import parse_wheel_filename

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None or shutil.which("make") is None,
    reason="building the wheel needs make and the Go toolchain",
)

OPEN_HANDLE = (
    "import json, kvshim.native as n; print(n.library_path());"
    "h = n.Handle(json.dumps({'role': 'worker', 'server': '/nonexistent/kvshim.sock', 'namespace': {'model': 't',"
    " 'dtype': 'bfloat16', 'layout': 'x', 'world_size': 1, 'chunk_size': 8}})); h.close();"
    "print(n.version())"
)


@pytest.fixture(scope="module")
def wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                        str(repo_root)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (whl,) = wheels.glob("kvshim-*.whl")
    return whl


def clean_env(venv: Path) -> dict[str, str]:
    """The environment of a fresh install: neither the source tree, nor the
    built library, nor go on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVSHIM_LIBRARY", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PYENV")}
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    return env


def install_and_open(python: str, whl: Path, venv: Path, cwd: Path) -> tuple[str, str]:
    """Makes a venv of python, pip-installs the wheel (pip refuses a wheel
    whose tags the interpreter does not support), opens a handle there.
    Returns (library path, version stamp)."""
    env = clean_env(venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
    r = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index",
                        "--disable-pip-version-check", str(whl)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"pip install into {python}'s venv: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    go_dirs = [p for p in env["PATH"].split(":") if Path(p, "go").exists()]
    assert not go_dirs, f"go is still on PATH: {go_dirs}"
    r = subprocess.run([venv / "bin" / "python", "-c", OPEN_HANDLE], capture_output=True, text=True, env=env,
                       timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr
    lib_path, version = r.stdout.split()
    assert lib_path.startswith(str(venv)), lib_path
    return lib_path, version


def glibc_needs(so: Path) -> tuple[list[str], tuple[int, int]]:
    """NEEDED libraries and the newest GLIBC_2.N symbol version of so, from objdump."""
    dyn = subprocess.run(["objdump", "-p", str(so)], capture_output=True, text=True, check=True).stdout
    syms = subprocess.run(["objdump", "-T", str(so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"^\s*NEEDED\s+(\S+)", dyn, re.M)
    versions = [(int(a), int(b)) for a, b in re.findall(r"\bGLIBC_(\d+)\.(\d+)", syms)]
    return needed, max(versions)


def test_wheel_tag_is_py3_none_manylinux_for_the_glibc_the_library_needs(wheel: Path, tmp_path: Path):
    name, _, _, wheel_tags = parse_wheel_filename(wheel.name)
    assert name == "kvshim"
    (tag,) = wheel_tags
    assert (tag.interpreter, tag.abi) == ("py3", "none"), wheel.name
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag.platform)
    assert m, f"{wheel.name}: platform {tag.platform} is not manylinux_X_Y_ARCH"
    assert m[3] == platform.machine()
    assert tag in set(tags.sys_tags()), f"{tag} is not supported by this interpreter ({sys.version.split()[0]})"

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "kvshim/libkvshim.so" in names, names  # at the root: platlib, no .data/purelib detour
        assert "kvshim/vllm/__init__.py" in names and "kvshim/vllm/connector.py" in names, names  # the connector package
        assert not [n for n in names if n.endswith(".h")], names
        z.extract("kvshim/libkvshim.so", tmp_path)
        wheel_info = z.read(f"kvshim-{wheel.name.split('-')[1]}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in wheel_info
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is missing: cannot check the glibc symbol versions")
    needed, newest = glibc_needs(tmp_path / "kvshim" / "libkvshim.so")
    assert set(needed) <= {"libc.so.6", "libpthread.so.0", "libdl.so.2", "libm.so.6", "libresolv.so.2"}, needed
    # The tag claims exactly what the .so needs: no older glibc (it would not
    # load there), no newer (it would refuse hosts it runs on).
    assert (int(m[1]), int(m[2])) == newest, f"tag {tag.platform}, but the .so needs GLIBC_{newest[0]}.{newest[1]}"


def test_wheel_installs_and_runs_without_go(repo_root: Path, wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    _, version = install_and_open(sys.executable, wheel, venv, tmp_path)
    env = clean_env(venv)
    r = subprocess.run([venv / "bin" / "kvshim", "doctor"], capture_output=True, text=True, env=env, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "verdict      ready" in r.stdout

    # The library is `make lib`'s: stamped VERSION+commit like `make` stamps it.
    stamp = (repo_root / "VERSION").read_text().strip()
    m = re.fullmatch(re.escape(stamp) + r"\+([0-9a-f]{7,40})", version)
    assert m, f"version {version!r} is not {stamp}+<commit> (the Makefile's stamp)"
    subprocess.run(["git", "-C", str(repo_root), "cat-file", "-e", f"{m[1]}^{{commit}}"], check=True)


def _find_python(minor: int) -> str | None:
    """A working CPython 3.minor on this machine, or None."""
    home = Path.home()
    pyenv = Path(os.environ.get("PYENV_ROOT", home / ".pyenv"))
    uv = Path(os.environ.get("UV_PYTHON_INSTALL_DIR", home / ".local/share/uv/python"))
    candidates = [shutil.which(f"python3.{minor}")]
    candidates += sorted(glob.glob(str(pyenv / "versions" / f"3.{minor}.*" / "bin" / f"python3.{minor}")), reverse=True)
    candidates += sorted(glob.glob(str(uv / f"cpython-3.{minor}.*" / "bin" / f"python3.{minor}")), reverse=True)
    candidates += [f"/usr/bin/python3.{minor}", f"/usr/local/bin/python3.{minor}"]
    candidates += glob.glob(f"/opt/python/cp3{minor}-cp3{minor}/bin/python3.{minor}")
    for c in candidates:
        if not c or not os.access(c, os.X_OK):
            continue
        try:
            r = subprocess.run([c, "-c", "import sys, venv, ensurepip; print(sys.implementation.name, *sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60,
                               env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.split() == ["cpython", "3", str(minor)]:
            return c
    return None


@pytest.mark.parametrize("minor", [10, 11, 12, 13], ids=lambda m: f"3.{m}")
def test_wheel_installs_on_another_python(wheel: Path, tmp_path: Path, minor: int):
    """The one wheel installs (pip checks its tags against that interpreter)
    and opens a handle on each CPython vLLM runs on, not only the build's."""
    if sys.version_info[:2] == (3, minor):
        pytest.skip(f"3.{minor} is the build's Python: test_wheel_installs_and_runs_without_go covers it")
    python = _find_python(minor)
    if python is None:
        pytest.skip(f"no CPython 3.{minor} on this machine (looked for python3.{minor} on PATH, in pyenv's and uv's "
                    "version directories, /usr/bin, /usr/local/bin, /opt/python)")
    _, version = install_and_open(python, wheel, tmp_path / "venv", tmp_path)
    assert version
