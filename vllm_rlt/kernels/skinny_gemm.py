"""A GEMM for few rows: y = x @ w.T with x [M <= 16, K] and a weight w [N, K] (nn.Linear layout).

Decode invocations multiply a handful of rows by the shared-layer weights, so the GEMMs only
stream weights: their floor is the weight bytes over the memory bandwidth. cuBLAS reaches 55-62%
of it there (`docs/benchmarks/layer-kernels.md`); its kernel names read as tiles of 64-128 weight
rows, a grid smaller than the GPU for most of Ouro-1.4B's projections. This kernel gives each
program `BLOCK_N` weight rows (coalesced along K) and, when that still leaves too few programs,
splits K: every split writes an fp32 partial and counts itself in an arrival counter of its
output block; the split that arrives last adds the block's partials in split order (so the
result does not depend on timing) and resets the counter. No second launch: the counters live
in a zeroed buffer that every call leaves zeroed, also under CUDA-graph replay. Rows are padded
to 16 for `tl.dot` (the padding costs no memory traffic: x is tiny).

On Hopper GPUs the kernel is launched early (programmatic dependent launch, `pdl.py`): while the
kernel that produces x finishes, each program pulls its first PREFETCH_K weight columns into the
L2. The CUDA default for up to 16 rows (`layer_kernels.SkinnyLayerKernels`); measurements in
`docs/benchmarks/layer-kernels.md` and `decode-sweep.md`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET, sm_count
from vllm_rlt.kernels.fused_ops import _round
from vllm_rlt.kernels.pdl import pdl, prefetch_l2, wait_for_primary

MAX_ROWS = 16  # rows of x one launch handles (the dot's minimum M)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PREFETCH_K = 256  # K columns of its weight rows a program pulls into the L2 when launched early
MAX_COUNTERS = 4096  # output blocks of one launch whose split arrivals a device buffer counts


@dataclass(frozen=True)
class SkinnyConfig:
    """Compile-time shape of one launch and how far K is split."""

    block_n: int = 32  # weight rows per program
    block_k: int = 128  # K step
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 2  # split K until the grid holds about this many programs per SM
    min_k_steps: int = 4  # shortest K range of a split, in K steps


DEFAULT_CONFIG = SkinnyConfig()


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
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
    LINE: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    GDC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if GDC:  # launched early: pull the first weights (no kernel writes them) into the L2
        n_safe = tl.where(n_ok, offs_n, 0).to(tl.int64) * stride_wn
        lines = tl.minimum(k_start + tl.arange(0, PREFETCH_K // LINE) * LINE, K - 1)
        prefetch_l2(w_ptr + n_safe[:, None] + lines[None, :])
        wait_for_primary(GDC)  # x is the output of the kernel before this one
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
    mn_ok = m_ok[:, None] & n_ok[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT:
        part = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + part, acc, mask=mn_ok)
        # every thread's part stored, then one gpu-scope release: count this split's arrival
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:  # the last split: every partial is visible
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(tl.num_programs(1)):
                total += tl.load(part_ptr + s * M * N + part, mask=mn_ok, cache_modifier=".cg")
            tl.store(o_ptrs, _round(total, out_ptr.dtype.element_ty), mask=mn_ok)
            tl.store(counter_ptr + pid_n, 0)  # zeroed for the next call
    else:
        tl.store(o_ptrs, _round(acc, out_ptr.dtype.element_ty), mask=mn_ok)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of one device, zero between calls (each call resets those it used)."""
    return torch.zeros(MAX_COUNTERS, device=device, dtype=torch.int32)


def num_k_splits(num_n_blocks: int, k: int, num_sms: int, cfg: SkinnyConfig) -> int:
    """K splits so the grid reaches about cfg.programs_per_sm programs per SM, each split
    covering at least cfg.min_k_steps K steps."""
    want = triton.cdiv(num_sms * cfg.programs_per_sm, num_n_blocks)
    return max(1, min(want, k // (cfg.min_k_steps * cfg.block_k)))


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, contiguous along K) @ weight [N, K].T -> [M, N] in x's dtype;
    fp32 accumulation (fp16, bf16 or fp32 operands)."""
    cfg = config or DEFAULT_CONFIG
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
    n_blocks = triton.cdiv(n, cfg.block_n)
    splits = 1
    if n_blocks <= MAX_COUNTERS:
        splits = num_k_splits(n_blocks, k, sm_count(x.device), cfg)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32) if splits > 1 else out
    counters = _counters(x.device) if splits > 1 else out
    gdc = pdl(x.device)
    _skinny_gemm_kernel[(n_blocks, splits)](
        x, weight, out, part, counters, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        k_per_split,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=splits > 1,
        UPCAST=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        LINE=128 // weight.element_size(), PREFETCH_K=PREFETCH_K, GDC=gdc, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({"launch_pdl": True} if gdc else {}),
    )  # fmt: skip
    return out
