"""vLLM's KV events (take_events, published by --kv-events-config) for
kvshim: Go decides what happened (shim/events.go: a chunk is announced once
every KV rank committed it; a reset clears everything); this module only
carries the workers' save reports to the scheduler and turns Go's JSON into
vLLM's BlockStored / AllBlocksCleared dataclasses, with the block hashes,
token ids and LoRA of the request as vLLM's own events carry them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:  # vLLM 0.32 and 0.33 both have it; an older vLLM has no worker metadata
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

    from kvshim import native


def enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (--kv-events-config with
    enable_kv_cache_events): kvshim records nothing otherwise."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


@dataclass
class KVShimWorkerMeta(KVConnectorWorkerMetadata):
    """One step's save reports of each worker (Go's JSON, unparsed);
    vLLM's KVOutputAggregator concatenates the ranks' lists."""

    reports: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVShimWorkerMeta:
        if isinstance(other, KVShimWorkerMeta):
            self.reports.extend(other.reports)
        return self


def worker_meta(worker: native.Worker) -> KVShimWorkerMeta | None:
    """The save reports since the last step, None when there are none."""
    data = worker.take_save_reports()
    return None if data.strip() in (b"", b"[]") else KVShimWorkerMeta([data])


class EventSource:
    """The scheduler's events: the requests whose blocks may still be
    announced (vLLM's Request: block hashes, tokens, LoRA), until Go says
    they are done."""

    def __init__(self, sched: native.Scheduler, block_size: int) -> None:
        from vllm.distributed import kv_events

        self._kv_events = kv_events
        self.native = sched
        self.block_size = block_size
        self.requests: dict[str, Request] = {}
        fields = set(getattr(kv_events.BlockStored, "__struct_fields__", ()))
        self._group_field = "group_idx" in fields  # 0.32 and 0.33 have it; feature-detected all the same
        sched.take_events()  # Go records from now on

    def track(self, request: Request) -> None:
        self.requests.setdefault(request.request_id, request)

    def reports(self, meta: Any) -> None:
        """update_connector_output's worker metadata."""
        if isinstance(meta, KVShimWorkerMeta) and meta.reports:
            self.native.save_reports(meta.reports)

    def take(self) -> list[KVCacheEvent]:
        got = self.native.take_events()
        out: list[KVCacheEvent] = []
        for ev in got["events"]:
            if ev["kind"] == "cleared":
                out.append(self._kv_events.AllBlocksCleared())
                continue
            e = self._stored(ev)
            if e is not None:
                out.append(e)
        for rid in got["done"]:
            self.requests.pop(rid, None)
        return out

    def _stored(self, ev: dict[str, Any]) -> KVCacheEvent | None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req = self.requests.get(ev["req"])
        if req is None:
            return None
        first, n, bs = int(ev["first_block"]), int(ev["blocks"]), self.block_size
        hashes = list(req.block_hashes[first:first + n])
        if len(hashes) != n:
            # vLLM hashed the request at another granularity (a hybrid
            # model's hash_block_size): no hashes to name the blocks by.
            return None
        lora = req.lora_request
        kw: dict[str, Any] = {}
        if self._group_field:
            kw["group_idx"] = int(ev["group"])
        return self._kv_events.BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes],
            parent_block_hash=maybe_convert_block_hash(req.block_hashes[first - 1]) if first > 0 else None,
            token_ids=list(req.all_token_ids[first * bs:(first + n) * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=str(ev.get("medium") or "CPU"),
            lora_name=lora.name if lora else None,
            **kw,
        )
