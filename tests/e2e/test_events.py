"""kvshim's KV events on a real `vllm serve` (CPU build of vLLM 0.32.0):
a ZMQ subscriber decodes vLLM's KVEventBatch (msgspec) from
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
...}'` and sees kvshim's BlockStored (medium "CPU") name the same block
hashes as vLLM's own GPU prefix-cache events for the chunks kvshim
committed, and BlockRemoved (medium "CPU") name the hashes it announced once
a small L1 evicts them. See docs/vllm-controls.md ("KV events").

Not tested here: BlockStored / BlockRemoved medium "STORAGE" (an L2) and
AllBlocksCleared after POST /reset_prefix_cache (tests/vllm checks both
through vLLM's Scheduler).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from harness import Processes, VllmServer, free_port, kvshim_config, prompt_ids

CHUNK = 256  # kvshim.chunk_size (its default)
# The tiny model's chunk is 512 KiB (4 layers x 2 KV heads x 64 x bf16 K and
# V x 256 tokens): an L1 of 2 MiB holds at most 4, so 6 more chunks evict.
L1_GB = 2 / 1024


class Subscriber:
    """A ZMQ SUB socket for vLLM's publisher, as a router's indexer has. It
    binds: vLLM's PUB binds only a wildcard or ipc endpoint and connects to
    any other (ZmqEventPublisher._is_bind_endpoint). Its own thread polls
    it from the start: libzmq attaches a connecting peer, and sends it the
    subscription, only while the application calls into the socket, and a
    PUB drops whatever it sends before the subscription arrives."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.events: list[Any] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()
        assert self._bound.wait(10), "the subscriber did not bind"

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.bind(self.endpoint)
            self._bound.set()
            decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
            while not self._stop.is_set():
                if sock.poll(50):
                    _topic, _seq, payload = sock.recv_multipart()
                    batch = decoder.decode(payload)
                    with self._lock:
                        self.events += batch.events
        except BaseException as e:  # reported by drain()
            self.errors.append(e)
            self._bound.set()
        finally:
            sock.close(0)
            ctx.term()

    def drain(self, until: Any, timeout_s: float) -> list[Any]:
        """The events received once until(events) holds or timeout_s passed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                got = list(self.events)
            if self.errors or until(got):
                break
            time.sleep(0.05)
        assert not self.errors, self.errors
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def served(procs: Processes) -> Iterator[tuple[VllmServer, Subscriber]]:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    sub = Subscriber(endpoint)
    s = procs.start_vllm("vllm-events", kv=kvshim_config(l1_size_gb=L1_GB), prefix_caching=True,
                         args=["--kv-events-config", json.dumps(ev)])
    yield s, sub
    sub.close()


def kvshim_stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]


def test_block_stored_names_vllms_own_block_hashes(served: tuple[VllmServer, Subscriber]) -> None:
    s, sub = served
    tokens = prompt_ids(3 * CHUNK + 10, seed=41)
    s.complete(tokens, max_tokens=1)
    # No other request follows: the events come with the step that returns
    # the request's blocks (finished_sending), which waits for the COMMIT's
    # report, so an engine that goes idle still publishes them.
    events = sub.drain(lambda evs: sum(len(e.token_ids) for e in kvshim_stored(evs)) >= 3 * CHUNK, 60)
    stored = kvshim_stored(events)
    gpu_events = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert stored and gpu_events, [(type(e).__name__, getattr(e, "medium", None)) for e in events]
    block = gpu_events[0].block_size  # the CPU build's default (128), not the GPU's 16
    assert all(e.block_size == block for e in stored)
    got = [h for e in stored for h in e.block_hashes]
    assert len(got) == 3 * CHUNK // block, stored
    assert [t for e in stored for t in e.token_ids] == tokens[: 3 * CHUNK]
    # vLLM's own events for the same blocks (its GPU prefix cache) name
    # them by the same hashes: a router joins the two tiers by hash.
    gpu = [h for e in gpu_events for h in e.block_hashes]
    assert got == gpu[: len(got)]
    assert stored[0].parent_block_hash is None


def test_block_removed_names_the_hashes_announced_when_l1_evicts(served: tuple[VllmServer, Subscriber]) -> None:
    s, sub = served
    first = prompt_ids(2 * CHUNK + 10, seed=51)
    s.complete(first, max_tokens=1)

    def first_stored(evs: list[Any]) -> list[BlockStored]:
        """kvshim's BlockStored of the first prompt's chunks (one per chunk)."""
        return [e for e in kvshim_stored(evs)
                if any(e.token_ids == first[i:i + len(e.token_ids)] for i in range(0, 2 * CHUNK, CHUNK))]

    events = sub.drain(lambda evs: sum(len(e.token_ids) for e in first_stored(evs)) >= 2 * CHUNK, 60)
    announced = {h for e in first_stored(events) for h in e.block_hashes}
    assert announced, "no BlockStored for the first prompt"
    for seed in (52, 53, 54):  # 6 chunks more than L1 holds: the first prompt's are evicted
        s.complete(prompt_ids(2 * CHUNK + 10, seed=seed), max_tokens=1)

    def removed(evs: list[Any]) -> set[Any]:
        return {h for e in evs if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes}

    # The server flags the eviction on its next answer to this instance's
    # scheduler; a short request makes the scheduler ask (an idle engine
    # has no step to publish in).
    deadline = time.monotonic() + 60
    while not announced <= removed(sub.drain(lambda evs: announced <= removed(evs), 2)):
        assert time.monotonic() < deadline, "no BlockRemoved for the evicted chunks"
        s.complete(prompt_ids(CHUNK + 8, seed=int(time.monotonic() * 1000) % 10_000), max_tokens=1)
    events = sub.drain(lambda evs: False, 0)
    everything_stored = {h for e in kvshim_stored(events) for h in e.block_hashes}
    # a router's view stays a subset of what kvshim holds: nothing is
    # removed that was not announced first
    assert removed(events) <= everything_stored
