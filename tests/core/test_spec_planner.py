"""Speculative windows in the scheduler, without a model: a window's plan step by step (draft
rows, draft samples, verify rows, acceptance, KV given back), and the adaptive rule that picks
a window's number of drafts."""

from __future__ import annotations

import pytest

from vllm_rlt.config import ConfigError, SchedulerConfig, SpeculativeConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import (
    DraftSample,
    RowKind,
    RunnerOutput,
    SampledToken,
    VerifySample,
)
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.core.sched.spec_planner import JUDGE_AFTER, PROBE_EVERY, SpecPlanner
from vllm_rlt.request import ExitSettings, Request
from vllm_rlt.sampling_params import SamplingParams

D = 4


def scheduler(k: int, d: int, **kw) -> Scheduler:
    kv = KVCacheManager(4096, 4, "last_exited", D)
    spec = SpeculativeConfig(num_speculative_tokens=k, speculative_draft_loops=d)
    return Scheduler(SchedulerConfig(**kw), kv, make_exit_policy("ouro", None), D, speculative=spec)


def stepper(s: Scheduler):
    """One scheduler step with a fake runner: every sample gives token 7, a verify the tokens
    passed. Returns the plan and its rows (kind, position, rows, depth)."""

    def step(accepted=()):
        batch = s.schedule()
        sampled = {r: SampledToken(7, None, ()) for r in batch.sample_req_ids}
        sampled |= {v.request_id: tuple(SampledToken(t, None, ()) for t in accepted)
                    for v in batch.verifies}  # fmt: skip
        s.update(batch, RunnerOutput(sampled, ()))
        rows = [(t.kind, t.token_start, t.num_tokens, t.depth) for t in batch.requests]
        return batch, rows

    return step


@pytest.mark.parametrize("d", [1, 2])
def test_a_window_step_by_step(d):
    """A decode-only window of K = 2 takes two steps: one drafts every position (loop count
    (K + 1) d, the draft tokens sampled between positions), one verifies."""
    s = scheduler(2, d, max_num_batched_tokens=16, async_scheduling=False)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    s.add_request(Request("a", list(range(6)), params, ExitSettings(1, D, 1.0), seed=0))
    step = stepper(s)
    step()  # the prompt, atomically
    # the first token is sampled; positions 6, 7, 8 run their draft loops in turn, each draft
    # token sampled (token 0 is index 0) before the invocation its position enters in
    batch, rows = step()
    assert batch.sample_req_ids == ("a",) and batch.loop_count == 3 * d
    assert rows == [(RowKind.SPEC, 6, 1, 0)] and batch.requests[0].draft_loops == d
    assert batch.drafts == (DraftSample("a", 1, 1, d), DraftSample("a", 2, 2, 2 * d))
    assert [(t.token_start, depth) for t, depth in batch.live(3 * d - 1, D)] == [(8, d - 1)]
    # its KV: positions 6-8 in the draft planes, position 6 in the verify planes (the first
    # window's position was allocated at admission): 3 blocks of 4 positions, 2 past the draft
    assert [len(s.kv.block_table("a", p)) for p in range(D)] == [3] * d + [2] * (D - d)
    batch, rows = step([11, 12])  # verify: positions 6-8 through depths d..D-1 at once
    assert rows == [(RowKind.SPEC, 6, 3, d)] and batch.loop_count == D - d
    assert batch.verifies == (VerifySample("a", 2, 1),) and batch.drafts == ()
    a = s.requests["a"]
    assert a.output_token_ids == [7, 11, 12] and a.spec.start == 8  # next window at the newest
    assert s.spec.as_dict()["spec_acceptance_rate"] == 0.5  # 1 of 2 drafts, then the target's
    # positions 0-7 hold KV (position 8, rejected, is rewritten by the next window): 2 blocks
    assert all(len(s.kv.block_table("a", p)) == 2 for p in range(D))
    batch, rows = step()  # the next window drafts at once from the newest token
    assert rows == [(RowKind.SPEC, 8, 1, 0)] and batch.loop_count == 3 * d


