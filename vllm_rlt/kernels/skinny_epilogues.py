"""The few-row GEMM's finishing code (`skinny_gemm.py`): what a program does with its output
block once the K loop (and, split, the sum of the K partials) is done.

`_epilogue` rounds the block and stores it, or finishes a pair of rows first (SWIGLU: silu(gate)
* up; ROPE: the rotation of a head's halves, and the KV write); `_norm_tail` runs the residual
step after the projection once the last block of the launch is stored. Each reproduces the
roundings of the separate kernels (`fused_ops`, `kv_write`), so the results are the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_rlt.kernels.fused_ops import _round, norm_row, rotate_halves, silu_times

# the kernel's epilogues (`EPILOGUE`); constexpr globals, so that the kernels can read them
PLAIN, SWIGLU, ROPE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _epilogue(
    acc, out_ptr, cos_ptr, sin_ptr, offs_m, m_ok, cols, col_ok, cols_a, a_ok, table_cols,
    rotate, pair_offset, stride_om, stride_cos, stride_sin, kv_head, cache_ptr, slot_ptr,
    cache_cols_a, kv_cols, EPILOGUE: tl.constexpr,
):  # fmt: skip
    """Round the fp32 sums to the output dtype and finish them. PLAIN stores them; the paired
    epilogues split the tile's interleaved columns into a (even) and b (odd): SWIGLU stores
    silu(a) * b at a's columns; ROPE rotates the halves a | b (when `rotate`: q and k heads) and
    stores both, a k or v head (`kv_head`, only with the kernel's WRITE_KV) also at each row's
    slot of its cache (slots of kv_cols elements, a at cache_cols_a). Every rounding is the one
    the separate kernels make."""
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
                tl.store(dst, a, mask=mask)
                tl.store(dst + pair_offset, b, mask=mask)
        tl.store(out_ptr + rows + cols_a[None, :], a, mask=mask)


@triton.jit
def _norm_tail(
    y_ptr, res_ptr, w_ptr, w2_ptr, sum_ptr, normed_ptr, tail_ptr, M, N, stride_y, stride_res,
    stride_sum, stride_normed, EPS: tl.constexpr, EPS2: tl.constexpr, NORM_BLOCK: tl.constexpr,
):  # fmt: skip
    """After a program has stored its output block: the program that stores the last block
    runs `fused_ops.add_rms_norm` over the finished rows y (sum = res + norm(y; w), normed =
    norm(sum; w2)), the same code as the norm kernel, and zeroes the block counter."""
    tl.debug_barrier()  # every thread's stores issued, then one gpu-scope release
    arrived = tl.atomic_add(tail_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:  # every block of every row is visible
        cols = tl.arange(0, NORM_BLOCK)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0)
        for m in range(M):
            norm_row(
                y_ptr + m * stride_y, res_ptr + m * stride_res, w, w2, sum_ptr + m * stride_sum,
                normed_ptr + m * stride_normed, cols, mask, N, EPS, EPS2, True, tl.float32, ".cg",
            )  # fmt: skip
        tl.store(tail_ptr, 0)  # zeroed for the next call
