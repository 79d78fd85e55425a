"""Decode rows of a step (`DecodePlanner.plan`): which decoding requests sample their next token
now and which tokens run a loop, under the scheduling mode's holds."""

from __future__ import annotations

from vllm_rlt.core.sched.execution_batch import RowKind, ScheduledRequest
from vllm_rlt.core.sched.exit_policy import ExitPolicy
from vllm_rlt.request import DecodeToken, Request


class DecodePlanner:
    def __init__(self, scheduling_mode: str, exit_policy: ExitPolicy):
        self.scheduling_mode = scheduling_mode
        self.exit_policy = exit_policy

    @staticmethod
    def decoding(running: list[Request]) -> list[Request]:
        """Running requests past their prefill with a token in flight or ready to sample."""
        return [
            r
            for r in running
            if not r.in_prefill and (r.decode is not None or r.ready_loops is not None)
        ]

    def fixed_loops(self, decoding: list[Request]) -> bool:
        """Whether every token of `decoding` runs a fixed number of loops (reads no gate)."""
        return all(self.exit_policy.fixed_loops(r.exit) is not None for r in decoding)

    def plan(self, running: list[Request], budget: int) -> tuple[list[ScheduledRequest], list[str]]:
        """One row per decoding request (the newest token at its next depth), and the requests
        whose next token is sampled now; no_refill holds samples until the cohort has exited.
        A request whose last token is sampled but not yet read back has no work left."""
        decoding = self.decoding(running)
        ready = [r for r in decoding if r.ready_loops is not None]
        cohort_done = len(ready) == len(decoding)
        hold_all = self.scheduling_mode == "no_refill" and not cohort_done
        hold_next = bool(ready) and not cohort_done and self.phase_hold(decoding, ready)
        tasks, samples = [], []
        for req in decoding:
            if req.ready_loops is not None:
                last = req.is_last_sample
                if hold_all or not last and (hold_next or len(tasks) >= budget):
                    continue
                samples.append(req.request_id)
                token = DecodeToken(position=req.num_tokens, index=req.num_sampled)
                req.pending_exit_depths.append(req.ready_loops)
                req.ready_loops = None
                if last:
                    continue
                req.decode = token
                self.exit_policy.start(req.decode, req.exit, req.request_id)
            elif len(tasks) >= budget:
                continue
            tok = req.decode
            reads_gate = self.exit_policy.reads_gate(tok, req.exit)
            tasks.append(
                ScheduledRequest(
                    req.request_id, RowKind.DECODE, tok.position, 1, tok.loops_done,
                    reads_gate=reads_gate,
                )
            )  # fmt: skip
        return tasks, samples

    def phase_hold(self, decoding: list[Request], ready: list[Request]) -> bool:
        """Phase hold: whether the `ready` requests (their tokens exited) wait for the others'
        tokens to exit, so that all next tokens start together. Then decode-only steps run all
        their loops in one step (R1) with one sampling pass, instead of one step per phase.
        Only when every decoding token runs the same fixed number of loops (a wait of at most
        that many loops brings them in phase for good), and not when a first token is sampled
        now: that one starts at once (the hold must not delay a time to first token), and the
        ready requests start with it."""
        cycles = {self.exit_policy.fixed_loops(r.exit) for r in decoding}
        if len(cycles) != 1 or None in cycles:
            return False
        return not any(r.num_sampled == 0 and not r.is_last_sample for r in ready)
