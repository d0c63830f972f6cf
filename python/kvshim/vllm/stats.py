"""What crosses from one side to the other: the step metadata (Go's bytes)
and the stats vLLM collects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVShimStats(KVConnectorStats):
    """kvshim's counters since the last report (kvshim_take_step_stats): the
    workers' and the scheduler's are summed by aggregate() across ranks
    (vLLM's KVOutputAggregator), with the scheduler's and over vLLM's
    logging interval. reduce() is what vLLM's LoggingStatLogger prints ("KV
    Transfer metrics: k=v, ..."): the SUMMARY keys, then any other counter."""

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
