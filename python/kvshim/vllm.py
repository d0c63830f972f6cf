"""KVShimConnector: kvshim as a vLLM v1 KV connector.

Select it with::

    --kv-transfer-config '{"kv_connector": "KVShimConnector",
                           "kv_connector_module_path": "kvshim.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvshim.l1_size_gb": 16}}'

This module only translates vLLM objects into flat arrays and JSON and calls
libkvshim.so once per vLLM call; chunk keys, lookups, planning, the protocol
and the copies happen in Go (shim/, ipc/, layout/, cuda/). Importing it loads
nothing native: the library is loaded in the constructor, after vLLM has
forked its worker processes.
"""

from __future__ import annotations

import array
import json
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

try:  # vLLM 0.33 (0.32 has no per-tier hit sources: the hook is then never called)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

from kvshim import events as kv_events
from kvshim import native
from kvshim.errors import InvalidArgumentError, KVShimError, NotSupportedError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

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


@dataclass
class KVShimStats(KVConnectorStats):
    """kvshim's counters since the last report, in the form vLLM collects
    them: each worker's get_kv_connector_stats (chunks and bytes loaded and
    saved, failed loads and saves, saves skipped as already stored or for
    lack of space) and the scheduler's (hit_tokens: tokens kvshim was asked
    to load, hit_requests: requests with such a hit) are summed by
    aggregate(): across the workers (vLLM's KVOutputAggregator, so with TP
    each rank's chunks and bytes add up), with the scheduler's (in
    Scheduler.update_from_output) and over vLLM's logging interval. reduce()
    is what vLLM's LoggingStatLogger prints, "KV Transfer metrics: k=v, ...":
    the SUMMARY keys always, in that order, then any other counter."""

    SUMMARY: ClassVar[tuple[str, ...]] = (
        "hit_tokens", "hit_requests", "loaded_chunks", "loaded_bytes", "failed_loads",
        "saved_chunks", "saved_bytes", "failed_saves", "skipped_chunks",
    )

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVShimStats:
        for k, v in other.data.items():
            if isinstance(v, list):  # latencies (load_seconds, save_seconds): every sample kept
                self.data[k] = [*self.data.get(k, ()), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in self.SUMMARY}
        out.update((k, self.data[k]) for k in sorted(self.data) if k not in out and not isinstance(self.data[k], list))
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class KVShimMetadata(KVConnectorMetadata):
    """One step's scheduler → worker metadata; the bytes are written and read
    by Go (shim/meta.go: a binary form, chunk hashes as raw bytes)."""

    data: bytes


META_VERSION = 2  # shim.MetaVersion


