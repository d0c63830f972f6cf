"""`kvshim demo`: store and restore a Llama-3-8B-shaped paged KV cache.

A stream of requests that share prefixes runs against a paged KV cache in
CPU memory. For each request the demo asks kvshim how many leading chunks it
holds, restores those chunks into freshly allocated blocks (never the blocks
they were saved from), checks every restored byte against what the "model"
would have computed, computes the rest, and saves the new full chunks.

The "model" fills a token's KV with bytes derived from the hash of the whole
prefix up to that block, so a restored block is right only if the exact
prefix's bytes came back.

Today the demo runs the walking skeleton (an in-process store behind the C
ABI); the connector issue moves it onto the embedded server and the vLLM
connector path.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import time

import numpy as np

from kvshim import native

# Llama-3-8B: 32 layers, 8 KV heads, head size 128, bf16; vLLM block 16.
LAYERS, KV_HEADS, HEAD_SIZE, DTYPE_BYTES, BLOCK_TOKENS = 32, 8, 128, 2, 16
BLOCK_BYTES = LAYERS * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_SIZE * DTYPE_BYTES  # 2 MiB


def _ptr(a: np.ndarray, ctype: type) -> ctypes._Pointer:
    return a.ctypes.data_as(ctypes.POINTER(ctype))


class PagedCache:
    """A cross-layer paged KV cache: (blocks, layers, 2, block, heads, head) bf16."""

    def __init__(self, num_blocks: int) -> None:
        self.data = np.zeros(num_blocks * BLOCK_BYTES, dtype=np.uint8)
        self.free = list(np.random.default_rng(7).permutation(num_blocks))

    def allocate(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise MemoryError(f"demo cache has {len(self.free)} free blocks, request needs {n}")
        ids, self.free = self.free[:n], self.free[n:]
        return np.array(ids, dtype=np.int64)

    def release(self, ids: np.ndarray) -> None:
        self.free.extend(int(i) for i in ids)

    def block(self, i: int) -> np.ndarray:
        return self.data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]


def expected_block(tokens: np.ndarray, block: int) -> np.ndarray:
    """The bytes the 'model' computes for block `block` of this prompt."""
    digest = hashlib.sha256(tokens[: (block + 1) * BLOCK_TOKENS].tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def workload(requests: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Prompts sharing a system prompt, then one of a few documents, then a question."""
    system = rng.integers(0, 128_000, 1024, dtype=np.uint32)
    docs = [rng.integers(0, 128_000, 2048, dtype=np.uint32) for _ in range(3)]
    out = []
    for i in range(requests):
        q = rng.integers(0, 128_000, int(rng.integers(40, 300)), dtype=np.uint32)
        out.append(np.concatenate([system, docs[i % len(docs)], q]))
    return out


def progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvshim demo", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    prompts = workload(args.requests, rng)
    max_blocks = max(len(p) for p in prompts) // BLOCK_TOKENS + 1
    cache = PagedCache(2 * max_blocks)
    lib = native.library()
    cfg = json.dumps({"role": "skeleton", "block_bytes": BLOCK_BYTES, "block_tokens": BLOCK_TOKENS, "chunk_tokens": args.chunk_tokens})

    hit_tokens = restored_bytes = 0
    restore_s = 0.0
    lookup_us: list[float] = []
    verified = True
    with native.Handle(cfg) as h:
        for n, tokens in enumerate(prompts):
            n_tok = ctypes.c_size_t(len(tokens))
            chunks = ctypes.c_uint64(0)
            t0 = time.perf_counter()
            h.check(lib.kvshim_skeleton_lookup(h.value, _ptr(tokens, ctypes.c_uint32), n_tok, ctypes.byref(chunks)))
            lookup_us.append((time.perf_counter() - t0) * 1e6)

            blocks = cache.allocate(-(-len(tokens) // BLOCK_TOKENS))
            hit_blocks = chunks.value * args.chunk_tokens // BLOCK_TOKENS
            if chunks.value:
                t0 = time.perf_counter()
                h.check(lib.kvshim_skeleton_load(h.value, cache.data.ctypes.data, cache.data.nbytes, _ptr(blocks, ctypes.c_int64),
                                                 len(blocks), _ptr(tokens, ctypes.c_uint32), n_tok, chunks.value))
                restore_s += time.perf_counter() - t0
                hit_tokens += chunks.value * args.chunk_tokens
                restored_bytes += hit_blocks * BLOCK_BYTES
                for b in range(hit_blocks):
                    if not np.array_equal(cache.block(int(blocks[b])), expected_block(tokens, b)):
                        verified = False
                        print(f"request {n}: block {b} restored wrong bytes", file=sys.stderr)
            # "Prefill" the rest, then save the new full chunks.
            for b in range(hit_blocks, len(tokens) // BLOCK_TOKENS):
                cache.block(int(blocks[b]))[:] = expected_block(tokens, b)
            saved = ctypes.c_uint64(0)
            h.check(lib.kvshim_skeleton_save(h.value, cache.data.ctypes.data, cache.data.nbytes, _ptr(blocks, ctypes.c_int64),
                                             len(blocks), _ptr(tokens, ctypes.c_uint32), n_tok, ctypes.byref(saved)))
            cache.release(blocks)
            progress(n + 1, len(prompts))

    total_tokens = sum(len(p) for p in prompts)
    result = {
        "requests": len(prompts),
        "prompt_tokens": total_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": round(hit_tokens / total_tokens, 4),
        "bytes_restored": restored_bytes,
        "verified_ok": verified,
        "restore_gbps": round(restored_bytes / restore_s / 1e9, 3) if restore_s else 0.0,
        "lookup_p50_us": round(float(np.median(lookup_us)), 2),
        "path": "walking skeleton (in-process store)",
    }
    print(f"{len(prompts)} requests, {hit_tokens}/{total_tokens} prompt tokens restored "
          f"({result['hit_rate']:.0%}), {restored_bytes / 2**30:.2f} GiB at {result['restore_gbps']} GB/s, "
          f"verified: {verified}")
    print(json.dumps(result))
    return 0 if verified else 1
