"""`kvshim demo`: store and restore a Llama-3-8B-shaped paged KV cache.

The demo drives libkvshim.so the way the vLLM connector does, one engine
step at a time, with no vLLM in the process: a scheduler handle (which starts
the embedded server, as `--kv-transfer-config` alone does in vLLM) and a
worker handle whose KV cache is laid out as vLLM 0.33 lays out Llama-3-8B's
for FlashAttention: one bf16 buffer, seen as 32 per-layer (blocks, 8 heads,
16 tokens, K|V 256) views, in KVCacheLayout LBNHC (layers outermost, the
default) or BLNHC (blocks outermost). The buffer is in CPU memory (numpy, or
torch with --tensors torch) or, with --device cuda, a torch CUDA tensor. A
stream of requests that share prefixes runs through it. For each request the
demo looks the prompt up (pending, then final), allocates fresh blocks, has
the worker restore the hit chunks from the server's shared-memory L1 into
those blocks (never the blocks they were saved from), checks every restored
byte against what the "model" computes (on the device, for CUDA), computes
the rest, and saves the new full chunks (ALLOC, copy, COMMIT) before the
blocks are freed.

In the same run it measures the reference the library is held to: the same
chunks copied by the copy engine alone (kvshim_worker_engine_copy: the
worker's plans on an engine of its kind, no server, no lookup, no checks),
into the same blocks, from caller memory (pinned for CUDA), and verified the
same way; with CUDA also one large pinned torch copy in each direction.

The "model" fills a block's KV with bytes derived from the hash of the whole
prefix up to that block, so a restored block is right only if exactly that
prefix's bytes came back.

The demo needs no vLLM (its geometry is the constants below) and, for
--device cuda, no numpy: the GPU check runs it with a bare torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
import uuid
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from kvshim import native

# Llama-3-8B: 32 layers, 8 KV heads, head size 128, bf16; vLLM block 16.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS = 32, 8, 128, 16
CONTENT = 2 * HEAD_SIZE  # one token's K and V for one head
BLOCK_BYTES = LAYERS * BLOCK_TOKENS * KV_HEADS * CONTENT * 2  # 2 MiB across layers, K and V
LAYOUTS = ("LBNHC", "BLNHC")
DIGEST = 32  # SHA-256
BATCH = 32  # blocks per device verification batch (64 MiB of expected bytes)

# The bytes every block starts from; each block XORs its prefix digest in.
PATTERN = random.Random(0).randbytes(BLOCK_BYTES)


class Refused(Exception):
    """The demo cannot run as asked here: one line, no traceback."""


def prefix_digests(tokens: array[int], blocks: int) -> list[bytes]:
    """SHA-256 of the whole prefix up to the end of each full block."""
    h, out = hashlib.sha256(), []
    raw = tokens.tobytes()
    step = BLOCK_TOKENS * tokens.itemsize
    for b in range(blocks):
        h.update(raw[b * step:(b + 1) * step])
        out.append(h.copy().digest())
    return out


def workload(requests: int, doc_tokens: int, seed: int) -> list[array[int]]:
    """Prompts sharing a system prompt, then one of three documents, then a question."""
    rng = random.Random(seed)

    def toks(n: int) -> array[int]:
        return array("I", (rng.randrange(128_000) for _ in range(n)))

    system = toks(1024)
    docs = [toks(doc_tokens) for _ in range(3)]
    return [system + docs[i % len(docs)] + toks(rng.randrange(40, 300)) for i in range(requests)]


class Cache:
    """vLLM 0.33's allocate_kv_cache for one FlashAttention group: one buffer
    (layers, blocks, block_size, heads, K|V) for LBNHC or (blocks, layers,
    ...) for BLNHC, registered as a (blocks, heads, block_size, K|V) view
    per layer. Subclasses hold the buffer (numpy or torch)."""

    device = "cpu"

    def __init__(self, layout: str, num_blocks: int) -> None:
        self.layout, self.num_blocks = layout, num_blocks
        self.free = list(range(num_blocks))
        random.Random(7).shuffle(self.free)

    def shape(self) -> tuple[int, ...]:
        if self.layout == "LBNHC":
            return (LAYERS, self.num_blocks, BLOCK_TOKENS, KV_HEADS, CONTENT)
        return (self.num_blocks, LAYERS, BLOCK_TOKENS, KV_HEADS, CONTENT)

    def allocate(self, n: int) -> array[int]:
        if n > len(self.free):
            raise MemoryError(f"demo cache has {len(self.free)} free blocks, request needs {n}")
        ids, self.free = self.free[:n], self.free[n:]
        return array("q", ids)

    def release(self, ids: array[int]) -> None:
        self.free.extend(ids)

    def describe(self) -> list[dict[str, Any]]:
        """The per-layer tensors, as native.Worker.register reads them."""
        return [
            {"layer": f"model.layers.{i}.self_attn.attn", "group": 0, "backend": "paged", "device": self.device,
             "data_ptr": ptr, "dtype_size": 2, "shape": shape, "stride_bytes": strides,
             "storage_ptr": self.storage()[0], "storage_bytes": self.storage()[1]}
            for i, (ptr, shape, strides) in enumerate(self.views())
        ]

    # Implemented by the buffers.
    def views(self) -> list[tuple[int, list[int], list[int]]]:
        """Each layer's view: (address, shape, strides in bytes)."""
        raise NotImplementedError

    def storage(self) -> tuple[int, int]:
        """The buffer: (address, bytes)."""
        raise NotImplementedError

    def fill(self, digests: Sequence[bytes], ids: Sequence[int]) -> None:
        """Writes block ids[i] as the model computes it for prefix digests[i]."""
        raise NotImplementedError

    def bad_blocks(self, digests: Sequence[bytes], ids: Sequence[int]) -> list[int]:
        """The indices i where block ids[i] differs from what fill wrote."""
        raise NotImplementedError

    def wipe(self, ids: Sequence[int]) -> None:
        raise NotImplementedError

    def host_buffer(self, nbytes: int) -> tuple[int, Any]:
        """Caller memory for the engine-alone copies: (address, owner)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Waits for the device's queued work (the 'forward pass')."""

    def stream_event(self) -> tuple[int, Any]:
        """A CUevent recorded after the forward pass for the save stream to
        wait on (0 on the CPU), and the object that keeps it alive."""
        return 0, None


