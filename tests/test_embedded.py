"""The connector's two roles through the typed binding against the embedded server,
with no vLLM: the demo end to end, and L2 surviving a server restart.

CPU memory stands in for GPU memory (this machine has no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from kvshim import native
from rig import CHUNK, Rig, fa_cache


def test_demo_restores_and_verifies(repo_root):
    r = subprocess.run([sys.executable, "-m", "kvshim", "demo", "--requests", "4", "--l1-size-gb", "1"],
                       capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["verified_ok"] is True
    assert result["hit_tokens"] > 0 and result["bytes_restored"] > 0
    assert result["requests"] == 4
    assert result["restore_gbps"] > 0 and result["lookup_p50_us"] > 0


def test_l2_serves_hits_after_a_restart_with_empty_l1(tmp_path):
    l2 = [{"type": "fs", "base_path": str(tmp_path / "l2")}]
    tokens = np.arange(1000, 1000 + 3 * CHUNK + 5, dtype=np.uint32)
    src = list(range(7))
    rig = Rig(f"t-{uuid.uuid4().hex[:8]}", fa_cache(), l2)
    try:
        rng = np.random.default_rng(3)
        for t in rig.kv:
            t[:, src] = rng.standard_normal(t[:, src].shape).astype(np.float16)
        saved = [t[:, src[:6]].copy() for t in rig.kv]
        rig.save("a", tokens, src)
        # The store controller writes to L2 in the background.
        key = "kvshim_l2_store_saved_objects_total{adapter=fs}"
        deadline = time.monotonic() + 10
        while server_stats(rig).get(key, 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server_stats(rig)[key] == 3
    finally:
        rig.close()

    # A new server: L1 is empty, L2 (the same directory) has the chunks.
    rig = Rig(f"t-{uuid.uuid4().hex[:8]}", fa_cache(), l2)
    try:
        assert server_stats(rig)["kvshim_l1_used_bytes"] == 0
        dst = list(range(20, 26))
        n, errors = rig.restore("b", tokens, dst)
        assert n == 3 * CHUNK and errors == []
        for t, want in zip(rig.kv, saved):
            np.testing.assert_array_equal(t[:, dst], want)
    finally:
        rig.close()


def server_stats(rig: Rig) -> dict[str, float]:
    st = rig.stats()
    assert st.server is not None, st.server_error
    return st.server


def test_unknown_connector_config_key_is_refused():
    from kvshim.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="unknown field \"bogus\""):
        native.Scheduler({"server": "embedded", "engine_id": "x", "bogus": 1})
