"""Triton kernels for a decoder layer's element-wise work, one launch each.

- `rms_norm`: RMSNorm of every row.
- `add_rms_norm`: the sandwich-norm residual step `out = h + norm_a(y)` together with the norm that
  follows it, `norm_b(out)` (the next block's input norm); both results are written.
- `rope_qk_`: RoPE on the q and k parts of a fused QKV projection output, in place, returning
  q, k, v as views of it, and optionally the KV write of its k and v heads.
- `silu_mul`: SwiGLU's `silu(gate) * up` from a fused gate/up projection output.
- `gate_logits`: the early-exit gate's logit x . w + b of every row, in fp32 (fp64 for fp64).

Numerics follow the torch path (`vllm_rlt.models.layers`) op by op: statistics and arithmetic in
fp32 (fp64 for fp64 inputs), and each result rounded to the activation dtype wherever the torch
path rounds it (the normalised value before the weight multiplies, each product and sum of RoPE,
silu before the multiply by up). Launches pass `enable_fp_fusion=False` so no multiply is fused
into a following add (torch rounds the product first). What remains different is the summation
order of the sum of squares (an ulp of the statistic) and of the gate's dot product, and the exp
inside silu (library ulps).
The layer-kernel choice (`vllm_rlt.models.layer_kernels`) uses these on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.kv_write import kv_target, stored
from vllm_rlt.kernels.pdl import launch_options, pdl, release_dependents, wait_for_primary
from vllm_rlt.tensor_utils import acc_dtype

NO_FMA = {"enable_fp_fusion": False}  # round products before adds, as torch does
# The interpreter truncates fp32 -> bf16 casts (GPUs round to nearest even): round by hand there.
_RNE_BY_HAND = tl.constexpr(INTERPRET)


def _acc(dtype: torch.dtype) -> tl.dtype:
    """Arithmetic dtype: fp64 for fp64 tensors, else fp32 (matches `layers.acc_dtype`)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"expected [rows, n] tensors contiguous along n, got {t.shape}")


