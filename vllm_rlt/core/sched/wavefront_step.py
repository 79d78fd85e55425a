"""Wavefront steps of several invocations (R5; docs/design/wcpb.md §2).

WCPB regroups ready (chunk, depth) tasks at every depth boundary, so each invocation has a plan
of its own. Which tasks are ready never depends on what an invocation computes (prefill rows
take no exit decision), so where decode rows ride the prefill as a device run the scheduler
plans several invocations at once: after each one's tasks it applies their loop to the
requests' prefill state (`_ChunkedPlanner.advance`, as the step's end would) and plans the next
from there. The step's tasks carry their invocation (`ScheduledRequest.invocation`) and the
runner runs them, the run's rows riding each, with no host decision between.

A step ends before an invocation when `limit` invocations are planned, when no task is ready,
when its blocks do not fit without preempting (its new chunks are withdrawn), or after an
invocation in which a recomputed output position leaves its piece (R6: its skipped-depth copies
must land before any later loop).
"""

from __future__ import annotations

from dataclasses import replace

from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import ScheduledRequest, by_request
from vllm_rlt.core.sched.kv_demand import kv_demand, reserve
from vllm_rlt.core.sched.prefill_planner import WavefrontPlanner, entries, withdraw
from vllm_rlt.request import Request

Exit = tuple[str, int, int]  # (request, position, last depth) of a recomputed output position


def wavefront_step(
    planner: WavefrontPlanner,
    kv: KVCacheManager,
    requests: dict[str, Request],
    running: list[Request],
    first: list[ScheduledRequest],
    budget: int,
    limit: int,
) -> tuple[list[ScheduledRequest], int, list[Exit]]:
    """The step of up to `limit` invocations that starts with the prefill tasks `first` (planned
    and their blocks allocated), each later one planned under `budget` rows. Applies every
    invocation to the requests' prefill state. Returns the tasks (tagged with their invocation
    when there are several), the invocation count and the exits of the last invocation."""
    plans, exits = [first], _advance(planner, requests, first)
    while len(plans) < limit and not exits:
        prefilling = [r for r in running if r.in_prefill]
        marks = entries(prefilling)
        tasks = planner.plan(prefilling, budget)
        if not tasks or not reserve(kv, kv_demand(kv, tasks, 1, [], planner.num_loops)):
            withdraw(marks)  # the new chunks it entered
            break
        plans.append(tasks)
        exits = _advance(planner, requests, tasks)
    if len(plans) == 1:
        return first, 1, exits
    tagged = [replace(t, invocation=i) for i, tasks in enumerate(plans) for t in tasks]
    return tagged, len(plans), exits


def _advance(
    planner: WavefrontPlanner, requests: dict[str, Request], tasks: list[ScheduledRequest]
) -> list[Exit]:
    """One loop of `tasks` applied to their requests' prefill state; the exits it makes."""
    exits = []
    for req_id, own in by_request(tasks).items():
        _, left = planner.advance(requests[req_id], own, 1)
        exits += [(req_id, pos, depth) for pos, depth in left]
    return exits
