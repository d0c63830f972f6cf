"""The Python bindings: lazy loading, fork safety, error mapping, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from kvshim import errors, native

# A handle that needs no server: a worker opens without dialling.
WORKER = json.dumps({"role": "worker", "server": "/nonexistent/kvshim.sock",
                     "namespace": {"model": "t", "dtype": "bfloat16", "layout": "x", "world_size": 1, "chunk_size": 8}})


def run_py(code: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, **kw)


def test_import_does_not_load_library():
    r = run_py(
        """
        import kvshim, kvshim.native, kvshim.cli, kvshim.errors
        try:
            import kvshim.vllm
        except ImportError:
            pass  # vLLM not installed in this interpreter
        maps = open("/proc/self/maps").read()
        assert not kvshim.native.loaded()
        assert "libkvshim" not in maps, "importing kvshim mapped the Go library"
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_child_of_fork_loads_and_works():
    # The parent imports kvshim (as vLLM imports connectors), then forks; the
    # child is the first to load the Go runtime and must work normally.
    r = run_py(
        """
        import json, os, kvshim.native as native
        pid = os.fork()
        if pid == 0:
            try:
                with native.Handle(json.dumps({"role": "worker", "server": "/nonexistent/kvshim.sock",
                                               "namespace": {"model": "t", "dtype": "bfloat16", "layout": "x",
                                                             "world_size": 1, "chunk_size": 8}})):
                    assert native.version()
                os._exit(0)
            except BaseException as e:
                print("child failed:", repr(e), flush=True)
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert not native.loaded(), "parent must not have loaded the library"
        print("child exit", os.waitstatus_to_exitcode(status))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("child exit 0"), r.stdout


def test_loaded_before_fork_is_refused_in_child():
    # A library loaded before fork() cannot be used in the child: the call is
    # refused with a clear error instead of hanging in a dead Go runtime.
    r = run_py(
        """
        import os, kvshim.native as native
        native.version()
        pid = os.fork()
        if pid == 0:
            try:
                native.version()
                os._exit(4)
            except RuntimeError as e:
                print(e, flush=True)
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        """
    )
    assert r.returncode == 0, r.stderr
    assert "loaded before this process forked" in r.stdout
    assert r.stdout.strip().endswith("child exit 0")


def test_errors_carry_code_and_message():
    from kvshim import native

    with pytest.raises(errors.InvalidArgumentError, match="not JSON"):
        native.Handle("{")
    with pytest.raises(errors.InvalidArgumentError, match=r'unknown role "x" \(valid: scheduler, tool, worker\)'):
        native.Handle('{"role": "x"}')
    with pytest.raises(errors.BadHandleError, match="handle 99"):
        native.check(native.library().kvshim_close(99))
    h = native.Handle(WORKER)
    with pytest.raises(errors.PanicError, match="kvshim_debug_panic called"):
        h.check(native.library().kvshim_debug_panic(h.value))
    h.close()
    with pytest.raises(errors.BadHandleError):
        native.check(native.library().kvshim_close(h.value or 0), 0)


def test_handles_do_not_leak():
    from kvshim import native

    lib = native.library()
    before = lib.kvshim_handle_count()
    hs = [native.Handle(WORKER) for _ in range(5)]
    assert lib.kvshim_handle_count() == before + 5
    for h in hs:
        h.close()
    assert lib.kvshim_handle_count() == before


def test_doctor_reports_and_exits_zero(repo_root):
    r = subprocess.run([sys.executable, "-m", "kvshim", "doctor", "--json"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(repo_root / "python")))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["protocol_version"] >= 1 and rep["abi_version"] == native.ABI_MAJOR * 1000 + native.ABI_MINOR
    assert rep["memfd_ok"] is True
    assert rep["cache_line_bytes"] in (32, 64, 128)
    assert rep["verdict"].startswith("ready")
    if not rep["cuda_ok"]:
        assert "libcuda" in rep["cuda"] or "CUDA" in rep["cuda"], rep["cuda"]


def test_cli_usage_errors(repo_root):
    r = subprocess.run([sys.executable, "-m", "kvshim", "no-such"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(repo_root / "python")))
    assert r.returncode == 2
    assert 'unknown command "no-such"' in r.stderr


def test_cli_as_a_tool(repo_root, tmp_path):
    """--version and help on stdout with exit 0; a demo failure is one line,
    not a traceback; a missing optional package is named."""
    env = dict(os.environ, PYTHONPATH=str(repo_root / "python"))

    def kvshim(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvshim", *args], capture_output=True, text=True, timeout=120,
                              env=kw.pop("env", env), **kw)

    r = kvshim("--version")
    assert r.returncode == 0 and r.stdout.startswith("kvshim ") and "protocol" in r.stdout, r
    for cmd in ("serve", "stat", "doctor"):
        r = kvshim(cmd, "--help")
        assert r.returncode == 0 and r.stderr == "" and f"usage: kvshim {cmd}" in r.stdout, (cmd, r)
    r = kvshim("doctor", "extra")
    assert r.returncode == 2 and 'unexpected argument "extra"' in r.stderr
    # A library that cannot be loaded: one line, exit 1.
    r = kvshim("demo", env=dict(env, KVSHIM_LIBRARY=str(tmp_path / "missing.so")))
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # numpy (the demo's optional package) hidden: one line that names it.
    blocker = tmp_path / "numpy"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    r = kvshim("demo", env=dict(env, PYTHONPATH=f"{tmp_path}:{repo_root / 'python'}"))
    assert r.returncode == 2 and "numpy" in r.stderr and r.stderr.count("\n") == 1, r.stderr
