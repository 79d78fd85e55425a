"""Row buckets of CUDA-graph invocations and the tables one bucket reads (capture: cuda_graph.py).

A graph runs a fixed number of rows B, its bucket: an invocation of R <= B rows runs with B - R
padding rows appended, each a one-row segment at position 0 of the KV cache's scratch block (which
the block pool never hands out), so padding rows write only that block. Two kinds:

- decode graphs admit invocations whose segments are all one row; their tile table has B one-row
  slots and the attention kernel runs its one-row launch alone;
- mixed graphs admit invocations of prefill chunks beside decode rows, rows of several requests
  at several depths, up to a number of tiles: `num_one_slots` one-row and `num_chunk_slots`
  multi-row tile slots, sized from the segments one invocation is expected to hold
  (`graph_specs`; an invocation with more tiles runs in a larger graph or eagerly). The
  multi-row launch sizes its row block for min(tile_rows, B) rows, and mixed graphs do not split
  the KV (their programs are mostly prefill tiles, which splitting slows down).

Unused slots hold tiles of zero rows, which the kernel skips at the cost of a program each, so
both launches have the same grid on every replay. Padding rows get no tile: their attention
output is never computed (nothing reads it; each row's result depends on its own inputs only).

Everything a replay reads per call is packed into one buffer for one host-to-device copy (`pack`),
in this order (B rows, T = one-row + multi-row tile slots, S real segments, W table columns):

    int64 [B] positions | int64 [B] slot_mapping | int64 [B] state-row index (first R used)
    int32 [B + 1] seg_row_starts | int32 [B] seg_token_starts (first S + B - R used)
    int32 [T] tile_seg | int32 [T] tile_row_start | int32 [T] tile_num_rows
    int32 [S, W] block tables of the real segments (one device copy places them in the static
    [B, max_blocks] table; the padding segments' rows get the scratch block in column 0)

The tile table is laid out in launch order (one-row slots, then multi-row slots), so the static
`tile_order` is the identity.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_rlt.attention.metadata import TILE_ROWS, HostMetadata, tile_layout

# decode buckets (vLLM-like): dense where decode batches are small, coarser up to 256
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# mixed buckets: doubling while an invocation is weight-bound (GPU time nearly flat in rows), then
# steps of 64 up to 1024 rows and of 128 up to 2048. Above ~190 rows an invocation is
# compute-bound (docs/design/runner.md §2), so padding rows cost their share of the GEMMs:
# the steps keep them under 1/3 at 192 rows and under 1/8 from 512 rows on.
MIXED_BUCKETS = (8, 16, 32, 64, 128, *range(192, 1025, 64), *range(1152, 2049, 128))


def capped(buckets: tuple[int, ...], max_rows: int) -> tuple[int, ...]:
    """`buckets` below `max_rows`, then `max_rows` itself (or the last bucket if smaller)."""
    cap = min(max_rows, buckets[-1])
    return tuple(b for b in buckets if b < cap) + (cap,)


@dataclass(frozen=True, order=True)
class GraphSpec:
    """The shape one captured graph runs: its rows and the tile slots of its attention launches."""

    num_rows: int  # B: the bucket; real rows first, then padding rows
    num_one_slots: int  # one-row tile slots: B in a decode graph
    num_chunk_slots: int  # multi-row tile slots: 0 in a decode graph

    @property
    def num_tiles(self) -> int:
        return self.num_one_slots + self.num_chunk_slots


def graph_specs(
    max_num_seqs: int, max_num_batched_tokens: int, max_segments: int, tile_rows: int = TILE_ROWS
) -> tuple[GraphSpec, ...]:
    """Decode graphs up to the decode rows of one invocation (<= max_num_seqs), then mixed graphs
    up to its token budget (<= 2048). A mixed graph of B rows has room for the tiles of
    `max_segments` segments (one-row segments, and one partial tile per multi-row segment) and
    for B rows in full tiles: min(B, max_segments) one-row and min(B // 2, ceil(B / tile_rows) +
    max_segments) multi-row slots (a multi-row tile holds >= 2 rows)."""
    decode = capped(DECODE_BUCKETS, min(max_num_seqs, max_num_batched_tokens))
    mixed = capped(MIXED_BUCKETS, max_num_batched_tokens)
    specs = [GraphSpec(b, b, 0) for b in decode] + [
        GraphSpec(b, min(b, max_segments), min(b // 2, -(-b // tile_rows) + max_segments))
        for b in mixed
    ]
    return tuple(dict.fromkeys(specs))  # a budget of one row: one decode graph


def tile_counts(num_rows: list[int], tile_rows: int) -> tuple[int, int]:
    """(one-row tiles, multi-row tiles) of segments of `num_rows` rows, cut as
    `HostMetadata.build` cuts them (`tile_layout`)."""
    return _one_and_multi(tile_layout(np.asarray(num_rows, dtype=np.int64), tile_rows)[2])


def _one_and_multi(tile_num_rows: np.ndarray) -> tuple[int, int]:
    one = int((tile_num_rows == 1).sum())
    return one, tile_num_rows.shape[0] - one


def select_spec(
    specs: tuple[GraphSpec, ...], num_rows: list[int], tile_rows: int = TILE_ROWS
) -> GraphSpec | None:
    """The smallest graph that admits segments of `num_rows` rows (a decode graph if every segment
    is one row and one fits), or None."""
    return _smallest_fit(specs, num_rows, *tile_counts(num_rows, tile_rows))


def select_spec_for(
    specs: tuple[GraphSpec, ...], num_rows: list[int], tile_num_rows: np.ndarray
) -> GraphSpec | None:
    """`select_spec` for segments already cut into tiles of `tile_num_rows` rows
    (`HostMetadata.tile_num_rows`): they are counted, not cut again."""
    return _smallest_fit(specs, num_rows, *_one_and_multi(tile_num_rows))


def _smallest_fit(specs, num_rows: list[int], one: int, multi: int) -> GraphSpec | None:
    total, decode = sum(num_rows), max(num_rows) == 1
    fits = [
        s
        for s in specs
        if s.num_rows >= total
        and (decode or s.num_chunk_slots > 0)
        and one <= s.num_one_slots
        and multi <= s.num_chunk_slots
    ]
    return min(fits, key=lambda s: (s.num_chunk_slots > 0, s.num_rows), default=None)


@functools.cache
def field_offsets(spec: GraphSpec) -> dict[str, tuple[int, type, int]]:
    """Byte offset, dtype and length of each fixed-size field of the spec's upload, in order."""
    b, t = spec.num_rows, spec.num_tiles
    fields = (
        ("positions", np.int64, b),
        ("slot_mapping", np.int64, b),
        ("index", np.int64, b),
        ("seg_row_starts", np.int32, b + 1),
        ("seg_token_starts", np.int32, b),
        ("tile_seg", np.int32, t),
        ("tile_row_start", np.int32, t),
        ("tile_num_rows", np.int32, t),
    )
    out, offset = {}, 0
    for name, dtype, length in fields:
        out[name] = (offset, dtype, length)
        offset += np.dtype(dtype).itemsize * length
    return out


