"""Scheduler rules without a model: loop_count derivation (R1-R4), budgets, modes, chunk
bookkeeping. A fake runner answers every step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import RowKind, SampledToken, StepOutput
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.prefill_planner import WavefrontPlanner
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.request import ExitSettings, PrefillPiece, Request
from vllm_rlt.sampling_params import SamplingParams

D = 4


def scheduler(**kw) -> Scheduler:
    """A scheduler whose fake runner answers each step at once (no async scheduling)."""
    kv = KVCacheManager(4096, 4, kw.pop("layout", "last_exited"), D)
    config = SchedulerConfig(async_scheduling=False, **kw)
    return Scheduler(config, kv, make_exit_policy("ouro", None), D)


def request(req_id, prompt_len, max_tokens=4, threshold=1.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(req_id, list(range(prompt_len)), params, ExitSettings(1, D, threshold), seed=0)


def step(s: Scheduler, gate: float = 0.0):
    batch = s.schedule()
    reading = [t for t in batch.requests if t.reads_gate]
    assert all(t.kind is RowKind.DECODE for t in reading)
    sampled = {r: SampledToken(1, None, ()) for r in batch.sample_req_ids}
    s.update(batch, StepOutput(tuple(gate for _ in reading), lambda: sampled))
    return batch


def test_prefill_only_batch_runs_atomically_even_with_requests_waiting():
    s = scheduler(max_num_seqs=1, max_num_batched_tokens=16, prefill_chunk_size=8)
    s.add_request(request("a", 8))
    s.add_request(request("b", 8))
    batch = step(s)
    assert batch.loop_count == D  # R2: "b" waiting does not split "a"'s chunk
    assert [(t.request_id, t.token_start, t.num_tokens, t.depth) for t in batch.requests] == [
        ("a", 0, 8, 0)
    ]
    a = s.requests["a"]
    assert (a.num_prefilled_tokens, a.prefill_reclaimable_tokens, a.pieces) == (8, 8, [])
    assert a.ready_loops == D and not a.in_prefill


def test_mixed_batch_runs_the_decode_rows_loops_beside_the_chunk_decode_first():
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=6, prefill_chunk_size=8)
    s.add_request(request("a", 3))
    step(s)  # a's prompt, atomically
    s.add_request(request("b", 8))
    batch = step(s)
    assert batch.loop_count == D  # R1: a's token runs all its loops beside b's piece (R2)
    kinds = [(t.request_id, t.kind, t.num_tokens, t.depth) for t in batch.requests]
    assert kinds == [("a", RowKind.DECODE, 1, 0), ("b", RowKind.PREFILL, 5, 0)]  # entry cut to 5
    assert batch.sample_req_ids == ("a",)
    b = s.requests["b"]
    assert (b.num_prefilled_tokens, b.prefill_reclaimable_tokens) == (5, 0)
    batch = step(s)
    assert batch.loop_count == D
    assert [(t.request_id, t.token_start, t.num_tokens, t.depth) for t in batch.requests] == [
        ("a", 4, 1, 0),
        ("b", 5, 3, 0),  # the rest of the chunk enters once the first piece has run every depth
    ]


def test_decode_rows_run_one_loop_while_a_prompt_in_prefill_is_left_out():
    """A request in prefill with no task in the batch would wait for all the batch's loops."""
    s = scheduler(max_num_seqs=3, max_num_batched_tokens=6, prefill_chunk_size=8)
    s.add_request(request("a", 3))
    step(s)
    s.add_request(request("b", 8))
    s.add_request(request("c", 8))
    for depth in range(D):
        batch = step(s)
        assert batch.loop_count == 1  # c is admitted, but the budget leaves it out
        assert [(t.request_id, t.depth) for t in batch.requests] == [("a", depth), ("b", depth)]


def test_rule3_an_overtaking_task_forces_one_loop():
    s = scheduler(max_num_seqs=1, max_num_batched_tokens=4, prefill_chunk_size=8)
    req = request("a", 8)
    s.add_request(req)
    s._admit()
    # a piece at depth 1 that no longer fits the budget, and a later piece at depth 0 that does
    req.pieces = [PrefillPiece(0, 5, 1), PrefillPiece(5, 3, 0)]
    req.num_prefilled_tokens = 8
    batch = s.schedule()
    assert [(t.token_start, t.depth) for t in batch.requests] == [(5, 0)]
    assert batch.loop_count == 1  # depth 1 of positions 0-4 is missing: R3


