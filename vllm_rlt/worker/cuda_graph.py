"""CUDA-graph replay of recurrent-core invocations: one graph per bucket (`graph_tables.py`).

`CudaGraphRunner` owns static device buffers sized for its largest bucket: the input hidden
rows, one upload buffer for everything a call changes (row, segment and tile tables and the
gathered state-row index, laid out per bucket by `graph_tables.field_offsets`) and the block-table
matrix; each graph's `AttentionMetadata` views them. `max_context` is fixed for every graph, so
the attention kernels choose the same KV splits on every call (mixed graphs: none), and the tile
tables have a fixed length per bucket (zero-row tiles fill them), so the kernels' grids are fixed
too: a graph captured once per bucket is valid for any invocation the bucket admits (decode
graphs: one-row segments only; mixed graphs: segments whose tiles fit its tile slots).

Per invocation: the host tables (`HostMetadata`, built as for an eager invocation) and the padding
rows are packed into one pinned buffer and sent with one host-to-device copy; one device copy
places the block tables and one fill points the padding segments at the scratch block; the input
rows are gathered into the static input, and the graph replays. No step waits for the GPU. The
prelude of entering rows and the scatter of the outputs stay outside the graph (the model
runner's `_invoke`). Without capture (CPU tests) the very call a graph records runs eagerly over
the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_rlt.attention.metadata import TILE_ROWS, AttentionMetadata, HostMetadata
from vllm_rlt.worker.graph_tables import (
    GraphSpec,
    field_offsets,
    pack,
    select_spec_for,
    tables_offset,
)
from vllm_rlt.worker.kv_cache import DeviceKVCache


def graphs_supported(model: torch.nn.Module) -> bool:
    """True when `model` runs on CUDA and each of its attention backends stays valid under replay
    (`AttentionBackend.supports_cuda_graphs`)."""
    backends = [m.backend for m in model.modules() if hasattr(m, "backend")]
    return (
        model.lm_head.weight.device.type == "cuda"
        and bool(backends)
        and all(getattr(b, "supports_cuda_graphs", False) for b in backends)
    )


@dataclass(frozen=True)
class StaticInvocation:
    """One invocation loaded into the static buffers, ready for `CudaGraphRunner.run`."""

    spec: GraphSpec  # the graph that runs it (its bucket of B rows)
    meta: AttentionMetadata  # [B]-row views of the static buffers (host copies of this call)
    index: torch.Tensor  # [R] int64: hidden-state rows gathered into `hidden` (and scattered back)
    hidden: torch.Tensor  # [R, H] the static input rows (the prelude may overwrite entering rows)


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: DeviceKVCache,
        specs: tuple[GraphSpec, ...],
        max_context: int,
        tile_rows: int = TILE_ROWS,
        capture: bool = True,
    ):
        """`specs`: the graphs (`graph_tables.graph_specs`); `max_context`: positions a row may
        have (and KV split sizing for every graph); `tile_rows`: rows per multi-row tile, as the
        eager runner tiles; `capture=False` runs the padded static-buffer calls eagerly (no CUDA
        needed)."""
        self.model = model
        self.kv_cache = kv_cache
        self.specs = specs
        self.max_context = max_context
        self.tile_rows = tile_rows
        self.max_blocks = -(-max_context // kv_cache.block_size)
        device = kv_cache.kv.device
        self._pin = device.type == "cuda"
        n = max(s.num_rows for s in specs)
        head = max(tables_offset(s) for s in specs)
        weight = model.lm_head.weight
        self._hidden = torch.zeros(n, model.state_size, dtype=weight.dtype, device=device)
        self._upload = torch.zeros(head + 4 * n * self.max_blocks, dtype=torch.uint8, device=device)
        self._tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self._metas = {s: self._static_meta(s, device) for s in specs}
        self.graphs: dict[GraphSpec, torch.cuda.CUDAGraph] = {}  # captured graphs
        self._outputs: dict[GraphSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        if capture:
            self._capture()

    def prepare(
        self,
        token_starts: list[int],
        num_rows: list[int],
        block_tables: list[tuple[int, ...]],
        index: np.ndarray,
        states: torch.Tensor,
    ) -> StaticInvocation | None:
        """Load an invocation's segments (as for `HostMetadata.build`) and its input rows
        `states[index]` (states: [N, H], index: [R] int64) into the static buffers; None when no
        graph admits the invocation (too many rows or tiles, or a position at or past
        `max_context`): it then runs eagerly."""
        ends = (s + n for s, n in zip(token_starts, num_rows, strict=True))
        # more rows than the largest graph: no tables to build, the eager path builds its own
        if sum(num_rows) > self._hidden.shape[0] or max(ends) > self.max_context:
            return None
        block_size = self.kv_cache.block_size
        host = HostMetadata.build(token_starts, num_rows, block_tables, block_size, self.tile_rows)
        spec = select_spec_for(self.specs, num_rows, host.tile_num_rows)
        if spec is None:
            return None
        meta = self._load(spec, host, index)
        r = index.shape[0]
        hidden = self._hidden[:r]
        rows = self._field(spec, "index")[:r]
        torch.index_select(states, 0, rows, out=hidden)
        return StaticInvocation(spec, meta, rows, hidden)

    def run(self, inv: StaticInvocation) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrent-core call over the bucket: (hidden [R, H], gate logits [R] fp32), views
        of the graph's outputs, valid until the graph replays again."""
        r = inv.hidden.shape[0]
        graph = self.graphs.get(inv.spec)
        if graph is None:
            out, gate = self._forward(inv.spec, inv.meta)
        else:
            graph.replay()
            out, gate = self._outputs[inv.spec]
        return out[:r], gate[:r]

    # ---- static buffers ---------------------------------------------------------------------
    def _field(self, spec: GraphSpec, name: str) -> torch.Tensor:
        """A fixed-size field of the spec's upload layout, as a device tensor view."""
        offset, dtype, length = field_offsets(spec)[name]
        torch_dtype = torch.int64 if dtype == np.int64 else torch.int32
        return self._upload[offset : offset + length * torch_dtype.itemsize].view(torch_dtype)

    def _static_meta(self, spec: GraphSpec, device: torch.device) -> AttentionMetadata:
        """The graph's metadata: views of the static buffers, launch shapes fixed for the spec
        (host copies of the segment tables are filled per call)."""
        b = spec.num_rows
        return AttentionMetadata(
            block_size=self.kv_cache.block_size,
            positions=self._field(spec, "positions"),
            slot_mapping=self._field(spec, "slot_mapping"),
            seg_row_starts=self._field(spec, "seg_row_starts"),
            seg_token_starts=self._field(spec, "seg_token_starts"),
            block_tables=self._tables[:b],
            tile_rows=self.tile_rows,
            tile_seg=self._field(spec, "tile_seg"),
            tile_row_start=self._field(spec, "tile_row_start"),
            tile_num_rows=self._field(spec, "tile_num_rows"),
            seg_row_starts_host=(),
            seg_token_starts_host=(),
            max_context=self.max_context,
            tile_order=torch.arange(spec.num_tiles, dtype=torch.int32, device=device),
            num_one_row_tiles=spec.num_one_slots,
            max_tile_rows=min(self.tile_rows, b) if spec.num_chunk_slots else 1,
            num_splits=1 if spec.num_chunk_slots else None,  # see graph_tables
        )

    def _load(
        self, spec: GraphSpec, host: HostMetadata | None, index: np.ndarray
    ) -> AttentionMetadata:
        """Copy a call's tables into the spec's static buffers: one host-to-device copy of a
        pinned buffer (the caching host allocator keeps it until the copy ran), one device copy
        that places the block tables, one fill for the padding segments' tables. No host
        synchronisation. Returns the spec's metadata with this call's host copies."""
        scratch = self.kv_cache.scratch_block
        slot = scratch * self.kv_cache.block_size
        packed = pack(spec, host, index, slot, self.max_blocks, self._pin)
        self._upload[: packed.data.shape[0]].copy_(packed.data, non_blocking=True)
        s, w, p = packed.num_tables, packed.width, packed.num_padding
        if s:
            head = tables_offset(spec)
            staged = self._upload[head : head + 4 * s * w].view(torch.int32).view(s, w)
            self._tables[:s, :w].copy_(staged)
        if p:
            self._tables[s : s + p, 0].fill_(scratch)  # padding rows: the scratch block's slot 0
        return replace(
            self._metas[spec],
            seg_row_starts_host=packed.seg_row_starts,
            seg_token_starts_host=packed.seg_token_starts,
        )

    # ---- capture ----------------------------------------------------------------------------
    def _forward(
        self, spec: GraphSpec, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.recurrent_core(self._hidden[: spec.num_rows], meta, self.kv_cache)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture one graph per spec, largest first, all in one memory pool; each after an eager
        warm-up (kernel compilation) over padding rows only."""
        pool = torch.cuda.graph_pool_handle()
        for spec in sorted(self.specs, reverse=True):
            meta = self._load(spec, None, np.zeros(0, dtype=np.int64))
            self._forward(spec, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[spec] = self._forward(spec, meta)
            self.graphs[spec] = graph
