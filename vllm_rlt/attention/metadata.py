"""Per-row attention metadata for one recurrent-core invocation.

An invocation's rows are packed as *segments*: a segment is a contiguous range of rows of one
request at one plane, covering consecutive positions `token_start .. token_start + num_rows - 1`
(a prefill piece or a single decode row). Every row of a segment reads the same block table (the
request's table for that plane) and sees positions `<= its own` of that plane; rows of the same
invocation that write a plane earlier in the layer are visible too (K/V are written before
attention). The builder is vectorised: Python touches segments, never rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Row and segment tables shared by every layer of one invocation."""

    block_size: int  # KV positions per block
    positions: torch.Tensor  # [R] int64: position of each row (RoPE and causal limit)
    slot_mapping: torch.Tensor  # [R] int64: flat KV slot (block * block_size + offset) a row writes
    seg_row_starts: torch.Tensor  # [S + 1] int32: first row of each segment, then R
    seg_token_starts: torch.Tensor  # [S] int32: position of each segment's first row
    block_tables: torch.Tensor  # [S, max_blocks] int32: physical blocks of the segment's plane
    tile_rows: int  # rows per kernel tile (tiles never straddle segments)
    tile_seg: torch.Tensor  # [T] int32: segment of each tile
    tile_row_start: torch.Tensor  # [T] int32: first row of each tile
    tile_num_rows: torch.Tensor  # [T] int32: rows in each tile (<= tile_rows)
    seg_row_starts_host: tuple[int, ...]  # host copy of seg_row_starts
    seg_token_starts_host: tuple[int, ...]  # host copy of seg_token_starts
    max_context: int  # largest number of KV positions any row sees
    tile_order: torch.Tensor  # [T] int32: tile indices, one-row tiles first (one launch per class)
    num_one_row_tiles: int  # how many tiles have one row (the head of tile_order: decode rows)
    max_tile_rows: int  # largest tile_num_rows (kernels size their row block by it)

    @property
    def num_rows(self) -> int:
        return self.seg_row_starts_host[-1]

    @property
    def num_segments(self) -> int:
        return len(self.seg_token_starts_host)


def build_attention_metadata(
    token_starts: Sequence[int],
    num_rows: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    tile_rows: int = 16,
) -> AttentionMetadata:
    """Build the tables for segments given by their first position, row count and block table.

    Each block table must cover the segment's last position.
    """
    num_segs = len(token_starts)
    if not (num_segs == len(num_rows) == len(block_tables)) or num_segs == 0:
        raise ValueError("token_starts, num_rows and block_tables must be non-empty and aligned")
    starts = np.asarray(token_starts, dtype=np.int64)
    counts = np.asarray(num_rows, dtype=np.int64)
    if (counts < 1).any() or (starts < 0).any():
        raise ValueError("segments need at least one row and a non-negative start position")
    max_blocks = max(len(bt) for bt in block_tables)
    tables = np.zeros((num_segs, max_blocks), dtype=np.int64)
    for i, bt in enumerate(block_tables):
        tables[i, : len(bt)] = bt
    ends = starts + counts
    if ((ends + block_size - 1) // block_size > [len(bt) for bt in block_tables]).any():
        raise ValueError("a block table does not cover its segment's last position")

    row_starts = np.concatenate([[0], np.cumsum(counts)])
    row_seg = np.repeat(np.arange(num_segs), counts)
    positions = starts[row_seg] + np.arange(row_starts[-1]) - row_starts[row_seg]
    slots = tables[row_seg, positions // block_size] * block_size + positions % block_size

    tiles_per_seg = (counts + tile_rows - 1) // tile_rows
    tile_seg = np.repeat(np.arange(num_segs), tiles_per_seg)
    tile_first = np.concatenate([[0], np.cumsum(tiles_per_seg)])[:-1]
    tile_local = np.arange(tile_seg.shape[0]) - tile_first[tile_seg]
    tile_row_start = row_starts[tile_seg] + tile_local * tile_rows
    tile_num_rows = np.minimum(tile_rows, row_starts[tile_seg + 1] - tile_row_start)
    one_row = tile_num_rows == 1
    tile_order = np.concatenate([np.flatnonzero(one_row), np.flatnonzero(~one_row)])

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    return AttentionMetadata(
        block_size=block_size,
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        seg_row_starts=dev(row_starts, torch.int32),
        seg_token_starts=dev(starts, torch.int32),
        block_tables=dev(tables, torch.int32),
        tile_rows=tile_rows,
        tile_seg=dev(tile_seg, torch.int32),
        tile_row_start=dev(tile_row_start, torch.int32),
        tile_num_rows=dev(tile_num_rows, torch.int32),
        seg_row_starts_host=tuple(int(x) for x in row_starts),
        seg_token_starts_host=tuple(int(x) for x in starts),
        max_context=int(ends.max()),
        tile_order=dev(tile_order, torch.int32),
        num_one_row_tiles=int(one_row.sum()),
        max_tile_rows=int(tile_num_rows.max()),
    )
