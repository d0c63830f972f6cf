"""vLLM's own KVConnectorFactory loads kvshim's connector by module path.

Nothing of vLLM is stubbed: a real VllmConfig (tiny local Llama config.json,
no hub access) and vLLM's factory, for both roles, on a machine without a GPU.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from harness import make_kv_cache_config, make_vllm_config

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def kv_transfer_config(cfg: VllmConfig) -> KVTransferConfig:
    assert cfg.kv_transfer_config is not None
    return cfg.kv_transfer_config


def test_import_loads_no_native_library():
    # A fresh interpreter: the Go runtime must not be loaded before vLLM forks.
    code = textwrap.dedent(
        """
        import os, sys
        sys.path.insert(0, sys.argv[1])
        import kvshim.vllm
        assert kvshim.vllm.KVShimConnector
        maps = open("/proc/self/maps").read()
        pkg = os.path.dirname(kvshim.vllm.__file__)
        paths = {l.split()[-1] for l in maps.splitlines() if "/" in l}
        bad = sorted(p for p in paths
                     if "libkvshim" in os.path.basename(p) or p.startswith(pkg))
        print("MAPPED", bad)
        sys.exit(1 if bad else 0)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(PYTHON_DIR)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_factory_creates_kvshim_connector(tiny_model_dir, role):
    from kvshim.vllm import KVShimConnector

    cfg = make_vllm_config(
        tiny_model_dir,
        kv_connector="KVShimConnector",
        kv_connector_module_path="kvshim.vllm",
        kv_connector_extra_config={"kvshim.server": "embedded"},
    )
    kv_cache_config = make_kv_cache_config(num_blocks=64)

    assert KVConnectorFactory.get_connector_class(kv_transfer_config(cfg)) is (
        KVShimConnector
    )
    conn = KVConnectorFactory.create_connector(cfg, role, kv_cache_config)

    assert type(conn) is KVShimConnector
    assert isinstance(conn, KVConnectorBase_V1)
    assert conn.role is role
    assert conn._vllm_config is cfg
    assert conn._kv_cache_config is kv_cache_config
    assert conn._kv_transfer_config.get_from_extra_config("kvshim.server", None) == (
        "embedded"
    )


def test_hma_stays_on_for_kvshim(tiny_model_dir):
    # KVShimConnector is a SupportsHMA, so vLLM's factory accepts it with the
    # hybrid KV cache manager on (a connector without it is refused: the
    # "does not support HMA" branch), and VllmConfig does not turn HMA off for
    # it. This machine's platform never enables HMA itself (tests/vllm/NOTES.md,
    # "Hybrid models"), so the test turns it on as a GPU platform leaves it.
    from kvshim.vllm import KVShimConnector

    cfg = make_vllm_config(tiny_model_dir)
    assert KVConnectorFactory.supports_hma_config(kv_transfer_config(cfg)) is True
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    conn = KVConnectorFactory.create_connector(
        cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config(num_blocks=64)
    )
    assert type(conn) is KVShimConnector


def test_two_argument_constructor_is_rejected(tiny_model_dir):
    cfg = make_vllm_config(
        tiny_model_dir,
        kv_connector="TwoArgConnector",
        kv_connector_module_path="kvshim_test_connectors",
        disable_hybrid_kv_cache_manager=True,
    )
    with pytest.raises(ValueError, match="2-argument constructor"):
        KVConnectorFactory.get_connector_class(kv_transfer_config(cfg))


def test_module_path_wins_over_a_registered_name(tiny_model_dir):
    # "ExampleConnector" is registered in vLLM's factory; with a module path the
    # class is looked up in that module instead.
    cfg = make_vllm_config(
        tiny_model_dir,
        kv_connector="RecordingConnector",
        kv_connector_module_path="kvshim_test_connectors",
    )
    from kvshim_test_connectors import RecordingConnector

    assert KVConnectorFactory.get_connector_class(kv_transfer_config(cfg)) is (
        RecordingConnector
    )
