"""The typed binding (native.Scheduler, native.Worker): how Python values
become the C ABI's arrays, and the role objects' lifetime."""

from __future__ import annotations

import array
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvshim import native
from kvshim.errors import InvalidArgumentError, NotSupportedError
from rig import BLOCK, CHUNK, HEAD, HEADS, LAYERS, Rig, fa_cache


def _read(ptr: Any, n: int, ctype: type[ctypes.c_uint32]) -> list[int]:
    return list(ctypes.cast(ptr, ctypes.POINTER(ctype))[:n])


@pytest.mark.parametrize("typecode, ctype, dtype", [("I", ctypes.c_uint32, np.uint32), ("q", ctypes.c_int64, np.int64)])
def test_arrays_of_the_c_type_pass_without_a_copy(typecode, ctype, dtype):
    a = array.array(typecode, [1, 2, 3])
    ptr, n, owner = native._c_array(a, typecode, ctype)
    assert owner is a and n == 3 and ctypes.cast(ptr, ctypes.c_void_p).value == a.buffer_info()[0]
    x = np.arange(5, dtype=dtype)
    ptr, n, owner = native._c_array(x, typecode, ctype)
    assert owner is x and n == 5 and ctypes.cast(ptr, ctypes.c_void_p).value == x.ctypes.data


@pytest.mark.parametrize("values", [[7, 8, 9], (7, 8, 9), np.array([7, 8, 9], dtype=np.int64), np.arange(14)[7:13:2] - np.array([0, 1, 2]),
                                    array.array("q", [7, 8, 9]), range(7, 10)])
def test_other_integer_sequences_are_packed(values):
    ptr, n, owner = native._c_array(values, "I", ctypes.c_uint32)
    assert n == 3 and isinstance(owner, array.array)
    assert _read(ptr, n, ctypes.c_uint32) == [7, 8, 9]


def test_a_value_the_c_type_cannot_hold_is_an_error_not_a_wrap():
    # Token ids (uint32) through native.token_ids: the error names the id.
    with pytest.raises(ValueError, match=r"token id -1 at position 1 is outside"):
        native._c_array([1, -1], "I", ctypes.c_uint32)
    with pytest.raises(ValueError, match=r"token id 4294967296 at position 0"):
        native._c_array([2**32], "I", ctypes.c_uint32)
    with pytest.raises(OverflowError):
        native._c_array([2**63], "q", ctypes.c_int64)
    with pytest.raises(TypeError):
        native._c_array([1.5], "q", ctypes.c_int64)  # type: ignore[list-item]  # the point


def test_roles_close_their_handles():
    lib = native.library()
    before = lib.kvshim_handle_count()
    rig = Rig(f"bind-{uuid.uuid4().hex[:8]}", fa_cache())
    assert lib.kvshim_handle_count() == before + 2
    rig.close()
    assert lib.kvshim_handle_count() == before


