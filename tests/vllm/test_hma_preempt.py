"""Hybrid models (vLLM's hybrid KV-cache manager, HMA) under memory pressure
with saves in flight, and a load that fails, through vLLM's real scheduler
(one manager per KV-cache group) and a KV cache too small for its requests.

A save reads its blocks after the forward pass, on the worker's own
thread. Besides the two contracts test_preempt.py checks for one group
(preemption: the workers wait for a preempted request's copies before the
forward pass; finish: vLLM keeps a finished request's blocks until its
saves end), a hybrid model has a third way to lose blocks a save still
reads: a sliding-window group frees the blocks its window moved past while
the request runs (vLLM tells the connector nothing: tests/vllm/NOTES.md,
"Hybrid models"), and the very next step may hand them to another request
or to the same one. kvshim fences them (shim/scheduler.go fence): a step
that hands out such a block lists the saving request as preempted, so the
workers wait for its copies before the forward pass.

As in test_preempt.py, the kvshim server runs in its own process and is
stopped (SIGSTOP) once the saves are dispatched, so their copies have read
nothing; it is resumed by an event, never a timer: when the worker is seen
blocked in its bind (the wait under test) or, if the worker did not wait,
right after a forward pass wrote into a block the stopped saves still have
to read, whose object the restores that follow then fail to match.

The model: a sliding-window layer (40 tokens, smaller than a 64-token
chunk) and a global one: vLLM makes two KV-cache groups of one layer each,
whose blocks come from one pool and view one buffer.
"""

from __future__ import annotations

import pytest
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    HybridModelRunner,
    assert_clean,
    hybrid_kv_cache_config,
    hybrid_layer_specs,
    loads_of,
    new_req_data,
    prompt,
    run_until_scheduled,
    saves_of,
    skipped_tokens,
    wait_stat,
)
from kvshim.native import meta_json
from test_preempt import ResumeWhenBlockedInBind, Stoppable, preempt_while_saving, step_until, stoppable_harnesses

BLOCK = 16
LAYERS = [("sliding_window", 40), ("full", 0)]


