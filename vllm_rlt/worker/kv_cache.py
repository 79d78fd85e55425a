"""Device KV tensors: one tensor holds K and V of every layer for every physical block.

Layout `[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]`; block ids come from
the host-side `KVCacheManager` (which also computes the slots of the skipped-depth copy). The extra
last block is the scratch block: the manager's pool of `num_blocks` never hands it out, and padding
rows of a CUDA-graph invocation write and read only it.
"""

from __future__ import annotations

import torch


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
    ):
        self.block_size = block_size
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
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int) -> DeviceKVCache:
        """A cache of `num_blocks` blocks for `model`'s layers and heads, on its device and in
        its dtype."""
        c, weight = model.config, model.lm_head.weight
        return cls(
            c.num_kv_layers,
            num_blocks,
            block_size,
            c.num_key_value_heads,
            c.head_dim,
            weight.dtype,
            weight.device,
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s (k_cache, v_cache), each [num_blocks, block_size, Hkv, d]."""
        return self.kv[index, 0], self.kv[index, 1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For every layer, K and V: slot dst[i] <- slot src[i] (the skipped-depth copy).

        src, dst: [N] int64 flat slots; a slot appears at most once in dst and never in both.
        """
        if src.numel() == 0:
            return
        flat = self.kv.view(self.kv.shape[0], 2, -1, *self.kv.shape[-2:])
        flat[:, :, dst] = flat[:, :, src]
