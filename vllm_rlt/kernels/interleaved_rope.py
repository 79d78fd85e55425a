"""Huginn's q/k step in one launch: the q and k parts of its fused q/k/v projection output, each
plus its bias, rotated by adjacent pairs (2i, 2i + 1), in place.

The torch path (the bias adds, then `models.layers.rotate_interleaved`) takes about a dozen
element-wise kernels per layer and recurrence for a few kilobytes; this kernel does the same
arithmetic element by element: the bias add rounded to the activation dtype, then each product
and difference in fp32 (fp64 for fp64) and the result rounded once, with no fused multiply-add
(`fused_ops.NO_FMA`). The results are the torch path's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.fused_ops import NO_FMA, _acc, _check_rows, _round

BLOCK = 1024  # pairs per program


@triton.jit
def _bias_rope_kernel(
    qkv_ptr, bias_ptr, table_ptr, stride_row, stride_table, num_pairs,
    HALF: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Program (row, pair block): pairs p of the row's q | k columns (2p, 2p + 1), each the
    pair p % HALF of its head; the table holds (cos, sin) per row and pair in fp32."""
    row = tl.program_id(0).to(tl.int64)
    pairs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = pairs < num_pairs
    dt = qkv_ptr.dtype.element_ty
    x_ptr = qkv_ptr + row * stride_row + 2 * pairs
    b_ptr = bias_ptr + 2 * pairs
    x0 = _round(tl.load(x_ptr, mask=ok).to(ACC) + tl.load(b_ptr, mask=ok).to(ACC), dt)
    x1 = _round(tl.load(x_ptr + 1, mask=ok).to(ACC) + tl.load(b_ptr + 1, mask=ok).to(ACC), dt)
    t_ptr = table_ptr + row * stride_table + 2 * (pairs % HALF)
    cos = tl.load(t_ptr, mask=ok).to(ACC)
    sin = tl.load(t_ptr + 1, mask=ok).to(ACC)
    x0, x1 = x0.to(ACC), x1.to(ACC)
    tl.store(x_ptr, _round(x0 * cos - x1 * sin, dt), mask=ok)
    tl.store(x_ptr + 1, _round(x1 * cos + x0 * sin, dt), mask=ok)


def bias_rope_(
    qkv: torch.Tensor, qk_bias: torch.Tensor, table: torch.Tensor, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [R, 3 H d] (q | k | v, heads of d contiguous) -> q, k, v [R, H, d] views of it, q and
    k with their bias qk_bias [2, 1, H, d] added and rotated by the table [R, 1, d/2, 2] fp32
    (cos, sin of each pair), in place."""
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
    if rows:
        _bias_rope_kernel[(rows, triton.cdiv(cols, BLOCK))](
            qkv, qk_bias, table, qkv.stride(0), table.stride(0), cols,
            HALF=head_dim // 2, BLOCK=BLOCK, ACC=_acc(qkv.dtype), num_warps=4, **NO_FMA,
        )  # fmt: skip
    return qkv.view(rows, 3, num_heads, head_dim).unbind(1)
