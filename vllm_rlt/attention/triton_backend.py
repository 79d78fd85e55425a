"""Triton attention backend: one-launch KV write, then paged attention over the tile table.

The kernels live in `vllm_rlt.kernels.kv_write` and `vllm_rlt.kernels.paged_attention`; this
class only binds them to the `AttentionBackend` protocol. Set TRITON_INTERPRET=1 before importing
it to run on a CPU.
"""

from __future__ import annotations

import torch

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.kv_write import write_kv_cache
from vllm_rlt.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True
    invariant = False  # each row's output the same bits in any invocation (no KV split)

    def __init__(self, num_splits: int | None = None) -> None:
        # KV splits per tile; None takes the invocation's (`AttentionMetadata.num_splits`) or
        # picks them per call from the grid size and the max context (under CUDA graphs both are
        # fixed per row bucket, so the choice is too).
        self.num_splits = num_splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVLayer,
        meta: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q: [R, Hq, d]; k, v: [R, Hkv, d]; the layer's caches: [num_blocks, block_size, Hkv, d].

        Returns [R, Hq, d] in q's dtype (see `AttentionBackend.forward`).
        """
        if not kv_stored:
            write_kv_cache(k, v, cache, meta.slot_mapping)
        splits = meta.num_splits if self.num_splits is None else self.num_splits
        return paged_attention(q, cache, meta, num_splits=splits, invariant=self.invariant)


class InvariantTritonAttentionBackend(TritonAttentionBackend):
    """The batch-invariant launch (`paged_attention(..., invariant=True)`), for batch_invariant."""

    name = "triton_invariant"
    invariant = True
