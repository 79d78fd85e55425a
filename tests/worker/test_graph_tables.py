"""Graph buckets and their per-call tables: which graph admits an invocation, and the packed
upload (padding rows at the scratch slot, tiles in launch order, zero-row tiles filling the
fixed grids, every row in exactly one tile)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_rlt.attention.metadata import TILE_ROWS, HostMetadata, tile_rows_for
from vllm_rlt.worker.graph_tables import (
    DECODE_BUCKETS,
    MIXED_BUCKETS,
    GraphSpec,
    capped,
    field_offsets,
    graph_specs,
    pack,
    select_spec,
    tables_offset,
    tile_counts,
)

SCRATCH_SLOT = 4000


def test_capped_buckets():
    assert capped(DECODE_BUCKETS, 1) == (1,)
    assert capped(DECODE_BUCKETS, 6) == (1, 2, 4, 6)
    assert capped(DECODE_BUCKETS, 32) == (1, 2, 4, 8, 16, 24, 32)
    assert capped(DECODE_BUCKETS, 100)[-3:] == (80, 96, 100)
    assert capped(DECODE_BUCKETS, 1000)[-1] == 256


def test_graph_specs():
    specs = graph_specs(8, 1024, 40)
    decode = [s for s in specs if s.num_chunk_slots == 0]
    mixed = [s for s in specs if s.num_chunk_slots > 0]
    assert decode == [GraphSpec(b, b, 0) for b in (1, 2, 4, 8)]
    assert [s.num_rows for s in mixed] == [8, 16, 32, 64, 128, *range(192, 1025, 64)]

    def padding(rows: int) -> float:  # share of a bucket's rows that are padding
        bucket = min(b for b in MIXED_BUCKETS if b >= rows)
        return (bucket - rows) / bucket

    assert max(padding(r) for r in range(129, 2049)) < 1 / 3
    assert max(padding(r) for r in range(513, 2049)) < 1 / 8
    # tile slots: every row in a multi-row tile, or the tiles of 40 segments
    assert mixed[0] == GraphSpec(8, 8, 4) and mixed[-1] == GraphSpec(1024, 40, 16 + 40)
    assert graph_specs(300, 100, 600)[-1] == GraphSpec(100, 100, 50)  # decode rows fit too
    assert max(s.num_rows for s in graph_specs(8, 5000, 40)) == 2048
    assert [s.num_rows for s in graph_specs(4, 3, 8)] == [1, 2, 3, 3]
    assert graph_specs(4, 1, 8) == (GraphSpec(1, 1, 0),)


def test_tile_rows_follow_the_chunk_size():
    """Tiles as tall as a chunk (a power of two), at most TILE_ROWS; 32-token chunks get 32-row
    tiles, so their graphs' multi-row slots cover every row of a 1024-row budget."""
    assert [tile_rows_for(c) for c in (1, 2, 20, 32, 33, 64, 128, 512)] == [
        1, 2, 32, 32, 64, 64, 64, 64,
    ]  # fmt: skip
    assert TILE_ROWS == 64
    assert graph_specs(8, 1024, 40, tile_rows_for(32))[-1] == GraphSpec(1024, 40, 32 + 40)


def test_tile_counts():
    assert tile_counts([1, 1, 1], 64) == (3, 0)
    assert tile_counts([65, 2, 128, 129], 64) == (2, 1 + 1 + 2 + 2)  # 65 = 64 + 1 rows
    assert tile_counts([3, 1], 1) == (4, 0)


def test_select_spec():
    specs = graph_specs(6, 100, 12)
    assert select_spec(specs, [1, 1, 1]) == GraphSpec(4, 4, 0)  # decode rows: a decode graph
    assert select_spec(specs, [2, 1]) == GraphSpec(8, 8, 4)  # a chunk: the smallest mixed graph
    assert select_spec(specs, [1] * 7) == GraphSpec(8, 8, 4)  # more decode rows than graphs
    assert select_spec(specs, [65, 1, 30]) == GraphSpec(100, 12, 14)
    assert select_spec(specs, [65, 40]) is None  # more rows than the largest graph
    # more tiles than a graph's slots: the next graph that holds them, or none
    assert select_spec(specs, [2] * 5) == GraphSpec(16, 12, 8)
    assert select_spec(specs, [1] * 13 + [2]) is None  # 13 one-row tiles, 12 slots