def read_meta(data: bytes) -> dict[str, Any]:
    """A step's metadata bytes as the dict of its JSON text form (json.Marshal
    of Go's shim.StepMeta): {"loads": [{"req", "group", "owner", "lookup",
    "start", "end", "hashes", "blocks"}], "saves": [{"req", "group", "first",
    "hashes", "blocks"}], "finished": [...], "preempted": [...]}, owner and
    hashes in hex, empty lists left out as Go leaves them out ("group", the
    KV-cache group, is left out when 0, as Go leaves it out).

    For tests and debugging only: the connector never reads its metadata in
    Python; the workers' Go decoder (shim.DecodeStepMeta) is the reference
    and this reader follows its version-1 layout (see shim.MetaVersion)."""
    if not data:
        return {}
    if data[0] != META_VERSION:
        raise ValueError(f"step metadata version {data[0]}, this reader knows {META_VERSION}")
    pos = 1

    def uv() -> int:
        nonlocal pos
        v = shift = 0
        while True:
            b = data[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            if b < 0x80:
                return v
            shift += 7

    def raw(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise IndexError(pos + n)
        pos += n
        return data[pos - n : pos]

    def zz() -> int:
        u = uv()
        return (u >> 1) ^ -(u & 1)

    def text() -> str:
        return raw(uv()).decode("utf-8", "surrogateescape")

    def hashes() -> list[str]:
        return [raw(32).hex() for _ in range(uv())]

    def blocks() -> list[int]:
        return [zz() for _ in range(uv())]

    try:
        # (dict displays evaluate left to right: the fields in wire order)
        loads = [{"req": text(), "group": uv(), "owner": raw(16).hex(), "lookup": uv(), "start": uv(), "end": uv(),
                  "hashes": hashes(), "blocks": blocks()} for _ in range(uv())]
        saves = [{"req": text(), "group": uv(), "first": uv(), "hashes": hashes(), "blocks": blocks()}
                 for _ in range(uv())]
        finished = [text() for _ in range(uv())]
        preempted = [text() for _ in range(uv())]
    except IndexError:
        raise ValueError(f"step metadata truncated at byte {pos} of {len(data)}") from None
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} bytes after the step metadata")
    for ld in loads:
        if not ld["hashes"]:
            del ld["hashes"]
    for x in loads + saves:
        if not x["group"]:
            del x["group"]
    m = {"loads": loads, "saves": saves, "finished": finished, "preempted": preempted}
    return {k: v for k, v in m.items() if v}


def _namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """What makes KV bytes compatible, computed the same way in every role."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    model = cfg["kvshim.model"] or f"{mc.model}@{mc.revision or 'main'}"
    spec, layers = None, 0
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        group = kv_cache_config.kv_cache_groups[0]
        spec, layers = group.kv_cache_spec, len(group.layer_names)
    dtype = str(getattr(spec, "dtype", vllm_config.cache_config.cache_dtype)).removeprefix("torch.")
    layout = {
        "spec": type(spec).__name__,
        "block_size": getattr(spec, "block_size", vllm_config.cache_config.block_size),
        "kv_heads": getattr(spec, "num_kv_heads", None),
        "head_size": getattr(spec, "head_size", None),
        "layers": layers,
        # Resolved by the engine core before the scheduler and the workers'
        # connectors exist (resolve_kv_cache_layout, record_kv_cache_layout).
        "cache_layout": vllm_config.cache_config.kv_cache_layout or getattr(kv_cache_config, "kv_cache_layout", None),
    }
    groups = _groups(kv_cache_config, model, vllm_config)
    if groups:
        # Several KV-cache groups (vLLM's hybrid allocator), or one that
        # frees blocks (a window, a Mamba state): the layout names them
        # all, and Go (shim/groups.go) gives each its own namespace and
        # reads vLLM's null block as no block. One full-attention group
        # adds nothing: its keys stay those of kvshim before groups.
        layout["groups"] = groups
    if pc.pipeline_parallel_size > 1:
        # Pipeline stages hold different layers, and the scheduler sees only
        # stage 0's (vLLM builds its KV cache config from rank 0's:
        # generate_scheduler_kv_cache_config): one namespace for every role
        # names the model's layers and their split into stages; a stage's
        # objects are apart from the others' by their rank in the key.
        from vllm.distributed.utils import get_pp_indices

        total, pp = mc.get_total_num_hidden_layers(), pc.pipeline_parallel_size
        layout["layers"] = total
        layout["pp_stages"] = [list(get_pp_indices(total, s, pp)) for s in range(pp)]
    return {
        "model": model,
        "dtype": dtype,
        "layout": json.dumps(layout, sort_keys=True),
        "world_size": pc.world_size,
        "tp_size": pc.tensor_parallel_size,
        "chunk_size": int(cfg["kvshim.chunk_size"]),
        "kv_group": 0,
        "mla": bool(mc.use_mla),
        # decode context parallel: each rank of a DCP group holds a slice
        # of every block's tokens (1: none)
        "dcp_size": _dcp_size(vllm_config, spec),
    }


def _groups(kv_cache_config: KVCacheConfig | None, model: str, vllm_config: VllmConfig) -> list[dict[str, Any]]:
    """The KV-cache groups as shim.GroupSpec reads them: {"kind": "full" |
    "sliding_window" | "chunked_local" | "mamba", "window": tokens}, plus
    what else makes a group's bytes differ (its spec, block size, heads or
    state shapes, layers).

    A window is what vLLM's managers free blocks by
    (v1/core/single_type_kv_cache_manager.py, get_num_skipped_tokens):
    SlidingWindowSpec's sliding_window plus its extra_retained_tokens,
    ChunkedLocalAttentionSpec's attention_chunk_size. A FullAttentionSpec
    with a sliding_window (the hybrid allocator turned off) keeps every
    block: a full group. A MambaSpec group is a "mamba" group where vLLM
    keeps the state at block boundaries (_mamba_state_refusal says when it
    does not); other kinds of group are refused with an error naming the
    group and the model (see tests/vllm/NOTES.md, "Hybrid models").

    One group: [] (the layout of kvshim before groups, keys unchanged),
    unless it frees blocks (_has_groups: a window, or the Mamba state of an
    attention-free model): then the list of that group, so Go applies its
    rule and never reads vLLM's null block as a block."""
    if kv_cache_config is None:
        return []
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    def where(i: int, grp: Any) -> str:
        names = list(grp.layer_names)
        return (f"KV-cache group {i} ({type(grp.kv_cache_spec).__name__}, layers {names[:3]}"
                f"{'...' if len(names) > 3 else ''}) of model {model}")

    groups = kv_cache_config.kv_cache_groups
    for i, grp in enumerate(groups):
        if isinstance(grp.kv_cache_spec, MambaSpec):
            why = _mamba_state_refusal(grp.kv_cache_spec, vllm_config)
            if why:
                raise ValueError(f"kvshim: {where(i, grp)} holds Mamba/SSM state, which kvshim does not save or restore "
                                 f"here: {why}; serve this model without kv_connector KVShimConnector")
    if not _has_groups(kv_cache_config):
        return []
    out = []
    sizes = set()
    for i, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            g = {"kind": "sliding_window", "window": int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0))}
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            g = {"kind": "chunked_local", "window": int(spec.attention_chunk_size)}
        elif isinstance(spec, FullAttentionSpec):
            g = {"kind": "full"}
        elif isinstance(spec, MambaSpec):
            # The state's tensors and dtypes make its bytes; the padding
            # (page_size_padded) is never copied.
            g = {"kind": "mamba", "shapes": [list(x) for x in spec.shapes],
                 "dtypes": [str(x).removeprefix("torch.") for x in spec.dtypes],
                 "mamba_type": str(getattr(spec.mamba_type, "name", spec.mamba_type))}
        else:
            raise ValueError(f"kvshim: {where(i, grp)}: kvshim restores full, sliding-window and chunked local "
                             "attention groups and Mamba state groups only")
        g |= {"spec": type(spec).__name__, "block_size": spec.block_size,
              "kv_heads": getattr(spec, "num_kv_heads", None), "head_size": getattr(spec, "head_size", None),
              "layers": len(grp.layer_names)}
        sizes.add(spec.block_size)
        out.append(g)
    if len(sizes) > 1:
        raise ValueError(f"kvshim: the KV-cache groups of model {model} have blocks of {sorted(sizes)} tokens; "
                         "kvshim needs one block size for all groups")
    return out


def _layerwise(cfg: dict[str, Any], kv_cache_config: KVCacheConfig | None) -> bool:
    """kvshim.layerwise, on only for one full-attention KV-cache group:
    several groups (or a lone window or Mamba group) report failed loads by
    request (failed_recving), which vLLM reads only for asynchronous loads."""
    on = bool(cfg["kvshim.layerwise"])
    if on and _has_groups(kv_cache_config):
        logger.warning("kvshim.layerwise: off for this model (several KV-cache groups, or one that frees blocks: "
                       "failed loads are reported by request, which needs asynchronous loads)")
        return False
    return on


