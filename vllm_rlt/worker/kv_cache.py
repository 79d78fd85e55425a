"""Device KV tensors: one tensor holds K and V of every layer for every physical block.

Layout `[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]`; block ids come with
the plans (the scheduler's `KVCacheManager` hands them out and computes the slots of the
skipped-depth copy). The extra last block is the scratch block: the manager's pool of `num_blocks`
never hands it out, and padding rows of a CUDA-graph invocation write and read only it. An FP8
cache (`kv_format`) holds a K and a V scale per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_rlt.kernels.kv_format import FP8, KVLayer


class DeviceKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: Sequence[tuple[float, float]] | None = None,
    ):
        """scales: (k_scale, v_scale) of each layer (default 1.0; used by FP8 caches only)."""
        self.block_size = block_size
        self.scales = [(1.0, 1.0)] * num_layers if scales is None else list(scales)
        if len(self.scales) != num_layers:
            raise ValueError(f"{len(self.scales)} KV scale pairs for {num_layers} layers")
        self.scratch_block = num_blocks  # never in a block table: padding rows use it
        self.kv = torch.zeros(
            num_layers,
            2,
            num_blocks + 1,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        scales: Sequence[tuple[float, float]] | None = None,
    ) -> DeviceKVCache:
        """A cache of `num_blocks` blocks for `model`'s layers and heads, on its device and in
        `dtype` (default: the model's)."""
        c, weight = model.config, model.lm_head.weight
        return cls(
            c.num_kv_layers,
            num_blocks,
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            dtype or weight.dtype,
            weight.device,
            scales,
        )

    def layer(self, index: int) -> KVLayer:
        """Layer `index`'s caches, each [num_blocks, block_size, Hkv, d], and scales."""
        return KVLayer(self.kv[index, 0], self.kv[index, 1], *self.scales[index])

    def amax(self) -> list[tuple[float, float]]:
        """The largest |K| and |V| each layer holds (every block and plane; FP8 as stored),
        reduced in place a layer's K or V at a time (no copy of the cache)."""

        def peak(t: torch.Tensor) -> float:
            t = t.float() if t.dtype == FP8 else t  # FP8 has no min/max reductions on the CPU
            return max(float(t.amax()), -float(t.amin()))

        return [(peak(self.kv[i, 0]), peak(self.kv[i, 1])) for i in range(self.kv.shape[0])]

    @property
    def bytes(self) -> torch.Tensor:
        """The cache's storage as bytes, [L, 2, num_blocks + 1, block_size, Hkv * d * itemsize]
        (copies and transfers move it whatever the dtype: CPU indexing has no FP8 kernels)."""
        kv = self.kv
        return kv.view(torch.uint8).view(*kv.shape[:4], -1)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For every layer, K and V: slot dst[i] <- slot src[i] (the skipped-depth copy).

        src, dst: [N] int64 flat slots; a slot appears at most once in dst and never in both.
        """
        if src.numel() == 0:
            return
        flat = self.bytes.flatten(2, 3)
        flat[:, :, dst] = flat[:, :, src]
