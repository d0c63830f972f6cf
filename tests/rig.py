"""Drives the connector's two roles through the C ABI with no vLLM: one
scheduler handle (which starts the embedded server) and one worker handle
over CPU tensors (this machine has no GPU)."""

from __future__ import annotations

import ctypes
import json
import time
from typing import Any

import numpy as np

from kvshim import native

BLOCK, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 16


def fa_cache(blocks: int = 32) -> list[tuple[np.ndarray, dict[str, Any]]]:
    """Per-layer FlashAttention NHD caches (2, blocks, 16, 2, 16) of fp16."""
    out = []
    for i in range(LAYERS):
        t = np.zeros((2, blocks, BLOCK, HEADS, HEAD), dtype=np.float16)
        out.append((t, {"layer": f"l{i}", "group": 0, "backend": "flash_attn", "device": "cpu", "data_ptr": t.ctypes.data,
                        "dtype_size": 2, "shape": list(t.shape), "stride_bytes": list(t.strides)}))
    return out


class Rig:
    """One scheduler handle (embedded server) and one worker handle over a
    small FlashAttention-shaped CPU cache."""

    def __init__(self, engine: str, tensors: list[tuple[Any, dict[str, Any]]], l2: list[dict] | None = None,
                 mla: bool = False) -> None:
        self.lib = native.library()
        ns = {"model": "t", "dtype": "float16", "layout": "x", "world_size": 1, "chunk_size": CHUNK, "mla": mla}
        common = {"server": "embedded", "engine_id": engine, "namespace": ns, "timeout_ms": 3000}
        self.sched = native.Handle(json.dumps({**common, "role": "scheduler", "block_size": BLOCK, "l1_size_gb": 0.0625,
                                               "l2_adapters": [json.dumps(a) for a in l2 or []]}))
        self.worker = native.Handle(json.dumps({**common, "role": "worker", "rank": 0}))
        self.kv = [t for t, _ in tensors]
        descs = [d for _, d in tensors]
        try:
            self.worker.check(self.lib.kvshim_worker_register(self.worker.value, json.dumps(descs).encode()))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.worker.close()
        self.sched.close()

    def match(self, req: str, tokens: np.ndarray) -> int:
        out = ctypes.c_int64(-1)
        for _ in range(2000):
            self.sched.check(self.lib.kvshim_sched_match(self.sched.value, req.encode(),
                                                         tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), len(tokens),
                                                         None, 0, ctypes.byref(out)))
            if out.value >= 0:
                return out.value
            time.sleep(0.002)
        raise AssertionError("lookup still pending")

    def alloc(self, req: str, blocks: list[int], n: int) -> None:
        ids = np.array(blocks, dtype=np.int64)
        self.sched.check(self.lib.kvshim_sched_after_alloc(self.sched.value, req.encode(),
                                                           ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), len(ids), -1, n))

    def step(self, requests: list[dict], saves: bool) -> dict:
        meta = self.sched.output("kvshim_sched_build_meta", json.dumps({"requests": requests}).encode())
        buf = ctypes.create_string_buffer(meta, len(meta))
        self.worker.check(self.lib.kvshim_worker_bind(self.worker.value, buf, len(meta), 3000))
        self.worker.check(self.lib.kvshim_worker_start_loads(self.worker.value))
        if saves:
            self.worker.check(self.lib.kvshim_worker_start_saves(self.worker.value, 0))
        return json.loads(self.worker.output("kvshim_worker_poll"))

    def drain(self, want: str, key: str) -> dict:
        for _ in range(1000):
            p = self.step([], saves=False)
            if want in (p[key] or ()):
                return p
            time.sleep(0.003)
        raise AssertionError(f"{want} never reported in {key}")

    def stats(self) -> dict:
        return json.loads(self.sched.output("kvshim_stats"))


    def finished(self, req: str) -> bool:
        delay = ctypes.c_int()
        self.sched.check(self.lib.kvshim_sched_finished(self.sched.value, req.encode(), ctypes.byref(delay)))
        return bool(delay.value)

    def accounted_saves(self) -> int:
        """Chunks the worker has finished with: saved, skipped or failed."""
        w = json.loads(self.worker.output("kvshim_stats"))["worker"]
        return w["SavedChunks"] + w["SkippedChunks"] + w["FailedSaves"]

    def save(self, req: str, tokens: np.ndarray, blocks: list[int]) -> None:
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

    def restore(self, req: str, tokens: np.ndarray, blocks: list[int]) -> tuple[int, list[int]]:
        """A request that hits: its prefix is loaded into blocks; returns the
        loaded tokens and the blocks that failed."""
        n = self.match(req, tokens)
        self.alloc(req, blocks, n)
        errors = self.drain(req, "recving")["error_blocks"] or [] if n else []
        self.finished(req)
        return n, errors
