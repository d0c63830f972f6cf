"""kvshim's KV events on a real `vllm serve` (CPU build of vLLM 0.32.0):
a ZMQ subscriber decodes vLLM's KVEventBatch (msgspec) from
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
...}'` and sees kvshim's BlockStored (medium "CPU") name the same block
hashes as vLLM's own GPU prefix-cache events for the chunks kvshim
committed. See docs/vllm-controls.md ("KV events").

Not tested here: BlockRemoved (kvshim does not report evictions yet) and
AllBlocksCleared after POST /reset_prefix_cache (tests/vllm checks the
connector's through vLLM's Scheduler).
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from harness import Processes, VllmServer, free_port, kvshim_config, prompt_ids

CHUNK = 256  # kvshim.chunk_size (its default)
BLOCK = 16  # vllm serve's default block size on CPU


class Subscriber:
    """A ZMQ SUB socket on vLLM's publisher, as a router's indexer has."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self, until: Any, timeout_s: float) -> list[Any]:
        """Receives until until(events) holds or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while not until(self.events) and time.monotonic() < deadline:
            if self.sock.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events += self.decoder.decode(payload).events
        return self.events

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def served(procs: Processes) -> tuple[VllmServer, Subscriber]:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    sub = Subscriber(endpoint)  # SUB connects before PUB binds: zmq retries
    s = procs.start_vllm("vllm-events", kv=kvshim_config(), prefix_caching=True,
                         args=["--kv-events-config", json.dumps(ev)])
    yield s, sub
    sub.close()


def kvshim_stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]


def test_block_stored_names_vllms_own_block_hashes(served: tuple[VllmServer, Subscriber]) -> None:
    s, sub = served
    tokens = prompt_ids(3 * CHUNK + 10, seed=41)
    s.complete(tokens, max_tokens=1)
    # The committed chunks' events come with a later step's output: a
    # second request keeps the engine stepping.
    s.complete(prompt_ids(20, seed=42), max_tokens=1)
    ours = 3 * CHUNK // BLOCK
    events = sub.drain(lambda evs: sum(len(e.block_hashes) for e in kvshim_stored(evs)) >= ours, 60)
    stored = kvshim_stored(events)
    got = [h for e in stored for h in e.block_hashes]
    assert len(got) == ours, (stored, [(type(e).__name__, getattr(e, "medium", None)) for e in events])
    assert all(e.block_size == BLOCK for e in stored)
    assert [t for e in stored for t in e.token_ids] == tokens[: 3 * CHUNK]
    # vLLM's own events for the same blocks (its GPU prefix cache) name
    # them by the same hashes: a router joins the two tiers by hash.
    gpu = [h for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes]
    assert got == gpu[:ours]
    assert stored[0].parent_block_hash is None