class WatchRunner(HybridModelRunner):
    """HybridModelRunner that resumes the stopped server right after a
    forward pass wrote into a watched block (one a stopped save still has
    to read), and says so."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.watch: set[int] = set()
        self.srv: Stoppable | None = None
        self.overwritten_while_stopped = False

    def _forward(self, work):
        super()._forward(work)
        if not self.watch or self.srv is None or not self.srv.stopped:
            return
        for rid, start, n in work:
            r = self.reqs[rid]
            if {b[p // BLOCK] for b in r.blocks for p in range(start, start + n)} & self.watch:
                self.overwritten_while_stopped = True
                self.srv.resume()


@pytest.fixture
def pressure(tiny_model_dir, tmp_path):
    with stoppable_harnesses(tiny_model_dir, tmp_path,
                             lambda cfg, n: hybrid_kv_cache_config(cfg, hybrid_layer_specs(LAYERS), n), WatchRunner) as make:
        yield make


def restore(h, r, tokens, hit_chunks):
    """A new request with tokens restores hit_chunks chunks, every group the
    blocks its window needs there, byte for byte (checked before vLLM
    computes the rest: every real block below the hit, every group)."""
    r.scribble()  # only a load can bring the bytes back
    hit = hit_chunks * CHUNK
    q = h.add_request(h.make_request(tokens, max_tokens=1))
    s = run_until_scheduled(h, q)
    assert new_req_data(s, q.request_id).num_computed_tokens == hit
    loads = {ld.get("group", 0): ld for st in h.steps for ld in loads_of(st, q.request_id)}
    for g, spec in enumerate(r.specs):
        first = skipped_tokens(spec, hit) // BLOCK
        assert (loads[g]["start"], loads[g]["end"]) == (first * BLOCK // CHUNK, hit_chunks), (g, loads[g])
    assert r.prefix_checks[q.request_id] == (hit, {g: [] for g in range(len(r.specs))}), r.prefix_checks[q.request_id]
    h.settle()


def test_window_freed_blocks_handed_out_while_their_save_is_in_flight(pressure):
    # 17 blocks: the null block and 16 for A's 128-token prompt (8 per
    # group). A's prefill saves chunks 0-1 of both groups; the sliding
    # window's objects read blocks 1-3 (chunk 0: the window at token 63
    # starts at 24) and 5-7. At A's first decode vLLM frees the window
    # group's blocks 0-4 (the window at 129 starts at 90) and hands them
    # out at once: A's new block in each group and B's two come from them.
    h, r, srv = pressure(num_blocks=17)
    sw = next(g for g, sp in enumerate(r.specs) if isinstance(sp, SlidingWindowSpec))
    pa = prompt(81, 2 * CHUNK)
    a = h.add_request(h.make_request(pa, max_tokens=20))
    so = step_until(h, lambda so: a.request_id in so.num_scheduled_tokens, "A's prefill")
    assert so.num_scheduled_tokens[a.request_id] == len(pa) and h.num_free_blocks == 0
    srv.stop()  # the saves' ALLOCs now wait: their copies read nothing yet
    h.finish(so, h.execute(so))
    svs = saves_of(h, a.request_id)
    assert sorted((sv.get("group", 0), sv["first"], len(sv["hashes"])) for sv in svs) == [(0, 0, 2), (1, 0, 2)]
    a_sw = r.reqs[a.request_id].blocks[sw]
    read = {x for sv in svs if sv.get("group", 0) == sw for x in sv["blocks"] if x > 0}
    assert read == {a_sw[i] for i in (1, 2, 3, 5, 6, 7)}
    assert r.kvshim.worker.stats().jobs >= 1 and srv.stopped  # the saves are in flight
    r.watch, r.srv = read, srv

    b = h.add_request(h.make_request(prompt(82, 10), max_tokens=3))
    so = h.scheduler.schedule()
    # vLLM preempted nothing: it freed A's blocks behind the window and
    # handed some of those the window's save reads to A and B
    assert not so.preempted_req_ids and b.request_id in so.num_scheduled_tokens
    assert a.request_id in so.num_scheduled_tokens
    handed = set(so.scheduled_new_reqs[0].block_ids[0]) | set(so.scheduled_new_reqs[0].block_ids[1])
    handed |= {x for ids in so.scheduled_cached_reqs.new_block_ids[0] or () for x in ids}
    assert handed & read, (handed, read)
    # kvshim's fence: A goes out as preempted, so the worker waits for its
    # copies before this step's forward pass
    assert meta_json(so.kv_connector_metadata.data).get("preempted") == [a.request_id]
    resumer = ResumeWhenBlockedInBind(srv)
    resumer.start()
    try:
        h.finish(so, h.execute(so))
    finally:
        resumer.done.set()
        resumer.join(timeout=15)
        srv.resume()
    h.settle()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert resumer.fired, "the worker's bind did not wait for the window's save"
    assert not r.overwritten_while_stopped
    assert all(not e for e in r.load_errors)
    wait_stat(h, "kvshim_l1_commits_total", 4)
    # The window's objects hold A's bytes: chunk 0's (a hit of 64 tokens:
    # the window there starts in block 1) and chunk 1's (a hit of 128).
    restore(h, r, pa[:CHUNK] + prompt(83, 9), hit_chunks=1)
    restore(h, r, pa + prompt(84, 9), hit_chunks=2)
    assert_clean(h)


def test_hybrid_request_preempted_while_its_saves_are_in_flight(pressure):
    # 23 blocks: the null block, 6 for B (47-token prompt, 3 blocks per
    # group, decoding) and 16 for A (128 tokens). When B needs its 4th
    # blocks (token 48), none is free: vLLM preempts A (the last running
    # request) and frees all its blocks, both groups', while its saves wait
    # on the stopped server; B takes two of them.
    h, r, srv = pressure(num_blocks=23)
    b = h.add_request(h.make_request(prompt(85, 47), max_tokens=20))
    h.step()  # B's prefill (no full chunk: no server call)
    pa = prompt(86, 2 * CHUNK)
    a = h.add_request(h.make_request(pa, max_tokens=3))
    so = step_until(h, lambda so: a.request_id in so.num_scheduled_tokens, "A's prefill")
    assert so.num_scheduled_tokens[a.request_id] == len(pa)
    assert h.num_free_blocks == 0
    srv.stop()
    h.finish(so, h.execute(so))
    a_blocks = {x for ids in r.reqs[a.request_id].blocks for x in ids}
    svs = saves_of(h, a.request_id)
    assert sorted((sv.get("group", 0), sv["first"], len(sv["hashes"])) for sv in svs) == [(0, 0, 2), (1, 0, 2)]
    assert r.kvshim.worker.stats().jobs >= 1 and srv.stopped
    r.watch, r.srv = {x for sv in svs for x in sv["blocks"] if x > 0}, srv

    resumer = preempt_while_saving(h, r, srv, a, b, lambda rid: {x for ids in r.reqs[rid].blocks for x in ids}, a_blocks)
    # A comes back while B decodes (two groups' blocks free up at different
    # steps): its lookup hits its own saved chunks, every group's loaded
    # byte-exact into new blocks
    h.settle()
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.num_preemptions == 1
    n, wrong = r.prefix_checks.get(a.request_id, (0, None))
    assert n == 2 * CHUNK and wrong == {0: [], 1: []}, (n, wrong)
    assert resumer.fired, "the worker's bind did not wait for the preempted request's saves"
    assert not r.overwritten_while_stopped
    assert all(not e for e in r.load_errors)
    restore(h, r, pa[:CHUNK] + prompt(87, 9), hit_chunks=1)
    restore(h, r, pa + prompt(88, 9), hit_chunks=2)
    assert_clean(h)


def test_failed_load_is_reported_by_request_and_recomputed(pressure):
    """A load that fails (the server dies with it planned) is reported in
    failed_recving: vLLM cannot map block ids to requests with several
    KV-cache groups and raises on invalid_block_ids
    (Scheduler._handle_invalid_blocks). vLLM recomputes the request."""
    h, r, srv = pressure(num_blocks=64)
    pa = prompt(89, 2 * CHUNK)
    h.add_request(h.make_request(pa, max_tokens=1))
    h.settle()
    wait_stat(h, "kvshim_l1_commits_total", 4)
    r.scribble()
    q = pa + prompt(90, 20)
    b = h.add_request(h.make_request(q, max_tokens=2))
    so = h.scheduler.schedule()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sorted(ld.get("group", 0) for ld in loads_of(so, b.request_id)) == [0, 1]
    srv.srv.kill()
    steps = [h.finish(so, h.execute(so))]
    recvd = lambda s: b.request_id in (s.kv_connector_output.finished_recving or ())  # noqa: E731
    if not recvd(steps[0]):  # the failure may surface a few steps later
        steps += h.settle(until=recvd)
    failed = set().union(*(s.kv_connector_output.failed_recving or set() for s in steps))
    assert failed == {b.request_id}
    assert not any(s.kv_connector_output.invalid_block_ids for s in steps)
    s = run_until_scheduled(h, b)
    assert new_req_data(s, b.request_id).num_computed_tokens == 0
    assert s.num_scheduled_tokens[b.request_id] == len(q)
    h.settle()
    assert h.outputs[b.request_id] == [7, 7]
    h.assert_no_leaks()
    assert h.kvshim.scheduler.stats().requests == 0
