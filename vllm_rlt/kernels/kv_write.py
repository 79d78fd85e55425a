"""The KV write of an attention layer: k and v rows to their cache slots in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_row,
    stride_v_row,
    ROW_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW_ELEMS
    k = tl.load(k_ptr + row.to(tl.int64) * stride_k_row + offs, mask=mask)
    v = tl.load(v_ptr + row.to(tl.int64) * stride_v_row + offs, mask=mask)
    dst = slot * ROW_ELEMS + offs
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v [R, Hkv, d] at flat slots [R] of caches [num_blocks, block_size, Hkv, d]."""
    num_rows = k.shape[0]
    row_elems = k_cache.shape[2] * k_cache.shape[3]
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError("k and v rows must be contiguous over (heads, head_dim)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("KV caches must be contiguous")
    if num_rows == 0:
        return
    _write_kv_kernel[(num_rows,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW_ELEMS=row_elems, BLOCK=triton.next_power_of_2(row_elems), num_warps=4,
    )  # fmt: skip
