#!/usr/bin/env python3
"""`make bench-ipc`: the control plane's round trip, kvshim vs LMCache's transport.

Measured from Python, in one run, with the same payload (a request carrying
64 chunk keys of 32 bytes, and its answer):

- kvshim: ctypes -> libkvshim.so -> shared-memory ring -> server (another
  process) -> ring -> Go -> Python. The server echoes the body (OpPing).
- baseline: what LMCache's MP mode uses: pyzmq DEALER <-> ROUTER over ipc://
  between two Python processes, the request msgpack-encoded on the client
  and the answer msgpack-decoded there. The ROUTER echoes the frames without
  decoding them (LMCache's server decodes and encodes too, so the baseline
  is, if anything, flattered).

Then it runs the Go-only benchmark (cmd/kvshim-bench-ipc: spin and sleep mode
ring round trips, idle CPU) and prints one JSON object with every figure as
its last line.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KEYS, KEY_BYTES = 64, 32


def percentiles(us: list[float]) -> dict[str, float]:
    a = np.array(us)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "p999": float(np.percentile(a, 99.9)),
            "msgs_per_s": float(len(a) / (a.sum() / 1e6))}


def spawn(code: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    line = p.stdout.readline()
    if not line.startswith("ready"):
        p.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return p


def bench_kvshim(n: int, warmup: int) -> dict[str, float]:
    from kvshim import native

    engine = f"bench-{uuid.uuid4().hex[:8]}"
    ns = {"model": "bench", "dtype": "bf16", "layout": "x", "world_size": 1, "chunk_size": 256}
    server = spawn(f"""
        import json, sys
        import kvshim.native as n
        h = n.Handle(json.dumps({{"role": "scheduler", "server": "embedded", "engine_id": "{engine}",
                                 "namespace": {json.dumps(ns)}, "block_size": 16, "l1_size_gb": 0.0625}}))
        print("ready", flush=True)
        sys.stdin.read()
        h.close()
    """)
    try:
        lib = native.library()
        h = native.Handle(json.dumps({"role": "tool", "server": "embedded", "engine_id": engine, "namespace": ns}))
        body = np.random.default_rng(0).integers(0, 256, KEYS * KEY_BYTES, dtype=np.uint8)
        out = ctypes.create_string_buffer(KEYS * KEY_BYTES)
        got = ctypes.c_size_t()
        ptr, size = body.ctypes.data, body.nbytes
        us = []
        for i in range(n + warmup):
            t0 = time.perf_counter_ns()
            rc = lib.kvshim_ping(h.value, ptr, size, out, len(out), ctypes.byref(got))
            t1 = time.perf_counter_ns()
            if rc != 0:
                h.check(rc)
            if i >= warmup:
                us.append((t1 - t0) / 1e3)
        assert out.raw[: got.value] == body.tobytes(), "echo differs"
        h.close()
        return percentiles(us)
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def bench_zmq(n: int, warmup: int) -> dict[str, float]:
    import msgpack
    import zmq

    path = Path(tempfile.mkdtemp()) / "router.ipc"
    server = spawn(f"""
        import zmq
        ctx = zmq.Context()
        s = ctx.socket(zmq.ROUTER)
        s.bind("ipc://{path}")
        print("ready", flush=True)
        while True:
            frames = s.recv_multipart()
            if frames[1] == b"stop":
                break
            s.send_multipart(frames)
    """)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"ipc://{path}")
    keys = [bytes(k) for k in np.random.default_rng(0).integers(0, 256, (KEYS, KEY_BYTES), dtype=np.uint8)]
    us = []
    for i in range(n + warmup):
        t0 = time.perf_counter_ns()
        s.send_multipart([msgpack.packb(i), msgpack.packb("LOOKUP"), msgpack.packb(keys)])
        frames = s.recv_multipart()
        answer = msgpack.unpackb(frames[2])
        t1 = time.perf_counter_ns()
        if i >= warmup:
            us.append((t1 - t0) / 1e3)
    assert answer == keys
    s.send_multipart([b"stop"])
    server.wait(timeout=30)
    s.close(0)
    ctx.term()
    return percentiles(us)


def bench_go() -> dict[str, float]:
    r = subprocess.run(["go", "run", "./cmd/kvshim-bench-ipc"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return {}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    n = int(os.environ.get("KVSHIM_BENCH_N", "20000"))
    warmup = n // 10
    kv = bench_kvshim(n, warmup)
    zq = bench_zmq(n, warmup)
    go = bench_go()
    print(f"{'round trip, 64 keys':<28}{'p50 µs':>10}{'p99 µs':>10}{'p99.9 µs':>10}{'msg/s':>10}")
    for name, r in (("kvshim (Python->Go->ring)", kv), ("pyzmq DEALER/ROUTER ipc", zq)):
        print(f"{name:<28}{r['p50']:>10.1f}{r['p99']:>10.1f}{r['p999']:>10.1f}{r['msgs_per_s']:>10.0f}")
    result = {
        "python_rtt_p50_us": round(kv["p50"], 2), "python_rtt_p99_us": round(kv["p99"], 2),
        "python_rtt_p999_us": round(kv["p999"], 2), "python_msgs_per_s": round(kv["msgs_per_s"]),
        "zmq_rtt_p50_us": round(zq["p50"], 2), "zmq_rtt_p99_us": round(zq["p99"], 2),
        "zmq_rtt_p999_us": round(zq["p999"], 2), "zmq_msgs_per_s": round(zq["msgs_per_s"]),
        "ratio_p50": round(zq["p50"] / kv["p50"], 2), "ratio_p99": round(zq["p99"] / kv["p99"], 2),
        "iterations": n,
    }
    result |= {k: v for k, v in go.items() if k.startswith(("go_", "idle_"))}
    print(f"ratio (zmq / kvshim): p50 {result['ratio_p50']}x, p99 {result['ratio_p99']}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
