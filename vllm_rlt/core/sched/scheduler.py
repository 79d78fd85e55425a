"""The scheduler: the per-step plan (`schedule`); through its parts `Admission` (admission.py)
admission and KV placement, through `StepUpdate` (step_update.py) the runner's answer (`update`).

Invariant of `schedule()`: every row of the plan's first invocation counts against
`max_num_batched_tokens`; decode rows come before prefill tasks, and a batch with decode rows
takes at most `prefill_rows_with_decode` prefill rows (a latency rule: decode rows wait for every
row of their invocation; WCPB's default: half the budget), nor, while a seat is free, more than
its decode tokens have left of `prefill_rows_per_decode_token` (WCPB's default: the same half;
`DecodePlanner.prefill_rows_beside`).

KV (`_place`, admission.py): the plan is made first, then the blocks it writes are allocated,
plane by plane (each task's positions in the planes of the depths it runs, each exited token's
skipped planes). Only when they do not fit are requests preempted, by queue policy (the latest
arrival, or the lowest priority then the latest): the victim's blocks are freed, its work leaves
the plan and it waits first in line. A resumed request recomputes its prompt and its fed-back
output positions as an ordinary staged prefill in which each output position runs the loops it
ran before (`Request.position_loops`), so its KV, and everything it generates next, is what it
would have been. A request admitted in this step that does not fit goes back unannounced.

How many loops a batch runs (`ExecutionBatch.loop_count`) is decided by rules R1-R7
(`LoopRules`, loop_rules.py); R7 (decode apart from long prefill) also shapes the plan here
(`_take_turn`).
"""

from __future__ import annotations

import itertools

from vllm_rlt.config_sched import SchedulerConfig, SpeculativeConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.admission import Admission
from vllm_rlt.core.sched.decode_planner import DecodePlanner
from vllm_rlt.core.sched.device_runs import RunPlanner
from vllm_rlt.core.sched.execution_batch import (
    DecodeRun,
    ExecutionBatch,
    NewRequestData,
    RowKind,
    ScheduledRequest,
    StepOutput,
    by_request,
)
from vllm_rlt.core.sched.exit_policy import ExitPolicy
from vllm_rlt.core.sched.kv_demand import kv_demand, reserve
from vllm_rlt.core.sched.loop_rules import LoopRules
from vllm_rlt.core.sched.prefill_planner import (
    SplitPlanner,
    WavefrontPlanner,
    entries,
    make_planner,
    withdraw,
)
from vllm_rlt.core.sched.request_queue import RequestQueue
from vllm_rlt.core.sched.spec_governor import SpecGovernor
from vllm_rlt.core.sched.spec_planner import SpecPlanner
from vllm_rlt.core.sched.step_update import StepUpdate
from vllm_rlt.core.sched.wavefront_step import wavefront_step
from vllm_rlt.request import Request, RequestStatus


