"""Preemption and recompute under memory pressure with saves in flight,
through vLLM's real scheduler and a KV cache too small for its requests.

A save reads its blocks after the forward pass, on the worker's own thread;
vLLM may give those blocks to another request as soon as it preempts or
frees their owner. Two contracts keep the save's bytes right:

- preemption: vLLM frees a preempted request's blocks at once (the
  connector is not asked); kvshim lists the request in the step's metadata
  and the worker's bind (handle_preemptions / bind_connector_metadata) waits
  for its copies before the forward pass that may overwrite the blocks.
- finish: request_finished returns True (delay the free) while a save may
  still read the blocks; vLLM frees them when the workers report the
  request in finished_sending.

To hold a save in flight for as long as the test needs, the kvshim server
runs in its own process (harness.ServerProcess) and is stopped with SIGSTOP
after the save is dispatched: the save's ALLOC waits, so its copy has not
read a byte. The server is resumed by an event, never by a timer: in the
preemption test when the worker is blocked in its bind (the wait under
test), or, if the worker did not wait, right after another request's
forward pass wrote into the preempted request's blocks, so a save that
reads them afterwards would store that request's bytes, and the restore
that follows would fail its byte check.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    ModelRunner,
    SchedulerHarness,
    ServerProcess,
    assert_clean,
    kvshim_config,
    make_kv_cache_config,
    prompt,
    saves_of,
    server_stats,
    wait_jobs,
)
from test_multiturn import turn2

TIMEOUT_MS = 5000


def _thread_state(pid: int, tid: str) -> str:
    """A thread's state letter from /proc (R, S, D, T, t, Z, ...); an exited thread counts as stopped."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except FileNotFoundError:
        return "T"
    return stat[stat.rindex(")") + 2]


