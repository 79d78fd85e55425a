"""The prefill side: runs prompts with the engine's prefill mode (atomic, split or WCPB) and
sends each chunk's KV, every plane, to the request's decode engine as soon as the chunk has
completed every depth, while later chunks are still in prefill.

A request runs here as an ordinary request with max_tokens=1. After every step the role compares
how far each prompt has completed all depths (`prefill_reclaimable_tokens`: every position before
it has) with what it sent: the whole blocks between are sent, and once the prompt is complete the
rest, marked last. Blocks the decode engine found in its prefix cache are not sent. The first
token, sampled at full depth in a later step (so always after the last chunk), goes to the front
end, which relays it to the decode engine.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from vllm_rlt.core.sched.execution_batch import SampledToken
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.role import Role
from vllm_rlt.disagg.transport import KVSender
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.request import RequestStatus


@dataclass
class _Job:
    order: msg.Prefill
    sent_blocks: int  # logical blocks sent (or skipped) so far
    done_at: float | None = None  # when the last chunk completed its final depth


class PrefillRole(Role):
    def __init__(self, engine, place, conn, groups, via_host: bool):
        super().__init__(engine, place, conn)
        rank = place.rank
        peers = {d: g for (p, d), g in groups.items() if p == rank}
        self.sender = KVSender(engine.handoff.kv_cache, peers, via_host)
        self.jobs: dict[str, _Job] = {}
        self.by_handle: dict[int, str] = {}

    def handle(self, message) -> None:
        if isinstance(message, msg.Prefill):
            self._add(message)
        elif isinstance(message, msg.Abort):
            req_id = self.by_handle.pop(message.handle, None)
            if req_id is not None:
                del self.jobs[req_id]
                self.engine.abort_request(req_id)
        elif isinstance(message, msg.PeerDead):
            self.sender.forget(message.rank)
            for job in [j for j in self.jobs.values() if j.order.decode_rank == message.rank]:
                self.handle(msg.Abort(job.order.handle))

    def _add(self, order: msg.Prefill) -> None:
        if not self.admit(order):
            return
        self.jobs[order.request_id] = _Job(order, order.skip_blocks)
        self.by_handle[order.handle] = order.request_id

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for req_id, job in self.jobs.items():
            if job.done_at is None:
                self._send_completed(req_id, job)
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or not out.finished:
                continue
            del self.jobs[out.request_id]
            del self.by_handle[job.order.handle]
            comp = out.outputs[0]
            if comp.finish_reason == RequestStatus.FINISHED_ERROR.value or not comp.token_ids:
                failed = msg.Rejected(job.order.handle, "the prefill of this request failed", False)
                self.conn.send(failed)
                continue
            token = comp.token_ids[0]
            logprobs = comp.logprobs[0] if comp.logprobs else None
            first = SampledToken(
                token,
                None if logprobs is None else logprobs[token],
                () if logprobs is None else tuple(logprobs.items()),
            )
            self.conn.send(msg.FirstToken(job.order.handle, first, job.done_at))

    def _send_completed(self, req_id: str, job: _Job) -> None:
        """Send the blocks of `req_id` whose positions completed every depth since last time."""
        blocks = self.engine.handoff.completed_blocks(req_id)
        if blocks is None:
            return  # waiting, or preempted: what was sent stays valid, the rest comes later
        complete, total = blocks
        if complete <= job.sent_blocks and complete < total:
            return
        first = job.sent_blocks
        planes = self.engine.handoff.block_tables(req_id, first, complete)
        last = complete == total
        self.sender.send(job.order.decode_rank, job.order.handle, first, planes, last)
        job.sent_blocks = complete
        if last:
            job.done_at = time.monotonic()


def prefill_params(params, seed: int):
    """A request's parameters on the prefill side: its first token only, with the seed the
    decode side uses."""
    return dataclasses.replace(params, max_tokens=1, seed=seed)
