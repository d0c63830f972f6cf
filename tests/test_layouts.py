"""Save blocks and restore them into different block ids, bit-exact, for
every KV layout vLLM hands a connector, with real torch CPU tensors built
the way vLLM builds them (a buffer in the backend's physical order, viewed
in its logical shape) and described by the connector's own code.

CPU tensors stand in for GPU memory: this machine has no GPU
(build/gpu-check.sh runs the CUDA engine on one)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
vllm_connector = pytest.importorskip("kvshim.vllm")  # _tensor_desc: how the connector reports tensors

from rig import BLOCK, CHUNK, Rig  # noqa: E402

NB, H, D, MLA_D = 24, 2, 16, 64


def fa(hnd: bool) -> torch.Tensor:
    """FlashAttention (2, blocks, block_size, heads, head); HND stores heads before tokens."""
    if hnd:
        return torch.empty(2, NB, H, BLOCK, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    return torch.empty(2, NB, BLOCK, H, D, dtype=torch.bfloat16)


def flashinfer(hnd: bool) -> torch.Tensor:
    """FlashInfer (blocks, 2, block_size, heads, head)."""
    if hnd:
        return torch.empty(NB, 2, H, BLOCK, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    return torch.empty(NB, 2, BLOCK, H, D, dtype=torch.bfloat16)


def mla() -> torch.Tensor:
    return torch.empty(NB, BLOCK, MLA_D, dtype=torch.bfloat16)


LAYOUTS = {
    "flash_attn NHD": (lambda: fa(False), 1),
    "flash_attn HND": (lambda: fa(True), 1),
    "flashinfer NHD": (lambda: flashinfer(False), 0),
    "flashinfer HND": (lambda: flashinfer(True), 0),
    "mla": (mla, 0),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_round_trip_into_other_blocks(name):
    make, block_dim = LAYOUTS[name]
    layers = [make() for _ in range(3)]
    gen = torch.Generator().manual_seed(hash(name) & 0xFFFF)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
    descs = [vllm_connector._tensor_desc(f"model.layers.{i}.attn", t, 0) for i, t in enumerate(layers)]
    if not name.startswith("mla"):
        assert not layers[0].is_contiguous() or "NHD" in name  # HND views are strided, not copied
    rig = Rig(f"lay-{uuid.uuid4().hex[:8]}", list(zip(layers, descs)), mla=name == "mla")
    try:
        tokens = np.arange(7, 7 + 2 * CHUNK + 3, dtype=np.uint32)  # 2 full chunks + a tail
        src, dst = [3, 4, 5, 6, 7], [17, 12, 20, 9, 1]  # dst: scattered, in another order
        before = [t.clone() for t in layers]
        rig.save("a", tokens, src)
        n, errors = rig.restore("b", tokens, dst)
        assert n == 2 * CHUNK and errors == []
        loaded = 2 * CHUNK // BLOCK
        for t, b in zip(layers, before):
            got = t.index_select(block_dim, torch.tensor(dst[:loaded]))
            want = b.index_select(block_dim, torch.tensor(src[:loaded]))
            assert torch.equal(got, want), name
            untouched = [i for i in range(NB) if i not in dst[:loaded]]
            assert torch.equal(t.index_select(block_dim, torch.tensor(untouched)),
                               b.index_select(block_dim, torch.tensor(untouched)))
    finally:
        rig.close()


def test_inconsistent_geometry_is_refused_with_layer_and_field():
    t = fa(False)
    d = vllm_connector._tensor_desc("model.layers.0.attn", t, 0)
    d["stride_bytes"][1] = 7  # blocks overlapping each other
    from kvshim.errors import KVShimError

    with pytest.raises(KVShimError, match=r'layer "model.layers.0.attn"'):
        Rig(f"bad-{uuid.uuid4().hex[:8]}", [(t, d)]).close()
