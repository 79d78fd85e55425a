"""The synchronous engine: `add_request`, `step`, `abort_request`.

A step is `schedule -> execute -> update -> emit` (docs/design/architecture.md §3); the
engine adds validation and output processing around it, never scheduling logic.

With async scheduling (the default) a step queues its work on the device and advances the
scheduler by its loops, then reads back the tokens the previous step sampled: by then the device
has long produced them, so the host does not wait, and the next step is scheduled while this one
runs. A request that stopped on a token is noticed one step late; the work queued for it in
that step is discarded (its token is never read), and its KV blocks, freed then, are handed out
only to work queued after it on the same stream.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import torch

from vllm_rlt.config import EngineConfig
from vllm_rlt.core.sched.execution_batch import SampledToken
from vllm_rlt.engine.assembly import assemble
from vllm_rlt.engine.output_processor import OutputProcessor
from vllm_rlt.engine.stats import EngineSnapshot, EngineStats, KVCapacity
from vllm_rlt.kernels import native
from vllm_rlt.models.loader import LoadedModel
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.request import ExitSettings, Request, RequestStatus
from vllm_rlt.sampling_params import SamplingParams, check_text

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded`: an already loaded model to serve (benchmarks compare scheduler settings on
        one set of weights); by default the engine loads `config.model`. The parts are built by
        `assembly.assemble`."""
        self.config = config
        parts = assemble(config, loaded)
        self.model_dir = parts.model_dir
        self.model, self.model_config = parts.loaded.model, parts.loaded.config
        self.tokenizer = parts.loaded.tokenizer
        self.num_loops = self.model.num_loops
        self.kv_manager = parts.kv_manager
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.handoff = parts.handoff  # PD's seam
        self.max_model_len = parts.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(config.model.seed)  # seeds for requests that give none
        self.stats = EngineStats()
        eos = self.model_config.eos_token_id
        self.eos_token_ids = (
            tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        )
        logger.info("engine: %s", self.settings_summary())

    def settings_summary(self) -> str:
        """What the engine runs with besides its KV cache (scheduling, CUDA graphs, exits): the
        start log line, the server's among them."""
        sc, ex = self.config.scheduler, self.config.exit
        threshold = ex.exit_threshold
        if threshold is None:
            threshold = self.model_config.early_exit_threshold
        runs, wcpb = self.scheduler.runs, "on" if sc.wavefront_chunked_prefill else "off"
        return (
            f"{sc.scheduling_mode} scheduling, WCPB {wcpb}"
            f", chunk {sc.prefill_chunk_size or sc.max_num_batched_tokens}, budget "
            f"{sc.max_num_batched_tokens} tokens, {sc.max_num_seqs} sequences; CUDA graphs "
            f"{'off' if self.runner.graphs is None else 'on'}; exits {ex.exit_mode} at threshold "
            f"{1.0 if threshold is None else threshold}, "
            + (f"device runs of up to {runs.max_loops} invocations" if runs.enabled
               else "decided on the host")
            + f"; {native.report(self.runner.device)}"
        )  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        exit_trace: list[int] | None = None,
    ) -> None:
        """Queue a request; bad input raises ValueError naming the field (nothing is queued)."""
        params = params or SamplingParams()
        if params.init_scale is None:
            params = dataclasses.replace(params, init_scale=self.config.model.init_scale)
        text, ids = self._prompt_ids(prompt)
        self._validate(ids, params)
        if request_id in self.scheduler.requests or self.outputs.children(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        settings = self._exit_settings(params, exit_trace)
        if self.scheduler.spec is not None and (
            settings.threshold < 1.0 or settings.max_loops != self.num_loops
        ):
            raise ValueError(
                "exit_threshold, max_loops: speculative decoding (num_speculative_tokens > 0) "
                f"needs fixed depth; leave exit_threshold at 1 and max_loops at {self.num_loops}"
            )
        children = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        now = time.monotonic() if arrival_time is None else arrival_time
        reqs = [
            Request(
                child,
                list(ids),
                params,
                settings,
                self._seeds.getrandbits(62) if params.seed is None else params.seed + i,
                self.eos_token_ids,
                now,
                priority,
            )
            for i, child in enumerate(children)
        ]
        if params.prompt_logprobs is not None:  # (the samples share the prompt: one scores it)
            reqs[0].prompt_logprobs = [None] * len(ids)
        # everything above may fail; nothing below does, so a request is queued whole or not at all
        self.outputs.add(request_id, text, ids, children)
        for req in reqs:
            self.scheduler.add_request(req)

    def prefilled_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int
    ) -> Request:
        """A request (one sample, `seed` drawn by the engine that prefills it) whose prompt
        another engine prefills (a prefill/decode import, `import_prefilled`); validated, not
        queued. ValueError as `add_request`."""
        self._validate(prompt_ids, params)
        if params.n != 1:
            raise ValueError("n: a disaggregated server runs one sample per request (n=1)")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: a disaggregated server scores no prompt tokens")
        if request_id in self.scheduler.requests or self.outputs.children(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        settings = self._exit_settings(params, None)
        return Request(
            request_id, list(prompt_ids), params, settings, seed, self.eos_token_ids,
            time.monotonic(),
        )  # fmt: skip

    def import_prefilled(self, req: Request, first: SampledToken) -> list[RequestOutput]:
        """Start decoding `req`, whose blocks hold its whole prompt's KV (imported), from its
        first token; returns the output carrying that token."""
        self.outputs.add(req.request_id, None, req.prompt_token_ids, [req.request_id])
        self.scheduler.add_prefilled(req, first)
        return self._emit([(req, 0)])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples) in any state; its KV is freed at once. Returns its
        final output (finish_reason "abort"), or None for an unknown or finished request."""
        final = None
        for child in self.outputs.children(request_id):
            self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
            self.outputs.finish(child, RequestStatus.FINISHED_ABORTED)
            final = self.outputs.collect([child])[0]
        return final

    def stats_dict(self) -> dict[str, float]:
        """`EngineStats.as_dict()` and, with speculation, the speculative counters and ratios
        (`Scheduler.spec_stats()`)."""
        return {**self.stats.as_dict(), **self.scheduler.spec_stats()}

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters now (read between steps)."""
        return EngineSnapshot.of(self.scheduler, self.kv_manager, self.stats_dict())

    def kv_capacity(self) -> KVCapacity:
        kv = self.kv_manager
        return KVCapacity(
            kv.num_total_blocks, kv.block_size, kv.num_planes, kv.max_tokens_per_request()
        )

    def kv_amax(self) -> list[tuple[float, float]]:
        """Per layer, the largest |K| and |V| the KV cache holds now (FP8 scale calibration)."""
        return self.runner.kv_cache.amax()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: text needs a tokenizer; this model has none, pass token ids"
                )
            check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt).ids
        return None, list(prompt)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        c = self.model_config
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < c.vocab_size]
        if bad:
            raise ValueError(
                f"prompt has token ids outside the vocabulary [0, {c.vocab_size}): {bad[:5]}"
            )
        params.validate_for_model(self.num_loops, c.vocab_size)
        threshold = params.exit_threshold
        if not self.model.has_exit_gate and threshold is not None and threshold < 1:
            raise ValueError(
                f"exit_threshold={threshold} needs an exit gate, which this model does not have "
                "(every token runs max_loops loops)"
            )
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )

    def _exit_settings(self, params: SamplingParams, trace: list[int] | None) -> ExitSettings:
        default = self.config.exit.exit_threshold
        if default is None:
            default = self.model_config.early_exit_threshold
        threshold = params.exit_threshold if params.exit_threshold is not None else default
        max_loops = params.max_loops or self.num_loops
        return ExitSettings(
            min_loops=params.min_loops or 1,
            max_loops=max_loops,
            threshold=1.0 if threshold is None else threshold,
            trace=tuple(trace) if trace is not None else None,
            prompt_loops=max_loops if self.model.prompt_runs_max_loops else None,
        )

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update, emit: queue one step on the device and return the outputs
        of the tokens the scheduler read back in it (`Scheduler.update` says which: with async
        scheduling, the previous step's)."""
        batch = self.scheduler.schedule()
        output = self.runner.execute(batch)
        self.stats.record_batch(batch, self.num_loops)
        return self._emit(self.scheduler.update(batch, output))

    def _emit(self, got: list[tuple[Request, int]]) -> list[RequestOutput]:
        """Outputs of the requests that got tokens (each with its output count before them):
        detokenization and stop strings end them here; of several tokens that came back
        together, those after the one that completes a stop string are dropped."""
        for req, first in got:
            try:  # detokenization, stop strings, logprobs: work of this request alone
                hit = self.outputs.process(req)
                if hit is not None and len(req.output_token_ids) - first > 1:
                    self.scheduler.drop_outputs(req, self.outputs.stop_prefix(req, first))
                    hit = self.outputs.process(req)
            except Exception:
                self._fail_request(req.request_id)
                continue
            for depth in req.output_exit_depths[first:]:
                self.stats.record_token(depth)
            if hit is not None and not req.status.finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        return self.outputs.collect([req.request_id for req, _ in got])

    def _fail_request(self, req_id: str) -> None:
        """End one request whose own processing raised (finish_reason "error", its KV freed);
        every other request goes on."""
        logger.exception("request %s failed; it ends with finish_reason 'error'", req_id)
        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ERROR)
        self.outputs.finish(req_id, RequestStatus.FINISHED_ERROR)

    @torch.inference_mode()
    def generate_all(self) -> list[RequestOutput]:
        """Step until every request finished; returns the final outputs in finishing order."""
        finished = []
        while self.has_unfinished_requests():
            finished += [o for o in self.step() if o.finished]
        return finished
