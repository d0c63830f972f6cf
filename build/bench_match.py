#!/usr/bin/env python3
"""`make bench-match`: get_num_new_matched_tokens from a Python token list, end to end.

vLLM 0.33's real Scheduler builds the SCHEDULER-role KVShimConnector (with
kvshim's embedded server in this process) and a WORKER-role connector with
CPU KV caches stores each prompt once (tests/vllm/harness/: nothing of
vLLM is stubbed). Then, for prompts of 16K and 128K tokens (64 and 512
chunks of 256 tokens), each timed call is one fresh vLLM Request, as the
scheduler sees it, from the first get_num_new_matched_tokens to its final
answer (a pending lookup is asked again at once), with the request's
prompt_token_ids a plain Python list, as vLLM holds it:

- ``hit``: every chunk is in L1 (the answer is prompt - 1 tokens);
- ``miss``: a prompt never stored (the answer is 0).

Three paths run interleaved in the same run: ``new`` (the connector as it
is: vLLM's list handed to the library, native.Scheduler.match_list, which
reads it in C inside the lookup call: nothing converted on the Python
side), ``array`` (the connector with match_list refused, as before it: the
list converted by kvshim.native.token_ids, the library's C loop into an
array('I'), then native.match) and ``old`` (np.asarray(tokens, dtype=np.uint32),
then native.match). The conversions alone are measured too, with the other
candidates that were considered. With ``--gap-ms`` the
process sleeps that long before each call, so the server's thread is asleep
when a request comes, as at low load; ``--server serve`` runs the server as
its own ``kvshim serve`` process (as a server shared by several vLLM
instances runs) instead of embedded.

The last line is one JSON object with every figure (milliseconds, medians
unless named otherwise).
"""

from __future__ import annotations

import argparse
import array
import gc
import json
import statistics
import struct
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import kvshim.vllm as kv  # noqa: E402
from kvshim import native  # noqa: E402
from kvshim.errors import NotSupportedError  # noqa: E402
from harness import (  # noqa: E402
    TINY_LLAMA_CONFIG,
    ModelRunner,
    SchedulerHarness,
    ServerProcess,
    make_kv_cache_config,
    make_vllm_config,
    prompt,
    run_until_scheduled,
    server_stats,
)

CHUNK, BLOCK = 256, 16
SIZES = {"16k": 16 * 1024, "128k": 128 * 1024}
ROUNDS = {"16k": 200, "128k": 40}


def old_u32(tokens: Any) -> np.ndarray:
    """The conversion before: numpy, element by element."""
    return np.ascontiguousarray(np.asarray(tokens, dtype=np.uint32))