def _has_groups(kv_cache_config: KVCacheConfig | None) -> bool:
    """Whether kvshim describes the model's KV-cache groups to Go. One group
    of full attention keeps the keys and block handling of kvshim before
    groups; one that frees blocks (a window, a state: vLLM's null block, id
    0, stands where they were) is a group list of one, so Go applies its
    rule, as it does to several groups."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return False
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 or isinstance(groups[0].kv_cache_spec, (MambaSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))


def _mamba_state_refusal(spec: Any, vllm_config: VllmConfig) -> str:
    """Why kvshim cannot restore this MambaSpec group's state ("" when it
    can). kvshim relies on vLLM's "align" invariant: once a request computed
    (p+1)*block_size tokens, its block p holds the state after exactly that
    many tokens or is the null block (v1/core/sched/scheduler.py:607-610;
    shim/groups.go). Every case below breaks it or is untested."""
    cc, pc = vllm_config.cache_config, vllm_config.parallel_config
    if spec.mamba_cache_mode != "align" or cc.mamba_cache_mode != "align":
        # "none": one running state per request, overwritten in place;
        # no state of a chunk boundary survives (single_type_kv_cache_manager.py
        # MambaManager.get_num_blocks_to_allocate, :1713-1727).
        return (f"mamba_cache_mode is {spec.mamba_cache_mode!r} (cache config {cc.mamba_cache_mode!r}); kvshim needs "
                "'align' (vLLM's prefix caching on), where a block holds the state at its last token")
    if spec.num_speculative_blocks:
        # The running state lives in the last 1+n blocks and vLLM moves
        # speculative blocks in place (_relocate_speculative_block, :1925).
        return f"speculative decoding keeps {spec.num_speculative_blocks} speculative state blocks"
    if vllm_config.speculative_config is not None:
        # EAGLE's block drop moves a prefill checkpoint one block before the
        # block it is written to (kv_cache_interface.py:1184-1185,
        # kv_cache_coordinator.py:181).
        return "speculative decoding (a prefill checkpoint state may sit in the block after its position)"
    if getattr(spec, "tokens_per_state", -1) > 0:
        return f"a block holds several states (tokens_per_state {spec.tokens_per_state})"
    unit = getattr(cc, "prefix_match_unit", None)
    if unit not in (None, spec.block_size):
        # Partial-block prefix hits copy a state that ends inside a block
        # (MambaManager._cache_partial_tail_block, copy-on-write).
        return f"prefix_match_unit {unit} is finer than the {spec.block_size}-token block"
    if int(getattr(pc, "decode_context_parallel_size", 1) or 1) > 1 or int(getattr(pc, "prefill_context_parallel_size", 1) or 1) > 1:
        return "context parallelism (vLLM itself serves no Mamba prefix hit with DCP/PCP: MambaManager.find_longest_cache_hit)"
    if spec.block_size != cc.block_size:
        # The scheduler's block table counts cache_config.block_size tokens
        # a block (_open_config); a state block standing for another
        # number of tokens (mamba_block_size set apart) would be read at
        # the wrong boundaries.
        return f"its {spec.block_size}-token blocks (mamba_block_size) are not the scheduler's {cc.block_size}-token blocks"
    return ""


def _flat_groups(block_ids: Any) -> list[int]:
    """Per-group block ids (vLLM's tuple of lists) as Go reads them
    (shim.splitGroups): one group as it is; several one after the other,
    each padded with -1 to the longest."""
    if len(block_ids) == 1:
        return list(block_ids[0])
    n = max(len(ids) for ids in block_ids)
    out: list[int] = []
    for ids in block_ids:
        out.extend(ids)
        out.extend([-1] * (n - len(ids)))
    return out
def _dcp_size(vllm_config: VllmConfig, spec: Any) -> int:
    """vLLM's decode context parallel size for this KV cache spec: the
    factor between the scheduler's blocks and the ranks' blocks
    (kv_cache_utils.resolve_dcp_kv_block_size; specs that are not
    dcp_sharded keep whole blocks per rank)."""
    dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
    if dcp > 1 and spec is not None and not getattr(spec, "dcp_sharded", True):
        return 1
    return dcp


def _tensor_desc(name: str, t: torch.Tensor, group: int) -> dict[str, Any]:
    """How a KV tensor lies in memory, read from the tensor itself."""
    shape, esize = list(t.shape), t.element_size()
    if len(shape) == 4:
        backend = "paged"  # vLLM >= 0.33: (blocks, heads, block_size, K|V content), any stride order
    elif len(shape) == 3:
        backend = "mla"
    elif len(shape) == 5 and shape[0] == 2:
        backend = "flash_attn"
    elif len(shape) == 5 and shape[1] == 2:
        backend = "flashinfer"
    else:
        raise ValueError(f"KV tensor {name}: unsupported shape {shape} (want vLLM 0.33's (blocks, heads, block_size, content) "
                         "view, FlashAttention, FlashInfer or MLA)")
    device = str(t.device)
    if device == "cuda":
        device = f"cuda:{t.device.index or 0}"
    storage = t.untyped_storage()
    return {
        "layer": name,
        "group": group,
        "backend": backend,
        "device": device,
        "data_ptr": t.data_ptr(),
        "dtype_size": esize,
        "shape": shape,
        "stride_bytes": [s * esize for s in t.stride()],
        "storage_ptr": storage.data_ptr(),
        "storage_bytes": storage.nbytes(),
    }


def _kernel_split_desc(name: str, t: torch.Tensor, block_size: int, group: int) -> dict[str, Any]:
    """The descriptor of a (blocks, heads, kernel block, content) view whose
    blocks vLLM split into kernel blocks (v1/worker/utils.py
    prepare_kernel_block_sizes and allocate_kv_cache: dim 0 counts kernel
    blocks, k of them per block, in order), in the whole blocks the
    scheduler's block ids index. When a kernel block's tokens continue where
    the previous one's end (token-major per-layer pages: LBNHC), the same
    memory is a (blocks, heads, block_size, content) view: one run of tokens
    a block. Otherwise (heads outside the tokens: LBHNC, ...) a
    kernel_blocks dimension says that a block is k kernel blocks
    (layout.DimKernelBlocks)."""
    kbs = t.shape[2]
    if block_size % kbs or t.shape[0] % (block_size // kbs):
        raise ValueError(f"KV tensor {name}: kernel blocks of {kbs} tokens do not divide vLLM's {block_size}-token blocks")
    k = block_size // kbs
    s0, s1, s2, s3 = t.stride()
    if s0 == kbs * s2:
        return _tensor_desc(name, t.as_strided((t.shape[0] // k, t.shape[1], block_size, t.shape[3]), (k * s0, s1, s2, s3)), group)
    d = _tensor_desc(name, t, group)
    esize = t.element_size()
    d["shape"] = [t.shape[0] // k, k, t.shape[1], kbs, t.shape[3]]
    d["stride_bytes"] = [x * esize for x in (k * s0, s0, s1, s2, s3)]
    d["dims"] = ["blocks", "kernel_blocks", "heads", "block_size", "head"]
    return d


def _state_desc(name: str, t: torch.Tensor, block_size: int, group: int) -> dict[str, Any]:
    """The descriptor of a Mamba/SSM layer's page view: vLLM 0.33 views it
    as (blocks, num_heads, states, state bytes) int8 (kv_cache_interface.py
    create_kv_cache_views and compute_layer_kv_cache_shape_bytes: one state
    a block, page_size_padded left outside the view). The block still
    stands for block_size tokens of the block table (layout.TensorDesc
    BlockTokens): kvshim copies the whole state."""
    if t.dim() != 4 or t.shape[2] != 1:
        raise ValueError(f"Mamba state tensor {name}: shape {list(t.shape)}, want vLLM 0.33's (blocks, heads, 1, state bytes) view")
    return _tensor_desc(name, t, group) | {"block_tokens": block_size}


_U32_MAX = 0xFFFFFFFF
if array.array("I").itemsize != 4 or array.array("q").itemsize != 8:  # pragma: no cover - every platform vLLM runs on
    raise ImportError("kvshim needs array('I') of 4 bytes and array('q') of 8")


def _u32(tokens: Any) -> npt.NDArray[np.uint32]:
    """Token ids as a contiguous uint32 array: what Go reads (a pointer and a
    length, no copy on its side).

    A list (vLLM's Request.prompt_token_ids) is read by the library in one
    C loop over the list's items (native.tokens_from_list: 31 µs for 16K
    ids where array('I', ...) takes 111 µs, 0.27 ms for 128K where it takes
    0.85 ms); any other plain sequence, or a list the library cannot read
    (an id out of range: the error below), is packed by ``array('I', ...)``,
    itself about 4x faster than ``np.asarray(tokens, dtype=np.uint32)``
    (``make bench-match`` measures the candidates). vLLM 0.33's Request
    holds no array of its ids to borrow: prompt_token_ids and
    _all_token_ids are lists (EngineCoreRequest's too).

    A uint32 array, memoryview or tensor is used as it is; any other integer
    array is range-checked, then converted. An id outside [0, 2^32) is a
    ValueError and a non-integer a TypeError, both naming the first bad id:
    never a silent wrap."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"token ids must be a sequence or array of integers, not {type(tokens).__name__}")
    if type(tokens) is list:
        out = np.empty(len(tokens), dtype=np.uint32)
        if native.tokens_from_list(tokens, out.ctypes.data, out.size):
            return out
    if not isinstance(tokens, (np.ndarray, array.array, memoryview)) and not hasattr(tokens, "__array__"):
        try:
            packed = array.array("I", tokens)
        except (OverflowError, TypeError) as e:
            raise _bad_token(list(tokens), e) from None
        return np.frombuffer(packed, dtype=np.uint32)
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got an array of {a.dtype}")
    wider = a.dtype != np.uint32 and a.size and (a.dtype.kind == "i" or a.dtype.itemsize > 4)
    if wider and (int(a.min()) < 0 or int(a.max()) > _U32_MAX):
        (i, *_) = np.flatnonzero((a < 0) | (a > _U32_MAX))
        raise ValueError(f"token id {int(a[i])} at position {i} is outside [0, 2**32)")
    return np.ascontiguousarray(a, dtype=np.uint32)


def _bad_token(tokens: list[Any], cause: Exception) -> Exception:
    """The error for the first id that array('I') refused (the slow path,
    only once packing failed)."""
    for i, t in enumerate(tokens):
        try:
            v = int(t.__index__())
        except (AttributeError, TypeError):
            return TypeError(f"token id {t!r} at position {i} is not an integer")
        if not 0 <= v <= _U32_MAX:
            return ValueError(f"token id {v} at position {i} is outside [0, 2**32)")
    return ValueError(f"token ids are not uint32: {cause}")


def _i64(ids: Any) -> npt.NDArray[np.int64]:
    """Block ids as a contiguous int64 array (a list: packed by array('q'),
    about 10 % faster than numpy at 1K-8K ids)."""
    if isinstance(ids, (list, tuple)):
        return np.frombuffer(array.array("q", ids), dtype=np.int64)
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64))


