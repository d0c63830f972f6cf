"""Step-level timing of vLLM's engine core and worker, for finding where a
hit's TTFT goes (docs/e2e.md, "Where a hit's time goes"). Not part of any
test or benchmark: put this directory first on PYTHONPATH of `vllm serve`
and set KVPROF_DIR; every process then appends JSON lines to
KVPROF_DIR/<pid>.jsonl: EngineCore.add_request/step, Scheduler.schedule/
update_from_output, the model runner's execute_model, every KVShimConnector
(and LMCacheMPConnector) call and the native worker calls, each with t0/t1
from CLOCK_MONOTONIC (comparable across processes). Modules are patched as
they are imported (a meta-path hook), so nothing is imported early.
Without KVPROF_DIR it does nothing. build/stepprof/report.py reads it."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_DIR = os.environ.get("KVPROF_DIR")
_out = None


def emit(**kv):
    global _out
    if _out is None or getattr(_out, "_pid", None) != os.getpid():
        _out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)
        _out._pid = os.getpid()
    kv["pid"] = os.getpid()
    _out.write(json.dumps(kv) + "\n")


now = time.monotonic_ns


def timed(cls, name, tag, extra=None):
    orig = getattr(cls, name, None)
    if orig is None or getattr(orig, "_kvprof", False):
        return

    def wrapper(self, *a, **k):
        t0 = now()
        r = orig(self, *a, **k)
        t1 = now()
        ev = {"ev": tag, "t0": t0, "t1": t1}
        if extra is not None:
            try:
                ev.update(extra(self, a, k, r))
            except Exception as e:  # noqa: BLE001
                ev["extra_error"] = repr(e)
        emit(**ev)
        return r

    wrapper._kvprof = True
    setattr(cls, name, wrapper)


def patch_core(m):
    EC = m.EngineCore

    def add_extra(self, a, k, r):
        req = a[0] if a else k.get("request")
        return {"rid": getattr(req, "request_id", None)}

    timed(EC, "add_request", "add", add_extra)
    timed(EC, "step", "step", lambda s, a, k, r: {"executed": bool(r[1])})
    timed(EC, "_process_engine_step", "engine_step")


def patch_sched(m):
    S = m.Scheduler

    def sched_extra(self, a, k, r):
        return {"tokens": r.total_num_scheduled_tokens,
                "new": {x.req_id: [x.num_computed_tokens, r.num_scheduled_tokens.get(x.req_id, 0)]
                        for x in r.scheduled_new_reqs},
                "cached": list(r.scheduled_cached_reqs.req_ids),
                "waiting": len(self.waiting), "running": len(self.running)}

    timed(S, "schedule", "schedule", sched_extra)

    def upd_extra(self, a, k, r):
        mo = a[1]
        kc = getattr(mo, "kv_connector_output", None)
        return {"recving": sorted(getattr(kc, "finished_recving", None) or ()) if kc else [],
                "outs": sum(len(o.outputs) for o in r.values()) if r else 0}

    timed(S, "update_from_output", "update", upd_extra)


def patch_runner(m):
    for cname in dir(m):
        c = getattr(m, cname)
        if isinstance(c, type) and cname.endswith("ModelRunner") and "execute_model" in c.__dict__:
            timed(c, "execute_model", "execute",
                  lambda s, a, k, r: {"tokens": a[0].total_num_scheduled_tokens if a else None})
            if "sample_tokens" in c.__dict__:
                timed(c, "sample_tokens", "sample")


def patch_connector(m):
    C = m.KVShimConnector
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "request_finished_all_groups",
                 "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "wait_for_save",
                 "get_transfer_results", "get_kv_connector_stats", "clear_connector_metadata",
                 "get_block_ids_with_load_errors", "handle_preemptions", "build_connector_worker_meta"):
        extra = None
        if name == "get_num_new_matched_tokens":
            extra = lambda s, a, k, r: {"rid": a[0].request_id, "ret": list(r)}  # noqa: E731
        elif name == "get_transfer_results":
            extra = lambda s, a, k, r: {"recving": sorted(r.finished_recving)}  # noqa: E731
        timed(C, name, "c." + name, extra)
    timed(m.KVShimWorker, "_stream_event", "w._stream_event")


def patch_native(m):
    for name in ("start_saves", "poll", "stats", "take_latencies", "start_loads", "wait"):
        timed(m.Worker, name, "n." + name)


def patch_lmcache(m):
    C = getattr(m, "LMCacheMPConnector", None)
    if C is None:
        return
    for name in ("get_num_new_matched_tokens", "build_connector_meta", "start_load_kv", "wait_for_save",
                 "get_finished", "update_state_after_alloc", "wait_for_layer_load"):
        extra = None
        if name == "get_num_new_matched_tokens":
            extra = lambda s, a, k, r: {"rid": a[0].request_id, "ret": list(r)}  # noqa: E731
        timed(C, name, "c." + name, extra)


PATCHES = {
    "vllm.v1.engine.core": patch_core,
    "vllm.v1.core.sched.scheduler": patch_sched,
    "vllm.v1.worker.cpu_model_runner": patch_runner,
    "vllm.v1.worker.gpu_model_runner": patch_runner,
    "kvshim.vllm": patch_connector,
    "kvshim.native": patch_native,
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector": patch_lmcache,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.fn(module)
        except Exception as e:  # noqa: BLE001
            emit(ev="patch_error", mod=module.__name__, err=repr(e))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        fn = PATCHES.get(name)
        if fn is None:
            return None
        for f in sys.meta_path:
            if f is self:
                continue
            spec = getattr(f, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader, fn)
                return spec
        return None


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    sys.meta_path.insert(0, _Finder())
