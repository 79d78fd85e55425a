"""Prefill planning on a fixed chunk grid: which prompt tasks run in the next invocation.

A chunk is `chunk_size` prompt positions on a grid from position 0; a piece is the rows of a chunk
that entered depth 0 together (the token budget may cut only that entry); a task is one piece
at one depth. A request holds at most `ring_slots` chunks in its prefill hidden-state ring: a new
chunk enters only when its slot (chunk index % ring_slots) is free, i.e. once the chunk that held
it has finished its final depth.

Readiness (the one dependency rule): a piece may run depth d once every earlier prompt position
has written plane d - in an earlier invocation, or by a task scheduled into the same invocation
(each layer writes the invocation's K/V before attending).

Two strategies share that machinery and differ in ring size and task order:
- `SplitPlanner` (one ring slot): requests in queue order, each one's resident pieces oldest
  first, then its new positions. With no reason to yield the scheduler runs the batch through
  all remaining depths (atomic), else one depth per step (split).
- `WavefrontPlanner` (WCPB; a ring of max(D, budget // chunk) slots, so that one long prompt
  can fill an invocation with its own chunks): ready tasks of all requests, deepest first (a
  deeper task finishes a chunk sooner, which frees a ring slot and brings the first token
  closer), ties by queue order then position; new positions enter depth 0 last, one chunk per
  request per round, rounds in queue order: requests share the rows left for new chunks, so
  requests admitted together progress together (as under Split) rather than one after the other,
  which would leave the early ones decoding beside the others' prefill chunks.
  Regrouping happens at every depth boundary, so each invocation has a plan of its own; the
  scheduler may plan several as one step (`wavefront_step.py`).
"""

from __future__ import annotations

from dataclasses import replace

from vllm_rlt.config import KVLayout
from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.core.sched.execution_batch import NewRequestData, RowKind, ScheduledRequest
from vllm_rlt.request import PrefillPiece, Request

_ENTRY = None  # marks a request's depth-0 entry of new positions among the candidates


