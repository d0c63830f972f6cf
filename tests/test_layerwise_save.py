"""Layer-wise saves through the real library (native.Worker.save_layer, ABI
5.4): what the connector's save_kv_layer / wait_for_save call. The delayed
copies of the emulated driver and the failure paths are in Go
(shim/layersave_test.go); this drives the C ABI and the embedded server."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvshim import errors
from rig import CHUNK, Rig, fa_cache


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.002)


def _bind_save_step(rig: Rig, req: str, tokens: npt.NDArray[np.uint32], blocks: list[int]) -> None:
    assert rig.match(req, tokens) == 0
    rig.alloc(req, blocks, 0)
    rig.worker.bind(rig.sched.build_meta({"requests": [
        {"req": req, "blocks": blocks, "computed": 0, "scheduled": len(tokens)}]}), 3000)


def test_layer_saved_as_written_then_restored_bytes_exact() -> None:
    tensors = fa_cache()
    rng = np.random.default_rng(5)
    for t, _ in tensors:
        t[...] = rng.standard_normal(t.shape).astype(np.float16)
    with Rig(f"lws-{uuid.uuid4().hex[:8]}", tensors) as rig:
        tokens = np.arange(11, 11 + 2 * CHUNK + 3, dtype=np.uint32)  # 2 full chunks + a tail
        src, dst = [3, 4, 5, 6, 7], [20, 9, 27, 14, 1]
        _bind_save_step(rig, "a", tokens, src)
        w = rig.worker
        spans = w.stats().counters["CopySpans"]
        w.save_layer("l0")  # layer 0's KV is written: its copy starts now
        _wait(lambda: w.stats().counters["CopySpans"] > spans, "layer 0's copy before layer 1 is written")
        # The forward pass writes layer 1 only now.
        l1 = rig.kv[1]
        l1[:, src] = rng.standard_normal(l1[:, src].shape).astype(np.float16)
        want = [t[:, src[:4]].copy() for t in rig.kv]  # the 2 chunks' blocks
        w.save_layer("l1")
        w.start_saves()  # wait_for_save: ends the step
        assert rig.finished("a")
        rig.drain("a", "sending")
        _wait(lambda: rig.accounted_saves() >= 2, "saves accounted for")
        c = w.stats().counters
        assert (c["SavedChunks"], c["FailedSaves"], c["LayerwiseSaves"]) == (2, 0, 1)

        n, errs = rig.restore("b", tokens, dst)
        assert (n, errs) == (2 * CHUNK, [])
        for t, wnt in zip(rig.kv, want):
            assert np.array_equal(t[:, dst[:4]], wnt)


def test_step_never_ended_commits_nothing() -> None:
    tensors = fa_cache()
    for i, (t, _) in enumerate(tensors):
        t[...] = i + 1
    with Rig(f"lws-{uuid.uuid4().hex[:8]}", tensors) as rig:
        tokens = np.arange(40, 40 + 2 * CHUNK, dtype=np.uint32)
        _bind_save_step(rig, "a", tokens, [1, 2, 3, 4])
        rig.worker.save_layer("l0")
        rig.worker.save_layer("not a layer")  # a name not registered: saved at the step's end
        # The next step starts its own layer-wise saves with no wait_for_save
        # between: the first step's chunks (layer 1 never marked) abort.
        rig.worker.bind(rig.sched.build_meta({"requests": [
            {"req": "a", "blocks": [1, 2, 3, 4], "computed": 0, "scheduled": len(tokens)}]}), 3000)
        rig.worker.save_layer("l0")
        rig.worker.close()  # abandons the second step too
        assert rig.finished("a")
        assert rig.match("b", tokens) == 0, "a chunk committed with a layer never marked"


def test_save_layer_needs_a_bound_step() -> None:
    with Rig(f"lws-{uuid.uuid4().hex[:8]}", fa_cache()) as rig:
        try:
            rig.worker.save_layer("l0")
        except errors.InvalidArgumentError:
            pass
        else:
            raise AssertionError("save_layer without a bound step succeeded")
