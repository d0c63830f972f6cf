"""TP ranks' model runners in a process of their own (started with
multiprocessing "spawn" by harness.Proc; serve is its command loop): the
process loads libkvshim.so itself, each rank builds its own VllmConfig,
registers its own CPU KV tensors (standing in for GPU memory) with a
WORKER-role KVShimConnector made by vLLM's factory, and executes the
SchedulerOutputs the scheduler process sends (pickled, as vLLM's multiproc
executor sends them to its workers)."""

from __future__ import annotations

import os
import traceback
from typing import Any


def rank_command(runner: Any, cmd: str, args: Any) -> Any:
    """One rank's command: check_blocks, blocks, scribble,
    skip_save_in, drop_group_saves_in, stats, attr."""
    if cmd == "check_blocks":
        return runner.check_blocks(*args)
    if cmd == "blocks":
        return list(runner.reqs[args[0]].blocks)
    if cmd == "scribble":
        runner.scribble()
        return None
    if cmd == "skip_save_in":
        # Drop this rank's saves in its n-th step from now (a save lost on
        # one rank only).
        runner.skip_save_steps.add(runner.step_no + args[0])
        return None
    if cmd == "drop_group_saves_in":
        # Drop this rank's saves of the KV-cache groups args[1] in its n-th
        # step from now (harness.HybridModelRunner: one group's object lost
        # on one rank only).
        runner.drop_saves[runner.step_no + args[0]] = set(args[1])
        return None
    if cmd == "stats":
        st = runner.kvshim.worker.stats()
        return {"worker": st.counters, "jobs": st.jobs}  # as kvshim_stats reports them
    if cmd == "attr":
        return getattr(runner, args[0])
    raise ValueError(f"unknown command {cmd!r}")


# ---- the ranks of a process (serve: test_tp.py runs one a process,
# test_tp_large.py several) ----------------------------------------------------
#
# TP=8 as eight spawned processes would import torch and vLLM eight times
# (about 8 s of CPU each): too much for a 2-core machine. A process here
# hosts several ranks instead, each with everything a rank has in vLLM: its
# own VllmConfig (parallel_config.rank = its global rank), its own
# KVCacheConfig (a pipeline stage lists only its own layers, as
# get_kv_cache_configs makes them), its own KV tensors from vLLM's
# allocate_kv_cache and its own WORKER-role KVShimConnector (its own server
# session and writer). Only the interpreter is shared.


