"""Depth-aware paged KV accounting (host side, no torch).

Owns the block tables: for each request and plane, the physical blocks holding its positions.
LAST_EXITED keeps one plane per depth (a row at depth d reads and writes plane d); SHARED keeps
one plane that every depth overwrites. A model with attention layers outside the loop (Huginn's
prelude and coda) has `num_edge_planes` more after those, written with depth 0. Blocks are
allocated on demand, plane by plane, when the scheduler places work that writes positions there
(`allocate`), and released when the request ends or is preempted.

Prefix caching: a full block of prompt positions is keyed by a hash chain over the prompt's token
ids from position 0 (salted with the layout, loop and edge plane counts and block size: everything
else that decides the KV), one key per plane. Prompt positions run every loop, so their KV does
not depend on exit decisions; once every plane holds a block's positions (`cache_prompt`), later
requests with the same prefix share those blocks (`find_prefix`, `attach`) until the pool evicts
them.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from vllm_rlt.config import KVLayout
from vllm_rlt.core.block_pool import BlockPool


class KVCapacityError(ValueError):
    """A reservation the cache cannot hold; the message says what is needed and available."""


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks a prompt starts with: `blocks[plane]` lists them in position order."""

    num_tokens: int  # positions the hit covers (whole blocks)
    blocks: tuple[tuple[int, ...], ...]
    digests: tuple[bytes, ...] = ()  # the hash chain of those blocks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVLayout | str,
        num_loops: int,
        enable_prefix_caching: bool = False,
        num_edge_planes: int = 0,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.layout = KVLayout(layout)
        self.block_size = block_size
        self.num_loops = num_loops
        # planes the loops read and write (exits copy between them), then the edge planes
        self.num_loop_planes = self.layout.num_planes(num_loops)
        self.num_planes = self.num_loop_planes + num_edge_planes
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, self.num_planes)
        self._tables: dict[str, list[list[int]]] = {}  # req_id -> per-plane block lists
        # req_id -> the hash chain of its prompt blocks in the cache (extended as blocks finish)
        self._chains: dict[str, list[bytes]] = {}
        self._changed: set[str] = set()  # requests whose tables grew since `take_changed`
        self._salt = f"{self.layout.value}:{num_loops}:{num_edge_planes}:{block_size}".encode()

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

    # ---- allocation -------------------------------------------------------------------------
    def num_new_blocks(self, req_id: str, plane: int, end: int) -> int:
        """Blocks `plane` of `req_id` lacks to hold positions [0, end)."""
        tables = self._tables.get(req_id)
        held = len(tables[plane]) if tables else 0
        return max(0, -(-end // self.block_size) - held)

    def allocate(self, req_id: str, plane: int, end: int) -> None:
        """Make `plane` of `req_id` hold positions [0, end) (the caller checked `num_free`)."""
        count = self.num_new_blocks(req_id, plane, end)
        if count:
            table = self._tables.setdefault(req_id, [[] for _ in range(self.num_planes)])
            table[plane].extend(self.pool.allocate(count, plane))
            self._changed.add(req_id)

    def reserve(self, req_id: str, num_tokens: int) -> None:
        """Make every plane of `req_id` hold `num_tokens` positions at once."""
        need = sum(self.num_new_blocks(req_id, p, num_tokens) for p in range(self.num_planes))
        if num_tokens > self.max_tokens_per_request() or need > self.pool.num_free:
            raise KVCapacityError(
                f"request {req_id!r} needs {need} more KV blocks ({num_tokens} positions x "
                f"{self.num_planes} planes, block size {self.block_size}) but only "
                f"{self.pool.num_free} of {self.pool.num_blocks} are free"
            )
        for plane in range(self.num_planes):
            self.allocate(req_id, plane, num_tokens)

    def free(self, req_id: str) -> None:
        """Release every block of `req_id` (no-op for an unknown id)."""
        self._chains.pop(req_id, None)
        self._changed.discard(req_id)
        self._release_tail(self._tables.pop(req_id, []), 0)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Release `req_id`'s blocks past those that hold positions [0, num_tokens) in every
        plane (rejected speculative positions; generated positions are never shared)."""
        tables = self._tables.get(req_id)
        if tables and self._release_tail(tables, -(-num_tokens // self.block_size)):
            self._changed.add(req_id)

    def _release_tail(self, tables: list[list[int]], keep: int) -> bool:
        """Release the blocks of `tables` from block index `keep` on, last positions first so
        that they are evicted before the prefix other requests may share; whether any was."""
        longest = max((len(t) for t in tables), default=0)
        self.pool.release(
            t[i] for i in reversed(range(keep, longest)) for t in tables if i < len(t)
        )
        for table in tables:
            del table[keep:]
        return longest > keep

    def mark_changed(self, req_id: str) -> None:
        """Report `req_id`'s tables at the next `take_changed` (blocks reserved before the
        scheduler took the request in: a prefill/decode import)."""
        self._changed.add(req_id)

    def take_changed(self) -> list[str]:
        """Requests whose block tables changed since the last call."""
        changed, self._changed = sorted(self._changed), set()
        return changed

    # ---- prefix cache -----------------------------------------------------------------------
    def find_prefix(self, token_ids: list[int], max_tokens: int) -> PrefixHit:
        """The longest run of cached full blocks that `token_ids` starts with, within its first
        `max_tokens` positions."""
        if not self.enable_prefix_caching:
            return PrefixHit(0, ())
        planes: list[list[int]] = [[] for _ in range(self.num_planes)]
        chain: list[bytes] = []
        for digest in self._digests(token_ids, chain, max_tokens // self.block_size):
            found = [self.pool.lookup((digest, p)) for p in range(self.num_planes)]
            if None in found:
                break
            chain.append(digest)
            for plane, block in zip(planes, found, strict=True):
                plane.append(block)
        num_tokens = len(chain) * self.block_size
        return PrefixHit(num_tokens, tuple(tuple(p) for p in planes), tuple(chain))

    def attach(self, req_id: str, hit: PrefixHit) -> None:
        """Start `req_id`'s tables with the blocks of a prefix hit (one more reference each)."""
        if not hit.num_tokens:
            return
        table = self._tables.setdefault(req_id, [[] for _ in range(self.num_planes)])
        for plane, blocks in enumerate(hit.blocks):
            for block in blocks:
                self.pool.share(block, plane)
            table[plane].extend(blocks)
        self._chains[req_id] = list(hit.digests)
        self._changed.add(req_id)

    def cache_prompt(self, req_id: str, token_ids: list[int], num_tokens: int) -> None:
        """Index `req_id`'s full blocks among the first `num_tokens` positions, which every plane
        holds now (prompt positions only)."""
        if not self.enable_prefix_caching or req_id not in self._tables:
            return
        chain = self._chains.setdefault(req_id, [])
        tables = self._tables[req_id]
        for digest in self._digests(token_ids, chain, num_tokens // self.block_size):
            for plane, table in enumerate(tables):
                self.pool.cache(table[len(chain)], (digest, plane))
            chain.append(digest)

    def _digests(self, token_ids: list[int], chain: list[bytes], num_blocks: int):
        """The hash chain of `token_ids`'s full blocks after the `len(chain)` in `chain`, up to
        the first `num_blocks` (each digest covers its block and every block before it)."""
        digest, size = (chain[-1] if chain else self._salt), self.block_size
        for i in range(len(chain), min(num_blocks, len(token_ids) // size)):
            block = token_ids[i * size : (i + 1) * size]
            h = hashlib.blake2b(digest, digest_size=16)
            h.update(array("q", block).tobytes())
            digest = h.digest()
            yield digest

    # ---- addressing -------------------------------------------------------------------------
    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def plane(self, depth: int) -> int:
        """The plane a row at `depth` (0-based) reads and writes."""
        return depth if self.layout is KVLayout.LAST_EXITED else 0

    def planes_written(self, depth: int) -> tuple[int, ...]:
        """The planes a row at `depth` writes: its loop plane, and at depth 0 the edge planes
        too (the prelude's layers; the coda's write the same positions later)."""
        edge = range(self.num_loop_planes, self.num_planes) if depth == 0 else ()
        return (self.plane(depth), *edge)

    def block_table(self, req_id: str, plane: int) -> tuple[int, ...]:
        tables = self._tables.get(req_id)
        return tuple(tables[plane]) if tables else ()

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
            (src, self.slot(req_id, p, position))
            for p in range(exit_depth + 1, self.num_loop_planes)
        ]
