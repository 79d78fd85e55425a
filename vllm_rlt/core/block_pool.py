"""The pool of physical KV blocks: a free list and nothing else (host side, no torch).

Blocks are shared by every plane and layer: one block id addresses `block_size` positions of one
plane in every layer's K and V tensors. Freed blocks are not zeroed; sequence lengths hide their
stale content.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (the caller checked availability)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        """Return blocks; they are handed out again after the blocks freed before them."""
        self._free.extend(blocks)
