"""The pool of physical KV blocks: reference counts, the free queue and the prefix-cache index
(host side, no torch).

Blocks are shared by every plane and layer: one block id addresses `block_size` positions of one
plane in every layer's K and V tensors. A block is in use while a request's table holds it (a
prefix-cache hit makes several tables hold one block). A block nobody holds is free: it waits in
the free queue, oldest release first, and keeps its contents and cache key until it is handed
out again, so a released prompt block can still be found by a later request (LRU eviction among
unreferenced blocks). Freed blocks are not zeroed; sequence lengths hide their stale content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int, num_planes: int = 1):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._plane = [0] * num_blocks  # plane of each block in use (usage per plane)
        self._in_use = [0] * num_planes  # blocks in use per plane
        self._key: dict[int, Hashable] = {}  # block -> its prefix-cache key
        self._cached: dict[Hashable, int] = {}  # prefix-cache key -> block

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (cached ones among them can be evicted at any time)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def plane_usage(self) -> list[int]:
        """Blocks in use per plane."""
        return list(self._in_use)

    def allocate(self, count: int, plane: int = 0) -> list[int]:
        """Take `count` free blocks for `plane`, oldest release first, evicting the cache entry a
        block still carries (the caller checked availability)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            key = self._key.pop(block, None)
            if key is not None:
                del self._cached[key]
            self._hold(block, plane)
            blocks.append(block)
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the end of the free
        queue (pass a request's blocks tail first: its last blocks are then evicted first)."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._in_use[self._plane[block]] -= 1
                self._free[block] = None

    def lookup(self, key: Hashable) -> int | None:
        """The block cached under `key`, if any (held or free)."""
        return self._cached.get(key)

    def share(self, block: int, plane: int) -> None:
        """One more reference to a cached block (a prefix-cache hit); a free one leaves the
        free queue."""
        if self._refs[block] == 0:
            del self._free[block]
        self._hold(block, plane)

    def cache(self, block: int, key: Hashable) -> None:
        """Index a block whose contents are final under `key` (first block wins a key)."""
        if key not in self._cached and block not in self._key:
            self._cached[key] = block
            self._key[block] = key

    def _hold(self, block: int, plane: int) -> None:
        if self._refs[block] == 0:
            self._plane[block] = plane
            self._in_use[plane] += 1
        self._refs[block] += 1
