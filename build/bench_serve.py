#!/usr/bin/env python3
"""`make bench-serve`: real `vllm serve` (the CPU build of vLLM 0.32.0, the
tiny Llama of tests/e2e) under eight cache configurations, one after the
other, each driven by the same two workloads:

- `vllm bench serve --dataset-name prefix_repetition` (8 prefixes of 3,072
  tokens, 4 prompts each with a 64-token suffix, 8 output tokens, concurrency
  1, seed 0): the first prompt of a prefix is cold, the other 24 can hit.
  Which is which is known by sampling the same dataset here (same code, same
  seed) and checked against the lengths the tool reports.
- a multi-turn chat (4 conversations of 4 turns, taken round robin, a
  system prompt of 110 generated lines each, 16 answer tokens, streamed): turns 2-4 can
  hit the conversation so far.

Configurations: no cache (`cold`); vLLM's prefix cache; kvshim (embedded,
prefix cache off); kvshim loading layer by layer (kvshim.layerwise); kvshim
loading a hit before the forward pass of its step (kvshim.sync_load); kvshim +
vLLM's prefix cache; vLLM's cache too small for
the working set (--num-gpu-blocks-override 80: three prefixes of eight) with
and without kvshim; LMCache 0.5.6's MP server (--shm-name) through vLLM's
LMCacheMPConnector (python/requirements-bench-serve.txt: run under that
layer's python, as make bench-serve does).

Greedy outputs (temperature 0) are compared with vLLM's prefix cache, the
reference: a cold recompute chunks a prompt differently and may differ in
the last bf16 bits, so `cold` is reported apart.

Not a baseline interleaved request by request: each configuration runs alone
(two servers at once would share the 2 cores). On a shared machine, read the
ratios of one run, and the load averages it prints. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # this process samples the dataset with vLLM's code

from harness import MODEL_NAME, Proc, Processes, VllmServer, free_port, kvshim_config, prompt_ids, wait_for  # noqa: E402
from tiny_model import corpus, model_dir  # noqa: E402

PREFIX, SUFFIX, PREFIXES, PROMPTS, OUT = 3072, 64, 8, 32, 8
SMALL_BLOCKS = 80  # x 128 tokens: 3 of the 8 prefixes
CONVS, TURNS, ANSWER = 4, 4, 16


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def lmcache_config(port: int) -> dict[str, Any]:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


def expected_prompts(model: Path) -> list[tuple[str, int]]:
    """The prefix_repetition prompts `vllm bench serve --seed 0` sends, in its
    order, with the length the tool computes for each."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(str(model))
    reqs = PrefixRepetitionRandomDataset(random_seed=0).sample(
        tokenizer=tok, num_requests=PROMPTS, prefix_len=PREFIX, suffix_len=SUFFIX, num_prefixes=PREFIXES,
        output_len=OUT)
    return [(str(r.prompt), int(r.prompt_len)) for r in reqs]


def repeats(prompts: list[tuple[str, int]]) -> list[bool]:
    """For each prompt, whether an earlier one shares its prefix (its first
    2,000 characters: a prefix is 3,072 random tokens, ~13,000 characters of
    this tokenizer's text, a suffix 64 tokens)."""
    seen: set[str] = set()
    out = []
    for text, _ in prompts:
        key = text[:2000]
        out.append(key in seen)
        seen.add(key)
    return out


