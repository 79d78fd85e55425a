"""The fused Triton kernels against the torch ops they replace (`vllm_rlt.models.layers`).

On CPU they run under the Triton interpreter; `gpu` variants run the same checks on CUDA. RoPE has
no reduction and must match bit for bit in every dtype. RMSNorm and SwiGLU differ only in the
summation order of the sum of squares and in the exp of silu: fp32 within a few ulps (rel 1e-6),
fp64 within 1e-14, and bf16 equal to the torch result in almost every entry and never more than
one bf16 ulp away. The exit gate's dot product is checked against the exact sum.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_targets import assert_written_alike, nan_caches
from vllm_rlt.kernels import fused_ops
from vllm_rlt.models.layers import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float64]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def assert_matches_torch(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.bfloat16:
        a, b = actual.double(), expected.double()
        ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - 7)
        assert ((a - b).abs() <= ulp).all()
        assert (a == b).double().mean() > 0.98
    else:
        tol = 1e-6 if expected.dtype == torch.float32 else 1e-14
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def make_norm(hidden: int, eps: float, dtype: torch.dtype, device: str, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data.copy_(torch.rand(hidden, generator=gen) + 0.5)
    return norm


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 2048])
def test_rms_norm_and_add_rms_norm(device, dtype, hidden):
    """Odd and model-size rows; inputs are column slices of wider tensors (row strides != H)."""
    norm_a, norm_b = (make_norm(hidden, eps, dtype, device, s) for s, eps in ((1, 1e-6), (2, 1e-5)))
    x = randn(7, hidden + 5, dtype=dtype, device=device, seed=3, scale=3.0)[:, 5:]
    h = randn(7, hidden + 3, dtype=dtype, device=device, seed=4)[:, :hidden]
    assert_matches_torch(fused_ops.rms_norm(x, norm_a.weight, norm_a.eps), norm_a(x))
    out, normed = fused_ops.add_rms_norm(h, x, norm_a.weight, norm_a.eps, norm_b.weight, 1e-5)
    expected_out = h + norm_a(x)
    assert_matches_torch(out, expected_out)
    assert_matches_torch(normed, norm_b(out))  # the next norm reads the fused sum
    assert not out.equal(h)  # the residual was added, h itself untouched
    assert torch.equal(h, randn(7, hidden + 3, dtype=dtype, device=device, seed=4)[:, :hidden])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 2, 8), (3, 3, 12), (16, 4, 128)],  # GQA; head_dim/2 not a power of 2; two head blocks
)
def test_rope_qk_matches_torch_exactly(device, dtype, num_heads, num_kv_heads, head_dim):
    rows = 5
    rotary = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    positions = torch.tensor([0, 1, 17, 511, 4095], device=device)
    cos, signed_sin = rotary.tables(positions, dtype)
    cols = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(rows, cols + 4, dtype=dtype, device=device, seed=5, scale=2.0)[:, 2:-2]
    original = qkv.clone()
    q, k, v = fused_ops.rope_qk_(qkv, cos, signed_sin, num_heads, num_kv_heads, head_dim)
    q_ref, k_ref, v_ref = original.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1
    )
    heads = (rows, -1, head_dim)
    assert torch.equal(q, RotaryEmbedding.apply((cos, signed_sin), q_ref.reshape(heads)))
    assert torch.equal(k, RotaryEmbedding.apply((cos, signed_sin), k_ref.reshape(heads)))
    assert torch.equal(v, v_ref.reshape(heads))
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place, returned as views
    assert not torch.equal(q, q_ref.reshape(heads))  # positions > 0 really rotate


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-kv", "fp8-kv"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 2, 8), (3, 3, 12), (16, 4, 128)],  # head blocks straddling q | k | v in the last
)
def test_rope_qk_also_does_the_kv_write(device, dtype, fp8, num_heads, num_kv_heads, head_dim):
    """With caches and slots, RoPE stores the rotated k and the v heads where `write_kv_cache`
    puts them (FP8 caches: the same bits at their own K and V scales), touches no other cache
    slot, and rotates q and k as without them."""
    rows = 5
    rotary = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    rope = rotary.tables(torch.tensor([0, 1, 17, 511, 4095], device=device), dtype)
    heads = (num_heads, num_kv_heads, head_dim)
    qkv = randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device,
                seed=9, scale=2.0)  # fmt: skip
    expected_kv, kv, slots = nan_caches(num_kv_heads, head_dim, dtype, device, fp8)
    expected = qkv.clone()
    _, k, v = fused_ops.rope_qk_(expected, *rope, *heads)
    fused_ops.rope_qk_(qkv, *rope, *heads, kv=(kv, slots))
    assert torch.equal(qkv, expected)
    assert_written_alike(expected_kv, kv, k, v, slots)
    with pytest.raises(ValueError, match="one slot per row"):
        fused_ops.rope_qk_(qkv, *rope, *heads, kv=(kv, slots[:3]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [40, 1500])  # one and two column blocks
def test_silu_mul(device, dtype, intermediate):
    gate_up = randn(6, 2 * intermediate, dtype=dtype, device=device, seed=6, scale=3.0)
    gate, up = gate_up.chunk(2, dim=1)
    expected = torch.nn.functional.silu(gate) * up
    assert_matches_torch(fused_ops.silu_mul(gate_up), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 2048])
def test_gate_logits_within_the_summation_bound(device, dtype, hidden):
    """The exit gate's logit in the accumulation dtype, against the exact dot product: within
    the bound gamma_(n+1) * sum |terms| of any summation order (the bf16 and fp64 products are
    exact in the accumulation dtype; fp32 products add one rounding each, u |x_i w_i|)."""
    gate = torch.nn.Linear(hidden, 1).to(device=device, dtype=dtype)
    x = randn(7, hidden + 5, dtype=dtype, device=device, seed=8, scale=2.0)[:, 5:]
    got = fused_ops.gate_logits(x, gate.weight, gate.bias)
    acc = torch.promote_types(dtype, torch.float32)
    assert got.dtype == acc and got.shape == (7,)
    terms = x.double() * gate.weight.double()
    exact = terms.sum(1) + gate.bias.double()
    u = torch.finfo(acc).eps / 2
    n = hidden + 1
    bound = n * u / (1 - n * u) * (terms.abs().sum(1) + gate.bias.double().abs())
    if dtype == torch.float32:
        bound += u * terms.abs().sum(1)
    assert ((got.double() - exact).abs() <= bound).all()
    assert fused_ops.gate_logits(x[:0], gate.weight, gate.bias).shape == (0,)


def test_empty_rows_and_bad_inputs():
    norm = make_norm(16, 1e-6, torch.float32, "cpu", 0)
    assert fused_ops.rms_norm(torch.empty(0, 16), norm.weight, 1e-6).shape == (0, 16)
    assert fused_ops.silu_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="norm weights"):
        fused_ops.rms_norm(torch.ones(2, 16, dtype=torch.bfloat16), norm.weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous along n"):
        fused_ops.rms_norm(torch.ones(16, 2).t(), norm.weight, 1e-6)
    cos = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="columns"):
        fused_ops.rope_qk_(torch.ones(2, 40), cos, cos, 2, 2, 8)
    with pytest.raises(ValueError, match="one logit"):
        fused_ops.gate_logits(torch.ones(2, 16), torch.ones(2, 16), torch.ones(2))
