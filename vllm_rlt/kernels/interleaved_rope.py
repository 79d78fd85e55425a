"""Huginn's q/k step in one launch: the q and k parts of its fused q/k/v projection output, each
plus its bias, rotated by adjacent pairs (2i, 2i + 1), in place.

The torch path (the bias adds, then `models.layers.rotate_interleaved`) takes about a dozen
element-wise kernels per layer and recurrence for a few kilobytes; this kernel does the same
arithmetic element by element: the bias add rounded to the activation dtype, then each product
and difference in fp32 (fp64 for fp64) and the result rounded once, with no fused multiply-add
(`fused_ops.NO_FMA`). The results are the torch path's bits. Given the layer's caches it also
writes k and v into them, as `rope_qk_` does for Ouro.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.fused_ops import NO_FMA, _acc, _check_rows, _round
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.kv_write import kv_target, stored

BLOCK = 1024  # pairs per program


@triton.jit
def _bias_rope_kernel(
    qkv_ptr, bias_ptr, table_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_row, stride_table,
    num_pairs, num_all, k_scale, v_scale, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ACC: tl.constexpr, WRITE_KV: tl.constexpr, FP8_CACHE: tl.constexpr,
):  # fmt: skip
    """Program (row, pair block): pairs p of the row's q | k columns (2p, 2p + 1; p below
    num_pairs), each the pair p % HALF of its head; the table holds (cos, sin) per row and pair
    in fp32. WRITE_KV: the pairs up to num_all also cover v, and the rotated k and the v pairs
    are stored at the row's slot of the caches (`kv_write.write_kv_cache`'s values)."""
    row = tl.program_id(0).to(tl.int64)
    pairs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = pairs < num_all
    qk = pairs < num_pairs
    dt = qkv_ptr.dtype.element_ty
    x_ptr = qkv_ptr + row * stride_row + 2 * pairs
    b_ptr = bias_ptr + 2 * pairs
    raw0, raw1 = tl.load(x_ptr, mask=ok), tl.load(x_ptr + 1, mask=ok)
    x0 = _round(raw0.to(ACC) + tl.load(b_ptr, mask=qk).to(ACC), dt)
    x1 = _round(raw1.to(ACC) + tl.load(b_ptr + 1, mask=qk).to(ACC), dt)
    t_ptr = table_ptr + row * stride_table + 2 * (pairs % HALF)
    cos = tl.load(t_ptr, mask=qk).to(ACC)
    sin = tl.load(t_ptr + 1, mask=qk).to(ACC)
    x0, x1 = x0.to(ACC), x1.to(ACC)
    y0, y1 = _round(x0 * cos - x1 * sin, dt), _round(x1 * cos + x0 * sin, dt)
    tl.store(x_ptr, y0, mask=qk)
    tl.store(x_ptr + 1, y1, mask=qk)
    if WRITE_KV:  # k pairs from num_pairs / 2, then v pairs from num_pairs: H d columns each
        col = 2 * pairs - num_pairs  # the pair's column in a slot of the k (then v) cache
        slot = tl.load(slot_ptr + row).to(tl.int64) * num_pairs
        is_k = (col >= 0) & qk
        is_v = (pairs >= num_pairs) & ok
        k_dst, v_dst = k_cache_ptr + slot + col, v_cache_ptr + slot + col - num_pairs
        tl.store(k_dst, stored(y0, k_scale, k_cache_ptr, FP8_CACHE), mask=is_k)
        tl.store(k_dst + 1, stored(y1, k_scale, k_cache_ptr, FP8_CACHE), mask=is_k)
        tl.store(v_dst, stored(raw0, v_scale, v_cache_ptr, FP8_CACHE), mask=is_v)
        tl.store(v_dst + 1, stored(raw1, v_scale, v_cache_ptr, FP8_CACHE), mask=is_v)


def bias_rope_(
    qkv: torch.Tensor,
    qk_bias: torch.Tensor,
    table: torch.Tensor,
    num_heads: int,
    head_dim: int,
    kv: tuple[KVLayer, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [R, 3 H d] (q | k | v, heads of d contiguous) -> q, k, v [R, H, d] views of it, q and
    k with their bias qk_bias [2, 1, H, d] added and rotated by the table [R, 1, d/2, 2] fp32
    (cos, sin of each pair), in place. kv: (a layer's caches, slot_mapping [R]): also does
    `kv_write.write_kv_cache` of the rotated k and v, in the same launch."""
    _check_rows(qkv)
    rows, cols = qkv.shape[0], num_heads * head_dim
    if qkv.shape[1] != 3 * cols or head_dim % 2:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, expected 3 * {num_heads} * {head_dim}")
    if qk_bias.numel() != 2 * cols or qk_bias.dtype != qkv.dtype or not qk_bias.is_contiguous():
        raise ValueError(f"qk_bias must be 2 * {cols} contiguous {qkv.dtype} values")
    if table.shape[-2:] != (head_dim // 2, 2) or table.dtype != torch.float32:
        raise ValueError(f"the RoPE table must be [R, 1, {head_dim // 2}, 2] fp32")
    if table.stride(-1) != 1 or table.stride(-2) != 2:
        raise ValueError("the RoPE table must be contiguous along its last two dimensions")
    cache, slots = kv_target(kv, rows, num_heads, head_dim, qkv)
    pairs = cols + (cols // 2 if kv else 0)  # q | k pairs, then v's
    if rows:
        _bias_rope_kernel[(rows, triton.cdiv(pairs, BLOCK))](
            qkv, qk_bias, table, cache.k, cache.v, slots, qkv.stride(0), table.stride(0), cols,
            pairs, cache.k_scale, cache.v_scale, HALF=head_dim // 2, BLOCK=BLOCK,
            ACC=_acc(qkv.dtype), WRITE_KV=kv is not None, FP8_CACHE=cache.fp8, num_warps=4,
            **NO_FMA,
        )  # fmt: skip
    return qkv.view(rows, 3, num_heads, head_dim).unbind(1)
