"""make test's installers: build/venv.sh says what it installs before it
installs it, lets pip show its progress, and two concurrent runs share one
build of a virtualenv instead of deleting each other's; build/deps.sh
announces its Debian packages first and leaves no service enabled at boot.

Offline: the virtualenvs install a wheel made here (PIP_NO_INDEX), and
deps.sh runs against stub apt-get/dpkg-query/deb-systemd-helper/... on a
PATH without gcc or redis."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest


def make_wheel(where: Path) -> Path:
    """A minimal pure wheel, demo_pkg 1.0."""
    files = {
        "demo_pkg/__init__.py": b"VALUE = 42\n",
        "demo_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        "demo_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "demo_pkg-1.0.dist-info/RECORD,,\n"
    whl = where / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("demo_pkg-1.0.dist-info/RECORD", record)
    return whl


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def venv_setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A requirements file naming a local wheel, a cache dir, and a PYTHON
    that logs each `-m venv` and lingers 3 s after it (a slow first build)."""
    req = tmp_path / "requirements-demo-pkg.txt"
    req.write_text(f"# a local wheel: no network\n{make_wheel(tmp_path)}\n")
    log = tmp_path / "venv-calls.log"
    base = getattr(sys, "_base_executable", sys.executable)
    wrapper = executable(tmp_path / "python-wrapper", f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = venv ]; then
  echo "venv $3" >> {log}
  {base} "$@"; rc=$?
  sleep 3
  exit $rc
fi
exec {base} "$@"
""")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_QUIET")}
    env.update(PYTHON=str(wrapper), KVSHIM_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return req, env


def run_venv_sh(repo_root: Path, req: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([str(repo_root / "build" / "venv.sh"), str(req)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=repo_root)


def test_venv_says_what_it_installs_then_shows_pips_progress(repo_root: Path, venv_setup):
    req, env = venv_setup
    p = run_venv_sh(repo_root, req, env)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    venv = Path(out.strip())
    wheel_line = req.read_text().splitlines()[1]
    announced = err.find(f"    {wheel_line}")
    assert "it installs" in err and announced >= 0, err
    # pip's own output, not --quiet: what it processes, what it installed.
    processing = err.find("Processing ")
    assert processing > announced, err
    assert "Successfully installed demo-pkg-1.0" in err, err
    r = subprocess.run([venv / "bin" / "python", "-c", "import demo_pkg; print(demo_pkg.VALUE)"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "42", r.stderr

    # The second run reuses it, silently.
    p = run_venv_sh(repo_root, req, env)
    out2, err2 = p.communicate(timeout=120)
    assert (p.returncode, out2, err2) == (0, out, "")


def test_two_concurrent_runs_share_one_virtualenv(repo_root: Path, venv_setup, tmp_path: Path):
    req, env = venv_setup
    log = tmp_path / "venv-calls.log"
    a = run_venv_sh(repo_root, req, env)
    deadline = time.monotonic() + 120
    while not log.exists():  # A is inside `python -m venv`, 3 s from done
        assert time.monotonic() < deadline and a.poll() is None, a.communicate()
        time.sleep(0.05)
    b = run_venv_sh(repo_root, req, env)
    out_a, err_a = a.communicate(timeout=600)
    out_b, err_b = b.communicate(timeout=600)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    assert out_a == out_b
    calls = log.read_text().splitlines()
    assert len(calls) == 1, f"the virtualenv was built {len(calls)} times (a run deleted the other's): {calls}\n{err_b}"
    assert "waiting for another run" in err_b, err_b
    venv = Path(out_a.strip())
    r = subprocess.run([venv / "bin" / "python", "-c", "import demo_pkg"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # pip's scripts name the directory they were installed in, which still exists.
    pip_script = (venv / "bin" / "pip").read_text().splitlines()[0]
    assert Path(pip_script.removeprefix("#!")).exists(), pip_script


def test_a_dead_runs_leftovers_are_replaced(repo_root: Path, venv_setup):
    req, env = venv_setup
    p = run_venv_sh(repo_root, req, env)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    venv = Path(out.strip())
    # A later requirements change is a new key; simulate instead a run that
    # died mid-build: an unfinished build directory and no published venv.
    target = venv.resolve()
    venv.unlink()
    (target / ".complete").unlink()
    p = run_venv_sh(repo_root, req, env)
    out2, err2 = p.communicate(timeout=600)
    assert p.returncode == 0, err2
    assert out2 == out
    assert not target.exists(), "the dead run's build directory is still there"
    assert (venv / ".complete").exists()


def test_an_install_hook_replaces_pip_and_joins_the_key(repo_root: Path, venv_setup, tmp_path: Path):
    """A requirements file's `#!install: SCRIPT FILE` line (the CPU build of
    vLLM uses it): venv.sh runs SCRIPT VENV REQ FILE inside its lock instead of
    `pip install -r`, and a change to SCRIPT or FILE is a new virtualenv."""
    req, env = venv_setup
    base = tmp_path / "base.txt"
    base.write_text("base 1\n")
    hook = executable(tmp_path / "hook.sh", '#!/bin/bash\nset -e\necho "$2 $(cat "$3")" > "$1/hooked"\n')
    req.write_text(f"#!install: {hook} {base}\nnot-a-package-pip-could-install==1\n")
    p = run_venv_sh(repo_root, req, env)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    venv = Path(out.strip())
    assert (venv / "hooked").read_text() == f"{req} base 1\n"
    assert f"installing with {hook}" in err, err
    base.write_text("base 2\n")  # the file a layer builds on changed: a new key
    p = run_venv_sh(repo_root, req, env)
    out2, err2 = p.communicate(timeout=600)
    assert p.returncode == 0, err2
    assert out2 != out
    assert (Path(out2.strip()) / "hooked").read_text() == f"{req} base 2\n"
    # A failing hook publishes nothing.
    hook.write_text("#!/bin/bash\nexit 3\n")
    p = run_venv_sh(repo_root, req, env)
    out3, _ = p.communicate(timeout=600)
    assert p.returncode != 0 and out3 == ""


STUB_POSTINST = r"""#!/bin/bash
# apt-get stub: "install" runs what Debian's postinst of a service does.
echo "STUB apt-get $*" >&2
[ "$1" = install ] || exit 0
for pkg in "$@"; do
  [ "$pkg" = redis-server ] || continue
  if [ -x /usr/sbin/policy-rc.d ] && /usr/sbin/policy-rc.d redis-server start; [ $? = 101 ]; then
    echo "start refused" >> "$STATE/events"
  else
    echo "started redis-server" >> "$STATE/events"
    touch "$STATE/running"
  fi
  touch "$STATE/enabled.redis-server.service" "$STATE/rc.S01redis-server"
