#!/usr/bin/env python3
"""Reads build/stepprof's KVPROF_DIR (the *.jsonl of every vLLM process) and
a client.json of [t0_ns, t1_ns] request windows (time.monotonic_ns() around
each timed request, one request at a time), and prints per configuration the
median time from add_request to the start of the step that computes the
request, the steps in a window and the median time of each call.

Usage: report.py DIR...   (each DIR: one server's KVPROF_DIR with client.json)"""

from __future__ import annotations

import collections
import glob
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load(d: Path) -> list[dict[str, Any]]:
    evs: list[dict[str, Any]] = []
    for f in glob.glob(str(d / "*.jsonl")):
        with open(f) as fh:
            evs += [json.loads(line) for line in fh]
    return evs


def report(d: Path) -> None:
    evs = load(d)
    windows = json.loads((d / "client.json").read_text())
    adds = {e["rid"]: e["t0"] for e in evs if e["ev"] == "add"}
    pre: list[float] = []
    steps: list[int] = []
    fwd: list[float] = []  # the computing step's execute_model
    out: list[float] = []  # add -> the end of the computing step's update_from_output
    for t0, t1 in windows:
        rid = next((r for r, t in adds.items() if t0 <= t <= t1), None)
        if rid is None:
            continue
        sched = [e for e in evs if e["ev"] == "schedule" and e["new"].get(rid, [0, 0])[1] > 0]
        if sched:
            pre.append((sched[0]["t0"] - adds[rid]) / 1e6)
            ex = min((e for e in evs if e["ev"] == "execute" and e["t0"] >= sched[0]["t1"]), key=lambda e: e["t0"],
                     default=None)
            up = min((e for e in evs if e["ev"] == "update" and e["t0"] >= sched[0]["t1"]), key=lambda e: e["t0"],
                     default=None)
            if ex is not None:
                fwd.append((ex["t1"] - ex["t0"]) / 1e6)
            if up is not None:
                out.append((up["t1"] - adds[rid]) / 1e6)
        steps.append(sum(1 for e in evs if e["ev"] == "step" and t0 <= e["t0"] and e["t1"] <= t1))
    calls: dict[str, list[float]] = collections.defaultdict(list)
    for e in evs:
        if "t1" in e:
            calls[e["ev"]].append((e["t1"] - e["t0"]) / 1e3)
    print(f"== {d.name}: {len(windows)} requests")
    if pre:
        print(f"  add -> step that computes it: median {statistics.median(pre):.2f} ms "
              f"[{', '.join(f'{x:.1f}' for x in sorted(pre))}]")
    if fwd:
        print(f"  the computing step's execute_model: median {statistics.median(fwd):.2f} ms")
    if out:
        print(f"  add -> that step's output: median {statistics.median(out):.2f} ms")
    if steps:
        print(f"  engine steps in a request's window: median {statistics.median(steps)}")
    for k in sorted(calls):
        print(f"  {k:40s} median {statistics.median(calls[k]):9.1f} us  n {len(calls[k])}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        report(Path(arg))
