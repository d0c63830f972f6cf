"""examples/ and deploy/ checked with the code the product runs on them.

The vLLM launch lines' --kv-transfer-config goes through vLLM's own
KVTransferConfig and the connector's read_config (python/kvshim/vllm/config.py);
the kv_connector_extra_config examples likewise. (The --l2-adapter JSON,
every `kvshim serve` line and deploy/kvshim.conf are parsed by Go, with
`kvshim serve`'s own code: cli/examples_test.go, cli/config_test.go.)
The systemd unit is checked with systemd-analyze where it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

# (tests/vllm alone would also import as a namespace package "vllm", origin None.)
_spec = importlib.util.find_spec("vllm")
needs_vllm = pytest.mark.skipif(_spec is None or _spec.origin is None,
                                reason="the connector's config is read by kvshim.vllm, which needs vLLM")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DEPLOY = ROOT / "deploy"


def logical_lines(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def vllm_launches(path: Path) -> list[list[str]]:
    """The `vllm serve` command lines of a shell example, as argv (the
    environment assignments and a trailing & dropped)."""
    out = []
    for ln in logical_lines(path):
        words = shlex.split(ln.rstrip("&"))
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[:2] == ["vllm", "serve"]:
            out.append(words)
    return out


def flag(argv: list[str], name: str) -> str | None:
    for i, w in enumerate(argv):
        if w == name:
            return argv[i + 1]
        if w.startswith(name + "="):
            return w[len(name) + 1:]
    return None


def check_kv_transfer(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """What vLLM and the connector make of a --kv-transfer-config."""
    from vllm.config import KVTransferConfig

    from kvshim.vllm import read_config

    assert raw is not None, "no --kv-transfer-config"
    d = json.loads(raw) if isinstance(raw, str) else raw
    kv = KVTransferConfig(**d)
    assert kv.kv_connector == "KVShimConnector"
    assert kv.kv_connector_module_path == "kvshim.vllm"
    assert kv.kv_role == "kv_both"
    return read_config(kv.kv_connector_extra_config)


def conf_value(key: str) -> str:
    for ln in (DEPLOY / "kvshim.conf").read_text().splitlines():
        k, eq, v = ln.partition("=")
        if eq and k.strip() == key:
            return v.strip()
    raise KeyError(key)


@needs_vllm
def test_tp2_embedded_launch():
    (argv,) = vllm_launches(EXAMPLES / "vllm-tp2-embedded.sh")
    assert flag(argv, "--tensor-parallel-size") == "2"
    cfg = check_kv_transfer(flag(argv, "--kv-transfer-config"))
    assert cfg["kvshim.server"] == "embedded"
    assert cfg["kvshim.l1_size_gb"] == 32.0


@needs_vllm
def test_shared_server_launches():
    launches = vllm_launches(EXAMPLES / "vllm-shared-server.sh")
    assert len(launches) == 2
    socket = conf_value("socket")
    for argv in launches:
        cfg = check_kv_transfer(flag(argv, "--kv-transfer-config"))
        assert cfg["kvshim.server"] == socket, "vLLM connects where deploy/kvshim.conf listens"
    text = (EXAMPLES / "vllm-shared-server.sh").read_text()
    assert f"--socket {socket}" in text


@needs_vllm
@pytest.mark.parametrize("adapter", ["fs", "redis", "mooncake"])
def test_connector_extra_config_with_l2(adapter):
    path = EXAMPLES / f"vllm-kv-transfer-config-{adapter}.json"
    cfg = check_kv_transfer(path.read_text())
    (a,) = cfg["kvshim.l2_adapters"]
    # The same adapter as the --l2-adapter example for kvshim serve.
    assert a == json.loads((EXAMPLES / f"l2-{adapter}.json").read_text())


def test_every_example_is_checked():
    checked = {"vllm-tp2-embedded.sh", "vllm-shared-server.sh"} | {
        f"{p}-{a}.json" for p in ("vllm-kv-transfer-config", "l2") for a in ("fs", "redis", "mooncake")}
    # Checked in Go: l2-s3.json and l2-plugin.json by cli/examples_test.go,
    # the C plugin in l2-plugin/ by server/l2/plugin's contract suite.
    checked |= {"l2-s3.json", "l2-plugin.json", "l2-plugin"}
    assert {p.name for p in EXAMPLES.iterdir()} == checked, "a new example needs a test"


def unit() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for ln in (DEPLOY / "kvshim.service").read_text().splitlines():
        ln = ln.strip()
        if ln and not ln.startswith(("#", "[")):
            k, _, v = ln.partition("=")
            keys.setdefault(k, []).append(v)
    return keys


def test_unit_matches_config():
    u = unit()
    (execstart,) = u["ExecStart"]
    argv = shlex.split(execstart)
    assert argv[1:3] == ["serve", "--config"]
    conf = argv[3]
    (confdir,) = u["ConfigurationDirectory"]
    assert conf.startswith(f"/etc/{confdir}/")
    (rundir,) = u["RuntimeDirectory"]
    assert Path(conf_value("socket")).parent == Path("/run") / rundir, "the socket lives in the unit's RuntimeDirectory"
    assert u["RuntimeDirectoryMode"] == ["0700"], "ipc refuses a socket directory others can enter"
    assert u["User"] and u["User"] != ["root"]
    assert u["LimitMEMLOCK"] == ["infinity"]
    assert u["Restart"] == ["on-failure"]
    assert u["RestartPreventExitStatus"] == ["2"], "kvshim serve exits 2 on a bad config"
    for off in ("PrivateDevices", "MemoryDenyWriteExecute", "RemoveIPC"):
        assert off not in u, f"{off} would break RDMA, the Mooncake helper or shared segments"


# What the server needs from the kernel (the unix.* calls of ipc/, server/
# and the Go runtime's): memfd segments, their sizing and mapping, futex
# wake-ups, SCM_RIGHTS and SO_PEERCRED on the Unix socket, pidfd exit
# watches, the fs L2's renames and utimensat, memlock for RDMA, the
# Mooncake helper's fork/exec.
NEEDED_SYSCALLS = ["memfd_create", "ftruncate", "fallocate", "mmap", "munmap", "madvise", "futex", "sched_yield",
                   "sendmsg", "recvmsg", "socket", "bind", "listen", "accept4", "connect", "getsockopt", "setsockopt",
                   "pidfd_open", "poll", "ppoll", "kill", "dup", "fcntl", "fstat", "newfstatat", "statfs", "chmod",
                   "fchmodat", "unlinkat", "renameat2", "utimensat", "getrlimit", "prlimit64", "mlock",
                   "epoll_pwait", "clone", "clone3", "execve", "prctl", "clock_gettime"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_syscall_filter_allows_shared_memory():
    filters = unit()["SystemCallFilter"]

    def expand(name: str, out: set[str], seen: set[str]) -> None:
        if not name.startswith("@"):
            out.add(name)
            return
        if name in seen:
            return
        seen.add(name)
        r = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, check=True)
        for ln in r.stdout.splitlines()[1:]:
            ln = ln.strip()
            if ln and not ln.startswith("#"):
                expand(ln, out, seen)

    # systemd: assignments accumulate; one starting with "~" denies its list.
    allowed: set[str] = set()
    for flt in filters:
        deny = flt.startswith("~")
        names: set[str] = set()
        for group in flt.lstrip("~").split():
            expand(group, names, set())
        allowed = allowed - names if deny else allowed | names
    missing = [s for s in NEEDED_SYSCALLS if s not in allowed]
    assert not missing, f"SystemCallFilter={filters} refuses {missing}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_verifies(tmp_path, repo_root):
    binary = repo_root / "out" / "kvshim"
    if not binary.exists():
        pytest.skip("out/kvshim is not built (make)")
    # verify checks that ExecStart exists: point it at the built binary.
    text = (DEPLOY / "kvshim.service").read_text().replace("/usr/local/bin/kvshim", str(binary))
    u = tmp_path / "kvshim.service"
    u.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(u)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
