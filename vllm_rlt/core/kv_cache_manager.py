"""Depth-aware paged KV accounting (host side, no torch).

Owns the block tables: for each request and plane, the physical blocks holding its positions.
LAST_EXITED keeps one plane per depth (a row at depth d reads and writes plane d); SHARED keeps
one plane that every depth overwrites. Reservation is all-planes-at-once: a request that may hold
`n` positions gets `ceil(n / block_size)` blocks in every plane.
"""

from __future__ import annotations

from enum import Enum

from vllm_rlt.core.block_pool import BlockPool


class KVLayout(str, Enum):
    LAST_EXITED = "last_exited"  # one plane per depth; exits copy KV into skipped planes
    SHARED = "shared"  # one plane, overwritten at every loop


def num_planes_for(layout: KVLayout | str, num_loops: int) -> int:
    """KV planes a layout keeps: one per depth (LAST_EXITED) or one (SHARED)."""
    return num_loops if KVLayout(layout) is KVLayout.LAST_EXITED else 1


class KVCapacityError(ValueError):
    """A reservation the cache cannot hold; the message says what is needed and available."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout | str, num_loops: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.layout = KVLayout(layout)
        self.block_size = block_size
        self.num_loops = num_loops
        self.num_planes = num_planes_for(self.layout, num_loops)
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[list[int]]] = {}  # req_id -> per-plane block lists

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks (all planes together) that hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size) * self.num_planes

    def max_tokens_per_request(self) -> int:
        """The most positions one request can ever hold with the whole cache to itself."""
        return self.pool.num_blocks // self.num_planes * self.block_size

    def num_extra_blocks(self, req_id: str, num_tokens: int) -> int:
        tables = self._tables.get(req_id)
        held = len(tables[0]) * self.num_planes if tables else 0
        return max(0, self.blocks_for(num_tokens) - held)

    def can_reserve(self, req_id: str, num_tokens: int) -> bool:
        return self.num_extra_blocks(req_id, num_tokens) <= self.pool.num_free

    def reserve(self, req_id: str, num_tokens: int) -> None:
        """Make every plane of `req_id` hold at least `num_tokens` positions."""
        extra = self.num_extra_blocks(req_id, num_tokens)
        if num_tokens > self.max_tokens_per_request():
            raise KVCapacityError(
                f"request {req_id!r} needs {self.blocks_for(num_tokens)} KV blocks "
                f"({num_tokens} positions x {self.num_planes} planes, block size "
                f"{self.block_size}) but the cache has only {self.pool.num_blocks} blocks in all "
                f"(at most {self.max_tokens_per_request()} positions per request); shorten the "
                f"request or give the cache more memory"
            )
        if extra > self.pool.num_free:
            raise KVCapacityError(
                f"request {req_id!r} needs {extra} more KV blocks ({num_tokens} positions x "
                f"{self.num_planes} planes, block size {self.block_size}) but only "
                f"{self.pool.num_free} of {self.pool.num_blocks} are free; wait for running "
                f"requests to finish or free some"
            )
        if extra == 0:
            return
        tables = self._tables.setdefault(req_id, [[] for _ in range(self.num_planes)])
        per_plane = extra // self.num_planes
        for plane in tables:
            plane.extend(self.pool.allocate(per_plane))

    def free(self, req_id: str) -> None:
        """Release every block of `req_id` (no-op for an unknown id)."""
        for plane in self._tables.pop(req_id, []):
            self.pool.release(plane)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def plane(self, depth: int) -> int:
        """The plane a row at `depth` (0-based) reads and writes."""
        return depth if self.layout is KVLayout.LAST_EXITED else 0

    def block_table(self, req_id: str, plane: int) -> tuple[int, ...]:
        return tuple(self._tables[req_id][plane])

    def slot(self, req_id: str, plane: int, position: int) -> int:
        """The flat slot (block * block_size + offset) of `position` in `plane`."""
        block = self._tables[req_id][plane][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def exit_copy_slots(self, req_id: str, position: int, exit_depth: int) -> list[tuple[int, int]]:
        """(src, dst) slots that fill the planes a token exiting after `exit_depth` skipped.

        Under LAST_EXITED the token's plane-`exit_depth` K/V goes to planes exit_depth+1..D-1;
        SHARED has nothing to copy.
        """
        if self.layout is KVLayout.SHARED:
            return []
        src = self.slot(req_id, exit_depth, position)
        return [
            (src, self.slot(req_id, p, position)) for p in range(exit_depth + 1, self.num_planes)
        ]
