"""kvshim's trace files (package trace: Arrow IPC files, one schema per
record kind) open with pyarrow.ipc and load into pandas."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

pa = pytest.importorskip(
    "pyarrow", reason="pyarrow is not in the test venv (python/requirements-test.txt does not list it yet)")
pd = pytest.importorskip("pandas", reason="pandas is not in the test venv")
import pyarrow.ipc  # noqa: E402, F401 - makes pa.ipc importable

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_trace_files_open_with_pyarrow_and_pandas(tmp_path):
    if shutil.which("go") is None:
        pytest.skip("go is not on PATH: the sample trace is written by `go test ./trace -run TestWriteSample`")
    env = dict(os.environ, KVSHIM_TRACE_SAMPLE_DIR=str(tmp_path))
    r = subprocess.run(["go", "test", "-count=1", "-run", "^TestWriteSample$", "./trace/"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(tmp_path.glob("*.arrow"))
    kinds = {}
    for f in files:
        with pa.ipc.open_file(f) as rd:
            table = rd.read_all()
        kind = table.schema.metadata[b"kvshim.trace.kind"].decode()
        kinds[kind] = table.to_pandas()
    assert set(kinds) == {"lookup", "load", "writer"}
    lk = kinds["lookup"]
    assert list(lk.columns[:10]) == ["mono_ns", "wall_ns", "source", "pid", "event", "request_id", "lookup_id",
                                     "owner", "namespace", "rank"]
    assert lk.loc[0, "event"] == "registered" and lk.loc[0, "matched"] == 3
    assert lk.loc[0, "l1_bitmap"] == bytes([0b0111])
    ld = kinds["load"]
    assert list(ld["chunk"]) == [0, 1, 2] and set(ld["result"]) == {"ok"}
    assert ld.groupby("request_id")["bytes"].sum()["req-A"] == 3072
    assert kinds["writer"].loc[0, "dropped"] == 0
