"""What Python sends over the C ABI, and what it reads back, matches the one
schema of each JSON document (export/schema/*.json; Go's side of the same
check is export/schema_test.go).

A real scheduler and worker (tests/rig.py: embedded server, CPU cache) save
and restore a prefix, with KV events on, while every document crossing the
ABI is recorded at the binding's edge: the JSON arguments of the C functions
(kvshim_open's config, kvshim_worker_register's tensors, step_json, extras,
params, ids and the save reports) as native.py passes them to ctypes, and
the JSON results (poll, stats, step stats, hit sources, latencies, save
reports, events, kvshim_meta_json of every step's metadata) as native.py
reads them. The connector's configuration documents (kvshim_vllm_config,
kvshim_vllm_namespace, kvshim_vllm_tensors) are written by
python/kvshim/vllm from vLLM's own KV-cache spec classes, so that part
needs vLLM (skipped without it). Every schema file is checked by one of
the two.

The validator is the `jsonschema` package, already in the test venv as a
dependency of vLLM (pinned in tests/vllm/pip-freeze.txt), so adding this
test rebuilds no venv; `referencing` (its dependency) resolves the
schemas' references to each other (vllm_config.json -> vllm_namespace.json
-> vllm_tensors.json, open.json).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the venvs; its use here is small
import numpy as np
import pytest
from referencing import Registry, Resource

from kvshim import native
from kvshim.errors import InvalidArgumentError
from rig import BLOCK, CHUNK, HEAD, HEADS, LAYERS, Rig, fa_cache

SCHEMAS = Path(__file__).resolve().parent.parent / "export" / "schema"

# The C functions' JSON arguments: function -> (its argument's index, the schema).
INPUTS: dict[str, tuple[int, str]] = {
    "kvshim_open": (0, "open.json"),
    "kvshim_worker_register": (1, "tensors.json"),
    "kvshim_sched_build_meta": (1, "step.json"),
    "kvshim_sched_match": (4, "extras.json"),
    "kvshim_sched_match_list": (3, "extras.json"),
    "kvshim_sched_request_options": (2, "request_options.json"),
    "kvshim_sched_received": (1, "received.json"),
    "kvshim_sched_save_reports": (1, "save_reports.json#/$defs/step"),
    "kvshim_vllm_namespace": (0, "vllm_namespace.json"),
    "kvshim_vllm_config": (0, "vllm_config.json"),
    "kvshim_vllm_tensors": (0, "vllm_tensors.json"),
}
# The C functions' JSON results: function -> the schema.
OUTPUTS: dict[str, str] = {
    "kvshim_worker_poll": "poll.json",
    "kvshim_stats": "stats.json",
    "kvshim_take_step_stats": "step_stats.json",
    "kvshim_sched_hit_sources": "hit_sources.json",
    "kvshim_worker_take_latencies": "latencies.json",
    "kvshim_worker_take_save_reports": "save_reports.json",
    "kvshim_sched_take_events": "events.json",
    "kvshim_meta_json": "meta.json",
    "kvshim_vllm_namespace": "vllm_namespace.json#/$defs/out",
    "kvshim_vllm_config": "vllm_config.json#/$defs/out",
    "kvshim_vllm_tensors": "tensors.json",
}
# What each test records (every schema of INPUTS and OUTPUTS is in one).
VLLM_DOCS = {"vllm_namespace.json", "vllm_config.json", "vllm_tensors.json", "vllm_namespace.json#/$defs/out",
             "vllm_config.json#/$defs/out", "tensors.json"}
RIG_DOCS = ((set(OUTPUTS.values()) | {s for _, s in INPUTS.values()}) - VLLM_DOCS) | {"tensors.json"}  # the rig registers too


def _registry() -> Registry[Any]:
    """Every schema file under its file name: their references to each other resolve."""
    return Registry().with_resources(
        (p.name, Resource.from_contents(json.loads(p.read_text()))) for p in SCHEMAS.glob("*.json"))


def _validator(name: str) -> jsonschema.Draft202012Validator:
    """The validator of a schema file, or of one of its parts (file#pointer)."""
    file, _, pointer = name.partition("#")
    schema = json.loads((SCHEMAS / file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator({"$ref": name} if pointer else schema, registry=_registry())


class _Recorder:
    """Records the documents crossing the binding, by schema name, and the
    step metadata (binary) kvshim_sched_build_meta answered."""

    def __init__(self) -> None:
        self.docs: dict[str, list[Any]] = {}
        self.metas: list[bytes] = []

    def add(self, name: str, doc: Any) -> None:
        self.docs.setdefault(name, []).append(doc)

    def check(self, names: set[str]) -> None:
        """Each of names was recorded, and every recorded document matches its schema."""
        assert names <= set(self.docs), f"never recorded: {sorted(names - set(self.docs))}"
        for name, docs in self.docs.items():
            v = _validator(name)
            for doc in docs:
                errors = sorted(v.iter_errors(doc), key=str)
                assert not errors, f"{name}: {doc}: {[e.message for e in errors]}"


class _RecordingLibrary:
    """The loaded library with every JSON argument of INPUTS recorded on its way in."""

    def __init__(self, lib: Any, rec: _Recorder) -> None:
        self._lib, self._rec = lib, rec

    def __getattr__(self, name: str) -> Any:
        return _recording(getattr(self._lib, name), name, self._rec)


def _recording(fn: Any, name: str, rec: _Recorder) -> Any:
    if name not in INPUTS:
        return fn
    i, schema = INPUTS[name]

    def call(*args: Any) -> Any:
        if args[i] is not None:  # NULL: no document
            rec.add(schema, json.loads(args[i]))
        return fn(*args)

    return call


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    rec = _Recorder()
    lib = _RecordingLibrary(native.library(), rec)
    monkeypatch.setattr(native, "library", lambda: lib)
    py_function = native._py_function

    def recording_py_function(name: str, argtypes: list[Any]) -> Any:
        fn = py_function(name, argtypes)
        return None if fn is None else _recording(fn, name, rec)

    monkeypatch.setattr(native, "_py_function", recording_py_function)
    output = native.Handle.output

    def recording_output(self: native.Handle, fn_name: str, *args: object) -> bytes:
        out = output(self, fn_name, *args)
        if fn_name in OUTPUTS:
            rec.add(OUTPUTS[fn_name], json.loads(out))
        elif fn_name == "kvshim_sched_build_meta":
            rec.metas.append(out)
        return out

    monkeypatch.setattr(native.Handle, "output", recording_output)
    lib_output = native._lib_output

    def recording_lib_output(fn_name: str, *args: Any) -> bytes:
        out = lib_output(fn_name, *args)
        rec.add(OUTPUTS[fn_name], json.loads(out))
        return out

    monkeypatch.setattr(native, "_lib_output", recording_lib_output)
    yield rec


def _until(what: str, get: Callable[[], Any]) -> Any:
    """get()'s first answer that is not None (a pending lookup, an event not yet made)."""
    for _ in range(2000):
        v = get()
        if v is not None:
            return v
        time.sleep(0.002)
    raise AssertionError(f"{what}: no answer in time")


def test_every_schema_is_checked() -> None:
    names = {s.partition("#")[0] for s in RIG_DOCS | VLLM_DOCS}
    assert names == {p.name for p in SCHEMAS.glob("*.json")}


def test_documents_crossing_the_abi_match_their_schemas(recorded: _Recorder) -> None:
    tokens = np.arange(2 * CHUNK, dtype=np.uint32)
    extras = {"cache_salt": "tenant", "lora": {"name": "sql", "path": "/adapters/sql"},
              "mm": [{"hash": "img-0", "offset": 4, "length": 8}]}
    with Rig("schema-rig", fa_cache(), l2=[]) as rig:
        s, w = rig.sched, rig.worker
        assert s.take_events()["events"] == []  # the first calls start recording
        assert w.take_save_reports() == b"[]"
        rig.save("a", tokens, [1, 2, 3, 4])
        s.save_reports([w.take_save_reports(), b"[]"])  # every rank's reports (an empty one among them)
        ev = _until("stored event", lambda: next((e for e in s.take_events()["events"] if e["kind"] == "stored"), None))
        assert ev["req"] == "a", ev

        s.request_options("b", {"kvshim.skip_save": True, "another_connectors_key": 1})
        n = rig.match("b", tokens)
        assert n == 2 * CHUNK - 1  # the last token is always computed (vLLM's rule)
        rig.alloc("b", [5, 6, 7, 8], n)
        assert s.hit_sources("b", n) == {"host": n}
        assert rig.drain("b", "recving").error_blocks == []
        rig.step([{"req": "b", "new_blocks": [9], "computed": 2 * CHUNK, "scheduled": 1,  # a decode step
                   "tokens": [int(t) for t in tokens], "tokens_from": 0}], saves=False)
        s.received(["b"])
        rig.finished("b")

        for req, match in (("c", s.match), ("d", s.match_list)):
            _until(f"match {req}", functools.partial(match, req, list(range(CHUNK)), extras))
            s.finished(req)
        s.build_meta({"requests": [], "preempted": ["b"]})
        s.reset()
        assert any(e["kind"] == "cleared" for e in s.take_events()["events"])

        # a load ended (its latency is kept as its job ends, just after poll reported it) ...
        _until("a load's latency", lambda: w.take_latencies()["load"] or None)
        assert w.take_latencies()["load"] is None  # ... and none since
        s.take_step_stats()
        w.take_step_stats()
        rig.stats()
        w.stats()
    for meta in recorded.metas:
        native.meta_json(meta)
    roles = [d["role"] for d in recorded.docs["open.json"]]
    assert roles == ["scheduler", "worker"], roles
    recorded.check(RIG_DOCS)
    # both shapes of the stats result were seen, and metadata with loads and saves
    assert any("requests" in d for d in recorded.docs["stats.json"])
    assert any("worker" in d for d in recorded.docs["stats.json"])
    assert any("loads" in d for d in recorded.docs["meta.json"])
    assert any("saves" in d for d in recorded.docs["meta.json"])


def test_vllm_configuration_documents_match_their_schemas(recorded: _Recorder) -> None:
    """The connector's own code (python/kvshim/vllm) writes the configuration
    documents from vLLM's KV-cache spec classes; the namespace export is
    asked with the spec the config carries."""
    torch = pytest.importorskip("torch")
    config = pytest.importorskip("kvshim.vllm.config")
    worker = pytest.importorskip("kvshim.vllm.worker")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        layers, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16))])
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="t", revision=None, use_mla=False),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=BLOCK, kv_cache_layout=None, mamba_cache_mode="none"),
        parallel_config=SimpleNamespace(world_size=1, tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        speculative_config=None,
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"kvshim.chunk_size": CHUNK}, engine_id="e",
                                           kv_role="kv_both"))
    config.read_config({"kvshim": {"l1_size_gb": 1}})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        out = config.connector_config(vllm_config, kvc, role)
        assert out["open"]["namespace"]["chunk_size"] == CHUNK
    spec = recorded.docs["vllm_config.json"][-1]["vllm"]
    assert native.vllm_namespace({**spec, "chunk_size": CHUNK})["chunk_size"] == CHUNK
    kv = {name: torch.zeros(2, 8, BLOCK, HEADS, HEAD, dtype=torch.float16) for name in layers}
    descs = native.vllm_tensors({"block_size": BLOCK, "groups": config.kv_groups(kvc),
                                 "tensors": [worker._raw(name, t) for name, t in kv.items()]})
    assert [d["layer"] for d in descs] == layers
    recorded.check(VLLM_DOCS)