@functools.cache
def tables_offset(spec: GraphSpec) -> int:
    """Byte offset of the block tables in the spec's upload: the size of the fixed fields."""
    offset, dtype, length = list(field_offsets(spec).values())[-1]
    return offset + np.dtype(dtype).itemsize * length


@dataclass(frozen=True)
class PackedCall:
    """One invocation's tables in a (pinned) host buffer, laid out as `field_offsets` says."""

    data: torch.Tensor  # uint8: the fixed-size fields, then the [S, W] block tables
    num_tables: int  # S: real segments, whose table rows come first in the static table
    width: int  # W: table columns uploaded
    num_padding: int  # B - R padding rows (= padding segments, table rows S .. S + B - R - 1)
    seg_row_starts: tuple[int, ...]  # host copy, real then padding segments, ending at B
    seg_token_starts: tuple[int, ...]  # host copy, real then padding segments


def pack(
    spec: GraphSpec,
    host: HostMetadata | None,
    index: np.ndarray,
    scratch_slot: int,
    max_blocks: int,
    pin: bool,
) -> PackedCall:
    """Pack the tables of the real segments `host` (None: none, the capture warm-up) and the
    state-row index [R] for bucket `spec`, appending the padding rows at `scratch_slot`.
    Tables are cut to `max_blocks` columns (enough for positions < the runner's max context)."""
    b = spec.num_rows
    host = _no_segments() if host is None else host
    r, s = host.positions.shape[0], host.seg_token_starts.shape[0]
    p = b - r
    pad = np.arange(max(p, 0), dtype=np.int64)
    one = host.tile_num_rows == 1
    num_one = int(one.sum())
    num_chunk = one.shape[0] - num_one
    if p < 0 or num_one > spec.num_one_slots or num_chunk > spec.num_chunk_slots:
        raise ValueError(f"{r} rows in {num_one} + {num_chunk} tiles do not fit {spec}")
    # one-row tiles fill slots 0.., multi-row tiles the slots after the one-row ones; the rest
    # stay zero-row tiles, and the padding rows have none
    slot = np.where(one, np.cumsum(one) - 1, spec.num_one_slots + np.cumsum(~one) - 1)
    tiles = np.zeros((3, spec.num_tiles), dtype=np.int64)
    tiles[:, slot] = host.tile_seg, host.tile_row_start, host.tile_num_rows
    values = {
        "positions": np.concatenate([host.positions, np.zeros(p, dtype=np.int64)]),
        "slot_mapping": np.concatenate([host.slot_mapping, np.full(p, scratch_slot)]),
        "index": index,
        "seg_row_starts": np.concatenate([host.seg_row_starts, r + 1 + pad]),
        "seg_token_starts": np.concatenate([host.seg_token_starts, np.zeros(p, dtype=np.int64)]),
        "tile_seg": tiles[0],
        "tile_row_start": tiles[1],
        "tile_num_rows": tiles[2],
    }
    tables = host.block_tables[:, :max_blocks]
    head = tables_offset(spec)
    data = torch.empty(head + 4 * tables.size, dtype=torch.uint8, pin_memory=pin)
    a = data.numpy()
    for name, (offset, dtype, length) in field_offsets(spec).items():
        v = values[name]
        a[offset : offset + length * np.dtype(dtype).itemsize].view(dtype)[: len(v)] = v
    a[head:].view(np.int32)[:] = tables.ravel()
    return PackedCall(
        data,
        s,
        tables.shape[1],
        p,
        tuple(values["seg_row_starts"].tolist()),
        tuple(values["seg_token_starts"].tolist()),
    )


def _no_segments() -> HostMetadata:
    """The tables of zero real segments (the capture warm-up runs padding rows only)."""
    none = np.zeros(0, dtype=np.int64)
    return HostMetadata(
        block_size=1, tile_rows=1, positions=none, slot_mapping=none,
        seg_row_starts=np.zeros(1, dtype=np.int64), seg_token_starts=none,
        block_tables=np.zeros((0, 0), dtype=np.int64),
        tile_seg=none, tile_row_start=none, tile_num_rows=none, tile_order=none,
    )  # fmt: skip
