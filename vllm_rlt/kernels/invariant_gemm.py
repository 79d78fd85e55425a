"""A batch-invariant GEMM: y = x @ w.T whose row i depends on x[i] and w alone.

cuBLAS (and `skinny_gemm` below 16 rows) pick kernels, tile shapes and split-K by the number of
rows M, so one row's sums are added in an order that depends on how many other rows share the
call. This kernel fixes everything that shapes a row's arithmetic by the weight's (N, K) and the
dtype only: the tile (`InvariantConfig`), the K step and the order of the K steps, one program
per (row block, column block), no split of K. Rows of different blocks run the same code on the
same tile shape, so a row's result is the same bits whether the call has 1 row or 2,048, and
wherever in its block the row sits (under the Triton interpreter the K steps are sums of
broadcast products, not `tl.dot`: `_ROW_SUMS`). The price: few rows pad a whole row block, and
without a K split a call of few rows has only N / BLOCK_N programs to stream the weights
(docs/design/runner.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class InvariantConfig:
    """The tile of every call on one dtype (never chosen by M)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# 16-bit inputs: tensor-core tiles; fp32 (exactness runs, the CPU interpreter): small ieee tiles
HALF_CONFIG = InvariantConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
FP32_CONFIG = InvariantConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)


# The interpreter's tl.dot is numpy's matmul, and its BLAS may add a row's products in an order
# set by the row's place in the tile: OpenBLAS 0.3.31's Haswell sgemm (on an AMD EPYC) gives one
# row of a [32, 32] @ [32, 32] three different results, at rows 0-5 and 12-17, 6-11 and 18-23,
# and 24-31.
# Under the interpreter a K step is therefore a broadcast product summed along K by numpy, the
# same arithmetic for every row (paged_attention's invariant launches do likewise).
_ROW_SUMS = tl.constexpr(INTERPRET)


def config_for(dtype: torch.dtype) -> InvariantConfig:
    return FP32_CONFIG if dtype == torch.float32 else HALF_CONFIG


@triton.jit
def _invariant_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile: K in BLOCK_K steps from 0, fp32 sums, one rounding."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter computes 16-bit tl.dot wrongly
            x, w = x.to(tl.float32), w.to(tl.float32)
        if _ROW_SUMS:
            acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype, each row independent of the others."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"invariant_linear takes {DTYPES} operands of one dtype, got "
                         f"{x.dtype} and {weight.dtype}")  # fmt: skip
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"shapes {tuple(x.shape)} @ {tuple(weight.shape)}.T do not multiply")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    cfg = config_for(x.dtype)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _invariant_gemm_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=INTERPRET and x.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
