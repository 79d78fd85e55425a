"""Self-speculative decoding on the scheduler's side (docs/design/speculative.md): when a window
opens and how many tokens it drafts (the adaptive rule), its rows in each step, how its loops
advance, and the counters of drafted and accepted tokens.

A window starts at the newest sampled token (position `start`). Each of its `K + 1` positions
runs the draft loops (depths 0..d-1) in turn, as one drafting row that moves to the next
position after each position's d loops (`ScheduledRequest.draft_loops`); before the next
position enters at depth 0 the runner samples its draft token from the state the previous one
reached (`DraftSample`, with the invocation it precedes). Then the `K + 1` positions run depths
d..D-1 together (verify); after the step whose invocations finish them, the runner accepts a
prefix of the drafts plus one token (`VerifySample`) and the scheduler appends the accepted
tokens once they are read back. That acceptance is the window's only decision: a decode-only
step runs the whole window at once (R1; the drafting row turns into the verify rows within the
step, `ScheduledRequest.at`), a step of one loop (beside prefill) one loop of it.
"""

from __future__ import annotations

from vllm_rlt.config_sched import SpeculativeConfig
from vllm_rlt.core.sched.execution_batch import (
    DraftSample,
    RowKind,
    ScheduledRequest,
    VerifySample,
)
from vllm_rlt.core.sched.spec_governor import SpecGovernor, speculation_on
from vllm_rlt.request import DecodeToken, Request, SpecWindow

PRIOR_ACCEPTANCE = 0.7  # the adaptive rule's acceptance rate before any draft was verified
PRIOR_WEIGHT = 8  # drafts the prior counts as
MEMORY = 64  # drafts the rule's acceptance estimate remembers (older ones fade geometrically)
JUDGE_AFTER = 16  # the rule without a cost table turns speculation off only after this many drafts
PROBE_EVERY = 256  # ... and then still opens a window about every this many decode steps


