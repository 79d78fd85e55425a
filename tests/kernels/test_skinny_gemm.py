"""The few-row GEMM (`vllm_rlt.kernels.skinny_gemm`) against fp64 matmuls of the same values,
and its SwiGLU and RoPE epilogues against the separate kernels (`fused_ops`) they replace.

On CPU under the Triton interpreter (fp32 arithmetic, so fp32 results sit within fp32 summation
error of the fp64 product and bf16 results are that product rounded to bf16: at most one bf16 ulp
away); `gpu` variants run the same checks on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_targets import assert_written_alike, nan_caches
from vllm_rlt.kernels import fused_ops, skinny_gemm
from vllm_rlt.kernels.skinny_gemm import SkinnyConfig
from vllm_rlt.models.layers import RotaryEmbedding

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype) / k**0.5
    return x, w


def exact_operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Operands in eighths of [-1, 1]: every partial sum of x @ w.T is exact in fp32, so the
    product is the same bits in any summation order (the interpreter's numpy matmul blocks the
    sum by the operands' shapes, differently on different BLAS kernels)."""
    gen = torch.Generator().manual_seed(seed)
    x, w = (torch.randint(-8, 9, shape, generator=gen) / 8 for shape in ((m, k), (n, k)))
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def assert_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    assert y.dtype == x.dtype and y.shape == exact.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # the exact product rounded to bf16: within one ulp of it
        ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert ((y.double() - exact).abs() <= ulp).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 100, 200), (16, 33, 130), (27, 40, 130)])
def test_skinny_linear_computes_x_times_w_transposed(device, dtype, m, n, k):
    x, w = operands(m, n, k, dtype, device)
    assert_product(skinny_gemm.skinny_linear(x, w), x, w)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_partials_add_up(device):
    # ask for many programs per SM so that K (1100: two uneven splits of 640 and 460) is split
    cfg = SkinnyConfig(programs_per_sm=256)
    x, w = operands(5, 70, 1100, torch.float32, device, seed=1)
    n_blocks = -(-70 // cfg.block_n)
    assert skinny_gemm.num_k_splits(n_blocks, 1100, 1, cfg) == 2
    assert_product(skinny_gemm.skinny_linear(x, w, cfg), x, w)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert_product(skinny_gemm.skinny_linear(xb, wb, cfg), xb, wb)


@pytest.mark.parametrize("device", DEVICES)
def test_the_last_split_adds_the_partials_and_leaves_the_counters_zeroed(device):
    """Three splits per output block; repeated calls (as graph replays are) keep working because
    the split that adds a block's partials resets its arrival counter."""
    cfg = SkinnyConfig(programs_per_sm=256)
    x, w = operands(4, 96, 1536, torch.float32, device, seed=2)
    for _ in range(3):
        assert_product(skinny_gemm.skinny_linear(x, w, cfg), x, w)
    assert not skinny_gemm._counters(x.device).any()


def test_k_splits_fill_the_h200_for_ouro_projections():
    # 132 SMs, 2 programs each: o_proj and down_proj (2048 outputs) split K, gate/up does not
    cfg = SkinnyConfig(block_n=32, block_k=128, programs_per_sm=2, min_k_steps=4)
    blocks = {n: -(-n // cfg.block_n) for n in (2048, 6144, 11264)}
    assert skinny_gemm.num_k_splits(blocks[2048], 2048, 132, cfg) == 4  # K 2048: 512 per split
    assert skinny_gemm.num_k_splits(blocks[2048], 5632, 132, cfg) == 5
    assert skinny_gemm.num_k_splits(blocks[6144], 2048, 132, cfg) == 2
    assert skinny_gemm.num_k_splits(blocks[11264], 2048, 132, cfg) == 1


SPLIT_K = SkinnyConfig(block_k=32, programs_per_sm=256, min_k_steps=1)  # 3 splits of K = 96


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, SPLIT_K], ids=["whole-k", "split-k"])
def test_the_swiglu_epilogue_is_silu_mul_of_the_gemm(device, dtype, config):
    x, gate_up = exact_operands(
        5, 2 * 72, 96, dtype, device, seed=3
    )  # I = 72: a partial last block
    expected = fused_ops.silu_mul(skinny_gemm.skinny_linear(x, gate_up, config))
    assert torch.equal(skinny_gemm.skinny_swiglu(x, gate_up, config), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, SPLIT_K], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 32), ((2, 2), 64)])
def test_the_rope_epilogue_is_rope_of_the_gemm(device, dtype, config, heads, head_dim):
    num_heads, num_kv_heads = heads
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x, w = exact_operands(6, n, 96, dtype, device, seed=4)
    positions = torch.tensor([0, 5, 17, 100, 2, 63], device=device)
    rope = RotaryEmbedding(head_dim, 128, 10000.0).to(device).tables(positions, dtype)
    plain = skinny_gemm.skinny_linear(x, w, config)
    q, k, v = fused_ops.rope_qk_(plain.clone(), *rope, num_heads, num_kv_heads, head_dim)
    fused = skinny_gemm.skinny_qkv_rope(x, w, *rope, num_heads, num_kv_heads, head_dim, config)
    assert torch.equal(fused, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1))
    assert not torch.equal(fused[:, : n // 3], plain[:, : n // 3])  # q really rotated


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, SPLIT_K], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-kv", "fp8-kv"])
def test_the_rope_epilogue_also_does_the_kv_write(device, dtype, config, fp8):
    """With caches and slots, the q/k/v GEMM stores the rotated k and the v heads where
    `write_kv_cache` puts them (FP8 caches: the same bits at their own K and V scales), and
    touches no other cache slot."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x, w = operands(5, n, 96, dtype, device, seed=6)
    positions = torch.tensor([3, 9, 40, 0, 77], device=device)
    rope = RotaryEmbedding(head_dim, 128, 10000.0).to(device).tables(positions, dtype)
    heads = (num_heads, num_kv_heads, head_dim)
    expected_kv, kv, slots = nan_caches(num_kv_heads, head_dim, dtype, device, fp8)
    expected = skinny_gemm.skinny_qkv_rope(x, w, *rope, *heads, config)
    _, k, v = fused_ops.split_qkv(expected, *heads)
    got = skinny_gemm.skinny_qkv_rope(x, w, *rope, *heads, config, kv=(kv, slots))
    assert torch.equal(got, expected)
    assert_written_alike(expected_kv, kv, k, v, slots)
    with pytest.raises(ValueError, match="one slot per row"):
        skinny_gemm.skinny_qkv_rope(x, w, *rope, *heads, config, kv=(kv, slots[:3]))


def test_rope_epilogue_needs_whole_blocks_per_half_head():
    assert skinny_gemm.rope_fits(32) and skinny_gemm.rope_fits(128)
    assert not skinny_gemm.rope_fits(8) and not skinny_gemm.rope_fits(48)
    x, w = operands(2, 4 * 8, 16, torch.float32, "cpu")
    cos = torch.ones(2, 8)
    with pytest.raises(ValueError, match="heads of 8"):
        skinny_gemm.skinny_qkv_rope(x, w, cos, cos, 2, 1, 8)


def test_bad_operands_are_refused():
    x, w = operands(33, 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="1-32 rows"):
        skinny_gemm.skinny_linear(x, w)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(x[:4], w.bfloat16())
    with pytest.raises(ValueError, match="supports"):
        skinny_gemm.skinny_linear(x[:4].double(), w.double())
