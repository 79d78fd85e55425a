"""The scheduler's second half: the runner's answer to a step (`update`), applied to the
requests. `StepUpdate` holds no state of its own: it is a part of `Scheduler`
(scheduler.py), which owns every attribute used here (the requests, the KV manager, the
planners, the unread answers and the run in flight)."""

from __future__ import annotations

from vllm_rlt.core.sched.execution_batch import ExecutionBatch, RowKind, StepOutput
from vllm_rlt.request import DecodeToken, Request, RequestStatus


class StepUpdate:
    def update(self, batch: ExecutionBatch, output: StepOutput) -> list[tuple[Request, int]]:
        """Take the runner's answer to `batch`, right after its launch: the step's loops advance
        the requests (`decode_gate_logits` decide exits now), and the sampled tokens that are
        due are read back and applied (stop tokens, `max_tokens`): this step's, or with async
        scheduling (`SchedulerConfig.async_scheduling`) the last step's, whose device work has
        long finished; a device run's when the run that goes on from it is queued, or before
        the next plan (`schedule`). Returns the requests that got tokens since the last
        `update`, each with its number of output tokens before them, in the order read."""
        self._advance(batch, output.decode_gate_logits)
        answer = (batch, output)
        if batch.decode_run is not None:
            self._read_run()  # the run this one continues
            unread, self._unread, self._unread_run = self._unread, None, answer
            if unread is not None:
                self._read_tokens(*unread)
            self._read_tokens(*answer)
        else:
            if self.config.async_scheduling:
                answer, self._unread = self._unread, answer
            if answer is not None:
                self._read_tokens(*answer)
        got, self._got = self._got.values(), {}
        got = [(req, before) for req, before in got if len(req.output_token_ids) > before]
        if self.governor is not None:
            tokens = sum(len(req.output_token_ids) - before for req, before in got)
            self.governor.observe(tokens, len(self.decode.decoding(self.running)))
        return got

    def _note(self, req_ids) -> None:
        """Remember the output counts of `req_ids` before tokens are applied to them."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and req_id not in self._got:
                self._got[req_id] = (req, len(req.output_token_ids))

    def _read_tokens(self, batch: ExecutionBatch, output: StepOutput) -> None:
        """Wait for the tokens sampled in `batch` (and its scored prompt tokens) and apply them."""
        for req_id, scored in output.read_prompt_logprobs().items():
            req = self.requests.get(req_id)
            if req is None:  # ended meanwhile
                continue
            for position, token in scored:
                req.prompt_logprobs[position] = token.logprobs()
        sampled = output.read_tokens()
        self._note([*batch.sample_req_ids, *(v.request_id for v in batch.verifies)])
        self._apply_tokens(batch, sampled)

    def _read_if_idle(self) -> None:
        """Read the last step's tokens back now (async scheduling) when nothing can be planned
        without them: every running request awaits them (`DecodePlanner.awaits_tokens`: its
        newest token sampled, or its window verified) and no waiting request can take a seat.
        Otherwise the plan would be a step with no work whose update reads them (aligned
        speculative windows: every other step)."""
        if self._unread is None or self._seat_wanted():
            return
        if all(self.decode.awaits_tokens(r) for r in self.running):
            self._read_tokens(*self._unread)
            self._unread = None

    def _read_run(self) -> None:
        """Wait for the results of the device run queued last, if any, and apply them."""
        if self._unread_run is None:
            return
        (batch, output), self._unread_run = self._unread_run, None
        results = output.read_run()
        self._note(t.request_id for t in batch.requests[: len(results)])
        self._apply_run(batch, results)

    def _advance(self, batch: ExecutionBatch, decode_gate_logits: tuple[float, ...]) -> None:
        """The step's loops over decode tokens: their depths and exit decisions
        (`decode_gate_logits`: of the rows that `reads_gate`, in plan order). Needs no sampled
        token, so the next step can be scheduled before they are read back."""
        gates = iter(decode_gate_logits)
        for task in batch.requests:
            if task.kind is RowKind.PREFILL or batch.decode_run is not None:
                continue  # (a device run's rows advance when its tokens are read back)
            gate = next(gates) if task.reads_gate else None
            req = self.requests.get(task.request_id)
            if req is not None and req.decode is not None:
                self._after_loops(req, gate, batch.loop_count)
            elif req is not None and req.spec is not None:
                self.spec.advance(req.spec, batch.loop_count)

    def _start_decoding(self, req: Request) -> None:
        """After the prefill: the first token comes from the prompt's last depth; a resumed request
        instead feeds back its newest output token, as before it was preempted."""
        if not req.output_token_ids:
            req.ready_loops = req.prompt_loops(self.num_loops)
            return
        index = len(req.output_token_ids) - 1
        token = DecodeToken(position=req.prefill_len, index=index)
        self.decode.start(req, token, len(self.decode.decoding(self.running)))

    def _apply_tokens(self, batch: ExecutionBatch, sampled: dict) -> None:
        """The tokens `batch` sampled (request_id -> SampledToken; VerifySample -> the accepted
        tokens), oldest unread first: stop checks; a request that finished meanwhile ignores its
        later tokens."""
        for req_id in batch.sample_req_ids:
            req = self.requests.get(req_id)
            if req is not None and req.pending_exit_depths:
                self._append_token(req, sampled[req_id])
        for verify in batch.verifies:
            req = self.requests.get(verify.request_id)
            if req is not None and req.spec is not None and req.spec.verified:
                self._accept(req, sampled[verify])

    def _apply_run(self, batch: ExecutionBatch, results) -> None:
        """A device run's tokens and its rows' final states (`RunRowResult` per task, after the
        step's own samples were applied)."""
        if batch is self._flight:
            self._flight = None
        self.runs.record(batch.decode_run, results)
        self._run_ended = set()
        for task, result in zip(batch.requests[: len(results)], results, strict=True):
            req = self.requests.get(task.request_id)
            if req is not None:
                self.runs.apply(req, result, self._append_token)
                if req.status.finished:  # a stop token or max_tokens: the device stopped it too
                    self._run_ended.add(req.request_id)

    @staticmethod
    def drop_outputs(req: Request, num_tokens: int) -> None:
        """Keep `req`'s first `num_tokens` output tokens: a stop string ended it within tokens
        that came back together; the rest never reach a client."""
        del req.output_token_ids[num_tokens:]
        del req.output_exit_depths[num_tokens:]
        del req.output_logprobs[num_tokens:]

    def _accept(self, req: Request, tokens) -> None:
        """A verified window's tokens (accepted drafts, then the target's token): appended up to
        a stop; the KV of the positions after them is dropped, and the newest token loops next
        (a preempted request gets it when it resumes)."""
        window, req.spec = req.spec, None
        self.spec.record(window, len(tokens))
        for token in tokens:
            req.pending_exit_depths.append(self.num_loops)
            self._append_token(req, token)
            if req.status.finished:
                return
        if req.status is RequestStatus.RUNNING:
            self.kv.truncate(req.request_id, req.num_tokens - 1)
            token = DecodeToken(position=req.num_tokens - 1, index=req.num_sampled - 1)
            self.decode.start(req, token, len(self.decode.decoding(self.running)))

    def _append_token(self, req: Request, sampled) -> None:
        req.output_token_ids.append(sampled.token_id)
        req.output_exit_depths.append(req.pending_exit_depths.pop(0))
        if req.sampling_params.logprobs is not None:
            req.output_logprobs.append(sampled.logprobs())
        params, tok = req.sampling_params, sampled.token_id
        if not params.ignore_eos and tok in req.eos_token_ids or tok in params.stop_token_ids:
            req.stop_reason = tok
            self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        elif len(req.output_token_ids) >= params.max_tokens:
            self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)

    def _after_loops(self, req: Request, gate_logit: float | None, loops: int) -> None:
        """A decode token ran `loops` loops (more than one only when no decision fell due)."""
        tok = req.decode
        tok.loops_done += loops
        if not self.exit_policy.should_exit(tok, req.exit, gate_logit):
            return
        req.decode = None
        req.ready_loops = tok.loops_done
        if tok.loops_done < self.kv.num_loop_planes:
            self._exits.append((req.request_id, tok.position, tok.loops_done - 1))
