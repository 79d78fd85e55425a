"""The stages outside the loop, as the runner runs them: the prelude of rows entering depth 0,
the coda of rows whose loops are done, and the LM head of the rows that sample.

`PlainEdges` (Ouro) has no attention there: the prelude is the embedding, the coda the head.
`AttendingEdges` (Huginn) runs attention blocks in both over the model's edge KV planes (after
the loops' planes), so it builds their metadata, and runs the coda's blocks for every prompt
position once its last loop is done (writing their K/V) and for each sampled decode row right
before its head. It also hands the prelude each row's seed and `init_scale` for the initial
state. The runner picks one at construction (`edge_stages_for`), never per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_rlt.attention.metadata import AttentionMetadata, build_attention_metadata
from vllm_rlt.tensor_utils import to_device
from vllm_rlt.worker.kv_cache import DeviceKVCache


@dataclass(frozen=True)
class EdgeSegment:
    """Consecutive positions of one request outside the loop (rows in segment order)."""

    token_start: int  # position of the first row
    num_tokens: int  # rows
    block_tables: tuple[tuple[int, ...], ...]  # the request's tables, every plane
    seed: int  # the request's seed (its initial state's noise)
    init_scale: float  # scale of that noise


class PlainEdges:
    """A prelude and a coda without attention (the embedding, the LM head)."""

    finishes = False  # nothing runs for prompt rows whose loops are done

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def enter(
        self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[EdgeSegment]
    ) -> torch.Tensor:
        """tokens, positions: [R] of the entering rows -> their state rows."""
        return self.model.prelude(tokens, positions)

    def finish(self, states: torch.Tensor, rows: list[int], segments: list[EdgeSegment]) -> None:
        """`states[rows]`: prompt rows whose loops are done; nothing to run before their head."""

    def logits(self, states: torch.Tensor, segments: list[EdgeSegment]) -> torch.Tensor:
        """State rows [N, S] of the sampling requests -> logits [N, V]."""
        return self.model.coda(states)


class AttendingEdges:
    """A prelude and a coda with attention blocks over `model.num_edge_planes` planes that
    follow the loops' `first_plane` planes."""

    finishes = True  # prompt rows whose loops are done run the coda's blocks (`finish`)

    def __init__(
        self, model: torch.nn.Module, kv_cache: DeviceKVCache, first_plane: int, tile_rows: int
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.first_plane = first_plane
        self.tile_rows = tile_rows
        self.device = kv_cache.kv.device

    def _metas(self, segments: list[EdgeSegment]) -> list[AttentionMetadata]:
        starts = [s.token_start for s in segments]
        counts = [s.num_tokens for s in segments]
        return [
            build_attention_metadata(
                starts,
                counts,
                [s.block_tables[self.first_plane + k] for s in segments],
                self.kv_cache.block_size,
                self.device,
                self.tile_rows,
            )
            for k in range(self.model.num_edge_planes)
        ]

    def enter(self, tokens, positions, segments):
        del positions  # the edge metadata holds them
        counts = [s.num_tokens for s in segments]
        seeds = np.repeat([s.seed for s in segments], counts)
        scales = np.repeat([s.init_scale for s in segments], counts)
        return self.model.prelude(
            tokens,
            self._metas(segments),
            self.kv_cache,
            to_device(seeds, torch.int64, self.device),
            to_device(scales, torch.float32, self.device),
        )

    def finish(self, states: torch.Tensor, rows: list[int], segments: list[EdgeSegment]) -> None:
        """`states[rows]`: prompt rows whose loops are done: the coda's blocks write their K/V."""
        done = states[to_device(rows, torch.int64, self.device)]
        self.model.coda_blocks(done, self._metas(segments), self.kv_cache)

    def logits(self, states, segments):
        metas = self._metas(segments)
        return self.model.coda(self.model.coda_blocks(states, metas, self.kv_cache))


def edge_stages_for(
    model: torch.nn.Module, kv_cache: DeviceKVCache, num_loop_planes: int, tile_rows: int
) -> PlainEdges | AttendingEdges:
    """The strategy `model` needs: attending edges when it has edge KV planes."""
    if model.num_edge_planes:
        return AttendingEdges(model, kv_cache, num_loop_planes, tile_rows)
    return PlainEdges(model)
