"""The walking skeleton end to end: Python paged cache -> ctypes -> export ->
shim -> store -> copies, restored into different block ids.

It proves the wiring only; the connector tests cover the full design."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from kvshim import errors, native

BLOCK_TOKENS, CHUNK_TOKENS = 16, 64
LAYERS, HEADS, HEAD = 4, 2, 32
BLOCK_BYTES = LAYERS * 2 * BLOCK_TOKENS * HEADS * HEAD * 2  # bf16


def ptr(a: np.ndarray, t: type):
    return a.ctypes.data_as(ctypes.POINTER(t))


@pytest.fixture
def store():
    cfg = {"role": "skeleton", "block_bytes": BLOCK_BYTES, "block_tokens": BLOCK_TOKENS, "chunk_tokens": CHUNK_TOKENS}
    with native.Handle(json.dumps(cfg)) as h:
        yield h


def test_save_lookup_restore_into_other_blocks(store):
    lib = native.library()
    rng = np.random.default_rng(0)
    blocks = 64
    cache = rng.integers(0, 2**16, (blocks, LAYERS, 2, BLOCK_TOKENS, HEADS, HEAD), dtype=np.uint16)
    tokens = rng.integers(0, 50_000, 200, dtype=np.uint32)  # 3 full chunks + a partial one
    src = np.arange(3, 16, dtype=np.int64)
    dst = np.arange(40, 53, dtype=np.int64)
    saved = ctypes.c_uint64()
    store.check(lib.kvshim_skeleton_save(store.value, cache.ctypes.data, cache.nbytes, ptr(src, ctypes.c_int64), len(src),
                                         ptr(tokens, ctypes.c_uint32), len(tokens), ctypes.byref(saved)))
    assert saved.value == 3

    chunks = ctypes.c_uint64()
    store.check(lib.kvshim_skeleton_lookup(store.value, ptr(tokens, ctypes.c_uint32), len(tokens), ctypes.byref(chunks)))
    assert chunks.value == 3
    other = tokens.copy()
    other[100] += 1  # inside chunk 1: chunk 0 still matches, the rest must not
    store.check(lib.kvshim_skeleton_lookup(store.value, ptr(other, ctypes.c_uint32), len(other), ctypes.byref(chunks)))
    assert chunks.value == 1

    before = cache.copy()
    store.check(lib.kvshim_skeleton_load(store.value, cache.ctypes.data, cache.nbytes, ptr(dst, ctypes.c_int64), len(dst),
                                         ptr(tokens, ctypes.c_uint32), len(tokens), 3))
    n = 3 * CHUNK_TOKENS // BLOCK_TOKENS
    np.testing.assert_array_equal(cache[dst[:n]], before[src[:n]])
    untouched = np.setdiff1d(np.arange(blocks), dst[:n])
    np.testing.assert_array_equal(cache[untouched], before[untouched])


def test_bad_block_id_writes_nothing(store):
    lib = native.library()
    cache = np.zeros((8, BLOCK_BYTES), dtype=np.uint8)
    cache[0] = 7
    tokens = np.arange(CHUNK_TOKENS, dtype=np.uint32)
    ids = np.arange(4, dtype=np.int64)
    saved = ctypes.c_uint64()
    store.check(lib.kvshim_skeleton_save(store.value, cache.ctypes.data, cache.nbytes, ptr(ids, ctypes.c_int64), 4,
                                         ptr(tokens, ctypes.c_uint32), len(tokens), ctypes.byref(saved)))
    bad = np.array([4, 5, 6, 8], dtype=np.int64)  # 8 is out of range
    snapshot = cache.copy()
    with pytest.raises(errors.InvalidArgumentError, match="block id 8 outside"):
        store.check(lib.kvshim_skeleton_load(store.value, cache.ctypes.data, cache.nbytes, ptr(bad, ctypes.c_int64), 4,
                                             ptr(tokens, ctypes.c_uint32), len(tokens), 1))
    np.testing.assert_array_equal(cache, snapshot)
