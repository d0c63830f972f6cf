#!/usr/bin/env python3
"""Write KV-tensor descriptors exactly as the kvshim connector reports them.

With PyTorch, the tensors are real (allocated the way vLLM does: a buffer in
the backend's physical order, permuted to its logical shape) on --device
(cpu or cuda:N), and every field comes from the tensor itself. Without
PyTorch (--emulate, or torch missing) the same tensors are described with
pure-Python stride arithmetic. layout's TestTorchGeometry reads the file
(KVSHIM_TORCH_GEOMETRY=path) and checks the run structure and span counts
listed under "expect".

usage: torch_geometry.py [--device cuda:0] [--emulate] OUT.json
"""
import json
import sys

NB, BS, H, D, L = 8, 16, 2, 8, 3  # small: 8 blocks of 16 tokens, 2 heads of 8
MLA_D = 64
K = 4  # blocks per chunk -> chunk_tokens = 64
RUN = BS * H * D * 2  # bytes of one (block, layer, K|V) run at bf16


class FakeTensor:
    """Just enough of torch.Tensor for descriptors: a strided view."""

    _next = 1 << 32

    def __init__(self, shape, stride=None, ptr=None, storage=None, esize=2):
        self.shape = list(shape)
        if stride is None:
            stride, acc = [], 1
            for n in reversed(shape):
                stride.insert(0, acc)
                acc *= n
        self._stride = list(stride)
        self.esize = esize
        if ptr is None:
            n = 1
            for s in shape:
                n *= s
            ptr = FakeTensor._next
            FakeTensor._next += (n * esize + 4095) // 4096 * 4096 + 4096
            storage = (ptr, n * esize)
        self.ptr, self.storage = ptr, storage
        self.device = "cpu"

    def permute(self, *order):
        return FakeTensor([self.shape[i] for i in order], [self._stride[i] for i in order],
                          self.ptr, self.storage, self.esize)

    def select0(self, i):  # t[i]
        return FakeTensor(self.shape[1:], self._stride[1:], self.ptr + i * self._stride[0] * self.esize,
                          self.storage, self.esize)

    def select1(self, i):  # t[:, i]
        return FakeTensor(self.shape[:1] + self.shape[2:], self._stride[:1] + self._stride[2:],
                          self.ptr + i * self._stride[1] * self.esize, self.storage, self.esize)


def make_backend(emulate, device):
    if emulate:
        return (lambda shape: FakeTensor(shape)), "emulated"
    import torch

    alive = []  # a freed tensor's memory is reused by the next one: keep them all

    def alloc(shape):
        alive.append(torch.empty(shape, dtype=torch.bfloat16, device=device))
        return alive[-1]

    return alloc, "torch " + torch.__version__


def select0(t, i):
    return t.select0(i) if isinstance(t, FakeTensor) else t[i]


def select1(t, i):
    return t.select1(i) if isinstance(t, FakeTensor) else t[:, i]


def describe(name, t, backend, dims=None, group=0):
    if isinstance(t, FakeTensor):
        ptr, esize, shape, stride = t.ptr, t.esize, t.shape, t._stride
        sptr, sbytes, dev = t.storage[0], t.storage[1], "cpu"
    else:
        ptr, esize, shape, stride = t.data_ptr(), t.element_size(), list(t.shape), list(t.stride())
        st = t.untyped_storage()
        sptr, sbytes, dev = st.data_ptr(), st.nbytes(), str(t.device)
        if dev == "cuda":
            dev = "cuda:0"
    d = {"layer": name, "group": group, "backend": backend, "device": dev, "data_ptr": ptr,
         "dtype_size": esize, "shape": shape, "stride_bytes": [s * esize for s in stride],
         "storage_ptr": sptr, "storage_bytes": sbytes}
    if dims:
        d["dims"] = dims
    return d


