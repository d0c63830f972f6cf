"""fork(): a process imports vLLM and kvshim.vllm (which loads nothing
native), forks, and the child builds the connectors and works — what vLLM's
default "fork" start method does to its engine-core and worker processes.

Run in a fresh interpreter (this pytest process has loaded libkvshim.so
already). The child drives vLLM's real Scheduler with the SCHEDULER-role
connector (embedded server) and a WORKER-role connector whose KV cache is
CPU torch tensors standing in for GPU memory: store, then a hit restored
byte for byte. Then the converse: once the parent has loaded the library, a
forked child that builds a connector gets a clear error, not a hang.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON_DIR = HERE.parent.parent / "python"

SCRIPT = textwrap.dedent(
    """
    import os, sys, traceback
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import vllm  # noqa: F401
    import kvshim.vllm  # noqa: F401
    from kvshim import native
    from harness import (CHUNK, ModelRunner, SchedulerHarness, kvshim_config,
                         make_kv_cache_config, new_req_data, prompt,
                         run_until_scheduled, store, wait_stat, write_tiny_model_dir)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    assert not native.loaded(), "import loaded libkvshim.so"
    model_dir = write_tiny_model_dir(sys.argv[3])

    def child_round_trip():
        cfg = kvshim_config(model_dir, enable_prefix_caching=False)
        kvc = make_kv_cache_config(num_blocks=64)
        h = SchedulerHarness(cfg, kvc)
        r = ModelRunner(cfg, kvc)
        h.runners = [r]
        p = prompt(41, 200)
        store(h, r, p, max_tokens=1)
        wait_stat(h, "kvshim_l1_commits_total", 3)
        r.scribble()
        b = h.add_request(h.make_request(p + [5, 6], max_tokens=1))
        s = run_until_scheduled(h, b)
        assert new_req_data(s, b.request_id).num_computed_tokens == 3 * CHUNK
        assert r.check_blocks(p, r.reqs[b.request_id].blocks[:12]) == []
        h.settle()
        h.assert_no_leaks()
        h.close()

    def in_child(fn):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn()
                code = 0
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    assert in_child(child_round_trip) == 0, "child failed"
    assert not native.loaded(), "the parent loaded the library"

    # The parent loads the library (a connector), then forks.
    cfg = kvshim_config(model_dir)
    kvc = make_kv_cache_config(num_blocks=64)
    parent_conn = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
    assert native.loaded()

    def child_refused():
        try:
            KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
        except RuntimeError as e:
            assert "before this process forked" in str(e), e
            return
        raise AssertionError("a connector was built on a Go runtime that did not survive fork")

    assert in_child(child_refused) == 0, "child with an inherited library"
    parent_conn.shutdown()
    print("FORK-OK")
    """
)


def test_fork_child_builds_the_connector_and_works(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(PYTHON_DIR), str(HERE), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0 and "FORK-OK" in r.stdout, r.stdout[-4000:] + r.stderr[-8000:]