class NumpyCache(Cache):
    def __init__(self, layout: str, num_blocks: int) -> None:
        super().__init__(layout, num_blocks)
        try:
            import numpy as np
        except ImportError as e:
            raise Refused(f"--tensors numpy needs numpy ({e}); pip install 'kvshim[demo]', or use --tensors torch") from None
        self.np = np
        self.buf = np.zeros(self.shape(), dtype=np.uint16)  # bf16 bits
        self.pattern = np.frombuffer(PATTERN, dtype=np.uint8).reshape(-1, DIGEST)

    def views(self) -> list[tuple[int, list[int], list[int]]]:
        out = []
        for i in range(LAYERS):
            v = (self.buf[i] if self.layout == "LBNHC" else self.buf[:, i]).transpose(0, 2, 1, 3)
            out.append((v.ctypes.data, list(v.shape), list(v.strides)))
        return out

    def storage(self) -> tuple[int, int]:
        return self.buf.ctypes.data, self.buf.nbytes

    def _block(self, b: int) -> Any:
        return self.buf[:, b] if self.layout == "LBNHC" else self.buf[b]  # (layers, tokens, heads, K|V)

    def _expected(self, digest: bytes) -> Any:
        x = self.pattern ^ self.np.frombuffer(digest, dtype=self.np.uint8)
        return x.view(self.np.uint16).reshape(LAYERS, BLOCK_TOKENS, KV_HEADS, CONTENT)

    def fill(self, digests: Sequence[bytes], ids: Sequence[int]) -> None:
        for d, b in zip(digests, ids):
            self._block(b)[...] = self._expected(d)

    def bad_blocks(self, digests: Sequence[bytes], ids: Sequence[int]) -> list[int]:
        return [i for i, (d, b) in enumerate(zip(digests, ids)) if not self.np.array_equal(self._block(b), self._expected(d))]

    def wipe(self, ids: Sequence[int]) -> None:
        for b in ids:
            self._block(b)[...] = 0

    def host_buffer(self, nbytes: int) -> tuple[int, Any]:
        buf = self.np.ones(nbytes, dtype=self.np.uint8)  # faulted in
        return buf.ctypes.data, buf