def _check_weights(dtype: torch.dtype, *weights: torch.Tensor) -> None:
    for w in weights:
        if w.dtype != dtype or not w.is_contiguous():
            raise ValueError(f"norm weights must be contiguous {dtype}, got {w.dtype}")


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x (in the arithmetic dtype) rounded to nearest even in `dtype` (finite values)."""
    if _RNE_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)  # exact in bf16 now: truncating is harmless
    return x.to(dtype)


@triton.jit
def _rms(x, w, EPS: tl.constexpr, n, ACC: tl.constexpr):
    """x, w: [BLOCK] (masked lanes 0) -> w * (x / rms(x)) in x's dtype (HF Llama order)."""
    x32 = x.to(ACC)
    mean_sq = tl.sum(x32 * x32, axis=0) / n
    normed = _round(x32 * tl.rsqrt(mean_sq + EPS), x.dtype)
    return _round(w.to(ACC) * normed.to(ACC), x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    w2_ptr,
    sum_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_sum,
    stride_out,
    n,
    EPS: tl.constexpr,
    EPS2: tl.constexpr,
    BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ACC: tl.constexpr,
    GDC: tl.constexpr,
):
    """One row per program. RESIDUAL: sum = res + norm(x; w), out = norm(sum; w2); else
    out = norm(x; w). The eps are compile-time constants so that they enter fp64 arithmetic
    unrounded (a float argument arrives as fp32)."""
    release_dependents(GDC)  # the projection after the norm may start streaming its weights
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # no kernel writes the weights
    w2 = tl.load(w2_ptr + cols, mask=mask & RESIDUAL, other=0.0)
    wait_for_primary(GDC)  # x (and the residual) come from kernels before this one
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = _rms(x, w, EPS, n, ACC)
    if RESIDUAL:
        h = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        s = _round(h.to(ACC) + y.to(ACC), h.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        y = _rms(s, w2, EPS2, n, ACC)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def _norm_launch(x: torch.Tensor) -> dict:
    block = triton.next_power_of_2(x.shape[1])
    warps = 4 if block <= 1024 else 8
    gdc = pdl(x.device)
    return {"BLOCK": block, "num_warps": warps, "GDC": gdc, **NO_FMA, **launch_options(gdc)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [R, H]; weight: [H] in x's dtype -> weight * x / rms(x), [R, H] (new tensor)."""
    _check_rows(x)
    _check_weights(x.dtype, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, x, weight, weight, out, out, x.stride(0), 0, 0, out.stride(0),
            x.shape[1], EPS=eps, EPS2=eps, RESIDUAL=False, ACC=_acc(x.dtype),
            **_norm_launch(x),
        )  # fmt: skip
    return out


def add_rms_norm(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor,
    next_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, y: [R, H] (residual stream, block output); weights: [H] in their dtype.

    Returns (out, normed), both [R, H] and new: out = h + weight * norm(y) and
    normed = next_weight * norm(out).
    """
    _check_rows(h, y)
    _check_weights(h.dtype, weight, next_weight)
    if y.dtype != h.dtype or y.shape != h.shape:
        raise ValueError("h and y must have one shape and dtype")
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    normed = torch.empty_like(out)
    if h.shape[0]:
        _rms_norm_kernel[(h.shape[0],)](
            y, h, weight, next_weight, out, normed, y.stride(0), h.stride(0), out.stride(0),
            normed.stride(0), h.shape[1], EPS=eps, EPS2=next_eps, RESIDUAL=True, ACC=_acc(h.dtype),
            **_norm_launch(h),
        )  # fmt: skip
    return out, normed


@triton.jit
def rotate_halves(lo, hi, cos_lo, sin_lo, cos_hi, sin_hi, ACC: tl.constexpr):
    """RoPE of the two halves of heads (in their dtype; the tables in ACC): lo*cos_lo + hi*sin_lo
    and hi*cos_hi + lo*sin_hi, each product and the sum rounded to the halves' dtype."""
    dt = lo.dtype
    lo32, hi32 = lo.to(ACC), hi.to(ACC)
    new_lo = _round(lo32 * cos_lo, dt).to(ACC) + _round(hi32 * sin_lo, dt).to(ACC)
    new_hi = _round(hi32 * cos_hi, dt).to(ACC) + _round(lo32 * sin_hi, dt).to(ACC)
    return _round(new_lo, dt), _round(new_hi, dt)


@triton.jit
def silu_times(gate, up, ACC: tl.constexpr):
    """silu(gate) * up in gate's dtype, silu rounded before the multiply."""
    g = gate.to(ACC)
    act = _round(g / (1.0 + tl.exp(-g)), gate.dtype)
    return _round(act.to(ACC) * up.to(ACC), gate.dtype)


@triton.jit
def _rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_row,
    stride_cos,
    stride_sin,
    num_rotated,
    num_heads,
    first_kv,
    num_kv_heads,
    k_scale,
    v_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ACC: tl.constexpr,
    WRITE_KV: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    GDC: tl.constexpr,
):
    """Program (row, head block): rotates the row's heads below `num_rotated` (q and k) among
    BLOCK_H of its `num_heads` in place; WRITE_KV also stores its k and v heads (from
    `first_kv`, rotated k, then v) at the row's slot of the caches.

    out = x * cos + roll(x, d/2) * signed_sin, i.e. per half: lo' = lo*cos_lo + hi*sin_lo and
    hi' = hi*cos_hi + lo*sin_hi. Each element is loaded and stored by the same thread (the two
    halves are separate tiles of one layout), so rotating in place is race-free.
    """
    release_dependents(GDC)  # attention may start (and wait)
    half: tl.constexpr = HEAD_DIM // 2
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    rotate = (heads < num_rotated)[:, None]
    cos_row, sin_row = cos_ptr + row * stride_cos, sin_ptr + row * stride_sin
    cos_lo = tl.load(cos_row + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    cos_hi = tl.load(cos_row + half + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    sin_lo = tl.load(sin_row + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    sin_hi = tl.load(sin_row + half + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    wait_for_primary(GDC)  # qkv comes from the projection before this kernel
    lo_ptrs = qkv_ptr + row * stride_row + heads[:, None] * HEAD_DIM + cols[None, :]
    lo = tl.load(lo_ptrs, mask=mask, other=0.0)
    hi = tl.load(lo_ptrs + half, mask=mask, other=0.0)
    new_lo, new_hi = rotate_halves(lo, hi, cos_lo, sin_lo, cos_hi, sin_hi, ACC)
    new_lo, new_hi = tl.where(rotate, new_lo, lo), tl.where(rotate, new_hi, hi)
    tl.store(lo_ptrs, new_lo, mask=mask & rotate)
    tl.store(lo_ptrs + half, new_hi, mask=mask & rotate)
    if WRITE_KV:  # the KV write's stores (`kv_write.write_kv_cache`), of the same values
        kv = heads - first_kv  # k heads, then v heads
        is_v = (kv >= num_kv_heads)[:, None]
        head = tl.where(kv >= num_kv_heads, kv - num_kv_heads, kv)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        dst = slot * (num_kv_heads * HEAD_DIM) + head[:, None] * HEAD_DIM + cols[None, :]
        k_mask = mask & (kv >= 0)[:, None] & ~is_v
        v_mask = mask & is_v
        k_dst, v_dst = k_cache_ptr + dst, v_cache_ptr + dst
        tl.store(k_dst, stored(new_lo, k_scale, k_cache_ptr, FP8_CACHE), mask=k_mask)
        tl.store(k_dst + half, stored(new_hi, k_scale, k_cache_ptr, FP8_CACHE), mask=k_mask)
        tl.store(v_dst, stored(new_lo, v_scale, v_cache_ptr, FP8_CACHE), mask=v_mask)
        tl.store(v_dst + half, stored(new_hi, v_scale, v_cache_ptr, FP8_CACHE), mask=v_mask)


def rope_qk_(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv: tuple[KVLayer, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the q and k parts of a fused projection output in place; return q, k, v views.

    qkv: [R, (num_heads + 2 * num_kv_heads) * head_dim], each row laid out q | k | v with heads
    of `head_dim` contiguous; cos, signed_sin: [R, 1, head_dim] or [R, head_dim] in qkv's dtype
    (`RotaryEmbedding.tables`). Returns q [R, Hq, d], k [R, Hkv, d], v [R, Hkv, d], all views.
    kv: (a layer's caches, slot_mapping [R]): also does `kv_write.write_kv_cache` of the rotated
    k and the v heads, in the same launch.
    """
    _check_rows(qkv)
    rows, rotated = qkv.shape[0], num_heads + num_kv_heads
    if qkv.shape[1] != (rotated + num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected (Hq + 2 Hkv) * d")
    if cos.dtype != qkv.dtype or signed_sin.dtype != qkv.dtype:
        raise ValueError("the RoPE tables must be in qkv's dtype")
    if cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("the RoPE tables must be contiguous along head_dim")
    cache, slots = kv_target(kv, rows, num_kv_heads, head_dim, qkv)
    heads = rotated + (num_kv_heads if kv else 0)
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(heads), max(1, 1024 // block_half))
    gdc = pdl(qkv.device)
    if rows:
        _rope_kernel[(rows, triton.cdiv(heads, block_h))](
            qkv, cos, signed_sin, cache.k, cache.v, slots, qkv.stride(0), cos.stride(0),
            signed_sin.stride(0), rotated, heads, num_heads, num_kv_heads, cache.k_scale,
            cache.v_scale, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_HALF=block_half,
            ACC=_acc(qkv.dtype), WRITE_KV=kv is not None, FP8_CACHE=cache.fp8, GDC=gdc,
            num_warps=4, **NO_FMA, **launch_options(gdc),
        )  # fmt: skip
    return split_qkv(qkv, num_heads, num_kv_heads, head_dim)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, (Hq + 2 Hkv) * d] laid out q | k | v -> views q [R, Hq, d], k and v [R, Hkv, d]."""
    kv_cols = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_cols, kv_cols], dim=1)
    return (
        q.unflatten(1, (num_heads, head_dim)),
        k.unflatten(1, (num_kv_heads, head_dim)),
        v.unflatten(1, (num_kv_heads, head_dim)),
    )


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    n,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    GDC: tl.constexpr,
):
    """Program (row, column block): out = silu(gate) * up, silu rounded before the multiply."""
    release_dependents(GDC)  # the down projection may start streaming its weights
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_times(gate, up, ACC), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [R, 2 * I], each row gate | up -> silu(gate) * up, [R, I] (new tensor)."""
    _check_rows(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n,
            BLOCK=block, ACC=_acc(gate_up.dtype), GDC=pdl(gate_up.device), num_warps=4,
            **NO_FMA,
        )  # fmt: skip
    return out


@triton.jit
def _gate_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    stride_x,
    n,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
    GDC: tl.constexpr,
):
    """One row per program: out = x . w + b, every operand converted to ACC first."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(ACC)  # no kernel writes the weights
    b = tl.load(b_ptr).to(ACC)
    wait_for_primary(GDC)  # x is the norm kernel's output
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(ACC)
    tl.store(out_ptr + row, tl.sum(x * w, axis=0) + b)


def gate_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x: [R, H]; weight [1, H] and bias [1] of an `nn.Linear(H, 1)` in x's dtype -> the logits
    x . weight + bias, [R] in fp32 (fp64 for fp64 x): the torch path's linear on operands
    converted to that dtype, in one launch."""
    _check_rows(x)
    _check_weights(x.dtype, weight, bias)
    if weight.shape != (1, x.shape[1]) or bias.shape != (1,):
        raise ValueError(f"gate weight {tuple(weight.shape)} / bias {tuple(bias.shape)} "
                         f"do not map {x.shape[1]} features to one logit")  # fmt: skip
    out = torch.empty(x.shape[0], device=x.device, dtype=acc_dtype(x.dtype))
    if x.shape[0]:
        _gate_kernel[(x.shape[0],)](
            x, weight, bias, out, x.stride(0), x.shape[1], ACC=_acc(x.dtype),
            **_norm_launch(x),
        )  # fmt: skip
    return out
