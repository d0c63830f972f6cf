"""vLLM's KV events (take_events, published by --kv-events-config) for
kvshim: Go decides what happened (shim/events.go: a chunk is announced once
every KV rank committed it; a reset clears everything; the server reports
the announced chunks that L1 evicted or an L2 wrote or dropped, whichever
instance caused it); this module only carries the workers' save reports to
the scheduler and turns Go's JSON into vLLM's BlockStored / BlockRemoved /
AllBlocksCleared dataclasses, with the block hashes, token ids and LoRA of
the request as vLLM's own events carry them."""

from __future__ import annotations

from array import array
from collections import OrderedDict
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


# The most chunks whose announcement is remembered (their block hashes, to
# name them in a later BlockRemoved; their tokens, for a STORAGE
# BlockStored). The server keeps as many per session (server/events.go
# maxAnnounced); past it the oldest is reported removed, here as there, so
# a router never keeps a block nobody would report gone. About 1 KiB a
# chunk of 256 tokens.
MAX_ANNOUNCED = 1 << 16


@dataclass
class _Chunk:
    """What one announced chunk's events need: its blocks' hashes (vLLM's
    converted form), the block before it, its tokens, LoRA, group and the
    media it was announced in."""

    hashes: list[Any]
    parent: Any
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    group: int
    media: set[str]


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
        self.chunks: OrderedDict[str, _Chunk] = OrderedDict()  # chunk hash (hex) -> its announcement
        self._overflow: list[KVCacheEvent] = []  # removals of chunks forgotten at MAX_ANNOUNCED
        fields = set(getattr(kv_events.BlockStored, "__struct_fields__", ()))
        self._group_field = "group_idx" in fields  # 0.32 and 0.33 have it; feature-detected all the same
        self._removed_group = "group_idx" in set(getattr(kv_events.BlockRemoved, "__struct_fields__", ()))
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
            kind = ev["kind"]
            if kind == "cleared":
                self.chunks.clear()
                out.append(self._kv_events.AllBlocksCleared())
            elif kind == "removed":
                self._removed(ev, out)
            elif kind == "stored_chunk":
                self._stored_chunk(ev, out)
            else:
                e = self._stored(ev)
                if e is not None:
                    out.append(e)
        for rid in got["done"]:
            self.requests.pop(rid, None)
        if self._overflow:
            out.extend(self._overflow)
            self._overflow.clear()
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
        converted = [maybe_convert_block_hash(h) for h in hashes]
        parent = maybe_convert_block_hash(req.block_hashes[first - 1]) if first > 0 else None
        medium = str(ev.get("medium") or "CPU")
        tokens = list(req.all_token_ids[first * bs:(first + n) * bs])
        chunks = ev.get("chunks") or []
        if chunks and n % len(chunks) == 0:
            per = n // len(chunks)
            for i, ch in enumerate(chunks):
                self._remember(str(ch), _Chunk(
                    hashes=converted[i * per:(i + 1) * per],
                    parent=parent if i == 0 else converted[i * per - 1],
                    tokens=array("q", tokens[i * per * bs:(i + 1) * per * bs]),
                    lora_id=lora.adapter_id if lora else None, lora_name=lora.name if lora else None,
                    group=int(ev["group"]), media={medium}))
        return self._kv_events.BlockStored(
            block_hashes=converted,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=medium,
            lora_name=lora.name if lora else None,
            **kw,
        )

    def _remember(self, key: str, ch: _Chunk) -> None:
        """Keeps ch's announcement; past MAX_ANNOUNCED the oldest is
        reported removed from every medium it was announced in (at the end
        of this take's events)."""
        old = self.chunks.pop(key, None)
        if old is not None:
            ch.media |= old.media
        self.chunks[key] = ch
        while len(self.chunks) > MAX_ANNOUNCED:
            _, gone = self.chunks.popitem(last=False)
            self._overflow.extend(self._removal(gone, m) for m in sorted(gone.media))

    def _removal(self, ch: _Chunk, medium: str) -> KVCacheEvent:
        kw: dict[str, Any] = {"group_idx": ch.group} if self._removed_group else {}
        return self._kv_events.BlockRemoved(block_hashes=list(ch.hashes), medium=medium, **kw)

    def _removed(self, ev: dict[str, Any], out: list[KVCacheEvent]) -> None:
        """The server's report that an announced chunk left a medium (an
        L1 eviction, an L2 drop): BlockRemoved with the hashes announced
        for it. A chunk not announced here (a reset since, a rank that
        never committed) names no block of ours."""
        key, medium = str(ev["chunk"]), str(ev.get("medium") or "CPU")
        ch = self.chunks.get(key)
        if ch is None or medium not in ch.media:
            return
        ch.media.discard(medium)
        if not ch.media:
            del self.chunks[key]
        out.append(self._removal(ch, medium))

    def _stored_chunk(self, ev: dict[str, Any], out: list[KVCacheEvent]) -> None:
        """The server's report that the L2 writer wrote an announced chunk:
        BlockStored for it, medium STORAGE, as its CPU one was."""
        key, medium = str(ev["chunk"]), str(ev.get("medium") or "STORAGE")
        ch = self.chunks.get(key)
        if ch is None or medium in ch.media:
            return
        ch.media.add(medium)
        kw: dict[str, Any] = {"group_idx": ch.group} if self._group_field else {}
        out.append(self._kv_events.BlockStored(
            block_hashes=list(ch.hashes), parent_block_hash=ch.parent, token_ids=list(ch.tokens),
            block_size=self.block_size, lora_id=ch.lora_id, medium=medium, lora_name=ch.lora_name, **kw))
