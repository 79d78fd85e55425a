"""The rule that turns runs with lanes off where they lose (`core/sched/lane_rule.py`): judged
on tokens per row and invocation against plain decoding's 1 / L, with probes once declined, and
the engine on a model whose drafts are rejected (random weights) against the packaged one."""

from __future__ import annotations

import random

from tests.engine.harness import Job, make_engine
from tests.engine.test_device_runs import _run
from tests.engine.test_speculative_gate import _lanes_runs
from vllm_rlt.core.sched.execution_batch import DecodeRun, RunRowResult
from vllm_rlt.core.sched.lane_rule import JUDGE_AFTER, PROBE_EVERY, LaneRule
from vllm_rlt.models.tiny import default_model_dir, write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams


def _record(rule: LaneRule, lanes: int, tokens: int, depth: int, rows: int = 2) -> None:
    """A run of 8 invocations over `rows` rows that took `tokens` tokens each of `depth` loops."""
    run = DecodeRun("ouro", (), (True,) * 9, lanes=lanes)
    result = RunRowResult(tuple((None, depth) for _ in range(tokens)), 0, 1.0, 0, False)
    rule.record(run, (result,) * rows)


def test_lanes_stay_while_they_yield_more_than_plain_decoding():
    rule = LaneRule()
    for _ in range(20):  # 2 loops per token: plain yields 1/2 per row and invocation; lanes 3/4
        assert rule.wanted()
        _record(rule, 3, 6, 2)
    assert rule.pays()


def test_lanes_that_yield_what_plain_decoding_yields_are_declined_then_probed():
    rule = LaneRule()
    wanted = []
    for _ in range(4 * PROBE_EVERY):
        wanted.append(rule.wanted())
        _record(rule, 3 if wanted[-1] else 1, 4, 2)  # 4 tokens in 8 invocations: 1/2 either way
    judged = JUDGE_AFTER // 8  # runs (of 8 tokens) before the rule judges
    assert all(wanted[:judged]) and not rule.pays()
    assert sum(wanted[judged:]) == len(wanted[judged:]) // PROBE_EVERY  # probes only
    for _ in range(2 * PROBE_EVERY):  # drafts turn good: the probes turn lanes back on
        if rule.wanted():
            _record(rule, 3, 8, 2)
    assert rule.pays() and rule.wanted()


def test_the_engine_declines_lanes_whose_drafts_are_rejected(tmp_path):
    """Random weights reject drafts: after the first runs, runs go without lanes (probes
    aside); the packaged model's drafts pay, and its runs keep them."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rng = random.Random(2)
    jobs = [Job(f"r{i}", rng.choices(range(40, 120), k=12), params) for i in range(2)]
    share = {}
    for name, model in (("random", write_tiny_ouro(tmp_path, vocab_size=256, seed=5)),
                        ("packaged", default_model_dir())):  # fmt: skip
        eng = make_engine(model, max_num_seqs=2, num_speculative_tokens=3, exit_threshold=0.5,
                          device_decode_loops=4)  # fmt: skip
        count, runs = _lanes_runs(eng), [0]
        schedule = eng.scheduler.schedule

        def counting(schedule=schedule, runs=runs):
            batch = schedule()
            runs[0] += batch.decode_run is not None
            return batch

        eng.scheduler.schedule = counting
        _run(eng, jobs)
        share[name] = count[0] / runs[0]
    assert share["random"] < 0.4 < 0.9 < share["packaged"]


def test_a_carried_run_without_lanes_ends_when_lanes_pay_again():
    """Lanes declined, one request's runs go on without them, carried one after another; once
    lanes pay again (here: the rule is told so) the carry ends and the next run has them."""
    eng = make_engine(default_model_dir(), max_num_seqs=1, num_speculative_tokens=1,
                      exit_threshold=0.6, device_decode_loops=8)  # fmt: skip
    rule = eng.scheduler.runs.lane_rule
    paying, plain_carried, lanes_after = [False], [0], [0]
    rule.judged, rule.pays = JUDGE_AFTER, lambda: paying[0]
    schedule = eng.scheduler.schedule

    def watching():
        batch = schedule()
        run = batch.decode_run
        if run is not None and run.lanes == 1 and run.carried:
            plain_carried[0] += 1
            paying[0] = paying[0] or plain_carried[0] == 3
        if run is not None and run.lanes > 1:
            lanes_after[0] += 1
        return batch

    eng.scheduler.schedule = watching
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    _run(eng, [Job("r", list(range(40, 60)), params)])
    assert plain_carried[0] >= 3 and paying[0]
    assert lanes_after[0] >= 2  # the first once the carry ended, and those carried after it
