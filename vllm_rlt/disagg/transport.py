"""KV transfers from a prefill engine to a decode engine over torch.distributed.

Each prefill/decode pair has its own process group (`pair_groups`). A transfer is a header,
int64 `[handle, first block, blocks, last]`, then (when it carries blocks) a payload
`[L, 2, P * blocks, block_size, Hkv * d * itemsize]`: logical blocks `first .. first + blocks`
of the request's prompt in every plane, plane-major, as the cache's bytes (both engines run one
config: the same KV dtype and scales). Messages between one pair arrive
in the order they were sent, so the receiver reads a header, then its payload, then the next
header. The engine loop never waits on a peer: one thread per peer sends (prefill side) or
receives (decode side) with blocking `send` / `recv` (gloo's non-blocking works report their
completion only to `wait()`, so they cannot be polled), and queues connect the threads to the
loop. With NCCL the tensors stay on the GPU; with gloo, CUDA KV passes through host memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vllm_rlt.worker.kv_cache import DeviceKVCache

logger = logging.getLogger(__name__)
HEADER_LEN = 4
TIMEOUT = timedelta(days=1)  # a receive posted for the next header may wait that long


def init_group(backend: str, addr: str, port: int, rank: int, world_size: int) -> None:
    """Join the engines' process group (every engine process calls it; it returns once all
    have joined)."""
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
        timeout=TIMEOUT,
    )  # fmt: skip


def pair_groups(num_prefill: int, num_decode: int) -> dict[tuple[int, int], object]:
    """(prefill rank, decode rank) -> the pair's process group. Every process creates every
    group in the same order (torch.distributed requires it); prefill i is rank i, decode j is
    rank num_prefill + j."""
    return {
        (p, num_prefill + d): dist.new_group([p, num_prefill + d], timeout=TIMEOUT)
        for p in range(num_prefill)
        for d in range(num_decode)
    }


@dataclass(frozen=True)
class Chunk:
    """Blocks of one request's prompt that arrived (every plane)."""

    handle: int  # the request's transfer handle
    first_block: int  # first logical block
    num_blocks: int  # blocks per plane (0: only the `last` mark)
    last: bool  # no more blocks of this request follow
    payload: torch.Tensor | None  # [L, 2, P * num_blocks, block_size, Hkv * d bytes]
    arrived_at: float  # time.monotonic() when its receive completed


class KVSender:
    """The prefill side: sends prompt blocks to decode engines, one thread per peer."""

    def __init__(self, kv_cache: DeviceKVCache, groups: dict[int, object], via_host: bool):
        """`groups`: decode rank -> the pair's process group."""
        self.kv = kv_cache.bytes  # whatever the cache's dtype (gloo has no FP8)
        self.device = torch.device("cpu") if via_host else self.kv.device
        self._queues: dict[int, queue.SimpleQueue] = {}
        self.dead: set[int] = set()
        for peer, group in groups.items():
            q: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[peer] = q
            args = (peer, group, q)
            threading.Thread(
                target=self._run, args=args, daemon=True, name=f"kv-send-{peer}"
            ).start()

    def send(self, peer: int, handle: int, first: int, planes: list[list[int]], last: bool):
        """Blocks `first..` of a request: `planes[p]` are their physical ids in plane p. The
        blocks are gathered now (in stream order: the KV as of the work queued so far)."""
        if peer in self.dead:
            return
        count = len(planes[0])
        header = torch.tensor([handle, first, count, int(last)], dtype=torch.int64)
        tensors = [header]
        if count:
            index = torch.tensor([b for plane in planes for b in plane], device=self.kv.device)
            tensors.append(self.kv[:, :, index])
        self._queues[peer].put(tensors)

    def _run(self, peer: int, group, q: queue.SimpleQueue) -> None:
        try:
            while True:
                for t in q.get():
                    dist.send(t.to(self.device), peer, group=group)
        except RuntimeError:
            logger.warning("the KV link to rank %d failed; that peer is gone", peer)
            self.dead.add(peer)

    def forget(self, peer: int) -> None:
        """Stop sending to `peer` (it died)."""
        self.dead.add(peer)


class KVReceiver:
    """The decode side: one thread per prefill peer receives headers and their payloads."""

    def __init__(self, kv_cache: DeviceKVCache, groups: dict[int, object], num_planes: int,
                 via_host: bool):  # fmt: skip
        """`groups`: prefill rank -> the pair's process group."""
        self.kv = kv_cache.bytes  # the sender's layout
        self.device = torch.device("cpu") if via_host else self.kv.device
        L, two, _, bs, row_bytes = self.kv.shape
        self.block_shape = (L, two, bs, row_bytes)
        self.num_planes = num_planes
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        for peer, group in groups.items():
            args = (peer, group)
            threading.Thread(
                target=self._run, args=args, daemon=True, name=f"kv-recv-{peer}"
            ).start()

    def _run(self, peer: int, group) -> None:
        try:
            while True:
                header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                dist.recv(header, peer, group=group)
                handle, first, count, last = header.tolist()
                payload = None
                if count:
                    L, two, bs, row_bytes = self.block_shape
                    shape = (L, two, self.num_planes * count, bs, row_bytes)
                    payload = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
                    dist.recv(payload, peer, group=group)
                self._arrived.put(
                    Chunk(handle, first, count, bool(last), payload, time.monotonic())
                )
        except RuntimeError:
            logger.warning("the KV link from rank %d failed; that peer is gone", peer)

    def poll(self) -> list[Chunk]:
        """Chunks that arrived since the last call, in arrival order."""
        done = []
        while not self._arrived.empty():
            done.append(self._arrived.get())
        return done

    def write(self, chunk: Chunk, planes: list[list[int]]) -> None:
        """Copy a chunk's payload into the blocks `planes[p]` of each plane p."""
        index = torch.tensor([b for plane in planes for b in plane], device=self.kv.device)
        self.kv[:, :, index] = chunk.payload.to(self.kv.device)
