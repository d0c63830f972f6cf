"""What Python sends over the C ABI, and what it reads back, matches the one
schema of each JSON document (export/schema/*.json; Go's side of the same
check is export/schema_test.go).

A real scheduler and worker (tests/rig.py: embedded server, CPU cache) save
and restore a prefix while every document crossing the ABI is recorded at
the binding's edge: the kvshim_open configs, the kvshim_worker_register
tensors, and the kvshim_worker_poll and kvshim_stats results.

The validator is the `jsonschema` package, already in the test venv as a
dependency of vLLM (pinned in tests/vllm/pip-freeze.txt), so adding this
test rebuilds no venv.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the venvs; its use here is small
import numpy as np
import pytest

from kvshim import native
from kvshim.errors import InvalidArgumentError
from rig import CHUNK, Rig, fa_cache

SCHEMAS = Path(__file__).resolve().parent.parent / "export" / "schema"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


class _Recorder:
    """Records the documents crossing the binding, by schema name."""

    def __init__(self) -> None:
        self.docs: dict[str, list[Any]] = {"open.json": [], "tensors.json": [], "poll.json": [], "stats.json": []}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    outputs = {"kvshim_worker_poll": "poll.json", "kvshim_stats": "stats.json"}

    class RecordingHandle(native.Handle):
        def __init__(self, config: str) -> None:
            rec.docs["open.json"].append(json.loads(config))
            super().__init__(config)

        def output(self, fn_name: str, *args: object) -> bytes:
            out = super().output(fn_name, *args)
            if fn_name in outputs:
                rec.docs[outputs[fn_name]].append(json.loads(out))
            return out

    register = native.Worker.register

    def recording_register(self: native.Worker, tensors: list[dict[str, Any]]) -> None:
        rec.docs["tensors.json"].append(json.loads(json.dumps(tensors)))  # as the binding serialises them
        register(self, tensors)

    monkeypatch.setattr(native, "Handle", RecordingHandle)
    monkeypatch.setattr(native.Worker, "register", recording_register)
    return rec


def test_documents_crossing_the_abi_match_their_schemas(recorded: _Recorder) -> None:
    tokens = np.arange(2 * CHUNK, dtype=np.uint32)
    with Rig("schema-rig", fa_cache(), l2=[]) as rig:
        rig.save("a", tokens, [1, 2, 3, 4])
        n, failed = rig.restore("b", tokens, [5, 6, 7, 8])
        assert (n, failed) == (2 * CHUNK - 1, [])  # the last token is always computed (vLLM's rule)
        rig.stats()
        rig.worker.stats()
    roles = [d["role"] for d in recorded.docs["open.json"]]
    assert roles == ["scheduler", "worker"], roles
    for name, docs in recorded.docs.items():
        assert docs, f"no {name} document recorded"
        v = _validator(name)
        for doc in docs:
            errors = sorted(v.iter_errors(doc), key=str)
            assert not errors, f"{name}: {doc}: {[e.message for e in errors]}"
    # both shapes of the stats result were seen
    assert any("requests" in d for d in recorded.docs["stats.json"])
    assert any("worker" in d for d in recorded.docs["stats.json"])


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
