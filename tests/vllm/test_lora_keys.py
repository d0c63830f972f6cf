"""LoRA adapters never share KV through kvshim.

The connector once keyed an adapter as f"{lora_name}:{lora_path}", so
LoRARequest("a:b", 3, "c") and LoRARequest("a", 4, "b:c") were one adapter to
kvshim: the second was answered the first one's chunks and vLLM loaded the
other adapter's KV. Now the adapter travels as {"name", "path"} and Go hashes
each field length-prefixed.

Same rig as test_connector.py: vLLM's real Scheduler builds the SCHEDULER-role
KVShimConnector (embedded server in this process), harness.ModelRunner drives
a WORKER-role connector on CPU tensors, requests are real vLLM Requests with
vLLM's real LoRARequest. No lora_config: the scheduler passes lora_request
through untouched, and the fake model's KV does not depend on the adapter, so
only kvshim's keys keep the adapters apart. vLLM's own prefix cache is off.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm.lora.request import LoRARequest

from harness import (
    CHUNK,
    new_req_data,
    prompt,
    run_until_scheduled,
    server_stats,
    store,
    wait_stat,
)
from kvshim.errors import InvalidArgumentError
from kvshim.vllm import _extras


def test_lora_name_and_path_never_share_kv(kv):
    h, r = kv()
    p = prompt(11, 3 * CHUNK + 5)  # 3 full chunks + a tail
    store(h, r, p, max_tokens=1, lora_request=LoRARequest("a:b", 3, "c"))
    wait_stat(h, "kvshim_l1_commits_total", 3)

    hits = 0
    for lora, want in [
        (LoRARequest("a", 4, "b:c"), 0),  # the collision: "a:b:c" both ways
        (LoRARequest("a:b", 3, "c:"), 0),
        (LoRARequest("a", 3, "c"), 0),
        (None, 0),  # the base model
        (LoRARequest("a:b", 3, "c"), 3 * CHUNK),  # the same adapter again: a hit
        # Same name and path under another per-process id: the same weights,
        # so the same KV (vLLM's prefix cache does not key the id either).
        (LoRARequest("a:b", 7, "c"), 3 * CHUNK),
    ]:
        b = h.add_request(h.make_request(p, max_tokens=1, lora_request=lora))
        s = run_until_scheduled(h, b)
        assert new_req_data(s, b.request_id).num_computed_tokens == want, lora
        hits += want // CHUNK
        h.settle()
    assert server_stats(h.connector)["kvshim_lookup_hit_chunks_total"] == hits
    # each of the 4 missing adapters stored its own 3 chunks
    wait_stat(h, "kvshim_l1_commits_total", 3 + 4 * 3)
    h.assert_no_leaks()


class _Req:
    """Only the attributes _extras reads."""

    def __init__(self, lora_request=None, cache_salt=None, mm_features=None):
        self.lora_request, self.cache_salt, self.mm_features = lora_request, cache_salt, mm_features


def extras_of(**kw: Any) -> dict[str, Any] | None:
    return _extras(_Req(**kw))  # type: ignore[arg-type]  # a stand-in with the attributes _extras reads


def test_extras_keep_the_lora_structure():
    assert extras_of() is None
    got = extras_of(lora_request=LoRARequest("a:b", 3, "c"), cache_salt="s")
    assert got == {"cache_salt": "s", "lora": {"name": "a:b", "path": "c"}}
    assert extras_of(lora_request=LoRARequest("a", 4, "b:c")) == {"lora": {"name": "a", "path": "b:c"}}
    # a NUL or a quote inside a field survives the trip to Go (JSON)
    got = json.loads(json.dumps(extras_of(lora_request=LoRARequest('n"\x00', 1, "p"))))
    assert got["lora"] == {"name": 'n"\x00', "path": "p"}


@pytest.mark.parametrize(
    "extras, field",
    [
        (b'{"lora": "a:b:c"}', "lora: want an object {name, path}, got a string"),  # the old joined key
        (b'{"lora": {"name": 1, "path": "p"}}', "lora.name: want a string, got the number 1"),
        (b'{"lora": {"name": "a"}}', "lora.path is missing"),
        (b'{"lora": {"name": "a", "path": "p", "id": 3}}', 'lora: unknown field "id"'),
        (b'{"cache_salt": ["x"]}', "cache_salt: want a string, got an array"),
        (b'{"mm": [{"hash": "h", "offset": "0", "length": 1}]}', "mm[0].offset: want an integer, got a string"),
    ],
)
def test_malformed_extras_are_refused_naming_the_field(kv, extras, field):
    """Through the native scheduler the connector calls: EINVAL and a message
    that names the field, never a silent key."""
    h, _ = kv()
    with pytest.raises(InvalidArgumentError, match="bad hash extras") as ei:
        h.kvshim.scheduler.native.match("bad", [1, 2, 3, 4], json.loads(extras))
    assert field in str(ei.value)


def test_a_request_kvshim_cannot_key_is_a_miss_not_a_crash(kv, caplog):
    """A LoRA path past Go's field limit makes the match fail: the scheduler
    connector answers a miss (vLLM computes the prompt) and logs why,
    instead of raising out of get_num_new_matched_tokens."""
    h, _ = kv()
    req = h.make_request(prompt(12, 3 * CHUNK), max_tokens=1, lora_request=LoRARequest("big", 5, "p" * 5000))
    with caplog.at_level("WARNING", logger="vllm.kvshim"):
        assert h.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "is a miss" in caplog.text and "lora" in caplog.text
