#!/usr/bin/env python3
"""Runs the step timing of docs/e2e.md ("Where a hit's time goes"): one
`vllm serve` (the CPU build, tests/e2e's tiny Llama) per configuration, all
up at once (an idle server costs next to nothing) with this directory's
sitecustomize hook on, driven one request at a time and interleaved: each
round sends every configuration, in a rotating order, a 3,072-token
token-id prefix + 64 tokens (computed and saved), then the same prefix with
another suffix (the hit, max_tokens 1, timed). Prints report.py's figures
per configuration, then the client's hit latency (p50, and the paired
ratio to the first configuration's hit in the same round).

Usage (under python/requirements-e2e.txt's venv, KVSHIM_LIBRARY set):
  drive.py [--hits N] [--only prefix_cache,kvshim,...] [--keep]"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "tests" / "e2e"))

from harness import Processes, kvshim_config, prompt_ids, warm_up  # noqa: E402
from tiny_model import model_dir  # noqa: E402

CONFIGS = {
    "prefix_cache": {"prefix_caching": True},
    "kvshim": {"kv": kvshim_config()},
    "kvshim_sync_load": {"kv": kvshim_config(sync_load=True)},
    "kvshim_layerwise": {"kv": kvshim_config(layerwise=True)},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hits", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvshim-stepprof-"))
    procs = Processes(work, model_dir())
    dirs = {n: work / n for n in names}
    lat: dict[str, list[float]] = {n: [] for n in names}
    try:
        servers = {}
        for n in names:
            dirs[n].mkdir()
            env = {"KVPROF_DIR": str(dirs[n]), "PYTHONPATH": f"{HERE}{os.pathsep}{procs.base_env()['PYTHONPATH']}"}
            servers[n] = procs.start_vllm(n, env=env, wait=False, **CONFIGS[n])  # type: ignore[arg-type]
        for s in servers.values():
            s.wait_ready()
            warm_up(s, prompt_ids(3072 + 8, seed=999))
        windows: dict[str, list[list[int]]] = {n: [] for n in names}
        for i in range(args.hits):
            prefix = prompt_ids(3072, seed=1000 + i)
            for n in names[i % len(names):] + names[:i % len(names)]:
                s = servers[n]
                s.complete(prefix + prompt_ids(64, seed=2000 + i), max_tokens=1)
                time.sleep(0.2)  # the first request's saves end
                t0 = time.monotonic_ns()
                s.complete(prefix + prompt_ids(64, seed=3000 + i), max_tokens=1)
                windows[n].append([t0, time.monotonic_ns()])
                lat[n].append((windows[n][-1][1] - t0) / 1e6)
        for n in names:
            (dirs[n] / "client.json").write_text(json.dumps(windows[n]))
    finally:
        procs.close()
        shutil.rmtree(procs.runtime_dir, ignore_errors=True)
    rc = subprocess.call([sys.executable, str(HERE / "report.py"), *map(str, dirs.values())])
    base = lat[names[0]]
    for n in names:
        paired = statistics.median(x / b for x, b in zip(lat[n], base))
        print(f"== {n}: hit p50 {statistics.median(lat[n]):.1f} ms (client), paired ratio to {names[0]} {paired:.3f}")
    if args.keep:
        print(f"work directory: {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
