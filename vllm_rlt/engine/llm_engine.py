"""The synchronous engine: `add_request`, `step`, `abort_request`.

A step is `schedule -> execute -> update` (docs/design/architecture.md §3) plus output
processing; the engine adds validation and bookkeeping around it, never scheduling logic.

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

from vllm_rlt.attention.metadata import tile_rows_for
from vllm_rlt.config import EngineConfig, KVLayout
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import ExecutionBatch, SampledToken, StepOutput
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.prefill_planner import make_planner
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.engine.kv_handoff import KVHandoff
from vllm_rlt.engine.kv_sizing import (
    kv_cache_dtype,
    log_kv_cache,
    plan_kv_blocks,
    resolve_max_model_len,
)
from vllm_rlt.engine.output_processor import OutputProcessor
from vllm_rlt.engine.stats import EngineSnapshot, EngineStats
from vllm_rlt.models import registry
from vllm_rlt.models.hub import resolve_model_dir
from vllm_rlt.models.loader import LoadedModel, load_model, read_config
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.request import ExitSettings, Request, RequestStatus
from vllm_rlt.sampling_params import SamplingParams, check_text
from vllm_rlt.worker.cuda_graph import CudaGraphRunner, graphs_supported
from vllm_rlt.worker.device_runs import DeviceRunner
from vllm_rlt.worker.graph_tables import graph_specs
from vllm_rlt.worker.hidden_state import HiddenStateStore
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.memory_profile import DeviceMemory, measure_device_memory
from vllm_rlt.worker.model_runner import ModelRunner
from vllm_rlt.worker.run_state import RunState
from vllm_rlt.worker.spec_windows import WindowTokens

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """`loaded`: an already loaded model to serve (benchmarks compare scheduler settings on
        one set of weights); by default the engine loads `config.model`."""
        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        # the model's directory (a hub id resolved): its chat template and tokenizer files
        self.model_dir = resolve_model_dir(mc.model, mc.revision, mc.download_dir)
        if loaded is None:
            model_dir = self.model_dir
            _, model_cls = registry.resolve(read_config(model_dir).model_type)
            config.check_model(model_cls)
            attention_backend, layer_kernels = mc.kernel_names()
            loaded = load_model(
                model_dir,
                dtype=mc.dtype,
                device=mc.device,
                load_format=mc.load_format,
                attention_backend=attention_backend,
                layer_kernels=layer_kernels,
                seed=mc.seed,
            )
        else:
            model_cls = type(loaded.model)
            config.check_model(model_cls)
        self.model, self.model_config, self.tokenizer = (
            loaded.model,
            loaded.config,
            loaded.tokenizer,
        )
        self.num_loops = self.model.num_loops
        weight = self.model.lm_head.weight
        c = self.model_config
        config.check_speculation(self.num_loops, c.early_exit_threshold)
        max_drafts = config.speculative.num_speculative_tokens
        # the loops' planes, then the planes of layers outside the loop (Huginn's prelude, coda)
        num_planes = KVLayout(cc.kv_layout).num_planes(self.num_loops) + self.model.num_edge_planes
        # everything that stays on the device besides the KV cache exists before it is sized
        planner = make_planner(sc, cc.kv_layout, self.num_loops)
        # a speculative window's rows use the ring once the prompt is done
        ring_rows = max(planner.ring_slots * planner.chunk_size, max_drafts + 1)
        states = HiddenStateStore(
            sc.max_num_seqs, ring_rows, self.model.state_size, weight.dtype, weight.device
        )
        windows = WindowTokens(sc.max_num_seqs, max_drafts, weight.shape[0], weight.device)
        # device runs: only for decode rows whose prelude and coda attend nothing
        run_state = None
        if sc.run_loops > 1 and not self.model.num_edge_planes:
            blocks = -(-(mc.max_model_len or c.max_position_embeddings) // cc.block_size)
            run_state = RunState(
                sc.max_num_seqs, sc.run_loops, weight.shape[0], num_planes, blocks,
                self.model.state_size, weight.dtype, weight.device,
            )  # fmt: skip
        tile_rows = tile_rows_for(planner.task_rows)
        specs = ()
        if not mc.enforce_eager and graphs_supported(self.model):
            segments = planner.expected_segments(sc.max_num_seqs)
            specs = graph_specs(sc.max_num_seqs, sc.max_num_batched_tokens, segments, tile_rows)

        def measure() -> DeviceMemory:  # graphs sized for the longest context a request may get
            max_context = mc.max_model_len or c.max_position_embeddings
            budget = sc.max_num_batched_tokens
            args = (budget, sc.max_num_seqs, cc.block_size, tile_rows, specs, max_context)
            return measure_device_memory(self.model, *args)

        kv_dtype = kv_cache_dtype(cc.kv_cache_dtype, weight.dtype, loaded.kv_scales)
        blocks = plan_kv_blocks(cc, c, num_planes, kv_dtype, weight.device, measure)
        num_blocks = blocks.num_blocks
        # a random initial state makes prompt KV depend on the request's seed: nothing to share
        prefix_caching = cc.enable_prefix_caching and not self.model.random_initial_state
        if cc.enable_prefix_caching and not prefix_caching:
            logger.info(
                "prefix caching is off: %s draws a random initial state per request, so prompt "
                "KV depends on the request's seed",
                type(self.model).__name__,
            )
        self.kv_manager = KVCacheManager(
            num_blocks,
            cc.block_size,
            cc.kv_layout,
            self.num_loops,
            prefix_caching,
            self.model.num_edge_planes,
        )
        per_plane = self.kv_manager.max_tokens_per_request()  # positions of one plane
        # the longest request (prompt + output positions) add_request accepts
        self.max_model_len = resolve_max_model_len(
            mc.max_model_len, c.max_position_embeddings, per_plane, blocks
        )
        log_kv_cache(blocks, per_plane, num_planes, self.max_model_len)
        kv_cache = DeviceKVCache.for_model(
            self.model, num_blocks, cc.block_size, kv_dtype, loaded.kv_scales
        )
        exit_policy = make_exit_policy(config.exit.exit_mode, config.exit.trace_seed)
        self.scheduler = Scheduler(
            sc,
            self.kv_manager,
            exit_policy,
            self.num_loops,
            atomic_prefill=self.model.requires_atomic_prefill,
            speculative=config.speculative,
            device_runs=run_state is not None,
            planner=planner,
        )
        graphs, runs = None, None
        max_context = min(self.max_model_len, per_plane)
        if specs:
            graphs = CudaGraphRunner(self.model, kv_cache, specs, max_context, tile_rows)
        loop_planes = self.kv_manager.num_loop_planes
        if run_state is not None:
            runs = DeviceRunner(self.model, kv_cache, states, windows, run_state, loop_planes,
                                tile_rows, max_context, capture=bool(specs))  # fmt: skip
            if specs:  # captured now: a first use mid-serving would stall every row
                runs.warm_up(config.exit.exit_mode)
        self.runner = ModelRunner(
            self.model, kv_cache, states, windows, loop_planes, graphs, tile_rows, runs
        )
        self.handoff = KVHandoff(self.scheduler, self.kv_manager, kv_cache)  # PD's seam
        self.outputs = OutputProcessor(self.tokenizer)
        # async scheduling: the last step's batch, its tokens not yet read back
        self._unread: tuple[ExecutionBatch, StepOutput] | None = None
        # a device run queued by the last step: its tokens are read before the next plan
        self._unread_run: tuple[ExecutionBatch, StepOutput] | None = None
        self._seeds = random.Random(mc.seed)  # seeds for requests that give none
        self.stats = EngineStats()
        eos = c.eos_token_id
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
        return self._emit([req])

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
        (`SpecPlanner.as_dict()`)."""
        spec = self.scheduler.spec
        return {**self.stats.as_dict(), **(spec.as_dict() if spec is not None else {})}

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters now (read between steps)."""
        return EngineSnapshot.of(self.scheduler, self.kv_manager, self.stats_dict())

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
        """Schedule and queue a step; returns the outputs of the tokens read back in it: this
        step's, or with async scheduling the previous step's. A device run's tokens come with
        the next step (which reads them before it plans: the plan needs its rows' states); the
        tokens sampled at its start, first tokens among them, with its own step; a run that
        goes on from the last one is queued before the last one's tokens are read."""
        outputs = []
        batch = self.scheduler.schedule()
        if batch is None:  # the plan needs the results of the run in flight
            outputs = self._read_run()
            batch = self.scheduler.schedule()
        launched = self.runner.execute(batch)
        self.stats.record_batch(batch, self.num_loops)
        self.scheduler.advance(batch, launched.decode_gate_logits)
        ready = (batch, launched)
        if batch.decode_run is not None:
            outputs += self._read_run()  # the run this one continues
            unread, self._unread, self._unread_run = self._unread, None, ready
            return (
                outputs + (self._read_tokens(*unread) if unread else []) + self._read_tokens(*ready)
            )
        if self.config.scheduler.async_scheduling:  # read the previous step's tokens instead
            ready, self._unread = self._unread, ready
        return outputs + (self._read_tokens(*ready) if ready is not None else [])

    def _read_tokens(self, batch: ExecutionBatch, launched: StepOutput) -> list[RequestOutput]:
        """Apply and emit a step's sampled tokens (several for a verified window)."""
        requests = self.scheduler.requests
        for req_id, scored in launched.read_prompt_logprobs().items():
            req = requests.get(req_id)
            if req is None:  # ended meanwhile
                continue
            for position, token in scored:
                req.prompt_logprobs[position] = token.logprobs()
        windows = [v.request_id for v in batch.verifies]
        before = {r: len(requests[r].output_token_ids) for r in windows if r in requests}
        return self._emit(self.scheduler.apply_tokens(batch, launched.read_tokens()), before)

    def _read_run(self) -> list[RequestOutput]:
        """Apply and emit the tokens of the device run queued by the last step, if any."""
        if self._unread_run is None:
            return []
        (batch, launched), self._unread_run = self._unread_run, None
        requests = self.scheduler.requests
        tasks = batch.requests[: len(batch.decode_run.rows)]
        rows = [t.request_id for t in tasks if t.request_id in requests]
        before = {r: len(requests[r].output_token_ids) for r in rows}
        return self._emit(self.scheduler.apply_run(batch, launched.read_run()), before)

    def _emit(
        self, touched: list[Request], before: dict[str, int] | None = None
    ) -> list[RequestOutput]:
        """Outputs of the requests that got tokens (stop strings end them here): one token
        each, or several for a verified window or a device run (`before`: its output count
        before them; of those, the tokens after the one that completes a stop string are
        dropped)."""
        before = before or {}
        for req in touched:
            first = before.get(req.request_id, len(req.output_exit_depths) - 1)
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
        return self.outputs.collect([r.request_id for r in touched])

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
