"""The connector's Python hot path.

Token ids reach Go as one contiguous uint32 buffer (native.token_ids): a
Python list (what vLLM's Request holds) is read by the library's C loop
(array('I') where it cannot), a uint32 array is used as it is, any other
array or tensor is converted, and an id that is no uint32 is a clear error,
never a silent wrap (np.asarray(int64 array, dtype=uint32) wraps -1 to
4294967295). In the connector such a request is a miss, not an exception out
of vLLM's scheduler.

The step metadata is binary, chunk hashes as raw bytes; kvshim.native.meta_json
(tests and debugging) reads it as its JSON text form with Go's decoder (kvshim_meta_json), checked here against
Go's golden file and against the real scheduler's metadata.
"""

from __future__ import annotations

import array
import ctypes
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    prompt,
    store,
)
from kvshim.native import _c_array, token_ids

ROOT = Path(__file__).resolve().parents[2]


def u32(tokens):
    """native.token_ids as a numpy array, to check its dtype and memory."""
    out = token_ids(tokens)
    return out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.uint32)  # type: ignore[call-overload]


def test_list_is_packed_as_uint32():
    toks = [0, 1, 2**32 - 1, 151_935, 7]
    for src in (toks, tuple(toks), range(5)):
        a = u32(src)
        assert a.dtype == np.uint32 and a.flags.c_contiguous
        assert a.tolist() == list(src)
    assert u32([]).size == 0


def test_list_is_read_by_the_library():
    """A list takes the library's C loop (native.tokens_from_list), which
    agrees with array('I') on every id and refuses what it refuses, leaving
    no Python exception set; a list subclass, bools and ints at the edges of
    one and two CPython digits take it too."""
    from kvshim import native

    class Sub(list[int]):
        pass

    class Int(int):
        pass

    # The loop reads an exact int's digits in place (a layout the library
    # checks against ints this interpreter makes); bools and subclasses of
    # int go through the C API.
    ids = [0, 1, True, 2**30 - 1, 2**30, 2**31 + 7, 2**32 - 1, 151_935, Int(2**30 + 3)]
    spread = np.random.default_rng(5).integers(0, 2**32, 100_000, dtype=np.uint64).tolist()
    for src in (ids, Sub(ids), list(range(70_000)), spread):
        out = np.empty(len(src), dtype=np.uint32)
        assert native.tokens_from_list(src, out.ctypes.data, out.size)
        assert out.tolist() == list(array.array("I", src))
        assert u32(src).tolist() == out.tolist()
    out = np.zeros(4, dtype=np.uint32)
    for bad in ([1, -1], [1, -(2**30)], [1, 2**32], [1, 2**32 + 2**31], [1, 2**64], [1, 1.5], [1, "2"], [1, np.int64(2)], [1, 2, 3, 4, 5]):
        assert not native.tokens_from_list(bad, out.ctypes.data, out.size)
    assert out[2:].tolist() == [0, 0]  # a list longer than the buffer: nothing written past it
    assert not native.tokens_from_list((1, 2), out.ctypes.data, out.size)  # type: ignore[arg-type]  # no list
    assert native.tokens_from_list([], out.ctypes.data, 0)
    assert u32([1, np.int64(2)]).tolist() == [1, 2]  # array('I') takes what the C loop leaves


def test_uint32_buffers_are_not_copied():
    a = np.arange(10, dtype=np.uint32)
    assert token_ids(a) is a
    ar = array.array("I", range(10))
    assert token_ids(ar) is ar
    assert token_ids(a[::2]) is not a and u32(a[::2]).tolist() == [0, 2, 4, 6, 8]  # strided: copied


@pytest.mark.parametrize(
    "src",
    [
        np.array([5, 0, 2**32 - 1], dtype=np.int64),
        np.array([5, 0, 2**32 - 1], dtype=np.uint64),
        np.array([5, 0, 7], dtype=np.int32),
        np.array([5, 0, 7], dtype=np.uint16),
        np.array([5, 0, 7], dtype=">u4"),
        array.array("q", [5, 0, 2**32 - 1]),
        torch.tensor([5, 0, 7], dtype=torch.int64),
        torch.tensor([5, 0, 7], dtype=torch.int32),
    ],
    ids=lambda s: f"{type(s).__name__}-{getattr(s, 'dtype', getattr(s, 'typecode', ''))}",
)
def test_integer_arrays_in_range_convert(src):
    a = u32(src)
    assert a.dtype == np.uint32 and a.flags.c_contiguous
    assert a.tolist() == [int(x) for x in src]


@pytest.mark.parametrize(
    ("src", "bad", "pos"),
    [
        ([3, -1, 4], -1, 1),
        ([3, 4, 2**32], 2**32, 2),
        ([2**64], 2**64, 0),
        (np.array([3, 4, -7], dtype=np.int64), -7, 2),  # np.asarray(..., dtype=uint32) wraps this silently
        (np.array([2**32 + 5], dtype=np.int64), 2**32 + 5, 0),
        (np.array([1, 2**40], dtype=np.uint64), 2**40, 1),
        (np.array([-2], dtype=np.int32), -2, 0),
        (array.array("q", [1, -1]), -1, 1),
        (torch.tensor([9, -3]), -3, 1),
    ],
    ids=["list-neg", "list-2^32", "list-2^64", "i64-neg", "i64-big", "u64-big", "i32-neg", "array-q-neg", "torch-neg"],
)
def test_out_of_range_id_is_a_clear_error(src, bad, pos):
    with pytest.raises(ValueError, match=rf"token id {bad} at position {pos} is outside \[0, 2\*\*32\)"):
        u32(src)


