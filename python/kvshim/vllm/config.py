"""kv_connector_extra_config and what the native handles are opened with:
the kvshim.* keys, the namespace (what makes KV bytes compatible) and the
KV-cache groups, computed the same way in every role."""

from __future__ import annotations

import json
import logging
import uuid
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

# kv_connector_extra_config keys: name -> (default, meaning).
CONFIG_KEYS: dict[str, tuple[Any, str]] = {
    "kvshim.server": ("embedded", '"embedded" (server inside vLLM\'s engine process) or the socket of a `kvshim serve`'),
    "kvshim.chunk_size": (256, "tokens per stored chunk; a multiple of vLLM's block size"),
    "kvshim.l1_size_gb": (16.0, "L1 host memory of the embedded server, GiB (> 0)"),
    "kvshim.l1_prefault_gb": (None, "embedded server: L1 created and faulted in ahead of use, GiB (default min(L1, 4); 0: lazy)"),
    "kvshim.timeout_ms": (5000, "longest wait for the server or a copy; past it a lookup is a miss, a load an error"),
    "kvshim.hold_ttl_s": (1800.0, "embedded server: last-resort release of holds a live client forgot"),
    "kvshim.model": (None, "model identity in the namespace (default: the model name and revision)"),
    "kvshim.l2_adapters": ([], 'embedded server: L2 adapters, each like `kvshim serve --l2-adapter` ({"type": "fs", "base_path": ...})'),
    "kvshim.verify": ("l2", ('payload checksums: "l2" (checked where bytes enter from L2, never re-read on an L1 restore), '
                             '"always" (also computed at every save and checked at every load) or "off" (unsafe with L2)')),
    "kvshim.kv_cache_layout": (None, ('KV cache layout to ask vLLM for: "BLNHC" or "BLHNC" put all layers of a block side by '
                                      "side, so a chunk is copied as one span per block (default: vLLM's choice)")),
    "kvshim.trace_dir": (None, ("directory for lifecycle traces (Arrow IPC files, `kvshim trace DIR` reads them) of the "
                                "workers and the embedded server (default: off)")),
    "kvshim.metrics_port": (0, ("embedded server: serve Prometheus metrics and /healthz at http://127.0.0.1:PORT "
                                "(0: off), as `kvshim serve --metrics-port`")),
    "kvshim.layerwise": (False, ("load a hit layer by layer in the step that computes the request, each attention "
                                 "layer waiting only for its own copy (docs/datapath.md); default: off, the load "
                                 "runs before the request is scheduled")),
}

KV_CACHE_LAYOUTS = tuple(m.name for m in KVCacheLayout)


def _positive(kind: type, *, zero: bool = False) -> Any:
    def check(key: str, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"{key}: want a number, got {v!r}")
        try:
            x = kind(v)
        except ValueError:
            raise ValueError(f"{key}: want a number, got {v!r}") from None
        if not (x > 0 or (zero and x == 0)):
            raise ValueError(f"{key}: must be {'>= 0' if zero else '> 0'}, got {v!r}")
        return x
    return check


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "1", "on", "false", "0", "off"):
        return v.lower() in ("true", "1", "on")
    raise ValueError(f"{key}: want true or false, got {v!r}")


def _string(key: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key}: want a non-empty string, got {v!r}")
    return v


def _adapters(key: str, v: Any) -> list[Any]:
    # vLLM's dotted CLI form delivers a JSON list as a string.
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise ValueError(f"{key}: not a JSON list of adapters: {e}") from None
    if isinstance(v, dict):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(a, (dict, str)) for a in v):
        raise ValueError(f'{key}: want a list of adapters such as [{{"type": "fs", "base_path": "/mnt/kv"}}], got {v!r}')
    return v


def _port(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"{key}: want a TCP port (0..65535, 0: off), got {v!r}")
    try:
        x = int(v)
    except ValueError:
        raise ValueError(f"{key}: want a TCP port (0..65535, 0: off), got {v!r}") from None
    if not 0 <= x <= 65535:
        raise ValueError(f"{key}: must be in 0..65535 (0: off), got {v!r}")
    return x


def _choice(*valid: Any) -> Any:
    def check(key: str, v: Any) -> Any:
        if v not in valid:
            raise ValueError(f"{key}: {v!r} is not one of {list(valid)}")
        return v
    return check


# How each key's value is checked and converted (the default is not checked).
_CHECKS: dict[str, Any] = {
    "kvshim.server": _string,
    "kvshim.chunk_size": _positive(int),
    "kvshim.l1_size_gb": _positive(float),
    "kvshim.l1_prefault_gb": _positive(float, zero=True),
    "kvshim.timeout_ms": _positive(int),
    "kvshim.hold_ttl_s": _positive(float),
    "kvshim.model": _string,
    "kvshim.l2_adapters": _adapters,
    "kvshim.verify": _choice("l2", "always", "off"),
    "kvshim.kv_cache_layout": _choice(*KV_CACHE_LAYOUTS),
    "kvshim.trace_dir": _string,
    "kvshim.metrics_port": _port,
    "kvshim.layerwise": _bool,
}


