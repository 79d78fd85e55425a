"""A random but dependency-valid schedule of the model runner's rows (`PlanDriver`), for
model/kernel tests.

Each request is a token sequence with a loop count per token. Invocations mix rows of several
requests at different depths and positions; a row (p, d) runs once its own depth d-1 is done and
every earlier position has written plane d (LAST_EXITED; a row sees rows of its own invocation)
or has finished all its loops (SHARED: position waves). Tokens that stop early get the
skipped-depth copy right after their last loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch

from vllm_rlt.core.sched.execution_batch import ScheduledRequest
from vllm_rlt.worker.plan_driver import PlanDriver, prompt_rows


@dataclass
class SimRequest:
    req_id: str
    token_ids: list[int]
    loops: list[int]  # loops each token runs (1..D)
    next_depth: list[int] = field(default_factory=list)
    states: dict = field(default_factory=dict)  # (depth, pos) -> state
    gates: dict = field(default_factory=dict)

    def __post_init__(self):
        self.next_depth = [0] * len(self.token_ids)

    def done(self, pos: int) -> bool:
        return self.next_depth[pos] == self.loops[pos]

    def plane_written(self, pos: int, depth: int) -> bool:
        return self.next_depth[pos] > depth or self.done(pos)


def pick_rows(req: SimRequest, rng: random.Random, layout: str, budget: int):
    """Ready (pos, depth) rows of one request for one invocation."""
    picked = []
    for pos in range(len(req.token_ids)):
        if len(picked) >= budget:
            break
        depth = req.next_depth[pos]
        if req.done(pos):
            continue
        if layout == "shared":
            ready = all(req.done(p) for p in range(pos))
        else:
            ready = all(req.plane_written(p, depth) or (p, depth) in picked for p in range(pos))
        if not ready:
            if layout == "shared":
                break
            continue
        if not picked or rng.random() < 0.7:
            picked.append((pos, depth))
    return picked


def segments_of(req_id: str, rows: list[tuple[int, int]]) -> list[ScheduledRequest]:
    """Group (pos, depth) rows into runs of consecutive positions at one depth."""
    segs = []
    for pos, depth in sorted(rows, key=lambda r: (r[1], r[0])):
        last = segs[-1] if segs else None
        if last and last.depth == depth and last.token_start + last.num_tokens == pos:
            segs[-1] = replace(last, num_tokens=last.num_tokens + 1)
        else:
            segs.append(prompt_rows(req_id, pos, 1, depth))
    return segs


def run_random_schedule(
    driver: PlanDriver,
    requests: list[SimRequest],
    seed: int,
    layout: str = "last_exited",
    max_rows: int = 12,
) -> list[list[ScheduledRequest]]:
    """Run every request to completion; returns the invocations (their segments)."""
    rng = random.Random(seed)
    by_id = {r.req_id: r for r in requests}
    for r in requests:
        driver.add(r.req_id, r.token_ids)
    num_loops = driver.runner.num_loops
    history = []
    while not all(r.done(p) for r in requests for p in range(len(r.token_ids))):
        segs = []
        for r in rng.sample(requests, len(requests)):
            budget = max_rows - sum(s.num_tokens for s in segs)
            if budget > 0 and rng.random() < 0.85:
                segs += segments_of(r.req_id, pick_rows(r, rng, layout, budget))
        if not segs:
            continue
        hidden, gates = (t[0] for t in driver.run(segs))
        row = 0
        for s in segs:
            req = by_id[s.request_id]
            for i in range(s.num_tokens):
                pos = s.token_start + i
                req.states[(s.depth, pos)] = hidden[row + i]
                req.gates[(s.depth, pos)] = gates[row + i]
                req.next_depth[pos] = s.depth + 1
                if req.done(pos) and req.loops[pos] < num_loops:
                    driver.exit(req.req_id, [pos], [req.loops[pos] - 1])
            row += s.num_tokens
        history.append(segs)
    return history


def stacked(req: SimRequest, num_loops: int, hidden_size: int):
    """States [D, S, H] and gates [D, S] with NaN where a token did not run."""
    seq = len(req.token_ids)
    hidden = torch.full((num_loops, seq, hidden_size), float("nan"), dtype=torch.float64)
    gates = torch.full((num_loops, seq), float("nan"), dtype=torch.float64)
    for (d, p), h in req.states.items():
        hidden[d, p] = h.double().cpu()
        gates[d, p] = float(req.gates[(d, p)])
    return hidden, gates
