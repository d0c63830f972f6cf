"""vLLM's configuration as plain data for the library, which decides the
kvshim.* settings (their defaults and checks), the namespace (what makes KV
bytes compatible), the KV-cache groups and each role's open config
(kvshim_vllm_config, export/connector/vllm.go)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvshim import native

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


# A child of vLLM's `vllm` logger: vLLM configures only that tree
# (vllm/logger.py: its handler, format and VLLM_LOGGING_LEVEL; it does not
# propagate to the root logger), so the connector's lines, the start-up one
# included, land in vLLM's own log. Tests capture it by adding caplog's
# handler to it (tests/vllm/conftest.py, kvshim_log).
LOGGER_NAME = "vllm.kvshim"
logger = logging.getLogger(LOGGER_NAME)


def required_layout(extra: dict[str, Any]) -> str | None:
    """kvshim.kv_cache_layout, flat or nested, for get_required_kvcache_layout:
    read here, not by the library: vLLM asks wherever it resolves the
    layout, possibly in a process that forks later, and the Go runtime must
    not be loaded before a fork. The library checks it with the rest when
    the connector opens."""
    nested = extra.get("kvshim")
    v = extra.get("kvshim.kv_cache_layout", nested.get("kv_cache_layout") if isinstance(nested, dict) else None)
    if v is not None and v not in KVCacheLayout.__members__:
        raise ValueError(f"kvshim.kv_cache_layout: {v!r} is not one of {list(KVCacheLayout.__members__)}")
    return v


def read_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The kvshim.* keys with their defaults, checked by the library
    (kvshim_vllm_config): an unknown key or a bad value is an
    InvalidArgumentError (a ValueError) naming the key."""
    return dict(native.vllm_config({"extra": extra, "kv_cache_layouts": list(KVCacheLayout.__members__)})["settings"])


def kv_groups(kv_cache_config: KVCacheConfig | None) -> list[dict[str, Any]]:
    """vLLM's KV-cache groups as plain data (shim.VLLMGroup), for
    kvshim_vllm_config and kvshim_vllm_tensors alike."""
    groups = []
    for grp in kv_cache_config.kv_cache_groups if kv_cache_config is not None else ():
        sp = grp.kv_cache_spec
        mt = getattr(sp, "mamba_type", "")
        groups.append({
            "classes": [c.__name__ for c in type(sp).__mro__], "layers": list(grp.layer_names),
            "block_size": sp.block_size, "dtype": str(getattr(sp, "dtype", "")),
            "kv_heads": getattr(sp, "num_kv_heads", None), "head_size": getattr(sp, "head_size", None),
            "sliding_window": int(getattr(sp, "sliding_window", 0) or 0),
            "extra_retained_tokens": int(getattr(sp, "extra_retained_tokens", 0) or 0),
            "attention_chunk_size": int(getattr(sp, "attention_chunk_size", 0) or 0),
            "shapes": [list(x) for x in getattr(sp, "shapes", ())], "dtypes": [str(x) for x in getattr(sp, "dtypes", ())],
            "mamba_type": str(getattr(mt, "name", mt)), "mamba_cache_mode": str(getattr(sp, "mamba_cache_mode", "")),
            "num_speculative_blocks": int(getattr(sp, "num_speculative_blocks", 0) or 0),
            "tokens_per_state": int(getattr(sp, "tokens_per_state", 0) or 0), "dcp_sharded": getattr(sp, "dcp_sharded", None),
        })
    return groups


def _vllm_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> dict[str, Any]:
    """vLLM's objects as plain data (shim.VLLMSpec): Go decides from them what
    makes KV bytes compatible, the KV-cache groups and what it refuses."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    spec = {
        "model": mc.model, "revision": mc.revision or "", "cache_dtype": str(cc.cache_dtype), "block_size": cc.block_size,
        # Resolved by the engine core before the scheduler and the workers'
        # connectors exist (resolve_kv_cache_layout, record_kv_cache_layout).
        "kv_cache_layout": cc.kv_cache_layout or getattr(kv_cache_config, "kv_cache_layout", None),
        "mamba_cache_mode": str(cc.mamba_cache_mode), "prefix_match_unit": getattr(cc, "prefix_match_unit", None),
        "speculative": vllm_config.speculative_config is not None, "mla": bool(mc.use_mla),
        "world_size": pc.world_size, "tp_size": pc.tensor_parallel_size,
        "dcp_size": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
        "pcp_size": int(getattr(pc, "prefill_context_parallel_size", 1) or 1), "groups": kv_groups(kv_cache_config),
    }
    if pc.pipeline_parallel_size > 1:
        # The scheduler sees only stage 0's layers: every role names the
        # model's layers and their split into stages.
        from vllm.distributed.utils import get_pp_indices

        total, pp = mc.get_total_num_hidden_layers(), pc.pipeline_parallel_size
        spec |= {"total_layers": total, "pp_stages": [list(get_pp_indices(total, s, pp)) for s in range(pp)]}
    return spec


def connector_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                     role: KVConnectorRole) -> dict[str, Any]:
    """What the library makes of vLLM's configuration for this role
    (kvshim_vllm_config): "settings" (the kvshim.* keys), "open" (what
    native.Scheduler / native.Worker are opened with: the same server,
    engine and namespace in every role), "layerwise", "by_request",
    "warnings" and "summary"."""
    tc = vllm_config.kv_transfer_config
    assert tc is not None  # vLLM builds connectors only from a kv_transfer_config
    return native.vllm_config({
        "extra": dict(tc.kv_connector_extra_config or {}), "kv_cache_layouts": list(KVCacheLayout.__members__),
        "role": "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
        "vllm": _vllm_spec(vllm_config, kv_cache_config), "engine_id": str(tc.engine_id),
        "kv_role": str(tc.kv_role or "kv_both"), "rank": int(vllm_config.parallel_config.rank),
    })
