"""Triton kernels for paged attention over an invocation's tile table
(docs/design/architecture.md §7, §11).

One program handles one tile (rows of one segment: one request at one plane) for one KV head and
all query heads of its GQA group, and optionally one KV split. It reads the segment's block table,
streams KV blocks of that plane up to the tile's last position with an fp32 online softmax, and
masks per row (key position <= row position); the per-tile code is in `attention_tile.py`. Tiles
come in two classes: one-row tiles (decode rows; rows x heads padded to the dot's minimum of 16,
or for MHA one query row against K and V without the dot) and multi-row tiles (prefill chunks;
rows x heads form the M side of `tl.dot`). Each class has its launch config; beside multi-row
tiles of 64 rows x heads or more both classes run in one launch (side by side rather than one
after the other), else in two.
A tile of zero rows does nothing: CUDA-graph buckets fill their fixed grids with such tiles
(worker/graph_tables.py).

When rows are few and contexts long, the KV range is split (flash-decoding): each split writes an
unnormalised partial output with its running max and sum, and a combine kernel merges them. The
grid holds a fixed number of splits S, but a tile's split length comes from its own context
(ceil(context / S), aligned, at least `min_split_len`), so CUDA graphs, whose grids are sized for
the longest context a row may reach, split a short context as finely as an eager launch would.
Rows whose keys all lie in split 0 (position < split length) are final there: split 0 stores
their output and the combine leaves them alone.
The KV write that precedes attention is in `kv_write.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels import native
from vllm_rlt.kernels.attention_splits import DECODE_SPLITS, launch_splits, split_policy
from vllm_rlt.kernels.attention_tile import DOT, ROW, SUM, attend_tile
from vllm_rlt.kernels.device_info import INTERPRET, sm_count
from vllm_rlt.kernels.pdl import launch_options, pdl, release_dependents, wait_for_primary

if TYPE_CHECKING:  # the kernel reads the tables by name; attention builds them on top of it
    from vllm_rlt.attention.metadata import AttentionMetadata
    from vllm_rlt.kernels.kv_format import KVLayer

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """Compile-time shape of one attention launch."""

    block_n: int  # KV positions per loop iteration (a power of two)
    num_warps: int  # warps per program
    num_stages: int  # software-pipelining depth of the KV loop
    use_dot: bool = True  # tl.dot with rows padded to 16, else a sum of products (one-row MHA)


# Chosen from an H200 sweep (docs/design/runner.md §4).
DECODE_CONFIG = LaunchConfig(block_n=128, num_warps=4, num_stages=3, use_dot=True)
# Decode-only launches that split finer (`split_policy`) with more than one program per SM
# before splitting (9-32 rows of Ouro-1.4B's 16 heads): KV steps of 64 with 2 stages, 4-14%
# faster at 512-4096 positions on the H200 (docs/design/runner.md §4).
FINE_DECODE_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=2, use_dot=True)
# Over an FP8 cache a one-row MHA tile widens K and V to fp32 and runs without the dot
# (attention_tile.ROW): the dot's FP8 -> bf16 widening ran below the bf16 cache's speed. The fine
# launches keep KV steps of 64 in 2 warps, the others steps of 128 in 4 warps with 3 stages
# (docs/benchmarks/fp8-kv.md §3).
FP8_DECODE_CONFIG = LaunchConfig(block_n=128, num_warps=4, num_stages=3, use_dot=False)
FP8_FINE_DECODE_CONFIG = LaunchConfig(block_n=64, num_warps=2, num_stages=2, use_dot=False)
# Prefill tiles below 64 rows x heads, and from 64. Swept at the engine's 1024-row invocations
# (docs/design/runner.md §4): 3-4% faster than 2 and 3 stages at contexts up to 512;
# the short tiles' 3 stages lose up to 2% at 4K, the tall tiles' 2 stages win up to 4K.
CHUNK_CONFIG = LaunchConfig(block_n=128, num_warps=4, num_stages=3)
CHUNK_CONFIG_LARGE_M = LaunchConfig(block_n=64, num_warps=4, num_stages=2)
# fp32 inputs (exactness checks, not the serving path): short KV steps keep the fp32 tiles' shared
# memory and compile time small (block_n 128 at 64 rows x 128 dims compiles for ~35 s).
FP32_BLOCK_N = 32
# Batch-invariant launches (`invariant=True`): every tile, a decode row's one-row tile too, runs
# in one row block of this many rows (x GQA group) with one config, no KV split and every KV
# step masked, so a row's online softmax visits the same KV steps in the same order, on the same
# dot shapes and the same code, whatever tile holds it (keys past a row's position add exact
# zeros).
INVARIANT_TILE_ROWS = 64
INVARIANT_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tile_ids_ptr,
    tile_seg_ptr,
    tile_row_start_ptr,
    tile_num_rows_ptr,
    seg_row_starts_ptr,
    seg_token_starts_ptr,
    block_tables_ptr,
    split_len_ptr,
    positions_ptr,
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
    balance_pieces,
    qk_scale,
    v_scale,
    num_one,
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
    GDC: tl.constexpr,
    BOTH: tl.constexpr,
    BLOCK_MG_ONE: tl.constexpr,
    BLOCK_N_ONE: tl.constexpr,
    PRODUCT_ONE: tl.constexpr,
    BALANCE_ROWS: tl.constexpr,
    KV_FP8: tl.constexpr,
    MASK_ALL: tl.constexpr,
):
    """One program per (tile, KV head, split). BOTH: the grid holds both classes, the first
    `num_one` tiles one-row (row block BLOCK_MG_ONE, KV step BLOCK_N_ONE), the rest multi-row,
    so that decode rows and prefill chunks of one invocation run side by side. BALANCE_ROWS > 0
    (a power of two >= num_rows): pieces of at least the rows' total context over
    `balance_pieces` positions (`attention_splits.decode_balance`)."""
    release_dependents(GDC)  # the combine or the output projection may start
    tile = tl.load(tile_ids_ptr + tl.program_id(0))  # tables: written before the invocation
    nrows = tl.load(tile_num_rows_ptr + tile)
    # q and this invocation's K/V come from the kernels before this one; every program waits,
    # so that this launch (even of padding tiles alone) ends after them
    wait_for_primary(GDC)
    if BALANCE_ROWS > 0:  # positions: written before the invocation, like the tables
        offs_r = tl.arange(0, BALANCE_ROWS)
        pos = tl.load(positions_ptr + offs_r, mask=offs_r < num_rows, other=-1)
        total = tl.sum(pos.to(tl.int32) + 1, 0)  # keys of all rows (padding rows: 1 each)
        piece = tl.cdiv(tl.cdiv(total, balance_pieces), SPLIT_ALIGN) * SPLIT_ALIGN
        min_split_len = tl.maximum(min_split_len, piece)
    if nrows > 0:  # zero rows: a padding tile (CUDA-graph buckets fill fixed grids with them)
        args = (
            out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
            tile, nrows, tile_seg_ptr, tile_row_start_ptr, seg_row_starts_ptr,
            seg_token_starts_ptr, block_tables_ptr, split_len_ptr, stride_q_row, stride_q_head,
            stride_o_row, stride_o_head, stride_block, stride_slot, stride_kv_head, stride_bt,
            num_rows, num_splits, min_split_len, qk_scale, v_scale,
        )  # fmt: skip
        if BOTH and tl.program_id(0) < num_one:
            attend_tile(
                *args, NUM_HEADS, GROUP, GROUP_P2, BLOCK_MG_ONE, HEAD_DIM, HEAD_PAD, BLOCK_N_ONE,
                BLOCK_SIZE, SPLIT, SPLIT_ALIGN, PRODUCT_ONE, UPCAST, PRECISION, ACC, F64, KV_FP8,
                MASK_ALL,
            )  # fmt: skip
        else:
            attend_tile(
                *args, NUM_HEADS, GROUP, GROUP_P2, BLOCK_MG, HEAD_DIM, HEAD_PAD, BLOCK_N,
                BLOCK_SIZE, SPLIT, SPLIT_ALIGN, PRODUCT, UPCAST, PRECISION, ACC, F64, KV_FP8,
                MASK_ALL,
            )  # fmt: skip


@triton.jit
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    positions_ptr,
    split_len_ptr,
    stride_o_row,
    stride_o_head,
    num_rows,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    F64: tl.constexpr,
    GDC: tl.constexpr,
):
    """Merge the splits of one (row, head) (split lengths are its tile's): splits past the row's
    position were not written. A row whose keys all lie in split 0 was stored by the attention
    kernel: its program moves no data."""
    release_dependents(GDC)  # the output projection may start streaming its weights
    wait_for_primary(GDC)  # the partials come from the attention kernel
    row = tl.program_id(0)
    head = tl.program_id(1)
    # a row in no tile (a CUDA-graph padding row, at position 0) has no split length stored:
    # it counts as one split, and nothing writes it
    split_len = tl.maximum(tl.load(split_len_ptr + row), 1)
    num_active = tl.load(positions_ptr + row).to(tl.int32) // split_len + 1
    if num_active > 1:
        offs_s = tl.arange(0, SPLITS_P2)
        active = offs_s < num_active
        part = (offs_s * num_rows + row) * NUM_HEADS + head
        m = tl.load(part_m_ptr + part, mask=active, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part, mask=active, other=0.0)
        if F64:  # noqa: SIM108 (the attention kernel's log domain, see _attend_block)
            w = tl.exp(m - tl.max(m, 0))
        else:
            w = tl.exp2(m - tl.max(m, 0))  # split 0 always sees key 0: the max is finite
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_DIM
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
        acc = tl.load(acc_ptrs, mask=active[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        o_ptrs = out_ptr + row.to(tl.int64) * stride_o_row + head * stride_o_head + offs_d
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _row_block(rows_per_tile: int, group: int, use_dot: bool) -> tuple[int, int]:
    """M side of a tile (rows x padded GQA group, at least 16 with `tl.dot`) and its inner
    product (`attention_tile.PRODUCT`)."""
    block_mg = triton.next_power_of_2(rows_per_tile) * triton.next_power_of_2(group)
    # without the dot only one-row MHA tiles on a GPU (registers); the interpreter has none to
    # spill
    if use_dot or (block_mg > 1 and not INTERPRET):
        return max(block_mg, 16), DOT.value
    return block_mg, (ROW if block_mg == 1 else SUM).value


def _launch(
    tile_ids: torch.Tensor,
    rows_per_tile: int,
    cfg: LaunchConfig,
    common: tuple,
    group: int,
    num_kv_heads: int,
    num_splits: int,
    constexprs: dict,
    one: tuple[int, LaunchConfig] | None = None,
) -> None:
    """One launch over `tile_ids`; with `one` = (k, decode config), its first k tiles are
    one-row tiles run with the decode config's row block, KV step and inner product."""
    block_mg, product = _row_block(rows_per_tile, group, cfg.use_dot)
    num_one, one_cfg = one if one is not None else (0, cfg)
    block_mg_one, product_one = _row_block(1, group, one_cfg.use_dot)
    grid = (tile_ids.shape[0], num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        *common[:7], tile_ids, *common[7:], num_one,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), BLOCK_MG=block_mg,
        BLOCK_N=cfg.block_n, PRODUCT=product, BOTH=one is not None, BLOCK_MG_ONE=block_mg_one,
        BLOCK_N_ONE=one_cfg.block_n, PRODUCT_ONE=product_one, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **constexprs, **launch_options(constexprs["GDC"]),
    )  # fmt: skip