def conversions(tokens: list[int]) -> dict[str, float]:
    """Each candidate conversion of a Python list into uint32 for ctypes, ms."""
    n = len(tokens)
    cands: dict[str, Callable[[], Any]] = {
        "np.asarray(uint32) [old]": lambda: np.asarray(tokens, dtype=np.uint32),
        "np.array(int64)+range check+astype": lambda: _i64_checked(np.array(tokens, dtype=np.int64)),
        "np.fromiter(uint32, count)": lambda: np.fromiter(tokens, dtype=np.uint32, count=n),
        "struct.pack(n I)": lambda: struct.pack(f"{n}I", *tokens),
        "array('I', list) [before the C loop]": lambda: array.array("I", tokens),
        "C loop in the library (native.tokens_from_list) [array]": lambda: _c_loop(tokens),
        "array('q', list)+range check": lambda: _i64_checked(np.frombuffer(array.array("q", tokens), dtype=np.int64)),
        "kvshim.native.token_ids(list)": lambda: native.token_ids(tokens),
    }
    number = max(1, 2_000_000 // n)
    out = {}
    for name, fn in cands.items():
        t = timeit.repeat(fn, number=number, repeat=9)
        out[name] = statistics.median(t) / number * 1e3
    return out


def _c_loop(tokens: list[int]) -> np.ndarray:
    out = np.empty(len(tokens), dtype=np.uint32)
    assert native.tokens_from_list(tokens, out.ctypes.data, out.size)
    return out


def _i64_checked(a: np.ndarray) -> np.ndarray:
    if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise ValueError("token id outside uint32")
    return a.astype(np.uint32)


def store(h: SchedulerHarness, tokens: list[int]) -> None:
    """Runs one request whose prompt is tokens through vLLM and the worker,
    then waits until its chunks are in L1."""
    want = server_stats(h.connector)["kvshim_l1_commits_total"] + len(tokens) // CHUNK
    req = h.add_request(h.make_request(tokens, max_tokens=1))
    run_until_scheduled(h, req, timeout_s=600)
    h.run_until_idle()
    h.settle()
    deadline = time.monotonic() + 120
    while server_stats(h.connector)["kvshim_l1_commits_total"] < want:
        assert time.monotonic() < deadline, "the stored chunks never committed"
        time.sleep(0.05)


def timed(fn: Callable[[Any], np.ndarray], spent: list[float]) -> Callable[[Any], np.ndarray]:
    """fn, recording how long each call took (ms) in spent."""

    def run(tokens: Any) -> np.ndarray:
        if native._as_is(tokens, "I"):  # native.match's own pass over what is converted already
            return tokens
        t0 = time.perf_counter()
        out = fn(tokens)
        spent.append((time.perf_counter() - t0) * 1e3)
        return out

    return run


def match_once(h: SchedulerHarness, conn: Any, tokens: list[int], rid: str) -> tuple[float, int]:
    """One fresh request from the first get_num_new_matched_tokens to its
    final answer; returns (ms, tokens matched)."""
    req = h.make_request(tokens, max_tokens=1, request_id=rid)  # vLLM hashes its blocks here: not timed
    t0 = time.perf_counter()
    while True:
        n, _ = conn.get_num_new_matched_tokens(req, 0)
        if n is not None:
            break
    dt = (time.perf_counter() - t0) * 1e3
    conn.request_finished(req, [])  # releases the lookup's holds
    return dt, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap-ms", type=float, default=0.0, help="sleep before each timed call (ms)")
    ap.add_argument("--server", choices=("embedded", "serve"), default="embedded",
                    help="the server inside this process, or a kvshim serve process")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server, where = None, "embedded"
        if args.server == "serve":
            server = ServerProcess(Path(tmp) / "kvshim.sock", l1_size_gb=0.5).start()
            where = server.socket
        longest = max(SIZES.values())
        model = Path(tmp) / "model"
        model.mkdir()
        # The harness's tiny Llama, with room for the longest prompt.
        (model / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG | {"max_position_embeddings": 2 * longest}))
        num_blocks = longest // BLOCK + 64
        cfg = make_vllm_config(
            model,
            kv_connector_extra_config={"kvshim.chunk_size": CHUNK, "kvshim.l1_size_gb": 0.5, "kvshim.timeout_ms": 10000,
                                       "kvshim.server": where},
            block_size=BLOCK,
            max_model_len=longest + CHUNK,
            max_num_batched_tokens=longest + CHUNK,
            enable_prefix_caching=False,
        )
        kvc = make_kv_cache_config(num_blocks=num_blocks, block_size=BLOCK)
        h = SchedulerHarness(cfg, kvc)
        h.runners = [ModelRunner(cfg, kvc)]
        conn = h.connector
        assert isinstance(conn, kv.KVShimConnector)
        result: dict[str, Any] = {"chunk_tokens": CHUNK, "python": sys.version.split()[0], "numpy": np.__version__,
                                  "gap_ms": args.gap_ms, "server": args.server}
        new_u32 = native.token_ids

        def no_list(*_args: Any, **_kwargs: Any) -> None:
            raise NotSupportedError("bench_match: the array path")

        # path -> (the connector's token conversion, whether native.match_list is refused)
        paths = {"new": (new_u32, False), "array": (new_u32, True), "old": (old_u32, True)}
        order = list(paths)
        try:
            for label, n in SIZES.items():
                hit = prompt(100 + n, n)
                miss = prompt(200 + n, n)
                store(h, hit)
                times: dict[str, list[float]] = {}
                shares: dict[str, list[float]] = {}
                for i in range(ROUNDS[label]):
                    for case, tokens in (("hit", hit), ("miss", miss)):
                        for path in order[i % 3:] + order[:i % 3]:
                            fn, refuse = paths[path]
                            spent: list[float] = []
                            native.token_ids = timed(fn, spent)
                            if refuse:
                                conn.scheduler.native.match_list = no_list  # type: ignore[method-assign]
                            else:
                                vars(conn.scheduler.native).pop("match_list", None)
                            if args.gap_ms:
                                time.sleep(args.gap_ms / 1e3)
                            dt, got = match_once(h, conn, tokens, f"{label}-{case}-{path}-{i}")
                            assert got == (n - 1 if case == "hit" else 0), (label, case, path, got)
                            assert bool(spent) == refuse, spent  # converted at each ask, or never
                            times.setdefault(f"{case}_{path}", []).append(dt)
                            if spent:
                                times.setdefault(f"{case}_{path}_convert", []).append(sum(spent))
                                shares.setdefault(f"{case}_{path}", []).append(sum(spent) / dt)
                    if i % 16 == 0:
                        gc.collect()
                vars(conn.scheduler.native).pop("match_list", None)
                native.token_ids = new_u32
                conv = conversions(hit)
                r: dict[str, Any] = {"tokens": n, "chunks": n // CHUNK, "rounds": ROUNDS[label]}
                for k, v in times.items():
                    r[f"{k}_ms"] = round(statistics.median(v), 4)
                    r[f"{k}_p90_ms"] = round(float(np.percentile(v, 90)), 4)
                r["candidates_ms"] = {k: round(v, 4) for k, v in conv.items()}
                for k, v in shares.items():
                    r[f"{k}_convert_share"] = round(statistics.median(v), 3)
                for case in ("hit", "miss"):
                    r[f"{case}_speedup"] = round(r[f"{case}_old_ms"] / r[f"{case}_new_ms"], 2)
                    r[f"{case}_array_speedup"] = round(r[f"{case}_array_ms"] / r[f"{case}_new_ms"], 2)
                result[label] = r
        finally:
            native.token_ids = new_u32
            h.close()
            if server is not None:
                server.kill()

    print(f"--gap-ms {args.gap_ms:g}, --server {args.server}")
    print(f"{'get_num_new_matched_tokens':<26}{'old ms':>9}{'array ms':>10}{'new ms':>9}{'old/new':>9}{'array/new':>10}"
          f"{'old conv':>10}{'array conv':>12}   (medians; conv: the token conversion inside the call, ms and share)")
    for label in SIZES:
        r = result[label]
        for case in ("hit", "miss"):
            o, a, nw = r[f"{case}_old_ms"], r[f"{case}_array_ms"], r[f"{case}_new_ms"]
            oc, ac = r[f"{case}_old_convert_ms"], r[f"{case}_array_convert_ms"]
            so, sa = r[f"{case}_old_convert_share"], r[f"{case}_array_convert_share"]
            print(f"{label + ' tokens, ' + case:<26}{o:>9.3f}{a:>10.3f}{nw:>9.3f}{o / nw:>9.2f}{a / nw:>10.2f}"
                  f"{oc:>6.3f}{so:>4.0%}{ac:>8.3f}{sa:>4.0%}")
    for label in SIZES:
        print(f"token list -> uint32 alone, {label} tokens (ms, candidates):")
        for k, v in result[label]["candidates_ms"].items():
            print(f"  {k:<40}{v:>9.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