class TorchCache(Cache):
    """The same buffer as a torch bf16 tensor on the CPU or a CUDA device;
    filled and verified there (torch.equal on the device), in batches."""

    def __init__(self, layout: str, num_blocks: int, device: str) -> None:
        super().__init__(layout, num_blocks)
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")
        self.dev = torch.device(device)
        if self.cuda:
            torch.cuda.set_device(self.dev)  # events and copies below use the current device
        self.device = f"cuda:{self.dev.index or 0}" if self.cuda else "cpu"
        self.buf = torch.zeros(self.shape(), dtype=torch.bfloat16, device=self.dev)
        self.i16 = self.buf.view(torch.int16)  # the same bytes, for exact integer copies and compares
        self.bdim = 1 if layout == "LBNHC" else 0
        self.pattern = torch.frombuffer(bytearray(PATTERN), dtype=torch.uint8).to(self.dev).reshape(1, -1, DIGEST)

    def views(self) -> list[tuple[int, list[int], list[int]]]:
        out = []
        for i in range(LAYERS):
            v = (self.buf[i] if self.layout == "LBNHC" else self.buf[:, i]).permute(0, 2, 1, 3)
            out.append((v.data_ptr(), list(v.shape), [s * v.element_size() for s in v.stride()]))
        return out

    def storage(self) -> tuple[int, int]:
        s = self.buf.untyped_storage()
        return s.data_ptr(), s.nbytes()

    def _index(self, ids: Sequence[int]) -> Any:
        return self.torch.tensor(list(ids), dtype=self.torch.int64, device=self.dev)

    def _expected(self, digests: Sequence[bytes]) -> Any:
        """(n, layers, tokens, heads, K|V) int16: the pattern XOR each digest."""
        d = self.torch.frombuffer(bytearray(b"".join(digests)), dtype=self.torch.uint8).to(self.dev)
        x = self.pattern ^ d.reshape(-1, 1, DIGEST)
        return x.view(self.torch.int16).reshape(len(digests), LAYERS, BLOCK_TOKENS, KV_HEADS, CONTENT)

    def _batches(self, digests: Sequence[bytes], ids: Sequence[int]) -> Iterator[tuple[int, Sequence[bytes], Any]]:
        for s in range(0, len(ids), BATCH):
            yield s, digests[s:s + BATCH], self._index(ids[s:s + BATCH])

    def fill(self, digests: Sequence[bytes], ids: Sequence[int]) -> None:
        for _, dg, idx in self._batches(digests, ids):
            exp = self._expected(dg)
            if self.layout == "LBNHC":
                self.i16[:, idx] = exp.transpose(0, 1)
            else:
                self.i16[idx] = exp

    def bad_blocks(self, digests: Sequence[bytes], ids: Sequence[int]) -> list[int]:
        bad: list[int] = []
        for s, dg, idx in self._batches(digests, ids):
            got = self.i16.index_select(self.bdim, idx)
            if self.layout == "LBNHC":
                got = got.transpose(0, 1)
            exp = self._expected(dg)
            if not self.torch.equal(got, exp):
                ne = (got != exp).flatten(1).any(dim=1).nonzero().flatten().tolist()
                bad.extend(s + i for i in ne)
        return bad

    def wipe(self, ids: Sequence[int]) -> None:
        for _, _, idx in self._batches([b""] * len(ids), ids):
            self.i16.index_fill_(self.bdim, idx, 0)

    def host_buffer(self, nbytes: int) -> tuple[int, Any]:
        buf = self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.cuda)
        buf.fill_(1)  # faulted in
        return buf.data_ptr(), buf

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def stream_event(self) -> tuple[int, Any]:
        if not self.cuda:
            return 0, None
        ev = self.torch.cuda.Event()
        ev.record()
        return int(ev.cuda_event), ev