def test_rule4_stall_limit_caps_prefill_only_batches():
    s = scheduler(max_num_seqs=1, max_num_batched_tokens=8, max_prefill_stall_loops=3)
    s.add_request(request("a", 8))
    first, second = step(s), step(s)
    assert (first.loop_count, second.loop_count) == (3, 1)
    assert [(t.token_start, t.depth) for t in second.requests] == [(0, 3)]
    assert not s.requests["a"].in_prefill


def test_rule1_decode_alone_runs_until_an_exit_decision_is_due():
    fixed = scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    fixed.add_request(request("a", 3, max_tokens=3))
    assert [step(fixed).loop_count for _ in range(4)] == [D, D, D, 1]  # prompt, 2 tokens, last
    gated = scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    gated.add_request(request("a", 3, max_tokens=3, threshold=0.99))
    assert [step(gated, gate=-5.0).loop_count for _ in range(3)] == [D, 1, 1]  # reads gates
    capped = scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_prefill_stall_loops=3)
    capped.add_request(request("a", 3, max_tokens=2))
    assert [step(capped).loop_count for _ in range(4)] == [3, 1, 3, 1]  # R4 caps both kinds
    kv = KVCacheManager(4096, 4, "last_exited", D)
    traced = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, async_scheduling=False),
        kv,
        make_exit_policy("trace", None),
        D,
    )
    for req_id, trace in (("a", (2, 3)), ("b", (4, 4))):
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        exits = ExitSettings(1, D, 1.0, trace=trace)
        traced.add_request(Request(req_id, [5, 6], params, exits, seed=0))
    a, b = traced.requests["a"], traced.requests["b"]
    batches = [step(traced) for _ in range(6)]
    # the first due decision ends each batch; a and b loop at different depths in batch 2
    assert [x.loop_count for x in batches] == [D, 2, 2, 1, 3, 1]
    assert [(t.request_id, t.depth) for t in batches[2].requests] == [("a", 0), ("b", 2)]
    assert (a.output_exit_depths, b.output_exit_depths) == ([4, 2, 3], [4, 4, 4])
    assert not traced.has_unfinished() and kv.num_free_blocks == kv.num_total_blocks


def test_refill_never_mixes_prefill_and_decode():
    s = scheduler(
        scheduling_mode="refill", max_num_seqs=3, max_num_batched_tokens=8, prefill_chunk_size=4
    )
    for i, n in enumerate((3, 9, 5)):
        s.add_request(request(f"r{i}", n, max_tokens=3))
    while s.has_unfinished():
        batch = step(s)
        kinds = {t.kind for t in batch.requests}
        assert len(kinds) <= 1
        if RowKind.PREFILL in kinds:
            assert batch.loop_count == D and not batch.sample_req_ids
        assert batch.num_rows <= 8


def test_no_refill_holds_exited_tokens_until_the_cohort_exits():
    s = scheduler(scheduling_mode="no_refill", max_num_seqs=2, max_num_batched_tokens=8)
    s.add_request(request("a", 2, max_tokens=6, threshold=0.5))
    s.add_request(request("b", 2, max_tokens=6, threshold=1.0))
    step(s)  # both prompts
    step(s, gate=-5.0)  # both sample their first token and run loop 1 (no exit: CDF 0.007)
    step(s, gate=5.0)  # a's gate fires (exit after 2 loops), b keeps looping (threshold 1)
    assert s.requests["a"].ready_loops == 2 and s.requests["b"].decode is not None
    while s.requests["b"].decode is not None:
        batch = step(s, gate=5.0)
        assert "a" not in batch.sample_req_ids  # a's coda waits for the cohort
    batch = s.schedule()
    assert set(batch.sample_req_ids) == {"a", "b"}