done
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_deps_announces_first_and_leaves_no_service_enabled(repo_root: Path, tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("deps.sh's policy-rc.d step needs root (it would call sudo)")
    state = tmp_path / "state"
    state.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # The real tools deps.sh uses, but no gcc, redis-server or redis-cli.
    for tool in ("env", "bash", "sh", "grep", "id", "tee", "chmod", "rm", "basename", "touch", "cat"):
        real = shutil.which(tool)
        assert real, tool
        (bin_dir / tool).symlink_to(real)
    executable(bin_dir / "apt-get", STUB_POSTINST)
    executable(bin_dir / "ldconfig", "#!/bin/bash\necho libibverbs.so.1 libnuma.so.1 libcurl.so.4\n")
    executable(bin_dir / "dpkg-query", """#!/bin/bash
[ "$2" = redis-server ] && printf '/lib/systemd/system/redis-server.service\\n/lib/systemd/system/redis-server@.service\\n/etc/init.d/redis-server\\n'
exit 0
""")  # noqa: E501
    executable(bin_dir / "deb-systemd-helper", """#!/bin/bash
echo "deb-systemd-helper $*" >> "$STATE/events"
[ "$1" = disable ] && rm -f "$STATE/enabled.$2"
exit 0
""")
    executable(bin_dir / "systemctl", """#!/bin/bash
echo "systemctl $*" >> "$STATE/events"
[ "$1" = stop ] && rm -f "$STATE/running"
[ "$1" = disable ] && rm -f "$STATE/enabled.$2"
exit 0
""")
    executable(bin_dir / "invoke-rc.d", """#!/bin/bash
echo "invoke-rc.d $*" >> "$STATE/events"
[ "$2" = stop ] && rm -f "$STATE/running"
exit 0
""")
    executable(bin_dir / "update-rc.d", """#!/bin/bash
echo "update-rc.d $*" >> "$STATE/events"
[ "$2" = disable ] && rm -f "$STATE/rc.S01$1"
exit 0
""")
    env = {"PATH": str(bin_dir), "STATE": str(state), "HOME": str(tmp_path)}
    r = subprocess.run([str(repo_root / "build" / "deps.sh")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    announce = r.stderr.find("installing Debian packages: gcc libc6-dev redis-server redis-tools")
    install = r.stderr.find("STUB apt-get install")
    assert 0 <= announce < install, r.stderr
    events = (state / "events").read_text()
    assert "start refused" in events, events
    left = sorted(p.name for p in state.iterdir() if p.name != "events")
    assert left == [], f"left enabled or running after deps.sh: {left}\n{events}"
    assert "redis-server@" not in events  # templates are not units to disable
