"""The native decode attention (`csrc/decode_attention.cu`) against the torch reference, on a
GPU of compute capability 9.0 or later (`--run-gpu`): every shape it has an instance for, over
NaN-filled caches (a stale or wrong slot read turns the output NaN), split into cluster pieces
or not, over FP8, and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_fp8_kv import _fp8_case
from tests.attention.test_triton_backend import BF16_TOL, _make_case, _rel_err
from vllm_rlt.attention.torch_backend import TorchAttentionBackend
from vllm_rlt.attention.triton_backend import TritonAttentionBackend
from vllm_rlt.kernels import native
from vllm_rlt.kernels.kv_format import KVLayer

pytestmark = pytest.mark.gpu


@pytest.fixture
def native_on(monkeypatch):
    """The native kernels on; `calls` counts the launches they took."""
    if torch.cuda.get_device_capability() < native.MIN_CAPABILITY:
        pytest.skip("the native decode attention needs compute capability 9.0")
    monkeypatch.setattr(native, "MODE", "1")
    found = native.native(torch.device("cuda"))
    assert found.library is not None, found.reason
    calls = []
    launch = native.decode_attention

    def counted(*args, **kwargs):
        took = launch(*args, **kwargs)
        calls.append(took)
        return took

    monkeypatch.setattr(native, "decode_attention", counted)
    return calls


def _decode_rows(rows: int, seed: int) -> list[tuple[int, int]]:
    """Decode rows at positions from 0 (one key) to past 2,500, block edges included."""
    edges = [0, 1, 15, 16, 17, 63, 64, 65, 600, 1023, 2500]
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, 2600, (max(rows - len(edges), 0),), generator=gen).tolist()
    return [(p, 1) for p in (edges + extra)[:rows]]


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, dtype",
    [
        (16, 16, 128, torch.bfloat16),  # Ouro-1.4B
        (8, 4, 64, torch.float16),  # GQA groups of 2
        (8, 2, 128, torch.bfloat16),  # groups of 4
        (4, 4, 64, torch.bfloat16),
        (55, 55, 96, torch.bfloat16),  # Huginn-0125
    ],
)
def test_native_decode_equals_the_torch_reference(native_on, rows, heads, kv_heads, head_dim,
                                                  dtype):  # fmt: skip
    q, k, v, k_cache, v_cache, meta = _make_case(
        _decode_rows(rows, rows), heads, kv_heads, head_dim, 16, dtype, "cuda", seed=rows
    )
    ref = KVLayer(k_cache.clone(), v_cache.clone())
    expected = TorchAttentionBackend().forward(q, k, v, ref, meta)
    got = TritonAttentionBackend().forward(q, k, v, KVLayer(k_cache, v_cache), meta)
    assert native_on == [True]
    assert torch.isfinite(got).all()
    assert _rel_err(got, expected) <= BF16_TOL


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_native_decode_over_fp8(native_on, rows):
    segments = [(600 + 61 * i, 1) for i in range(rows)]
    q, k, v, cache, meta = _fp8_case(segments, torch.bfloat16, 16 + rows, 16, 16, 128, 16)
    ref = cache._replace(k=cache.k.clone(), v=cache.v.clone())
    expected = TorchAttentionBackend().forward(q, k, v, ref, meta)
    got = TritonAttentionBackend().forward(q, k, v, cache, meta)
    assert native_on == [True]
    assert _rel_err(got, expected) <= BF16_TOL


def test_native_decode_in_a_cuda_graph(native_on):
    """Captured once, replayed over new queries: each replay equals an eager launch bit for bit
    (the same kernel on the same pieces)."""
    q, k, v, k_cache, v_cache, meta = _make_case(
        _decode_rows(8, 0), 16, 16, 128, 16, torch.bfloat16, "cuda"
    )
    backend, cache = TritonAttentionBackend(), KVLayer(k_cache, v_cache)
    backend.forward(q, k, v, cache, meta)  # writes this invocation's K/V; warms up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta)
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        graph.replay()
        assert torch.equal(out, backend.forward(q, k, v, cache, meta))
    assert all(native_on) and len(native_on) == 5