def test_non_integers_are_refused():
    with pytest.raises(TypeError, match=r"token id 1\.5 at position 1 is not an integer"):
        u32([1, 1.5])
    with pytest.raises(TypeError, match=r"token id 1\.0 at position 0 is not an integer"):
        u32(np.array([1.0], dtype=np.float32))
    with pytest.raises(TypeError, match="not bytes"):
        u32(b"\x01\x02")
    with pytest.raises(TypeError, match=r"token id \[0, 0\] at position 0 is not an integer"):  # not 1-D
        u32(np.zeros((2, 2), dtype=np.uint32))


def test_block_ids():
    """Block ids go to the library as vLLM's lists: the binding packs them."""
    ptr, n, _owner = _c_array([3, -1, 2**40], "q", ctypes.c_int64)
    assert ptr[:n] == [3, -1, 2**40]
    ptr, n, _owner = _c_array(np.array([1, 2], dtype=np.int32), "q", ctypes.c_int64)
    assert ptr[:n] == [1, 2]
    with pytest.raises(OverflowError):
        _c_array([2**63], "q", ctypes.c_int64)


# ---- in the connector ------------------------------------------------------




def test_the_connector_hands_vllms_list_to_the_library(kv):
    """vLLM's prompt_token_ids (a list) reaches the library as it is
    (native.Scheduler.match_list reads it in C): no array is made on the
    Python side, and the answer is the hit."""
    h, _ = kv()
    p = prompt(6, 2 * CHUNK + 3)
    store(h, h.runners[0], p, max_tokens=1)
    req = h.make_request(p, max_tokens=1)
    assert type(req.prompt_token_ids) is list
    assert h.connector.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    assert h.connector.scheduler._ids[req.request_id] is req.prompt_token_ids
    h.connector.request_finished(req, [])


def test_request_with_an_id_past_uint32_is_a_miss(kv, caplog):
    """Not an exception out of vLLM's scheduler (nor a wrapped id that keys
    another prompt's chunks): vLLM computes the request."""
    h, _ = kv()
    p = prompt(5, 2 * CHUNK + 3)
    store(h, h.runners[0], p, max_tokens=1)
    conn = h.connector
    good = h.make_request(p, max_tokens=1)
    assert conn.get_num_new_matched_tokens(good, 0) == (2 * CHUNK, True)
    conn.request_finished(good, [])
    bad = h.make_request([*p[:5], 2**32 + p[5], *p[6:]], max_tokens=1)  # wrapped, this is p
    with caplog.at_level(logging.WARNING, logger="vllm.kvshim"):
        assert conn.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert f"token id {2**32 + p[5]} at position 5 is outside" in caplog.text
    conn.request_finished(bad, [])
    # One that finished normally with the bad id past its last full chunk
    # (the tokens the save at request_finished reads): no error either.
    tail = h.make_request([*p[:-1], 2**32], max_tokens=1)
    assert conn.get_num_new_matched_tokens(tail, 0) == (0, False)
    tail.status = RequestStatus.FINISHED_STOPPED
    assert conn.request_finished(tail, []) == (False, None)
    assert h.kvshim.scheduler.stats().requests == 0


# ---- the step metadata ------------------------------------------------------


def test_read_meta_matches_go_golden():
    from kvshim.native import meta_json

    g = json.loads((ROOT / "shim" / "testdata" / "meta_v1_golden.json").read_text())
    data = bytes.fromhex(g["binary"])
    assert data[0] == g["version"]
    assert meta_json(data) == g["text"]
    for cut in (1, len(data) // 2, len(data) - 1):
        # Go names what the truncated metadata lacks ("truncated or overlong
        # varint", "2 saves in 3 bytes", ...) and where.
        with pytest.raises(ValueError, match=r"bad step metadata: byte \d+"):
            meta_json(data[:cut])
    with pytest.raises(ValueError, match="1 bytes after"):
        meta_json(data + b"\x00")
    with pytest.raises(ValueError, match="version 123"):
        meta_json(b"{" + data[1:])


def test_metadata_carries_raw_hashes(kv):
    """The scheduler's metadata is the binary form: hashes as 32 raw bytes
    each, no hex and no JSON, and it reads back as what vLLM scheduled."""
    from kvshim.native import meta_json

    h, r = kv()
    p = prompt(8, 3 * CHUNK + 8)
    a, blocks = store(h, r, p, max_tokens=1)
    metas = [s.connector_meta.data for s in h.steps]
    (data,) = [d for d in metas if meta_json(d).get("saves")]
    golden = json.loads((ROOT / "shim" / "testdata" / "meta_v1_golden.json").read_text())
    assert data[0] == golden["version"]
    with pytest.raises(ValueError):
        json.loads(data)
    (sv,) = meta_json(data)["saves"]
    assert sv["req"] == a.request_id and sv["first"] == 0 and len(sv["hashes"]) == 3
    assert sv["blocks"] == blocks[: 3 * CHUNK // 16]
    for hx in sv["hashes"]:
        assert bytes.fromhex(hx) in data and hx.encode() not in data
    # 3 hashes of 32 bytes, 12 one- or two-byte block ids, the request id: no
    # room for 64 hex digits a hash
    assert len(data) < 3 * 32 + 12 * 2 + len(a.request_id) + 16
