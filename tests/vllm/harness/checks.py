"""Helpers shared by the connector tests: prompts, stats, step metadata, leak checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvshim.native import meta_json
from kvshim.vllm import KVShimMetadata

from .runner import ModelRunner, as_kvshim
from .scheduler import SchedulerHarness, StepResult


def server_stats(connector: KVConnectorBase_V1 | None) -> dict[str, float]:
    """The server's counters through the scheduler connector (STATS)."""
    st = as_kvshim(connector).scheduler.stats()
    assert st.server is not None, st.server_error
    return st.server


def prompt(seed: int, n: int) -> list[int]:
    """n deterministic token ids (3..1000) for prompt number ``seed``."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, 1000, n)]


def released(h: SchedulerHarness, timeout: float = 5.0) -> dict[str, float]:
    """The server's counters once every hold and lookup is gone. A load
    counts as ended once its copies end; its RELEASE follows off the
    request's path (shim/worker.go, Worker.load): settle() waits for it
    (wait_workers), a test that reads between steps waits here."""
    wait_stat(h, "kvshim_l1_holds", 0, timeout)
    return wait_stat(h, "kvshim_lookups_live", 0, timeout)


def wait_stat(h: SchedulerHarness, name: str, want: float, timeout: float = 5.0) -> dict[str, float]:
    """Server counters move when asynchronous copies commit: poll them
    until ``name`` equals ``want``; return the server's counters."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        st = server_stats(h.connector)
        if st[name] == want or time.monotonic() > deadline:
            assert st[name] == want, (name, st[name], want)
            return st
        time.sleep(0.01)


def connector_output(step: StepResult) -> KVConnectorOutput:
    """The step's connector output (a step with a connector has one)."""
    assert step.kv_connector_output is not None, "no connector output"
    return step.kv_connector_output


def loads_of(step: StepResult | SchedulerOutput, req_id: str, kind: str = "loads") -> list[dict[str, Any]]:
    """The load specs (or with kind "saves", the save specs) kvshim put in
    this step's connector metadata (Go writes it in a binary form; meta_json
    gives its JSON text form: {"loads": [{"req", "start", "end", "hashes",
    "blocks", ...}], "saves": [...]})."""
    so = step.scheduler_output if isinstance(step, StepResult) else step
    assert isinstance(so.kv_connector_metadata, KVShimMetadata), so.kv_connector_metadata
    meta = meta_json(so.kv_connector_metadata.data)
    return [ld for ld in meta.get(kind, []) if ld["req"] == req_id]


def saves_of(h: SchedulerHarness, req_id: str) -> list[dict[str, Any]]:
    """Every save kvshim dispatched for req_id, in step order."""
    return [sv for s in h.steps for sv in loads_of(s, req_id, "saves")]


def assert_clean(h: SchedulerHarness) -> None:
    """No request, block, hold, staged object or lookup left anywhere."""
    h.assert_no_leaks()
    wait_jobs(h)
    st = server_stats(h.connector)
    assert st["kvshim_l1_holds"] == 0 and st["kvshim_lookups_live"] == 0, st
    staged = {k: v for k, v in st.items() if "stag" in k and not k.endswith("_total")}
    assert staged and not any(staged.values()), staged
    assert h.kvshim.scheduler.stats().requests == 0


def new_req_data(step: StepResult, req_id: str) -> Any:
    """The NewRequestData vLLM sent the workers for req_id in this step."""
    (nr,) = [n for n in step.scheduler_output.scheduled_new_reqs if n.req_id == req_id]
    return nr


def store(h: SchedulerHarness, r: ModelRunner, tokens: Sequence[int], **kw: Any) -> tuple[Request, list[int]]:
    """Run one request to completion (its full chunks get saved) and return
    the block ids it was computed in."""
    req = h.add_request(h.make_request(tokens, **kw))
    # (with an L2 the miss is answered after the L2 lookup: a pending step first)
    s = run_until_scheduled(h, req)
    assert s.num_scheduled_tokens[req.request_id] == len(tokens)
    blocks = list(r.reqs[req.request_id].blocks)
    h.settle()
    return req, blocks


def wait_jobs(h: SchedulerHarness, timeout: float = 5.0) -> None:
    """Until every worker has no job left (h.wait_workers): for a test that
    reads workers' counters between steps, not after settle()."""
    h.wait_workers(timeout)


def run_until_scheduled(h: SchedulerHarness, req: Request, timeout_s: float = 10.0, **kw: Any) -> StepResult:
    """Step until req is scheduled; return that step."""
    steps = h.settle(timeout_s, until=lambda s: req.request_id in s.num_scheduled_tokens, **kw)
    return next(s for s in steps if req.request_id in s.num_scheduled_tokens)