def test_a_round_trip_through_the_role_objects_with_python_values():
    """Lists in (tokens, blocks), ints, bools, bytes and dataclasses out."""
    with Rig(f"bind-{uuid.uuid4().hex[:8]}", fa_cache()) as rig:
        tokens = list(range(100, 100 + 2 * CHUNK))
        blocks = list(range(2 * CHUNK // BLOCK))
        assert rig.sched.match("a", tokens) in (None, 0)
        assert rig.match("a", np.array(tokens, dtype=np.uint32)) == 0
        rig.sched.after_alloc("a", blocks, 0)
        meta = rig.sched.build_meta({"requests": [{"req": "a", "blocks": blocks, "computed": 0, "scheduled": len(tokens)}]})
        assert isinstance(meta, bytes) and meta
        rig.worker.bind(meta, 3000)
        rig.worker.start_loads()
        rig.worker.start_saves()
        assert rig.sched.finished("a") is True
        done = rig.drain("a", "sending")
        assert isinstance(done, native.Finished) and done.error_blocks == []
        st = rig.sched.stats()
        assert st.requests == 0 and st.server is not None and st.server_error is None
        ws = rig.worker.stats()
        assert set(ws.counters) >= {"SavedChunks", "LoadedChunks"} and ws.jobs >= 0


def test_engine_copy_takes_a_direction():
    with Rig(f"bind-{uuid.uuid4().hex[:8]}", fa_cache()) as rig:
        payload = CHUNK // BLOCK * LAYERS * 2 * BLOCK * HEADS * HEAD * 2  # a chunk's blocks, K and V, fp16
        obj_size = payload + 4096  # and room for the object header
        objects = np.zeros(2 * obj_size, dtype=np.uint8)
        ids = list(range(2 * CHUNK // BLOCK))
        s = rig.worker.engine_copy(native.Direction.SAVE, objects.ctypes.data, obj_size, ids, 3000)
        assert s >= 0
        with pytest.raises(InvalidArgumentError):
            rig.worker.engine_copy(native.Direction.LOAD, objects.ctypes.data, obj_size, [1], 3000)


def test_threads_sharing_a_handle_read_their_own_output():
    """Output calls from several threads on one handle: each thread has its
    own buffer (and the library keeps output that did not fit for the thread
    that asked), so no thread reads bytes another call wrote. The worker's
    stats and its poll answer differ in shape: a mix-up shows as a decode
    error or the other answer's fields."""
    import threading

    with Rig(f"bind-{uuid.uuid4().hex[:8]}", fa_cache()) as rig:
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def hammer(stats: Any, want: str) -> None:
            try:
                start.wait(timeout=10)
                for _ in range(300):
                    got = stats()
                    assert hasattr(got, want), got
            except BaseException as e:  # collected and re-raised in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=hammer, args=(rig.worker.stats, "counters")) for _ in range(2)]
        threads += [threading.Thread(target=hammer, args=(rig.worker.poll, "sending")) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert errors == []


class _Int(int):
    """An int that is not exactly an int."""


def test_match_list_reads_the_list_only_to_key_the_request():
    """native.Scheduler.match_list (the connector's path for vLLM's lists)
    answers as match does over the same ids; asked again for a request it
    has keyed, it reads nothing (an unreadable list answers the same); a
    list it cannot read is refused before anything is asked."""
    with Rig(f"list-{uuid.uuid4().hex[:8]}", fa_cache()) as rig:
        tokens = list(range(500, 500 + 3 * CHUNK + 5))
        rig.save("seed", np.array(tokens, dtype=np.uint32), list(range(len(tokens) // BLOCK)))
        assert rig.match("array", np.array(tokens, dtype=np.uint32)) == 3 * CHUNK
        n = None
        for _ in range(2000):
            if (n := rig.sched.match_list("list", tokens)) is not None:
                break
        assert n == 3 * CHUNK
        assert rig.sched.match_list("list", [2**40]) == 3 * CHUNK  # keyed: not read
        assert rig.sched.match_list("other", tokens[:CHUNK] + [9] * (2 * CHUNK)) == CHUNK
        # An int the reader does not read in place (a subclass) in the
        # second chunk: read through the C API, keyed the same.
        mixed = tokens[:CHUNK] + [_Int(tokens[CHUNK])] + tokens[CHUNK + 1:]
        assert rig.sched.match_list("mixed", mixed) == 3 * CHUNK
        for req in ("array", "list", "other", "mixed"):
            rig.finished(req)
        with pytest.raises(InvalidArgumentError, match="item 1 is no int in"):
            rig.sched.match_list("list", [1, 2**40])  # forgotten once finished: read again
        with pytest.raises(NotSupportedError):
            rig.sched.match_list("tuple", tuple(tokens))  # type: ignore[arg-type]
        assert rig.stats().requests == 0


def test_match_list_keys_a_first_request_under_the_generation_in_force():
    """A scheduler that starts after its deployment was reset knows the
    generation only once it asks the server, which its first lookup does
    after the list was read (and, where the library hashes as it reads,
    hashed under generation 0): those keys are refused as stale and the
    list read again, so the first request hits what was stored after the
    reset."""
    engine = f"gen-{uuid.uuid4().hex[:8]}"
    with Rig(engine, fa_cache()) as rig:
        assert rig.sched.reset() >= 1
        tokens = list(range(700, 700 + 3 * CHUNK + 5))
        rig.save("seed", np.array(tokens, dtype=np.uint32), list(range(len(tokens) // BLOCK)))
        ns = {"model": "t", "dtype": "float16", "layout": "x", "world_size": 1, "chunk_size": CHUNK, "mla": False}
        later = native.Scheduler({"server": "embedded", "engine_id": engine, "namespace": ns, "timeout_ms": 3000,
                                  "block_size": BLOCK, "l1_size_gb": 0.0625})
        try:
            n = None
            for _ in range(2000):
                if (n := later.match_list("first", tokens)) is not None:
                    break
                time.sleep(0.002)
            assert n == 3 * CHUNK
            later.finished("first")
        finally:
            later.close()


def _stopped(pid: int) -> bool:
    """Every thread of pid in state T (kill(SIGSTOP) returns before a thread
    running on another core has stopped)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        states.append(stat[stat.rindex(")") + 2])
    return all(s in "Tt" for s in states)


def test_match_list_lets_other_threads_run_while_the_server_answers(tmp_path):
    """match_list is called with the GIL held (it reads the list); it must
    let go of it while the lookup waits for the server, or every Python
    thread of vLLM's engine stalls on each lookup. The server is stopped, so
    the lookup waits its whole timeout (then answers a miss); meanwhile
    this thread runs Python."""
    sock = str(tmp_path / "kvshim.sock")
    log = tmp_path / "serve.log"
    with open(log, "w") as logf:
        srv = subprocess.Popen([sys.executable, "-m", "kvshim", "serve", "--socket", sock, "--l1-size-gb", "0.0625"],
                               stdout=logf, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in log.read_text():
            assert srv.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        ns = {"model": "t", "dtype": "float16", "layout": "x", "world_size": 1, "chunk_size": CHUNK, "mla": False}
        with native.Scheduler({"server": sock, "engine_id": "gil", "namespace": ns, "timeout_ms": 1500,
                               "block_size": BLOCK}) as sched:
            assert sched.match_list("warm", list(range(2 * CHUNK))) == 0  # connected, nothing stored
            os.kill(srv.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 5
            while not _stopped(srv.pid):
                assert time.monotonic() < deadline, "the server did not stop"
                time.sleep(0.0005)
            answers: list[int | None] = []
            t = threading.Thread(target=lambda: answers.append(sched.match_list("a", list(range(2 * CHUNK)))))
            t.start()
            time.sleep(0.2)  # t is inside the call by now, waiting for the server
            spun, end = 0, time.monotonic() + 0.3
            while time.monotonic() < end:
                spun += 1
            assert t.is_alive(), "this thread ran only after match_list returned: the GIL was held"
            os.kill(srv.pid, signal.SIGCONT)
            t.join(10)
            assert answers == [0] and spun > 0  # resumed in time: it answers (nothing stored, a miss)
    finally:
        srv.kill()
        srv.wait(10)