def _open_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, cfg: dict[str, Any],
                 role: KVConnectorRole) -> dict[str, Any]:
    """What native.Scheduler / native.Worker are opened with: the same server,
    engine and namespace in every role, and each role's own settings."""
    tc = vllm_config.kv_transfer_config
    assert tc is not None  # vLLM builds connectors only from a kv_transfer_config
    common = {
        "server": cfg["kvshim.server"],
        "engine_id": str(tc.engine_id),
        "instance": str(uuid.uuid4()),
        "namespace": _namespace(vllm_config, kv_cache_config, cfg),
        "timeout_ms": int(cfg["kvshim.timeout_ms"]),
        **({} if cfg["kvshim.trace_dir"] is None else {"trace_dir": cfg["kvshim.trace_dir"]}),
    }
    if role == KVConnectorRole.SCHEDULER:
        return common | {
            # The scheduler's block: DCP ranks each hold a slice of it.
            "block_size": vllm_config.cache_config.block_size * common["namespace"]["dcp_size"],
            "l1_size_gb": float(cfg["kvshim.l1_size_gb"]),
            **({} if cfg["kvshim.l1_prefault_gb"] is None else {"l1_prefault_gb": cfg["kvshim.l1_prefault_gb"]}),
            "hold_ttl_s": float(cfg["kvshim.hold_ttl_s"]),
            "l2_adapters": [a if isinstance(a, str) else json.dumps(a) for a in cfg["kvshim.l2_adapters"]],
            "metrics_port": int(cfg["kvshim.metrics_port"]),
            # kv_producer saves and never loads, kv_consumer loads and never saves (Go: shim.Role)
            "kv_role": str(tc.kv_role or "kv_both"),
        }
    return common | {"rank": int(vllm_config.parallel_config.rank), "verify": str(cfg["kvshim.verify"])}


