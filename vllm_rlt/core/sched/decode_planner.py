"""Decode rows of a step (`DecodePlanner.plan`): which decoding requests sample their next token
now and which tokens run a loop, under the scheduling mode's holds; with speculation, the rows
of each open window (`SpecPlanner`)."""

from __future__ import annotations

from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.core.sched.execution_batch import RowKind, ScheduledRequest
from vllm_rlt.core.sched.exit_policy import ExitPolicy
from vllm_rlt.core.sched.spec_planner import SpecPlanner
from vllm_rlt.request import DecodeToken, Request


class DecodePlanner:
    def __init__(self, scheduling_mode: str, exit_policy: ExitPolicy, spec: SpecPlanner | None):
        """`spec`: the speculative planner (None: speculation off)."""
        self.scheduling_mode = scheduling_mode
        self.exit_policy = exit_policy
        self.spec = spec

    @staticmethod
    def decoding(running: list[Request]) -> list[Request]:
        """Running requests past their prefill with a token in flight or ready to sample."""
        return [
            r
            for r in running
            if not r.in_prefill
            and (r.decode is not None or r.ready_loops is not None or r.spec is not None)
        ]

    @staticmethod
    def awaits_tokens(req: Request) -> bool:
        """Whether `req` has no work before its sampled tokens are read back: past its prefill,
        with no token in flight or ready to sample, and no window that is not verified."""
        return (
            not req.in_prefill
            and req.decode is None
            and req.ready_loops is None
            and (req.spec is None or req.spec.verified)
        )

    def start(self, req: Request, token: DecodeToken, num_decoding: int) -> None:
        """The newest sampled `token` starts looping: in a speculative window when the adaptive
        rule takes drafts for it (`num_decoding` requests decode), else as a decode token."""
        if self.spec is not None and self.spec.open(req, token, num_decoding):
            return
        req.decode = token
        self.exit_policy.start(token, req.exit, req.request_id)

    def loops_to_decision(self, req: Request) -> int:
        """Loops the request's decode rows run before a decision about them falls due."""
        if req.spec is not None:
            return self.spec.loops_to_decision(req.spec)
        return self.exit_policy.loops_to_decision(req.decode, req.exit)

    def apart(self, running: list[Request], limit: int, runs: bool) -> bool:
        """R7 (docs/design/scheduler.md §2): whether decode rows and prefill tasks run in
        separate batches now, because a prompt in prefill is longer than `limit` or a decoding
        request is past it. A mixed invocation lasts as long as its longest-context tile
        (prefill tiles of a long prompt, or a decode row's tile, which mixed graphs do not
        split), so riding decode rows would pay for the long context at every loop and long
        decode rows would hold up the prefill rows. Only when every decoding token runs a fixed
        number of loops, so that a decode step can run all of them at once, or with device
        `runs`, which take the other tokens' decisions on the device."""
        decoding = self.decoding(running)
        prefilling = [r for r in running if r.in_prefill]
        if not decoding or not prefilling or not runs and not self.fixed_loops(decoding):
            return False
        return any(r.prefill_len > limit for r in prefilling) or any(
            r.num_tokens > limit for r in decoding
        )

    def fixed_loops(self, decoding: list[Request]) -> bool:
        """Whether every token of `decoding` runs a fixed number of loops (reads no gate)."""
        return all(self.exit_policy.fixed_loops(r.exit) is not None for r in decoding)

    @staticmethod
    def prefill_rows_beside(tasks, requests: dict, config: SchedulerConfig) -> int | None:
        """The most prefill rows an invocation with the decode rows `tasks` takes (None: no
        limit): `prefill_rows_with_decode`, and, while the engine holds fewer requests (running
        and waiting) than `max_num_seqs`, what the most ridden decode token among them has left
        of `prefill_rows_per_decode_token`. With every seat wanted, throughput comes first:
        a prefill held back keeps its seat from decoding."""
        cap, per_token = config.prefill_rows_with_decode, config.prefill_rows_per_decode_token
        if not tasks or per_token is None or len(requests) >= config.max_num_seqs:
            return cap if tasks else None
        tokens = [requests[t.request_id].decode for t in tasks]
        ridden = [tok.prefill_rows_ridden for tok in tokens if tok is not None]
        left = max(0, per_token - max(ridden, default=0))
        return left if cap is None else min(cap, left)

    @staticmethod
    def record_ride(tasks, requests: dict, loops: int, config: SchedulerConfig) -> None:
        """The decode tokens of the planned `tasks` ride its prefill rows for `loops` loops
        (counted only while a ride limit is in force)."""
        if config.prefill_rows_per_decode_token is None:
            return
        prefill = sum(
            t.num_tokens * (loops if t.invocation < 0 else 1)  # (a wavefront step's: one loop)
            for t in tasks
            if t.kind is RowKind.PREFILL
        )
        for t in tasks:
            tok = requests[t.request_id].decode if t.kind is RowKind.DECODE else None
            if tok is not None:
                tok.prefill_rows_ridden += prefill

    def plan(self, running: list[Request], budget: int) -> tuple[list[ScheduledRequest], list[str]]:
        """One row per decoding request (the newest token at its next depth), and the requests
        whose next token is sampled now; no_refill holds samples until the cohort has exited.
        A request whose last token is sampled but not yet read back has no work left. The
        window hold: a fresh speculative window waits while another window is in flight (has
        run loops), so that windows open together and a step runs all of theirs to their
        decisions at once (R1), instead of one step per phase."""
        decoding = self.decoding(running)
        ready = [r for r in decoding if r.ready_loops is not None]
        # open windows are no part of a cohort: they sample on their own
        cohort_done = len(ready) == sum(r.spec is None for r in decoding)
        hold_all = self.scheduling_mode == "no_refill" and not cohort_done
        hold_next = bool(ready) and not cohort_done and self.phase_hold(decoding, ready)
        tasks, samples, rows = [], [], 0
        in_flight = any(r.spec is not None and r.spec.started for r in decoding)
        for req in decoding:
            if req.ready_loops is not None:
                last = req.is_last_sample
                if hold_all or not last and (hold_next or rows >= budget):
                    continue
                samples.append(req.request_id)
                token = DecodeToken(position=req.num_tokens, index=req.num_sampled)
                req.pending_exit_depths.append(req.ready_loops)
                req.ready_loops = None
                if last:
                    continue
                self.start(req, token, len(decoding))
            if in_flight and req.spec is not None and not req.spec.started:
                continue  # the window hold: fresh windows open together, after the others
            task = self._task(req)
            if task is None or rows + task.most_rows > budget:
                continue
            tasks.append(task)
            rows += task.most_rows
        return tasks, samples

    def _task(self, req: Request) -> ScheduledRequest | None:
        """The request's decode rows in the next step (none while a window's acceptance is
        being read back)."""
        if req.spec is not None:
            return self.spec.task(req)
        tok = req.decode
        reads_gate = self.exit_policy.reads_gate(tok, req.exit)
        return ScheduledRequest(
            req.request_id, RowKind.DECODE, tok.position, 1, tok.loops_done, reads_gate=reads_gate
        )

    def phase_hold(self, decoding: list[Request], ready: list[Request]) -> bool:
        """Phase hold: whether the `ready` requests (their tokens exited) wait for the others'
        tokens to exit, so that all next tokens start together. Then decode-only steps run all
        their loops in one step (R1) with one sampling pass, instead of one step per phase.
        Only when every decoding token runs the same fixed number of loops (a wait of at most
        that many loops brings them in phase for good), and not when a first token is sampled
        now: that one starts at once (the hold must not delay a time to first token), and the
        ready requests start with it. Not while a speculative window is open (it never waits
        at a sample)."""
        cycles = {self.exit_policy.fixed_loops(r.exit) for r in decoding}
        if len(cycles) != 1 or None in cycles or any(r.spec is not None for r in decoding):
            return False
        return not any(r.num_sampled == 0 and not r.is_last_sample for r in ready)
