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


def test_a_window_step_by_step():
    s = scheduler(2, 1, max_num_batched_tokens=16, async_scheduling=False)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    s.add_request(Request("a", list(range(6)), params, ExitSettings(1, D, 1.0), seed=0))

    def step(accepted=()):
        batch = s.schedule()
        sampled = {r: SampledToken(7, None, ()) for r in batch.sample_req_ids}
        sampled |= {v.request_id: tuple(SampledToken(t, None, ()) for t in accepted)
                    for v in batch.verifies}  # fmt: skip
        s.update(batch, RunnerOutput(sampled, ()))
        rows = [(t.kind, t.token_start, t.num_tokens, t.depth) for t in batch.requests]
        return batch, rows

    step()  # the prompt, atomically
    batch, rows = step()  # the first token is sampled; position 6 runs its draft loop
    assert batch.sample_req_ids == ("a",) and batch.loop_count == 1
    assert rows == [(RowKind.SPEC, 6, 1, 0)] and batch.drafts == ()
    for offset in (1, 2):  # a draft token from the previous position, then its draft loop
        batch, rows = step()
        assert batch.drafts == (DraftSample("a", offset, offset),)  # token 0 is index 0
        assert rows == [(RowKind.SPEC, 6 + offset, 1, 0)] and not batch.sample_req_ids
    batch, rows = step([11, 12])  # verify: positions 6-8 through depths 1-3 at once
    assert rows == [(RowKind.SPEC, 6, 3, 1)] and batch.loop_count == D - 1
    assert batch.verifies == (VerifySample("a", 2, 1),)
    a = s.requests["a"]
    assert a.output_token_ids == [7, 11, 12] and a.spec.start == 8  # next window at the newest
    assert s.spec.as_dict()["spec_acceptance_rate"] == 0.5  # 1 of 2 drafts, then the target's
    # positions 0-7 hold KV (position 8, rejected, is rewritten by the next window): 2 blocks
    assert all(len(s.kv.block_table("a", p)) == 2 for p in range(D))


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
