"""Exit policies against hand-computed gate sequences."""

from __future__ import annotations

import math

import pytest

from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.request import DecodeToken, ExitSettings


def loops_until_exit(mode, gates, settings, trace_seed=None, req_id="r", index=0):
    policy = make_exit_policy(mode, trace_seed)
    tok = DecodeToken(position=10, index=index)
    policy.start(tok, settings, req_id)
    for g in gates:
        reads = policy.reads_gate(tok, settings)
        tok.loops_done += 1
        if policy.should_exit(tok, settings, g if reads else None):
            return tok.loops_done
    raise AssertionError("never exited")


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_ouro_exits_when_the_cdf_reaches_the_threshold():
    gates = [logit(0.2), logit(0.5), logit(0.5), logit(0.9)]
    # CDF after each loop: 0.2, 0.6, 0.8, ...
    assert loops_until_exit("ouro", gates, ExitSettings(1, 4, 0.5)) == 2
    assert loops_until_exit("ouro", gates, ExitSettings(1, 4, 0.8)) == 3
    assert loops_until_exit("ouro", gates, ExitSettings(1, 4, 0.19)) == 1
    assert loops_until_exit("ouro", gates, ExitSettings(3, 4, 0.19)) == 3  # min_loops
    assert loops_until_exit("ouro", gates, ExitSettings(1, 2, 0.99)) == 2  # max_loops
    assert loops_until_exit("ouro", [50.0] * 4, ExitSettings(1, 4, 1.0)) == 4  # fixed depth


def test_ouro_delayed_runs_one_more_loop_within_max():
    gates = [logit(0.2), logit(0.5), logit(0.5), logit(0.9)]
    assert loops_until_exit("ouro_delayed", gates, ExitSettings(1, 4, 0.5)) == 3
    assert loops_until_exit("ouro_delayed", gates, ExitSettings(1, 2, 0.5)) == 2


def test_trace_replays_given_depths_and_seeded_draws_are_stable():
    settings = ExitSettings(1, 4, 1.0, trace=(2, 9, 0))
    assert loops_until_exit("trace", [0.0] * 4, settings, index=0) == 2
    assert loops_until_exit("trace", [0.0] * 4, settings, index=1) == 4  # clamped to max_loops
    assert loops_until_exit("trace", [0.0] * 4, settings, index=2) == 1  # clamped to min_loops
    free = ExitSettings(1, 4, 1.0)
    draws = [loops_until_exit("trace", [0.0] * 4, free, 7, "req", i) for i in range(40)]
    again = [loops_until_exit("trace", [0.0] * 4, free, 7, "req", i) for i in range(40)]
    assert draws == again and set(draws) == {1, 2, 3, 4}
    assert loops_until_exit("trace", [0.0] * 4, free, None) == 4  # no trace, no seed: full depth


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="exit_mode"):
        make_exit_policy("entropy", None)


def test_policies_read_the_gate_only_when_a_decision_needs_it():
    tok, adaptive, fixed = (
        DecodeToken(position=3, index=0),
        ExitSettings(1, 4, 0.5),
        ExitSettings(1, 4, 1.0),
    )
    ouro, delayed = make_exit_policy("ouro", None), make_exit_policy("ouro_delayed", None)
    assert ouro.reads_gate(tok, adaptive) and not ouro.reads_gate(tok, fixed)
    assert delayed.reads_gate(tok, adaptive) and not delayed.reads_gate(tok, fixed)
    tok.loops_done = 1
    assert delayed.should_exit(tok, adaptive, logit(0.6)) is False  # fired: one more loop
    assert not delayed.reads_gate(tok, adaptive)  # the exit depth is decided
    tok.loops_done = 2
    assert delayed.should_exit(tok, adaptive, None) is True
    trace = make_exit_policy("trace", 1)
    trace.start(tok, adaptive, "r")
    assert not trace.reads_gate(tok, adaptive)