def read_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The kvshim.* keys with defaults, checked. vLLM's dotted CLI form
    (--kv-transfer-config.kv_connector_extra_config.kvshim.l1_size_gb=4)
    arrives nested, {"kvshim": {"l1_size_gb": 4}}: the same setting. An
    unknown key or a bad value is an error that names the key."""
    flat = {k: v for k, v in extra.items() if k != "kvshim"}
    nested = extra.get("kvshim", {})
    if not isinstance(nested, dict):
        raise ValueError(f"kvshim: want an object of kvshim settings, got {nested!r}")
    for k, v in nested.items():
        key = f"kvshim.{k}"
        if key in flat and flat[key] != v:
            raise ValueError(f"{key} is given twice, as {flat[key]!r} and {v!r}")
        flat[key] = v
    unknown = sorted(k for k in flat if k.startswith("kvshim.") and k not in CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; valid keys: {sorted(CONFIG_KEYS)}")
    cfg = {k: default for k, (default, _) in CONFIG_KEYS.items()}
    for k in CONFIG_KEYS:
        if k in flat and flat[k] is not None:
            cfg[k] = _CHECKS[k](k, flat[k])
    return cfg



def _vllm_spec(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM's objects as plain data (shim.VLLMSpec): Go decides from them what
    makes KV bytes compatible, the KV-cache groups and what it refuses."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
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
    spec = {
        "model": mc.model, "revision": mc.revision or "", "kvshim_model": cfg["kvshim.model"] or "",
        "chunk_size": int(cfg["kvshim.chunk_size"]), "cache_dtype": str(cc.cache_dtype), "block_size": cc.block_size,
        # Resolved by the engine core before the scheduler and the workers'
        # connectors exist (resolve_kv_cache_layout, record_kv_cache_layout).
        "kv_cache_layout": cc.kv_cache_layout or getattr(kv_cache_config, "kv_cache_layout", None),
        "mamba_cache_mode": str(cc.mamba_cache_mode), "prefix_match_unit": getattr(cc, "prefix_match_unit", None),
        "speculative": vllm_config.speculative_config is not None, "mla": bool(mc.use_mla),
        "world_size": pc.world_size, "tp_size": pc.tensor_parallel_size,
        "dcp_size": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
        "pcp_size": int(getattr(pc, "prefill_context_parallel_size", 1) or 1), "groups": groups,
    }
    if pc.pipeline_parallel_size > 1:
        # The scheduler sees only stage 0's layers: every role names the
        # model's layers and their split into stages.
        from vllm.distributed.utils import get_pp_indices

        total, pp = mc.get_total_num_hidden_layers(), pc.pipeline_parallel_size
        spec |= {"total_layers": total, "pp_stages": [list(get_pp_indices(total, s, pp)) for s in range(pp)]}
    return spec


def _resolve(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """The namespace, with sched_block_size and groups, as Go decides it
    (kvshim_vllm_namespace, shim/vllmspec.go)."""
    return native.vllm_namespace(_vllm_spec(vllm_config, kv_cache_config, cfg))


def _namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """What makes KV bytes compatible, the same in every role."""
    ns = _resolve(vllm_config, kv_cache_config, cfg)
    del ns["sched_block_size"], ns["groups"]
    return ns


def _layerwise(cfg: dict[str, Any], groups: bool) -> bool:
    """kvshim.layerwise, on only for one full-attention KV-cache group:
    several groups (or a lone window or Mamba group) report failed loads by
    request (failed_recving), which vLLM reads only for asynchronous loads."""
    on = bool(cfg["kvshim.layerwise"])
    if on and groups:
        logger.warning("kvshim.layerwise: off for this model (several KV-cache groups, or one that frees blocks: "
                       "failed loads are reported by request, which needs asynchronous loads)")
        return False
    return on


def _open_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, cfg: dict[str, Any],
                 role: KVConnectorRole) -> tuple[dict[str, Any], bool]:
    """What native.Scheduler / native.Worker are opened with: the same server,
    engine and namespace in every role, and each role's own settings; and
    whether the namespace names KV-cache groups."""
    tc = vllm_config.kv_transfer_config
    ns = _resolve(vllm_config, kv_cache_config, cfg)
    block_size, groups = ns.pop("sched_block_size"), bool(ns.pop("groups"))
    assert tc is not None  # vLLM builds connectors only from a kv_transfer_config
    common = {
        "server": cfg["kvshim.server"],
        "engine_id": str(tc.engine_id),
        "instance": str(uuid.uuid4()),
        "namespace": ns,
        "timeout_ms": int(cfg["kvshim.timeout_ms"]),
        **({} if cfg["kvshim.trace_dir"] is None else {"trace_dir": cfg["kvshim.trace_dir"]}),
    }
    if role == KVConnectorRole.SCHEDULER:
        return common | {
            "block_size": block_size,  # the scheduler's block: DCP ranks each hold a slice of it
            "l1_size_gb": float(cfg["kvshim.l1_size_gb"]),
            **({} if cfg["kvshim.l1_prefault_gb"] is None else {"l1_prefault_gb": cfg["kvshim.l1_prefault_gb"]}),
            "hold_ttl_s": float(cfg["kvshim.hold_ttl_s"]),
            "l2_adapters": [a if isinstance(a, str) else json.dumps(a) for a in cfg["kvshim.l2_adapters"]],
            "metrics_port": int(cfg["kvshim.metrics_port"]),
            # kv_producer saves and never loads, kv_consumer loads and never saves (Go: shim.Role)
            "kv_role": str(tc.kv_role or "kv_both"),
        }, groups
    return common | {"rank": int(vllm_config.parallel_config.rank), "verify": str(cfg["kvshim.verify"])}, groups
