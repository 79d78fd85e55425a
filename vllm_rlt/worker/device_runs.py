"""Device runs: decode rows that cross token boundaries on the device (docs/design/runner.md §7).

A run (`DecodeRun`, planned by `core/sched/device_runs.py`) is `loop_count` invocations over the
same R decode rows with no host decision between them. The rows' state lives in persistent
device buffers (`RunState`): each token's loops, the exit rule's running product, its position and
output count. Two functions of fixed shape advance it, all on the device, their bookkeeping in the
kernels of `kernels/run_rows.py` (off CUDA, their torch form `run_rows_torch.py`):

- **sample** (only before the invocations where the plan's `sample_at` says a token may have
  exited, and after the last): the coda and the sampler over every row; rows whose token exited
  take the token (the sampler's counter is the row's output count, so it is the token the host
  path samples), count it, stop at max_tokens or a stop token, and otherwise start the next token
  at depth 0 one position on;
- **step**: rows at depth 0 take the prelude of their newest token, every live row runs one loop
  at its own depth (plane, position and KV slot computed from its block tables), then the exit
  rule (`ouro`, `ouro_delayed`, `trace`: the host's rules of `core/sched/exit_policy.py`, the CDF
  in fp64) runs on the gate, and an exit that skipped planes fills them with its last K/V
  (LAST_EXITED).

On CUDA each function runs eagerly the first time for a row count (and sampling variant), which
compiles its kernels, and is captured as a CUDA graph right after; from then on a call costs the
host one graph replay. The tokens, their exit depths and logprobs and the rows' final state
are read back once, after the run (`RunRowResult`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.core.sched.execution_batch import DecodeRun, ExecutionBatch, RunRowResult
from vllm_rlt.kernels import run_rows
from vllm_rlt.tensor_utils import read_back
from vllm_rlt.worker import run_rows_torch
from vllm_rlt.worker.edge_stages import PlainEdges
from vllm_rlt.worker.hidden_state import HiddenStateStore
from vllm_rlt.worker.invocation_timer import InvocationTimer, detailed_shape, invocation_shape
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.run_state import RunState
from vllm_rlt.worker.sampler import SamplingTensors, host_tokens, sample
from vllm_rlt.worker.spec_windows import WindowTokens


@dataclass(frozen=True)
class RunMirror:
    """What the runner holds of a run row's request."""

    slot: int  # its hidden-state and token slot
    params: object  # its sampling settings (NewRequestData)
    block_tables: tuple[tuple[int, ...], ...]  # per plane


class DeviceRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: DeviceKVCache, states: HiddenStateStore,
                 windows: WindowTokens, state: RunState, num_planes: int, tile_rows: int,
                 max_context: int, capture: bool):  # fmt: skip
        """`state`: the runs' buffers; `num_planes`: the loops' KV planes (1: SHARED, nothing to
        fill); `max_context`: positions a row may reach (sizes the attention's KV splits);
        `capture`: record the run's functions as CUDA graphs."""
        self.model = model
        self.kv_cache = kv_cache
        self.states = states
        self.windows = windows
        self.edges = PlainEdges(model)
        self.num_planes = num_planes
        self.tile_rows = tile_rows
        self.max_context = max_context
        self.block_size = kv_cache.block_size
        self.scratch = kv_cache.scratch_block * kv_cache.block_size
        self.state = state
        # the bookkeeping's kernels on CUDA, their torch form elsewhere
        self.ops = run_rows if kv_cache.kv.is_cuda else run_rows_torch
        backends = [m.backend for m in model.modules() if hasattr(m, "backend")]
        # the torch reference backend loops over host copies of the segment tables
        self.host_tables = not all(getattr(b, "supports_cuda_graphs", False) for b in backends)
        self.capture = capture and not self.host_tables
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def run(self, batch: ExecutionBatch, mirrors: Sequence[RunMirror],
            timer: InvocationTimer | None) -> Callable[[], tuple[RunRowResult, ...]]:  # fmt: skip
        """Queue the batch's run over its rows (`mirrors`, in plan order; `timer`: times each
        invocation); returns a callable that waits for its read-back and gives each row's
        result."""
        run, n = batch.decode_run, batch.loop_count
        params = [m.params for m in mirrors]
        tensors = self.state.load(run, mirrors, self.states)
        r = len(mirrors)
        flags = (tensors.all_greedy, tensors.any_top_k_top_p, tensors.num_logprobs)
        meta = None if self.host_tables else self._metadata(r)
        newest = max(row.position for row in run.rows)  # (the timer's key)
        for i in range(n + 1):
            if run.sample_at[i]:
                self._call(("sample", r, *flags), lambda: self._sample(r, tensors))
            if i < n:
                with self._timed(timer, r, newest):
                    self._call(("step", r, run.exit_mode), lambda: self._step(r, run, meta))
        s = self.state
        phases = sum(run.sample_at)
        copied = read_back(
            s.tokens[:phases, :r], s.sampled[:phases, :r], s.depths[:phases, :r],
            *s.logprob_views(tensors.num_logprobs, phases, r), s.loops[:r], s.remaining[:r],
            s.exit_at[:r], s.ready[:r],
        )  # fmt: skip
        return lambda: _results(copied(), [p.num_logprobs for p in params])

    def _call(self, key: tuple, fn: Callable[[], None]) -> None:
        """Run `fn` (in place over the state buffers): eagerly the first time, which compiles
        its kernels, and captured as a CUDA graph right after (capture runs nothing); later
        calls replay the graph. Without capture, always eagerly."""
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        fn()
        if not self.capture:
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        self._graphs[key] = graph

    def _sample(self, r: int, tensors: SamplingTensors) -> None:
        """The coda and the sampler over every row; rows whose token exited take theirs and
        their next token starts."""
        s = self.state
        logits = self.edges.logits(self.states.buffer[s.state_rows[:r]], [])
        out = sample(logits, tensors)
        s.record_logprobs(r, out)
        self.ops.take_tokens(s, r, out.token_ids, self.windows.tokens)

    def _step(self, r: int, run: DecodeRun, meta: AttentionMetadata | None) -> None:
        """One loop of every live row at its depth, then the exit rule on its gate and, with
        several loop planes, the fill of the planes exited tokens skip (`meta`: the
        invocation's static tables; None: built now)."""
        s = self.state
        entry = self.edges.enter(self.windows.tokens[s.slots[:r], 0], s.position[:r], [])
        self.ops.enter_rows(s, r, entry, self.states.buffer, self.scratch, self.block_size)
        out, gate = self.model.recurrent_core(
            s.hidden[:r], meta or self._metadata(r), self.kv_cache
        )
        self.ops.exit_rows(s, r, run.exit_mode, gate, out, self.states.buffer)
        if self.num_planes > 1:
            self.ops.fill_skipped(s, r, self.kv_cache)

    def _metadata(self, r: int) -> AttentionMetadata:
        """One-row segments of the first `r` rows over the state's static tables (with host
        copies of their positions for a backend that reads those: then built for each step)."""
        s = self.state
        host_starts = tuple(s.position[:r].tolist()) if self.host_tables else ()
        return AttentionMetadata(
            block_size=self.block_size, positions=s.position[:r], slot_mapping=s.slot_mapping[:r],
            seg_row_starts=s.ids[: r + 1], seg_token_starts=s.seg_starts[:r],
            block_tables=s.meta_tables[:r], tile_rows=self.tile_rows, tile_seg=s.ids[:r],
            tile_row_start=s.ids[:r], tile_num_rows=s.ones[:r],
            seg_row_starts_host=tuple(range(r + 1)), seg_token_starts_host=host_starts,
            max_context=self.max_context, tile_order=s.ids[:r], num_one_row_tiles=r,
            max_tile_rows=1,
        )  # fmt: skip

    @staticmethod
    def _timed(timer: InvocationTimer | None, rows: int, position: int):
        """Times an invocation of the run's `rows` (all decode rows; by context: keyed by the
        newest position at the run's start) while a timer is attached."""
        if timer is None:
            return contextlib.nullcontext()
        if timer.by_context:
            return timer.time(detailed_shape(rows, rows, None, 0, position))
        return timer.time(invocation_shape(rows, rows, None))


def _results(copied, wants: list[int]) -> tuple[RunRowResult, ...]:
    """Each row's tokens (phases where it sampled) and final state, from the read-back."""
    tokens, sampled, depths, logprobs, logprob_ids, loops, remaining, exit_at, ready = copied
    results = []
    for r, want in enumerate(wants):
        phases = np.flatnonzero(sampled[:, r].numpy())
        ids = tokens[phases, r].tolist()
        lps = None if logprobs is None else logprobs[phases, r].tolist()
        lp_ids = None if logprob_ids is None else logprob_ids[phases, r].tolist()
        toks = host_tokens(ids, lps, lp_ids, [want] * len(ids))
        results.append(
            RunRowResult(
                sampled=tuple(zip(toks, depths[phases, r].tolist(), strict=True)),
                loops_done=int(loops[r]),
                remaining=float(remaining[r]),
                exit_at=int(exit_at[r]),
                ready=bool(ready[r]),
            )
        )
    return tuple(results)
