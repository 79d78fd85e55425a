"""The KV blocks a step's plan writes (host side, no torch): what `Scheduler._place` allocates
before the step runs, plane by plane."""

from __future__ import annotations

from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import ScheduledRequest


def kv_demand(
    kv: KVCacheManager,
    tasks: list[ScheduledRequest],
    loops: int,
    exits: list[tuple[str, int, int]],
    num_loops: int,
) -> dict[tuple[str, int], int]:
    """(request, plane) -> the positions [0, end) there that `loops` invocations of `tasks`
    write (each task in the planes of the depths it runs, at depth 0 also the edge planes, at the
    positions it runs them: a drafting window's row moves on; a wavefront step's task runs one
    loop), and the skipped planes that the `exits` (request, position, last depth) copy into."""
    need: dict[tuple[str, int], int] = {}

    def write(req_id: str, planes, end: int) -> None:
        for plane in planes:
            key = (req_id, plane)
            need[key] = max(need.get(key, 0), end)

    for t in tasks:
        if t.draft_loops:  # a drafting row moves on: each position in its draft planes
            for row in map(t.at, range(loops)):
                write(t.request_id, kv.planes_written(row.depth), row.token_start + row.num_tokens)
            continue
        span = 1 if t.invocation >= 0 else loops  # (a wavefront step's task: one loop)
        depths = range(t.depth, min(t.loops or num_loops, t.depth + span))
        planes = (p for d in depths for p in kv.planes_written(d))
        write(t.request_id, planes, t.token_start + t.num_tokens)
    for req_id, pos, depth in exits:
        write(req_id, range(depth + 1, kv.num_loop_planes), pos + 1)
    return need


def lacking(kv: KVCacheManager, need: dict[tuple[str, int], int]) -> int:
    """Blocks `need` ((request, plane) -> end) takes beyond those its requests hold."""
    return sum(kv.num_new_blocks(r, p, end) for (r, p), end in need.items())


def reserve(kv: KVCacheManager, need: dict[tuple[str, int], int]) -> bool:
    """Allocate `need` when its blocks fit in the free ones; False (nothing allocated) else."""
    if lacking(kv, need) > kv.num_free_blocks:
        return False
    for (req_id, plane), end in need.items():
        kv.allocate(req_id, plane, end)
    return True
