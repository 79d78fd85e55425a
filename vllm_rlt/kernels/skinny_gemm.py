"""A GEMM for few rows: y = x @ w.T with x [M <= 16, K] and a weight w [N, K] (nn.Linear layout).

Decode invocations multiply a handful of rows by the shared-layer weights, so the GEMMs only
stream weights: their floor is the weight bytes over the memory bandwidth. cuBLAS reaches 55-62%
of it there (`docs/benchmarks/layer-kernels.md`); its kernel names read as tiles of 64-128 weight
rows, a grid smaller than the GPU for most of Ouro-1.4B's projections. This kernel gives each
program `BLOCK_N` weight rows (coalesced along K) and, when that still leaves too few programs,
splits K: every split writes an fp32 partial and a second launch adds the partials in split
order, so the result does not depend on timing. Rows are padded to 16 for `tl.dot` (the padding
costs no memory traffic: x is tiny).

Experimental: selected by the `skinny` layer-kernel strategy, not a default. On the H200 it
streams the weights ~10% faster than cuBLAS, but the partial-sum launches take that back
(`docs/benchmarks/layer-kernels.md`, measured with `python -m benchmarks.layer_kernels`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET, sm_count
from vllm_rlt.kernels.fused_ops import _round

MAX_ROWS = 16  # rows of x one launch handles (the dot's minimum M)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 32  # weight rows per program
BLOCK_K = 128  # K step
MIN_K_PER_SPLIT = 4 * BLOCK_K  # shortest K range a split covers
PROGRAMS_PER_SM = 2  # split K until the grid holds about this many programs per SM


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:  # the interpreter computes bf16 tl.dot wrongly
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SPLIT:
        part = (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptr + part, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        y = _round(acc, out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, y, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, num_splits, size, BLOCK: tl.constexpr):
    """out[i] = sum over splits s (in order) of part[s, i], over a contiguous [M, N] output."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + s * size + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, _round(acc, out_ptr.dtype.element_ty), mask=ok)


def num_k_splits(num_n_blocks: int, k: int, num_sms: int) -> int:
    """K splits so the grid reaches about PROGRAMS_PER_SM programs per SM, each split covering
    at least MIN_K_PER_SPLIT of K."""
    want = triton.cdiv(num_sms * PROGRAMS_PER_SM, num_n_blocks)
    return max(1, min(want, k // MIN_K_PER_SPLIT))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, contiguous along K) @ weight [N, K].T -> [M, N] in x's dtype;
    fp32 accumulation (fp16, bf16 or fp32 operands)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or m == 0:
        raise ValueError(f"skinny_linear takes 1-{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {x.shape}")
    if x.dtype not in DTYPES:
        raise ValueError(f"skinny_linear supports fp16, bf16 and fp32, got {x.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    n_blocks = triton.cdiv(n, BLOCK_N)
    splits = num_k_splits(n_blocks, k, sm_count(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else out
    _skinny_gemm_kernel[(n_blocks, splits)](
        x, weight, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=splits > 1, UPCAST=INTERPRET,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=4,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, splits, m * n, BLOCK=block)
    return out
