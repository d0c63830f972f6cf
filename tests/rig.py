"""Drives the connector's two roles through the typed binding with no vLLM:
one scheduler (which starts the embedded server) and one worker over CPU
tensors (this machine has no GPU)."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvshim import native

BLOCK, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 16


def fa_cache(blocks: int = 32) -> list[tuple[npt.NDArray[np.float16], dict[str, Any]]]:
    """Per-layer FlashAttention NHD caches (2, blocks, 16, 2, 16) of fp16."""
    out: list[tuple[npt.NDArray[np.float16], dict[str, Any]]] = []
    for i in range(LAYERS):
        t = np.zeros((2, blocks, BLOCK, HEADS, HEAD), dtype=np.float16)
        out.append((t, {"layer": f"l{i}", "group": 0, "backend": "flash_attn", "device": "cpu", "data_ptr": t.ctypes.data,
                        "dtype_size": 2, "shape": list(t.shape), "stride_bytes": list(t.strides)}))
    return out


class Rig:
    """One scheduler (embedded server) and one worker over a small
    FlashAttention-shaped CPU cache."""

    def __init__(self, engine: str, tensors: list[tuple[Any, dict[str, Any]]], l2: list[dict[str, Any]] | None = None,
                 mla: bool = False) -> None:
        ns = {"model": "t", "dtype": "float16", "layout": "x", "world_size": 1, "chunk_size": CHUNK, "mla": mla}
        common = {"server": "embedded", "engine_id": engine, "namespace": ns, "timeout_ms": 3000}
        self.sched = native.Scheduler({**common, "block_size": BLOCK, "l1_size_gb": 0.0625,
                                       "l2_adapters": [json.dumps(a) for a in l2 or []]})
        self.worker = native.Worker({**common, "rank": 0})
        self.kv = [t for t, _ in tensors]
        try:
            self.worker.register([d for _, d in tensors])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.worker.close()
        self.sched.close()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def match(self, req: str, tokens: npt.NDArray[np.uint32]) -> int:
        for _ in range(2000):
            n = self.sched.match(req, tokens)
            if n is not None:
                return n
            time.sleep(0.002)
        raise AssertionError("lookup still pending")

    def alloc(self, req: str, blocks: list[int], n: int) -> None:
        self.sched.after_alloc(req, blocks, n)

    def step(self, requests: list[native.StepRequest], saves: bool) -> native.Finished:
        self.worker.bind(self.sched.build_meta({"requests": requests}), 3000)
        self.worker.start_loads()
        if saves:
            self.worker.start_saves()
        return self.worker.poll()

    def drain(self, want: str, key: Literal["sending", "recving"]) -> native.Finished:
        for _ in range(1000):
            p = self.step([], saves=False)
            if want in getattr(p, key):
                return p
            time.sleep(0.003)
        raise AssertionError(f"{want} never reported in {key}")

    def stats(self) -> native.SchedulerStats:
        return self.sched.stats()

    def finished(self, req: str) -> bool:
        return self.sched.finished(req)

    def accounted_saves(self) -> int:
        """Chunks the worker has finished with: saved, skipped or failed."""
        w = self.worker.stats().counters
        return w["SavedChunks"] + w["SkippedChunks"] + w["FailedSaves"]

    def save(self, req: str, tokens: npt.NDArray[np.uint32], blocks: list[int]) -> None:
        """A request that misses, is computed into blocks, is saved, finishes;
        returns once its chunks are committed (or failed)."""
        before = self.accounted_saves()
        assert self.match(req, tokens) == 0
        self.alloc(req, blocks, 0)
        self.step([{"req": req, "blocks": blocks, "computed": 0, "scheduled": len(tokens)}], saves=True)
        assert self.finished(req)  # delay-free until the saves have read the blocks
        self.drain(req, "sending")
        # The blocks are free once the copies have read them; COMMIT (what
        # makes the chunks visible to lookups) may come a moment later.
        deadline = time.monotonic() + 5
        while self.accounted_saves() < before + len(tokens) // CHUNK:
            assert time.monotonic() < deadline, "saves not accounted for within 5 s"
            time.sleep(0.002)

    def restore(self, req: str, tokens: npt.NDArray[np.uint32], blocks: list[int]) -> tuple[int, list[int]]:
        """A request that hits: its prefix is loaded into blocks; returns the
        loaded tokens and the blocks that failed."""
        n = self.match(req, tokens)
        self.alloc(req, blocks, n)
        errors = self.drain(req, "recving").error_blocks if n else []
        self.finished(req)
        return n, errors
