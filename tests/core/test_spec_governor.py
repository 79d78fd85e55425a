"""The measured fallback of speculation (`SpecGovernor`): phases of steps with and without
speculation on a clock the test drives, per load, and revisits of the slower mode that grow;
the time between steps (an idle engine) is not measured."""

from __future__ import annotations

import pytest

from vllm_rlt.core.sched.spec_governor import (
    FIRST_REVISIT,
    MAX_REVISIT,
    PHASE_STEPS,
    SETTLE_STEPS,
    SpecGovernor,
)

PHASE = SETTLE_STEPS + PHASE_STEPS  # steps per phase


class Steps:
    """Steps of an engine whose step costs `cost[speculating]` seconds on a clock of its own,
    emitting `tokens[speculating]` tokens."""

    def __init__(self, cost: dict[bool, float], tokens: dict[bool, int]):
        self.now = 0.0
        self.cost, self.tokens = cost, tokens
        self.gov = SpecGovernor(clock=lambda: self.now)
        self.modes: list[bool] = []  # the mode of every step

    def run(self, steps: int, num_decoding: int = 4, idle_every: int = 0) -> None:
        """`steps` steps; with `idle_every`, the engine is idle for a long time (no steps: no
        requests, or another engine running) after every `idle_every`-th step."""
        for i in range(steps):
            mode = self.gov.speculate
            self.modes.append(mode)
            self.gov.begin()
            self.now += self.cost[mode]
            self.gov.observe(self.tokens[mode], num_decoding)
            if idle_every and (i + 1) % idle_every == 0:
                self.now += 1000.0


def phases(modes: list[bool]) -> list[bool]:
    """The mode of each whole phase."""
    return [modes[i] for i in range(0, len(modes) - PHASE + 1, PHASE)]


def test_a_slower_speculation_is_turned_off_and_revisited_ever_more_rarely():
    # speculating: 2 tokens per step but 3x the time -> 0.67x the tokens per second
    s = Steps(cost={True: 3.0, False: 1.0}, tokens={True: 2, False: 1})
    s.run(PHASE * 60)
    got = phases(s.modes)
    assert got[:3] == [True, False, True]  # measure both, and speculation a second time
    # then plain decoding, speculation measured again (two phases) after 8 phases, 16, 32
    revisits = [i for i, on in enumerate(got) if on][2:]
    first = 3 + FIRST_REVISIT  # plain decoding ran phases 3-10
    second = first + 2 + 2 * FIRST_REVISIT
    third = second + 2 + 4 * FIRST_REVISIT
    want = [p + look for p in (first, second, third) for look in (0, 1)]
    assert revisits == [p for p in want if p < len(got)]
    assert s.gov.rates[3, True] < s.gov.rates[3, False]  # (4 decoding: load bucket 3)
    assert s.gov.waits[3] <= MAX_REVISIT


def test_a_faster_speculation_stays_on_and_plain_decoding_is_remeasured():
    s = Steps(cost={True: 1.2, False: 1.0}, tokens={True: 2, False: 1})
    s.run(PHASE * 60)
    got = phases(s.modes)
    assert got[:3] == [True, False, False]  # plain decoding slower on two looks
    off = [i for i, on in enumerate(got) if not on]
    assert off[:4] == [1, 2, 3 + FIRST_REVISIT, 4 + FIRST_REVISIT]  # again after 8 phases
    assert sum(got) > 0.85 * len(got)


def slow_phase(s: Steps) -> None:
    """A phase of the current mode in which one measured step takes 100 s (a slow spell)."""
    mode, cost = s.gov.speculate, s.cost[s.gov.speculate]
    s.run(SETTLE_STEPS + 1)
    s.cost[mode] = 100.0
    s.run(1)
    s.cost[mode] = cost
    s.run(PHASE - SETTLE_STEPS - 2)


@pytest.mark.parametrize("spells", [1, 2])
def test_a_mode_slower_on_one_phase_gets_a_second_look(spells):
    """Speculation (faster) whose first phase caught a slow spell (its first compiles, say) is
    measured again at once, not after FIRST_REVISIT phases of plain decoding, and keeps the
    better of its two rates; slower on both looks, plain decoding runs."""
    s = Steps(cost={True: 1.2, False: 1.0}, tokens={True: 2, False: 1})
    slow_phase(s)
    s.run(PHASE)  # plain decoding: faster than that phase
    assert s.gov.speculate is True  # the second look
    if spells == 2:
        slow_phase(s)
        assert s.gov.speculate is False
        s.run(PHASE * FIRST_REVISIT)
        assert not any(s.modes[-PHASE * FIRST_REVISIT :])
        return
    s.run(PHASE)
    assert s.gov.rates[3, True] == pytest.approx(2 / 1.2)  # the better look
    s.run(PHASE * 10)  # plain decoding's second look, then speculation
    got = phases(s.modes)
    assert got[:5] == [True, False, True, False, True] and all(got[4 : 4 + FIRST_REVISIT])


def test_settle_steps_are_not_measured():
    """Tokens of a phase's first steps (windows of the mode before still finishing) do not count:
    a burst there changes no rate."""
    gov = SpecGovernor(clock=lambda: float(len(seen)))
    seen: list[int] = []
    for i in range(PHASE):
        gov.begin()
        seen.append(i)
        gov.observe(1000 if i < SETTLE_STEPS else 1, 1)
    assert gov.rates[1, True] == PHASE_STEPS / PHASE_STEPS  # 1 token per unit of time


def test_each_load_is_measured_on_its_own():
    s = Steps(cost={True: 3.0, False: 1.0}, tokens={True: 2, False: 1})
    s.run(PHASE * 3, num_decoding=1)  # measured at 1: speculation loses there
    assert s.gov.speculate is False
    s.run(1, num_decoding=8)  # a phase starts at a load not measured yet: speculation first
    assert s.gov.speculate is True
    assert (4, True) not in s.gov.rates


def test_idle_time_between_steps_is_not_measured():
    """An engine idle between steps (between requests, or while a benchmark runs another engine)
    measures the steps alone: idle time inside a phase of the faster mode does not turn it off
    (measured from the phase's start, the phase caught in it lost to the other mode)."""
    s = Steps(cost={True: 1.2, False: 1.0}, tokens={True: 2, False: 1})
    s.run(PHASE * 30, idle_every=PHASE * 3 + 7)  # some phases of each mode take an idle spell
    got = phases(s.modes)
    # plain decoding: measured, revisited after 8, 16, each time with a second look
    assert sum(not on for on in got) <= 6
    assert s.gov.rates[3, True] == pytest.approx(2 / 1.2)
    assert s.gov.rates[3, False] == pytest.approx(1.0)


def test_steps_without_decoding_requests_are_not_measured():
    """A step with no request decoding (a wave's prefill) neither starts nor advances a phase:
    a phase begun there would decide the mode of the decoding that follows by a load of 0."""
    s = Steps(cost={True: 3.0, False: 1.0}, tokens={True: 2, False: 1})
    s.run(PHASE * 3)  # speculation measured slower at 4 decoding requests
    assert s.gov.speculate is False
    steps = s.gov.steps
    s.run(PHASE * 2, num_decoding=0)
    assert s.gov.speculate is False and s.gov.steps == steps
    assert all(load > 0 for load, _ in s.gov.rates)
