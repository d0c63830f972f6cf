"""Ranks in spawned processes (test_tp_large.py, test_hma_tp.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from .scheduler import SchedulerHarness


class Proc:
    """A spawned process hosting several ranks (kvshim_tp_worker.serve)."""

    def __init__(self, ctx: Any, i: int) -> None:
        import kvshim_tp_worker

        self.i = i
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=kvshim_tp_worker.serve, args=(child,), name=f"kvshim-ranks-{i}", daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout: float = 60) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"process {self.i}: no answer in {timeout}s")
        status, res = self.conn.recv()
        if status not in ("ok", "ready"):
            raise AssertionError(f"process {self.i}: {res}")
        return res

    def call(self, cmd: str, *args: Any, timeout: float = 60) -> Any:
        self.conn.send((cmd, args))
        return self.recv(timeout)

    def close(self) -> None:
        import contextlib

        if self.proc.is_alive():
            with contextlib.suppress(Exception):  # killed below
                self.call("close", timeout=15)
        self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class Ranks:
    """The scheduler's handle on every rank: execute fans the scheduler
    output out to every process at once and gathers their outputs (ranks
    split evenly over the processes, in order)."""

    def __init__(self, procs: Sequence[Proc], world: int) -> None:
        self.procs = list(procs)
        self.world = world
        self.owner = {rk: self.procs[rk * len(self.procs) // world] for rk in range(world)}

    def setup(self, model_dir: str | os.PathLike[str], engine_id: str, par: dict[str, Any], num_blocks: int,
              cfg_kw: dict[str, Any]) -> None:
        """Every process makes its ranks' runners (kvshim_tp_worker.serve)."""
        for p in self.procs:
            mine = [rk for rk in range(self.world) if self.owner[rk] is p]
            p.conn.send(("setup", (str(model_dir), engine_id, mine, par, num_blocks, cfg_kw)))
        for p in self.procs:
            p.recv(timeout=120)

    def execute_all(self, so: SchedulerOutput) -> list[KVConnectorOutput]:
        for p in self.procs:
            p.conn.send(("execute", (so,)))
        outs: list[KVConnectorOutput] = []
        for p in self.procs:
            outs += p.recv()
        return outs

    def call(self, rank: int, sub: str, *args: Any) -> Any:
        return self.owner[rank].call("rank", rank, sub, *args)

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Until no rank has a copy left: saves committed and counted (a
        worker counts a save once its COMMIT is answered, just after the
        server counted the commit), loads reported."""
        import time

        deadline = time.monotonic() + timeout
        for rk in range(self.world):
            while self.call(rk, "stats")["jobs"]:
                assert time.monotonic() < deadline, f"rank {rk}: jobs still running after {timeout}s"
                time.sleep(0.005)


class WorldHarness(SchedulerHarness):
    """SchedulerHarness whose runners are the remote ranks (their connector
    outputs combined by vLLM's KVOutputAggregator over the whole world)."""

    def __init__(self, cfg: VllmConfig, kvc: KVCacheConfig, ranks: Ranks) -> None:
        super().__init__(cfg, kvc)
        self.ranks = ranks
        self.runners = [ranks]  # non-empty: execute() goes to runners_step
        self._aggregator = KVOutputAggregator(ranks.world)

    def wait_workers(self, timeout_s: float = 5.0) -> None:
        self.ranks.wait_idle(timeout_s)

    def runners_step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        outs = self.ranks.execute_all(scheduler_output)
        mros: list[ModelRunnerOutput | None] = [self.model_runner_output(scheduler_output, kv_connector_output=o) for o in outs]
        assert self._aggregator is not None
        agg = self._aggregator.aggregate(mros)
        assert agg is not None and agg.kv_connector_output is not None
        return agg.kv_connector_output

    def close(self) -> None:
        self.runners = []
        super().close()
