"""The few-row GEMM (`vllm_rlt.kernels.skinny_gemm`) against fp64 matmuls of the same values.

On CPU under the Triton interpreter (fp32 arithmetic, so fp32 results sit within fp32 summation
error of the fp64 product and bf16 results are that product rounded to bf16: at most one bf16 ulp
away); `gpu` variants run the same checks on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.kernels import skinny_gemm
from vllm_rlt.kernels.skinny_gemm import SkinnyConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype) / k**0.5
    return x, w


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
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 100, 200), (16, 33, 130)])
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


def test_bad_operands_are_refused():
    x, w = operands(17, 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="1-16 rows"):
        skinny_gemm.skinny_linear(x, w)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(x[:4], w.bfloat16())
    with pytest.raises(ValueError, match="supports"):
        skinny_gemm.skinny_linear(x[:4].double(), w.double())
