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

from vllm_rlt.tensor_utils import to_device

# most rows per attention tile in the engine (`tile_rows_for`): chunk rows share KV loads (64
# measured best for 128-token chunks on the H200, docs/design/runner.md §4); decode
# rows get one-row tiles
TILE_ROWS = 64


def tile_rows_for(task_rows: int) -> int:
    """The engine's tile height for prefill tasks of at most `task_rows` rows: TILE_ROWS, or that
    many rounded up to a power of two when smaller (a 64-row block computes padding beside
    32-row tasks, docs/design/runner.md §4)."""
    return min(TILE_ROWS, 1 << (task_rows - 1).bit_length())


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
    tile_num_rows: torch.Tensor  # [T] int32: rows in each tile (<= tile_rows; 0: a padding tile)
    seg_row_starts_host: tuple[int, ...]  # host copy of seg_row_starts
    seg_token_starts_host: tuple[int, ...]  # host copy of seg_token_starts
    max_context: int  # largest number of KV positions any row sees
    tile_order: torch.Tensor  # [T] int32: tile indices, one-row tiles first (launch order)
    num_one_row_tiles: int  # one-row tiles (decode rows): the head of tile_order
    max_tile_rows: int  # row block of the multi-row tiles: >= the rows of every tile in it
    num_splits: int | None = None  # KV splits per tile fixed for this invocation; None: chosen

    @property
    def num_rows(self) -> int:
        return self.seg_row_starts_host[-1]

    @property
    def num_segments(self) -> int:
        return len(self.seg_token_starts_host)


def tile_layout(num_rows: np.ndarray, tile_rows: int) -> tuple[np.ndarray, ...]:
    """Tiles of segments of `num_rows` rows (int64 array), in row order: (segment, first row, rows)
    of each. Tiles never straddle segments; each segment's last tile holds what is left."""
    row_starts = np.concatenate([[0], np.cumsum(num_rows)])
    tiles_per_seg = (num_rows + tile_rows - 1) // tile_rows
    tile_seg = np.repeat(np.arange(num_rows.shape[0]), tiles_per_seg)
    tile_first = np.concatenate([[0], np.cumsum(tiles_per_seg)])[:-1]
    tile_local = np.arange(tile_seg.shape[0]) - tile_first[tile_seg]
    tile_row_start = row_starts[tile_seg] + tile_local * tile_rows
    tile_num_rows = np.minimum(tile_rows, row_starts[tile_seg + 1] - tile_row_start)
    return tile_seg, tile_row_start, tile_num_rows


@dataclass(frozen=True)
class HostMetadata:
    """The tables of `AttentionMetadata` as int64 numpy arrays, before they go to the device
    (`upload`); the CUDA-graph runner copies them into its static buffers instead."""

    block_size: int  # KV positions per block
    tile_rows: int  # rows per kernel tile
    positions: np.ndarray  # [R]
    slot_mapping: np.ndarray  # [R]
    seg_row_starts: np.ndarray  # [S + 1]
    seg_token_starts: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, max_blocks]
    tile_seg: np.ndarray  # [T]
    tile_row_start: np.ndarray  # [T]
    tile_num_rows: np.ndarray  # [T]
    tile_order: np.ndarray  # [T]

    @classmethod
    def build(
        cls,
        token_starts: Sequence[int],
        num_rows: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        tile_rows: int,
    ) -> HostMetadata:
        """The tables for segments given by their first position, row count and block table.

        Each block table must cover the segment's last position.
        """
        num_segs = len(token_starts)
        if not (num_segs == len(num_rows) == len(block_tables)) or num_segs == 0:
            raise ValueError(
                "token_starts, num_rows and block_tables must be non-empty and aligned"
            )
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

        tile_seg, tile_row_start, tile_num_rows = tile_layout(counts, tile_rows)
        one_row = tile_num_rows == 1
        tile_order = np.concatenate([np.flatnonzero(one_row), np.flatnonzero(~one_row)])
        return cls(
            block_size, tile_rows, positions, slots, row_starts, starts, tables,
            tile_seg, tile_row_start, tile_num_rows, tile_order,
        )  # fmt: skip

    def upload(self, device: torch.device | str) -> AttentionMetadata:
        device = torch.device(device)

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(a, dtype, device)

        return AttentionMetadata(
            block_size=self.block_size,
            positions=dev(self.positions, torch.int64),
            slot_mapping=dev(self.slot_mapping, torch.int64),
            seg_row_starts=dev(self.seg_row_starts, torch.int32),
            seg_token_starts=dev(self.seg_token_starts, torch.int32),
            block_tables=dev(self.block_tables, torch.int32),
            tile_rows=self.tile_rows,
            tile_seg=dev(self.tile_seg, torch.int32),
            tile_row_start=dev(self.tile_row_start, torch.int32),
            tile_num_rows=dev(self.tile_num_rows, torch.int32),
            seg_row_starts_host=tuple(self.seg_row_starts.tolist()),
            seg_token_starts_host=tuple(self.seg_token_starts.tolist()),
            max_context=int(self.positions.max()) + 1,
            tile_order=dev(self.tile_order, torch.int32),
            num_one_row_tiles=int((self.tile_num_rows == 1).sum()),
            max_tile_rows=int(self.tile_num_rows.max()),
        )


def build_attention_metadata(
    token_starts: Sequence[int],
    num_rows: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
    tile_rows: int = 16,
) -> AttentionMetadata:
    """Build the tables for segments given by their first position, row count and block table
    (see `HostMetadata.build`) and upload them to `device`."""
    host = HostMetadata.build(token_starts, num_rows, block_tables, block_size, tile_rows)
    return host.upload(device)