class Scheduler(Admission, StepUpdate):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        exit_policy: ExitPolicy,
        num_loops: int,
        atomic_prefill: bool = False,
        speculative: SpeculativeConfig | None = None,
        device_runs: bool = False,
        planner: SplitPlanner | WavefrontPlanner | None = None,
        spec_runs: bool = False,
    ):
        """`atomic_prefill`: the model needs every prefill batch to run all its loops (Huginn):
        mixed scheduling then always keeps decode rows and prefill apart (R7). `speculative`:
        self-speculative decoding settings (None or 0 drafts: off). `device_runs`: the model's
        decode rows can cross token boundaries on the device (device_runs.py). `planner`: the
        prefill planner `make_planner` gives for these settings, when the caller has built it
        already (the engine sizes the runner's buffers from its ring). `spec_runs`: speculation
        drafts in device runs, not windows (the exit gate is on, docs/design/speculative.md
        §3)."""
        self.config = config
        self.atomic_prefill = atomic_prefill
        self.kv = kv_manager
        self.exit_policy = exit_policy
        self.num_loops = num_loops
        self.planner = planner or make_planner(config, kv_manager.layout, num_loops)
        self.spec = None  # speculative windows
        speculates = speculative is not None and speculative.num_speculative_tokens > 0
        # speculation only while it measures faster (None: whenever the adaptive rules say)
        self.governor = SpecGovernor() if speculates and speculative.speculative_fallback else None
        if speculates and not spec_runs:
            self.spec = SpecPlanner(
                speculative, num_loops, config.max_num_batched_tokens, self.governor
            )
        self.decode = DecodePlanner(config.scheduling_mode, exit_policy, self.spec)
        self.loop_rules = LoopRules(config, self.planner, self.decode, num_loops)
        lanes = speculative if spec_runs else None
        self.runs = RunPlanner(
            config, kv_manager, exit_policy, num_loops, device_runs, lanes, self.governor
        )
        self.waiting = RequestQueue(config.queue_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._new: list[NewRequestData] = []  # what the runner hears in the next batch
        self._exits: list[tuple[str, int, int]] = []  # (request, position, last depth) to copy
        self._finished: list[str] = []  # requests the runner forgets (ended or preempted)
        self._order: dict[str, int] = {}  # request -> arrival rank (ties of arrival_time)
        self._ranks = itertools.count()
        self._apart_now = False  # R7 holds in this step
        # a wavefront step of several invocations was planned in this step: the exits of its
        # last (its prefill progress is applied as it is planned); None: none was
        self._stepped: list[tuple[str, int, int]] | None = None
        self._prefill_turn = False  # under R7: the next batch is prefill's
        self._flight: ExecutionBatch | None = None  # the last device run, its results not applied
        # the requests that the run read back last ended on its tokens (its device rows stopped)
        self._run_ended: set[str] = set()
        # the runner's answers whose tokens are not read yet: with async scheduling the last
        # step's (`_unread`), and the last device run's (`_unread_run`, read before the next
        # plan or once the run that goes on from it is queued)
        self._unread: tuple[ExecutionBatch, StepOutput] | None = None
        self._unread_run: tuple[ExecutionBatch, StepOutput] | None = None
        self._got: dict[str, tuple[Request, int]] = {}  # requests given tokens since `update`
        self.num_preemptions = 0
        self.prefix_queries = 0  # positions looked up in the prefix cache at admission
        self.prefix_hits = 0  # positions found there

    @property
    def expected_segments(self) -> int:
        return self.planner.expected_segments(self.config.max_num_seqs)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._ranks)
        self.waiting.push(req)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """Finish a request in any state (abort, or a stop string found by the engine)."""
        req = self.requests.get(req_id)
        if req is None or req.status.finished:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self._release(req_id)
            self._finished.append(req_id)
        req.status = status
        del self.requests[req_id]
        del self._order[req_id]
        return req

    def _release(self, req_id: str) -> None:
        self.kv.free(req_id)
        self._exits = [e for e in self._exits if e[0] != req_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- schedule ---------------------------------------------------------------------------
    def schedule(self) -> ExecutionBatch:
        """The next step's plan. While a device run is in flight (planned, its results not
        applied), the continuation of that run; when the plan cannot be one, the run's results
        are read back first (this waits for the device), as are the last step's tokens when
        nothing can be planned without them (`_read_if_idle`)."""
        if self.governor is not None:
            self.governor.begin()
        self._stepped = None
        admitted: dict[str, tuple[int, int]] = {}
        if self._flight is not None:
            carried = self._carry() or self._ride_flight(admitted)
            if carried is not None:
                return carried
            self._read_run()
        self._read_if_idle()
        admitted |= self._admit()
        budget = self.config.max_num_batched_tokens
        samples: list[str] = []
        run = None  # a device run over the decode tasks (device_runs.py)
        mixed = self.config.scheduling_mode == "mixed"
        limit = 0 if self.atomic_prefill else self.config.max_context_with_decode
        self._apart_now = mixed and self.decode.apart(self.running, limit, self.runs.enabled)
        if self._apart_now:
            tasks, loops, run = self._take_turn(budget, samples, admitted)
        elif mixed:
            self._prefill_turn = False
            decode_tasks, samples = self.decode.plan(self.running, budget)
            prefill_budget = budget - sum(t.most_rows for t in decode_tasks)
            cap = self.decode.prefill_rows_beside(decode_tasks, self.requests, self.config)
            prefill_budget = prefill_budget if cap is None else min(prefill_budget, cap)
            prefill_tasks = self._plan_prefill(prefill_budget)
            tasks, loops, run = self._mixed(
                decode_tasks, prefill_tasks, samples, admitted, prefill_budget
            )
            self.decode.record_ride(tasks, self.requests, loops, self.config)
        else:  # refill / no_refill: a batch holds prefill work or decode work, not both
            tasks, loops = self._place([], self._plan_prefill(budget), samples, admitted)
            if not tasks:  # no prefill work, or preemption took all of it
                tasks, loops, samples, run = self._decode_only(budget, admitted)
        batch = self._batch(tasks, loops, samples, run)
        self._flight = batch if run is not None else None
        self._progress(batch)
        return batch

    def _decode_only(self, budget: int, admitted: dict):
        """A batch of decode work alone: (tasks, loops, samples, run). When placing it preempts
        every row it kept (the requests whose tokens had exited held for those rows, phase
        hold), it is planned once more without them: else a request whose recompute leaves no
        block for its next token would be admitted, prefilled and preempted again and again
        while the held requests wait for it."""
        preempted = self.num_preemptions
        for _ in range(2):
            decode_tasks, samples = self.decode.plan(self.running, budget)
            run = self._run(decode_tasks)
            tasks, loops = self._place(decode_tasks, [], samples, admitted, run)
            if tasks or samples or self.num_preemptions == preempted:
                break
        return tasks, loops, samples, run

    def _carry(self) -> ExecutionBatch | None:
        """The run that goes on from the one in flight (device_runs.py `carry`), or None."""
        flight = self._flight
        reqs = [self.requests.get(t.request_id) for t in flight.requests]
        if None in reqs or self._seat_wanted():
            return None
        if len(reqs) > len(flight.decode_run.rows):  # it ran beside prefill
            return None
        run = self.runs.carry(flight.decode_run, reqs, self.running, bool(self.waiting))
        if run is None:
            return None
        self._flight = self._batch(list(flight.requests), len(run.sample_at) - 1, [], run)
        return self._flight

    def _ride_flight(self, admitted: dict) -> ExecutionBatch | None:
        """The run in flight goes on without its results read back (split prefill only):
        beside the prompts of the requests admitted now to free seats, beside the next chunks
        of those it rode, and with the rows of those it rode to their end joining it fresh
        (their first tokens sampled on the device as the step starts). The host plans and
        queues the batch while the run's invocations keep the GPU busy, where reading back
        first would leave it idle. A row of the run whose request ended on a token of the run
        before (its seat often the one now taken) idles in it: the device stopped it, so it
        writes no KV and no state. None (the caller reads back) when a row's request ended
        otherwise, there is neither prefill nor a joining row, R7 keeps decode and prefill
        apart, the prefill batch runs fewer than two loops, or its blocks or the run's do not
        fit; the prefill planned for it is then withdrawn (its blocks stay with the requests,
        whose prefill needs them)."""
        flight = self._flight
        run_tasks = list(flight.requests[: len(flight.decode_run.rows)])
        reqs = [self.requests.get(t.request_id) for t in run_tasks]
        gone = {t.request_id for t, r in zip(run_tasks, reqs, strict=True) if r is None}
        ids = {t.request_id for t in run_tasks}
        decoding = [r for r in self.running if not r.in_prefill and r.request_id in ids]
        joining = [r for r in self.running if not r.in_prefill and r.request_id not in ids]
        if (
            self.config.scheduling_mode != "mixed"
            or self.planner.single_loop
            or not gone <= self._run_ended
            or len(reqs) - len(gone) != len(decoding)
            or flight.decode_run.lanes > 1
            or any(r.spec is not None for r in joining)
        ):
            return None
        admitted |= self._admit()
        prefilling = [r for r in self.running if r.in_prefill]
        if not prefilling and not joining:
            return None
        limit = 0 if self.atomic_prefill else self.config.max_context_with_decode
        if self.decode.apart(self.running, limit, self.runs.enabled):
            return None
        live = [t for t in run_tasks if t.request_id not in gone]
        rows_left = self.config.max_num_batched_tokens - len(run_tasks)  # (one row a task)
        budget = rows_left - len(joining)
        cap = self.decode.prefill_rows_beside(live, self.requests, self.config)
        marks = entries(prefilling)
        self._apart_now = False
        prefill_tasks = self._plan_prefill(budget if cap is None else min(budget, cap))
        loops = self._loop_count([], prefill_tasks) if prefill_tasks else 0
        need = kv_demand(self.kv, prefill_tasks, loops, self._exits, self.num_loops)
        fresh, samples = [], []  # the joining rows' tasks, the samples of their first tokens

        def start() -> list[Request]:  # once the run's blocks are allocated
            tasks, sampled = self.decode.plan(joining, rows_left)
            fresh.extend(tasks)
            samples.extend(sampled)
            return [self.requests[t.request_id] for t in tasks]

        run = None
        if (loops >= 2 or not prefill_tasks) and reserve(self.kv, need):
            waiting = bool(self.waiting) and not prefill_tasks
            run = self.runs.carry(flight.decode_run, reqs, decoding, waiting, loops, joining,
                                  start)  # fmt: skip
        if run is None:
            withdraw(marks)  # the chunks it entered
            return None
        loops = len(run.sample_at) - 1
        tasks = run_tasks + fresh
        self.decode.record_ride(live + fresh + prefill_tasks, self.requests, loops, self.config)
        self._flight = self._batch(tasks + prefill_tasks, loops, samples, run)
        self._progress(self._flight)
        return self._flight

    def _batch(self, tasks, loops: int, samples: list[str], run) -> ExecutionBatch:
        """The plan of `tasks` (with the step's pending table changes, copies and endings)."""
        new = tuple(self._new)
        changed = [r for r in self.kv.take_changed() if r in self.requests]
        drafts, verifies = self.spec.samples(tasks, loops, self.requests) if self.spec else ((), ())
        batch = ExecutionBatch(
            requests=tuple(tasks),
            loop_count=loops,
            new_requests=new,
            block_tables=tuple(
                (r, tuple(self.kv.block_table(r, p) for p in range(self.kv.num_planes)))
                for r in changed
            ),
            kv_copies=tuple(
                pair for rid, pos, depth in self._exits
                for pair in self.kv.exit_copy_slots(rid, pos, depth)
            ),
            sample_req_ids=tuple(samples),
            sample_indices=tuple(self.requests[r].num_sampled - 1 for r in samples),
            drafts=drafts,
            verifies=verifies,
            finished_req_ids=tuple(self._finished),
            decode_run=run,
        )  # fmt: skip
        self._new, self._exits, self._finished = [], [], []
        return batch

    def _run(self, decode_tasks, beside: int = 0) -> DecodeRun | None:
        """A device run of the decode tasks, its blocks allocated (None: the step runs them on
        the host's decisions); `beside`: the loops of the prefill batch it rides."""
        return self.runs.plan(
            decode_tasks, self.requests, self.running, self._exits, beside, bool(self.waiting)
        )

    def _mixed(self, decode_tasks, prefill_tasks, samples: list[str], admitted: dict, budget):
        """A mixed batch: decode rows ride the prefill tasks' invocations. Rows that would run
        as a device run (gate readers) do so for the prefill batch's loops (R2-R6; under WCPB a
        wavefront step of several invocations, each planned under `budget` prefill rows) when
        it runs at least two; otherwise every row runs one loop on the host's decisions (R1).
        Returns the tasks, their loop count and the run (or None)."""
        if not prefill_tasks:
            run = self._run(decode_tasks)
            return *self._place(decode_tasks, [], samples, admitted, run), run
        wanted = self.runs.wanted(decode_tasks, self.requests)
        wave = wanted and self.planner.single_loop
        if not wanted or not wave and self._loop_count([], prefill_tasks) < 2:
            return *self._place(decode_tasks, prefill_tasks, samples, admitted), None
        tasks, loops = self._place([], prefill_tasks, samples, admitted)
        running = RequestStatus.RUNNING  # (not preempted by the prefill's placement)
        decode_tasks = [t for t in decode_tasks if self.requests[t.request_id].status is running]
        if not tasks:  # the placement preempted every prefill task's request
            return self._mixed(decode_tasks, [], samples, admitted, budget)
        if wave:
            tasks, loops = self._wavefront(tasks, budget)
        run = self._run(decode_tasks, loops)
        if run is not None:
            return decode_tasks + tasks, loops, run
        one_loop = loops == 1  # the rows run it on the host's decisions, where they fit
        if one_loop and reserve(self.kv, kv_demand(self.kv, decode_tasks, 1, [], self.num_loops)):
            return decode_tasks + tasks, loops, None
        return tasks, loops, None  # the run's blocks do not fit: the rows wait

    def _take_turn(self, budget: int, samples: list[str], admitted: dict):
        """R7's batch: prefill's turn takes the whole budget, decode's runs every decoding token
        to its exit (or a device run); a turn with no work passes to the other. Returns the
        tasks, their loop count and the device run (or None)."""
        if self._prefill_turn:
            self._prefill_turn = False
            prefill_tasks = self._plan_prefill(budget)
            if prefill_tasks:
                return *self._place([], prefill_tasks, samples, admitted), None
        tasks, loops, sampled, run = self._decode_only(budget, admitted)
        samples += sampled
        if tasks:
            self._prefill_turn = True
            return tasks, loops, run
        return *self._place([], self._plan_prefill(budget), samples, admitted), None

    def _wavefront(self, tasks, budget: int):
        """A WCPB batch's prefill `tasks` (placed) as the first invocation of a wavefront step
        of up to D invocations (fewer under R4's stall bound; `wavefront_step.py`). Returns the
        tasks and the loop count."""
        stall = self.config.max_prefill_stall_loops
        limit = self.num_loops if stall is None else min(self.num_loops, stall)
        args = (self.planner, self.kv, self.requests, self.running, tasks, budget, limit)
        tasks, loops, self._stepped = wavefront_step(*args)
        return tasks, loops

    def _progress(self, batch: ExecutionBatch) -> None:
        """The prefill progress of the planned `batch`, applied as it is planned (it needs no
        output): pieces advance and finished chunks leave the ring (a wavefront step's already
        did, as it was planned), the prompt's finished blocks become prefix-cache entries (the
        device writes them before any later step reads them), and a finished prefill starts
        decoding. The skipped-depth copies of recomputed positions that left early go with the
        next batch."""
        if self._stepped is not None:
            self._exits += self._stepped
        for req_id, tasks in by_request(batch.requests, RowKind.PREFILL).items():
            req = self.requests[req_id]
            if self._stepped is None:
                _, exits = self.planner.advance(req, tasks, batch.loop_count)
                self._exits += [(req_id, pos, depth) for pos, depth in exits]
            prompt_done = min(req.prefill_reclaimable_tokens, req.num_prompt_tokens)
            self.kv.cache_prompt(req_id, req.prompt_token_ids, prompt_done)
            if not req.in_prefill:
                self._start_decoding(req)

    def _loop_count(self, decode_tasks, prefill_tasks) -> int:
        return self.loop_rules.count(
            decode_tasks, prefill_tasks, self.requests, self.running, self._apart_now
        )

    def _plan_prefill(self, budget: int) -> list[ScheduledRequest]:
        if budget <= 0:
            return []
        return self.planner.plan([r for r in self.running if r.in_prefill], budget)

    def spec_stats(self) -> dict[str, float]:
        """Speculation's counters and ratios (`SpecPlanner.as_dict`; with the exit gate, the
        runs with lanes'), empty without speculation."""
        return self.spec.as_dict() if self.spec is not None else self.runs.spec_stats()