def cases(alloc):
    out = []
    fa_dims = None

    def add(name, tensors, runs, block_bytes, consec_spans, scattered_spans):
        out.append({"name": name, "tensors": tensors, "expect": {
            "runs_per_block": runs, "block_bytes": block_bytes,
            "consecutive_spans": consec_spans, "scattered_spans": scattered_spans}})

    # vLLM 0.33 (allocate_kv_cache): one buffer, a (NB, H, BS, K|V) view
    # per layer. LBNHC, the default: physical (L, NB, BS, H, 2D).
    lb = alloc((L, NB, BS, H, 2 * D))
    add("paged_lbnhc", [describe(f"layers.{i}", select0(lb, i).permute(0, 2, 1, 3), "paged") for i in range(L)],
        L, 2 * L * RUN, L, L * K)
    # BLNHC: all layers of a block side by side, physical (NB, L, BS, H, 2D);
    # together the views tile each block: copied as one run per block.
    bl = alloc((NB, L, BS, H, 2 * D))
    add("paged_blnhc", [describe(f"layers.{i}", select1(bl, i).permute(0, 2, 1, 3), "paged") for i in range(L)],
        1, 2 * L * RUN, 1, K)
    # FlashAttention NHD (vLLM <= 0.32): (2, NB, BS, H, D) allocated as is.
    add("flash_attn_nhd", [describe(f"layers.{i}", alloc((2, NB, BS, H, D)), "flash_attn") for i in range(L)],
        2 * L, 2 * L * RUN, 2 * L, 2 * L * K)
    # FlashAttention HND: physical (2, NB, H, BS, D), logical view permuted.
    add("flash_attn_hnd", [describe(f"layers.{i}", alloc((2, NB, H, BS, D)).permute(0, 1, 3, 2, 4), "flash_attn")
                           for i in range(L)], 2 * L, 2 * L * RUN, 2 * L, 2 * L * K)
    # FlashInfer NHD / HND: (NB, 2, BS, H, D); K and V of a block are adjacent.
    add("flashinfer_nhd", [describe(f"layers.{i}", alloc((NB, 2, BS, H, D)), "flashinfer") for i in range(L)],
        L, 2 * L * RUN, L, L * K)
    add("flashinfer_hnd", [describe(f"layers.{i}", alloc((NB, 2, H, BS, D)).permute(0, 1, 3, 2, 4), "flashinfer")
                           for i in range(L)], L, 2 * L * RUN, L, L * K)
    # MLA: (NB, BS, head).
    add("mla", [describe(f"layers.{i}", alloc((NB, BS, MLA_D)), "mla") for i in range(L)],
        L, L * BS * MLA_D * 2, L, L * K)
    # Cross-layer, FlashAttention's logical order (layers, 2, NB, BS, H, D)
    # over a block-major buffer: NHD physical (NB, L, 2, BS, H, D) ...
    cl_dims = ["layers", "kv", "blocks", "block_size", "heads", "head"]
    add("cross_layer_nhd", [describe("kv_cache", alloc((NB, L, 2, BS, H, D)).permute(1, 2, 0, 3, 4, 5), "cross_layer", cl_dims)],
        1, 2 * L * RUN, 1, K)
    # ... and HND physical (NB, H, L, 2, BS, D).
    add("cross_layer_hnd", [describe("kv_cache", alloc((NB, H, L, 2, BS, D)).permute(2, 3, 0, 4, 1, 5), "cross_layer", cl_dims)],
        1, 2 * L * RUN, 1, K)
    # Per-layer FlashAttention views into one block-major buffer: they tile
    # each block, so they are copied as the cross-layer tensor they are.
    buf = alloc((NB, L, 2, BS, H, D))
    add("per_layer_views_of_cross_buffer",
        [describe(f"layers.{i}", select1(buf, i).permute(1, 0, 2, 3, 4), "flash_attn") for i in range(L)],
        1, 2 * L * RUN, 1, K)
    return out


def main():
    args = sys.argv[1:]
    device, emulate = "cpu", False
    while args and args[0].startswith("--"):
        a = args.pop(0)
        if a == "--device":
            device = args.pop(0)
        elif a == "--emulate":
            emulate = True
    if not emulate:
        try:
            import torch  # noqa: F401
        except ImportError:
            emulate = True
    alloc, source = make_backend(emulate, device)
    doc = {"source": source, "chunk_tokens": K * BS, "consecutive_ids": list(range(2, 2 + K)),
           "scattered_ids": [7, 1, 4, 2][:K], "cases": cases(alloc)}
    with open(args[0], "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {len(doc['cases'])} cases ({source}) to {args[0]}")


if __name__ == "__main__":
    main()
