"""Speculative windows in the scheduler, without a model: a window's plan step by step (draft
rows, draft samples, verify rows, acceptance, KV given back), and the adaptive rule that picks
a window's number of drafts."""

from __future__ import annotations

import pytest

from vllm_rlt.config import ConfigError
from vllm_rlt.config_sched import SchedulerConfig, SpeculativeConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import (
    DraftSample,
    RowKind,
    SampledToken,
    StepOutput,
    VerifySample,
)
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.core.sched.spec_planner import JUDGE_AFTER, MEMORY, PROBE_EVERY, SpecPlanner
from vllm_rlt.request import ExitSettings, Request, SpecWindow
from vllm_rlt.sampling_params import SamplingParams

D = 4


def scheduler(k: int, d: int, **kw) -> Scheduler:
    kv = KVCacheManager(4096, 4, "last_exited", D)
    # (the adaptive rule alone: the measured fallback reads the clock)
    spec = SpeculativeConfig(
        num_speculative_tokens=k, speculative_draft_loops=d, speculative_fallback=False
    )
    config = SchedulerConfig(async_scheduling=False, **kw)  # the fake runner answers at once
    return Scheduler(config, kv, make_exit_policy("ouro", None), D, speculative=spec)


def stepper(s: Scheduler):
    """One scheduler step with a fake runner: every sample gives token 7, a verify the tokens
    passed. Returns the plan and its rows (kind, position, rows, depth)."""

    def step(accepted=()):
        batch = s.schedule()
        sampled = {r: SampledToken(7, None, ()) for r in batch.sample_req_ids}
        sampled |= {v: tuple(SampledToken(t, None, ()) for t in accepted)
                    for v in batch.verifies}  # fmt: skip
        s.update(batch, StepOutput((), lambda: sampled))
        rows = [(t.kind, t.token_start, t.num_tokens, t.depth) for t in batch.requests]
        return batch, rows

    return step