class Stoppable:
    """SIGSTOP/SIGCONT of the server process, resumed at most once per stop."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.stopped = False
        self.lock = threading.Lock()

    def stop(self) -> None:
        """Returns once every thread of the server is stopped: kill()
        returns before a thread running on another core has taken the
        signal, and in that window (~0.1 ms) the server still answers (it
        did: a save committed "while stopped", a flaky test)."""
        pid = self.srv.proc.pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped = True
        deadline = time.monotonic() + 5
        while not all(_thread_state(pid, t) in ("T", "t") for t in os.listdir(f"/proc/{pid}/task")):
            assert time.monotonic() < deadline, "the server did not stop"
            time.sleep(0.0005)

    def resume(self) -> bool:
        with self.lock:
            if not self.stopped:
                return False
            os.kill(self.srv.proc.pid, signal.SIGCONT)
            self.stopped = False
            return True


# The worker connector's calls in which vLLM's model runner hands it the
# step's metadata before the forward pass (kvshim waits there).
BIND_CALLS = {"handle_preemptions", "bind_connector_metadata"}


class ResumeWhenBlockedInBind(threading.Thread):
    """Resumes the server once the main thread is seen inside the worker
    connector's handle_preemptions / bind_connector_metadata (where the
    native bind waits for the copies of preempted requests) on two polls
    20 ms apart."""

    def __init__(self, srv: Stoppable, timeout_s: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.srv, self.timeout_s = srv, timeout_s
        self.main = threading.main_thread().ident
        self.fired = False
        self.done = threading.Event()

    def in_bind(self) -> bool:
        assert self.main is not None
        f = sys._current_frames().get(self.main)
        while f is not None:
            if f.f_code.co_name in BIND_CALLS and "kvshim" in f.f_code.co_filename:
                return True
            f = f.f_back
        return False

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        seen = 0
        while not self.done.wait(0.02) and time.monotonic() < deadline and self.srv.stopped:
            seen = seen + 1 if self.in_bind() else 0
            if seen >= 2:
                self.fired = self.srv.resume()
                return


class PressureRunner(ModelRunner):
    """ModelRunner that resumes the stopped server right after a forward
    pass wrote into a watched block for another request (the overwrite a
    worker that did not wait for a preempted request's save lets happen
    before that save's copy)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.watch: tuple[str, set[int]] | None = None
        self.srv: Stoppable | None = None
        self.overwritten_while_stopped = False

    def _forward(self, work):
        super()._forward(work)
        if self.watch is None or self.srv is None or not self.srv.stopped:
            return
        owner, blocks = self.watch
        bs = self.block_size
        for rid, start, n in work:
            if rid == owner:
                continue
            r = self.reqs[rid]
            if {r.blocks[p // bs] for p in range(start, start + n)} & blocks:
                self.overwritten_while_stopped = True
                self.srv.resume()


def _prewarmed(runner: Any, timeout: float = 60.0) -> None:
    """A CPU worker dials the server and populates its L1 mapping in the
    background (shim.Worker's prewarm). A test that stops the server before
    that ended stops it mid-dial: the dial times out and the saves the test
    wants in flight fail at once instead (seen under load: FailedSaves 4,
    jobs 0). Wait until the prewarm is over (PopulatePending 0)."""
    deadline = time.monotonic() + timeout
    while runner.kvshim.worker.stats().counters.get("PopulatePending"):
        assert time.monotonic() < deadline, "the worker's prewarm did not end"
        time.sleep(0.01)


@contextmanager
def stoppable_harnesses(model_dir: Any, tmp_path: Any, kv_cache_config: Callable[[Any, int], Any],
                        runner: Callable[[Any, Any], Any]) -> Iterator[Callable[[int], tuple[Any, Any, Stoppable]]]:
    """make(num_blocks) -> (harness, its runner, the server as a Stoppable):
    harnesses on one `kvshim serve` process in tmp_path, with the KV cache
    config kv_cache_config(vllm_config, num_blocks) and runner(vllm_config,
    kv_cache_config). The server is resumed and killed at the end."""
    d = tmp_path / "srv"
    d.mkdir(mode=0o700)
    srv = ServerProcess(d / "kvshim.sock").start()
    made = []

    def make(num_blocks: int) -> tuple[Any, Any, Stoppable]:
        cfg = kvshim_config(model_dir, server=srv.socket, timeout_ms=TIMEOUT_MS, enable_prefix_caching=False,
                            async_scheduling=False)
        kvc = kv_cache_config(cfg, num_blocks)
        h = SchedulerHarness(cfg, kvc)
        h.runners = [runner(cfg, kvc)]
        made.append(h)
        _prewarmed(h.runners[0])
        return h, h.runners[0], Stoppable(srv)

    try:
        yield make
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            os.kill(srv.proc.pid, signal.SIGCONT)
        for h in made:
            h.close()
        srv.kill()


@pytest.fixture
def pressure(tiny_model_dir, tmp_path):
    with stoppable_harnesses(tiny_model_dir, tmp_path, lambda cfg, n: make_kv_cache_config(num_blocks=n),
                             PressureRunner) as make:
        yield make


def step_until(h, pred, what: str, max_steps: int = 50):
    for _ in range(max_steps):
        so = h.scheduler.schedule()
        if pred(so):
            return so
        h.finish(so, h.execute(so))
    raise AssertionError(f"{what}: not within {max_steps} steps")


def preempt_while_saving(h, r, srv: Stoppable, a, b, blocks_of: Callable[[str], set[int]],
                         a_blocks: set[int]) -> ResumeWhenBlockedInBind:
    """The next step preempts A while its saves wait on the stopped server:
    the worker's bind must wait for them (the resumer resumes the server
    once it does), then the step runs on until B decodes into A's former
    blocks (the trap a worker that did not wait falls into: the runner
    resumes the server only after that overwrite). Returns the resumer
    (its .fired says whether the bind waited)."""
    so = h.scheduler.schedule()
    assert a.request_id in so.preempted_req_ids and a.status == RequestStatus.PREEMPTED
    resumer = ResumeWhenBlockedInBind(srv)
    resumer.start()
    try:
        h.finish(so, h.execute(so))
        if resumer.fired:
            # The bind returned once A's saves had read A's blocks; their
            # COMMITs follow. A is looked up again from the next step on:
            # let the commits land first, or that lookup may miss them.
            wait_jobs(h)
        h.settle(until=lambda s: b.request_id in s.num_scheduled_tokens and bool(blocks_of(b.request_id) & a_blocks))
    finally:
        resumer.done.set()
        resumer.join(timeout=15)
        srv.resume()
    return resumer


def test_preempted_while_its_save_is_in_flight(pressure):
    # 12 blocks: the null block, 3 for B (40-token prompt, decoding), 8 for
    # A (128-token prompt = 2 chunks, exactly 8 blocks). When A needs its
    # 9th block vLLM preempts A (the last running request) and frees its 8
    # blocks; B takes A's last block (chunk 1's) when it needs its 4th.
    h, r, srv = pressure(num_blocks=12)
    b = h.add_request(h.make_request(prompt(51, 40), max_tokens=20))
    h.step()  # B's prefill (no full chunk: no lookup, no server call)
    pa = prompt(52, 2 * CHUNK)
    a = h.add_request(h.make_request(pa, max_tokens=3))
    # A's prefill step: its 2 chunks' save is in this step's metadata.
    so = step_until(h, lambda so: a.request_id in so.num_scheduled_tokens, "A's prefill")
    assert so.num_scheduled_tokens[a.request_id] == len(pa)
    assert h.num_free_blocks == 0
    srv.stop()  # the save's ALLOC now waits: its copy reads nothing yet
    h.finish(so, h.execute(so))
    a_blocks = list(r.reqs[a.request_id].blocks)
    assert [(x["first"], len(x["hashes"])) for x in saves_of(h, a.request_id)] == [(0, 2)]
    assert r.kvshim.worker.stats().jobs >= 1 and srv.stopped  # the save is in flight
    r.watch, r.srv = (a.request_id, set(a_blocks)), srv

    # Next step: vLLM preempts A and frees its blocks; the worker's bind
    # must wait for A's save before any forward pass may write into them.
    resumer = preempt_while_saving(h, r, srv, a, b, lambda rid: set(r.reqs[rid].blocks), set(a_blocks))
    # A comes back when B is done: its lookup hits its own saved chunks
    # (loaded byte-exact into new blocks, checked before its forward pass),
    # it recomputes the rest and finishes.
    h.settle()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.num_preemptions == 1
    # a later request restores both saved chunks byte-exact: the save read
    # A's bytes, not B's
    turn2(h, r, pa + prompt(53, 10), hit_chunks=2)
    # (A's resume was looked up over all its tokens, its first generated
    # one included: both chunks load whole, no prompt token is recomputed)
    n, bad = r.prefix_checks.get(a.request_id, (0, None))
    assert n == 2 * CHUNK and bad == [], (n, bad)
    assert r.kvshim.worker.stats().counters["LoadedChunks"] == 2 + 2
    assert all(not e for e in r.load_errors)
    assert resumer.fired, "the worker's bind did not wait for the preempted request's save"
    assert not r.overwritten_while_stopped
    assert_clean(h)


def test_finished_request_keeps_its_blocks_while_its_save_is_in_flight(pressure):
    # 11 blocks: A (128 tokens, 8 blocks) finishes in its prefill step
    # (max_tokens=1) while its save waits on the stopped server; B (60
    # tokens: no full chunk, never a server call) needs 4 blocks, only 2
    # are free until A's blocks come back.
    h, r, srv = pressure(num_blocks=11)
    pa = prompt(54, 2 * CHUNK)
    a = h.add_request(h.make_request(pa, max_tokens=1))
    so = step_until(h, lambda so: a.request_id in so.num_scheduled_tokens, "A's prefill")
    srv.stop()
    res = h.finish(so, h.execute(so))
    a_blocks = set(r.reqs[a.request_id].blocks)
    assert res.finished.get(a.request_id) is not None
    # request_finished said "delay": vLLM keeps A and its blocks
    assert a.request_id in h.scheduler.requests and h.num_free_blocks == 2
    bq = h.add_request(h.make_request(prompt(55, 60), max_tokens=2))
    r.watch, r.srv = (a.request_id, a_blocks), srv
    for _ in range(5):  # the save cannot end while the server is stopped
        s = h.step()
        assert not s.num_scheduled_tokens, s.num_scheduled_tokens
        assert a.request_id not in (s.kv_connector_output.finished_sending or ())
        assert h.num_free_blocks == 2
    assert srv.resume()
    s = step_until(h, lambda so: bq.request_id in so.num_scheduled_tokens, "B scheduled")
    h.finish(s, h.execute(s))
    assert set(r.reqs[bq.request_id].blocks) & a_blocks  # B got A's blocks back
    assert not r.overwritten_while_stopped
    h.settle()
    assert bq.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert any(a.request_id in (s.kv_connector_output.finished_sending or ()) for s in h.steps)
    st = server_stats(h.connector)
    assert st["kvshim_l1_commits_total"] == 2
    turn2(h, r, pa + prompt(56, 10), hit_chunks=2)
    assert_clean(h)


def test_running_request_waits_for_delay_freed_blocks_instead_of_preemption(pressure):
    # 12 blocks: B (40 tokens, decoding) has 3 and needs a 4th at token 48;
    # A (128 tokens, 8 blocks) finishes while its save waits on the stopped
    # server, so its blocks are delay-freed: none is free. kvshim says
    # has_pending_block_frees, so vLLM lets B wait for A's blocks instead of
    # preempting it (and recomputing it).
    h, r, srv = pressure(num_blocks=12)
    b = h.add_request(h.make_request(prompt(57, 40), max_tokens=20))
    h.step()
    pa = prompt(58, 2 * CHUNK)
    a = h.add_request(h.make_request(pa, max_tokens=1))
    so = step_until(h, lambda so: a.request_id in so.num_scheduled_tokens, "A's prefill")
    assert b.num_tokens < 48
    srv.stop()
    h.finish(so, h.execute(so))
    assert a.request_id in h.scheduler.requests and h.num_free_blocks == 0
    assert h.connector.has_pending_block_frees()
    waited = 0
    for _ in range(20):  # B decodes up to token 48, then has to wait
        s = h.step()
        assert not s.scheduler_output.preempted_req_ids
        if b.request_id not in s.num_scheduled_tokens:
            waited += 1
            if waited == 3:
                break
    assert waited == 3 and b.num_computed_tokens == 48 and b.num_preemptions == 0
    assert srv.resume()
    h.settle()
    assert not h.connector.has_pending_block_frees()
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.num_preemptions == 0
    turn2(h, r, pa + prompt(59, 10), hit_chunks=2)
    assert_clean(h)
