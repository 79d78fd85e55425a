"""Wavefront steps (`wavefront_step`, docs/design/wcpb.md §2): several WCPB invocations planned at
once, each from the prefill state the ones before leave."""

from __future__ import annotations

import copy

from tests.core.test_scheduler import D, request
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.kv_demand import kv_demand, reserve
from vllm_rlt.core.sched.prefill_planner import WavefrontPlanner
from vllm_rlt.core.sched.wavefront_step import wavefront_step
from vllm_rlt.request import Request


def _prompts(kv: KVCacheManager, lengths: dict[str, int]) -> list[Request]:
    """Requests admitted with no prefix hit, none of their blocks allocated yet."""
    reqs = [request(req_id, n) for req_id, n in lengths.items()]
    for req in reqs:
        kv.attach(req.request_id, kv.find_prefix([], 0))
    return reqs


def _first(planner, kv, reqs: list[Request], budget: int):
    """The step's first invocation, planned and its blocks allocated (as the scheduler does)."""
    tasks = planner.plan(reqs, budget)
    assert reserve(kv, kv_demand(kv, tasks, 1, [], D))
    return tasks


def _rows(tasks) -> list[tuple]:
    return [(t.request_id, t.token_start, t.num_tokens, t.depth) for t in tasks]


def test_a_wavefront_step_plans_what_steps_of_one_invocation_would():
    """Each invocation of a step holds exactly the tasks that one-invocation steps plan from the
    same state (the planner, then one loop applied), and the requests end in the same state."""
    lengths, budget = {"a": 23, "b": 9, "c": 14}, 12
    kv = KVCacheManager(4096, 4, "last_exited", D)
    planner = WavefrontPlanner(4, D, budget // 4)
    reqs = _prompts(kv, lengths)
    mirror = copy.deepcopy(reqs)  # stepped one invocation at a time
    first = _first(planner, kv, reqs, budget)
    tasks, loops, exits = wavefront_step(
        planner, kv, {r.request_id: r for r in reqs}, reqs, first, budget, D
    )
    assert loops == D and not exits
    for i in range(loops):
        single = planner.plan([r for r in mirror if r.in_prefill], budget)
        assert _rows(t for t in tasks if t.invocation == i) == _rows(single)
        for req in mirror:
            own = [t for t in single if t.request_id == req.request_id]
            if own:
                planner.advance(req, own, 1)
    for req, twin in zip(reqs, mirror, strict=True):
        assert (req.pieces, req.num_prefilled_tokens, req.prefill_reclaimable_tokens) == (
            twin.pieces, twin.num_prefilled_tokens, twin.prefill_reclaimable_tokens
        )  # fmt: skip


def test_a_wavefront_step_ends_where_its_blocks_run_out():
    """The next invocation's blocks must fit in the free ones (a step never preempts): 12
    blocks hold two 8-token prompts' first three planes (4 blocks each) but not the fourth."""
    kv = KVCacheManager(12, 4, "last_exited", D)
    planner = WavefrontPlanner(4, D, 4)
    reqs = _prompts(kv, {"a": 8, "b": 8})
    first = _first(planner, kv, reqs, 16)
    tasks, loops, _ = wavefront_step(
        planner, kv, {r.request_id: r for r in reqs}, reqs, first, 16, D
    )
    assert loops == 3 and sorted({t.invocation for t in tasks}) == [0, 1, 2]
    assert kv.num_free_blocks == 0
    assert [p.depth for r in reqs for p in r.pieces] == [3] * 4  # advanced through the three


def test_new_chunks_of_an_invocation_that_does_not_fit_are_withdrawn():
    """Chunks 0-1 of a 16-token prompt start the step at depth 2; their depth-3 invocation
    finishes them, and the next would enter chunks 2-3, whose plane-0 blocks (2) do not fit in
    the one block left: the step ends after two invocations and the entries are undone."""
    kv = KVCacheManager(9, 4, "last_exited", D)
    planner = WavefrontPlanner(4, D, 2)
    (req,) = _prompts(kv, {"a": 16})
    for _ in range(2):  # (earlier steps: chunks 0-1 through depths 0-1, 4 blocks)
        planner.advance(req, _first(planner, kv, [req], 8), 1)
    first = _first(planner, kv, [req], 8)
    assert _rows(first) == [("a", 0, 8, 2)]
    tasks, loops, _ = wavefront_step(planner, kv, {"a": req}, [req], first, 8, D)
    assert loops == 2 and _rows(tasks) == [("a", 0, 8, 2), ("a", 0, 8, 3)]
    assert (req.pieces, req.num_prefilled_tokens, req.prefill_reclaimable_tokens) == ([], 8, 8)
    assert kv.num_free_blocks == 1