class SpecPlanner:
    def __init__(
        self,
        config: SpeculativeConfig,
        num_loops: int,
        max_rows: int,
        governor: SpecGovernor | None = None,
    ):
        """`max_rows`: rows of one invocation (a window's verify rows must fit); `governor`:
        windows open only while it measures speculation faster."""
        self.config = config
        self.governor = governor
        self.num_loops = num_loops
        self.draft_loops = config.speculative_draft_loops
        self.max_drafts = min(config.num_speculative_tokens, max_rows - 1)
        costs = config.invocation_costs() if config.speculative_invocation_costs else None
        self.costs = costs
        self.num_windows = 0  # windows verified and read back
        self.num_drafted = 0  # draft tokens those windows verified
        self.num_accepted = 0  # draft tokens accepted (each window also emits one target token)
        self.recent_drafted = 0.0  # the same two counts, faded over the last ~MEMORY drafts
        self.recent_accepted = 0.0
        self.num_declined = 0  # windows the rule without a cost table turned off since a probe

    # ---- the adaptive rule ------------------------------------------------------------------
    def num_drafts(self, num_decoding: int, remaining: int) -> int:
        """Drafts of a window that opens while `num_decoding` requests decode, for a request
        that may sample `remaining` more tokens (the window emits up to drafts + 1)."""
        most = min(self.max_drafts, remaining - 1)
        if most <= 0 or num_decoding > self.config.speculative_max_decode_rows:
            return 0
        if not speculation_on(self.governor):
            return 0
        if self.costs is None:
            return most if self.flat_rule_drafts(most, num_decoding) else 0
        rate = [self.tokens_per_cost(k, num_decoding) for k in range(most + 1)]
        return max(range(most + 1), key=lambda k: (rate[k], -k))

    def flat_rule_drafts(self, k: int, num_decoding: int) -> bool:
        """The rule without a cost table (invocations weight-bound, all costing the same):
        whether a window drafts `k`. It does while the acceptance so far makes `k` drafts pay
        against plain decoding, or before `JUDGE_AFTER` drafts were verified; when it does not,
        a window drafts anyway about every `PROBE_EVERY` decode steps (one window declined per
        decoding request and step), so that the acceptance keeps being measured."""
        if self.num_drafted < JUDGE_AFTER:
            return True
        if self.tokens_per_cost(k, num_decoding) > 1 / self.num_loops:
            return True
        self.num_declined += 1
        if self.num_declined < PROBE_EVERY * num_decoding:
            return False
        self.num_declined = 0
        return True

    def acceptance(self) -> float:
        """Acceptance rate per draft over the last ~`MEMORY` drafts, starting from the prior."""
        prior = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
        return (self.recent_accepted + prior) / (self.recent_drafted + PRIOR_WEIGHT)

    def tokens_per_cost(self, k: int, rows: int) -> float:
        """The cost model: expected tokens per window over the window's invocation costs when
        `rows` requests each run a window of `k` drafts (k = 0: plain decoding, D invocations
        of `rows` rows per token)."""
        a, d, depth = self.acceptance(), self.draft_loops, self.num_loops
        tokens = k + 1 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
        cost = (k + 1) * d * self.cost(rows) + (depth - d) * self.cost(rows * (k + 1))
        return tokens / cost

    def cost(self, rows: int) -> float:
        """One invocation's cost at `rows` rows (1 without a table), interpolated linearly in the
        table: flat below
        its first point, along its last segment above its last (proportional to rows for a
        table of one point)."""
        points = self.costs
        if points is None:  # no table: weight-bound, every invocation costs the same
            return 1.0
        if rows <= points[0][0]:
            return points[0][1]
        if len(points) == 1:
            return points[0][1] * rows / points[0][0]
        segment = next((i for i in range(1, len(points)) if rows <= points[i][0]), len(points) - 1)
        (r0, c0), (r1, c1) = points[segment - 1], points[segment]
        return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)

    # ---- windows ----------------------------------------------------------------------------
    def open(self, req: Request, token: DecodeToken, num_decoding: int) -> bool:
        """Open a window at the newest sampled `token` when the rule takes drafts for it
        (requests that ask for logprobs or penalties decode plainly)."""
        if req.sampling_params.logprobs is not None or req.sampling_params.penalized:
            return False
        remaining = req.sampling_params.max_tokens - req.num_sampled
        k = self.num_drafts(num_decoding, remaining)
        if k:
            req.spec = SpecWindow(start=token.position, index=token.index, num_drafts=k)
        return bool(k)

    def task(self, req: Request) -> ScheduledRequest | None:
        """The window's rows in the next step: the drafting position at its next depth, or
        every position at its next verify depth; none while the acceptance is being read."""
        w = req.spec
        if w.verified:
            return None
        if not w.verifying:
            position = w.start + w.offset
            return ScheduledRequest(
                req.request_id, RowKind.SPEC, position, 1, w.loops_done,
                prefill_hidden_row_offset=w.offset, draft_loops=self.draft_loops,
                window_rows=w.num_drafts + 1,
            )  # fmt: skip
        depth = self.draft_loops + w.loops_done
        return ScheduledRequest(
            req.request_id, RowKind.SPEC, w.start, w.num_drafts + 1, depth,
            prefill_hidden_row_offset=0,
        )  # fmt: skip

    def loops_to_decision(self, w: SpecWindow) -> int:
        """Loops the window's rows run before the scheduler has something to do for them (its
        acceptance): the rest of the drafting (every remaining position's draft loops) and of
        the verify."""
        verify = self.num_loops - self.draft_loops
        if w.verifying:
            return verify - w.loops_done
        return (w.num_drafts + 1 - w.offset) * self.draft_loops - w.loops_done + verify

    def advance(self, w: SpecWindow, loops: int) -> None:
        """The window's rows ran `loops` loops (drafting: across positions, into the verify)."""
        if not w.verifying:
            done = w.offset * self.draft_loops + w.loops_done + loops
            drafting = (w.num_drafts + 1) * self.draft_loops
            if done < drafting:
                w.offset, w.loops_done = divmod(done, self.draft_loops)
                return
            w.offset, w.loops_done, loops = w.num_drafts + 1, 0, done - drafting
        w.loops_done += loops
        w.verified = w.loops_done == self.num_loops - self.draft_loops

    def samples(self, tasks, loops: int, requests: dict[str, Request]):
        """The draft samples of this step (each before the invocation in which a drafting row
        enters a position past the window's first) and the acceptances that close it, for the
        window rows among `tasks` (a step of `loops` loops)."""
        drafts, verifies = [], []
        for t in tasks:
            if t.kind is not RowKind.SPEC:
                continue
            w = requests[t.request_id].spec
            if t.draft_loops:  # the rows of the step's last invocation: verify rows, last depth?
                last = t.at(loops - 1)
                verified = not last.draft_loops and last.depth == self.num_loops - 1
            else:
                verified = t.depth + loops == self.num_loops
            if verified:
                verifies.append(VerifySample(t.request_id, w.num_drafts, w.index + 1))
            for i in range(loops if t.draft_loops else 0):
                row = t.at(i)
                offset = row.prefill_hidden_row_offset
                if row.draft_loops and row.depth == 0 and offset:
                    drafts.append(DraftSample(t.request_id, offset, w.index + offset, i))
        return tuple(drafts), tuple(verifies)

    def as_dict(self) -> dict[str, float]:
        """The counters, the acceptance rate (accepted / drafted tokens) and the mean accepted
        length (tokens per window: accepted drafts + the target's token)."""
        return spec_counters(self.num_windows, self.num_drafted, self.num_accepted)

    def record(self, w: SpecWindow, num_tokens: int) -> None:
        """A window's acceptance was read back: `num_tokens` tokens (accepted drafts + one)."""
        self.num_windows += 1
        self.num_drafted += w.num_drafts
        self.num_accepted += num_tokens - 1
        fade = (1 - 1 / MEMORY) ** w.num_drafts
        self.recent_drafted = self.recent_drafted * fade + w.num_drafts
        self.recent_accepted = self.recent_accepted * fade + num_tokens - 1


def spec_counters(windows: int, drafted: int, accepted: int) -> dict[str, float]:
    """Speculation's counters as the engine reports them, with the acceptance rate (accepted /
    drafted tokens) and the mean accepted length (tokens per window: accepted drafts + one)."""
    return {
        "spec_windows": windows,
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
        "spec_mean_accepted_length": 1 + accepted / windows if windows else 0.0,
    }
