"""Save blocks and restore them into different block ids, bit-exact, for
every KV layout vLLM hands a connector, with real torch CPU tensors built
the way vLLM builds them (a buffer in the backend's physical order, viewed
in its logical shape) and described by the connector's own code.

CPU tensors stand in for GPU memory: this machine has no GPU
(build/gpu-check.sh runs the CUDA engine on one)."""

from __future__ import annotations

import ctypes.util
import json
import os
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from kvshim import errors, native

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")
vllm_connector = pytest.importorskip("kvshim.vllm.worker")  # _raw: what the connector reads of a tensor

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


def describe(layers: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The descriptors the connector registers for these tensors (no KV-cache
    groups): its _raw facts, decided in Go (kvshim_vllm_tensors)."""
    return native.vllm_tensors({"block_size": BLOCK, "groups": [],
                                "tensors": [vllm_connector._raw(name, t) for name, t in layers.items()]})


def desc(name: str, t: torch.Tensor) -> dict[str, Any]:
    (d,) = describe({name: t})
    return d


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
    descs = describe({f"model.layers.{i}.attn": t for i, t in enumerate(layers)})
    assert [d["layer"] for d in descs] == [f"model.layers.{i}.attn" for i in range(3)]
    if not name.startswith("mla"):
        assert not layers[0].is_contiguous() or "NHD" in name  # HND views are strided, not copied
    rig = Rig(f"lay-{uuid.uuid4().hex[:8]}", list(zip(layers, descs)), mla=name == "mla")
    try:
        tokens = np.arange(7, 7 + 2 * CHUNK + 3, dtype=np.uint32)  # 2 full chunks + a tail
        src, dst = [3, 4, 5, 6, 7], [17, 12, 20, 9, 1]  # dst: scattered, in another order
        before = [t.clone() for t in layers]
        rig.save("a", tokens, src)
        n, load_errors = rig.restore("b", tokens, dst)
        assert n == 2 * CHUNK and load_errors == []
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


def worker_handle():
    """A worker handle with no server: registration needs none."""
    from kvshim import native

    ns = {"model": "t", "dtype": "bfloat16", "layout": "x", "world_size": 1, "chunk_size": CHUNK}
    return native.Handle(json.dumps({"role": "worker", "server": "/nonexistent/kvshim.sock", "namespace": ns}))


def register(h, descs) -> None:
    from kvshim import native

    h.check(native.library().kvshim_worker_register(h.value, json.dumps(descs).encode()))


def test_inconsistent_geometry_is_refused_with_layer_and_field():
    t = fa(False)
    d = desc("model.layers.0.attn", t)
    d["stride_bytes"][1] = 7  # blocks overlapping each other
    with worker_handle() as h:
        with pytest.raises(errors.InvalidArgumentError, match=r'layer "model.layers.0.attn"') as e:
            register(h, [d])
        assert e.value.code == errors.EINVAL


def test_registered_twice_is_an_invalid_argument():
    t = fa(False)
    d = desc("model.layers.0.attn", t)
    with worker_handle() as h:
        register(h, [d])
        with pytest.raises(errors.InvalidArgumentError, match="registered twice"):
            register(h, [d])


@pytest.mark.skipif(bool(os.environ.get("KVSHIM_LIBCUDA") or ctypes.util.find_library("cuda")),
                    reason="a CUDA driver is loadable here")
def test_gpu_cache_without_a_driver_is_not_supported():
    t = fa(False)
    d = {**desc("model.layers.0.attn", t), "device": "cuda:0"}
    with worker_handle() as h:
        with pytest.raises(errors.NotSupportedError, match="cuda") as e:
            register(h, [d])
        assert e.value.code == errors.ENOTSUP
        register(h, [desc("model.layers.0.attn", t)])  # the host engine still works


def test_a_shape_no_backend_has_is_refused_naming_the_tensor():
    # a ValueError, as the connector's own check was
    with pytest.raises(errors.InvalidArgumentError, match=r'tensors\[0\]\.shape: KV tensor "x": unsupported shape \[24, 7\]'):
        desc("x", torch.empty(NB, 7))