def decode_config_for(
    num_programs: int, decode_only: bool, num_sms: int, kv_fp8: bool = False
) -> LaunchConfig:
    """The decode tiles' launch config of a launch of `num_programs` (tiles x KV heads) before
    splitting; launches with prefill tiles take DECODE_CONFIG (FP8_DECODE_CONFIG over FP8)."""
    fine = split_policy(num_programs, decode_only, num_sms) is DECODE_SPLITS
    if fine and num_programs > num_sms:
        return FP8_FINE_DECODE_CONFIG if kv_fp8 else FINE_DECODE_CONFIG
    return FP8_DECODE_CONFIG if kv_fp8 else DECODE_CONFIG


def paged_attention(
    q: torch.Tensor,
    cache: KVLayer,
    meta: AttentionMetadata,
    *,
    num_splits: int | None = None,
    decode_config: LaunchConfig | None = None,
    chunk_config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Causal paged attention of q [R, Hq, d] over a layer's caches [num_blocks, block_size,
    Hkv, d] (FP8 ones times their scales).

    Returns [R, Hq, d] in q's dtype (written into `out` when given). `num_splits` fixes the KV
    splits per tile (default: chosen from the grid size and max context by the split policy of
    decode-only or mixed launches, `attention_splits.py`; a fixed count splits a tile's context
    evenly); the configs override the tuned launch shapes. `invariant`: each row's output is
    the same bits in any invocation (INVARIANT_CONFIG; no split, the configs are ignored).
    Decode-only launches with the tuned defaults run the native kernel where it is on and has
    an instance (`native.decode_attention`).
    """
    tuned = num_splits is None and decode_config is None and chunk_config is None
    num_rows, num_heads, head_dim = q.shape
    k_cache, v_cache = cache.k, cache.v
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError("the number of query heads must be a multiple of the KV heads")
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q and the caches must be contiguous along head_dim, caches alike")
    group = num_heads // num_kv_heads
    num_tiles = meta.tile_seg.shape[0]
    num_one = meta.num_one_row_tiles
    fp32 = q.dtype in (torch.float32, torch.float64)  # exactness runs: ieee dots, short steps
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    programs, num_sms = num_tiles * num_kv_heads, sm_count(q.device)
    decode_only = num_one == num_tiles
    if decode_config is None and fp32:
        decode_config = replace(DECODE_CONFIG, block_n=FP32_BLOCK_N)
    elif decode_config is None:
        decode_config = decode_config_for(programs, decode_only, num_sms, cache.fp8)
    big = _row_block(meta.max_tile_rows, group, True)[0] >= 64
    if invariant:
        if meta.max_tile_rows > INVARIANT_TILE_ROWS:
            raise ValueError(f"batch-invariant attention takes tiles of at most "
                             f"{INVARIANT_TILE_ROWS} rows, got {meta.max_tile_rows}")  # fmt: skip
        block_n = FP32_BLOCK_N if fp32 else INVARIANT_CONFIG.block_n
        # the interpreter's tl.dot is a BLAS matmul, whose sums may depend on the row's place
        # in the tile (invariant_gemm._ROW_SUMS): broadcast-and-sum there
        decode_config = chunk_config = replace(
            INVARIANT_CONFIG, block_n=block_n, use_dot=not INTERPRET
        )
        num_splits = 1
    if chunk_config is None:
        chunk_config = CHUNK_CONFIG_LARGE_M if big else CHUNK_CONFIG
        chunk_config = replace(chunk_config, block_n=FP32_BLOCK_N) if fp32 else chunk_config
    block_n = max(decode_config.block_n, chunk_config.block_n)  # splits align to both launches
    min_split_len, balance_pieces = block_n, 0
    if num_splits is None:
        policy, num_splits, balance_pieces = launch_splits(
            programs, num_kv_heads, meta.max_context, num_sms, decode_only
        )
        min_split_len = triton.cdiv(policy.min_len, block_n) * block_n

    qk_scale = head_dim**-0.5 * _LOG2E  # the fp64 kernel computes its own (F64 in _attend_block)
    if cache.fp8:
        qk_scale = cache.k_scale if acc_dtype == torch.float64 else qk_scale * cache.k_scale
    if out is None:
        out = torch.empty(num_rows, num_heads, head_dim, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError("out must match q's shape and dtype, contiguous along head_dim")
    may_go_native = tuned and decode_only and not invariant and q.is_cuda
    if may_go_native and native.decode_attention(q, cache, meta, out, num_sms):
        return out
    if num_splits > 1:
        part_acc = torch.empty(
            num_splits, num_rows, num_heads, head_dim, device=q.device, dtype=acc_dtype
        )
        part_m = torch.empty(num_splits, num_rows, num_heads, device=q.device, dtype=acc_dtype)
        part_l = torch.empty_like(part_m)
        split_len = torch.empty(num_rows, device=q.device, dtype=torch.int32)
    else:
        part_acc = part_m = part_l = split_len = out  # unused
    common = (
        out, part_acc, part_m, part_l, q, k_cache, v_cache,
        meta.tile_seg, meta.tile_row_start, meta.tile_num_rows, meta.seg_row_starts,
        meta.seg_token_starts, meta.block_tables, split_len, meta.positions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        num_rows, num_splits, min_split_len, max(balance_pieces, 1), qk_scale, cache.v_scale,
    )  # fmt: skip
    constexprs = dict(
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=meta.block_size,
        SPLIT=num_splits > 1,
        SPLIT_ALIGN=block_n,
        UPCAST=INTERPRET,  # the interpreter computes bf16 tl.dot wrongly: upcast to fp32 there
        PRECISION="ieee" if fp32 else "tf32",
        ACC=tl.float64 if acc_dtype == torch.float64 else tl.float32,
        F64=acc_dtype == torch.float64,
        GDC=pdl(q.device),
        BALANCE_ROWS=triton.next_power_of_2(num_rows) if balance_pieces and num_splits > 1 else 0,
        KV_FP8=cache.fp8,
        MASK_ALL=invariant,
    )
    args = (common, group, num_kv_heads, num_splits, constexprs)
    tiles = meta.tile_order
    if invariant:
        _launch(tiles, INVARIANT_TILE_ROWS, chunk_config, *args)
    elif 0 < num_one < num_tiles and big:
        # decode rows beside prefill tiles of 64 rows (x group): one launch, side by side; beside
        # shorter tiles the two launches measured faster (docs/design/runner.md §4)
        one_cfg = replace(decode_config, block_n=min(decode_config.block_n, chunk_config.block_n))
        _launch(tiles, meta.max_tile_rows, chunk_config, *args, (num_one, one_cfg))
    else:
        if num_one > 0:
            _launch(tiles[:num_one], 1, decode_config, *args)
        if num_one < num_tiles:
            _launch(tiles[num_one:], meta.max_tile_rows, chunk_config, *args)
    if num_splits > 1:
        _combine_kernel[(num_rows, num_heads)](
            out, part_acc, part_m, part_l, meta.positions, split_len, out.stride(0),
            out.stride(1), num_rows,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4, F64=constexprs["F64"],
            GDC=constexprs["GDC"], **launch_options(constexprs["GDC"]),
        )  # fmt: skip
    return out
