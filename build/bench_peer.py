#!/usr/bin/env python3
"""`make bench-peer`: kvshim beside the real LMCache 0.5.6 MP server.

The servers run at the same time, each in its own process, started the way
their users start them, with the same --l1-size-gb (KVSHIM_PEER_L1_GB, 2):

- LMCache: ``python -m lmcache.v1.multiprocess.server --host 127.0.0.1
  --port P --chunk-size 256 --l1-size-gb N --eviction-policy LRU
  --supported-transfer-mode engine_driven``, plus ``--prometheus-port`` on a
  free port (its default 9090 may be taken) and LMCACHE_TRACK_USAGE=false
  (no telemetry: these machines have no way out). With KVSHIM_PEER_SHM=1
  (default) a second one adds ``--shm-name NAME --no-l1-use-lazy``.
- kvshim: ``python -m kvshim serve --socket S --l1-size-gb N
  --eviction-policy LRU``.

Each side is driven from a client process of its own by the code its vLLM
connector runs:

- LMCache: ``lmcache.integration.vllm.vllm_multi_process_adapter``: the
  ``LMCacheMPSchedulerAdapter`` (``maybe_submit_lookup_request``, then
  ``check_lookup_result`` until it is not None, as LMCacheMPConnector's
  ``get_num_new_matched_tokens`` does) and one ``LMCacheMPWorkerAdapter`` per
  rank with CPU torch KV caches, registered with the layout hint vLLM 0.33's
  LBNHC translates to (``NHD``). CPU caches make the adapter pick
  engine-driven transfer (``EngineDrivenTransferContext``: PREPARE_STORE,
  torch gather, COMMIT_STORE; PREPARE_RETRIEVE, torch scatter,
  COMMIT_RETRIEVE). Without ``--shm-name`` (the issue's command line) the
  chunks travel pickled over the ZMQ socket; with it, through the server's
  POSIX shared-memory slots. LMCache's processes run with OMP_NUM_THREADS=1
  (KVSHIM_PEER_LMCACHE_OMP): with torch's default of one OpenMP thread per
  core its CPU gather/scatter of a 32 MiB chunk took 0.2-0.4 s instead of
  ~13 ms on a shared 2-vCPU VM.
- kvshim: libkvshim.so through kvshim.native: a scheduler handle and one
  worker handle per rank on the `kvshim serve` socket, calling what
  KVShimConnector calls (native.Scheduler.match_list until final: the
  Python token list handed to the library, read in C inside the call;
  after_alloc, build_meta, the workers' bind / start_loads / start_saves /
  poll, kvshim_sched_finished). This client runs under
  KVSHIM_PEER_KVSHIM_PYTHON (the test venv's).

Measured on identical token lists, the sides alternating iteration by
iteration (paired samples: load from elsewhere falls on both alike):

(a) lookup to the final answer from a Python token list, 64 chunks (16,384
    tokens), TP 1, full hit;
(b) the same for 512 chunks (131,072 tokens) at TP 8: one lookup for the
    request folds all 8 ranks (kvshim: world_size 8 in the namespace;
    LMCache: the scheduler adapter sends one LOOKUP with worker_id None and
    world_size 8, which the server expands to one key row per KV rank and
    folds; every rank's worker stores its own shard under its worker id);
(c) store and retrieve of one 32 MiB chunk (256 tokens of Llama-3-8B:
    32 layers x 8 KV heads x 128 x bf16, K and V) by a worker with a CPU KV
    cache in vLLM 0.33's layout, restored into other blocks and compared
    byte for byte. Store is timed to the chunk being visible to lookups
    (LMCache's engine-driven store returns after COMMIT_STORE; kvshim frees
    vLLM's blocks once copied, then commits: both times are in the JSON).
    Retrieve is timed from after the lookup to every worker reporting the
    request in finished_recving.

Lookups use a one-layer KV shape: a lookup never touches the payload. Every
lookup is a new request; its holds are released afterwards, untimed
(kvshim_sched_finished; LMCache free_lookup_locks + end_session). A pending
answer is polled every 20 µs (KVSHIM_PEER_POLL_US) on both sides.

The transport floor (64 keys of 32 B echoed: build/bench_ipc.py's pyzmq
DEALER/ROUTER echo with msgpack, and kvshim_ping to the same `kvshim serve`,
back to back and after 5 ms idle) is reported only as that: a floor, not a
peer; beside it, a call of an empty Go export after 3 ms of Python work (the
first entry into Go after idle, under every call of the library from Python).

Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
CHUNK = 256
POLL_S = float(os.environ.get("KVSHIM_PEER_POLL_US", "20")) / 1e6  # between polls of a pending answer
# (c): Llama-3-8B, one 256-token chunk = 32 MiB.
LLAMA_LAYERS, LLAMA_HEADS, LLAMA_HEAD = 32, 8, 128
# (a), (b): lookups only; one layer, 8 KV heads (1 per rank at TP 8), head 16.
TINY_LAYERS, TINY_HEADS, TINY_HEAD = 1, 8, 16


def pct(us: list[float]) -> dict[str, float]:
    a = np.asarray(us, dtype=float)
    a = a[~np.isnan(a)]
    if not a.size:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan"), "n": 0}
    return {"p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "mean": round(float(a.mean()), 1), "n": int(a.size)}


def prompts(seed: int, count: int, n: int) -> list[list[int]]:
    """Python lists of token ids (what vLLM hands a connector)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128_000, n).tolist() for _ in range(count)]


