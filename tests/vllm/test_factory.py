"""vLLM's own KVConnectorFactory loads kvshim's connector by module path.

Nothing of vLLM is stubbed: a real VllmConfig (tiny local Llama config.json,
no hub access) and vLLM's factory, for both roles, on a machine without a GPU.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import make_kv_cache_config, make_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


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

    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is (
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


def test_hma_is_turned_off_for_a_connector_without_supports_hma(tiny_model_dir):
    # VllmConfig auto-disables the hybrid KV cache manager (HMA) when the
    # connector class is not a SupportsHMA (and on platforms without HMA).
    cfg = make_vllm_config(tiny_model_dir)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True

    # If HMA is forced on anyway, the factory refuses such a connector.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    with pytest.raises(ValueError, match="does not support HMA"):
        KVConnectorFactory.create_connector(
            cfg, KVConnectorRole.SCHEDULER, make_kv_cache_config(num_blocks=64)
        )


def test_two_argument_constructor_is_rejected(tiny_model_dir):
    cfg = make_vllm_config(
        tiny_model_dir,
        kv_connector="TwoArgConnector",
        kv_connector_module_path="kvshim_test_connectors",
        disable_hybrid_kv_cache_manager=True,
    )
    with pytest.raises(ValueError, match="2-argument constructor"):
        KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)


def test_module_path_wins_over_a_registered_name(tiny_model_dir):
    # "ExampleConnector" is registered in vLLM's factory; with a module path the
    # class is looked up in that module instead.
    cfg = make_vllm_config(
        tiny_model_dir,
        kv_connector="RecordingConnector",
        kv_connector_module_path="kvshim_test_connectors",
    )
    from kvshim_test_connectors import RecordingConnector

    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is (
        RecordingConnector
    )
