"""The KV write of an attention layer: k and v rows to their cache slots in one launch, stored
as `kv_format` says."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET
from vllm_rlt.kernels.kv_format import FP8, FP8_MAX, KVLayer

# globals a kernel reads must be constexprs
_INTERPRET = tl.constexpr(INTERPRET)
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _e4m3_bits(y):
    """The e4m3 bits of fp32 y (|y| <= 448), rounded to nearest, ties to even, computed in
    integer and fp32 arithmetic: the interpreter's own fp8 conversion rounds half up, drops the
    carry into the exponent (31.5 becomes 16) and the sign of zero."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6's step
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    units = tl.abs(y) / step  # exact: step is a power of two
    low = tl.floor(units)
    frac = units - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    units = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low).to(tl.int32)
    # units: 8-16 for normals (16 carries into the next exponent), 0-7 below 2^-6
    carry = units == 16
    exponent = tl.where(carry, exponent + 1, exponent)
    units = tl.where(carry, 8, units)
    normal = units >= 8
    field = tl.where(normal, ((exponent + 7) << 3) | (units - 8), units)
    return (((bits >> 24) & 0x80) | field).to(tl.uint8)


@triton.jit
def stored(x, scale, cache_ptr, FP8_CACHE: tl.constexpr):
    """x as `cache_ptr`'s elements store it (`kv_format.quantize`)."""
    dt = cache_ptr.dtype.element_ty
    if FP8_CACHE:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -_FP8_MAX), _FP8_MAX)
        if _INTERPRET:
            return _e4m3_bits(y).to(dt, bitcast=True)
        return y.to(dt)
    return x.to(dt)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_row,
    stride_v_row,
    k_scale,
    v_scale,
    ROW_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_CACHE: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW_ELEMS
    k = tl.load(k_ptr + row.to(tl.int64) * stride_k_row + offs, mask=mask)
    v = tl.load(v_ptr + row.to(tl.int64) * stride_v_row + offs, mask=mask)
    dst = slot * ROW_ELEMS + offs
    tl.store(k_cache_ptr + dst, stored(k, k_scale, k_cache_ptr, FP8_CACHE), mask=mask)
    tl.store(v_cache_ptr + dst, stored(v, v_scale, v_cache_ptr, FP8_CACHE), mask=mask)


def check_target(
    cache: KVLayer, slots: torch.Tensor, rows: int, num_kv_heads: int, head_dim: int, dtype
) -> None:
    """Raise unless `cache` and `slots` can take `rows` rows of k and v heads in `dtype`, as a
    projection kernel that writes them itself stores them."""
    shape = (num_kv_heads, head_dim)
    for c in cache[:2]:
        if not (c.dtype in (dtype, FP8) and tuple(c.shape[2:]) == shape and c.is_contiguous()):
            raise ValueError(f"KV caches must be contiguous [blocks, block_size, {shape}] in "
                             f"{dtype} or FP8, got {tuple(c.shape)} {c.dtype}")  # fmt: skip
    if slots.shape != (rows,):
        raise ValueError(f"slot_mapping must hold one slot per row, got {tuple(slots.shape)}")


def kv_target(
    kv: tuple[KVLayer, torch.Tensor] | None,
    rows: int,
    num_kv_heads: int,
    head_dim: int,
    placeholder: torch.Tensor,
) -> tuple[KVLayer, torch.Tensor]:
    """The (caches, slots) a kernel that may also write k and v takes: `kv` checked against
    `rows` rows of heads in `placeholder`'s dtype, or without one `placeholder` in their places
    (the kernel then stores nothing there)."""
    if kv is None:
        return KVLayer(placeholder, placeholder), placeholder
    check_target(*kv, rows, num_kv_heads, head_dim, placeholder.dtype)
    return kv


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, cache: KVLayer, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [R, Hkv, d] at flat slots [R] of `cache` ([num_blocks, block_size, Hkv, d])."""
    num_rows = k.shape[0]
    row_elems = cache.k.shape[2] * cache.k.shape[3]
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError("k and v rows must be contiguous over (heads, head_dim)")
    if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if num_rows == 0:
        return
    _write_kv_kernel[(num_rows,)](
        k, v, cache.k, cache.v, slot_mapping, k.stride(0), v.stride(0), cache.k_scale,
        cache.v_scale, ROW_ELEMS=row_elems, BLOCK=triton.next_power_of_2(row_elems),
        FP8_CACHE=cache.fp8, num_warps=4,
    )  # fmt: skip
