"""Whether runs with lanes pay (docs/design/speculative.md §3): speculation with the exit gate
drafts only while it yields more tokens per invocation than plain decoding would.

Counting every invocation as costing the same (decode at small batch reads the weights once per
invocation, whatever its rows), a plain run advances each row one loop per invocation, so it
yields 1 / L tokens per row and invocation for L loops per token; a run with lanes yields what
its rows took per row and invocation. Runs with lanes go on while theirs exceeds `MARGIN` / L
(lanes add rows to every invocation and a sample phase after each); the estimates fade over the
last ~`MEMORY` tokens, are judged after `JUDGE_AFTER` tokens of runs with lanes, and once lanes
are declined one run in `PROBE_EVERY` still has them, so that a workload whose drafts become
good turns them back on. A run planned or carried without lanes counts towards the probe; a
carried run ends when lanes it has stopped paying, or when it has none and they are wanted
again (lanes pay against a yardstick that moved, or a probe is due), so that the next run is
fresh. The rule also keeps the speculative counters of runs with lanes.
"""

from __future__ import annotations

from vllm_rlt.core.sched.execution_batch import DecodeRun, RunRowResult
from vllm_rlt.core.sched.spec_planner import spec_counters

MARGIN = 1.1  # lanes must beat plain decoding's tokens per row and invocation by this factor
MEMORY = 256  # tokens the estimates remember (older ones fade geometrically)
JUDGE_AFTER = 32  # tokens of runs with lanes before the rule judges them
PROBE_EVERY = 16  # once declined, one run in this many has lanes anyway


def run_lanes(drafts: int, num_loops: int) -> int:
    """The lanes of a row in a run with lanes for `drafts` (num_speculative_tokens) and a
    model of `num_loops` loops: drafts + 1, but at most num_loops, since no more positions can
    be in flight. A lane starts at most one position per sample phase and only after the one
    before it ran a loop, and the oldest lane's token leaves after at most num_loops loops,
    taken in the sample phase that follows, before the newest lane drafts into the freed lane;
    so while the oldest runs, the others started in at most num_loops - 1 later phases."""
    return min(drafts, num_loops - 1) + 1


class LaneRule:
    def __init__(self) -> None:
        self.lane_tokens = 0.0  # tokens runs with lanes took, faded
        self.lane_slots = 0.0  # their rows x invocations, faded alike
        self.tokens = 0.0  # tokens of every run, faded
        self.loops = 0.0  # their exit depths' sum, faded alike
        self.judged = 0  # tokens of runs with lanes seen
        self.declined = 0  # runs without lanes since one with them was read back
        self.counts = [0, 0, 0]  # drafts, accepted drafts, tokens drafting rows took

    def wanted(self) -> bool:
        """Whether a run that may have lanes has them: they pay, or a probe is due (it stays due
        until a run with lanes is read back, so asking twice gives the same answer); a run
        without them counts towards the next probe."""
        if self.keeps() or self.declined >= PROBE_EVERY - 1:
            return True
        self.declined += 1
        return False

    def keeps(self) -> bool:
        """Whether runs with lanes go on (a carried run keeps its lanes only then): not judged
        yet, or they pay."""
        return self.judged < JUDGE_AFTER or self.pays()

    def pays(self) -> bool:
        """Runs with lanes take more tokens per row and invocation than `MARGIN` / L."""
        if not self.lane_slots or not self.loops:
            return True
        return self.lane_tokens / self.lane_slots > MARGIN * self.tokens / self.loops

    def record(self, run: DecodeRun, results: tuple[RunRowResult, ...]) -> None:
        """A run's results were read back."""
        tokens = sum(len(r.sampled) for r in results)
        loops = sum(depth for r in results for _, depth in r.sampled)
        keep = max(0.0, 1.0 - tokens / MEMORY)
        self.tokens = self.tokens * keep + tokens
        self.loops = self.loops * keep + loops
        if run.lanes > 1:
            self.declined = 0
            self.lane_tokens = self.lane_tokens * keep + tokens
            self.lane_slots = self.lane_slots * keep + len(results) * (len(run.sample_at) - 1)
            self.judged += tokens
            for r in results:
                self.counts = [a + b for a, b in zip(self.counts, r.spec_counts, strict=True)]

    def as_dict(self) -> dict[str, float]:
        """The speculative counters of `SpecPlanner.as_dict`: drafts, accepted drafts, and as
        windows the tokens drafting rows took that were not accepted drafts (so that the mean
        accepted length is tokens per such token)."""
        drafted, accepted, taken = self.counts
        return spec_counters(taken - accepted, drafted, accepted)