def test_a_window_beside_prefill_advances_one_loop_per_step():
    """Beside a prompt in prefill (mixed scheduling, R1) a window's row runs one loop per step:
    it moves to the next position between steps, and each draft is sampled at a step's start."""
    s = scheduler(2, 2, scheduling_mode="mixed", max_num_batched_tokens=16, prefill_chunk_size=4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    exits = ExitSettings(1, D, 1.0)
    s.add_request(Request("a", list(range(6)), params, exits, seed=0))
    step = stepper(s)
    while s.requests["a"].in_prefill:
        step()
    s.add_request(Request("b", list(range(64)), params, exits, seed=0))
    seen = []
    for _ in range(6 + (D - 2)):  # three positions of two draft loops, then the verify loops
        batch, rows = step([11, 12])
        assert batch.loop_count == 1 and rows[-1][0] is RowKind.PREFILL
        spec = [r for r in rows if r[0] is RowKind.SPEC]
        seen.append((spec[0][1:], [(x.offset, x.invocation) for x in batch.drafts]))
    assert seen == [
        ((6, 1, 0), []), ((6, 1, 1), []),
        ((7, 1, 0), [(1, 0)]), ((7, 1, 1), []),
        ((8, 1, 0), [(2, 0)]), ((8, 1, 1), []),
        ((6, 3, 2), []), ((6, 3, 3), []),
    ]  # fmt: skip
    assert s.requests["a"].output_token_ids == [7, 11, 12]


def rule(k=4, d=1, **kw) -> SpecPlanner:
    config = SpeculativeConfig(num_speculative_tokens=k, speculative_draft_loops=d, **kw)
    return SpecPlanner(config, D, max_rows=64)


def test_default_rule_is_off_above_the_row_limit():
    r = rule(speculative_max_decode_rows=8)
    assert r.num_drafts(num_decoding=8, remaining=100) == 4
    assert r.num_drafts(num_decoding=9, remaining=100) == 0
    assert r.num_drafts(num_decoding=1, remaining=3) == 2  # the window emits up to 3 tokens
    assert r.num_drafts(num_decoding=1, remaining=1) == 0
    assert SpecPlanner(SpeculativeConfig(num_speculative_tokens=4), D, max_rows=3).max_drafts == 2


def test_default_rule_stops_drafting_that_does_not_pay():
    """Without a cost table invocations count as weight-bound (all cost the same): a window
    drafts K while the acceptance so far pays there, judged after JUDGE_AFTER drafts; declined
    windows still draft every PROBE_EVERY-th time, to keep measuring."""
    r = rule(k=1, d=3)  # the prior (a = 0.7) does not pay: 1.7 tokens for 7 invocations, not 4
    assert r.num_drafts(1, 100) == 1
    r.num_drafted, r.num_accepted = JUDGE_AFTER, JUDGE_AFTER  # all accepted: 2 for 7 pays
    assert r.num_drafts(1, 100) == 1
    r = rule(k=4, d=1)
    r.num_drafted, r.num_accepted = 100, 10  # a ~ 0.16: 1.19 tokens for 8 invocations
    assert [r.num_drafts(1, 100) for _ in range(2 * PROBE_EVERY)].count(4) == 2
    r.num_accepted = 90  # a ~ 0.85: 4.2 tokens for 8 invocations
    assert r.num_drafts(1, 100) == 4


def test_cost_table_rule():
    """Weight-bound invocations (flat cost) make long windows pay; compute-bound ones (cost
    proportional to rows) make verify rows cost what plain decoding saves, so speculation is
    off; a table that turns compute-bound at 64 rows switches off as the rows grow."""
    flat = rule(speculative_invocation_costs="1:1.0,512:1.0", speculative_max_decode_rows=1000)
    # prior acceptance a = 0.7, d = 1: (1 - a^(k+1)) / (1 - a) / (k + 4) peaks at k = 2
    assert flat.num_drafts(1, 100) == 2 and flat.num_drafts(100, 100) == 2
    flat.num_drafted = flat.num_accepted = 10**6  # every draft accepted: the longest window
    assert flat.num_drafts(1, 100) == 4
    linear = rule(speculative_invocation_costs="1:1", speculative_max_decode_rows=1000)
    assert linear.cost(10) == 10 and linear.num_drafts(1, 100) == 0
    knee = rule(speculative_invocation_costs="1:1,64:1,1024:16", speculative_max_decode_rows=1000)
    assert knee.cost(544) == pytest.approx(8.5)
    assert knee.num_drafts(1, 100) == 2 and knee.num_drafts(256, 100) == 0
    # the measured acceptance replaces the prior: all drafts rejected -> off
    knee.num_drafted = 1000
    assert knee.num_drafts(1, 100) == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"num_speculative_tokens": -1},
        {"speculative_draft_loops": 0},
        {"speculative_invocation_costs": "8:1,4:1"},
        {"speculative_invocation_costs": "1:0"},
        {"speculative_invocation_costs": "rows"},
    ],
)
def test_config_is_validated(kw):
    with pytest.raises(ConfigError):
        SpeculativeConfig(**kw)
