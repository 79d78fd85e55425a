"""The batch-invariant GEMM (`vllm_rlt.kernels.invariant_gemm`): each row's result is the same
bits whatever the number of rows in the call and wherever the row sits, and it is the product.

On CPU under the Triton interpreter; the `gpu` variants run the same checks on CUDA, where they
are the ones that matter (tensor-core tiles, the engine's graph buckets' row counts)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_skinny_gemm import assert_product, operands
from vllm_rlt.kernels.invariant_gemm import config_for, invariant_linear

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (37, 100, 200), (70, 33, 130)])
def test_invariant_linear_computes_x_times_w_transposed(device, dtype, m, n, k):
    x, w = operands(m, n, k, dtype, device)
    assert_product(invariant_linear(x, w), x, w)


def _rows_alone_and_batched(device, dtype, n, k, row_counts):
    """Every row count's result for rows of one pool, and the pool's rows computed one at a
    time."""
    pool, w = operands(max(row_counts), n, k, dtype, device, seed=3)
    alone = torch.cat([invariant_linear(pool[i : i + 1], w) for i in range(pool.shape[0])])
    return pool, w, alone


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_other_rows(device, dtype):
    block = config_for(dtype).block_m
    counts = [1, 2, 5, block - 1, block, block + 1, 2 * block + 3]
    pool, w, alone = _rows_alone_and_batched(device, dtype, 96, 200, counts)
    for m in counts:
        for start in (0, 1):  # the same rows at another offset in their row block
            rows = pool[start : start + m]
            if rows.shape[0] < m:
                continue
            assert torch.equal(invariant_linear(rows, w), alone[start : start + m]), (m, start)
    noise = pool.clone()
    noise[1:] = torch.randn_like(noise[1:]) * 100  # other rows' values do not leak into row 0
    assert torch.equal(invariant_linear(noise, w)[0], alone[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 2048), (2048, 5632), (16384, 2048)])
def test_row_invariance_over_the_graph_buckets_on_cuda(dtype, n, k):
    # Ouro-1.4B's projections (fused q/k/v, o, down, gate/up) at every row count an engine
    # invocation can have, up to the largest graph bucket
    pool, w, alone = _rows_alone_and_batched("cuda", dtype, n, k, [2048])
    for m in list(range(1, 33)) + [48, 64, 100, 128, 255, 512, 1000, 1024, 2048]:
        assert torch.equal(invariant_linear(pool[:m], w), alone[:m]), m


def test_rejects_mixed_dtypes_and_bad_shapes():
    x, w = operands(2, 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(x, w.double())
    with pytest.raises(ValueError, match="do not multiply"):
        invariant_linear(x, w[:, :8])
    assert invariant_linear(x[:0], w).shape == (0, 8)