def raw_copies(torch: Any, dev: Any, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """One large pinned torch copy each way (H2D, D2H), GB/s, median of repeats."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(3)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    rates: dict[str, list[float]] = {"h2d": [], "d2h": []}
    for _ in range(repeats + 1):  # the first round warms up
        for name, dst, src in (("h2d", gpu, host), ("d2h", host, gpu)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            rates[name].append(nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
    del host, gpu
    torch.cuda.empty_cache()
    return statistics.median(rates["h2d"][1:]), statistics.median(rates["d2h"][1:])


def progress(done: int, total: int, hit: int, seen: int) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {hit}/{seen} tokens restored")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class Engine:
    """The connector's calls, in vLLM's order, against a native scheduler and
    worker."""

    def __init__(self, sched: native.Scheduler, worker: native.Worker, timeout_s: float) -> None:
        self.sched, self.worker = sched, worker
        self.timeout_s = timeout_s
        self.timeout_ms = int(timeout_s * 1000)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.error_blocks: set[int] = set()

    def match(self, req: str, tokens: array[int]) -> tuple[int, float]:
        """get_num_new_matched_tokens until the lookup is final; returns the
        tokens to load and the lookup's latency in µs."""
        t0 = time.perf_counter()
        while True:
            n = self.sched.match(req, tokens)
            if n is not None:
                return n, (time.perf_counter() - t0) * 1e6
            time.sleep(20e-6)  # vLLM would ask again next step

    def step(self, requests: list[native.StepRequest], saves: bool, event: int = 0) -> None:
        """build_connector_meta, then the worker's bind, start_load_kv and wait_for_save."""
        self.worker.bind(self.sched.build_meta({"requests": requests}), self.timeout_ms)
        self.worker.start_loads()
        if saves:
            self.worker.start_saves(event)

    def load_layerwise(self) -> tuple[float, float]:
        """kvshim.layerwise's restore: build_connector_meta, bind,
        start_load_kv, then wait_for_layer_load of each layer in the forward
        pass's order and the step's end (get_finished waits for it); seconds
        to the first layer released (when its attention could start) and to
        the last."""
        self.worker.bind(self.sched.build_meta({"requests": []}), self.timeout_ms)
        t0 = time.perf_counter()
        self.worker.start_loads_layered()
        first = 0.0
        for i in range(LAYERS):
            if not self.worker.wait_layer(f"model.layers.{i}.self_attn.attn", self.timeout_ms):
                raise TimeoutError(f"layer {i} not loaded after {self.timeout_ms} ms")
            if i == 0:
                first = time.perf_counter() - t0
        if not self.worker.wait_layers(self.timeout_ms):
            raise TimeoutError(f"layer-wise loads not done after {self.timeout_ms} ms")
        return first, time.perf_counter() - t0

    def poll(self) -> None:
        """get_finished + get_block_ids_with_load_errors."""
        done = self.worker.poll()
        self.sending.update(done.sending)
        self.recving.update(done.recving)
        self.error_blocks.update(done.error_blocks)

    def wait(self, req: str, done: set[str], steps: bool) -> None:
        """Polls until req is in done. steps: vLLM keeps stepping (finished
        saves are reported once the metadata has told the worker the request
        finished); a load's completion needs only get_finished."""
        deadline = time.monotonic() + self.timeout_s
        while req not in done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {req}: copies not done after {self.timeout_s}s")
            if steps:
                self.step([], saves=False)
            elif not self.worker.wait(100):
                # Blocks until the worker has something to report (a load
                # polled every 50 µs took a P from the copies each time).
                continue
            self.poll()
            if steps and req not in done:
                time.sleep(50e-6)
        done.discard(req)

    def stats(self) -> dict[str, int]:
        return self.worker.stats().counters

    def wait_populated(self, nbytes: int, t_start: float, timeout_s: float = 120.0) -> float | None:
        """Waits (as vLLM's own start-up would) until the worker has
        populated its mapping of `nbytes` of L1; ms since t_start, or None
        when the library does not populate (CUDA: registration does)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            if "PopulatedBytes" not in s or os.environ.get("KVSHIM_POPULATE") == "off":
                return None
            if s["PopulatedBytes"] >= nbytes and not s.get("PopulatePending"):
                return round((time.perf_counter() - t_start) * 1e3, 1)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def settled_saves(self, before: dict[str, int], chunks: int, timeout_s: float = 10.0) -> dict[str, int]:
        """Worker stats once `chunks` more saves are accounted for (saved,
        skipped or failed), or after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.stats()
            done = sum(s[k] - before[k] for k in ("SavedChunks", "SkippedChunks", "FailedSaves"))
            if done >= chunks or time.monotonic() > deadline:
                return s
            time.sleep(1e-3)

    def engine_copy(self, direction: native.Direction, objects: int, stride: int, ids: list[int]) -> float:
        """The worker's copy engine alone on these blocks; seconds."""
        return self.worker.engine_copy(direction, objects, stride, ids, self.timeout_ms)


def phase_counters(stats: dict[str, Any]) -> dict[str, float]:
    """Time counters the library's WorkerStats exposes (fields named *Ns)."""
    return {k: float(v) for k, v in stats.items() if k.endswith("Ns") and isinstance(v, (int, float))}


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if a and b else None


def open_device(device: str, tensors: str) -> tuple[str, str]:
    """Checks that the device and tensor kind can run here; raises Refused."""
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise Refused(f"--device {device!r}: want cpu, cuda or cuda:N")
    if device == "cpu":
        if tensors == "torch":
            try:
                import torch
            except ImportError as e:
                raise Refused(f"--tensors torch needs PyTorch: import torch failed ({e})") from None
        return device, tensors or "numpy"
    if tensors == "numpy":
        raise Refused("--device cuda needs --tensors torch (the KV cache is a torch CUDA tensor)")
    try:
        import torch
    except ImportError as e:
        raise Refused(f"--device {device} needs PyTorch with CUDA: import torch failed ({e})") from None
    if not torch.cuda.is_available():
        raise Refused(f"--device {device}: no CUDA here (torch {torch.__version__}, built for CUDA "
                      f"{torch.version.cuda or 'none'}: torch.cuda.is_available() is False)")
    index = int(device[5:]) if device.startswith("cuda:") else 0
    if index >= torch.cuda.device_count():
        raise Refused(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}", "torch"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvshim demo", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (torch CUDA tensors)")
    ap.add_argument("--layout", default="LBNHC", choices=LAYOUTS, help="vLLM 0.33 KVCacheLayout of the buffer")
    ap.add_argument("--tensors", choices=("numpy", "torch"), help="what holds a CPU cache (default numpy; cuda: torch)")
    ap.add_argument("--requests", type=int, help="requests (default 12 on the CPU, 24 on CUDA)")
    ap.add_argument("--doc-tokens", type=int, help="tokens per shared document (default 2048 on the CPU, 8192 on CUDA)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--l1-size-gb", type=float, help="embedded server's L1 (default 4 on the CPU, 8 on CUDA)")
    ap.add_argument("--raw-copy-gib", type=float, default=1.0, help="CUDA: size of the large pinned reference copy")
    ap.add_argument("--trace-dir", help="write lifecycle traces (Arrow IPC) of the server and the worker here; "
                    "read them with `kvshim trace DIR`")
    ap.add_argument("--verify", choices=("l2", "always", "off"),
                    help="the worker's kvshim.verify (default: the library's, l2: payload checks on bytes from L2)")
    ap.add_argument("--layerwise", action="store_true",
                    help="restore as kvshim.layerwise does (layer by layer; reports the first layer's wait)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        device, tensors = open_device(args.device, args.tensors)
        return run(args, device, tensors)
    except Refused as e:
        print(f"kvshim demo: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, device: str, tensors: str) -> int:
    cuda = device != "cpu"
    requests = args.requests or (24 if cuda else 12)
    doc_tokens = args.doc_tokens or (8192 if cuda else 2048)
    l1_size_gb = args.l1_size_gb or (8.0 if cuda else 4.0)
    ct = args.chunk_tokens
    if ct <= 0 or ct % BLOCK_TOKENS:
        raise Refused(f"--chunk-tokens {ct}: want a positive multiple of the block size {BLOCK_TOKENS}")
    cb = ct // BLOCK_TOKENS
    payload = cb * BLOCK_BYTES
    stride = payload + 4096  # room for the object header; kvshim_worker_engine_copy checks it

    prompts = workload(requests, doc_tokens, args.seed)
    max_blocks = max(len(p) for p in prompts) // BLOCK_TOKENS + 1
    cache: Cache = TorchCache(args.layout, 2 * max_blocks, device) if tensors == "torch" else NumpyCache(args.layout, 2 * max_blocks)
    raw_h2d = raw_d2h = 0.0
    if cuda:
        assert isinstance(cache, TorchCache)  # open_device: CUDA is torch's
        raw_h2d, raw_d2h = raw_copies(cache.torch, cache.dev, int(args.raw_copy_gib * 2**30))
    objects, objects_keep = cache.host_buffer((max_blocks // cb + 1) * stride)

    namespace = {"model": "meta-llama/Meta-Llama-3-8B@demo", "dtype": "bfloat16",
                 "layout": f"paged {args.layout} 32x(B,8,16,256)",
                 "world_size": 1, "tp_size": 1, "chunk_size": ct, "kv_group": 0, "mla": False}
    engine_id = f"demo-{uuid.uuid4().hex[:12]}"
    common = {"server": "embedded", "engine_id": engine_id, "namespace": namespace, "timeout_ms": 10_000,
              **({"trace_dir": args.trace_dir} if args.trace_dir else {})}
    # All of L1 prepared at start-up (the server's default prepares 4 GiB):
    # the worker populates its mapping of each segment as it is announced.
    sched_cfg = {**common, "block_size": BLOCK_TOKENS, "l1_size_gb": l1_size_gb,
                 **({} if cuda else {"l1_prefault_gb": l1_size_gb})}

    hit_tokens = restored_bytes = seen = saved_bytes = engine_save_bytes = engine_restore_bytes = 0
    restore_s = engine_restore_s = save_s = engine_save_s = save_warm_s = 0.0
    pair_ratios: list[float] = []  # per request: engine alone time / library time, same chunks
    save_warm_bytes = 0
    first_save_ms = None
    lookup_us: list[float] = []
    first_layer_ms: list[float] = []  # --layerwise: start_load_kv to layer 0 released
    whole_ms: list[float] = []
    lookup_hit_us = 0.0
    library_phases: dict[str, float] = {}
    verified = engine_verified = True
    worker_cfg = {**common, "rank": 0, **({"verify": args.verify} if args.verify else {})}
    with native.Scheduler(sched_cfg) as sched, native.Worker(worker_cfg) as worker:
        t_start = time.perf_counter()
        worker.register(cache.describe())
        eng = Engine(sched, worker, timeout_s=30.0)
        startup_ms = None if cuda else eng.wait_populated(int(l1_size_gb * 2**30), t_start)
        for n, tokens in enumerate(prompts):
            req = f"req-{n}"
            full = len(tokens) // BLOCK_TOKENS
            digests = prefix_digests(tokens, full)
            load, us = eng.match(req, tokens)
            lookup_us.append(us)
            blocks = cache.allocate(-(-len(tokens) // BLOCK_TOKENS))
            sched.after_alloc(req, blocks, load)
            if load:
                before = phase_counters(eng.stats())
                if args.layerwise:
                    first_s, dt = eng.load_layerwise()
                    eng.poll()
                    first_layer_ms.append(first_s * 1e3)
                else:
                    t0 = time.perf_counter()
                    eng.step([], saves=False)
                    eng.wait(req, eng.recving, steps=False)
                    dt = time.perf_counter() - t0
                whole_ms.append(dt * 1e3)
                restore_s += dt
                for k, v in phase_counters(eng.stats()).items():
                    library_phases[k] = library_phases.get(k, 0.0) + v - before.get(k, 0.0)
                lookup_hit_us += us
                loaded = -(-load // BLOCK_TOKENS)
                ids = list(blocks[:loaded])
                bad = eng.error_blocks & set(blocks)
                if bad:
                    verified = False
                    print(f"{req}: load errors in blocks {sorted(bad)}", file=sys.stderr)
                for i in cache.bad_blocks(digests[:loaded], ids):
                    verified = False
                    print(f"{req}: block {i} restored wrong bytes", file=sys.stderr)
                hit_tokens += load
                restored_bytes += loaded * BLOCK_BYTES
                # The same chunks, the engine alone: save them to caller
                # memory, wipe the blocks, restore them, verify again.
                chunk_ids = list(blocks[:-(-loaded // cb) * cb])
                eng.engine_copy(native.Direction.SAVE, objects, stride, chunk_ids)
                cache.wipe(chunk_ids)
                cache.sync()
                edt = eng.engine_copy(native.Direction.LOAD, objects, stride, chunk_ids)
                engine_restore_s += edt
                engine_restore_bytes += len(chunk_ids) * BLOCK_BYTES
                if len(chunk_ids) == loaded:
                    pair_ratios.append(edt / dt)
                for i in cache.bad_blocks(digests[:len(chunk_ids)], chunk_ids):
                    engine_verified = False
                    print(f"{req}: block {i} restored wrong bytes by the engine alone", file=sys.stderr)
            # "Prefill" the rest, then save its new full chunks after the step.
            first = load // BLOCK_TOKENS
            cache.fill(digests[first:full], list(blocks[first:full]))
            cache.sync()  # the forward pass is done: the save's time is the save's
            saves_before = eng.stats()
            new_chunks = list(blocks[-(-load // ct) * cb:len(tokens) // ct * cb])
            t0 = time.perf_counter()
            event, keep = cache.stream_event()
            eng.step([{"req": req, "blocks": list(blocks), "computed": load, "scheduled": len(tokens) - load}],
                     saves=True, event=event)
            del keep
            if sched.finished(req):
                eng.wait(req, eng.sending, steps=True)  # the blocks are freed only after the saves read them
                dt = time.perf_counter() - t0
                # COMMIT may follow the release of the blocks: count what
                # was copied once the worker has accounted for every chunk.
                after = eng.settled_saves(saves_before, len(new_chunks) // cb)
                nbytes = (after["SavedChunks"] - saves_before["SavedChunks"]) * payload
                if nbytes:
                    save_s += dt
                    saved_bytes += nbytes
                    if first_save_ms is None:
                        first_save_ms = round(dt * 1e3, 2)
                    else:
                        save_warm_s += dt
                        save_warm_bytes += nbytes
                # The same new chunks saved by the engine alone.
                if new_chunks:
                    engine_save_s += eng.engine_copy(native.Direction.SAVE, objects, stride, new_chunks)
                    engine_save_bytes += len(new_chunks) * BLOCK_BYTES
            cache.release(blocks)
            seen += len(tokens)
            progress(n + 1, len(prompts), hit_tokens, seen)
        stats = sched.stats()
        wstats = eng.stats()
    del objects_keep

    total_tokens = sum(len(p) for p in prompts)
    server = stats.server or {}
    restore_gbps = gbps(restored_bytes, restore_s)
    engine_restore_gbps = gbps(engine_restore_bytes, engine_restore_s)
    save_gbps = gbps(saved_bytes, save_s)
    engine_save_gbps = gbps(engine_save_bytes, engine_save_s)
    result: dict[str, Any] = {
        "device": device,
        "layout": args.layout,
        "tensors": tensors,
        "verify": args.verify or "library default",
        "requests": len(prompts),
        "prompt_tokens": total_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": round(hit_tokens / total_tokens, 4),
        "bytes_restored": restored_bytes,
        "verified_ok": verified,
        "engine_verified_ok": engine_verified,
        "restore_gbps": restore_gbps,
        "engine_restore_gbps": engine_restore_gbps,
        "save_gbps": save_gbps,
        "save_gbps_warm": gbps(save_warm_bytes, save_warm_s) if save_warm_bytes else None,
        "engine_save_gbps": engine_save_gbps,
        "first_save_ms": first_save_ms,
        # Start-up: register to the worker's mapping of all of L1 populated
        # (ipc.PopulateMode; none on CUDA, where registration pins it).
        "l1_populate_startup_ms": startup_ms,
        "l1_populate_cpu_ms": round(wstats.get("PopulateNanos", 0) / 1e6, 1),
        # The median over requests of library vs engine-alone restore
        # throughput, each pair measured back to back on the same chunks:
        # steadier than the ratio of totals on a busy machine.
        "restore_vs_engine_p50_per_request": round(statistics.median(pair_ratios), 3) if pair_ratios else None,
        "lookup_p50_us": round(statistics.median(lookup_us), 2),
        "lookup_p99_us": round(sorted(lookup_us)[min(len(lookup_us) - 1, int(0.99 * len(lookup_us)))], 2),
        # Saves (save_gbps, first_save_ms) are timed from the step that
        # starts them to the request reported in finished_sending (vLLM may
        # free its blocks), counting the chunks the worker saved.
        # Restores, summed over the requests that restored: lookup (first
        # ask to the final answer), the library's restore (the step that
        # starts the load to the request reported received), the engine
        # alone on the same chunks, and the difference (retrieve, header and
        # checksum checks, scheduling and completion reporting).
        "phase_ms": {
            "lookup": round(lookup_hit_us / 1e3, 2),
            "restore": round(restore_s * 1e3, 2),
            "engine_copy": round(engine_restore_s * 1e3, 2),
            "restore_minus_engine_copy": round((restore_s - engine_restore_s) * 1e3, 2),
        },
        "library_phase_ms": ({k: round(v / 1e6, 2) for k, v in library_phases.items()} if library_phases
                             else "not exposed (WorkerStats has no *Ns timers)"),
        "saved_chunks": wstats["SavedChunks"],
        # --layerwise: per restore, start_load_kv to layer 0 released (its
        # attention could start) against the whole restore: the TTFT a
        # forward pass overlapping the copies can gain (a GPU figure).
        "layerwise": ({"first_layer_ms_p50": round(statistics.median(first_layer_ms), 2),
                       "restore_ms_p50": round(statistics.median(whole_ms), 2),
                       "restores": len(first_layer_ms)} if first_layer_ms else None),
        "l1_used_bytes": server.get("kvshim_l1_used_bytes"),
    }
    if cuda:
        result.update({
            "raw_h2d_gbps": round(raw_h2d, 3),
            "raw_d2h_gbps": round(raw_d2h, 3),
            "restore_ratio": ratio(restore_gbps, raw_h2d),
            "save_ratio": ratio(save_gbps, raw_d2h),
            "save_ratio_warm": ratio(result["save_gbps_warm"], raw_d2h),
            "ratio_basis": "one large pinned torch copy (raw_h2d_gbps, raw_d2h_gbps)",
            "restore_vs_engine": ratio(restore_gbps, engine_restore_gbps),
            "engine_restore_ratio": ratio(engine_restore_gbps, raw_h2d),
            "path": "embedded server, shared-memory rings, memfd L1 registered with the driver, CUDA copy engine",
        })
    else:
        result.update({
            "restore_ratio": ratio(restore_gbps, engine_restore_gbps),
            "save_ratio": ratio(save_gbps, engine_save_gbps),
            "ratio_basis": "the host copy engine alone on the same chunks (engine_restore_gbps, engine_save_gbps)",
            "path": "embedded server, shared-memory rings, memfd L1, host copy engine",
        })
    print(f"{len(prompts)} requests, {hit_tokens}/{total_tokens} prompt tokens restored ({result['hit_rate']:.0%}), "
          f"{restored_bytes / 2**30:.2f} GiB at {restore_gbps} GB/s (engine alone {engine_restore_gbps} GB/s), "
          f"lookup p50 {result['lookup_p50_us']} µs, verified: {verified}")
    print(json.dumps(result))
    return 0 if verified and engine_verified else 1