def bench_prefix_repetition(s: VllmServer, model: Path, outdir: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    vllm = Path(sys.executable).parent / "vllm"
    argv = [str(vllm), "bench", "serve", "--backend", "vllm", "--base-url", s.url, "--model", MODEL_NAME,
            "--tokenizer", str(model), "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(PREFIX), "--prefix-repetition-suffix-len", str(SUFFIX),
            "--prefix-repetition-num-prefixes", str(PREFIXES), "--prefix-repetition-output-len", str(OUT),
            "--num-prompts", str(PROMPTS), "--max-concurrency", "1", "--seed", "0", "--temperature", "0",
            "--ignore-eos", "--num-warmups", "0", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(outdir), "--result-filename", f"{name}.json",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90"]
    with (outdir / f"{name}.bench.log").open("w") as log:
        subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600, check=True)
    res: dict[str, Any] = json.loads((outdir / f"{name}.json").read_text())
    return res


def chat_workload(s: VllmServer) -> dict[str, Any]:
    lines = corpus(40000)
    convs: list[list[dict[str, str]]] = [
        [{"role": "system", "content": " ".join(lines[c * 500:(c * 500) + 110])}] for c in range(CONVS)]
    ttfts: list[list[float]] = [[] for _ in range(TURNS)]
    outputs: list[str] = []
    t0 = time.monotonic()
    n = 0
    for turn in range(TURNS):
        for c in range(CONVS):
            convs[c].append({"role": "user", "content": " ".join(lines[3000 + c * 40 + turn * 7:][:7])})
            body = {"model": MODEL_NAME, "messages": convs[c], "max_tokens": ANSWER, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}
            start = time.monotonic()
            first: float | None = None
            text = []
            with requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
                r.raise_for_status()
                for raw in r.iter_lines():
                    if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                        continue
                    delta = json.loads(raw[6:])["choices"][0]["delta"].get("content")
                    if delta:
                        if first is None:
                            first = time.monotonic() - start
                        text.append(delta)
            ttfts[turn].append((first if first is not None else time.monotonic() - start) * 1000)
            answer = "".join(text)
            outputs.append(answer)
            convs[c].append({"role": "assistant", "content": answer})
            n += 1
    dur = time.monotonic() - t0
    later = [x for t in ttfts[1:] for x in t]
    every = [x for t in ttfts for x in t]
    return {"ttft_p50_ms": pct(every, 50), "ttft_p90_ms": pct(every, 90), "request_throughput": n / dur,
            "turn1_ttft_p50_ms": pct(ttfts[0], 50), "later_turns_ttft_p50_ms": pct(later, 50), "outputs": outputs}


def run_config(procs: Processes, name: str, spec: dict[str, Any], model: Path, outdir: Path,
               prompts: list[tuple[str, int]], rep: list[bool]) -> dict[str, Any]:
    t0 = time.monotonic()
    s = procs.start_vllm(name, kv=spec.get("kv"), prefix_caching=spec.get("prefix_caching", False),
                         args=spec.get("args"), env=spec.get("env"))
    startup = time.monotonic() - t0
    try:
        # Warm-up: two long prompts nobody sends again (kernels, allocator).
        for i in range(2):
            s.complete(prompt_ids(PREFIX + SUFFIX, seed=5000 + i), max_tokens=2)
        m0 = s.metrics()
        res = bench_prefix_repetition(s, model, outdir, name, procs.base_env())
        lens = [int(x) for x in res["input_lens"]]
        # The server counts a prompt's tokens (it re-encodes the text; a few
        # differ from the sampler's count), so lengths match within a few.
        order_known = len(lens) == len(prompts) and all(abs(a - n) <= 8 for a, (_, n) in zip(lens, prompts))
        ttft = [float(x) * 1000 for x in res["ttfts"]]
        hit = [t for t, r in zip(ttft, rep) if r] if order_known else []
        cold = [t for t, r in zip(ttft, rep) if not r] if order_known else []
        chat = chat_workload(s)
        m1 = s.metrics()
        ext = m1.get("vllm:external_prefix_cache_hits_total", 0) - m0.get("vllm:external_prefix_cache_hits_total", 0)
        loc = m1.get("vllm:prefix_cache_hits_total", 0) - m0.get("vllm:prefix_cache_hits_total", 0)
        errors = [e for e in res.get("errors", []) if e]
        return {
            "startup_s": round(startup, 1),
            "prefix_repetition": {
                "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
                "request_throughput": res["request_throughput"], "completed": res["completed"],
                "failed": res["failed"] + len(errors), "order_known": order_known,
                "hit_ttft_p50_ms": pct(hit, 50), "hit_ttft_p90_ms": pct(hit, 90), "hits_n": len(hit),
                "first_ttft_p50_ms": pct(cold, 50)},
            "multi_turn": {k: v for k, v in chat.items() if k != "outputs"},
            "hit_tokens": {"external": ext, "vllm_prefix_cache": loc},
            "_outputs": [str(t) for t in res["generated_texts"]] + chat["outputs"],
        }
    finally:
        s.stop()


def table(out: dict[str, Any]) -> str:
    """The configurations as a Markdown table (docs/e2e.md has one)."""
    def f(x: Any) -> str:
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"

    head = ("| configuration | prefix_repetition TTFT p50 / p90 ms | its hits p50 ms | req/s | chat TTFT p50 / p90 ms "
            "| chat turns 2-4 p50 ms | req/s | hit tokens (kvshim or LMCache / vLLM) | outputs = vLLM prefix cache |")
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for k, v in out["configs"].items():
        pr, mt, ht = v["prefix_repetition"], v["multi_turn"], v["hit_tokens"]
        rows.append(f"| {k} | {f(pr['ttft_p50_ms'])} / {f(pr['ttft_p90_ms'])} | {f(pr['hit_ttft_p50_ms'])} "
                    f"| {pr['request_throughput']:.2f} | {f(mt['ttft_p50_ms'])} / {f(mt['ttft_p90_ms'])} "
                    f"| {f(mt['later_turns_ttft_p50_ms'])} | {mt['request_throughput']:.2f} "
                    f"| {ht['external']:.0f} / {ht['vllm_prefix_cache']:.0f} "
                    f"| {out['outputs_equal_vllm_prefix_cache'].get(k)} |")
    return "\n".join(rows)


def _finite(x: Any) -> Any:
    """NaN (a configuration that did not run, no hits) as null: JSON has no NaN."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _ratio(a: float, b: float) -> float:
    """a / b; NaN (null in the JSON) when b is not a positive number: an
    overhead at or below zero (a run where the peer's hit was as fast as
    vLLM's own) has no meaningful ratio."""
    return a / b if b > 0 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, results)")
    args = ap.parse_args()
    # A stopped benchmark stops its servers too (SystemExit runs the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    have_lmcache = True
    try:
        import lmcache  # noqa: F401
    except ImportError:
        have_lmcache = False
    model = model_dir()
    work = Path(tempfile.mkdtemp(prefix="kvshim-bench-serve-"))
    procs = Processes(work, model)
    kv = kvshim_config(l1_size_gb=2)
    small = ["--num-gpu-blocks-override", str(SMALL_BLOCKS)]
    lm_port = free_port()
    configs: dict[str, dict[str, Any]] = {
        "cold": {},
        "vllm_prefix_cache": {"prefix_caching": True},
        "kvshim": {"kv": kv},
        "kvshim_layerwise": {"kv": kvshim_config(l1_size_gb=2, layerwise=True)},
        "kvshim_sync": {"kv": kvshim_config(l1_size_gb=2, sync_load=True)},
        "kvshim_prefix_cache": {"kv": kv, "prefix_caching": True},
        "small_prefix_cache": {"prefix_caching": True, "args": small},
        "small_prefix_cache_kvshim": {"kv": kv, "prefix_caching": True, "args": small},
        "lmcache": {"kv": lmcache_config(lm_port)},
    }
    if not have_lmcache:
        print("lmcache is not importable: run under python/requirements-bench-serve.txt's venv "
              "(make bench-serve does); its configuration is skipped", file=sys.stderr)
        del configs["lmcache"]
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    prompts = expected_prompts(model)
    rep = repeats(prompts)
    load0 = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    t_all = time.monotonic()
    try:
        for name, spec in configs.items():
            lm: Proc | None = None
            if name == "lmcache":
                env = {**procs.base_env(), "LMCACHE_TRACK_USAGE": "false", "OMP_NUM_THREADS": "1"}
                lm = Proc("lmcache-mp-server", [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host",
                                                "127.0.0.1", "--port", str(lm_port), "--chunk-size", "256",
                                                "--l1-size-gb", "2", "--eviction-policy", "LRU",
                                                "--supported-transfer-mode", "engine_driven",
                                                "--shm-name", f"kvshim_bench_serve_{os.getpid()}",
                                                "--prometheus-port", str(free_port())], env, work / "lmcache.log")
                procs.all.append(lm)
                wait_for(lambda lm=lm: "LMCache cache server is running" in lm.log_text() or not lm.alive(),
                         180, "LMCache MP server start-up")
                if not lm.alive():
                    raise lm.exited_error("starting")
            print(f"== {name}", file=sys.stderr, flush=True)
            try:
                results[name] = run_config(procs, name, spec, model, work, prompts, rep)
            finally:
                if lm is not None:
                    lm.stop()  # SIGTERM: SIGKILL would leave its /dev/shm pool behind
            r = results[name]
            print(f"   prefix_repetition ttft p50 {r['prefix_repetition']['ttft_p50_ms']:.1f} ms, hits p50 "
                  f"{r['prefix_repetition']['hit_ttft_p50_ms']:.1f} ms; chat later turns p50 "
                  f"{r['multi_turn']['later_turns_ttft_p50_ms']:.1f} ms; hit tokens {r['hit_tokens']}",
                  file=sys.stderr, flush=True)
    finally:
        procs.close()
        shutil.rmtree(procs.runtime_dir, ignore_errors=True)
    ref = results.get("vllm_prefix_cache", {}).get("_outputs")
    same = {k: (v["_outputs"] == ref) for k, v in results.items() if ref is not None}
    for v in results.values():
        v.pop("_outputs", None)

    def hit50(k: str) -> float:
        return float(results.get(k, {}).get("prefix_repetition", {}).get("hit_ttft_p50_ms", float("nan")))

    cold50 = float(results.get("cold", {}).get("prefix_repetition", {}).get("ttft_p50_ms", float("nan")))
    out = {
        "cold_ttft_p50_ms": cold50,
        "kvshim_hit_ttft_p50_ms": hit50("kvshim"),
        "kvshim_layerwise_hit_ttft_p50_ms": hit50("kvshim_layerwise"),
        "kvshim_sync_hit_ttft_p50_ms": hit50("kvshim_sync"),
        "vllm_prefix_cache_hit_ttft_p50_ms": hit50("vllm_prefix_cache"),
        "lmcache_hit_ttft_p50_ms": hit50("lmcache"),
        "kvshim_over_lmcache_hit_ttft": hit50("kvshim") / hit50("lmcache") if "lmcache" in results else None,
        "kvshim_over_vllm_prefix_cache_hit_ttft": hit50("kvshim") / hit50("vllm_prefix_cache"),
        # What a cache adds to a hit over vLLM's own prefix-cache hit (which
        # copies nothing), same run: the measure that can be compared across
        # caches (docs/e2e.md). A ratio of whole TTFTs cannot go below
        # vLLM's prefix-cache hit over the peer's, whatever the cache does.
        "kvshim_overhead_ms": hit50("kvshim") - hit50("vllm_prefix_cache"),
        "kvshim_layerwise_overhead_ms": hit50("kvshim_layerwise") - hit50("vllm_prefix_cache"),
        "kvshim_sync_overhead_ms": hit50("kvshim_sync") - hit50("vllm_prefix_cache"),
        "lmcache_overhead_ms": hit50("lmcache") - hit50("vllm_prefix_cache"),
        "kvshim_vs_lmcache_overhead": _ratio(hit50("kvshim") - hit50("vllm_prefix_cache"),
                                             hit50("lmcache") - hit50("vllm_prefix_cache")),
        "targets": {"kvshim_over_lmcache_hit_ttft": 0.5, "kvshim_over_vllm_prefix_cache_hit_ttft": 1.05,
                    "kvshim_vs_lmcache_overhead": 0.5},
        "identical_outputs": all(v for k, v in same.items() if k != "cold") if same else None,
        "outputs_equal_vllm_prefix_cache": same,
        "hit_tokens": {k: v["hit_tokens"] for k, v in results.items()},
        "configs": results,
        "workloads": {"prefix_repetition": {"prefix_len": PREFIX, "suffix_len": SUFFIX, "num_prefixes": PREFIXES,
                                            "num_prompts": PROMPTS, "output_len": OUT, "max_concurrency": 1},
                      "multi_turn": {"conversations": CONVS, "turns": TURNS, "answer_tokens": ANSWER}},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load0, "loadavg_after": os.getloadavg()},
        "seconds": round(time.monotonic() - t_all, 1),
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory: {work}", file=sys.stderr)
    print(table(out), file=sys.stderr)
    print(json.dumps(_finite(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
