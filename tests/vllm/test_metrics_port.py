"""kvshim.metrics_port: the embedded server (inside vLLM's engine process)
serves Prometheus metrics and /healthz, as `kvshim serve --metrics-port`
does, and stops serving when the scheduler connector shuts down."""

import socket
import urllib.error
import urllib.request

import pytest

from harness import SchedulerHarness, kvshim_config
from kvshim import native
from kvshim.vllm import read_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


def test_embedded_metrics_port(tiny_model_dir):
    port = _free_port()
    cfg = kvshim_config(tiny_model_dir, kv_connector_extra_config={"kvshim.metrics_port": port})
    h = SchedulerHarness(cfg)
    try:
        code, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200
        lines = body.splitlines()
        build = [ln for ln in lines if ln.startswith("kvshim_build_info{")]
        assert len(build) == 1 and build[0].endswith(" 1"), build
        assert f'abi="{native.ABI_MAJOR}.{native.ABI_MINOR}"' in build[0] and 'protocol="' in build[0] and 'version="' in build[0]
        assert any(ln.startswith("go_goroutines ") for ln in lines)
        assert any(ln.startswith("process_") for ln in lines)
        assert any(ln.startswith("kvshim_l1_used_bytes ") for ln in lines)
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert (code, body) == (200, "ok\n")
    finally:
        h.close()
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port}/healthz")


def test_metrics_port_default_off_and_checked():
    assert read_config({})["kvshim.metrics_port"] == 0
    assert read_config({"kvshim.metrics_port": "9400"})["kvshim.metrics_port"] == 9400
    for bad in (-1, 65536, "port", True, 1.5):
        with pytest.raises(ValueError, match=r"kvshim\.metrics_port"):
            read_config({"kvshim.metrics_port": bad})
