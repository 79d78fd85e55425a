"""CUDA-graph replay of recurrent-core invocations whose segments are all one row (decode).

`DecodeGraphRunner` owns static device buffers sized for its largest row bucket: the input hidden
rows, the gathered hidden-state row index, and the attention metadata that changes per
invocation (positions, slots, segment start positions, block tables; the segment and tile tables
of one-row segments are the same on every invocation of a bucket). An invocation of R one-row
segments is padded to the smallest bucket B >= R with segments at position 0 of the KV cache's
scratch block, which the block pool never hands out: padding rows write and read only that block.
`max_context` is fixed for every bucket, so the attention kernels choose the same KV splits and
grid on every call and a graph captured once per bucket is valid for any invocation it admits.

Per invocation: the host tables (`HostMetadata`, built as for an eager invocation) are packed
into one pinned buffer and sent with one host-to-device copy (plus one device copy that places the
block tables), the input rows are gathered into the static input, and the bucket's graph replays.
Without capture (CPU tests) the very call the graph records runs eagerly over the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_rlt.attention.metadata import AttentionMetadata, HostMetadata
from vllm_rlt.worker.kv_cache import DeviceKVCache

# row buckets (vLLM-like): dense where decode batches are small, coarser up to 256
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# bytes per bucket row of the packed upload before the block tables:
# positions, slot_mapping and the state-row index (int64), seg_token_starts (int32)
_ROW_BYTES = 8 + 8 + 8 + 4


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Buckets for invocations of up to `max_rows` one-row segments (capped at 256)."""
    cap = min(max_rows, BUCKETS[-1])
    return tuple(b for b in BUCKETS if b < cap) + (cap,)


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
    """One invocation loaded into the static buffers, ready for `DecodeGraphRunner.run`."""

    bucket: int  # padded rows B: the graph that runs it
    meta: AttentionMetadata  # [B]-row views of the static buffers (host copies of this call)
    index: torch.Tensor  # [R] int64: hidden-state rows gathered into `hidden` (and scattered back)
    hidden: torch.Tensor  # [R, H] the static input rows (the prelude may overwrite entering rows)


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: DeviceKVCache,
        max_num_seqs: int,
        max_context: int,
        capture: bool = True,
    ):
        """`max_context`: positions a row may have (and KV split sizing for every bucket);
        `capture=False` runs the padded static-buffer calls eagerly (no CUDA needed)."""
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = row_buckets(max_num_seqs)
        self.max_context = max_context
        self.block_size = kv_cache.block_size
        self.max_blocks = -(-max_context // self.block_size)
        device = kv_cache.kv.device
        self._pin = device.type == "cuda"
        n = self.buckets[-1]
        weight = model.lm_head.weight
        self._hidden = torch.zeros(n, model.config.hidden_size, dtype=weight.dtype, device=device)
        self._upload = torch.zeros(
            n * (_ROW_BYTES + 4 * self.max_blocks), dtype=torch.uint8, device=device
        )
        self._tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self._metas = {b: self._static_meta(b, device) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> captured graph
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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
        `states[index]` (states: [N, H], index: [R] int64) into the static buffers; None when the
        invocation does not fit a graph (a segment of several rows, too many rows, or a position
        at or past `max_context`): it then runs eagerly."""
        r = len(token_starts)
        if r > self.buckets[-1] or max(num_rows) > 1 or max(token_starts) >= self.max_context:
            return None
        b = next(x for x in self.buckets if x >= r)
        host = self._host(b, token_starts, block_tables)
        self._load(b, host, index)
        hidden = self._hidden[:r]
        rows = self._field(b, 2, torch.int64)[:r]
        torch.index_select(states, 0, rows, out=hidden)
        meta = replace(self._metas[b], seg_token_starts_host=tuple(host.seg_token_starts.tolist()))
        return StaticInvocation(b, meta, rows, hidden)

    def run(self, inv: StaticInvocation) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrent-core call over the bucket: (hidden [R, H], gate logits [R] fp32). The
        hidden rows are a view of the graph's output, valid until the bucket replays again."""
        r = inv.hidden.shape[0]
        graph = self.graphs.get(inv.bucket)
        if graph is None:
            out, gate = self._forward(inv.bucket, inv.meta)
        else:
            graph.replay()
            out, gate = self._outputs[inv.bucket]
        return out[:r], gate[:r].clone()

    # ---- static buffers ---------------------------------------------------------------------
    def _host(
        self, bucket: int, token_starts: list[int], block_tables: list[tuple[int, ...]]
    ) -> HostMetadata:
        """Host tables of one-row segments padded to `bucket` with scratch-block segments."""
        pad = bucket - len(token_starts)
        return HostMetadata.build(
            [*token_starts, *[0] * pad],
            [1] * bucket,
            [*block_tables, *[(self.kv_cache.scratch_block,)] * pad],
            self.block_size,
            tile_rows=1,
        )

    def _field(self, bucket: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Field `k` of the bucket's packed upload: 0 positions, 1 slot_mapping, 2 the state-row
        index (int64), 3 seg_token_starts (int32); each [bucket]."""
        start = 8 * bucket * k
        return self._upload[start : start + bucket * dtype.itemsize].view(dtype)

    def _static_meta(self, bucket: int, device: torch.device) -> AttentionMetadata:
        """The bucket's metadata: constant segment and tile tables, per-call fields as views."""
        meta = self._host(bucket, [], []).upload(device)
        return replace(
            meta,
            positions=self._field(bucket, 0, torch.int64),
            slot_mapping=self._field(bucket, 1, torch.int64),
            seg_token_starts=self._field(bucket, 3, torch.int32),
            block_tables=self._tables[:bucket],
            max_context=self.max_context,
        )

    def _load(self, bucket: int, host: HostMetadata, index: np.ndarray) -> None:
        """Copy the per-call tables into the bucket's static buffers: one host-to-device copy
        of a pinned buffer (the caching host allocator keeps it until the copy ran), then one
        device copy of the block tables into place. No host synchronisation."""
        tables = host.block_tables[:, : self.max_blocks]  # positions < max_context need no more
        width = tables.shape[1]
        head = _ROW_BYTES * bucket
        packed = torch.empty(head + 4 * bucket * width, dtype=torch.uint8, pin_memory=self._pin)
        a = packed.numpy()
        for k, values in enumerate((host.positions, host.slot_mapping, index)):
            a[8 * bucket * k : 8 * bucket * k + 8 * len(values)].view(np.int64)[:] = values
        a[24 * bucket : head].view(np.int32)[:] = host.seg_token_starts
        a[head:].view(np.int32)[:] = tables.ravel()
        self._upload[: packed.shape[0]].copy_(packed, non_blocking=True)
        staged = self._upload[head : packed.shape[0]].view(torch.int32).view(bucket, width)
        self._tables[:bucket, :width].copy_(staged)

    # ---- capture ----------------------------------------------------------------------------
    def _forward(self, bucket: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.recurrent_core(self._hidden[:bucket], meta, self.kv_cache)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool; each after an
        eager warm-up (kernel compilation) over padding rows only."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            self._load(b, self._host(b, [], []), np.zeros(0, dtype=np.int64))
            self._forward(b, self._metas[b])
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[b] = self._forward(b, self._metas[b])
            self.graphs[b] = graph
