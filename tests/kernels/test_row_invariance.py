"""Every kernel on the batch-invariant path gives a row the same bits whatever the number of rows
in its launch (1 row up to the largest graph bucket, 2,048 rows, on the GPU; a few on the CPU
interpreter): the fused norms, RoPE, SwiGLU activation, exit gate and KV write. The GEMM and
attention have their own tests (test_invariant_gemm.py, attention/test_invariant_attention.py).
"""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.kernels import fused_ops
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.kv_write import write_kv_cache
from vllm_rlt.models.layers import RotaryEmbedding

GPU_ROWS = [1, 2, 3, 7, 8, 16, 17, 64, 100, 128, 512, 1000, 2048]
TARGETS = [  # device, dtype, hidden, heads (q, kv, head dim), row counts
    pytest.param("cpu", torch.float32, 64, (4, 2, 16), [1, 3, 17]),
    pytest.param("cuda", torch.bfloat16, 2048, (16, 16, 128), GPU_ROWS, marks=pytest.mark.gpu),
]


def _pool(device, dtype, rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device,dtype,hidden,heads,rows", TARGETS)
def test_norms_gate_and_swiglu(device, dtype, hidden, heads, rows):
    n = max(rows)
    h, y = _pool(device, dtype, n, hidden, 0), _pool(device, dtype, n, hidden, 1)
    w1, w2 = (_pool(device, dtype, 2, hidden, 2) + 1).unbind(0)
    gate_w, gate_b = _pool(device, dtype, 1, hidden, 3), _pool(device, dtype, 1, 1, 4)[0]
    gate_up = _pool(device, dtype, n, 6 * hidden, 5)
    ops = {
        "rms_norm": lambda m: (fused_ops.rms_norm(h[:m], w1, 1e-6),),
        "add_rms_norm": lambda m: fused_ops.add_rms_norm(h[:m], y[:m], w1, 1e-6, w2, 1e-5),
        "gate": lambda m: (fused_ops.gate_logits(h[:m], gate_w, gate_b),),
        "silu_mul": lambda m: (fused_ops.silu_mul(gate_up[:m]),),
    }
    for name, op in ops.items():
        full = op(n)
        for m in rows:
            for got, want in zip(op(m), full, strict=True):
                assert torch.equal(got, want[:m]), (name, m)


@pytest.mark.parametrize("device,dtype,hidden,heads,rows", TARGETS)
def test_rope_and_kv_write(device, dtype, hidden, heads, rows):
    num_heads, num_kv_heads, head_dim = heads
    n = max(rows)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _pool(device, dtype, n, width, 6)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0).to(device)
    positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(7))
    cos, sin = rotary.tables(positions.to(device), dtype)

    def rope(m):
        q, k, v = fused_ops.rope_qk_(qkv[:m].clone(), cos[:m], sin[:m], num_heads, num_kv_heads,
                                     head_dim)  # fmt: skip
        cache = torch.zeros(n, 1, num_kv_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.zeros_like(cache)
        write_kv_cache(k, v, KVLayer(cache, v_cache), torch.arange(m, device=device))
        return q, k, cache[:m, 0], v_cache[:m, 0]

    full = rope(n)
    for m in rows:
        for got, want in zip(rope(m), full, strict=True):
            assert torch.equal(got, want[:m]), m
