"""`kvshim demo`: store and restore a Llama-3-8B-shaped paged KV cache.

The demo drives libkvshim.so the way the vLLM connector does, one engine
step at a time, with no vLLM in the process: a scheduler handle (which starts
the embedded server, as `--kv-transfer-config` alone does in vLLM) and a
worker handle whose KV cache is laid out as vLLM 0.33 lays out Llama-3-8B's
for FlashAttention: one bf16 buffer in CPU memory, seen as 32 per-layer
(blocks, 8 heads, 16 tokens, K|V 256) views (KVCacheLayout LBNHC). A stream of requests that share
prefixes runs through it. For each request the demo looks the prompt up
(pending, then final), allocates fresh blocks, has the worker restore the hit
chunks from the server's shared-memory L1 into those blocks (never the blocks
they were saved from), checks every restored byte against what the "model"
computes, computes the rest, and saves the new full chunks (ALLOC, copy,
COMMIT) before the blocks are freed.

The "model" fills a block's KV with bytes derived from the hash of the whole
prefix up to that block, so a restored block is right only if exactly that
prefix's bytes came back.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import time
import uuid

import numpy as np

from kvshim import native

# Llama-3-8B: 32 layers, 8 KV heads, head size 128, bf16; vLLM block 16.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 32, 8, 128, 16
BLOCK_BYTES = LAYERS * BLOCK_TOKENS * KV_HEADS * 2 * HEAD_SIZE * 2  # 2 MiB across layers, K and V


class PagedCache:
    """vLLM 0.33's allocate_kv_cache for one FlashAttention group in LBNHC:
    one buffer (layers, blocks, block_size, heads, K|V), registered as a
    (blocks, heads, block_size, K|V) view per layer."""

    def __init__(self, num_blocks: int) -> None:
        self.buf = np.zeros((LAYERS, num_blocks, BLOCK_TOKENS, KV_HEADS, 2 * HEAD_SIZE), dtype=np.uint16)
        self.free = [int(i) for i in np.random.default_rng(7).permutation(num_blocks)]

    def describe(self) -> str:
        views = [self.buf[i].transpose(0, 2, 1, 3) for i in range(LAYERS)]
        return json.dumps([
            {"layer": f"model.layers.{i}.self_attn.attn", "group": 0, "backend": "paged", "device": "cpu",
             "data_ptr": v.ctypes.data, "dtype_size": 2, "shape": list(v.shape), "stride_bytes": list(v.strides)}
            for i, v in enumerate(views)
        ])

    def allocate(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise MemoryError(f"demo cache has {len(self.free)} free blocks, request needs {n}")
        ids, self.free = self.free[:n], self.free[n:]
        return np.array(ids, dtype=np.int64)

    def release(self, ids: np.ndarray) -> None:
        self.free.extend(int(i) for i in ids)

    def read(self, b: int) -> bytes:
        return self.buf[:, b].tobytes()

    def write(self, b: int, data: np.ndarray) -> None:
        self.buf[:, b] = data.view(np.uint16).reshape(self.buf[:, b].shape)


_PATTERN = np.random.default_rng(0).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def expected_block(tokens: np.ndarray, block: int) -> np.ndarray:
    """The bytes the 'model' computes for block `block` of this prompt: a
    fixed pattern XOR the SHA-256 of the whole prefix, repeated."""
    digest = np.frombuffer(hashlib.sha256(tokens[: (block + 1) * BLOCK_TOKENS].tobytes()).digest(), dtype=np.uint8)
    return _PATTERN ^ np.tile(digest, BLOCK_BYTES // digest.size)


def workload(requests: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Prompts sharing a system prompt, then one of a few documents, then a question."""
    system = rng.integers(0, 128_000, 1024, dtype=np.uint32)
    docs = [rng.integers(0, 128_000, 2048, dtype=np.uint32) for _ in range(3)]
    out = []
    for i in range(requests):
        q = rng.integers(0, 128_000, int(rng.integers(40, 300)), dtype=np.uint32)
        out.append(np.concatenate([system, docs[i % len(docs)], q]))
    return out


