"""Runs the paged model one recurrent-core invocation at a time over explicit segments.

A segment is a contiguous range of positions of one request at one depth. The executor turns
segments into attention metadata (block tables from the host `KVCacheManager`), calls the model's
recurrent core once for all of them, and applies the skipped-depth KV copy when a token exits.
It holds no request state of its own: callers keep each segment's hidden state. The stages
outside the loop run through the model's `edge_stages` strategy (Huginn's attend over its edge
planes; their initial state is the zero state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_rlt.attention.metadata import AttentionMetadata, build_attention_metadata
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.worker.edge_stages import EdgeSegment, edge_stages_for
from vllm_rlt.worker.kv_cache import DeviceKVCache


@dataclass(frozen=True)
class Segment:
    req_id: str  # request the rows belong to
    token_start: int  # position of the first row
    num_tokens: int  # rows (consecutive positions)
    depth: int  # 0-based loop the rows run in this invocation


@dataclass(frozen=True)
class LoopOutput:
    hidden: torch.Tensor  # [R, H] normed state after the loop, rows in segment order
    gate_logits: torch.Tensor  # [R] fp32 exit-gate logits


class PagedExecutor:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_manager: KVCacheManager,
        kv_cache: DeviceKVCache,
        tile_rows: int = 16,
    ):
        self.model = model
        self.kv_manager = kv_manager
        self.kv_cache = kv_cache
        self.tile_rows = tile_rows
        self.device = kv_cache.kv.device
        self.edges = edge_stages_for(model, kv_cache, kv_manager.num_loop_planes, tile_rows)

    @classmethod
    def create(
        cls, model: torch.nn.Module, num_blocks: int, block_size: int, layout: str = "last_exited"
    ) -> PagedExecutor:
        """An executor with its own KV cache sized in blocks, on the model's device and dtype."""
        manager = KVCacheManager(
            num_blocks,
            block_size,
            layout,
            model.config.num_loops,
            num_edge_planes=model.num_edge_planes,
        )
        cache = DeviceKVCache.for_model(model, num_blocks, block_size)
        return cls(model, manager, cache)

    def metadata(self, segments: Sequence[Segment]) -> AttentionMetadata:
        m = self.kv_manager
        return build_attention_metadata(
            [s.token_start for s in segments],
            [s.num_tokens for s in segments],
            [m.block_table(s.req_id, m.plane(s.depth)) for s in segments],
            m.block_size,
            self.device,
            self.tile_rows,
        )

    def _segment(self, req_id: str | None, token_start: int, num_tokens: int) -> EdgeSegment:
        m = self.kv_manager
        tables = tuple(m.block_table(req_id, p) for p in range(m.num_planes)) if req_id else ()
        return EdgeSegment(token_start, num_tokens, tables, seed=0, init_scale=0.0)

    @torch.inference_mode()
    def embed(
        self, token_ids: Sequence[int], token_start: int = 0, req_id: str | None = None
    ) -> torch.Tensor:
        """Prelude output [n, H] for consecutive positions from `token_start` (`req_id`: whose
        edge planes a prelude with attention writes)."""
        ids = torch.tensor(list(token_ids), device=self.device)
        positions = torch.arange(token_start, token_start + len(ids), device=self.device)
        return self.edges.enter(ids, positions, [self._segment(req_id, token_start, len(ids))])

    @torch.inference_mode()
    def logits(self, req_id: str, states: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [N, V] of candidate final states [N, H] of `req_id`'s `position`, one at a
        time (a coda with attention rewrites that position's K/V for each)."""
        seg = [self._segment(req_id, position, 1)]
        return torch.cat([self.edges.logits(s[None], seg) for s in states])

    @torch.inference_mode()
    def loop(self, segments: Sequence[Segment], hidden: torch.Tensor) -> LoopOutput:
        """One recurrent-core invocation; hidden: [R, H] input rows in segment order."""
        meta = self.metadata(segments)
        if hidden.shape[0] != meta.num_rows:
            raise ValueError(f"hidden has {hidden.shape[0]} rows, segments {meta.num_rows}")
        out, gate = self.model.recurrent_core(hidden, meta, self.kv_cache)
        return LoopOutput(out, gate)

    def exit(self, req_id: str, positions: Sequence[int], exit_depths: Sequence[int]) -> None:
        """Tokens at `positions` stop after 0-based depth `exit_depths[i]`: fill skipped planes."""
        pairs = [
            pair
            for pos, depth in zip(positions, exit_depths, strict=True)
            for pair in self.kv_manager.exit_copy_slots(req_id, pos, depth)
        ]
        if pairs:
            slots = torch.tensor(pairs, device=self.device)
            self.kv_cache.copy_slots(slots[:, 0], slots[:, 1])

    @torch.inference_mode()
    def prefill_all_depths(
        self, req_id: str, token_ids: Sequence[int], chunk_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve KV and run a prompt through every depth, chunk by chunk (one chunk per
        invocation). Returns per-depth states [D, S, H] and gate logits [D, S]."""
        seq = len(token_ids)
        chunk = chunk_size or seq
        self.kv_manager.reserve(req_id, seq)
        states, gates = [], []
        for start in range(0, seq, chunk):
            n = min(chunk, seq - start)
            h = self.embed(token_ids[start : start + n], start, req_id)
            chunk_states, chunk_gates = [], []
            for depth in range(self.model.num_loops):
                out = self.loop([Segment(req_id, start, n, depth)], h)
                h = out.hidden
                chunk_states.append(h)
                chunk_gates.append(out.gate_logits)
            self.edges.finish(h, list(range(n)), [self._segment(req_id, start, n)])
            states.append(torch.stack(chunk_states))
            gates.append(torch.stack(chunk_gates))
        return torch.cat(states, 1), torch.cat(gates, 1)
