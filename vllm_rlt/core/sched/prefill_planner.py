"""Prefill planning on a fixed chunk grid: which prompt tasks run in the next invocation.

A chunk is `chunk_size` prompt positions on a grid from position 0; a piece is the rows of a chunk
that entered depth 0 together (the token budget may cut only that entry); a task is one piece
at one depth. A request holds at most `ring_slots` chunks in its prefill hidden-state ring: a new
chunk enters only when its slot (chunk index % ring_slots) is free, i.e. once the oldest resident
chunk has finished its final depth. With one slot this is split/atomic chunked prefill.

Readiness (the only dependency rule): a piece may run depth d once every earlier prompt position
has written plane d - by an earlier invocation, or by a task scheduled into the same invocation
(each layer writes the invocation's K/V before attending).
"""

from __future__ import annotations

from vllm_rlt.core.sched.execution_batch import RowKind, ScheduledRequest
from vllm_rlt.request import PrefillPiece, Request


class ChunkedPrefillPlanner:
    def __init__(self, chunk_size: int, num_loops: int, ring_slots: int = 1):
        self.chunk_size = chunk_size
        self.num_loops = num_loops
        self.ring_slots = ring_slots

    def row_offset(self, token_start: int) -> int:
        """Row of `token_start` in its request's ring: slot * chunk_size + offset in the chunk."""
        c = self.chunk_size
        return (token_start // c) % self.ring_slots * c + token_start % c

    def plan_request(self, req: Request, budget: int) -> list[ScheduledRequest]:
        """Ready tasks of one request that fit `budget` rows, oldest piece first; new positions
        enter depth 0 last (they may be cut to the remaining budget). Records new pieces."""
        tasks: list[ScheduledRequest] = []
        scheduled: set[int] = set()  # token_start of pieces scheduled now
        for i, piece in enumerate(req.pieces):
            if piece.depth >= self.num_loops or piece.num_tokens > budget:
                continue
            if self._ready(req.pieces[:i], piece.depth, scheduled):
                tasks.append(self._task(req, piece))
                scheduled.add(piece.token_start)
                budget -= piece.num_tokens
        while budget > 0 and self._can_enter(req) and self._ready(req.pieces, 0, scheduled):
            start = req.num_prefilled_tokens
            chunk_end = min((start // self.chunk_size + 1) * self.chunk_size, req.num_prompt_tokens)
            piece = PrefillPiece(start, min(budget, chunk_end - start), 0)
            req.pieces.append(piece)
            req.num_prefilled_tokens += piece.num_tokens
            tasks.append(self._task(req, piece))
            scheduled.add(piece.token_start)
            budget -= piece.num_tokens
        return tasks

    def atomic_loops(self, req: Request, tasks: list[ScheduledRequest], loops: int) -> bool:
        """Whether `req`'s tasks can run `loops` invocations with no decision between them: every
        earlier piece left out of the batch must already be past the depths they will reach."""
        scheduled = {t.token_start for t in tasks}
        for task in tasks:
            last = min(self.num_loops, task.depth + loops)
            for piece in req.pieces:
                if piece.token_start >= task.token_start:
                    break
                if piece.token_start not in scheduled and piece.depth < last:
                    return False
        return True

    def advance(self, req: Request, tasks: list[ScheduledRequest], loops: int) -> bool:
        """Apply `loops` invocations to `req`'s tasks, free finished chunks; True once the whole
        prompt has run every depth."""
        by_start = {p.token_start: p for p in req.pieces}
        for task in tasks:
            piece = by_start[task.token_start]
            piece.depth = min(self.num_loops, piece.depth + loops)
        while req.pieces and req.prefill_reclaimable_tokens < req.num_prompt_tokens:
            start = req.prefill_reclaimable_tokens
            end = min(start + self.chunk_size, req.num_prompt_tokens)
            chunk = [p for p in req.pieces if p.token_start < end]
            if req.num_prefilled_tokens < end or any(p.depth < self.num_loops for p in chunk):
                break
            req.pieces = req.pieces[len(chunk) :]
            req.prefill_reclaimable_tokens = end
        return not req.in_prefill

    def _can_enter(self, req: Request) -> bool:
        start = req.num_prefilled_tokens
        if start >= req.num_prompt_tokens:
            return False
        oldest = req.prefill_reclaimable_tokens // self.chunk_size
        return start // self.chunk_size - oldest < self.ring_slots

    @staticmethod
    def _ready(earlier: list[PrefillPiece], depth: int, scheduled: set[int]) -> bool:
        return all(
            p.depth > depth or (p.depth == depth and p.token_start in scheduled) for p in earlier
        )

    def _task(self, req: Request, piece: PrefillPiece) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=req.request_id,
            kind=RowKind.PREFILL,
            token_start=piece.token_start,
            num_tokens=piece.num_tokens,
            depth=piece.depth,
            prefill_hidden_row_offset=self.row_offset(piece.token_start),
        )
