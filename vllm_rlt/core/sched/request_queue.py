"""Waiting queues: FCFS (arrival order) or priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
import itertools

from vllm_rlt.request import Request


class RequestQueue:
    def __init__(self, policy: str):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"queue_policy must be fcfs or priority, got {policy!r}")
        self.policy = policy
        self._heap: list[tuple[tuple, Request]] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)  # preempted requests go before every other
        self._removed: set[int] = set()  # id() of removed requests still in the heap
        self._size = 0

    def _key(self, req: Request, seq: int) -> tuple:
        if self.policy == "priority":
            return (req.priority, req.arrival_time, seq)
        return (seq,)

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (self._key(req, next(self._order)), req))
        self._size += 1

    def push_front(self, req: Request) -> None:
        """Queue a preempted request: FCFS puts it first (the latest preempted first), the
        priority policy by its priority and arrival."""
        heapq.heappush(self._heap, (self._key(req, next(self._front)), req))
        self._size += 1

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        self._size -= 1
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        """Lazy removal (abort of a waiting request)."""
        self._removed.add(id(req))
        self._size -= 1

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][1]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[1]))

    def __len__(self) -> int:
        return self._size

    def __iter__(self):
        return (r for _, r in sorted(self._heap, key=lambda x: x[0]) if id(r) not in self._removed)
