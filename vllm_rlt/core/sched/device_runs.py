"""Device runs (docs/design/scheduler.md §5): a decode-only step whose rows cross token
boundaries on the device, with exit decisions, sampling and re-entry there and no host between
its invocations (`DecodeRun`). `RunPlanner.plan` decides whether the step's decode rows run so
and for how many invocations, and reserves the KV blocks every token they may produce writes;
`RunPlanner.apply` takes the tokens back.

A run is planned over a step's decode rows with no speculative window, when some decoding
token's exit depends on its gate or varies (fixed-depth decoding already runs all its loops per
step, R1) and the blocks fit without preempting anyone. Alone in its batch, its length is
`device_decode_loops` (one token's loops while a prompt waits for its prefill turn; while a
request waits for a seat that a row may free within the run, as many as no row can end within,
at least one token's loops), at most `max_prefill_stall_loops` (R4: arrivals
wait at most that many loops), and no longer than the rows' longest remaining work
(`max_tokens`). Beside prefill tasks (mixed scheduling), it runs the prefill batch's loops
(R2-R6), its rows riding those invocations.

With speculation and the exit gate (`speculative`; docs/design/speculative.md §3) a run alone
with at most `speculative_max_decode_rows` rows gives each row K + 1 lanes, and its greedy rows
draft: every invocation ends in a sample phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from vllm_rlt.config_sched import SchedulerConfig, SpeculativeConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import (
    DecodeRun,
    RowKind,
    RunRow,
    RunRowResult,
    ScheduledRequest,
)
from vllm_rlt.core.sched.exit_policy import ExitPolicy, TraceExit
from vllm_rlt.core.sched.kv_demand import kv_demand, reserve
from vllm_rlt.core.sched.lane_rule import LaneRule, run_lanes
from vllm_rlt.core.sched.spec_governor import SpecGovernor, speculation_on
from vllm_rlt.request import DecodeToken, Request


class RunPlanner:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        exit_policy: ExitPolicy,
        num_loops: int,
        supported: bool,
        speculative: SpeculativeConfig | None = None,
        governor: SpecGovernor | None = None,
    ):
        """`supported`: the model's decode rows can run so (its prelude and coda need no
        attention); `speculative`: runs alone speculate with these settings, while `governor`
        (if any) measures speculation faster."""
        self.max_loops = config.run_loops
        if config.max_prefill_stall_loops is not None:  # R4
            self.max_loops = min(self.max_loops, config.max_prefill_stall_loops)
        self.enabled = supported and self.max_loops > 1 and config.scheduling_mode != "no_refill"
        self.kv = kv
        self.exit_policy = exit_policy
        self.num_loops = num_loops
        self.speculative = speculative
        self.governor = governor
        self.lane_rule = LaneRule()  # whether runs with lanes pay; their counters

    def wanted(self, tasks: list[ScheduledRequest], requests: dict[str, Request]) -> bool:
        """Whether the decode `tasks` (planned by DecodePlanner) run as a device run when their
        blocks fit: no speculative window, and some token's exit depends on its gate or varies
        (fixed-depth decoding already runs all its loops per step, R1)."""
        if not self.enabled or not tasks or any(t.kind is not RowKind.DECODE for t in tasks):
            return False
        return any(self.exit_policy.fixed_loops(requests[t.request_id].exit) is None for t in tasks)

    def plan(
        self,
        tasks: list[ScheduledRequest],
        requests: dict[str, Request],
        running: list[Request],
        exits: list[tuple[str, int, int]],
        beside: int = 0,
        waiting: bool = False,
    ) -> DecodeRun | None:
        """A run over the decode `tasks` (planned by DecodePlanner), or None when the step runs
        as before: not `wanted`, or blocks that do not fit. `beside`: the loops of the prefill
        batch it rides (0: a batch of the run alone); `waiting`: a request waits for a seat.
        Allocates the run's blocks (`exits`: the skipped-depth copies the step applies
        first)."""
        if not self.wanted(tasks, requests):
            return None
        reqs = [requests[t.request_id] for t in tasks]
        longest = self._longest(reqs, running, waiting)
        loops = beside or min(longest, max(self._work(r) for r in reqs))
        if loops < 2:
            return None
        lanes = not beside and self._speculates(reqs)
        # (a lane may draft before the first invocation: one position further)
        if not self._reserve(reqs, loops + lanes, exits):
            return None  # the host path preempts
        rows = tuple(self._row(r, loops) for r in reqs)
        if lanes:
            return self._lanes(reqs, rows, loops)
        return DecodeRun(self.exit_policy.name, rows, self._sample_at(reqs, rows, loops))

    def carry(
        self,
        flight: DecodeRun,
        reqs: list[Request],
        running: list[Request],
        waiting: bool,
        beside: int = 0,
        joining: list[Request] = (),
        start: Callable[[], list[Request]] | None = None,
    ) -> DecodeRun | None:
        """The run that goes on from `flight` (the last run, not read back yet: the rows'
        states in `reqs` are those it started from) over the same rows, or None when the next
        plan needs its results: a row ended or left, another request runs, a waiting one
        (`waiting`) may take a seat the run frees, no row has work left after it, lanes
        stopped paying or are wanted again (`LaneRule`), or the blocks do not fit. `beside`:
        the loops of the prefill batch it rides (0: alone; `running` then leaves out the
        requests in that prefill, and rows that end within the flight idle in it, as do those
        whose request is gone, None in `reqs`: the device stopped them). `joining`: requests
        whose prompt the flight rode to its end, whose rows join the run fresh after its own
        once `start()` (called when everything else holds and the blocks are allocated) has
        started their tokens; it returns those it started. Allocates the blocks of both runs'
        positions."""
        rows_of = reqs
        reqs = [r for r in reqs if r is not None]
        if (
            not self.enabled
            or not reqs
            or len(reqs) != len(running)
            or set(map(id, reqs)) != set(map(id, running))
        ):
            return None
        if any(r.decode is None or r.status.finished for r in reqs):
            return None
        if flight.lanes > 1 and not (self.lane_rule.keeps() and speculation_on(self.governor)):
            return None  # lanes stopped paying: the next run is fresh, without them
        alone = not beside and not joining
        if flight.lanes == 1 and alone and self._speculates(reqs):
            return None  # lanes are wanted again: the next run is fresh, with them
        before, samples = len(flight.sample_at) - 1, self._takes(flight)
        if waiting and any(self._may_end(r, samples) for r in reqs):
            return None
        work = max(self._work(r) for r in reqs) - before
        if beside:
            loops = beside if work > 0 else 0
        else:
            loops = min(self._longest([*reqs, *joining], running, waiting, samples), work)
        if loops < 2:
            return None
        # with lanes, the flight may start with lanes up to lanes - 1 positions past the newest
        # token, and a lane starts at most one position per invocation after them
        ahead = flight.lanes if flight.lanes > 1 else 0
        if not self._reserve(reqs, before + loops + ahead, [], joining):
            return None
        rows = tuple(self._row(r, before + loops) for r in reqs)
        if flight.lanes > 1:  # (its state on the device is lanes')
            return replace(self._lanes(reqs, rows, loops), carried=True)
        reach = self._sample_at(reqs, rows, before + loops)
        sample_at = (False, *reach[before + 1 :])
        by_req = dict(zip(map(id, reqs), rows, strict=True))
        rows = tuple(by_req[id(r)] if r is not None else _STOPPED for r in rows_of)
        joined = start() if joining else []
        if joined:
            fresh = tuple(self._row(r, loops) for r in joined)
            reach = self._sample_at(joined, fresh, loops)
            sample_at = tuple(a or b for a, b in zip(sample_at, reach, strict=True))
            rows += fresh
        return DecodeRun(self.exit_policy.name, rows, sample_at, carried=True, joined=len(joined))

    def _speculates(self, reqs: list[Request]) -> bool:
        """Whether a run alone over the rows of `reqs` speculates: speculation is on, at most
        `speculative_max_decode_rows` rows decode, none with penalties, some row is greedy
        without logprobs, and lanes pay (`LaneRule`)."""
        spec = self.speculative
        if spec is None or len(reqs) > spec.speculative_max_decode_rows:
            return False
        if any(r.sampling_params.penalized for r in reqs):
            return False  # (a penalty counts the tokens before: no row of its run has lanes)
        if not speculation_on(self.governor):
            return False
        return any(self._drafts(r) for r in reqs) and self.lane_rule.wanted()

    @staticmethod
    def _drafts(req: Request) -> bool:
        """Whether the request's row drafts in a run with lanes: greedy, no logprobs (others
        decode plainly there)."""
        params = req.sampling_params
        return params.temperature == 0 and params.logprobs is None

    def _lanes(self, reqs: list[Request], rows: tuple[RunRow, ...], loops: int) -> DecodeRun:
        """A run with lanes over the rows of `reqs` (`_speculates` said so), `loops`
        invocations."""
        spec = self.speculative
        rows = tuple(
            replace(row, speculates=self._drafts(r)) for r, row in zip(reqs, rows, strict=True)
        )
        return DecodeRun(self.exit_policy.name, rows, (True,) * (loops + 1),
                         lanes=run_lanes(spec.num_speculative_tokens, self.num_loops),
                         draft_loops=spec.speculative_draft_loops)  # fmt: skip

    def spec_stats(self) -> dict[str, float]:
        """With lanes, the speculative counters and ratios (`LaneRule.as_dict`)."""
        return {} if self.speculative is None else self.lane_rule.as_dict()

    def record(self, run: DecodeRun, results: tuple[RunRowResult, ...]) -> None:
        """A run's results were read back (for the rule on lanes)."""
        if self.speculative is not None:
            self.lane_rule.record(run, results)

    def _longest(
        self, reqs: list[Request], running: list[Request], waiting: bool, before: int = 0
    ) -> int:
        """How many invocations a run alone over the rows of `reqs` may take:
        `device_decode_loops`, but one token's loops at full depth while a prompt waits for its
        prefill turn (R7), and while a request waits for a seat that a row may free within the
        run, as many as no row can end within, at least one token's loops at full depth: an
        arrival then waits no longer for its admission, nor a stream for its next tokens, than
        at fixed depth (or `device_decode_loops`, if fewer). (`before`: tokens a row may take in
        the run in flight before it.)"""
        shorter = min(self.num_loops, self.max_loops)
        if any(r.in_prefill for r in running):
            return shorter
        # a fresh run of n invocations takes at most n + 1 tokens a row (`_takes`; a carried
        # one's lanes live at its start are positions the run before counted)
        reach = before + self.max_loops + 1
        ends = [r for r in reqs if self._may_end(r, reach)] if waiting else []
        if not ends:
            return self.max_loops
        if any(_stops(r) for r in ends):  # (may end on any token)
            return shorter
        # a row with m tokens left ends in no run that takes fewer: before + n + 1 < m
        left = min(r.sampling_params.max_tokens - r.num_sampled for r in ends)
        return max(shorter, left - before - 2)

    @staticmethod
    def _takes(run: DecodeRun) -> int:
        """The most tokens a row may take in `run`: one per sample phase; with lanes, where one
        phase may take several, one position starts per phase at most, so those of the lanes
        live at its start besides."""
        return sum(run.sample_at) + (run.lanes if run.lanes > 1 else 0)

    @staticmethod
    def _may_end(req: Request, samples: int) -> bool:
        """Whether the request may end within `samples` more sampled tokens: it has a stop
        token, or no more than that many tokens left before max_tokens."""
        return bool(_stops(req)) or req.sampling_params.max_tokens - req.num_sampled <= samples

    def _reserve(self, reqs: list[Request], loops: int, exits, joining=()) -> bool:
        """Allocate every plane of each position a token of the next `loops` invocations may
        write (and `exits`' copies; `joining`: requests whose next token, not started yet,
        runs only the last `loops` of them); False (nothing allocated) when the blocks do not
        fit."""
        need = kv_demand(self.kv, [], 0, exits, self.num_loops)
        ends = [(r, r.decode.position + loops) for r in reqs]
        ends += [(r, (r.decode.position if r.decode else r.num_tokens) + loops) for r in joining]
        for r, end in ends:
            end = min(end, r.max_positions)
            for plane in range(self.kv.num_loop_planes):
                need[r.request_id, plane] = max(need.get((r.request_id, plane), 0), end)
        return reserve(self.kv, need)

    def _work(self, req: Request) -> int:
        """The most invocations the request's row can use: its token's remaining loops, then
        every token it may still sample at full depth."""
        left = req.sampling_params.max_tokens - req.num_sampled
        return req.exit.max_loops - req.decode.loops_done + (left - 1) * req.exit.max_loops

    def _row(self, req: Request, loops: int) -> RunRow:
        tok, settings = req.decode, req.exit
        trace = ()
        if isinstance(self.exit_policy, TraceExit):  # the exit loops of the tokens it may start
            starts = [DecodeToken(0, req.num_sampled + i) for i in range(loops)]
            for t in starts:
                self.exit_policy.start(t, settings, req.request_id)
            trace = tuple(t.exit_at for t in starts)
        return RunRow(
            loops_done=tok.loops_done,
            remaining=tok.remaining,
            exit_at=tok.exit_at or 0,
            position=tok.position,
            num_sampled=req.num_sampled,
            max_tokens=req.sampling_params.max_tokens,
            min_loops=settings.min_loops,
            max_loops=settings.max_loops,
            threshold=settings.threshold,
            stop_token_ids=_stops(req),
            trace=trace,
        )

    def _sample_at(
        self, reqs: list[Request], rows: tuple[RunRow, ...], loops: int
    ) -> tuple[bool, ...]:
        """Before which invocations (and after the last) some row's token may have exited: a
        traced token exits at its given depth; any other exits after between `shortest` and
        max_loops loops, so its row samples at invocation `loops to its exit` after it entered,
        at the earliest."""
        may = [False] * (loops + 1)
        for req, row in zip(reqs, rows, strict=True):
            for at in self._exits_at(req, row, loops):
                may[at] = True
            if all(may[1:]):  # (no token exits before the first invocation)
                break
        return tuple(may)

    def _exits_at(self, req: Request, row: RunRow, loops: int) -> set[int]:
        """The invocations (up to `loops`) after which the row's tokens may exit."""
        settings, done = req.exit, req.decode.loops_done
        if row.trace:  # the depths are known: its current token's, then the trace's
            at, reached = row.exit_at - done, set()
            for depth in (0, *row.trace):
                at += depth
                if at > loops:
                    break
                reached.add(at)
            return reached
        fixed = self.exit_policy.fixed_loops(settings) is not None
        shortest = settings.max_loops if fixed else settings.min_loops
        first = range(max(shortest, done + 1), settings.max_loops + 1)
        if shortest == 1 and first:  # every invocation from the first exit on
            return set(range(first[0] - done, loops + 1))
        frontier, reached = [n - done for n in first], set()
        while frontier:
            at = frontier.pop()
            if at <= loops and at not in reached:
                reached.add(at)
                frontier += [at + n for n in range(shortest, settings.max_loops + 1)]
        return reached

    def apply(self, req: Request, result: RunRowResult, append) -> None:
        """Take a run's tokens for `req` (`append(req, token)`: the scheduler's stop checks, which
        may finish it) and set its newest token's state as the device left it."""
        for token, depth in result.sampled:
            req.pending_exit_depths.append(depth)
            append(req, token)
            if req.status.finished:
                return
        if result.ready:
            req.decode, req.ready_loops = None, result.loops_done
            return
        req.decode = DecodeToken(
            position=req.num_tokens - 1,
            index=req.num_sampled - 1,
            loops_done=result.loops_done,
            remaining=result.remaining,
            exit_at=result.exit_at or None,
        )


# a carried row whose request is gone: the device stopped it (a carried run loads no state)
_STOPPED = RunRow(0, 1.0, 0, 0, 0, 0, 1, 1, 1.0, ())


def _stops(req: Request) -> tuple[int, ...]:
    """The tokens that end the request when sampled (its stop tokens, EOS unless ignored)."""
    params = req.sampling_params
    return tuple(
        dict.fromkeys(params.stop_token_ids + (() if params.ignore_eos else req.eos_token_ids))
    )