# ------------------------------------------------------------------ kvshim side


class KvshimSide:
    """A scheduler handle and `world` worker handles on a `kvshim serve`
    socket, with CPU KV caches laid out as vLLM 0.33 lays out a
    FlashAttention group in LBNHC: one buffer (layers, blocks, 16, heads,
    K|V), registered as per-layer (blocks, heads, 16, K|V) views."""

    def __init__(self, sock: str, model: str, world: int, layers: int, heads: int, head: int, blocks: int) -> None:
        from kvshim import native

        self.native, self.lib = native, native.library()
        ns = {"model": model, "dtype": "bfloat16", "layout": f"paged LBNHC {layers}x(B,{heads // world},16,{2 * head})",
              "world_size": world, "tp_size": world, "chunk_size": CHUNK, "kv_group": 0, "mla": False}
        # sock "embedded": the server runs in this process (the connector's
        # default), started by the scheduler handle; its lookups call the
        # server's core directly, its workers use the ring.
        self.embedded = sock == "embedded"
        engine = f"bench-peer-{uuid.uuid4().hex[:8]}" if self.embedded else "bench-peer"
        common = {"server": sock, "engine_id": engine, "namespace": ns, "timeout_ms": 10_000}
        extra = {"l1_size_gb": float(os.environ.get("KVSHIM_PEER_L1_GB", "2"))} if self.embedded else {}
        self.scheduler = native.Scheduler({**common, "block_size": BLOCK, **extra})
        self.sched = self.scheduler.handle
        self.workers, self.bufs = [], []
        populated_before = None
        for r in range(world):
            w = native.Handle(json.dumps({**common, "role": "worker", "rank": r}))
            if populated_before is None:  # the process's counter, before any of these workers mapped L1
                populated_before = json.loads(w.output("kvshim_stats"))["worker"].get("PopulatedBytes", 0)
            buf = np.zeros((layers, blocks, BLOCK, heads // world, 2 * head), dtype=np.uint16)
            views = [buf[i].transpose(0, 2, 1, 3) for i in range(layers)]
            desc = [{"layer": f"model.layers.{i}.self_attn.attn", "group": 0, "backend": "paged", "device": "cpu",
                     "data_ptr": v.ctypes.data, "dtype_size": 2, "shape": list(v.shape), "stride_bytes": list(v.strides)}
                    for i, v in enumerate(views)]
            w.check(self.lib.kvshim_worker_register(w.value, json.dumps(desc).encode()))
            self.workers.append(w)
            self.bufs.append(buf)
        # Every server here prepares all of its L1 at start-up (the default
        # prefault, min(4 GiB, L1)): each worker maps and populates all of it.
        want = world * int(float(os.environ.get("KVSHIM_PEER_L1_GB", "2")) * 2**30)
        self.populate_s = self.wait_populated(populated_before or 0, want)

    def wait_populated(self, before: int, want: int, timeout_s: float = 120.0) -> float:
        """Waits until the workers have populated their mappings of L1 (the
        library does it in the background from registration, as vLLM
        starts; an embedded server announces its segments as it prepares
        them): seconds waited. Not timed as part of any lookup."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            stats = [json.loads(w.output("kvshim_stats"))["worker"] for w in self.workers]
            done = stats[0].get("PopulatedBytes", 0) - before
            if done >= want and all(st.get("PopulatePending", 0) == 0 for st in stats):
                break
            time.sleep(0.01)
        return round(time.monotonic() - t0, 2)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.sched.close()

    token_path = "native.Scheduler.match_list: the list read by the library inside the lookup call"

    def match(self, req: str, tokens: list[int]) -> tuple[int, float, int]:
        """get_num_new_matched_tokens until final: (tokens, µs, calls)."""
        t0 = time.perf_counter_ns()
        calls = 0
        while True:
            calls += 1
            n = self.scheduler.match_list(req, tokens)
            if n is not None:
                break
            time.sleep(POLL_S)
        return n, (time.perf_counter_ns() - t0) / 1e3, calls

    def finished(self, req: str) -> bool:
        d = ctypes.c_int()
        self.sched.check(self.lib.kvshim_sched_finished(self.sched.value, req.encode(), ctypes.byref(d)))
        return bool(d.value)

    def after_alloc(self, req: str, blocks: list[int], load: int) -> None:
        ids = np.asarray(blocks, dtype=np.int64)
        self.sched.check(self.lib.kvshim_sched_after_alloc(self.sched.value, req.encode(),
                                                           ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), len(ids), 1, -1, load))

    def step(self, requests: list[dict], saves: bool) -> list[dict]:
        """build_connector_meta; every worker's bind, start_load_kv,
        wait_for_save; every worker's get_finished."""
        meta = self.sched.output("kvshim_sched_build_meta", json.dumps({"requests": requests}).encode())
        buf = ctypes.create_string_buffer(meta, len(meta))
        for w in self.workers:
            w.check(self.lib.kvshim_worker_bind(w.value, buf, len(meta), 10_000))
            w.check(self.lib.kvshim_worker_start_loads(w.value))
            if saves:
                w.check(self.lib.kvshim_worker_start_saves(w.value, 0))
        return [json.loads(w.output("kvshim_worker_poll")) for w in self.workers]

    def wait_all(self, req: str, key: str, polls: list[dict]) -> list[int]:
        """Steps until every worker has reported req in `key`; returns error blocks."""
        done = [req in (p[key] or ()) for p in polls]
        errors = [b for p in polls for b in (p["error_blocks"] or ())]
        deadline = time.monotonic() + 30
        while not all(done):
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvshim: {req} not in {key}")
            time.sleep(POLL_S)
            for i, p in enumerate(self.step([], saves=False)):
                done[i] = done[i] or req in (p[key] or ())
                errors += p["error_blocks"] or ()
        return errors

    def saves_done(self) -> list[int]:
        """Per worker: chunks whose save has ended (COMMIT answered, skipped
        as already stored, or failed)."""
        out = []
        for w in self.workers:
            st = json.loads(w.output("kvshim_stats"))["worker"]
            out.append(st["SavedChunks"] + st["SkippedChunks"] + st["FailedSaves"])
        return out

    def store(self, req: str, tokens: list[int], blocks: list[int]) -> tuple[float, float]:
        """A request that misses, is computed into blocks and saved. Returns
        µs from the step to every worker reporting the request in
        finished_sending (its blocks are vLLM's again: the copy is done), and
        to every worker's COMMIT answered (the chunks are visible to lookups;
        kvshim releases the blocks before it commits)."""
        n, *_ = self.match(req, tokens)
        assert n == 0, f"kvshim: {req} unexpectedly hit {n}"
        self.after_alloc(req, blocks, 0)
        want = [d + len(tokens) // CHUNK for d in self.saves_done()]
        t0 = time.perf_counter_ns()
        polls = self.step([{"req": req, "blocks": blocks, "computed": 0, "scheduled": len(tokens)}], saves=True)
        if self.finished(req):
            self.wait_all(req, "sending", polls)
        t1 = time.perf_counter_ns()
        deadline = time.monotonic() + 30
        while any(d < w for d, w in zip(self.saves_done(), want)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvshim: {req}: saves not committed")
            time.sleep(POLL_S)
        return (t1 - t0) / 1e3, (time.perf_counter_ns() - t0) / 1e3

    def retrieve(self, req: str, load: int, blocks: list[int]) -> tuple[float, list[int]]:
        """After a final lookup of `load` tokens: µs from after_alloc to
        every worker reporting the load done, and the failed blocks."""
        t0 = time.perf_counter_ns()
        self.after_alloc(req, blocks, load)
        errors = self.wait_all(req, "recving", self.step([], saves=False))
        us = (time.perf_counter_ns() - t0) / 1e3
        self.finished(req)
        return us, errors

    def blocks_bytes(self, rank: int, blocks: list[int]) -> bytes:
        return self.bufs[rank][:, blocks].tobytes()

    def fill(self, rank: int, blocks: list[int], rng: np.random.Generator) -> None:
        shape = self.bufs[rank][:, blocks].shape
        self.bufs[rank][:, blocks] = rng.integers(0, 1 << 16, shape, dtype=np.uint16)


# ----------------------------------------------------------------- LMCache side


class LMCacheSide:
    """LMCacheMPSchedulerAdapter plus one LMCacheMPWorkerAdapter per rank,
    with CPU torch KV caches of the same layout as KvshimSide's."""

    def __init__(self, url: str, model: str, world: int, layers: int, heads: int, head: int, blocks: int) -> None:
        import torch
        import zmq
        from lmcache.integration.vllm import vllm_multi_process_adapter as mp

        self.torch, self.mp = torch, mp
        ctx = zmq.Context.instance()

        def strategy(rank: int) -> Any:
            return mp.ParallelStrategy(mla_only=False, vllm_world_size=world, vllm_worker_id=rank, tp_size=world,
                                       pp_size=1, n_servers=1)

        self.workers, self.bufs = [], []
        for r in range(world):
            w = mp.LMCacheMPWorkerAdapter(url, ctx, model, BLOCK, strategy(r))
            buf = torch.zeros((layers, blocks, BLOCK, heads // world, 2 * head), dtype=torch.bfloat16)
            views = {f"model.layers.{i}.self_attn.attn": buf[i].permute(0, 2, 1, 3) for i in range(layers)}
            # What vllm_layout_hints() returns for vLLM 0.33's LBNHC.
            w.register_kv_caches(views, layout_hints={"kv_layout": "NHD"})
            self.workers.append(w)
            self.bufs.append(buf)
        self.sched = mp.LMCacheMPSchedulerAdapter([url], ctx, model, BLOCK, strategy(0))

    def close(self) -> None:
        self.sched.shutdown()
        for w in self.workers:
            w.shutdown()

    def match(self, req: str, tokens: list[int]) -> tuple[int, float, int]:
        """LMCacheMPConnector.get_num_new_matched_tokens until final."""
        s = self.sched
        t0 = time.perf_counter_ns()
        calls = 0
        while True:
            calls += 1
            s.maybe_submit_lookup_request(req, token_ids=tokens)
            r = s.check_lookup_result(req)
            if r is not None:
                break
            time.sleep(POLL_S)
        return r, (time.perf_counter_ns() - t0) / 1e3, calls

    def release(self, req: str, tokens: list[int], hit: int) -> None:
        """A lookup whose chunks will not be retrieved: free its locks, end it."""
        if hit:
            self.sched.free_lookup_locks(tokens, 0, hit, req)
        self.sched.end_session(req)
        self.sched.cleanup_lookup_result(req)
        self.sched.req_clients[self.sched._server_urls[0]].noop().result(timeout=10)

    def _op(self, tokens: list[int], blocks: list[int], end: int) -> Any:
        return self.mp.LoadStoreOp(token_ids=tokens, block_ids=[blocks], start=0, end=end)

    def wait_all(self, req: str, which: int) -> None:
        done = [False] * len(self.workers)
        deadline = time.monotonic() + 30
        while not all(done):
            for i, w in enumerate(self.workers):
                if not done[i]:
                    got = w.get_finished({req})[which]
                    done[i] = bool(got and req in got)
            if not all(done):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"LMCache: {req} not finished")
                time.sleep(POLL_S)

    def store(self, req: str, tokens: list[int], blocks: list[int]) -> tuple[float, float]:
        """As KvshimSide.store; engine-driven submit_store_request returns
        after COMMIT_STORE, so both figures are the same."""
        t0 = time.perf_counter_ns()
        for w in self.workers:
            w.submit_store_request(req, self._op(tokens, blocks, len(tokens) // CHUNK * CHUNK), None)
        self.wait_all(req, 0)
        us = (time.perf_counter_ns() - t0) / 1e3
        return us, us

    def retrieve(self, req: str, tokens: list[int], load: int, blocks: list[int]) -> tuple[float, list[int]]:
        t0 = time.perf_counter_ns()
        for w in self.workers:
            w.submit_retrieve_request(req, self._op(tokens, blocks, load), None)
        self.wait_all(req, 1)
        us = (time.perf_counter_ns() - t0) / 1e3
        errors = sorted(set().union(*(w.get_block_ids_with_load_errors() for w in self.workers)))
        self.sched.end_session(req)
        self.sched.cleanup_lookup_result(req)
        return us, errors

    def blocks_bytes(self, rank: int, blocks: list[int]) -> bytes:
        return self.bufs[rank][:, blocks].contiguous().view(self.torch.uint16).numpy().tobytes()

    def fill(self, rank: int, blocks: list[int], rng: np.random.Generator) -> None:
        shape = tuple(self.bufs[rank][:, blocks].shape)
        data = self.torch.from_numpy(rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.int16))
        self.bufs[rank][:, blocks] = data.view(self.torch.bfloat16)


# --------------------------------------------------------------- the scenarios


class LookupRun:
    """(a), (b): prompts stored once (every rank its shard), then one full-hit
    lookup per iteration, a new request each time."""

    def __init__(self, side: Any, kind: str, seed: int, n_tokens: int, n_prompts: int) -> None:
        self.side, self.kv = side, kind == "kvshim"
        self.prompts = prompts(seed, n_prompts, n_tokens)
        for i, p in enumerate(self.prompts):
            side.store(f"seed-{uuid.uuid4().hex[:8]}-{i}", p, list(range(n_tokens // BLOCK)))
        time.sleep(0.2)

    def iteration(self, i: int) -> dict:
        p = self.prompts[i % len(self.prompts)]
        req = f"look-{uuid.uuid4().hex[:12]}"
        hit, us, calls = self.side.match(req, p)
        if self.kv:
            self.side.finished(req)
        else:
            self.side.release(req, p, hit)
        return {"us": us, "calls": calls, "hit": hit}


class ChunkRun:
    """(c): per iteration a new 257-token prompt (one full chunk and the token
    vLLM computes): store its chunk from blocks [0, 16), look it up, restore
    it into blocks [16, 32), compare byte for byte. kvshim gets every block of
    the request (as vLLM passes them); LMCache the chunk's, as its LoadStoreOp
    covers [0, 256)."""

    def __init__(self, side: Any, kind: str, seed: int) -> None:
        self.side, self.kv = side, kind == "kvshim"
        self.rng = np.random.default_rng(seed)

    def iteration(self, i: int) -> dict:
        side, kv = self.side, self.kv
        src, dst = list(range(16)), list(range(16, 32))
        tokens = self.rng.integers(0, 128_000, CHUNK + 1).tolist()
        side.fill(0, src, self.rng)
        want = side.blocks_bytes(0, src)
        side.bufs[0][:, dst] = 0
        free_us, s_us = side.store(f"chunk-{uuid.uuid4().hex[:12]}", tokens, src + [32] if kv else src)
        req = f"chunk-{uuid.uuid4().hex[:12]}"
        hit, l_us, _ = side.match(req, tokens)
        if hit < CHUNK - 1:  # a miss: nothing to retrieve (never expected)
            print(f"chunk {i}: lookup after the store answered {hit}", file=sys.stderr)
            side.finished(req) if kv else side.release(req, tokens, hit)
            return {"store_us": s_us, "blocks_free_us": free_us, "retrieve_us": float("nan"), "lookup_us": l_us, "ok": False}
        if kv:
            r_us, errors = side.retrieve(req, hit, dst + [33])
            loaded = -(-hit // BLOCK)
        else:
            r_us, errors = side.retrieve(req, tokens, hit, dst)
            loaded = hit // BLOCK
        got = side.blocks_bytes(0, dst[:loaded])
        ok = loaded == 16 and not errors and got == want
        if not ok:
            print(f"chunk {i}: hit {hit}, errors {errors[:4]}, bytes equal {got == want}", file=sys.stderr)
        return {"store_us": s_us, "blocks_free_us": free_us, "retrieve_us": r_us, "lookup_us": l_us, "ok": ok}


def open_run(kind: str, where: str, scenario: str, run: str) -> tuple[Any, Any]:
    make = KvshimSide if kind == "kvshim" else LMCacheSide
    if scenario == "tp1_64":
        side = make(where, f"tiny-{run}-tp1", 1, TINY_LAYERS, TINY_HEADS, TINY_HEAD, 16_384 // BLOCK + 8)
        return side, LookupRun(side, kind, 1, 16_384, 4)
    if scenario == "tp8_512":
        side = make(where, f"tiny-{run}-tp8", 8, TINY_LAYERS, TINY_HEADS, TINY_HEAD, 131_072 // BLOCK + 8)
        return side, LookupRun(side, kind, 2, 131_072, 2)
    side = make(where, f"llama3-8b-{run}", 1, LLAMA_LAYERS, LLAMA_HEADS, LLAMA_HEAD, 40)
    return side, ChunkRun(side, kind, 3)


def serve_client(kind: str, where: str) -> int:
    """A client process: one JSON command per line on stdin, one JSON answer
    per line on the original stdout (everything libraries print goes to
    stderr, the log)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    run = uuid.uuid4().hex[:8]  # fresh model names: nothing of an earlier run can hit
    open_runs: dict[str, tuple[Any, Any]] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op, sc = cmd["op"], cmd.get("scenario", "")
            if op == "setup":
                open_runs[sc] = open_run(kind, where, sc, run)
                side = open_runs[sc][0]
                reply = {"ok": True, "token_conversion": getattr(side, "token_path", None),
                         "populate_s": getattr(side, "populate_s", None)}
            elif op == "iter":
                reply = open_runs[sc][1].iteration(cmd["i"])
            elif op == "close":
                open_runs.pop(sc)[0].close()
                reply = {"ok": True}
            elif op == "floor":
                reply = floor_client(where, cmd["n"])
            else:
                break
        except Exception:
            import traceback

            reply = {"error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
    return 0


def floor_client(sock: str, n: int) -> dict:
    """The transports alone, 64 keys of 32 B echoed: build/bench_ipc.py's
    pyzmq DEALER/ROUTER echo with msgpack (LMCache MP's transport), and
    kvshim_ping on a tool handle to the same `kvshim serve` (kvshim's ring)."""
    sys.path.insert(0, str(ROOT / "build"))
    import bench_ipc
    from kvshim import native

    zq = bench_ipc.bench_zmq(n, n // 10)
    lib = native.library()
    h = native.Handle(json.dumps({"role": "tool", "server": sock}))
    body = np.random.default_rng(0).integers(0, 256, bench_ipc.KEYS * bench_ipc.KEY_BYTES, dtype=np.uint8)
    out = ctypes.create_string_buffer(body.nbytes)
    got = ctypes.c_size_t()
    us = []
    for i in range(n + n // 10):
        t0 = time.perf_counter_ns()
        rc = lib.kvshim_ping(h.value, body.ctypes.data, body.nbytes, out, len(out), ctypes.byref(got))
        t1 = time.perf_counter_ns()
        if rc:
            h.check(rc)
        if i >= n // 10:
            us.append((t1 - t0) / 1e3)
    assert out.raw[: got.value] == body.tobytes(), "echo differs"
    # The same echo after the machine idled 5 ms: the server's thread asleep
    # and both sides' caches cold, as a lookup finds them between steps.
    cold = []
    for _ in range(max(100, n // 25)):
        time.sleep(0.005)
        t0 = time.perf_counter_ns()
        h.check(lib.kvshim_ping(h.value, body.ctypes.data, body.nbytes, out, len(out), ctypes.byref(got)))
        cold.append((time.perf_counter_ns() - t0) / 1e3)
    h.close()
    # An empty Go export after 3 ms of Python work, as a lookup finds the
    # library between scheduler steps: the first entry into Go after idle,
    # under every call from Python (the runtime takes an idle P and wakes
    # its sysmon thread; docs/datapath.md, "What bounds each path here").
    entry = []
    for _ in range(200):
        busy_until = time.perf_counter() + 0.003
        while time.perf_counter() < busy_until:
            pass
        t0 = time.perf_counter_ns()
        lib.kvshim_abi_version()
        entry.append((time.perf_counter_ns() - t0) / 1e3)
    return {"zmq_echo_us": {k: round(zq[k], 1) for k in ("p50", "p99")}, "kvshim_ring_echo_us": pct(us),
            "kvshim_ring_echo_after_5ms_idle_us": pct(cold), "go_entry_after_3ms_busy_us": pct(entry)}


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], log: Path, ready: str, env: dict[str, str]) -> None:
        self.name, self.log, self.ready = name, log, ready
        self.t0 = time.monotonic()
        with open(log, "w") as f:  # a file, never a pipe that can fill
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready_after(self) -> float | None:
        """Seconds from start to its ready line, None while not ready."""
        if self.ready in self.log.read_text(errors="replace"):
            return time.monotonic() - self.t0
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}):\n{tail}")
        return None

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (all its threads)."""
        try:
            f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class Client:
    """A client process (serve_client) driven one command at a time."""

    def __init__(self, kind: str, where: str, python: str, env: dict[str, str], log: Path) -> None:
        self.kind, self.log = kind, log
        with open(log, "w") as f:
            self.proc = subprocess.Popen([python, __file__, "--client", kind, "--where", where], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=f, text=True, env=env)

    def call(self, **cmd: Any) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} client exited ({self.proc.wait()}); see {self.log}:\n"
                               f"{self.log.read_text(errors='replace')[-4000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.kind} client, {cmd}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("nan")


def summarize(samples: list[dict], key: str) -> dict[str, float]:
    return pct([x[key] for x in samples])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client", choices=("kvshim", "lmcache", "lmcache-shm"), help=argparse.SUPPRESS)
    ap.add_argument("--where", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=int(os.environ.get("KVSHIM_PEER_N", "200")),
                    help="lookups per side at TP 1 (half that at TP 8); env KVSHIM_PEER_N")
    ap.add_argument("--chunks", type=int, default=int(os.environ.get("KVSHIM_PEER_CHUNKS", "30")),
                    help="32 MiB store/retrieve rounds per side (0: skip); env KVSHIM_PEER_CHUNKS")
    ap.add_argument("--l1-size-gb", type=float, default=float(os.environ.get("KVSHIM_PEER_L1_GB", "2")),
                    help="--l1-size-gb of every server; env KVSHIM_PEER_L1_GB")
    ap.add_argument("--shm", type=int, default=int(os.environ.get("KVSHIM_PEER_SHM", "1")),
                    help="also run (c) against a second LMCache server with --shm-name (1/0); env KVSHIM_PEER_SHM")
    args = ap.parse_args()
    if args.client:
        return serve_client(args.client, args.where)

    tmp = Path(tempfile.mkdtemp(prefix="kvshim-bench-peer-"))
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    # LMCache's processes (servers and clients) copy with torch on the CPU.
    # With torch's default of one OpenMP thread per core, its gather/scatter
    # of a 32 MiB chunk took 0.2-0.4 s instead of ~13 ms on a shared 2-vCPU
    # VM (spinning OpenMP threads descheduled); one thread is its best here.
    lm_env = dict(env, OMP_NUM_THREADS=os.environ.get("KVSHIM_PEER_LMCACHE_OMP", "1"))
    sock, gb, shm_name = str(tmp / "kvshim.sock"), f"{args.l1_size_gb:g}", f"kvshim_bench_peer_{os.getpid()}"

    def lmcache_argv(port: int) -> list[str]:
        return [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
                "--chunk-size", str(CHUNK), "--l1-size-gb", gb, "--eviction-policy", "LRU",
                "--supported-transfer-mode", "engine_driven", "--prometheus-port", str(free_port())]

    lm_port, shm_port = free_port(), free_port()
    servers = {"lmcache": Server("LMCache MP server", lmcache_argv(lm_port), tmp / "lmcache.log",
                                 "LMCache cache server is running", lm_env),
               "kvshim": Server("kvshim serve", [sys.executable, "-m", "kvshim", "serve", "--socket", sock, "--l1-size-gb",
                                                 gb, "--eviction-policy", "LRU"], tmp / "kvshim.log", "listening on", env)}
    if args.shm and args.chunks:
        # LMCache's other engine-driven path: a shared-memory slot pool instead
        # of pickled chunks on the socket (an eager L1).
        servers["lmcache-shm"] = Server("LMCache MP server --shm-name", lmcache_argv(shm_port) + [
            "--shm-name", shm_name, "--no-l1-use-lazy"], tmp / "lmcache-shm.log", "LMCache cache server is running", lm_env)
    where = {"kvshim": sock, "lmcache": f"tcp://127.0.0.1:{lm_port}", "lmcache-shm": f"tcp://127.0.0.1:{shm_port}"}
    kv_python = os.environ.get("KVSHIM_PEER_KVSHIM_PYTHON") or sys.executable
    load_before = os.getloadavg()
    clients: dict[str, Client] = {}
    samples: dict[str, dict[str, list[dict]]] = {}
    cpu: dict[str, dict[str, float]] = {}
    conversion = None
    populate_s: dict[str, dict[str, float]] = {}
    try:
        start_s: dict[str, float] = {}
        deadline = time.monotonic() + 180
        while len(start_s) < len(servers):
            for k, srv in servers.items():
                if k not in start_s and (t := srv.ready_after()) is not None:
                    start_s[k] = round(t, 2)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after 180 s: {sorted(set(servers) - set(start_s))}; logs in {tmp}")
            time.sleep(0.02)
        print(f"servers up after {start_s} s; logs in {tmp}", file=sys.stderr)
        for k in servers:
            clients[k] = Client(k, where[k], kv_python if k == "kvshim" else sys.executable, env if k == "kvshim" else lm_env,
                                tmp / f"client-{k}.log")
        # The connector's default: the server embedded in the scheduler's
        # process (one per scenario, started by its scheduler handle).
        clients["kvshim-embedded"] = Client("kvshim", "embedded", kv_python, env, tmp / "client-kvshim-embedded.log")
        c0 = {k: s.cpu_s() for k, s in servers.items()}
        time.sleep(10)
        cpu["idle_10s"] = {k: round(s.cpu_s() - c0[k], 3) for k, s in servers.items()}
        plan = [("chunk_32mib", args.chunks, 3, [k for k in ("kvshim", "lmcache", "lmcache-shm") if k in clients])]
        if args.n:
            n8 = max(10, args.n // 2)
            lookup_sides = ["kvshim", "kvshim-embedded", "lmcache"]
            plan = [("tp1_64", args.n, max(2, args.n // 10), lookup_sides),
                    ("tp8_512", n8, max(2, n8 // 10), lookup_sides)] + plan
        for sc, n, warm, who in plan:
            if not n:
                continue
            for k in who:
                r = clients[k].call(op="setup", scenario=sc)
                conversion = r.get("token_conversion") or conversion
                if r.get("populate_s") is not None:
                    populate_s.setdefault(k, {})[sc] = r["populate_s"]
            if sc == "tp8_512" and "kvshim" in who:
                # kvshim serve with its scheduler and 8 worker sessions open
                # and idle (a TP 8 engine between requests).
                c0 = {"kvshim": servers["kvshim"].cpu_s()}
                t0 = time.monotonic()
                time.sleep(5)
                cpu["idle_9_sessions_pct"] = {"kvshim": round((servers["kvshim"].cpu_s() - c0["kvshim"]) / (time.monotonic() - t0) * 100, 2)}
            print(f"{sc}: {n} iterations each, {' and '.join(who)} alternating", file=sys.stderr)
            c0 = {k: servers[k].cpu_s() for k in who if k in servers}
            for i in range(warm + n):
                # Paired samples: every iteration runs each side once, the
                # order rotating, so load from elsewhere falls on both alike.
                for j in range(len(who)):
                    k = who[(i + j) % len(who)]
                    x = clients[k].call(op="iter", scenario=sc, i=i)
                    if i >= warm:
                        samples.setdefault(k, {}).setdefault(sc, []).append(x)
                    time.sleep(0.001)
            cpu[sc] = {k: round((servers[k].cpu_s() - c0[k]) / (warm + n) * 1e3, 2) for k in who if k in servers}
            for k in who:
                clients[k].call(op="close", scenario=sc)
        floor = clients["kvshim"].call(op="floor", n=max(1000, args.n * 25))
    finally:
        for c in clients.values():
            c.close()
        for s in servers.values():
            s.stop()
        for leftover in (shm_name, f"lmcache_l1_pool_{shm_name}"):  # LMCache prefixes the name it is given
            Path(f"/dev/shm/{leftover}").unlink(missing_ok=True)
    load_after = os.getloadavg()

    import lmcache
    from kvshim import native

    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
                    "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after]},
        "versions": {"lmcache": lmcache.__version__, "kvshim": native.version()},
        "server_start_s": start_s, "l1_size_gb": args.l1_size_gb, "kvshim_token_conversion": conversion,
        "lmcache_omp_num_threads": lm_env["OMP_NUM_THREADS"],
        "server_cpu_idle_10s_s": cpu["idle_10s"],
        # kvshim serve, a scheduler and 8 worker sessions connected, idle 5 s:
        # % of one core (target <= 0.5).
        "kvshim_serve_idle_cpu_pct_9_sessions": cpu.get("idle_9_sessions_pct", {}).get("kvshim"),
        # Untimed set-up: workers populating their mappings of L1.
        "kvshim_worker_populate_s": populate_s,
    }
    rows = []
    for sc, label in (("tp1_64", "lookup, 64 chunks, TP 1"), ("tp8_512", "lookup, 512 chunks x TP 8")):
        if sc not in samples.get("kvshim", {}):
            continue
        kvs, lms = samples["kvshim"][sc], samples["lmcache"][sc]
        k, m = summarize(kvs, "us"), summarize(lms, "us")
        emb = samples.get("kvshim-embedded", {}).get(sc, [])
        e = summarize(emb, "us") if emb else None
        out[sc] = {"kvshim_us": k, "lmcache_us": m,
                   "kvshim_answers": sorted({x["hit"] for x in kvs}), "lmcache_answers": sorted({x["hit"] for x in lms}),
                   "kvshim_calls_p50": float(np.median([x["calls"] for x in kvs])),
                   "lmcache_calls_p50": float(np.median([x["calls"] for x in lms])),
                   "server_cpu_ms_per_lookup": cpu[sc],
                   "ratio_p50": ratio(m["p50"], k["p50"]), "ratio_p99": ratio(m["p99"], k["p99"])}
        rows.append((label + ", kvshim serve", k, m, out[sc]["ratio_p50"], out[sc]["ratio_p99"]))
        if e:
            out[sc].update({"kvshim_embedded_us": e, "kvshim_embedded_answers": sorted({x["hit"] for x in emb}),
                            "kvshim_embedded_calls_p50": float(np.median([x["calls"] for x in emb])),
                            "ratio_embedded_p50": ratio(m["p50"], e["p50"]), "ratio_embedded_p99": ratio(m["p99"], e["p99"])})
            rows.append((label + ", embedded", e, m, out[sc]["ratio_embedded_p50"], out[sc]["ratio_embedded_p99"]))
    ok = True
    if "chunk_32mib" in samples.get("kvshim", {}):
        chunk_bytes = LLAMA_LAYERS * CHUNK * LLAMA_HEADS * 2 * LLAMA_HEAD * 2
        res: dict[str, Any] = {"chunk_bytes": chunk_bytes, "server_cpu_ms_per_round": cpu["chunk_32mib"]}
        for k, xs in samples.items():
            if "chunk_32mib" not in xs:
                continue
            xs = xs["chunk_32mib"]
            st, rt = summarize(xs, "store_us"), summarize(xs, "retrieve_us")
            res[k] = {"store_us": st, "store_blocks_free_us": summarize(xs, "blocks_free_us"), "retrieve_us": rt,
                      "lookup_us": summarize(xs, "lookup_us"),
                      "store_gbps_p50": round(chunk_bytes / (st["p50"] * 1e3), 2),
                      "retrieve_gbps_p50": round(chunk_bytes / (rt["p50"] * 1e3), 2),
                      "verified_ok": all(x["ok"] for x in xs)}
            ok = ok and res[k]["verified_ok"]
        for peer, tag in (("lmcache", ""), ("lmcache-shm", ", LMCache --shm-name")):
            if peer not in res:
                continue
            for op in ("store", "retrieve"):
                kk, mm = res["kvshim"][f"{op}_us"], res[peer][f"{op}_us"]
                suffix = "" if peer == "lmcache" else "_shm"
                res[f"{op}_ratio{suffix}_p50"], res[f"{op}_ratio{suffix}_p99"] = ratio(mm["p50"], kk["p50"]), ratio(mm["p99"], kk["p99"])
                rows.append((f"{op} one 32 MiB chunk{tag}", kk, mm, res[f"{op}_ratio{suffix}_p50"], res[f"{op}_ratio{suffix}_p99"]))
        out["chunk_32mib"] = res
    out["transport_floor_64_keys"] = floor

    print(f"{'(µs)':<44}{'kvshim p50':>11}{'p99':>9}{'LMCache p50':>13}{'p99':>10}{'ratio p50':>11}{'p99':>7}")
    for label, k, m, r50, r99 in rows:
        print(f"{label:<44}{k['p50']:>11.0f}{k['p99']:>9.0f}{m['p50']:>13.0f}{m['p99']:>10.0f}{r50:>10.1f}x{r99:>6.1f}x")
    print(f"transport floor only, 64 keys of 32 B echoed (not LMCache): pyzmq {floor['zmq_echo_us']['p50']} µs, "
          f"kvshim ring {floor['kvshim_ring_echo_us']['p50']} µs p50, "
          f"{floor['kvshim_ring_echo_after_5ms_idle_us']['p50']} µs after 5 ms idle; "
          f"an empty Go call after 3 ms of Python work {floor['go_entry_after_3ms_busy_us']['p50']} µs")
    print(json.dumps(out))
    return 0 if ok else 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
