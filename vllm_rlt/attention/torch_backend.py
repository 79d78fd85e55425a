"""Reference attention backend in plain torch: clear rather than fast.

It loops over segments (not rows), gathers the segment's visible KV through its block table and
computes a masked softmax in fp32. Kernels are tested against it.
"""

from __future__ import annotations

import torch

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.kernels.kv_format import KVLayer, dequantize, quantize
from vllm_rlt.tensor_utils import acc_dtype


class TorchAttentionBackend:
    name = "torch"
    supports_cuda_graphs = False  # loops over the metadata's host copies

    def __init__(self) -> None:
        # the segments of the invocation seen last, which its every layer shares: host tuples
        # (seg_token_starts_host, seg_row_starts_host) -> per segment (first row, end row,
        # context length, the positions its rows must not see, or None when they see them all)
        self._segments: tuple[tuple, list[tuple]] | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVLayer,
        meta: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            write_kv(k, v, cache, meta.slot_mapping)
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = cache.k.shape[2]
        group = num_heads // num_kv_heads
        bs = meta.block_size
        acc = acc_dtype(q.dtype)
        out = torch.empty_like(q)
        for s, (r0, r1, ctx, unseen) in enumerate(self._segments_of(meta, q.device)):
            blocks = meta.block_tables[s, : (ctx + bs - 1) // bs].long()
            keys = cache.k[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
            vals = cache.v[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
            keys, vals = dequantize(keys, cache.k_scale, acc), dequantize(vals, cache.v_scale, acc)
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
            scores = torch.einsum("nhd,chd->hnc", q[r0:r1].to(acc), keys) * head_dim**-0.5
            if unseen is not None:
                scores = scores.masked_fill(unseen, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[r0:r1] = torch.einsum("hnc,chd->nhd", probs, vals).to(q.dtype)
        return out

    def _segments_of(self, meta: AttentionMetadata, device: torch.device) -> list[tuple]:
        """Each segment's rows, context and causal mask (a row sees the positions up to its
        own: the mask is True after it), from the metadata's host copies; computed once for the
        layers of an invocation."""
        key = (meta.seg_token_starts_host, meta.seg_row_starts_host, device)
        if self._segments is None or self._segments[0] != key:
            rows, segments = meta.seg_row_starts_host, []
            for s, t0 in enumerate(meta.seg_token_starts_host):
                r0, r1 = rows[s], rows[s + 1]
                ctx = t0 + r1 - r0
                unseen = None  # one row: it sees every position up to its own
                if r1 - r0 > 1:
                    row_pos = torch.arange(t0, ctx, device=device)
                    unseen = torch.arange(ctx, device=device)[None, :] > row_pos[:, None]
                segments.append((r0, r1, ctx, unseen))
            self._segments = (key, segments)
        return self._segments[1]


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: KVLayer, slot_mapping: torch.Tensor) -> None:
    """Store each row's K/V at its flat slot (one index_copy per tensor, over the caches' bytes:
    CPU index_copy has no FP8 kernel)."""
    for x, c, scale in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        rows = c.view(torch.uint8).view(c.shape[0] * c.shape[1], -1)
        data = quantize(x, scale, c.dtype).contiguous().view(torch.uint8).reshape(x.shape[0], -1)
        rows.index_copy_(0, slot_mapping, data)