def _tables(spec: GraphSpec, call) -> dict[str, np.ndarray]:
    a = call.data.numpy()
    out = {}
    for name, (offset, dtype, length) in field_offsets(spec).items():
        out[name] = a[offset : offset + length * np.dtype(dtype).itemsize].view(dtype)
    head = tables_offset(spec)
    assert head == a.shape[0] - 4 * call.num_tables * call.width
    out["tables"] = a[head:].view(np.int32).reshape(call.num_tables, call.width)
    return out


def test_pack_mixed_invocation():
    # a 65-row chunk (tiles of 64 and 1 rows), a decode row, a 2-row piece, a 1-row piece
    starts, counts = [0, 7, 3, 12], [65, 1, 2, 1]
    tables = [list(range(17)), [20, 21], [30, 31], [40, 41, 42, 43]]
    host = HostMetadata.build(starts, counts, tables, 4, 64)
    spec = GraphSpec(100, 12, 14)
    index = np.arange(69, dtype=np.int64)[::-1].copy()
    call = pack(spec, host, index, SCRATCH_SLOT, 3, pin=False)
    t = _tables(spec, call)
    r, b, one = 69, 100, 12
    assert (call.num_tables, call.width, call.num_padding) == (4, 3, b - r)
    np.testing.assert_array_equal(t["tables"], host.block_tables[:, :3])  # cut to max_blocks
    np.testing.assert_array_equal(t["index"][:r], index)
    np.testing.assert_array_equal(t["positions"][:r], host.positions)
    np.testing.assert_array_equal(t["slot_mapping"][:r], host.slot_mapping)
    assert (t["positions"][r:] == 0).all() and (t["slot_mapping"][r:] == SCRATCH_SLOT).all()
    # padding rows: one one-row segment each, after the real segments
    assert call.seg_row_starts == (0, 65, 66, 68, *range(69, b + 1))
    assert call.seg_token_starts == (0, 7, 3, 12) + (0,) * (b - r)
    np.testing.assert_array_equal(t["seg_row_starts"][: 5 + b - r], call.seg_row_starts)
    # tiles: the real one-row tiles in the first of 12 one-row slots, the multi-row ones in the
    # first of 14 slots after those; zero-row tiles fill both, and padding rows have none
    nrows = t["tile_num_rows"]
    assert nrows.shape == (one + 14,)
    assert list(nrows[:one]) == [1, 1, 1] + [0] * (one - 3)
    assert list(nrows[one:]) == [64, 2] + [0] * 12
    assert (t["tile_seg"][nrows == 0] == 0).all()
    covered = np.zeros(b, dtype=int)
    for start, n in zip(t["tile_row_start"], nrows, strict=True):
        covered[start : start + n] += 1
    assert (covered[:r] == 1).all() and (covered[r:] == 0).all()


def test_pack_decode_and_warm_up():
    host = HostMetadata.build([5, 9], [1, 1], [[1, 2], [3, 4, 5]], 4, 64)
    spec = GraphSpec(4, 4, 0)
    t = _tables(spec, pack(spec, host, np.array([3, 1]), SCRATCH_SLOT, 8, pin=False))
    np.testing.assert_array_equal(t["tile_row_start"], [0, 1, 0, 0])
    np.testing.assert_array_equal(t["tile_seg"], [0, 1, 0, 0])
    np.testing.assert_array_equal(t["tile_num_rows"], [1, 1, 0, 0])  # padding rows: no tile
    np.testing.assert_array_equal(t["positions"], [5, 9, 0, 0])
    warm_up = pack(spec, None, np.zeros(0, dtype=np.int64), SCRATCH_SLOT, 8, pin=False)
    t = _tables(spec, warm_up)
    assert warm_up.num_tables == 0 and warm_up.seg_row_starts == (0, 1, 2, 3, 4)
    assert (t["slot_mapping"] == SCRATCH_SLOT).all()


def test_pack_rejects_what_the_spec_cannot_hold():
    host = HostMetadata.build([0], [3], [[1]], 4, 64)
    with pytest.raises(ValueError, match="do not fit"):
        pack(GraphSpec(4, 4, 0), host, np.arange(3), SCRATCH_SLOT, 8, pin=False)  # no chunk slot
    with pytest.raises(ValueError, match="do not fit"):
        pack(GraphSpec(2, 2, 1), host, np.arange(3), SCRATCH_SLOT, 8, pin=False)  # too many rows
    ones = HostMetadata.build([0, 5], [1, 1], [[1], [2, 3]], 4, 64)
    with pytest.raises(ValueError, match="do not fit"):
        pack(GraphSpec(4, 1, 2), ones, np.arange(2), SCRATCH_SLOT, 8, pin=False)  # 2 one-row