def progress(done: int, total: int, hit: int, seen: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {hit}/{seen} tokens restored")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class Engine:
    """The connector's calls, in vLLM's order, against two kvshim handles."""

    def __init__(self, sched: native.Handle, worker: native.Handle, timeout_s: float) -> None:
        self.sched, self.worker, self.lib = sched, worker, native.library()
        self.timeout_s = timeout_s
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.error_blocks: set[int] = set()

    def match(self, req: str, tokens: np.ndarray) -> tuple[int, float]:
        """get_num_new_matched_tokens until the lookup is final; returns the
        tokens to load and the lookup's latency in µs."""
        out = ctypes.c_int64()
        t0 = time.perf_counter()
        while True:
            self.sched.check(self.lib.kvshim_sched_match(
                self.sched.value, req.encode(), tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), len(tokens),
                None, 0, ctypes.byref(out)))
            if out.value >= 0:
                return out.value, (time.perf_counter() - t0) * 1e6
            time.sleep(20e-6)  # vLLM would ask again next step

    def step(self, requests: list[dict], saves: bool) -> None:
        """build_connector_meta, then the worker's bind, start_load_kv and wait_for_save."""
        meta = self.sched.output("kvshim_sched_build_meta", json.dumps({"requests": requests}).encode())
        buf = ctypes.create_string_buffer(meta, len(meta))
        self.worker.check(self.lib.kvshim_worker_bind(self.worker.value, buf, len(meta), int(self.timeout_s * 1000)))
        self.worker.check(self.lib.kvshim_worker_start_loads(self.worker.value))
        if saves:
            self.worker.check(self.lib.kvshim_worker_start_saves(self.worker.value, 0))

    def poll(self) -> None:
        """get_finished + get_block_ids_with_load_errors."""
        p = json.loads(self.worker.output("kvshim_worker_poll"))
        self.sending.update(p["sending"] or ())
        self.recving.update(p["recving"] or ())
        self.error_blocks.update(p["error_blocks"] or ())

    def wait(self, req: str, done: set[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while req not in done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {req}: copies not done after {self.timeout_s}s")
            self.step([], saves=False)  # vLLM keeps stepping; finished lists travel with the metadata
            self.poll()
            time.sleep(50e-6)
        done.discard(req)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvshim demo", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--l1-size-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    prompts = workload(args.requests, rng)
    max_blocks = max(len(p) for p in prompts) // BLOCK_TOKENS + 1
    cache = PagedCache(2 * max_blocks)
    namespace = {"model": "meta-llama/Meta-Llama-3-8B@demo", "dtype": "bfloat16", "layout": "paged LBNHC 32x(B,8,16,256)",
                 "world_size": 1, "tp_size": 1, "chunk_size": args.chunk_tokens, "kv_group": 0, "mla": False}
    engine_id = f"demo-{uuid.uuid4().hex[:12]}"
    common = {"server": "embedded", "engine_id": engine_id, "namespace": namespace, "timeout_ms": 10_000}
    sched_cfg = {**common, "role": "scheduler", "block_size": BLOCK_TOKENS, "l1_size_gb": args.l1_size_gb}

    hit_tokens = restored_bytes = seen = 0
    restore_s = 0.0
    lookup_us: list[float] = []
    verified = True
    with native.Handle(json.dumps(sched_cfg)) as sched, native.Handle(json.dumps({**common, "role": "worker", "rank": 0})) as worker:
        worker.check(native.library().kvshim_worker_register(worker.value, cache.describe().encode()))
        eng = Engine(sched, worker, timeout_s=10.0)
        for n, tokens in enumerate(prompts):
            req = f"req-{n}"
            load, us = eng.match(req, tokens)
            lookup_us.append(us)
            blocks = cache.allocate(-(-len(tokens) // BLOCK_TOKENS))
            ids = blocks.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
            sched.check(native.library().kvshim_sched_after_alloc(sched.value, req.encode(), ids, len(blocks), -1, load))
            if load:
                t0 = time.perf_counter()
                eng.step([], saves=False)
                eng.wait(req, eng.recving)
                restore_s += time.perf_counter() - t0
                loaded_blocks = -(-load // BLOCK_TOKENS)
                bad = eng.error_blocks & set(int(b) for b in blocks)
                if bad:
                    verified = False
                    print(f"{req}: load errors in blocks {sorted(bad)}", file=sys.stderr)
                for b in range(loaded_blocks):
                    if cache.read(int(blocks[b])) != expected_block(tokens, b).tobytes():
                        verified = False
                        print(f"{req}: block {b} restored wrong bytes", file=sys.stderr)
                hit_tokens += load
                restored_bytes += loaded_blocks * BLOCK_BYTES
            # "Prefill" the rest, then save its new full chunks after the step.
            first = load // BLOCK_TOKENS
            for b in range(first, len(tokens) // BLOCK_TOKENS):
                cache.write(int(blocks[b]), expected_block(tokens, b))
            eng.step([{"req": req, "blocks": blocks.tolist(), "computed": load, "scheduled": len(tokens) - load}], saves=True)
            delay = ctypes.c_int()
            sched.check(native.library().kvshim_sched_finished(sched.value, req.encode(), ctypes.byref(delay)))
            if delay.value:
                eng.wait(req, eng.sending)  # the blocks are freed only after the saves read them
            cache.release(blocks)
            seen += len(tokens)
            progress(n + 1, len(prompts), hit_tokens, seen)
        stats = json.loads(sched.output("kvshim_stats"))
        wstats = json.loads(worker.output("kvshim_stats"))["worker"]

    total_tokens = sum(len(p) for p in prompts)
    server = stats.get("server", {})
    result = {
        "requests": len(prompts),
        "prompt_tokens": total_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": round(hit_tokens / total_tokens, 4),
        "bytes_restored": restored_bytes,
        "verified_ok": verified,
        "restore_gbps": round(restored_bytes / restore_s / 1e9, 3) if restore_s else 0.0,
        "lookup_p50_us": round(float(np.median(lookup_us)), 2),
        "lookup_p99_us": round(float(np.percentile(lookup_us, 99)), 2),
        "saved_chunks": wstats["SavedChunks"],
        "l1_used_bytes": server.get("kvshim_l1_used_bytes"),
        "path": "embedded server, shared-memory rings, memfd L1, host copy engine",
    }
    print(f"{len(prompts)} requests, {hit_tokens}/{total_tokens} prompt tokens restored ({result['hit_rate']:.0%}), "
          f"{restored_bytes / 2**30:.2f} GiB at {result['restore_gbps']} GB/s, lookup p50 {result['lookup_p50_us']} µs, "
          f"verified: {verified}")
    print(json.dumps(result))
    return 0 if verified else 1
