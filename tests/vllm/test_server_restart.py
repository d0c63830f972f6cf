"""A standalone kvshim server killed with SIGKILL in the middle of a run.

vLLM's real Scheduler builds the SCHEDULER-role KVShimConnector (with
"kvshim.server" set to the socket of a `kvshim serve` running in another
process, started from libkvshim.so by harness.ServerProcess); a WORKER-role
connector with CPU torch KV tensors standing in for GPU memory is driven in
the model runner's order (harness.ModelRunner). Nothing of vLLM is stubbed.

Contract (docs/architecture.md, "Failure"): a dead server is a cache miss (lookups answer
0) and in-flight loads become load errors that vLLM recomputes; no call waits
longer than kvshim.timeout_ms; when a server is back on the socket the
connector redials (at most once a second) and saves and hits work again.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.request import RequestStatus

from harness import (
    CHUNK,
    ModelRunner,
    SchedulerHarness,
    ServerProcess,
    connector_output,
    kvshim_config,
    loads_of,
    make_kv_cache_config,
    new_req_data,
    prompt,
    released,
    run_until_scheduled,
    store,
    wait_stat,
)

TIMEOUT_MS = 300
REDIAL_S = 1.0  # shim/link.go: a failed dial is retried after this long


@pytest.fixture
def server(tmp_path):
    d = tmp_path / "srv"
    d.mkdir(mode=0o700)
    srv = ServerProcess(d / "kvshim.sock")
    yield srv
    srv.kill()


def test_server_killed_mid_run_is_a_miss_then_recovers(tiny_model_dir, server):
    server.start()
    cfg = kvshim_config(
        tiny_model_dir, server=server.socket, timeout_ms=TIMEOUT_MS, enable_prefix_caching=False
    )
    kvc = make_kv_cache_config(num_blocks=128)
    h = SchedulerHarness(cfg, kvc)
    r = ModelRunner(cfg, kvc)
    h.runners = [r]
    try:
        # 1. A is stored on the standalone server.
        p = prompt(21, 200)
        store(h, r, p, max_tokens=1)
        wait_stat(h, "kvshim_l1_commits_total", 3)
        r.scribble()

        # 2. B hits; its load is planned; the server dies before the
        # workers run the step.
        q = p + prompt(22, 30)
        b = h.add_request(h.make_request(q, max_tokens=2))
        so = h.scheduler.schedule()
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        meta_blocks = set(loads_of(so, b.request_id)[0]["blocks"])
        assert len(meta_blocks) == 12
        server.kill()
        t0 = time.monotonic()
        steps = [h.finish(so, h.execute(so))]
        recvd = lambda s: b.request_id in (s.kv_connector_output.finished_recving or ())  # noqa: E731
        if not recvd(steps[0]):
            steps += h.settle(until=recvd)
        took = time.monotonic() - t0
        assert took < 3 * TIMEOUT_MS / 1000, f"load failure took {took:.2f}s"
        # Loads run off the model runner's thread: the failure may surface a
        # few steps later, but every block of the load is a load error and
        # is reported no later than the request itself is reported finished
        # (received), so vLLM never runs on the blocks and never waits forever.
        errors = set().union(*(connector_output(s).invalid_block_ids for s in steps))
        assert errors == meta_blocks
        assert recvd(steps[-1]) and not any(recvd(s) for s in steps[:-1])
        # vLLM (kv_load_failure_policy="recompute") computes B from scratch.
        s = run_until_scheduled(h, b)
        assert new_req_data(s, b.request_id).num_computed_tokens == 0
        assert s.num_scheduled_tokens[b.request_id] == len(q)
        assert r.check_blocks(q, r.reqs[b.request_id].blocks[: len(q) // 16]) == []
        h.settle()
        assert h.outputs[b.request_id] == [7, 7]
        h.assert_no_leaks()

        # 3. With the server down: lookups are a miss at once, saves are
        # dropped, nothing hangs.
        assert h.kvshim.scheduler.stats().server_error is not None
        failed_before = r.kvshim.worker.stats().counters["FailedSaves"]
        t0 = time.monotonic()
        c = h.add_request(h.make_request(prompt(23, 3 * CHUNK + 7), max_tokens=1))
        s = h.step()
        assert s.num_scheduled_tokens[c.request_id] == 3 * CHUNK + 7
        assert new_req_data(s, c.request_id).num_computed_tokens == 0
        h.settle()
        assert time.monotonic() - t0 < 3 * TIMEOUT_MS / 1000
        h.assert_no_leaks()
        assert r.kvshim.worker.stats().counters["FailedSaves"] == failed_before + 3

        # 4. A new server on the same socket: the connector redials by itself.
        server.start()
        time.sleep(REDIAL_S + 0.1)
        a2 = h.add_request(h.make_request(p + [9], max_tokens=1))
        s = run_until_scheduled(h, a2)
        # the new server's L1 starts empty: a miss, never stale bytes
        assert new_req_data(s, a2.request_id).num_computed_tokens == 0
        h.settle()
        wait_stat(h, "kvshim_l1_commits_total", 3)  # a2 saved its 3 chunks again
        r.scribble()
        d = h.add_request(h.make_request(p + prompt(24, 20), max_tokens=1))
        s = run_until_scheduled(h, d)
        assert new_req_data(s, d.request_id).num_computed_tokens == 3 * CHUNK
        assert r.check_blocks(d.prompt_token_ids or [], r.reqs[d.request_id].blocks[:12]) == []
        h.settle()
        h.assert_no_leaks()
        st = released(h)
        assert st["kvshim_lookup_hit_chunks_total"] == 3
    finally:
        h.close()


def test_server_killed_while_saves_are_in_flight(tiny_model_dir, server):
    # SIGKILL right after the workers started A's saves (copies into L1,
    # then COMMIT): whatever stage they reach, A is still reported finished
    # sending, its blocks come back, and nothing waits past the timeout.
    server.start()
    cfg = kvshim_config(
        tiny_model_dir, server=server.socket, timeout_ms=TIMEOUT_MS, enable_prefix_caching=False
    )
    kvc = make_kv_cache_config(num_blocks=128)
    h = SchedulerHarness(cfg, kvc, runners=[])
    h.runners = [ModelRunner(cfg, kvc)]
    try:
        a = h.add_request(h.make_request(prompt(25, 7 * CHUNK + 3), max_tokens=1))
        so = h.scheduler.schedule()
        assert so.num_scheduled_tokens[a.request_id] == 7 * CHUNK + 3
        mro = h.execute(so)  # the forward, then 7 chunk saves start
        server.kill()
        h.finish(so, mro)
        t0 = time.monotonic()
        h.settle(timeout_s=5)
        assert time.monotonic() - t0 < 3 * TIMEOUT_MS / 1000
        assert any(a.request_id in (connector_output(s).finished_sending or ()) for s in h.steps)
        h.assert_no_leaks()
    finally:
        h.close()


def test_no_server_at_all_is_a_miss(tiny_model_dir, tmp_path):
    # "kvshim.server" names a socket nobody listens on: the connectors are
    # built, every lookup is a miss, saves are dropped, requests complete.
    cfg = kvshim_config(
        tiny_model_dir, server=str(tmp_path / "none.sock"), timeout_ms=TIMEOUT_MS,
        enable_prefix_caching=False,
    )
    kvc = make_kv_cache_config(num_blocks=64)
    h = SchedulerHarness(cfg, kvc)
    r = ModelRunner(cfg, kvc)
    h.runners = [r]
    try:
        t0 = time.monotonic()
        p = prompt(26, 3 * CHUNK + 3)
        for _ in range(2):
            b = h.add_request(h.make_request(p, max_tokens=2))
            s = h.step()
            assert s.num_scheduled_tokens[b.request_id] == len(p)
            h.settle()
            assert h.outputs[b.request_id] == [7, 7]
        assert time.monotonic() - t0 < 3 * TIMEOUT_MS / 1000
        h.assert_no_leaks()
        assert h.kvshim.scheduler.stats().server_error is not None
        assert r.kvshim.worker.stats().counters["FailedSaves"] == 6
    finally:
        h.close()
