"""The scheduler's admission and KV placement: waiting requests admitted to free seats
(`_admit`, and imports from a prefill engine, `add_prefilled`), the blocks a plan writes
allocated (`_place`), and preemption where they do not fit. `Admission` holds no state of its
own: it is a part of `Scheduler` (scheduler.py), which owns every attribute used here."""

from __future__ import annotations

from vllm_rlt.core.sched.execution_batch import SampledToken, split_kinds
from vllm_rlt.core.sched.kv_demand import kv_demand, lacking
from vllm_rlt.request import Request, RequestStatus


class Admission:
    def _seat_wanted(self) -> bool:
        """Whether a waiting request can take a seat now."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def _admit(self) -> dict[str, tuple[int, int]]:
        """Move waiting requests to running while seats allow and the free blocks hold their
        whole prefill (a request admitted on less would be preempted as its prefill grows, and
        under refill scheduling its prefill would hold back the decode steps that would free the
        blocks); a resumed request once its last sampled token is read back. Returns their ids
        with the positions they looked up in the prefix cache and found."""
        admitted = {}
        watermark = self.kv.num_total_blocks // 100
        while len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req is None or req.pending_exit_depths or req.spec is not None:
                break
            req.resume_tokens = max(0, len(req.output_token_ids) - 1)
            ids = req.prefill_token_ids()
            # generated positions are never cached; the last position is always recomputed; a
            # prompt whose tokens are scored runs whole
            queried = min(req.num_prompt_tokens, req.prefill_len - 1)
            queried *= req.prompt_logprobs is None
            hit = self.kv.find_prefix(ids, queried)
            # its whole prefill and first decode position fit beside the cached prefix
            writes = min(req.prefill_len + 1, req.max_positions)
            need = self.kv.blocks_for(writes) - self.kv.blocks_for(hit.num_tokens)
            if need + watermark > self.kv.num_free_blocks:
                break
            self.waiting.pop()
            self.kv.attach(req.request_id, hit)
            queried *= self.kv.enable_prefix_caching
            admitted[req.request_id] = (queried, hit.num_tokens)
            self._count_prefix(queried, hit.num_tokens)
            req.num_prefilled_tokens = req.prefill_reclaimable_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._new.append(self.planner.new_request(req))
        return admitted

    def add_prefilled(self, req: Request, first: SampledToken) -> None:
        """Take in a request whose whole prompt another engine prefilled (a prefill/decode
        import): its blocks hold every prompt position in every plane (reserved and filled by
        the caller), `first` is its first token, sampled there at full depth. Its prefill
        fields start from what arrived (the whole prompt) and it decodes from its next step,
        as a resumed request does; it may end on that token at once (a stop or max_tokens)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        req.num_prefilled_tokens = req.prefill_reclaimable_tokens = req.prefill_len
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req
        self._order[req.request_id] = next(self._ranks)
        self.running.append(req)
        self.kv.cache_prompt(req.request_id, req.prompt_token_ids, req.num_prompt_tokens)
        req.pending_exit_depths.append(req.prompt_loops(self.num_loops))
        self._append_token(req, first)
        if req.status.finished:
            return
        self.kv.mark_changed(req.request_id)
        self._new.append(self.planner.new_request(req))
        self._start_decoding(req)

    def _count_prefix(self, queried: int, found: int) -> None:
        self.prefix_queries += queried
        self.prefix_hits += found

    def _place(self, decode_tasks, prefill_tasks, samples: list[str], admitted: dict, run=None):
        """Allocate the blocks the plan writes, preempting requests while they do not fit;
        returns the plan without the victims' tasks (`samples` loses their samples) and its
        loop count. A device run `run` has its blocks already."""
        if run is not None:
            return decode_tasks, len(run.sample_at) - 1
        tasks = decode_tasks + prefill_tasks
        loops = self._loop_count(decode_tasks, prefill_tasks)
        while True:
            need = kv_demand(self.kv, tasks, loops, self._exits, self.num_loops)
            short = lacking(self.kv, need)
            if short <= self.kv.num_free_blocks:
                break
            if not self.running:
                raise RuntimeError(f"the KV cache cannot hold one step's work ({short} blocks)")
            victim = max(self.running, key=self._victim_key)
            self._preempt(victim, victim.request_id in samples, admitted.get(victim.request_id))
            tasks = [t for t in tasks if t.request_id != victim.request_id]
            if victim.request_id in samples:
                samples.remove(victim.request_id)
        for (req_id, plane), end in need.items():
            self.kv.allocate(req_id, plane, end)
        if len(tasks) < len(decode_tasks) + len(prefill_tasks):  # victims' work left the plan
            loops = min(loops, self._loop_count(*split_kinds(tasks)))
        return tasks, loops

    def _victim_key(self, req: Request) -> tuple:
        """Larger = preempted first: the latest arrival (priority policy: the lowest priority,
        then the latest arrival)."""
        arrival = (req.arrival_time, self._order[req.request_id])
        return (req.priority, *arrival) if self.config.queue_policy == "priority" else arrival

    def _preempt(self, req: Request, sampled_now: bool, admitted_now) -> None:
        """Free `req`'s blocks and send it back to the front of the queue; it keeps its output
        tokens and their exit depths and recomputes the rest when it resumes. `admitted_now`:
        its prefix-cache lookup when it was admitted in this step (then it is withdrawn, as is
        a request imported since the last step)."""
        self.running.remove(req)
        self._release(req.request_id)
        if admitted_now is not None:
            self._count_prefix(-admitted_now[0], -admitted_now[1])
        if any(n.request_id == req.request_id for n in self._new):  # the runner has not heard
            self._new = [n for n in self._new if n.request_id != req.request_id]
        else:
            self._finished.append(req.request_id)
            self.num_preemptions += 1
        if sampled_now:  # the token this step would have sampled
            req.pending_exit_depths.pop()
        req.pieces, req.decode, req.ready_loops = [], None, None
        if req.spec is not None and not req.spec.verified:  # (a verified one's tokens are coming)
            req.spec = None
        req.num_prefilled_tokens = req.prefill_reclaimable_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.push_front(req)