def test_budget_counts_rows_of_one_invocation_and_seqs_cap_requests():
    s = scheduler(max_num_seqs=3, max_num_batched_tokens=7, prefill_chunk_size=5)
    for i in range(5):
        s.add_request(request(f"r{i}", 11, max_tokens=2, threshold=0.5))
    seen = set()
    while s.has_unfinished():
        batch = step(s, gate=1.0)
        assert batch.num_rows <= 7
        assert len({t.request_id for t in batch.requests}) <= 3
        assert len(s.running) <= 3
        for t in batch.requests:
            if t.kind is RowKind.PREFILL:
                assert t.token_start // 5 == (t.token_start + t.num_tokens - 1) // 5  # one chunk
                seen.add((t.request_id, t.token_start, t.num_tokens))
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_shared_layout_prefills_in_position_waves():
    s = scheduler(layout="shared", max_num_seqs=2, max_num_batched_tokens=16)
    s.add_request(request("a", 3))
    s.add_request(request("b", 2))
    batch = step(s)
    assert batch.loop_count == D
    assert [(t.request_id, t.token_start, t.num_tokens) for t in batch.requests] == [
        ("a", 0, 1),
        ("b", 0, 1),
    ]


@pytest.mark.parametrize(("cap", "want"), [(3, 3), (None, 8)])  # None: WCPB's default, budget/2
def test_decode_rows_cap_the_prefill_rows_beside_them(cap, want):
    s = scheduler(
        max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=4,
        wavefront_chunked_prefill=True, max_prefill_rows_with_decode=cap,
    )  # fmt: skip
    s.add_request(request("a", 2, max_tokens=6))
    s.add_request(request("b", 40, max_tokens=2))
    beside, alone = [], []
    while s.has_unfinished():
        batch = step(s)
        decode = [t for t in batch.requests if t.kind is RowKind.DECODE]
        prefill = sum(t.num_tokens for t in batch.requests if t.kind is RowKind.PREFILL)
        (beside if decode else alone).append(prefill)
    assert max(beside) == want  # capped beside decode rows (and the cap is reached)
    assert max(alone) > want  # prefill-only batches use the whole budget


def test_only_wcpb_caps_prefill_rows_beside_decode_rows_by_default():
    """Both latency rules: per invocation, and per decode token (the ride limit)."""
    wcpb = SchedulerConfig(max_num_batched_tokens=1024, wavefront_chunked_prefill=True)
    split = SchedulerConfig(max_num_batched_tokens=1024)
    assert wcpb.prefill_rows_with_decode == wcpb.prefill_rows_per_decode_token == 512
    assert split.prefill_rows_with_decode is split.prefill_rows_per_decode_token is None
    explicit = replace(wcpb, max_prefill_rows_with_decode=1024, max_prefill_rows_per_decode_token=9)
    assert explicit.prefill_rows_with_decode == 1024  # a user's value wins
    assert explicit.prefill_rows_per_decode_token == 9


@pytest.mark.parametrize(("seats", "most"), [(3, 8), (2, D * 8)])
def test_decode_token_rides_few_prefill_rows_while_the_engine_has_a_free_seat(seats, most):
    """`max_prefill_rows_per_decode_token`: the prefill rows a decode token rides, summed over
    its D loops, stay within the limit (its other loops run decode-only invocations, prefill
    waiting) while the engine holds fewer requests than seats; with every seat taken only the
    per-invocation cap (half the budget) holds."""
    s = scheduler(
        max_num_seqs=seats, max_num_batched_tokens=16, prefill_chunk_size=4,
        wavefront_chunked_prefill=True, max_prefill_rows_per_decode_token=8,
    )  # fmt: skip
    s.add_request(request("a", 2, max_tokens=12))
    step(s)
    s.add_request(request("b", 60, max_tokens=2))
    ridden, rows, decode_only = [], 0, 0
    while s.has_unfinished():
        batch = step(s)
        if "a" in batch.sample_req_ids:  # sampled before the step's loops: a new token
            ridden, rows = [*ridden, rows], 0
        if any(t.request_id == "a" and t.kind is RowKind.DECODE for t in batch.requests):
            prefill = sum(t.num_tokens for t in batch.requests if t.kind is RowKind.PREFILL)
            rows += prefill * batch.loop_count
            decode_only += not prefill and any(r.in_prefill for r in s.running)
    assert max(ridden) == most  # reached, never passed
    assert bool(decode_only) is (seats == 3)  # b's prefill waited for a's decode-only loops


def _out_of_phase(second: Request, a_tokens: int = 12) -> Scheduler:
    """WCPB with 2-token chunks: "a" decodes; `second` ("b") finishes its prompt when "a"'s token
    has run 2 of its D loops, and its first token is sampled at once: the two are out of phase."""
    s = scheduler(
        max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=2,
        wavefront_chunked_prefill=True,
    )  # fmt: skip
    s.add_request(request("a", 3, max_tokens=a_tokens))
    step(s)
    step(s)
    s.add_request(second)
    for _ in range(4):
        step(s, gate=-5.0)
    assert s.requests["a"].decode.loops_done == 2
    first = step(s, gate=-5.0)  # never held: the first token
    assert first.sample_req_ids == ("b",) and first.loop_count in (1, 2)
    return s


