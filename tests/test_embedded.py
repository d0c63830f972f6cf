"""The connector's two roles through the C ABI against the embedded server,
with no vLLM: the demo end to end, and L2 surviving a server restart.

CPU memory stands in for GPU memory (this machine has no GPU)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest

from kvshim import native

BLOCK, CHUNK, LAYERS, HEADS, HEAD = 16, 32, 2, 2, 16


def test_demo_restores_and_verifies(repo_root):
    r = subprocess.run([sys.executable, "-m", "kvshim", "demo", "--requests", "4", "--l1-size-gb", "1"],
                       capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["verified_ok"] is True
    assert result["hit_tokens"] > 0 and result["bytes_restored"] > 0
    assert result["requests"] == 4
    assert result["restore_gbps"] > 0 and result["lookup_p50_us"] > 0


class Rig:
    """One scheduler handle (embedded server) and one worker handle over a
    small FlashAttention-shaped CPU cache."""

    def __init__(self, engine: str, l2: list[dict], blocks: int = 32) -> None:
        self.lib = native.library()
        ns = {"model": "t", "dtype": "float16", "layout": "fa", "object_format": 1, "world_size": 1, "chunk_size": CHUNK}
        common = {"server": "embedded", "engine_id": engine, "namespace": ns, "timeout_ms": 3000}
        self.sched = native.Handle(json.dumps({**common, "role": "scheduler", "block_size": BLOCK, "l1_size_gb": 0.0625,
                                               "l2_adapters": [json.dumps(a) for a in l2]}))
        self.worker = native.Handle(json.dumps({**common, "role": "worker", "rank": 0}))
        self.kv = [np.zeros((2, blocks, BLOCK, HEADS, HEAD), dtype=np.float16) for _ in range(LAYERS)]
        descs = [{"layer": f"l{i}", "group": 0, "backend": "flash_attn", "device": "cpu", "data_ptr": t.ctypes.data,
                  "dtype_size": 2, "shape": list(t.shape), "stride_bytes": list(t.strides)} for i, t in enumerate(self.kv)]
        self.worker.check(self.lib.kvshim_worker_register(self.worker.value, json.dumps(descs).encode()))

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
            import time
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
        import time
        for _ in range(1000):
            p = self.step([], saves=False)
            if want in (p[key] or ()):
                return p
            time.sleep(0.003)
        raise AssertionError(f"{want} never reported in {key}")

    def stats(self) -> dict:
        return json.loads(self.sched.output("kvshim_stats"))


def test_l2_serves_hits_after_a_restart_with_empty_l1(tmp_path):
    l2 = [{"type": "fs", "base_path": str(tmp_path / "l2")}]
    tokens = np.arange(1000, 1000 + 3 * CHUNK + 5, dtype=np.uint32)
    src = list(range(0, 7))
    rig = Rig(f"t-{uuid.uuid4().hex[:8]}", l2)
    try:
        assert rig.match("a", tokens) == 0
        rng = np.random.default_rng(3)
        for t in rig.kv:
            t[:, src] = rng.standard_normal(t[:, src].shape).astype(np.float16)
        saved = [t[:, src[:6]].copy() for t in rig.kv]
        rig.alloc("a", src, 0)
        rig.step([{"req": "a", "blocks": src, "computed": 0, "scheduled": len(tokens)}], saves=True)
        delay = ctypes.c_int()
        rig.sched.check(rig.lib.kvshim_sched_finished(rig.sched.value, b"a", ctypes.byref(delay)))
        assert delay.value == 1
        rig.drain("a", "sending")
        # The store controller writes to L2 in the background.
        import time
        for _ in range(500):
            if rig.stats()["server"].get("kvshim_l2_store_saved_objects_total{adapter=fs}", 0) >= 3:
                break
            time.sleep(0.01)
        assert rig.stats()["server"]["kvshim_l2_store_saved_objects_total{adapter=fs}"] == 3
    finally:
        rig.close()

    # A new server: L1 is empty, L2 (the same directory) has the chunks.
    rig = Rig(f"t-{uuid.uuid4().hex[:8]}", l2)
    try:
        assert rig.stats()["server"]["kvshim_l1_used_bytes"] == 0
        n = rig.match("b", tokens)
        assert n == 3 * CHUNK
        dst = list(range(20, 26))
        rig.alloc("b", dst, n)
        p = rig.drain("b", "recving")
        assert not p["error_blocks"]
        for t, want in zip(rig.kv, saved):
            np.testing.assert_array_equal(t[:, dst], want)
    finally:
        rig.close()


def test_unknown_connector_config_key_is_refused():
    from kvshim.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="unknown field \"bogus\""):
        native.Handle(json.dumps({"role": "scheduler", "server": "embedded", "engine_id": "x", "bogus": 1}))
