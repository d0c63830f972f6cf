"""vLLM's own controls on real `vllm serve` processes (CPU build of vLLM
0.32.0) sharing one `kvshim serve`: prefill/decode disaggregation by
kv_role (a kv_producer instance saves, a kv_consumer instance loads),
POST /reset_prefix_cache?reset_external=true reaching kvshim's reset, and
kvshim's stats in vLLM's own /metrics (build_prom_metrics). See
docs/vllm-controls.md.

The tests run in file order and share the servers; each says what it
leaves for the next. Not tested here: KV events (tests/e2e/test_events.py),
per-tier hit sources (vLLM 0.32's /metrics has no
per-source counter; tests/vllm checks them through vLLM's stats).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import requests

from harness import KvshimServer, Processes, VllmServer, kvshim_config, prompt_ids, wait_for

CHUNK = 256


@dataclass
class Rig:
    kvshim: KvshimServer
    prefill: VllmServer
    decode: VllmServer


@pytest.fixture(scope="module")
def rig(procs: Processes) -> Rig:
    kv = procs.start_kvshim("kvshim-serve")
    sock = str(kv.socket)
    prefill = procs.start_vllm("vllm-prefill", kv={**kvshim_config(sock), "kv_role": "kv_producer"}, wait=False)
    # Development endpoints (POST /reset_prefix_cache) are off unless asked for.
    decode = procs.start_vllm("vllm-decode", kv={**kvshim_config(sock), "kv_role": "kv_consumer"}, wait=False,
                              env={"VLLM_SERVER_DEV_MODE": "1"})
    prefill.wait_ready()
    decode.wait_ready()
    return Rig(kv, prefill, decode)


def commits(rig: Rig) -> float:
    return rig.kvshim.stat().get("kvshim_l1_commits_total", 0.0)


def test_decode_loads_what_prefill_saved(rig: Rig) -> None:
    prefix = prompt_ids(CHUNK * 4, seed=31)
    rig.prefill.complete(prefix + prompt_ids(20, seed=32), max_tokens=1)
    wait_for(lambda: commits(rig) >= 4, 60, "the prefill instance's 4 chunks committed")
    assert rig.prefill.external_hits() == 0
    c0 = commits(rig)
    h0 = rig.decode.external_hits()
    # A prompt of 5 full chunks: the decode instance loads 4 and computes
    # the fifth, which it does not save (kv_consumer).
    rig.decode.complete(prefix + prompt_ids(CHUNK + 20, seed=33), max_tokens=4)
    assert rig.decode.external_hits() - h0 == 4 * CHUNK
    assert commits(rig) == c0
    # The producer never looks up: the same prompt again is computed.
    rig.prefill.complete(prefix + prompt_ids(20, seed=34), max_tokens=1)
    assert rig.prefill.external_hits() == 0
    # Leaves: the prefix's 4 chunks in L1.


def test_kvshim_stats_in_vllms_metrics(rig: Rig) -> None:
    m = rig.decode.metrics()
    assert m.get("vllm:kvshim_loaded_chunks_total", 0) >= 4
    assert m.get("vllm:kvshim_hit_tokens_total", 0) >= 4 * CHUNK
    assert m.get("vllm:kvshim_load_seconds_count", 0) >= 1
    assert m.get("vllm:kvshim_saved_chunks_total", 0) == 0
    text = requests.get(rig.decode.url + "/metrics", timeout=10).text
    assert any(line.startswith("vllm:kvshim_loaded_chunks_total{") and 'engine="0"' in line for line in text.splitlines()), \
        "per-engine label"
    p = rig.prefill.metrics()
    assert p.get("vllm:kvshim_saved_chunks_total", 0) >= 4
    assert p.get("vllm:kvshim_save_seconds_count", 0) >= 1


def test_reset_prefix_cache_reaches_kvshim(rig: Rig) -> None:
    prefix = prompt_ids(CHUNK * 4, seed=31)  # the first test's, in L1
    r = requests.post(rig.decode.url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    assert rig.kvshim.stat().get("kvshim_resets_total", 0) >= 1
    h0 = rig.decode.external_hits()
    rig.decode.complete(prefix + prompt_ids(20, seed=35), max_tokens=1)
    assert rig.decode.external_hits() == h0, "served the old KV after the reset"
    # The prefill instance learns the new generation (it asks at most once a
    # second: it never looks up) and saves under it; the decode instance
    # then loads again.
    def saved_and_hit() -> bool:
        rig.prefill.complete(prefix + prompt_ids(20, seed=36), max_tokens=1)
        before = rig.decode.external_hits()
        rig.decode.complete(prefix + prompt_ids(20, seed=37), max_tokens=1)
        return rig.decode.external_hits() - before == 4 * CHUNK

    wait_for(saved_and_hit, 60, "the decode instance hits the prefill's saves after the reset", interval=1.5)