def test_phase_hold_starts_fixed_depth_tokens_together():
    s = _out_of_phase(request("b", 2, max_tokens=6))
    held = step(s)  # a's token is ready but waits for b's, 2 loops behind
    assert (held.loop_count, held.sample_req_ids) == (2, ())
    assert [(t.request_id, t.depth) for t in held.requests] == [("b", 2)]
    for _ in range(3):  # then both start together and run all D loops per step (R1)
        batch = step(s)
        assert (batch.loop_count, batch.sample_req_ids) == (D, ("a", "b"))


def test_no_phase_hold_when_tokens_read_gates_run_other_loops_or_end():
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cases = [
        (request("b", 2, max_tokens=6, threshold=0.99), 12),  # b reads gates
        (Request("b", [0, 1], params, ExitSettings(1, D, 1.0), seed=0), 2),  # a's last token
    ]
    for second, a_tokens in cases:
        s = _out_of_phase(second, a_tokens)
        while s.requests["a"].ready_loops is None:  # "a"'s token exits while "b"'s runs
            step(s, gate=-5.0)
        assert s.requests["b"].decode.loops_done > 0
        assert "a" in s.schedule().sample_req_ids


def test_phase_hold_lets_exited_tokens_start_with_a_first_token():
    s = scheduler(
        max_num_seqs=3, max_num_batched_tokens=8, prefill_chunk_size=2,
        wavefront_chunked_prefill=True,
    )  # fmt: skip
    s.add_request(request("a", 3, max_tokens=12))
    step(s)
    s.add_request(request("c", 2, max_tokens=12))
    for _ in range(3):
        step(s)
    s.add_request(request("b", 2, max_tokens=12))
    for _ in range(4):
        step(s)
    a, b, c = (s.requests[r] for r in "abc")
    assert (a.num_sampled, a.ready_loops, b.num_sampled, b.ready_loops) == (1, D, 0, D)
    assert c.decode.loops_done == D - 1  # mid-token: "a" alone would wait for it
    batch = step(s)
    assert batch.sample_req_ids == ("a", "b")  # "a" starts with "b"'s first token instead
    held = step(s)  # "c" waits for both, D - 1 loops, then all three run in phase
    assert (held.loop_count, held.sample_req_ids) == (D - 1, ())
    assert [t.request_id for t in held.requests] == ["a", "b"]
    for _ in range(3):
        batch = step(s)
        assert (batch.loop_count, sorted(batch.sample_req_ids)) == (D, ["a", "b", "c"])


def test_wavefront_new_chunks_enter_one_per_request_per_round():
    """With rows for fewer than every request's ring, WCPB's new chunks enter round-robin, in
    queue order: each running request gets a chunk before any gets another, so requests admitted
    together progress together (the last entry is cut by the budget). A request's consecutive
    chunks at one depth run as one task."""
    s = scheduler(
        max_num_seqs=4, max_num_batched_tokens=26, prefill_chunk_size=4,
        wavefront_chunked_prefill=True,
    )  # fmt: skip
    for i in range(4):
        s.add_request(request(f"r{i}", 16))
    batch = step(s)
    entered = [(t.request_id, t.token_start, t.num_tokens, t.depth) for t in batch.requests]
    assert entered == [("r0", 0, 8, 0), ("r1", 0, 8, 0), ("r2", 0, 6, 0), ("r3", 0, 4, 0)]
    # next invocation: the entered pieces one depth deeper first, then the rounds go on
    batch = step(s)
    assert [t.depth for t in batch.requests][:4] == [1] * 4


