"""A hit loaded in a step with no forward pass is reported by that step.

vLLM schedules an asynchronous load in a step that computes nothing for the
request (kv_connector_no_forward when nothing else runs: the forward
context has no attention metadata), and computes the request only in the
step after the one whose get_finished reported the load. Reported one step
late, a hit pays one more engine step and EngineCore's 1 ms idle sleep
(docs/e2e.md, "Where a hit's time goes"). The worker waits for such a step's
loads, up to 20 ms; this harness runs every step without attention metadata,
as vLLM does for a step with no forward pass.
"""

from __future__ import annotations

import time

from harness import loads_of, prompt, run_until_scheduled, wait_stat

IDLE_LOAD_WAIT_S = 0.020  # KVShimWorker.start_load_kv's bound


def test_a_load_in_a_step_without_forward_is_reported_by_that_step(kv):
    h, r = kv()
    p = prompt(1, 200)  # 3 full chunks
    a = h.add_request(h.make_request(p, max_tokens=1))
    h.run_until_idle()
    assert h.outputs[a.request_id] == [7]
    wait_stat(h, "kvshim_l1_commits_total", 3)

    b = h.add_request(h.make_request(p + prompt(2, 30), max_tokens=1))
    t0 = time.monotonic()
    s1 = h.step()
    took = time.monotonic() - t0
    assert b.request_id not in s1.num_scheduled_tokens  # nothing computed: the load only
    (ld,) = loads_of(s1, b.request_id)
    assert (ld["start"], ld["end"]) == (0, 3)
    recving = s1.kv_connector_output.finished_recving or set()
    # Reported now, unless the load itself outlasted the bound (a machine
    # too loaded to copy 3 chunks in 20 ms): then the step took that long.
    assert b.request_id in recving or took >= IDLE_LOAD_WAIT_S, (took, recving)

    # Reported now: the very next step computes it, from the loaded prefix.
    s2 = h.step() if b.request_id in recving else run_until_scheduled(h, b)
    assert s2.num_scheduled_tokens.get(b.request_id) == 230 - 192
    assert r.check_blocks(p + prompt(2, 30), r.reqs[b.request_id].blocks[:14]) == []
    h.settle()
    h.assert_no_leaks()