class KVShimScheduler:
    """The scheduler side of the connector (vLLM's scheduler process, one per
    engine): vLLM's requests as the native scheduler's arguments."""

    def __init__(self, sched: native.Scheduler, chunk_size: int, layerwise: bool = False) -> None:
        self.native = sched
        self._chunk = chunk_size
        # Layer-wise loads are synchronous: vLLM schedules the request in the
        # step that loads it, and the forward pass waits layer by layer.
        self._async = not layerwise
        # request -> the ids it is looked up over: vLLM's list, or their uint32 array (_match)
        self._ids: dict[str, list[int] | npt.NDArray[np.uint32]] = {}
        # rid -> [request, tokens Go keyed (a chunk boundary), num_preemptions when keyed]
        self._decoding: dict[str, list[Any]] = {}
        self._hits = {"hit_tokens": 0, "hit_requests": 0}  # since the last stats report
        self._match_errors = 0
        self._delay_freed: set[str] = set()  # finished, blocks kept until finished_sending
        self.events: kv_events.EventSource | None = None  # with --kv-events-config (kvshim/events.py)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if self.events is not None:
            self.events.track(request)  # its block hashes name the blocks of its saves
        ids = self._ids.get(rid)
        dec = self._decoding.get(rid)
        if ids is None:
            self._request_options(request)
        if ids is None or (dec is not None and dec[2] != request.num_preemptions):
            # Once per request, and once more each time it is resumed after a
            # preemption: vLLM asks again while a lookup is pending. A resumed
            # request is looked up over all its tokens, prompt and generated:
            # the chunks saved during its decode are loads, not recompute.
            embeds = getattr(request, "prompt_embeds", None) is not None
            ids = request.prompt_token_ids if embeds else self._lookup_ids(request)
            if type(ids) is not list or ids is not request.prompt_token_ids:
                # Only vLLM's prompt list goes to the library as it is: it
                # never changes. all_token_ids (a preempted request's) is a
                # view of a list that grows as the request decodes: its ids
                # now, converted once.
                try:
                    ids = _u32(ids if ids is not None else ())
                except (ValueError, TypeError) as e:  # an id that is no uint32
                    return self._miss(rid, e)
            self._ids[rid] = ids
            if not embeds:
                self._decoding[rid] = [request, len(ids) // self._chunk * self._chunk, request.num_preemptions]
        try:
            n = self._match(rid, ids, _extras(request), num_computed_tokens)
        except (KVShimError, ValueError, TypeError) as e:  # ValueError, TypeError: _match's conversion
            return self._miss(rid, e)
        if n is None:
            return None, False  # pending: vLLM asks again next step
        return n, n > 0 and self._async

    def _match(self, rid: str, ids: list[int] | npt.NDArray[np.uint32], extras: dict[str, Any] | None,
               num_computed: int) -> int | None:
        """native.match over the request's ids: vLLM's prompt list goes to
        the library as it is (match_list, which reads it only while Go has
        not keyed the request); a list the library cannot read is converted
        by _u32 and the array kept for the calls that follow."""
        if isinstance(ids, list):
            try:
                return self.native.match_list(rid, ids, extras, num_computed)
            except (NotSupportedError, InvalidArgumentError):
                # Converted by Python: an id that is no uint32 gets its
                # ValueError or TypeError naming it; else this library or
                # process cannot read lists, and the array is used from now on.
                ids = self._ids[rid] = _u32(ids)
        return self.native.match(rid, ids, extras, num_computed)

    def _request_options(self, request: Request) -> None:
        """The request's kvshim.* kv_transfer_params (docs/vllm-controls.md),
        checked by Go. A bad key or value never fails the request or the
        engine: it is logged, and the request is served without kvshim
        (neither loaded nor saved: a misspelt skip_save must not save)."""
        params = getattr(request, "kv_transfer_params", None)
        if not params or not any(isinstance(k, str) and k.startswith("kvshim.") for k in params):
            return
        try:
            self.native.request_options(request.request_id, params)
        except KVShimError as e:
            logger.warning("kvshim: request %s: %s", request.request_id, e)

    def reset(self) -> bool:
        """reset_cache: True once the server moved the deployment to a new
        generation (nothing stored before is found in any tier)."""
        try:
            gen = self.native.reset()
        except KVShimError as e:
            logger.warning("kvshim: reset_cache failed, the cache was not reset: %s", e)
            return False
        logger.info("kvshim: cache reset (generation %d)", gen)
        return True

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """get_external_cache_hit_sources, per chunk from the tier that served it."""
        if num_external_tokens <= 0:
            return {}
        try:
            got = self.native.hit_sources(request.request_id, num_external_tokens)
        except KVShimError:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource(k): v for k, v in got.items() if v}

    @staticmethod
    def _lookup_ids(request: Request) -> Any:
        """The token ids a request is looked up over: its prompt, or all its
        tokens once it was preempted (it recomputes its answer too)."""
        return request.all_token_ids if request.num_preemptions else request.prompt_token_ids

    def _miss(self, rid: str, why: Exception) -> tuple[int, bool]:
        """A request kvshim cannot key (a token id outside uint32, a LoRA
        path past the length limit, a malformed input) is computed by vLLM: a
        miss, never a dead scheduler. Logged at most a few times, then
        sparsely."""
        self._match_errors += 1
        if self._match_errors <= 10 or self._match_errors % 1000 == 0:
            logger.warning("kvshim: request %s is a miss (%d so far): %s", rid, self._match_errors, why)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._hits["hit_tokens"] += num_external_tokens
            self._hits["hit_requests"] += 1
        # num_computed left out: Go uses the local prefix-cache hit it was given at the match.
        self.native.after_alloc(request.request_id, _i64(_flat_groups(blocks.get_block_ids())), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVShimMetadata:
        sched = scheduler_output.num_scheduled_tokens
        reqs: list[native.StepRequest] = []
        for r in scheduler_output.scheduled_new_reqs:
            entry: native.StepRequest = {"req": r.req_id, "blocks": list(r.block_ids[0]), "computed": r.num_computed_tokens,
                                         "scheduled": sched.get(r.req_id, 0)}
            if len(r.block_ids) > 1:
                entry["group_blocks"] = _more_groups(r.block_ids)
            reqs.append(entry)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            ids = list(new[0]) if new is not None else []
            entry = {"req": rid, "computed": cached.num_computed_tokens[i], "scheduled": sched.get(rid, 0)}
            more = _more_groups(new) if new is not None and len(new) > 1 else None
            if rid in resumed:
                entry["blocks"] = ids
                if more is not None:
                    entry["group_blocks"] = more
            else:
                entry["new_blocks"] = ids
                if more is not None:
                    entry["new_group_blocks"] = more
                if rid in self._decoding:
                    self._decoded_chunks(rid, entry)
            reqs.append(entry)
        step: native.Step = {"requests": reqs, "preempted": sorted(scheduler_output.preempted_req_ids or ())}
        return KVShimMetadata(self.native.build_meta(step))

    def _decoded_chunks(self, rid: str, entry: native.StepRequest) -> None:
        """A running request whose KV crossed a chunk boundary since Go
        keyed its tokens: its token ids up to the last boundary go with its
        step entry (Go keys and saves the new full chunks). Only tokens
        whose KV is computed, accepted and processed count: vLLM's
        num_computed_tokens less the tokens in flight (rejected draft tokens
        are already rolled back; the last sampled token has no KV yet)."""
        dec = self._decoding[rid]
        request, keyed = dec[0], dec[1]
        done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if done < keyed + self._chunk:
            return
        end = done // self._chunk * self._chunk
        try:
            tokens = _u32(request.all_token_ids[keyed:end]).tolist()
        except (ValueError, TypeError):  # an id that is no uint32: not saved
            return
        if len(tokens) == end - keyed:
            entry["tokens"], entry["tokens_from"] = tokens, keyed
            dec[1] = end

    def has_pending_block_frees(self) -> bool:
        # Blocks of finished requests come back once their saves have read
        # them (finished_sending): vLLM waits for those instead of
        # preempting a running request (Scheduler.schedule).
        return bool(self._delay_freed)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._delay_freed.difference_update(connector_output.finished_sending or ())
        if self.events is not None:  # the workers' save reports: what was committed
            self.events.reports(getattr(connector_output, "kv_connector_worker_meta", None))
        if connector_output.finished_recving:
            # A request aborted before vLLM saw its load finish is a cancelled load (its trace record).
            self.native.received(sorted(connector_output.finished_recving))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay = self._finish(request, block_ids)
        if delay:
            self._delay_freed.add(request.request_id)
        return delay, None

    def _finish(self, request: Request, block_ids: list[int]) -> bool:
        """Tells the native scheduler the request finished; whether vLLM
        must keep its blocks until finished_sending."""
        rid = request.request_id
        prompt = self._ids.pop(rid, None)
        self._decoding.pop(rid, None)
        if prompt is None or request.status not in _SAVED_AT_FINISH or getattr(request, "prompt_embeds", None) is not None:
            # Never looked up, aborted (or failed), or a prompt of embeddings
            # (its token ids are placeholders): nothing new is saved.
            return self.native.finished(rid)
        # Every full chunk the request computed, prompt and generated alike,
        # is saved (the next turn of a conversation hits its answer too).
        # Go needs the token ids only from the prompt's last full chunk on
        # (it keyed the ones before at the lookup). Tokens whose KV is in
        # the blocks: num_computed_tokens less the tokens of steps still in
        # flight (async scheduling; vLLM caches its own blocks on the same
        # basis); the last sampled token has none yet, rejected draft tokens
        # are already rolled back.
        first = len(prompt) // self._chunk * self._chunk
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        done = self.native.finished_tokens(rid, _u32(request.all_token_ids[first:]), first, computed, _i64(block_ids))
        if done.not_saved is not None:
            # The request is finished either way: tokens that do not fit it
            # skip the save, never an error in vLLM's scheduler.
            logger.warning("kvshim: the computed chunks of request %s are not saved: %s", rid, done.not_saved)
        return done.delay

    def get_stats(self) -> KVShimStats | None:
        """The scheduler's part of the stats: vLLM calls this after every
        step's update_from_output and adds it to the workers' stats."""
        hits, self._hits = self._hits, {"hit_tokens": 0, "hit_requests": 0}
        st = KVShimStats(data=hits)
        return None if st.is_empty() else st

    def stats(self) -> native.SchedulerStats:
        return self.native.stats()

    def shutdown(self) -> None:
        self.native.close()


class KVShimWorker:
    """The worker side of the connector (one per rank): vLLM's KV tensors,
    step metadata and stream as the native worker's arguments."""

    def __init__(self, worker: native.Worker, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                 timeout_ms: int, layerwise: bool = False) -> None:
        self.native = worker
        self._layerwise = layerwise
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._timeout_ms = timeout_ms
        self._bound: KVShimMetadata | None = None
        self._load_errors: set[int] = set()
        # Several KV-cache groups: block ids are unique only within a group,
        # and vLLM raises on invalid_block_ids (Scheduler._handle_invalid_blocks);
        # a lone windowed or Mamba group cannot recompute from a failed block
        # (the window before it, or the state, is gone). A failed load is
        # reported by request (failed_recving) instead: vLLM recomputes it all.
        self._by_request = _has_groups(kv_cache_config)
        self._failed: set[str] = set()
        self._cpu_caches = False  # every KV tensor on the CPU: no stream event (_stream_event)
        self._reported: dict[str, int] = {}  # counters already in a stats report
        self.events: bool = kv_events.enabled(vllm_config)  # --kv-events-config: report saves
        if self.events:
            worker.take_save_reports()  # Go records from now on

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group_of: dict[str, int] = {}
        block_of: dict[str, int | None] = {}
        state_layers: set[str] = set()
        if self._kv_cache_config is not None:
            from vllm.v1.kv_cache_interface import MambaSpec

            for i, grp in enumerate(self._kv_cache_config.kv_cache_groups):
                group_of |= dict.fromkeys(grp.layer_names, i)
                block_of |= dict.fromkeys(grp.layer_names, getattr(grp.kv_cache_spec, "block_size", None))
                if isinstance(grp.kv_cache_spec, MambaSpec):
                    state_layers.update(grp.layer_names)
        descs: list[dict[str, Any]] = []
        seen: set[tuple[int | None, int]] = set()
        # Layers of a group first: with several KV-cache groups, the i-th
        # layers of all groups view one tensor (vLLM's hybrid allocator),
        # and each group copies its blocks through its own layers. A layer
        # in no group reads another's KV (KV sharing): copied once, with it.
        for name, t in sorted(kv_caches.items(), key=lambda kv: kv[0] not in group_of):
            g = group_of.get(name)
            if (g, t.data_ptr()) in seen or (g is None and any(p == t.data_ptr() for _, p in seen)):
                continue  # layers that share one KV tensor (KV sharing) are copied once
            seen.add((g, t.data_ptr()))
            block_size = block_of.get(name) or self._vllm_config.cache_config.block_size
            if name in state_layers:
                descs.append(_state_desc(name, t, block_size, g or 0))
            elif t.dim() == 4 and t.shape[2] != block_size:
                descs.append(_kernel_split_desc(name, t, block_size, g or 0))
            else:
                descs.append(_tensor_desc(name, t, g or 0))
        self.native.register(descs)
        self._cpu_caches = all(t.device.type == "cpu" for t in kv_caches.values())

    def bind(self, meta: KVConnectorMetadata) -> None:
        """Binds a step's metadata once (handle_preemptions and
        bind_connector_metadata both pass it)."""
        if meta is self._bound or not isinstance(meta, KVShimMetadata):
            return
        self.native.bind(meta.data, self._timeout_ms)
        self._bound = meta

    def clear(self) -> None:
        self._bound = None

    def start_load_kv(self, idle: bool = False) -> None:
        if self._bound is None:
            return
        if self._layerwise:
            self.native.start_loads_layered()
        else:
            self.native.start_loads()
            if idle and self._bound.data[1:2] not in (b"", b"\x00"):  # byte 1: the number of loads
                # Loads and no forward pass this step (vLLM's no-forward step): waited for here,
                # briefly, so this step reports them and vLLM computes the request in the next
                # step, not after one more empty step and its 1 ms sleep (docs/e2e.md).
                self.native.wait(min(self._timeout_ms, 20))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: returns once this layer's copies of the step ended."""
        if self._layerwise and self._bound is not None and not self.native.wait_layer(layer_name, self._timeout_ms):
            logger.warning("kvshim: layer %s not loaded after %d ms; its blocks are load errors", layer_name,
                           self._timeout_ms)

    def _wait_layers(self) -> None:
        """Layer-wise: the step's loads ended, their failures reported
        (before the step's output, which reads them)."""
        if self._layerwise and not self.native.wait_layers(self._timeout_ms):
            logger.warning("kvshim: the step's layer-wise loads still run after %d ms", self._timeout_ms)

    def wait_for_save(self) -> None:
        if self._bound is None:
            return
        # The event only has to live through the call: the library enqueues
        # the save stream's wait on it before returning.
        ev = self._stream_event()
        self.native.start_saves(int(ev.cuda_event) if ev is not None else 0)

    def _stream_event(self) -> Any:
        """A torch.cuda.Event recorded on vLLM's current stream after the
        forward pass, for the save stream to wait on; None when the KV cache
        is on the CPU (the forward pass is done). Known at registration: in
        vLLM's CPU worker torch.cuda.is_available() took ~0.45 ms a step."""
        if self._cpu_caches:
            return None
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._wait_layers()
        done = self.native.poll()
        if self._by_request:
            self._failed.update(done.failed)
        else:
            self._load_errors.update(done.error_blocks)
        return set(done.sending) or None, set(done.recving) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_failed_recving(self) -> set[str]:
        """Requests whose loads failed since the last call (several KV-cache
        groups only; reported with or before their finished_recving)."""
        failed, self._failed = self._failed, set()
        return failed

    def get_stats(self) -> KVShimStats | None:
        """The counters since the last report, as metric names."""
        # Populate* describe the start-up's L1 mapping (a gauge among them),
        # not a step's work: not reported as vLLM's per-step counters.
        now = {k: v for k, v in self.native.stats().counters.items() if not k.startswith("Populate")}
        delta: dict[str, Any] = {_snake(k): v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        lat = self.native.take_latencies()  # job durations for vLLM's /metrics (kvshim.prom)
        for kind in ("load", "save"):
            if lat.get(kind):
                delta[f"{kind}_seconds"] = lat[kind]
        st = KVShimStats(data=delta)
        return None if st.is_empty() else st

    def stats(self) -> native.WorkerStats:
        return self.native.stats()

    def shutdown(self) -> None:
        self.native.close()


class KVShimConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector API on top of libkvshim.so (see the module doc): each
    call goes to the object of this connector's role, connector_scheduler or
    connector_worker (as vLLM's OffloadingConnector does).

    SupportsHMA: vLLM's hybrid KV-cache manager stays on (models with sliding
    windows or chunked local attention keep their smaller KV caches); every
    KV-cache group is saved and restored by its own protocol
    (shim/groups.go)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        # The base declares kv_cache_config required; kvshim also runs without
        # one (one KV-cache group, the layout from vllm_config).
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        tc = vllm_config.kv_transfer_config
        cfg = read_config(dict(tc.kv_connector_extra_config or {}) if tc else {})
        open_cfg = _open_config(vllm_config, kv_cache_config, cfg, role)
        self.connector_scheduler: KVShimScheduler | None = None
        self.connector_worker: KVShimWorker | None = None
        # The first native call of this process: after vLLM's fork.
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVShimScheduler(native.Scheduler(open_cfg), int(cfg["kvshim.chunk_size"]),
                                                       _layerwise(cfg, kv_cache_config))
            if kv_events.enabled(vllm_config):
                self.connector_scheduler.events = kv_events.EventSource(self.connector_scheduler.native,
                                                                        int(open_cfg["block_size"]))
            detail = (f" l1_size_gb={cfg['kvshim.l1_size_gb']:g} l2_adapters={len(cfg['kvshim.l2_adapters'])}"
                      f" kv_cache_layout={open_cfg['namespace'].get('layout', '?')[:120]}")
        else:
            self.connector_worker = KVShimWorker(native.Worker(open_cfg), vllm_config, kv_cache_config,
                                                 int(cfg["kvshim.timeout_ms"]), _layerwise(cfg, kv_cache_config))
            detail = f" rank={open_cfg['rank']}"
        # One line that says kvshim is active, and with what.
        logger.info("kvshim %s active: role=%s server=%s chunk_size=%d verify=%s%s", native.version(),
                    "scheduler" if self.connector_scheduler else "worker", cfg["kvshim.server"],
                    int(cfg["kvshim.chunk_size"]), cfg["kvshim.verify"], detail)

    @property
    def scheduler(self) -> KVShimScheduler:
        """The scheduler side; an error in a worker-role connector."""
        if self.connector_scheduler is None:
            raise RuntimeError(f"a scheduler-side call on a {self.role.name} connector")
        return self.connector_scheduler

    @property
    def worker(self) -> KVShimWorker:
        """The worker side; an error in a scheduler-role connector."""
        if self.connector_worker is None:
            raise RuntimeError(f"a worker-side call on a {self.role.name} connector")
        return self.connector_worker

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # A wish: vLLM drops it, with a warning, if a backend cannot use it.
        tc = vllm_config.kv_transfer_config
        layout: str | None = read_config(dict(tc.kv_connector_extra_config or {}) if tc else {})["kvshim.kv_cache_layout"]
        return layout

    # ---------------------------------------------------------------- scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.has_pending_block_frees()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: every KV-cache group's blocks (vLLM 0.33 calls this
        # instead of request_finished, scheduler.py _connector_finished).
        return self.scheduler.request_finished(request, _flat_groups(block_ids))

    # ------------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Waits for the copies of preempted requests before vLLM reuses their blocks.
        self.worker.bind(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # No attention metadata: a step without a forward pass (kv_connector_no_forward).
        self.worker.start_load_kv(idle=getattr(forward_context, "attn_metadata", None) is None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # By default loads are asynchronous (vLLM schedules a request only
        # after get_finished reported its load) and no layer waits here;
        # with kvshim.layerwise each layer waits for its own copies.
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Saves are submitted once per step, in wait_for_save (layer-wise
        # saves: not built yet, docs/datapath.md).
        return None

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self.worker.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # -------------------------------------------------------------------- both

    def get_kv_connector_stats(self) -> KVShimStats | None:
        if self.connector_scheduler is not None:
            return self.connector_scheduler.get_stats()
        return self.worker.get_stats()

    # ----------------------------------------------------------- vLLM's controls

    def take_events(self) -> Iterable[KVCacheEvent]:
        ev = self.scheduler.events
        return ev.take() if ev is not None else ()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        w = self.worker
        return kv_events.worker_meta(w.native) if w.events else None

    def reset_cache(self) -> bool | None:
        # Scheduler.reset_prefix_cache(reset_connector=True), POST /reset_prefix_cache.
        if self.connector_scheduler is None:
            return None
        return self.connector_scheduler.reset()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.hit_sources(request, num_external_tokens)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        # kvshim's stats in vLLM's own /metrics, labelled per engine (kvshim.prom).
        from kvshim.prom import KVShimPromMetrics

        return KVShimPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVShimStats:
        return KVShimStats(data=dict(data or {}))

    def shutdown(self) -> None:
        for side in (self.connector_scheduler, self.connector_worker):
            if side is not None:
                side.shutdown()


# How a request must have finished for its computed chunks to be saved at
# request_finished: normally (an aborted or failed request saves nothing new).
_SAVED_AT_FINISH = frozenset(
    s for s in (getattr(RequestStatus, n, None) for n in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"))
    if s is not None
)


def _more_groups(block_ids: Any) -> list[list[int]]:
    """Groups 1, 2, ... of per-group block ids, for Go's StepRequest."""
    return [list(ids) for ids in block_ids[1:]]


def _snake(name: str) -> str:
    """Go's field names (SavedChunks) as metric names (saved_chunks)."""
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _extras(request: Request) -> dict[str, Any] | None:
    """The request's inputs that change its KV besides the tokens, as
    shim.DecodeExtras reads them (None: none). Every input keeps its structure (never a joined
    string: "a:b" + "c" and "a" + "b:c" must stay two adapters); Go hashes
    each field length-prefixed.

    The LoRA is {"name", "path"}: vLLM's own prefix-cache identity of an
    adapter (kv_cache_utils._gen_lora_extra_hash_keys keys ("lora", name,
    path)). lora_int_id is left out as vLLM leaves it out: it is a slot in this
    process's LoRA manager, not the weights, and differs across restarts and
    engines for the same adapter (see shim.LoRA)."""
    ex: dict[str, Any] = {}
    if getattr(request, "cache_salt", None):
        ex["cache_salt"] = request.cache_salt
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        ex["lora"] = {"name": lora.lora_name, "path": getattr(lora, "lora_path", "")}
    mm = []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        mm.append({"hash": str(f.identifier), "offset": int(pos.offset), "length": int(pos.length)})
    if mm:
        ex["mm"] = mm
    return ex or None