@pytest.mark.parametrize("wavefront", [True, False])
def test_rule7_decode_and_long_prefill_take_turns(wavefront):
    """Past `max_context_with_decode` decode steps (every loop, decode rows only) and prefill
    batches of the whole budget alternate; below it decode rows ride prefill batches (all
    their loops: no ride limit here)."""
    s = scheduler(
        max_num_seqs=3, max_num_batched_tokens=16, prefill_chunk_size=8,
        wavefront_chunked_prefill=wavefront, max_context_with_decode=40,
        max_prefill_rows_per_decode_token=16 * D,
    )  # fmt: skip
    s.add_request(request("a", 8, max_tokens=30))
    while s.requests["a"].ready_loops is None:
        step(s)  # a's prompt
    s.add_request(request("short", 40, max_tokens=30))  # not past the limit: it rides
    kinds = {t.kind for t in step(s).requests}
    assert kinds == {RowKind.DECODE, RowKind.PREFILL}
    while s.requests["short"].in_prefill:
        step(s)
    s.add_request(request("long", 200))
    batches = [step(s) for _ in range(10)]
    for batch in batches:
        kinds = {t.kind for t in batch.requests}
        assert len(kinds) == 1
        if RowKind.DECODE in kinds:
            assert batch.loop_count == D and all(t.depth == 0 for t in batch.requests)
        elif wavefront:  # one loop over the whole budget
            assert batch.loop_count == 1 and batch.num_rows == 16
        else:  # Split: one chunk (one ring slot) through its depths
            assert batch.loop_count == D - batch.requests[0].depth and batch.num_rows == 8
    turns = ["decode" if b.requests[0].kind is RowKind.DECODE else "prefill" for b in batches]
    assert turns == ["decode", "prefill"] * 5


def test_rule7_leaves_decode_with_exit_gates_riding():
    """Tokens that read their gate may exit at any loop: no decode step can run them to their
    exit at once, so they keep riding the prefill batches one loop at a time."""
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8,
                  max_context_with_decode=0)  # fmt: skip
    s.add_request(request("a", 8, max_tokens=30, threshold=0.5))
    while s.requests["a"].ready_loops is None:
        step(s)
    s.add_request(request("b", 64))
    batch = step(s)
    assert {t.kind for t in batch.requests} == {RowKind.DECODE, RowKind.PREFILL}
    assert batch.loop_count == 1


def test_wavefront_merges_consecutive_chunks_only_where_the_ring_rows_follow():
    """Pieces at one depth merge into one task when their positions and their ring rows follow
    each other; across the ring's wrap (slot 3 -> slot 0) they stay two tasks."""
    planner = WavefrontPlanner(chunk_size=4, num_loops=D)  # ring of D = 4 slots
    req = request("r", 40)
    req.prefill_reclaimable_tokens, req.num_prefilled_tokens = 12, 20
    req.pieces = [PrefillPiece(12, 4, 1), PrefillPiece(16, 4, 1)]  # slots 3 and 0
    tasks = planner.plan([req], budget=100)
    spans = [(t.token_start, t.num_tokens, t.depth, t.prefill_hidden_row_offset) for t in tasks]
    # chunks 5 and 6 enter at depth 0 in slots 1 and 2, which follow each other: one task
    assert spans == [(12, 4, 1, 12), (16, 4, 1, 0), (20, 8, 0, 4)]
    planner.advance(req, tasks, 1)
    assert [(p.token_start, p.depth) for p in req.pieces] == [(12, 2), (16, 2), (20, 1), (24, 1)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_update_reads_the_tokens_that_are_due(async_scheduling):
    """`update` takes the runner's answer right after launch: it advances the loops at once and
    reads back this step's tokens, or with async scheduling the previous step's (this step's
    callable is not called until the next `update`); it returns the requests that got tokens
    with their output counts before them."""
    kv = KVCacheManager(4096, 4, "last_exited", D)
    config = SchedulerConfig(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    s = Scheduler(config, kv, make_exit_policy("ouro", None), D)
    s.add_request(request("a", 3, max_tokens=2))
    read: list[int] = []  # the steps whose tokens were read, in order

    def answer(step: int, batch) -> StepOutput:
        def tokens():
            read.append(step)
            return {r: SampledToken(10 + step, None, ()) for r in batch.sample_req_ids}

        return StepOutput((), tokens)

    got = []
    for step in range(4):
        batch = s.schedule()
        got.append([(r.request_id, before) for r, before in s.update(batch, answer(step, batch))])
        assert read[-1:] == ([step] if not async_scheduling else [step - 1] if step else [])
    assert kv.num_free_blocks == kv.num_total_blocks and not s.has_unfinished()  # a ended
    # the prompt's step samples nothing; the next two sample a's tokens at their start
    want = [[], [("a", 0)], [("a", 1)], []]
    assert got == (want if not async_scheduling else [[], *want[:-1]])
