"""The model runner: the only owner of device tensors (weights, KV, hidden states).

It mirrors what it needs of each request from the plans (prompt, block tables, sampling
settings, hidden-state slot) and never reads the scheduler's `Request`. A step applies the
skipped-depth KV copies, samples the requests the plan names (coda of their state), then runs
`loop_count` recurrent-core invocations, each after the speculative windows' draft tokens due
before it and each one gathered call over all live rows as they run in it (a drafting window's
row moves to its next position within the step): replayed as a CUDA graph when a bucket admits
it (decode rows, prefill chunks, mixed; `worker/cuda_graph.py`, whose static buffers are loaded
afresh for every invocation), eagerly otherwise; then it accepts the windows verified in the
step. Entering rows' prelude, the coda of prompt rows whose loops are done, and the scatter of
the outputs run outside the graph, through the model's `worker/edge_stages.py` strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_rlt.attention.metadata import TILE_ROWS, build_attention_metadata
from vllm_rlt.core.sched.execution_batch import (
    DraftSample,
    ExecutionBatch,
    NewRequestData,
    RowKind,
    SampledToken,
    StateSpan,
    StepOutput,
)
from vllm_rlt.sampling_params import penalized
from vllm_rlt.tensor_utils import read_back, to_device
from vllm_rlt.worker.cuda_graph import CudaGraphRunner, StaticInvocation
from vllm_rlt.worker.device_runs import DeviceRunner, RunMirror, RunRows
from vllm_rlt.worker.edge_stages import EdgeSegment, edge_stages_for
from vllm_rlt.worker.hidden_state import HiddenStateStore
from vllm_rlt.worker.invocation_timer import InvocationTimer, detailed_shape, invocation_shape
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.penalties import PenaltyState
from vllm_rlt.worker.prompt_logprobs import Pick, PromptLogprobs
from vllm_rlt.worker.sampler import SamplingTensors, host_tokens, sample
from vllm_rlt.worker.spec_windows import WindowTokens


@dataclass
class _Mirror:
    data: NewRequestData
    slot: int
    block_tables: tuple[tuple[int, ...], ...] = ()
    position: int = -1  # position of the token whose state the decode row holds

    def segment(self, token_start: int, num_tokens: int) -> EdgeSegment:
        data = self.data
        return EdgeSegment(token_start, num_tokens, self.block_tables, data.seed, data.init_scale)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: DeviceKVCache,
        states: HiddenStateStore,
        windows: WindowTokens,
        num_planes: int,
        graphs: CudaGraphRunner | None = None,
        tile_rows: int = TILE_ROWS,
        runs: DeviceRunner | None = None,
        penalties: PenaltyState | None = None,
    ):
        """`states`: the hidden-state buffer (a slot per running request; the engine allocates
        it before sizing the KV cache); `windows`: the tokens that enter decode rows and the
        speculative windows' state (allocated likewise); `num_planes`: the KV planes of the
        loops (the model's edge planes follow them); `graphs`: runs the invocations its
        buckets admit over static buffers (None: all eager); `tile_rows`: rows per multi-row
        attention tile of eager invocations (the graph runner's own); `runs`: runs the plans'
        device runs (None: the plans have none); `penalties`: what the penalties read (the
        device runs' too; None: allocated here)."""
        self.model = model
        self.graphs = graphs
        self.tile_rows = tile_rows
        self.kv_cache = kv_cache
        self.num_planes = num_planes
        self.num_loops = model.num_loops
        self.device = kv_cache.kv.device
        self.states = states
        self.reqs: dict[str, _Mirror] = {}
        self.windows = windows
        self.edges = edge_stages_for(model, kv_cache, num_planes, tile_rows)
        self.runs = runs
        vocab_size = model.lm_head.weight.shape[0]
        self.penalties = penalties or PenaltyState(states.max_num_seqs, vocab_size, self.device)
        self.prompt_logprobs = PromptLogprobs(self.edges, self.device)
        # benchmarks attach one to time each recurrent-core call by its shape
        self.timer: InvocationTimer | None = None
        # `vllm-rlt inspect` and the model tests attach one (`plan_driver.py`) to see each
        # invocation's output states [R, S] and gate logits [R] (rows in plan order; a graph's
        # outputs, overwritten by its next replay)
        self.observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    @torch.inference_mode()
    def execute(self, batch: ExecutionBatch) -> StepOutput:
        self._sync_mirrors(batch)
        if batch.kv_copies:
            pairs = to_device(batch.kv_copies, torch.int64, self.device)
            self.kv_cache.copy_slots(pairs[:, 0], pairs[:, 1])
        sampled = self._sample(batch.sample_req_ids, batch.sample_indices)
        if batch.decode_run is not None:
            return StepOutput((), sampled, self._run(batch), self.prompt_logprobs.take())
        drafts: dict[int, list[DraftSample]] = {}
        for d in batch.drafts:
            drafts.setdefault(d.invocation, []).append(d)
        # rows that read their gate come in one-loop batches; the gates are gathered right after
        # invocation 0 (a later invocation may replay the same graph over its outputs)
        starts = np.cumsum([0] + [t.num_tokens for t in batch.requests])
        gate_rows = [starts[j] for j, t in enumerate(batch.requests) if t.reads_gate]
        read_gates = None
        for i in range(batch.loop_count):
            if i in drafts:
                self._draft(drafts[i])
            gates = self._invoke(batch, i)
            if gates is None:
                break
            if i == 0 and gate_rows:
                read_gates = gates[gate_rows]
        # the step's only waits for the GPU: gates an exit decision needs, and (when the caller
        # asks) sampled tokens
        decode_gates = read_gates.tolist() if read_gates is not None else []
        if batch.verifies:
            sampled = _merged(sampled, self._verify(batch))
        return StepOutput(tuple(decode_gates), sampled, None, self.prompt_logprobs.take())

    def _run(self, batch: ExecutionBatch) -> Callable[[], tuple]:
        """Queue the batch's device run over its first tasks; with prefill tasks after them, the
        run's rows ride each of the prefill batch's invocations (a run beside prefill)."""
        tasks = batch.requests[: len(batch.decode_run.rows)]
        mirrors = [self.reqs.get(t.request_id) for t in tasks]
        live = next(m for m in mirrors if m is not None)
        # a carried run's row whose request ended (forgotten): stopped on the device, it reads
        # what it is given and writes nothing
        stopped = RunMirror(0, live.data, ((),) * len(live.block_tables))
        rows = [RunMirror(m.slot, m.data, m.block_tables) if m else stopped for m in mirrors]
        if len(tasks) == len(batch.requests):
            return self.runs.run(batch, rows, self.timer)
        return self.runs.run(batch, rows, self.timer, lambda i, run: self._invoke(batch, i, run))

    def _draft(self, drafts: list[DraftSample]) -> None:
        """Draft tokens of windows: each from the state of the window position before it."""
        mirrors = [self.reqs[d.request_id] for d in drafts]
        self.windows.draft(
            drafts,
            [m.slot for m in mirrors],
            [
                self.states.ring_row(m.slot, d.offset - 1)
                for m, d in zip(mirrors, drafts, strict=True)
            ],
            [m.data for m in mirrors],
            self.model.coda,
            self.states.buffer,
        )

    def _verify(self, batch: ExecutionBatch):
        """The acceptance of the windows verified in this step; returns its read-back."""
        mirrors = [self.reqs[v.request_id] for v in batch.verifies]
        return self.windows.verify(
            batch.verifies,
            [m.slot for m in mirrors],
            [self.states.ring_row(m.slot, 0) for m in mirrors],
            [m.data for m in mirrors],
            self.model.coda,
            self.states.buffer,
        )

    def _sync_mirrors(self, batch: ExecutionBatch) -> None:
        for req_id in batch.finished_req_ids:
            mirror = self.reqs.pop(req_id, None)
            if mirror is not None:
                self.states.release(mirror.slot)
        for data in batch.new_requests:
            slot = self.states.allocate(data.ring_slots * data.chunk_size)
            self.reqs[data.request_id] = _Mirror(data, slot)
            self.penalties.admit(slot, data)
            if data.resume_token is not None:
                self.windows.tokens[slot, 0] = data.resume_token
        for req_id, tables in batch.block_tables:
            self.reqs[req_id].block_tables = tables

    def _sample(self, req_ids: tuple[str, ...], indices: tuple[int, ...]):
        """Coda + sampling for `req_ids` (`indices`: the output index of each token); the tokens
        become the requests' newest (`WindowTokens`). Returns a callable that converts them to
        host results (the step's one read-back: it waits for the sampling, not for the
        invocations queued after it)."""
        if not req_ids:
            return dict
        mirrors = [self.reqs[r] for r in req_ids]
        slots = to_device([m.slot for m in mirrors], torch.int64, self.device)
        rows = to_device(
            [self.states.decode_row(m.slot) for m in mirrors], torch.int64, self.device
        )
        segments = [m.segment(m.position, 1) for m in mirrors]
        logits = self.edges.logits(self.states.buffer[rows], segments)
        params = [m.data for m in mirrors]
        num_logprobs = max(p.num_logprobs for p in params)
        seen = self.penalties.rows(slots) if any(map(penalized, params)) else None
        tensors = SamplingTensors.of(params, list(indices), num_logprobs, self.device, seen)
        out = sample(logits, tensors)
        self.windows.set_newest(slots, out.token_ids)
        if seen is not None:
            self.penalties.count(slots, out.token_ids)
        # the copies start now, ahead of the step's invocations, which go on while the host waits
        copied = read_back(out.token_ids, out.logprobs, out.logprob_token_ids)
        wants = [p.num_logprobs for p in params]  # the mirrors may be gone when read back

        def to_host() -> dict[str, SampledToken]:
            ids, lps, lp_ids = (None if t is None else t.tolist() for t in copied())
            return dict(zip(req_ids, host_tokens(ids, lps, lp_ids, wants), strict=True))

        return to_host

    @torch.inference_mode()
    def coda_logits(self, req_id: str, states: torch.Tensor, token_start: int) -> torch.Tensor:
        """Logits [n, V] of final states [n, S] of `req_id`'s positions from `token_start`,
        through the coda as sampling runs it (a coda with attention writes their K/V)."""
        return self.edges.logits(states, [self.reqs[req_id].segment(token_start, len(states))])

    def _invoke(self, batch: ExecutionBatch, i: int, run: RunRows | None = None):
        """Invocation `i` of the batch over its live rows (rows in plan order, at their position
        and depth in that invocation); returns their gate logits [R] fp32, or None when no row
        is live. `run`: a device run's rows (the batch's first tasks) ride it, at their head."""
        live = batch.live(i, self.num_loops)
        run_tasks = len(batch.decode_run.rows) if run is not None else 0
        if len(live) == run_tasks:
            return None
        riders = run.num_rows if run is not None else 0  # (idle rows pad a run's rows)
        starts, counts, tables, rows = run.placeholders() if run is not None else ([], [], [], [])
        # prompt rows entering through the prelude
        prompt_rows, prompt_tokens, prompt_segs = [], [], []
        # decode and window rows entering: (slot, window offset) of their token
        decode_rows, decode_slots, decode_offsets, decode_segs = [], [], [], []
        done_src, done_dst = [], []  # last prompt row -> decode row when prefill completes
        finish_rows, finish_segs = [], []  # prompt rows past their last loop: their coda
        scored: list[Pick] = []  # prompt rows past their last loop that score a prompt token
        row = riders
        for t, depth in live[run_tasks:]:
            m = self.reqs[t.request_id]
            starts.append(t.token_start)
            counts.append(t.num_tokens)
            tables.append(m.block_tables[depth if self.num_planes > 1 else 0])
            rows.append(self._rows(t.state_span(), m))
            end = t.token_start + t.num_tokens
            prefill = t.kind is RowKind.PREFILL
            loops = t.loops or self.num_loops  # prefill rows: their last loop is loops - 1
            if depth == 0 and prefill:
                prompt_rows.extend(range(row, row + t.num_tokens))
                prompt_tokens.extend(m.data.prompt_token_ids[t.token_start : end])
                prompt_segs.append(m.segment(t.token_start, t.num_tokens))
            elif depth == 0:
                offset = t.prefill_hidden_row_offset or 0
                decode_rows.extend(range(row, row + t.num_tokens))
                decode_slots.extend([m.slot] * t.num_tokens)
                decode_offsets.extend(range(offset, offset + t.num_tokens))
                decode_segs.append(m.segment(t.token_start, t.num_tokens))
            if not prefill:
                m.position = end - 1
            elif self.edges.finishes:  # (per-row lists only for a model with coda blocks)
                for offset, n in self._finishing(m, t.token_start, t.num_tokens, depth, loops):
                    finish_rows.extend(range(row + offset, row + offset + n))
                    finish_segs.append(m.segment(t.token_start + offset, n))
            last_loop = prefill and depth == loops - 1
            n = self.prompt_logprobs.rows_of(m.data, t.token_start, t.num_tokens) * last_loop
            if n:
                scored.append((row, t.token_start, m.data, m.segment(t.token_start, n)))
            if last_loop and end == len(m.data.prompt_token_ids):
                done_src.append(row + t.num_tokens - 1)
                done_dst.append(self.states.decode_row(m.slot))
                m.position = end - 1
            row += t.num_tokens
        static, meta, index, hidden = self._core_inputs(starts, counts, tables, rows)
        if prompt_rows or decode_rows:
            tokens = to_device(prompt_tokens, torch.int64, self.device)
            if decode_rows:
                tokens = torch.cat(
                    [tokens, self.windows.entry_tokens(decode_slots, decode_offsets)]
                )
            entry = to_device(prompt_rows + decode_rows, torch.int64, self.device)
            segments = prompt_segs + decode_segs
            hidden[entry] = self.edges.enter(tokens, meta.positions[entry], segments)
        if run is not None:
            meta = run.ride(meta, hidden)
        with self._timed(live, row, static):
            if static is None:
                out, gate = self.model.recurrent_core(hidden, meta, self.kv_cache)
            else:
                out, gate = self.graphs.run(static)
        if run is not None:
            run.leave(out, gate)
        if self.observer is not None:
            self.observer(out, gate)
        self.states.buffer[index[riders:]] = out[riders:]
        if finish_rows:
            self.edges.finish(out, finish_rows, finish_segs)
        if scored:
            self.prompt_logprobs.score(out, scored)
        if done_src:
            src = to_device(done_src, torch.int64, self.device)
            self.states.buffer[to_device(done_dst, torch.int64, self.device)] = out[src]
        return gate

    def _finishing(self, m: _Mirror, start: int, count: int, depth: int, prompt_loops: int):
        """(row offset, rows) runs of the prefill rows [start, start + count) whose last loop is
        `depth`: prompt positions at their last depth (`prompt_loops` - 1), fed-back output
        positions (a resumed request's) at the depth they exited at before."""
        resumed = m.data.resumed_loops
        first_output = len(m.data.prompt_token_ids) - len(resumed)
        if not resumed or start + count <= first_output:
            return [(0, count)] if depth == prompt_loops - 1 else []
        loops = [
            prompt_loops if p < first_output else resumed[p - first_output]
            for p in range(start, start + count)
        ]
        return [(i, 1) for i, n in enumerate(loops) if n - 1 == depth]

    def _timed(self, live, rows: int, static: StaticInvocation | None):
        """Times the recurrent-core call over the `live` tasks (`rows` rows) by its shape while
        a `timer` is attached."""
        if self.timer is None:
            return contextlib.nullcontext()
        decode = [t for t, _ in live if t.kind is not RowKind.PREFILL]  # window rows: decode
        decode_rows = sum(t.num_tokens for t in decode)
        bucket = None if static is None else static.spec.num_rows
        if not self.timer.by_context:
            return self.timer.time(invocation_shape(decode_rows, rows, bucket))
        ends = [t.token_start + t.num_tokens for t, _ in live if t.kind is RowKind.PREFILL]
        prefill_end = max(ends, default=0)
        position = max((t.token_start for t in decode), default=0)
        return self.timer.time(detailed_shape(decode_rows, rows, bucket, prefill_end, position))

    def _core_inputs(self, starts, counts, tables, rows: list[np.ndarray]):
        """Metadata and gathered input rows of an invocation: in the graph runner's static
        buffers when it admits the invocation, else freshly built. Returns (the static
        invocation or None, metadata, state-row index [R], input hidden [R, H])."""
        state_rows = np.concatenate(rows)
        buffer = self.states.buffer
        static = self.graphs and self.graphs.prepare(starts, counts, tables, state_rows, buffer)
        if static is not None:
            return static, static.meta, static.index, static.hidden
        block_size = self.kv_cache.block_size
        meta = build_attention_metadata(
            starts, counts, tables, block_size, self.device, self.tile_rows
        )
        index = to_device(state_rows, torch.int64, self.device)
        return None, meta, index, buffer[index]

    def _rows(self, span: StateSpan, mirror: _Mirror) -> np.ndarray:
        """Flat hidden-state rows of a span: ring rows from the span's offset (prompt rows, a
        speculative window's rows), else the request's decode row."""
        offset = span.prefill_hidden_row_offset
        if offset is None:
            return np.array([self.states.decode_row(mirror.slot)])
        return self.states.ring_row(mirror.slot, offset) + np.arange(span.num_tokens)


def _merged(*reads: Callable[[], dict]) -> Callable[[], dict]:
    """One read-back callable from several (their results in one dict)."""
    return lambda: {k: v for read in reads for k, v in read().items()}