class _ChunkedPlanner:
    ring_slots: int
    single_loop: bool  # each invocation has a plan of its own (one loop; a wavefront step)

    def __init__(self, chunk_size: int, num_loops: int):
        self.chunk_size = chunk_size
        self.num_loops = num_loops

    def _order(self, req_index: int, piece: PrefillPiece) -> tuple:
        raise NotImplementedError

    def _entry_order(self, req_index: int, round_: int) -> tuple:
        """Priority of the `round_`-th new chunk of a request (each entry takes one chunk)."""
        raise NotImplementedError

    def expected_segments(self, max_num_seqs: int) -> int:
        """Segments an invocation holds in the usual case: per running request its decode row, or
        a chunk per depth and one piece the token budget cut (the runner's CUDA graphs are
        sized for this many; an invocation with more, such as one long prompt's many chunks,
        runs in a larger graph or eagerly)."""
        return max_num_seqs * (min(self.ring_slots, self.num_loops) + 1)

    def new_request(self, req: Request) -> NewRequestData:
        """What the runner needs of `req` as it is admitted (or resumed)."""
        params, outputs = req.sampling_params, req.output_token_ids
        return NewRequestData(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prefill_token_ids()),
            ring_slots=self.ring_slots,
            chunk_size=self.chunk_size,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            logit_bias=params.logit_bias,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            seed=req.seed,
            num_logprobs=-1 if params.logprobs is None else params.logprobs,
            num_prompt_logprobs=-1 if req.prompt_logprobs is None else params.prompt_logprobs,
            init_scale=1.0 if params.init_scale is None else params.init_scale,
            resume_token=outputs[-1] if outputs else None,
            resumed_loops=tuple(req.output_exit_depths[1 : req.resume_tokens + 1]),
        )

    def row_offset(self, token_start: int) -> int:
        """Row of `token_start` in its request's ring: slot * chunk_size + offset in the chunk."""
        c = self.chunk_size
        return (token_start // c) % self.ring_slots * c + token_start % c

    @property
    def task_rows(self) -> int:
        """Most rows one task holds: consecutive ready pieces of a request at one depth whose
        ring rows follow each other run as one task (`_merged`), up to the whole ring."""
        return self.ring_slots * self.chunk_size

    def resident_chunks(self, req: Request) -> int:
        """Chunks of `req` in its ring (entered and not yet finished)."""
        c = self.chunk_size
        first = req.prefill_reclaimable_tokens // c
        return -(-req.num_prefilled_tokens // c) - first if req.in_prefill else 0

    def plan(self, requests: list[Request], budget: int) -> list[ScheduledRequest]:
        """Ready tasks under `budget` rows for one invocation; records new pieces."""
        candidates = []
        for i, req in enumerate(requests):
            candidates += [
                (self._order(i, p), req, p)
                for p in req.pieces
                if p.depth < req.prompt_loops(self.num_loops)
            ]
            candidates += [(self._entry_order(i, k), req, _ENTRY) for k in range(self.ring_slots)]
        candidates.sort(key=lambda c: c[0])
        tasks: list[ScheduledRequest] = []
        scheduled: dict[str, set[int]] = {r.request_id: set() for r in requests}
        for _, req, piece in candidates:
            if budget <= 0:
                break
            own = scheduled[req.request_id]
            if piece is _ENTRY:
                new = self._enter(req, budget, own)
            elif piece.num_tokens <= budget and self._ready(req, piece, own):
                new = [piece]
            else:
                continue
            for p in new:
                tasks.append(self._task(req, p))
                own.add(p.token_start)
                budget -= p.num_tokens
        return _merged(tasks)

    def atomic_loops(self, req: Request, tasks: list[ScheduledRequest], loops: int) -> bool:
        """Whether `req`'s tasks can run `loops` invocations with no decision between them: every
        earlier piece left out of the batch must already be past the depths they will reach."""
        for task in tasks:
            last = min(req.prompt_loops(self.num_loops), task.depth + loops)
            for piece in req.pieces:
                if piece.token_start >= task.token_start:
                    break
                if not _covers(tasks, piece) and piece.depth < last:
                    return False
        return True

    def loops_to_exit(self, req: Request, task: ScheduledRequest) -> int:
        """Invocations `task` may run before one of its rows, a recomputed output position,
        leaves early (its skipped-depth copies must land before any later loop)."""
        loops = req.prompt_loops(self.num_loops) - task.depth
        for pos in range(max(task.token_start, req.num_prompt_tokens), _end(task)):
            row = req.position_loops(pos, self.num_loops)
            if row > task.depth:
                loops = min(loops, row - task.depth)
        return loops

    def advance(
        self, req: Request, tasks: list[ScheduledRequest], loops: int
    ) -> tuple[bool, list[tuple[int, int]]]:
        """Apply `loops` invocations to `req`'s tasks and free finished chunks (in order).
        Returns whether the whole prefill has run, and the (position, 0-based last depth) of
        recomputed output positions that left early: their rows leave the piece."""
        exits, depth = [], req.prompt_loops(self.num_loops)
        for task in tasks:
            for piece in [p for p in req.pieces if _covers([task], p)]:
                piece.depth = min(depth, piece.depth + loops)
                if piece.depth < depth and _end(task) > req.num_prompt_tokens:
                    exits += self._drop_exited(req, piece)
        while req.in_prefill:
            start = req.prefill_reclaimable_tokens
            end = min((start // self.chunk_size + 1) * self.chunk_size, req.prefill_len)
            chunk = [p for p in req.pieces if p.token_start < end]
            if req.num_prefilled_tokens < end or any(p.depth < depth for p in chunk):
                break
            req.pieces = req.pieces[len(chunk) :]
            req.prefill_reclaimable_tokens = end
        return not req.in_prefill, exits

    def _drop_exited(self, req: Request, piece: PrefillPiece) -> list[tuple[int, int]]:
        """Split `piece` around its rows whose loops are done; returns those rows' exits."""
        live, exits = [], []
        for pos in range(piece.token_start, piece.token_start + piece.num_tokens):
            if req.position_loops(pos, self.num_loops) <= piece.depth:
                exits.append((pos, piece.depth - 1))
            elif live and live[-1].token_start + live[-1].num_tokens == pos:
                live[-1].num_tokens += 1
            else:
                live.append(PrefillPiece(pos, 1, piece.depth))
        if exits:
            i = next(i for i, p in enumerate(req.pieces) if p is piece)
            req.pieces[i : i + 1] = live
        return exits

    def _enter(self, req: Request, budget: int, scheduled: set[int]) -> list[PrefillPiece]:
        """The next chunk's new positions at depth 0 (cut by budget), if rows, a ring slot and
        readiness allow."""
        if budget <= 0 or not self._can_enter(req) or not self._ready(req, None, scheduled):
            return []
        start = req.num_prefilled_tokens
        chunk_end = min((start // self.chunk_size + 1) * self.chunk_size, req.prefill_len)
        piece = PrefillPiece(start, min(budget, chunk_end - start), 0)
        req.pieces.append(piece)
        req.num_prefilled_tokens += piece.num_tokens
        scheduled.add(start)
        return [piece]

    def _can_enter(self, req: Request) -> bool:
        start = req.num_prefilled_tokens
        if start >= req.prefill_len:
            return False
        oldest = req.prefill_reclaimable_tokens // self.chunk_size
        return start // self.chunk_size - oldest < self.ring_slots

    @staticmethod
    def _ready(req: Request, piece: PrefillPiece | None, scheduled: set[int]) -> bool:
        """Every position before `piece` (None: before the prefill frontier) has written the
        plane `piece` runs in, or is scheduled to write it in this invocation."""
        depth = 0 if piece is None else piece.depth
        for p in req.pieces:
            if piece is not None and p.token_start >= piece.token_start:
                break
            if not (p.depth > depth or (p.depth == depth and p.token_start in scheduled)):
                return False
        return True

    def _task(self, req: Request, piece: PrefillPiece) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=req.request_id,
            kind=RowKind.PREFILL,
            token_start=piece.token_start,
            num_tokens=piece.num_tokens,
            depth=piece.depth,
            prefill_hidden_row_offset=self.row_offset(piece.token_start),
            loops=req.prompt_loops(self.num_loops),
        )


def entries(requests: list[Request]) -> list[tuple[Request, int, int]]:
    """Where the requests' prefill entries stand (pieces, frontier), for `withdraw`."""
    return [(r, len(r.pieces), r.num_prefilled_tokens) for r in requests]


def withdraw(marks: list[tuple[Request, int, int]]) -> None:
    """Take back the new chunks that `plan` entered since `entries` gave `marks` (a plan that
    will not run)."""
    for req, pieces, frontier in marks:
        del req.pieces[pieces:]
        req.num_prefilled_tokens = frontier


def _end(task: ScheduledRequest) -> int:
    return task.token_start + task.num_tokens


def _covers(tasks: list[ScheduledRequest], piece: PrefillPiece) -> bool:
    return any(t.token_start <= piece.token_start < _end(t) for t in tasks)


def _merged(tasks: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """`tasks` with each run of one request's tasks at one depth that follow each other in
    position and in its ring as one task (as in an atomic prefill, the rows of consecutive
    chunks see each other through the plane's KV written in the same invocation); fewer,
    taller segments stream the context fewer times. Groups keep their first task's place."""
    groups: dict[tuple[str, int], list[ScheduledRequest]] = {}
    for t in tasks:
        groups.setdefault((t.request_id, t.depth), []).append(t)
    out: list[ScheduledRequest] = []
    for group in groups.values():
        group.sort(key=lambda t: t.token_start)
        run = [group[0]]
        for t in group[1:]:
            last = run[-1]
            offset = last.prefill_hidden_row_offset + last.num_tokens
            if t.token_start == _end(last) and t.prefill_hidden_row_offset == offset:
                run[-1] = replace(last, num_tokens=last.num_tokens + t.num_tokens)
            else:
                run.append(t)
        out += run
    return out


class SplitPlanner(_ChunkedPlanner):
    ring_slots = 1
    single_loop = False

    def _order(self, req_index: int, piece: PrefillPiece) -> tuple:
        return (req_index, False, piece.token_start)

    def _entry_order(self, req_index: int, round_: int) -> tuple:
        return (req_index, True, round_)  # one ring slot: one round


class WavefrontPlanner(_ChunkedPlanner):
    single_loop = True

    def __init__(self, chunk_size: int, num_loops: int, budget_chunks: int = 0):
        """`budget_chunks`: chunks one invocation's row budget holds; the ring has that many
        slots, and at least D (a chunk per depth)."""
        super().__init__(chunk_size, num_loops)
        self.ring_slots = max(num_loops, budget_chunks)

    def _order(self, req_index: int, piece: PrefillPiece) -> tuple:
        return (0, -piece.depth, req_index, piece.token_start)

    def _entry_order(self, req_index: int, round_: int) -> tuple:
        return (1, round_, req_index, 0)


def make_planner(
    config: SchedulerConfig, layout: KVLayout | str, num_loops: int
) -> SplitPlanner | WavefrontPlanner:
    """The prefill planner of a scheduler with these settings (the engine sizes buffers from its
    ring before the KV cache, and so the scheduler, exists)."""
    # SHARED KV needs position waves: a position finishes every depth before the next one
    chunk = 1 if KVLayout(layout) is KVLayout.SHARED else config.chunk_size
    if config.wavefront_chunked_prefill:
        return WavefrontPlanner(chunk, num_loops, config.max_num_batched_tokens // chunk)
    return SplitPlanner(chunk, num_loops)
