"""The device code of paged attention for one tile: one KV head of one tile's rows, over one KV
split (`paged_attention.py` launches it; the tile tables are in `attention/metadata.py`).

`attend_tile` loads the tile's queries (rows x GQA group on the M side), walks its split of the
KV range in steps of BLOCK_N with an online softmax (`_attend_block`; the causal mask only in
the steps past the tile's first position), and stores the normalised output, or, split, the
partial with its running max and sum for the combine (split 0 still stores the output of the
rows that no other split reaches).
"""

from __future__ import annotations

import triton
import triton.language as tl

# How a tile forms its inner products (PRODUCT): `tl.dot` over rows x heads padded to 16; a
# broadcast-and-sum over a 3-D product (tiles of a few rows x heads: the interpreter's only);
# or, for a tile of one query row (MHA decode without the dot), K loaded like V (positions x
# dims, contiguous along dims) and p x V kept per position, summed over positions once after
# the KV loop rather than in every step.
SUM, DOT, ROW = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _load_tile(ptrs, in_range, offs_d, MASKED, HEAD_DIM, HEAD_PAD, TRANSPOSED):
    """A KV tile, [BLOCK_N, HEAD_PAD] or TRANSPOSED; zeros past the KV range (MASKED) and past
    head_dim (padded up to the dot's minimum K of 16)."""
    if TRANSPOSED:
        n_ok = in_range[None, :]
        d_ok = offs_d[:, None] < HEAD_DIM
    else:
        n_ok = in_range[:, None]
        d_ok = offs_d[None, :] < HEAD_DIM
    if HEAD_PAD != HEAD_DIM:
        if MASKED:
            tile = tl.load(ptrs, mask=n_ok & d_ok, other=0.0)
        else:
            tile = tl.load(ptrs, mask=d_ok, other=0.0)
    elif MASKED:
        tile = tl.load(ptrs, mask=n_ok, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    start,
    kv_end,
    pos_m,
    kv_head_off,
    stride_block,
    stride_slot,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    PRODUCT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    F64: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One BLOCK_N step of the online softmax; MASKED adds the range and causal masks.

    fp32 accumulation works in the log2 domain (qk_scale includes log2(e)); fp64 (ACC, exactness
    runs) in the natural one, with the scale computed in fp64 (a float argument arrives as fp32).
    KV_FP8: K and V arrive in FP8, widened exactly (to q's dtype for the dot, else to ACC); their
    scales are applied by the caller (K's in qk_scale, V's to the output).
    ROW: acc is [BLOCK_N, HEAD_PAD], per position.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    in_range = offs_n < kv_end
    if MASKED:
        blk = tl.load(bt_ptr + offs_n // BLOCK_SIZE, mask=in_range, other=0)
    else:
        blk = tl.load(bt_ptr + offs_n // BLOCK_SIZE)
    base = blk.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_slot + kv_head_off
    if PRODUCT == ROW:  # K like V: [BLOCK_N, HEAD_PAD]
        k = _load_tile(k_cache_ptr + base[:, None] + offs_d[None, :], in_range, offs_d, MASKED,
                       HEAD_DIM, HEAD_PAD, False)  # fmt: skip
    else:  # K^T: [HEAD_PAD, BLOCK_N]
        k = _load_tile(k_cache_ptr + base[None, :] + offs_d[:, None], in_range, offs_d, MASKED,
                       HEAD_DIM, HEAD_PAD, True)  # fmt: skip
    v = _load_tile(v_cache_ptr + base[:, None] + offs_d[None, :], in_range, offs_d, MASKED,
                   HEAD_DIM, HEAD_PAD, False)  # fmt: skip
    if KV_FP8:  # exact widening: to the dot's input type, or straight to the accumulator's
        k = k.to(q.dtype if PRODUCT == DOT else ACC)
        v = v.to(q.dtype if PRODUCT == DOT else ACC)

    if PRODUCT == DOT:
        if UPCAST or F64:
            s = tl.dot(q.to(ACC), k.to(ACC))
        else:
            s = tl.dot(q, k, input_precision=PRECISION)
    elif PRODUCT == ROW:  # q: one row
        s = tl.sum(k.to(ACC) * tl.sum(q.to(ACC), 0)[None, :], 1)[None, :]
    else:
        s = tl.sum(q.to(ACC)[:, :, None] * k.to(ACC)[None, :, :], axis=1)
    if F64:  # noqa: SIM108 (constexpr branches: only one is compiled)
        s = s * (1.0 / tl.sqrt(tl.full([1, 1], HEAD_DIM, tl.float64)))
        if KV_FP8:
            s = s * qk_scale  # the K scale alone
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(offs_n[None, :] <= pos_m[:, None], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    if F64:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
    else:
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if PRODUCT == DOT:
        if UPCAST or F64:
            acc += tl.dot(p.to(v.dtype).to(ACC), v.to(ACC))
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    elif PRODUCT == ROW:  # per position; attend_tile sums them after the KV loop
        acc += tl.sum(p, 0)[:, None] * v.to(ACC)
    else:
        acc += tl.sum(p[:, :, None] * v.to(ACC)[None, :, :], axis=1)
    return acc, m_new, l_i


@triton.jit
def attend_tile(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tile,
    nrows,
    tile_seg_ptr,
    tile_row_start_ptr,
    seg_row_starts_ptr,
    seg_token_starts_ptr,
    block_tables_ptr,
    split_len_ptr,
    stride_q_row,
    stride_q_head,
    stride_o_row,
    stride_o_head,
    stride_block,
    stride_slot,
    stride_kv_head,
    stride_bt,
    num_rows,
    num_splits,
    min_split_len,
    qk_scale,
    v_scale,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_MG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    PRODUCT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    ACC: tl.constexpr,
    F64: tl.constexpr,
    KV_FP8: tl.constexpr,
    MASK_ALL: tl.constexpr,
):
    """One tile (of `nrows` > 0 rows) for one KV head and one KV split."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seg = tl.load(tile_seg_ptr + tile)
    row0 = tl.load(tile_row_start_ptr + tile)
    pos0 = tl.load(seg_token_starts_ptr + seg) + row0 - tl.load(seg_row_starts_ptr + seg)

    # M side of the tile: index m = r * GROUP_P2 + g is row r, query head kv_head * GROUP + g.
    offs_m = tl.arange(0, BLOCK_MG)
    r = offs_m // GROUP_P2
    g = offs_m % GROUP_P2
    valid = (r < nrows) & (g < GROUP)
    row = row0 + r
    head = kv_head * GROUP + g
    pos_m = pos0 + tl.minimum(r, nrows - 1)  # padding rows copy a real row: never all-masked
    offs_d = tl.arange(0, HEAD_PAD)
    io_mask = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + row.to(tl.int64)[:, None] * stride_q_row + head[:, None] * stride_q_head
    q = tl.load(q_ptrs + offs_d[None, :], mask=io_mask, other=0.0)

    context = pos0 + nrows  # keys the tile's last row sees
    split_len = tl.cdiv(tl.cdiv(context, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    split_len = tl.maximum(split_len, min_split_len)
    kv_start = split * split_len
    # past the tile's context (kv_start >= context) a split does nothing: the combine never
    # reads it
    if kv_start < context:
        if SPLIT and split == 0 and kv_head == 0:  # the combine's per-row split length
            tl.store(split_len_ptr + row, split_len, mask=valid & (g == 0))
        kv_end = tl.minimum(context, kv_start + split_len)
        # Keys below pos0 + 1 are visible to every row of the tile: no mask needed there.
        # MASK_ALL (batch-invariant launches): every step masked, since the two step variants
        # (compiled separately) do not always round alike, and where a row's steps switch from
        # one to the other follows its tile's first row
        full_end = kv_start
        if not MASK_ALL:
            num_full = tl.maximum(tl.minimum(kv_end, pos0 + 1) - kv_start, 0) // BLOCK_N
            full_end += num_full * BLOCK_N
        bt_ptr = block_tables_ptr + seg.to(tl.int64) * stride_bt
        kv_head_off = kv_head * stride_kv_head

        m_i = tl.full([BLOCK_MG], float("-inf"), ACC)
        l_i = tl.zeros([BLOCK_MG], ACC)
        if PRODUCT == ROW:
            acc = tl.zeros([BLOCK_N, HEAD_PAD], ACC)
        else:
            acc = tl.zeros([BLOCK_MG, HEAD_PAD], ACC)
        for start in range(kv_start, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, start, kv_end, pos_m,
                kv_head_off, stride_block, stride_slot, qk_scale, HEAD_DIM, HEAD_PAD, BLOCK_N,
                BLOCK_SIZE, False, PRODUCT, UPCAST, PRECISION, ACC, F64, KV_FP8,
            )  # fmt: skip
        for start in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, start, kv_end, pos_m,
                kv_head_off, stride_block, stride_slot, qk_scale, HEAD_DIM, HEAD_PAD, BLOCK_N,
                BLOCK_SIZE, True, PRODUCT, UPCAST, PRECISION, ACC, F64, KV_FP8,
            )  # fmt: skip
        if PRODUCT == ROW:
            acc = tl.sum(acc, 0)[None, :]
        if KV_FP8:  # the V scale, before the partial or the normalised output is stored
            acc = acc * v_scale

        # Rows whose keys all lie in split 0 (position < split_len) are final here: split 0
        # stores their output and the combine kernel skips them; the others store a partial.
        # Rows this split does not reach are never read by the combine kernel.
        final = valid
        if SPLIT:
            final = valid & (split == 0) & (pos_m < split_len)
            part = (split * num_rows + row.to(tl.int64)) * NUM_HEADS + head
            partial = valid & ~final
            tl.store(part_m_ptr + part, m_i, mask=partial)
            tl.store(part_l_ptr + part, l_i, mask=partial)
            acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(acc_ptrs, acc, mask=io_mask & partial[:, None])
        if split == 0:  # (unsplit launches have only split 0)
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + row.to(tl.int64)[:, None] * stride_o_row
            o_ptrs += head[:, None] * stride_o_head + offs_d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask & final[:, None])
