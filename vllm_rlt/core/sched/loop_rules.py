"""How many loops a planned batch runs before the scheduler decides again
(`ExecutionBatch.loop_count`; docs/design/scheduler.md §2). Each rule is applied in
`LoopRules.count`:

  R1. a batch with decode rows runs one loop (exit decisions and sampling at depth boundaries),
      unless no row reads its gate and every request in prefill has tasks in the batch (or R7
      holds): then it runs to the first row's decision (fixed depth: the remaining depths; a
      speculative window: the rest of its draft and verify loops), no scheduling decision
      between them, and beside prefill tasks (not WCPB's, R5) at most their loops (R2-R6);
  R2. a prefill-only batch runs atomically, `max(D - depth)` loops, unless
  R3. a request has an earlier piece left out of the batch that the batch's tasks would overtake
      (its planes must be written first): one loop;
  R4. latency rule `max_prefill_stall_loops`: a batch runs at most that many loops, so new
      arrivals are admitted within that many loops;
  R5. wavefront prefill (WCPB) regroups ready tasks at every depth boundary: each invocation
      has a plan of its own, one loop (`LoopRules` counts one). Where the decode rows ride the
      batch as a device run, the scheduler plans up to D such invocations as one wavefront
      step (`wavefront_step.py`).
  R6. a recomputed output position leaves its piece at its recorded depth: a batch ends there.
  R7. decode apart from long prefill (`DecodePlanner.apart`, planned by the scheduler's
      `_take_turn`): while a prompt in prefill or a decoding position is past
      `max_context_with_decode` (always, for a model that needs atomic prefill), decode-only
      steps, which run to the first exit decision (R1 even with prompts in prefill) or as
      device runs, and prefill-only batches of the whole budget (R2-R6) take turns.

Speculative windows (`SpecPlanner`, docs/design/speculative.md) plan their rows with the decode
rows; a drafting row moves to its window's next position every d loops (`DraftSample`s).
Merely having waiting requests, or possible preemptions, does not split a batch.
"""

from __future__ import annotations

from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.core.sched.decode_planner import DecodePlanner
from vllm_rlt.core.sched.execution_batch import ScheduledRequest, by_request
from vllm_rlt.request import Request


class LoopRules:
    def __init__(self, config: SchedulerConfig, planner, decode: DecodePlanner, num_loops: int):
        """`planner`: the prefill planner (prefill_planner.py)."""
        self.config = config
        self.planner = planner
        self.decode = decode
        self.num_loops = num_loops

    def count(
        self,
        decode_tasks: list[ScheduledRequest],
        prefill_tasks: list[ScheduledRequest],
        requests: dict[str, Request],
        running: list[Request],
        apart: bool,
    ) -> int:
        """The loop count of a batch of these tasks (`apart`: R7 holds in this step)."""
        if prefill_tasks and self.planner.single_loop:  # R5: wavefront regroups tasks
            return 1
        if decode_tasks:  # R1
            if not apart and self._left_out(prefill_tasks, running):
                return 1
            loops = min(self.decode.loops_to_decision(requests[t.request_id]) for t in decode_tasks)
            if prefill_tasks:  # the prompts do not wait for the decode rows
                loops = min(loops, self._prefill_loops(prefill_tasks))
        elif not prefill_tasks:
            return 1
        else:
            loops = self._prefill_loops(prefill_tasks)  # R2
        if self.config.max_prefill_stall_loops is not None:  # R4
            loops = min(loops, self.config.max_prefill_stall_loops)
        for req_id, tasks in by_request(prefill_tasks).items():
            req = requests[req_id]
            if not self.planner.atomic_loops(req, tasks, loops):  # R3
                return 1
            loops = min([loops] + [self.planner.loops_to_exit(req, t) for t in tasks])  # R6
        return loops

    def _prefill_loops(self, prefill_tasks: list[ScheduledRequest]) -> int:
        """The loops the deepest-reaching of `prefill_tasks` has left (R2)."""
        return max((t.loops or self.num_loops) - t.depth for t in prefill_tasks)

    @staticmethod
    def _left_out(prefill_tasks: list[ScheduledRequest], running: list[Request]) -> bool:
        """Whether a request in prefill has no task in the batch (it would wait for its loops)."""
        planned = {t.request_id for t in prefill_tasks}
        return any(r.in_prefill and r.request_id not in planned for r in running)