def stage_layers(total_layers: int, rank: int, tp: int, pp: int) -> list[str]:
    """The attention layers of rank's pipeline stage, as vLLM splits them
    (vllm.distributed.utils.get_pp_indices; the stage is rank // TP, as in
    ModelConfig.get_layers_start_end_indices)."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(total_layers, (rank // tp) % pp, pp)
    return [f"model.layers.{i}.self_attn.attn" for i in range(start, end)]


def stage_kv_cache_config(num_blocks: int, names: list[str], num_kv_heads: int, block_size: int = 16,
                          mla_head_size: int = 0) -> Any:
    """One full-attention group over one stage's layers (MLA: one latent
    of mla_head_size elements a token, vLLM's MLAAttentionSpec)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    from harness import HEAD_SIZE

    spec: FullAttentionSpec
    if mla_head_size:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=mla_head_size, dtype=torch.float16)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=HEAD_SIZE, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def make_rank_runner(model_dir: str, engine_id: str, rank: int, par: dict[str, Any], num_blocks: int, cfg_kw: dict[str, Any]) -> Any:
    """One rank's ModelRunner (harness.ModelRunner, or harness-compatible
    ``runner_cls`` named by "module:Class" in par). A hybrid model
    (par["hybrid"]: its layers' (kind, window), harness.hybrid_layer_specs)
    gets a harness.HybridModelRunner over vLLM's KV-cache groups of its
    layers, each with this rank's share of the KV heads."""
    import importlib
    import json
    from pathlib import Path

    from harness import NUM_KV_HEADS, HybridModelRunner, ModelRunner, hybrid_kv_cache_config, hybrid_layer_specs, kvshim_config

    tp, pp, dcp = par.get("tp", 1), par.get("pp", 1), par.get("dcp", 1)
    cfg = kvshim_config(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        decode_context_parallel_size=dcp, rank=rank, engine_id=engine_id, **cfg_kw)
    assert cfg.parallel_config.rank == rank and cfg.parallel_config.world_size == tp * pp
    if par.get("hybrid"):
        specs = hybrid_layer_specs(par["hybrid"], num_kv_heads=max(1, NUM_KV_HEADS // tp))
        return HybridModelRunner(cfg, hybrid_kv_cache_config(cfg, specs, num_blocks), rank=rank)
    total = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    heads = par.get("kv_heads") or max(1, NUM_KV_HEADS // tp)
    mla = cfg.model_config.use_mla
    kvc = stage_kv_cache_config(num_blocks, stage_layers(total, rank, tp, pp), heads,
                                mla_head_size=cfg.model_config.get_head_size() if mla else 0)
    cls = ModelRunner
    if par.get("runner_cls"):
        mod, name = par["runner_cls"].split(":")
        cls = getattr(importlib.import_module(mod), name)
    runner = cls(cfg, kvc, rank=rank)
    if mla:
        # MLA's latent KV is the same on every TP rank: a rank-independent
        # "model" whose (K|V) content is the latent's elements.
        from harness import KVModel

        runner.model = KVModel(len(runner.layer_names), 1, cfg.model_config.get_head_size() // 2, 0)
    return runner


def serve(conn: Any) -> None:
    """Commands: ("setup", (model_dir, engine_id, ranks, par, num_blocks,
    cfg_kw)) makes one runner per rank; ("execute", (scheduler_output,))
    returns their KVConnectorOutputs in rank order; ("rank", (rank, cmd,
    *args)) runs a per-rank command (check_blocks, blocks, scribble,
    skip_save_in, stats); ("teardown", ()) closes the runners; ("close",
    ()) exits."""
    runners: dict[int, Any] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "setup":
                model_dir, engine_id, ranks, par, num_blocks, cfg_kw = args
                for rk in ranks:
                    runners[rk] = make_rank_runner(model_dir, engine_id, rk, par, num_blocks, cfg_kw)
                res: Any = sorted(runners)
            elif cmd == "execute":
                res = [runners[rk].execute(*args) for rk in sorted(runners)]
            elif cmd == "rank":
                rk, sub, *rest = args
                res = rank_command(runners[rk], sub, rest)
            elif cmd == "teardown":
                for r in runners.values():
                    r.close()
                runners.clear()
                res = None
            elif cmd == "close":
                for r in runners.values():
                    r.close()
                conn.send(("ok", None))
                conn.close()
                os._exit(0)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", res))
        except BaseException as e:
            conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))


def _dcp_runner_cls() -> Any:
    """harness.ModelRunner for a rank under decode context parallelism:
    vLLM's scheduler blocks are DCP times this rank's blocks, and this rank
    holds the tokens whose slot vLLM maps to it. The mapping is vLLM's
    (v1/worker/block_table.py, the slot-mapping kernel of BlockTable):
    position p of scheduler block p // (B*D), offset o = p % (B*D), is on
    DCP rank (o // I) % D at slot (o // (D*I)) * I + o % I of the rank's
    block (B: the rank's block size, D: DCP size, I:
    cp_kv_cache_interleave_size). The DCP rank is tp_rank % D (vLLM's DCP
    groups are consecutive TP ranks: parallel_state.py, "DCP spans PCP
    first, then TP")."""
    import torch

    from harness import KVModel, ModelRunner

    class DCPRunner(ModelRunner):
        def __init__(self, vllm_config: Any, kv_cache_config: Any, **kw: Any) -> None:
            super().__init__(vllm_config, kv_cache_config, **kw)
            pc = vllm_config.parallel_config
            self.dcp = pc.decode_context_parallel_size
            self.dcp_rank = (self.rank % pc.tensor_parallel_size) % self.dcp
            self.interleave = pc.cp_kv_cache_interleave_size
            self.vblock = self.block_size * self.dcp

        def _local(self, p: int) -> int | None:
            """This rank's slot of position p in its scheduler block, or None."""
            o, d, i = p % self.vblock, self.dcp, self.interleave
            if (o // i) % d != self.dcp_rank:
                return None
            slot: int = (o // (d * i)) * i + o % i
            return slot

        def _forward(self, work: list[tuple[str, int, int]]) -> None:
            for rid, start, n in work:
                r = self.reqs[rid]
                end = start + n
                while len(r.tokens) < end:
                    r.tokens.append(self.sampled_token)
                    r.hashes = KVModel.prefix_hashes(r.tokens)
                pos = [p for p in range(start, end) if self._local(p) is not None]
                if not pos:
                    continue
                blocks = torch.tensor([r.blocks[p // self.vblock] for p in pos], dtype=torch.long)
                slots = torch.tensor([self._local(p) for p in pos], dtype=torch.long)
                for li, name in enumerate(self.layer_names):
                    kv = self._content(self.model.kv([r.hashes[p] for p in pos], li))
                    self.kv_caches[name].view(torch.int16)[blocks, :, slots] = kv

        def expected_block(self, tokens: Any, block_index: int) -> torch.Tensor:
            base = block_index * self.vblock
            pos = [base + p for p in range(self.vblock) if self._local(base + p) is not None]
            assert len(pos) == self.block_size and pos[-1] < len(tokens), "block beyond the tokens"
            hs = KVModel.prefix_hashes(tokens[: pos[-1] + 1])
            hs = [hs[p] for p in sorted(pos, key=lambda p: self._local(p) or 0)]  # slot order (every p has one)
            return torch.stack([self._content(self.model.kv(hs, i)).transpose(0, 1) for i in range(len(self.layer_names))])

        def _check_prefix(self, rid: str, num_computed: int) -> None:
            n = num_computed // self.vblock
            if n:
                r = self.reqs[rid]
                self.prefix_checks[rid] = (num_computed, self.check_blocks(r.tokens, r.blocks[:n]))

    return DCPRunner


def __getattr__(name: str) -> Any:  # DCPRunner, made on first use (imports torch and vLLM)
    if name == "DCPRunner":
        return _dcp_runner_cls()
    raise AttributeError(name)
