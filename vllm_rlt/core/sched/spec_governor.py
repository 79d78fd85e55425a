"""Speculation that never loses (docs/design/speculative.md §5): output tokens per second with
speculation and without it, measured on the engine's clock at the current load, and windows (or
runs with lanes) opened only while speculating measured faster.

The adaptive rules (`SpecPlanner`, `LaneRule`) count invocations; what speculation costs a real
engine also depends on the host (a window's steps end at its decision, and every step costs host
time) and on how an invocation's cost grows with its rows. The governor measures the outcome:
after every step the scheduler reports the tokens it applied, and the governor runs phases of
`PHASE_STEPS` steps, speculating or not, each after `SETTLE_STEPS` steps in which the windows of
the phase before finish. A phase measures one mode at the load it starts at (decoding requests,
in buckets of powers of two; steps with none are not measured), over the time its steps take
from plan to update: time in which the engine has nothing to do (between requests, or while
another engine runs) is no step's. Once both modes of a load are measured the faster one runs.
A mode found slower on one phase's measurement gets a second look, a phase right away, and its
rate is the better of the two: one phase that caught a slow spell (the first compiles of a
shape, another process on the host) does not condemn it for many phases. Once it is slower on
both, it is measured again after `FIRST_REVISIT` phases, then after twice as many each
time it is slower again (at most `MAX_REVISIT`), so a workload whose costs change is followed
while a settled one spends almost no time in the slower mode. Outputs never depend on it:
speculation is exact, the governor only decides when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PHASE_STEPS = 32  # steps a phase measures
SETTLE_STEPS = 4  # steps at a phase's start that it does not measure
FIRST_REVISIT = 8  # phases of the faster mode before the slower one is measured again
MAX_REVISIT = 64  # ... doubling each time it is slower again, up to this many


class SpecGovernor:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.speculate = True  # the mode of the phase in progress
        self.rates: dict[tuple[int, bool], float] = {}  # (load, speculate) -> tokens per second
        self.looks: dict[tuple[int, bool], int] = {}  # ... -> the phases its rate rests on, 1-2
        self.waits: dict[int, int] = {}  # load -> the wait after its next measured slower mode
        self.left: dict[int, int] = {}  # load -> phases of the faster mode left before a revisit
        self.load: int | None = None  # the load at the start of the phase in progress
        self.steps = 0  # steps of the phase in progress
        self.tokens = 0  # tokens its measured steps applied
        self.elapsed = 0.0  # the time its measured steps took
        self.began = 0.0  # clock at the start of the step in progress

    def begin(self) -> None:
        """A step starts (the scheduler plans it)."""
        self.began = self.clock()

    def observe(self, tokens: int, num_decoding: int) -> None:
        """A step applied `tokens` output tokens while `num_decoding` requests decode."""
        if num_decoding == 0:  # nothing to speculate on: not measured
            return
        load = num_decoding.bit_length()  # 1, 2-3, 4-7, ...
        if self.steps == 0 and load != self.load:  # a phase starts at another load
            self.load, self.speculate = load, self._mode(load)
        self.steps += 1
        if self.steps == SETTLE_STEPS:
            self.tokens, self.elapsed = 0, 0.0
        elif self.steps > SETTLE_STEPS:
            self.tokens += tokens
            self.elapsed += self.clock() - self.began
        if self.steps < SETTLE_STEPS + PHASE_STEPS:
            return
        rate = self.tokens / self.elapsed if self.elapsed > 0 else float("inf")
        key = (self.load, self.speculate)
        if self._second_look(self.load) is self.speculate:  # the better of the two
            self.rates[key], self.looks[key] = max(rate, self.rates[key]), 2
        else:
            self.rates[key], self.looks[key] = rate, 1
        self._decide(self.load)
        self.steps = 0

    def _mode(self, load: int) -> bool:
        """The mode a phase at `load` starts in: a mode not measured there yet, the slower when
        its second look is due, else the faster."""
        on, off = self.rates.get((load, True)), self.rates.get((load, False))
        if on is None or off is None:
            return on is None
        due = self._second_look(load)
        return on > off if due is None else due

    def _second_look(self, load: int) -> bool | None:
        """The mode at `load` that measured slower on one look (its second is due), or None:
        not both measured, or the slower one on two looks."""
        on, off = self.rates.get((load, True)), self.rates.get((load, False))
        if on is None or off is None:
            return None
        slower = not on > off
        return slower if self.looks[load, slower] == 1 else None

    def _decide(self, load: int) -> None:
        """The mode of the next phase, after one at `load` was measured: the mode not measured
        yet; the slower, when it was slower on one look; the faster, for `waits` phases after
        the slower was measured (doubling each time); then the slower once."""
        on, off = self.rates.get((load, True)), self.rates.get((load, False))
        if on is None or off is None:
            self.speculate = on is None
            return
        faster = on > off
        if self._second_look(load) is not None:  # slower on one look: a second one now
            self.speculate = not faster
            return
        if load not in self.left:  # the slower mode was just measured (or both, for the first time)
            wait = self.waits.get(load, FIRST_REVISIT)
            self.waits[load] = min(2 * wait, MAX_REVISIT)
            self.left[load] = wait - (self.speculate == faster)  # (this phase ran the faster)
        else:
            self.left[load] -= 1
        self.speculate = faster
        if self.left[load] <= 0:
            del self.left[load]
            self.speculate = not faster  # measure the slower mode again


def speculation_on(governor: SpecGovernor | None) -> bool:
    """Whether speculation may run as far as the measured fallback goes (None: no fallback)."""
    return governor is None or governor.speculate
