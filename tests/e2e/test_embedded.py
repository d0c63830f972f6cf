"""The embedded default (the server inside vLLM's engine core) under real
`vllm serve`: a restart loses the cache (it lived in that process), and
leaves no socket and no shared memory behind, with vLLM's default
`--shutdown-timeout 0` (engine core SIGKILLed, the connector's shutdown never
runs: the next embedded server removes the dead one's socket) and with a
shutdown timeout (the connector closes its server).
"""

from __future__ import annotations

import os
from pathlib import Path

from harness import Processes, kvshim_config, prompt_ids, warm_up

CHUNK = 256


def _sockets(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("embedded-"))


def _shm() -> set[str]:
    # L1 is memfd (nothing in /dev/shm); its fallback is an unlinked
    # /dev/shm file. Either way no name may stay.
    return {n for n in os.listdir("/dev/shm") if "kvshim" in n.lower()}


def test_a_restart_loses_the_cache_and_leaves_no_socket_or_shared_memory(procs: Processes) -> None:
    shm0 = _shm()
    prefix = prompt_ids(CHUNK * 3, seed=11)
    # vLLM's default shutdown: engine core SIGKILLed.
    first = procs.start_vllm("vllm-embedded-1", kv=kvshim_config(), args=["--shutdown-timeout", "0"])
    warm_up(first, prompt_ids(CHUNK + 8, seed=997))
    first.complete(prefix + prompt_ids(10, seed=12), max_tokens=2)
    h0 = first.external_hits()
    first.complete(prefix + prompt_ids(10, seed=13), max_tokens=2)
    assert first.external_hits() - h0 == len(prefix), "no hit within one engine's life"
    live = _sockets(procs.socket_dir)
    assert len(live) == 1, live
    first.stop()
    leftover = _sockets(procs.socket_dir)  # the SIGKILLed server's, usually

    second = procs.start_vllm("vllm-embedded-2", kv=kvshim_config())  # --shutdown-timeout 10
    now = _sockets(procs.socket_dir)
    assert len(now) == 1 and now[0] not in leftover, (
        f"the dead server's socket was not removed at the next start: before {leftover}, now {now}")
    h0 = second.external_hits()
    second.complete(prefix + prompt_ids(10, seed=14), max_tokens=2)
    assert second.external_hits() - h0 == 0, "the embedded cache survived a restart of its engine"
    second.stop()
    assert second.popen.returncode is not None
    left = _sockets(procs.socket_dir)
    assert left == [], f"a clean shutdown left {left}"
    assert _shm() <= shm0, f"shared memory left behind: {_shm() - shm0}"