@pytest.mark.parametrize("doc", [
    {"role": "scheduler", "l1_size_gb": -1},
    {"role": "scheduler", "hold_ttl_s": -1},
    {"role": "worker", "rank": 0, "namespace": {"chunk_size": "256"}},
    {"role": "worker", "unknown_key": 1},
])
def test_open_schema_refuses_what_the_library_refuses(doc: dict[str, Any]) -> None:
    """The schema is strict where Go is: a bad config fails both, so the
    schema is a real statement of the contract, not a loose description."""
    assert list(_validator("open.json").iter_errors(doc))
    with pytest.raises(InvalidArgumentError):
        native.Handle(json.dumps({"server": "/nonexistent/kvshim.sock", **doc}))


@pytest.mark.parametrize("name, doc", [
    ("step.json", {"requests": [{"req": "a", "group_blocks": [[1]]}]}),
    ("extras.json", {"lora": "sql:/adapters/sql"}),
    ("request_options.json", {"kvshim.skip_save": "yes"}),
    ("received.json", {"ids": ["a"]}),
    ("save_reports.json#/$defs/step", [[{"r": "a", "g": 0, "k": 0, "h": "0" * 64, "ok": True, "extra": 1}]]),
    ("vllm_namespace.json", {"model": "t", "no_such_key": 1}),
])
def test_input_schemas_refuse_what_the_library_refuses(name: str, doc: Any) -> None:
    """The same for the other documents Python sends."""
    assert list(_validator(name).iter_errors(doc))
    with pytest.raises(InvalidArgumentError):
        if name.startswith("vllm_namespace"):
            native.vllm_namespace(doc)
            return
        with Rig("schema-refuse", fa_cache(), l2=[]) as rig:
            s = rig.sched
            {"step.json": lambda: s.build_meta(doc),
             "extras.json": lambda: s.match("a", list(range(CHUNK)), doc),
             "request_options.json": lambda: s.request_options("a", doc),
             "received.json": lambda: library_call("kvshim_sched_received", s, doc),
             "save_reports.json#/$defs/step": lambda: library_call("kvshim_sched_save_reports", s, doc),
             }[name]()


def library_call(fn_name: str, s: native.Scheduler, doc: Any) -> None:
    """A scheduler export taking one JSON document, given doc as it is (the
    typed binding would not send a bad one)."""
    s.handle.check(getattr(native.library(), fn_name)(s.handle.value, json.dumps(doc).encode()))