@pytest.mark.parametrize("d", [1, 2])
def test_a_window_step_by_step(d):
    """A decode-only window of K = 2 takes one step of (K + 1) d + D - d loops: its row drafts
    every position in turn (the draft tokens sampled between positions), then turns into the
    verify rows of all three positions, and the acceptance closes the step."""
    s = scheduler(2, d, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    s.add_request(Request("a", list(range(6)), params, ExitSettings(1, D, 1.0), seed=0))
    step = stepper(s)
    step()  # the prompt, atomically
    # the first token is sampled; positions 6, 7, 8 run their draft loops in turn, each draft
    # token sampled (token 0 is index 0) before the invocation its position enters in; then
    # positions 6-8 run depths d..D-1 at once
    batch, rows = step([11, 12])
    assert batch.sample_req_ids == ("a",) and batch.loop_count == 3 * d + D - d
    assert rows == [(RowKind.SPEC, 6, 1, 0)] and batch.requests[0].draft_loops == d
    assert batch.drafts == (DraftSample("a", 1, 1, d), DraftSample("a", 2, 2, 2 * d))
    live = [(t.token_start, t.num_tokens, depth) for i in range(batch.loop_count)
            for t, depth in batch.live(i, D)]  # fmt: skip
    draft = [(6 + i // d, 1, i % d) for i in range(3 * d)]
    assert live == draft + [(6, 3, depth) for depth in range(d, D)]
    assert batch.verifies == (VerifySample("a", 2, 1),)
    a = s.requests["a"]
    assert a.output_token_ids == [7, 11, 12] and a.spec.start == 8  # next window at the newest
    assert s.spec.as_dict()["spec_acceptance_rate"] == 0.5  # 1 of 2 drafts, then the target's
    # positions 0-7 hold KV (position 8, rejected, is rewritten by the next window): 2 blocks
    assert all(len(s.kv.block_table("a", p)) == 2 for p in range(D))
    batch, rows = step()  # the next window drafts at once from the newest token
    assert rows == [(RowKind.SPEC, 8, 1, 0)] and batch.loop_count == 3 * d + D - d


def test_a_window_split_across_steps_resumes_where_it_stopped():
    """Steps that end inside a window (beside tokens with earlier decisions) leave its row where
    the step left it, across positions and into the verify: the next step's task continues
    there, and the loops to its decision add up to the window's (K + 1) d + D - d."""
    planner = rule(k=2, d=2)
    w = SpecWindow(start=10, index=3, num_drafts=2)
    req = Request("a", [1], SamplingParams(max_tokens=9), ExitSettings(1, D, 1.0), seed=0)
    req.spec = w
    seen, total = [], 0
    for loops in (3, 2, 2, 1):  # 3 + 2 + 2 + 1 = (2 + 1) * 2 + 4 - 2
        assert planner.loops_to_decision(w) == 3 * 2 + D - 2 - total
        t = planner.task(req)
        seen.append((t.token_start, t.num_tokens, t.depth, t.draft_loops))
        rows = [t.at(i) if t.draft_loops else t for i in range(loops)]
        assert [r.num_tokens for r in rows] == [3 if r.depth >= 2 else 1 for r in rows]
        planner.advance(w, loops)
        total += loops
    assert seen == [(10, 1, 0, 2), (11, 1, 1, 2), (12, 1, 1, 2), (10, 3, 3, 0)]
    assert w.verified


def test_a_window_beside_prefill_runs_the_chunks_loops():
    """Beside a prompt in prefill (mixed scheduling, R1) a window's row runs as many loops as the
    chunk has left: it moves to its next position within the step, each draft sampled before its
    invocation, and the window's verify loops finish in the next step."""
    s = scheduler(2, 2, scheduling_mode="mixed", max_num_batched_tokens=16, prefill_chunk_size=4)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    exits = ExitSettings(1, D, 1.0)
    s.add_request(Request("a", list(range(6)), params, exits, seed=0))
    step = stepper(s)
    while s.requests["a"].in_prefill:
        step()
    s.add_request(Request("b", list(range(64)), params, exits, seed=0))
    seen = []
    for _ in range(2):  # three positions of two draft loops, then the verify loops: 2 steps
        batch, rows = step([11, 12])
        assert batch.loop_count == D and rows[-1][0] is RowKind.PREFILL
        spec = [r for r in rows if r[0] is RowKind.SPEC]
        seen.append((spec[0][1:], [(x.offset, x.invocation) for x in batch.drafts]))
    assert seen == [((6, 1, 0), [(1, 2)]), ((8, 1, 0), [(2, 0)])]
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


def feed(planner: SpecPlanner, windows: int, k: int, accepted: int) -> None:
    """`windows` verified windows of `k` drafts, `accepted` of each accepted."""
    for _ in range(windows):
        planner.record(SpecWindow(start=0, index=0, num_drafts=k), accepted + 1)


def test_default_rule_stops_drafting_that_does_not_pay():
    """Without a cost table invocations count as weight-bound (all cost the same): a window
    drafts K while the acceptance so far pays there, judged after JUDGE_AFTER drafts; declined
    windows still draft about every PROBE_EVERY decode steps, to keep measuring, and the
    estimate, which fades over MEMORY drafts, brings drafting back when the drafts get good."""
    r = rule(k=1, d=3)  # the prior (a = 0.7) does not pay: 1.7 tokens for 7 invocations, not 4
    assert r.num_drafts(1, 100) == 1
    feed(r, JUDGE_AFTER, 1, 1)  # all accepted: 2 for 7 pays
    assert r.num_drafts(1, 100) == 1
    r = rule(k=4, d=1)
    feed(r, 25, 4, 0)  # a ~ 0: 1 token for 8 invocations
    # one window per decoding request and step: a probe every PROBE_EVERY steps at any load
    assert [r.num_drafts(1, 100) for _ in range(2 * PROBE_EVERY)].count(4) == 2
    assert [r.num_drafts(8, 100) for _ in range(16 * PROBE_EVERY)].count(4) == 2
    resumed = next(n for n in range(1, 100) if r.num_drafts(1, 100) or feed(r, 1, 4, 4))
    assert MEMORY / 4 / 8 < resumed <= MEMORY / 4  # the old rejections fade out
    assert r.as_dict()["spec_draft_tokens"] == 4 * (25 + resumed - 1)  # counters never fade


def test_cost_table_rule():
    """Weight-bound invocations (flat cost) make long windows pay; compute-bound ones (cost
    proportional to rows) make verify rows cost what plain decoding saves, so speculation is
    off; a table that turns compute-bound at 64 rows switches off as the rows grow."""
    flat = rule(speculative_invocation_costs="1:1.0,512:1.0", speculative_max_decode_rows=1000)
    # prior acceptance a = 0.7, d = 1: (1 - a^(k+1)) / (1 - a) / (k + 4) peaks at k = 2
    assert flat.num_drafts(1, 100) == 2 and flat.num_drafts(100, 100) == 2
    flat.recent_drafted = flat.recent_accepted = 10**6  # every draft accepted: the longest window
    assert flat.num_drafts(1, 100) == 4
    linear = rule(speculative_invocation_costs="1:1", speculative_max_decode_rows=1000)
    assert linear.cost(10) == 10 and linear.num_drafts(1, 100) == 0
    knee = rule(speculative_invocation_costs="1:1,64:1,1024:16", speculative_max_decode_rows=1000)
    assert knee.cost(544) == pytest.approx(8.5)
    assert knee.num_drafts(1, 100) == 2 and knee.num_drafts(256, 100) == 0
    # the measured acceptance replaces the prior: all drafts rejected -> off
    knee.recent_drafted = 1000
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


def test_a_fresh_window_waits_for_the_windows_in_flight():
    """The window hold: b's first window opens while a's is in flight; it waits for a's
    acceptance, and from then on one step runs both windows whole (R1), in phase."""
    s = scheduler(2, 1, max_num_batched_tokens=16, max_num_seqs=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    exits = ExitSettings(1, D, 1.0)
    s.add_request(Request("a", list(range(6)), params, exits, seed=0))
    step = stepper(s)
    step()  # a's prompt
    s.add_request(Request("b", list(range(4)), params, exits, seed=0))
    batch, rows = step([11, 12])  # a's window beside b's prompt: the prompt's D loops
    assert batch.loop_count == D and [r[0] for r in rows] == [RowKind.SPEC, RowKind.PREFILL]
    window = 3 * 1 + D - 1  # a window of K = 2, d = 1
    batch, rows = step([11, 12])  # b's first token opens a fresh window: it waits
    assert batch.sample_req_ids == ("b",) and s.requests["b"].spec is not None
    assert [t.request_id for t in batch.requests] == ["a"]
    assert batch.loop_count == window - D and batch.verifies  # the rest of a's window
    for _ in range(3):
        batch, rows = step([11, 12])
        assert [t.request_id for t in batch.requests] == ["a", "b"]
        assert batch.loop_count == window and len(batch.verifies) == 2
