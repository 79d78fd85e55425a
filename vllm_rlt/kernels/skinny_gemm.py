"""A GEMM for few rows: y = x @ w.T with x [M <= 32, K] and a weight w [N, K] (nn.Linear layout).

Decode invocations multiply a handful of rows by the shared-layer weights, so the GEMMs only
stream weights: their floor is the weight bytes over the memory bandwidth. cuBLAS reaches 55-62%
of it there (`docs/design/runner.md §4`); its kernel names read as tiles of 64-128 weight
rows, a grid smaller than the GPU for most of Ouro-1.4B's projections. This kernel gives each
program `BLOCK_N` weight rows (coalesced along K) and, when that still leaves too few programs,
splits K: every split writes an fp32 partial and counts itself in an arrival counter of its
output block; the split that arrives last adds the block's partials in split order (so the
result does not depend on timing) and resets the counter. No second launch: the counters live
in a zeroed buffer that every call leaves zeroed, also under CUDA-graph replay. Rows are padded
to 16 for `tl.dot` (the padding costs no memory traffic: x is tiny), or to 32 beyond 16 rows.

Two epilogues fold the element-wise op after a projection into it: `skinny_swiglu` (SwiGLU's
silu(gate) * up from the fused gate/up weight) and `skinny_qkv_rope` (RoPE on the q and k heads
of the fused q/k/v weight, and optionally the KV write of the k and v heads). A program then
streams pairs of weight rows (gate and up row j, or columns j and j + d/2 of one head),
interleaved in its tile, and finishes each pair with the roundings of the separate kernels
(`fused_ops`, `kv_write`): the results are the same bits.

On Hopper GPUs the kernel is launched early (programmatic dependent launch, `pdl.py`): while the
kernel that produces x finishes, each program pulls its first PREFETCH_K weight columns into the
L2. The CUDA default for up to 16 rows (`layer_kernels.SkinnyLayerKernels`; at 24 and 32 rows
an invocation ran faster on cuBLAS, so 17-32 rows take it only in the probes); how to measure
it: `docs/design/runner.md §4`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET, sm_count
from vllm_rlt.kernels.fused_ops import NO_FMA, _round, rotate_halves, silu_times
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.kv_write import check_target, stored
from vllm_rlt.kernels.pdl import (
    launch_options,
    pdl,
    prefetch_l2,
    release_dependents,
    wait_for_primary,
)

MAX_ROWS = 32  # rows of x one launch handles (padded to the dot's minimum M of 16, or to 32)
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


# the kernel's epilogues (`EPILOGUE`); constexpr globals, so that the kernels can read them
PLAIN, SWIGLU, ROPE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _epilogue(
    acc, out_ptr, cos_ptr, sin_ptr, offs_m, m_ok, cols, col_ok, cols_a, a_ok, table_cols,
    rotate, pair_offset, stride_om, stride_cos, stride_sin, kv_head, cache_ptr, slot_ptr,
    cache_cols_a, kv_cols, kv_scale, EPILOGUE: tl.constexpr, FP8_CACHE: tl.constexpr,
):  # fmt: skip
    """Round the fp32 sums to the output dtype and finish them. PLAIN stores them; the paired
    epilogues split the tile's interleaved columns into a (even) and b (odd): SWIGLU stores
    silu(a) * b at a's columns; ROPE rotates the halves a | b (when `rotate`: q and k heads) and
    stores both, a k or v head (`kv_head`, only with the kernel's WRITE_KV) also at each row's
    slot of its cache (slots of kv_cols elements, a at cache_cols_a; FP8 at `kv_scale`). Every
    rounding is the one the separate kernels make."""
    dt = out_ptr.dtype.element_ty
    rows = offs_m[:, None] * stride_om
    y = _round(acc, dt)
    if EPILOGUE == PLAIN:
        tl.store(out_ptr + rows + cols[None, :], y, mask=m_ok[:, None] & col_ok[None, :])
    else:
        a, b = tl.split(tl.reshape(y, [y.shape[0], y.shape[1] // 2, 2]))
        mask = m_ok[:, None] & a_ok[None, :]
        if EPILOGUE == SWIGLU:
            a = silu_times(a, b, tl.float32)
        else:  # ROPE
            if rotate:
                cos = cos_ptr + offs_m[:, None] * stride_cos + table_cols[None, :]
                sin = sin_ptr + offs_m[:, None] * stride_sin + table_cols[None, :]
                cos_lo = tl.load(cos, mask=mask, other=0.0).to(tl.float32)
                sin_lo = tl.load(sin, mask=mask, other=0.0).to(tl.float32)
                cos_hi = tl.load(cos + pair_offset, mask=mask, other=0.0).to(tl.float32)
                sin_hi = tl.load(sin + pair_offset, mask=mask, other=0.0).to(tl.float32)
                a, b = rotate_halves(a, b, cos_lo, sin_lo, cos_hi, sin_hi, tl.float32)
            tl.store(out_ptr + rows + pair_offset + cols_a[None, :], b, mask=mask)
            if kv_head:  # the KV write's stores, of the same values
                slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
                dst = cache_ptr + slot[:, None] * kv_cols + cache_cols_a[None, :]
                tl.store(dst, stored(a, kv_scale, cache_ptr, FP8_CACHE), mask=mask)
                tl.store(dst + pair_offset, stored(b, kv_scale, cache_ptr, FP8_CACHE), mask=mask)
        tl.store(out_ptr + rows + cols_a[None, :], a, mask=mask)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    M,
    N,
    N_W,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_cos,
    stride_sin,
    k_per_split,
    pair_offset,
    rotated_cols,
    kv_cols,
    k_scale,
    v_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    LINE: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    GDC: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    """Program (output block, K split) over BLOCK_N weight rows. PLAIN: rows of N outputs.
    SWIGLU and ROPE: BLOCK_N / 2 pairs of rows `pair_offset` apart (interleaved in the tile):
    gate and up rows (pair_offset = I), or the low and high halves of one head's rows
    (pair_offset = HEAD_DIM / 2; columns below `rotated_cols` are q and k heads, the rest v,
    and with WRITE_KV the last kv_cols of each are also stored at the rows' cache slots);
    N first-of-pair columns in all. The weight has N_W rows."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    PAIRS: tl.constexpr = BLOCK_N // 2
    rotate = False
    table_cols = tl.arange(0, PAIRS)
    kv_head = False  # with WRITE_KV: a k or v head, stored also at cache_ptr, cache_cols_a
    cache_ptr, cache_cols_a, kv_scale = k_cache_ptr, table_cols, k_scale
    if EPILOGUE == ROPE:  # a head's low half holds HEAD_DIM / 2 / PAIRS blocks
        per_head: tl.constexpr = HEAD_DIM // 2 // PAIRS
        head_col = (pid_n // per_head) * HEAD_DIM
        table_cols = (pid_n % per_head) * PAIRS + tl.arange(0, PAIRS)
        cols_a = head_col + table_cols
        rotate = head_col < rotated_cols
        a_ok = table_cols < HEAD_DIM  # all: N / PAIRS programs cover the low halves exactly
        if WRITE_KV:  # q | k | v: k heads start kv_cols before rotated_cols
            kv_head = head_col >= rotated_cols - kv_cols
            cache_ptr = tl.where(rotate, k_cache_ptr, v_cache_ptr)
            kv_scale = tl.where(rotate, k_scale, v_scale)
            cache_cols_a = cols_a - tl.where(rotate, rotated_cols - kv_cols, rotated_cols)
    else:
        cols_a = pid_n * PAIRS + tl.arange(0, PAIRS)
        a_ok = cols_a < N
    if EPILOGUE == PLAIN:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
    else:  # a0, b0, a1, b1, ...
        cols = tl.reshape(tl.join(cols_a, cols_a + pair_offset), [BLOCK_N])
        col_ok = tl.reshape(tl.join(a_ok, a_ok), [BLOCK_N])
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_wn
    if GDC:  # launched early: pull the first weights (no kernel writes them) into the L2
        lines = tl.minimum(k_start + tl.arange(0, PREFETCH_K // LINE) * LINE, K - 1)
        prefetch_l2(w_rows + lines[None, :])
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
        w = tl.load(w_rows + offs_k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter computes bf16 tl.dot wrongly
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    # the weights are read: the kernel after this one may start (it waits for the outputs)
    release_dependents(GDC)
    if SPLIT:
        mask = m_ok[:, None] & col_ok[None, :]
        part = part_ptr + offs_m[:, None] * N_W + cols[None, :]  # split 0's partial
        tl.store(part + pid_k * M * N_W, acc, mask=mask)
        # every thread's part stored, then one gpu-scope release: count this split's arrival
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:  # the last split: every partial is visible
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(tl.num_programs(1)):  # in split order: independent of timing
                acc += tl.load(part + s * M * N_W, mask=mask, cache_modifier=".cg")
            _epilogue(
                acc, out_ptr, cos_ptr, sin_ptr, offs_m, m_ok, cols, col_ok, cols_a, a_ok,
                table_cols, rotate, pair_offset, stride_om, stride_cos, stride_sin, kv_head,
                cache_ptr, slot_ptr, cache_cols_a, kv_cols, kv_scale, EPILOGUE, FP8_CACHE,
            )  # fmt: skip
            tl.store(counter_ptr + pid_n, 0)  # zeroed for the next call
    else:
        _epilogue(
            acc, out_ptr, cos_ptr, sin_ptr, offs_m, m_ok, cols, col_ok, cols_a, a_ok,
            table_cols, rotate, pair_offset, stride_om, stride_cos, stride_sin, kv_head,
            cache_ptr, slot_ptr, cache_cols_a, kv_cols, kv_scale, EPILOGUE, FP8_CACHE,
        )  # fmt: skip


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of one device, zero between calls (each call resets those it used)."""
    return torch.zeros(MAX_COUNTERS, device=device, dtype=torch.int32)


def num_k_splits(num_n_blocks: int, k: int, num_sms: int, cfg: SkinnyConfig) -> int:
    """K splits so the grid reaches about cfg.programs_per_sm programs per SM, each split
    covering at least cfg.min_k_steps K steps."""
    want = triton.cdiv(num_sms * cfg.programs_per_sm, num_n_blocks)
    return max(1, min(want, k // (cfg.min_k_steps * cfg.block_k)))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    m, k = x.shape
    if m > MAX_ROWS or m == 0:
        raise ValueError(f"the few-row GEMM takes 1-{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {x.shape}")
    if x.dtype not in DTYPES:
        raise ValueError(f"the few-row GEMM supports fp16, bf16 and fp32, got {x.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    n_a: int,
    cfg: SkinnyConfig,
    epilogue: tl.constexpr = PLAIN,
    rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    kv: tuple[KVLayer, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One launch over n_a outputs (paired epilogues: first-of-pair columns, cfg.block_n / 2 of
    them per program, so that a program streams as many weight rows as a PLAIN one). rope:
    (cos, signed_sin, rotated columns, head_dim) for ROPE; kv: (a layer's caches, slots) that
    ROPE also stores the k and v heads in."""
    _check(x, weight)
    m, k = x.shape
    n_w = weight.shape[0]
    n_blocks = triton.cdiv(n_a, cfg.block_n if epilogue == PLAIN else cfg.block_n // 2)
    splits = 1
    if n_blocks <= MAX_COUNTERS:
        splits = num_k_splits(n_blocks, k, sm_count(x.device), cfg)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, m, n_w, device=x.device, dtype=torch.float32) if splits > 1 else out
    counters = _counters(x.device) if splits > 1 else out
    cos, sin, rotated_cols, head_dim = rope if rope else (out, out, 0, 0)
    cache, slots = kv if kv else (KVLayer(out, out), out)
    kv_cols = cache.k.shape[2] * cache.k.shape[3] if kv else 0
    # the distance between a pair's rows: gate to up (I), a head's low to high half, or none
    pair_offset = n_a if epilogue == SWIGLU else head_dim // 2
    gdc = pdl(x.device)
    _skinny_gemm_kernel[(n_blocks, splits)](
        x, weight, out, part, counters, cos, sin, cache.k, cache.v, slots, m, n_a, n_w, k,
        x.stride(0), weight.stride(0), out.stride(0), cos.stride(0), sin.stride(0), k_per_split,
        pair_offset, rotated_cols, kv_cols, cache.k_scale, cache.v_scale,
        BLOCK_M=16 if m <= 16 else 32, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=splits > 1,
        UPCAST=INTERPRET, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        LINE=128 // weight.element_size(), PREFETCH_K=PREFETCH_K, GDC=gdc, EPILOGUE=int(epilogue),
        HEAD_DIM=head_dim, WRITE_KV=kv is not None, FP8_CACHE=cache.fp8, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **NO_FMA,
        **launch_options(gdc),
    )  # fmt: skip
    return out


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, contiguous along K) @ weight [N, K].T -> [M, N] in x's dtype;
    fp32 accumulation (fp16, bf16 or fp32 operands)."""
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    return _launch(x, weight, out, weight.shape[0], config or DEFAULT_CONFIG)


def skinny_swiglu(
    x: torch.Tensor, gate_up: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """x [M, K] with the fused weight gate_up [2 I, K] (gate rows, then up rows) ->
    silu(x @ gate.T) * (x @ up.T), [M, I]: `fused_ops.silu_mul` of `skinny_linear`'s output,
    bit for bit, in one launch."""
    inter = gate_up.shape[0] // 2
    out = torch.empty(x.shape[0], inter, device=x.device, dtype=x.dtype)
    return _launch(x, gate_up, out, inter, config or DEFAULT_CONFIG, SWIGLU)


def rope_fits(head_dim: int, config: SkinnyConfig | None = None) -> bool:
    """Whether `skinny_qkv_rope` takes heads of `head_dim` (a whole number of blocks per half)."""
    block = (config or DEFAULT_CONFIG).block_n // 2
    return head_dim % (2 * block) == 0


def skinny_qkv_rope(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    config: SkinnyConfig | None = None,
    kv: tuple[KVLayer, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] @ qkv_weight [(Hq + 2 Hkv) d, K].T with RoPE on the q and k heads:
    `fused_ops.rope_qk_` of `skinny_linear`'s output, bit for bit, in one launch. cos,
    signed_sin: [M, 1, d] or [M, d] in x's dtype (`RotaryEmbedding.tables`). Returns [M, N].
    kv: (a layer's caches [num_blocks, block_size, Hkv, d] in x's dtype or FP8, slot_mapping
    [M]): also does `kv_write.write_kv_cache` of the rotated k and the v heads."""
    cfg = config or DEFAULT_CONFIG
    n = qkv_weight.shape[0]
    if not rope_fits(head_dim, cfg) or n != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv_weight {tuple(qkv_weight.shape)} does not hold heads of {head_dim}")
    if cos.dtype != x.dtype or signed_sin.dtype != x.dtype:
        raise ValueError("the RoPE tables must be in x's dtype")
    if cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("the RoPE tables must be contiguous along head_dim")
    if kv is not None:
        check_target(*kv, x.shape[0], num_kv_heads, head_dim, x.dtype)
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    rope = (cos, signed_sin, (num_heads + num_kv_heads) * head_dim, head_dim)
    # first blocks: the low halves of the heads
    return _launch(x, qkv_weight, out, n // 2, cfg, ROPE, rope, kv)
