"""The harness drives vLLM's real v1 Scheduler with a connector, no GPU."""

import os

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from harness import SchedulerHarness, connector_output, make_vllm_config
from kvshim_test_connectors import RecordingConnector, RecordingMetadata

BLOCK = 16


def _cfg(model_dir, **extra):
    kw = {
        k: extra.pop(k)
        for k in list(extra)
        if k in ("enable_prefix_caching", "async_scheduling")
    }
    return make_vllm_config(
        model_dir,
        kv_connector="RecordingConnector",
        kv_connector_module_path="kvshim_test_connectors",
        kv_connector_extra_config=extra,
        max_num_batched_tokens=256,
        **kw,
    )


def _calls(conn, name):
    return [args for n, args in conn.calls if n == name]


def test_scheduler_builds_placeholder_connector_via_factory(tiny_model_dir):
    from kvshim.vllm import KVShimConnector

    h = SchedulerHarness(make_vllm_config(tiny_model_dir), num_blocks=64)
    assert type(h.connector) is KVShimConnector
    assert h.connector.role is KVConnectorRole.SCHEDULER


# (async_scheduling, pipelined): plain Scheduler; vLLM's default here
# (AsyncScheduler) stepped serially; AsyncScheduler with overlapped batches.
MODES = [(False, False), (None, False), (None, True)]


@pytest.mark.parametrize("async_scheduling,pipelined", MODES)
def test_miss_runs_requests_to_completion(tiny_model_dir, async_scheduling, pipelined):
    # get_num_new_matched_tokens -> (0, False) for every request.
    h = SchedulerHarness(
        _cfg(tiny_model_dir, async_scheduling=async_scheduling), num_blocks=256
    )
    expected = "AsyncScheduler" if async_scheduling is None else "Scheduler"
    assert type(h.scheduler).__name__ == expected
    lens = [40, 100, 600]  # 600 > 256 batched tokens: chunked prefill
    reqs = [
        h.add_request(h.make_request(range(i * 1000, i * 1000 + n), max_tokens=4))
        for i, n in enumerate(lens)
    ]

    h.run_until_idle(max_steps=30, pipelined=pipelined)

    conn = h.connector
    assert isinstance(conn, RecordingConnector)
    for r in reqs:
        assert h.outputs[r.request_id] == [7] * 4
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    asked = {rid for rid, _ in _calls(conn, "get_num_new_matched_tokens")}
    assert asked == {r.request_id for r in reqs}
    allocs = _calls(conn, "update_state_after_alloc")
    assert all(n_ext == 0 for _, _, n_ext in allocs)
    assert len(_calls(conn, "build_connector_meta")) == len(h.steps)
    finished = dict(_calls(conn, "request_finished"))
    assert set(finished) == {r.request_id for r in reqs}
    # block ids handed over at finish cover prompt + outputs but the last token
    for r, n in zip(reqs, lens):
        assert len(finished[r.request_id]) == -(-(n + 4 - 1) // BLOCK)
    # chunked prefill: the 600-token prompt spans three steps of <= 256 tokens
    big = reqs[2].request_id
    chunks = [s.num_scheduled_tokens[big] for s in h.steps if big in s.num_scheduled_tokens]
    assert sum(chunks) == 600 + 3 and max(chunks) <= 256
    h.assert_no_leaks()


def test_connector_sees_block_aligned_local_prefix_hit(tiny_model_dir):
    h = SchedulerHarness(_cfg(tiny_model_dir), num_blocks=64)
    a = h.add_request(h.make_request(range(100), max_tokens=2))
    h.run_until_idle(max_steps=5)
    b = h.add_request(h.make_request(list(range(100)) + [5, 6, 7], max_tokens=2))
    s = h.step()
    # A's 6 full blocks (96 tokens) are a local prefix-cache hit for B.
    asked = dict(_calls(h.connector, "get_num_new_matched_tokens"))
    assert asked == {a.request_id: 0, b.request_id: 96}
    assert s.num_scheduled_tokens[b.request_id] == 103 - 96
    h.run_until_idle(max_steps=5)
    h.assert_no_leaks()


@pytest.mark.parametrize("async_scheduling,pipelined", MODES)
def test_async_external_hit_with_worker_connector(
    tiny_model_dir, async_scheduling, pipelined
):
    # Lookup pending twice (None), then 64 tokens found and loaded
    # asynchronously by the WORKER connector one step later.
    h = SchedulerHarness(
        _cfg(
            tiny_model_dir,
            hit_tokens=64,
            defers=2,
            enable_prefix_caching=False,
            async_scheduling=async_scheduling,
        ),
        num_blocks=128,
        with_worker=True,
    )
    req = h.add_request(h.make_request(range(100), max_tokens=3))
    rid = req.request_id

    s1, s2 = h.step(), h.step()  # pending: nothing scheduled
    assert not s1.num_scheduled_tokens and not s2.num_scheduled_tokens
    s3 = h.step()  # hit: blocks allocated, load starts, request waits
    assert rid not in s3.num_scheduled_tokens
    meta = s3.connector_meta
    assert isinstance(meta, RecordingMetadata) and len(meta.loads[rid]) == 64 // BLOCK
    assert connector_output(s3).finished_recving == {rid}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s4 = h.step()  # load done: the rest of the prompt is computed
    assert s4.num_scheduled_tokens[rid] == 100 - 64
    h.run_until_idle(max_steps=10, pipelined=pipelined)
    assert h.outputs[rid] == [7] * 3
    _, block_ids, n_ext = _calls(h.connector, "update_state_after_alloc")[0]
    assert n_ext == 64 and len(block_ids[0]) == 64 // BLOCK
    h.assert_no_leaks()


def test_delay_free_keeps_blocks_until_finished_sending(tiny_model_dir):
    h = SchedulerHarness(_cfg(tiny_model_dir, delay_free=True), num_blocks=64,
                         with_worker=True)
    req = h.add_request(h.make_request(range(50), max_tokens=1))
    r1 = h.step()  # prefill + the only token: finished, blocks held
    assert req.request_id in r1.finished
    assert req.request_id in h.scheduler.requests  # delay-freed
    assert h.num_free_blocks < 64 - 1
    h.run_until_idle(max_steps=3)  # worker reports finished_sending
    h.assert_no_leaks()


def test_vllm_example_connector_scheduler_side(tiny_model_dir, tmp_path):
    # vLLM's in-tree ExampleConnector (registered name, no module path).
    cfg = make_vllm_config(
        tiny_model_dir,
        kv_connector="ExampleConnector",
        kv_connector_module_path=None,
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
        enable_prefix_caching=False,
    )
    h = SchedulerHarness(cfg, num_blocks=128)
    prompt = list(range(1, 70))
    a = h.add_request(h.make_request(prompt, max_tokens=2))
    s = h.step()
    (store,) = s.connector_meta.requests
    assert store.is_store and s.num_scheduled_tokens[a.request_id] == 69
    h.run_until_idle(max_steps=5)

    # What the worker side would have written: the connector's own folder name.
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    n = (len(prompt) - 2) // BLOCK * BLOCK
    assert isinstance(h.connector, ExampleConnector), h.connector
    os.makedirs(h.connector._generate_foldername_debug(torch.tensor(prompt[:n]), []))
    b = h.add_request(h.make_request(prompt, max_tokens=2))
    s = h.step()
    (load,) = s.connector_meta.requests
    assert not load.is_store and s.scheduler_output.has_sync_kv_loads
    assert s.num_scheduled_tokens[b.request_id] == len(prompt) - n
    h.run_until_idle(max_steps=5)
    h.assert_no_leaks()
