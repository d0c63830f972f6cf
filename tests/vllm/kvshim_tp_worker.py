"""One TP rank's model runner in its own process (started with
multiprocessing "spawn" by test_tp.py): it loads libkvshim.so itself, builds
its own VllmConfig for its rank, registers its own CPU KV tensors (standing in
for GPU memory) with a WORKER-role KVShimConnector made by vLLM's factory, and
executes the SchedulerOutputs the scheduler process sends it (pickled, as
vLLM's multiproc executor sends them to its workers)."""

from __future__ import annotations

import os
import traceback
from typing import Any


def main(conn: Any, model_dir: str, engine_id: str, rank: int, tp: int, num_blocks: int, cfg_kw: dict) -> None:
    try:
        from harness import NUM_KV_HEADS, ModelRunner, kvshim_config, make_kv_cache_config

        cfg = kvshim_config(model_dir, tensor_parallel_size=tp, rank=rank, engine_id=engine_id, **cfg_kw)
        assert cfg.parallel_config.rank == rank
        kvc = make_kv_cache_config(num_blocks=num_blocks, num_kv_heads=NUM_KV_HEADS // tp)
        runner = ModelRunner(cfg, kvc, rank=rank)
        conn.send(("ready", os.getpid()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "execute":
                res: Any = runner.execute(*args)
            elif cmd == "check_blocks":
                res = runner.check_blocks(*args)
            elif cmd == "blocks":
                res = list(runner.reqs[args[0]].blocks)
            elif cmd == "scribble":
                res = runner.scribble()
            elif cmd == "skip_save_in":
                # Drop this rank's saves in its n-th step from now (a save
                # lost on one rank only).
                runner.skip_save_steps.add(runner.step_no + args[0])
                res = None
            elif cmd == "stats":
                res = runner.connector.stats()
            elif cmd == "close":
                runner.close()
                conn.send(("ok", None))
                conn.close()
                os._exit(0)  # skip torch/vLLM interpreter teardown (seconds)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", res))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))
