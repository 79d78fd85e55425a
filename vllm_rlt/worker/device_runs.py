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

A run beside prefill (the batch has prefill tasks after the run's rows) puts its rows at the head
of each of the prefill batch's invocations instead of the step (`RunRows.ride`: the model runner
builds that invocation with a placeholder segment per row, through its CUDA graphs where a
bucket admits it); its sample phases stay as they are.

The rows are padded with idle rows to a decode graph bucket (`padded`). On CUDA each function
runs eagerly the first time for a bucket (and sampling variant), which compiles its kernels, and
is captured as a CUDA graph right after (at startup for every bucket's step and greedy sample
phase, `warm_up`); from then on a call costs the host one graph replay. The tokens, their exit
depths and logprobs and the rows' final state are read back once, after the run
(`RunRowResult`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.core.sched.execution_batch import DecodeRun, ExecutionBatch, RunRowResult
from vllm_rlt.kernels import run_rows
from vllm_rlt.tensor_utils import read_back
from vllm_rlt.worker import run_rows_torch
from vllm_rlt.worker.edge_stages import PlainEdges
from vllm_rlt.worker.graph_tables import DECODE_BUCKETS, capped
from vllm_rlt.worker.hidden_state import HiddenStateStore
from vllm_rlt.worker.invocation_timer import InvocationTimer, detailed_shape, invocation_shape
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.penalties import PenaltyState
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
                 max_context: int, capture: bool, penalties: PenaltyState):  # fmt: skip
        """`state`: the runs' buffers; `num_planes`: the loops' KV planes (1: SHARED, nothing to
        fill); `max_context`: positions a row may reach (sizes the attention's KV splits);
        `capture`: record the run's functions as CUDA graphs; `penalties`: what the rows'
        penalties read (their output counts, which each sample phase adds to)."""
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
        self.penalties = penalties
        # the bookkeeping's kernels on CUDA, their torch form elsewhere
        self.ops = run_rows if kv_cache.kv.is_cuda else run_rows_torch
        backends = [m.backend for m in model.modules() if hasattr(m, "backend")]
        # the torch reference backend loops over host copies of the segment tables
        self.host_tables = not all(getattr(b, "supports_cuda_graphs", False) for b in backends)
        self.capture = capture and not self.host_tables
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.buckets = capped(DECODE_BUCKETS, state.slots.shape[0] // state.max_lanes)
        self._pool = None

    def run(self, batch: ExecutionBatch, mirrors: Sequence[RunMirror],
            timer: InvocationTimer | None, beside: Callable[[int, RunRows], None] | None = None,
            ) -> Callable[[], tuple[RunRowResult, ...]]:  # fmt: skip
        """Queue the batch's run over its rows (`mirrors`, in plan order; `timer`: times each
        invocation); returns a callable that waits for its read-back and gives each row's
        result. `beside(i, rows)`: the run rides the batch's prefill rows (a run beside
        prefill): it runs invocation `i` with the run's `rows` in it, eagerly."""
        run, n = batch.decode_run, batch.loop_count
        params, lanes = [m.params for m in mirrors], run.lanes
        r, padded = len(mirrors) * lanes, self.padded(len(mirrors)) * lanes
        tensors = self.state.load(run, mirrors, self.states, padded, self.windows.tokens)
        # riding a prefill batch, the run adds its own rows alone: the budget counted those
        ridden = r if beside is not None else padded
        rows = RunRows(self, ridden, run.exit_mode, self._static_metadata(ridden), lanes)
        newest = max(row.position for row in run.rows)  # (the timer's key)
        for i in range(n + 1):
            if run.sample_at[i]:
                self._sample(padded, tensors, run)
            if i < n and beside is not None:
                beside(i, rows)
            elif i < n:
                with self._timed(timer, padded, newest):
                    key = ("step", padded, run.exit_mode, lanes > 1)
                    self._call(key, lambda: self._step(rows))
        s = self.state
        phases = sum(run.sample_at)
        indices = counts = None
        if lanes > 1:
            self._settle(len(mirrors), lanes)
            indices, counts = s.indices[:phases, :r], s.counts[:, :r:lanes]
        copied = read_back(
            s.tokens[:phases, :r], s.sampled[:phases, :r], s.depths[:phases, :r], indices,
            *s.logprob_views(tensors.num_logprobs, phases, r),
            *s.finals(len(mirrors), lanes), counts,
        )  # fmt: skip
        return lambda: _results(copied(), [p.num_logprobs for p in params], lanes)

    def padded(self, rows: int) -> int:
        """The row count a run of `rows` rows runs with: the smallest bucket that holds them
        (idle rows fill the rest), so that a few shapes, captured at startup, serve every run."""
        return next(b for b in self.buckets if b >= rows)

    def warm_up(self, exit_mode: str, draft_loops: int = 0, lane_rows: int = 0) -> None:
        """Compile and capture the step (of `exit_mode`) and the greedy sample function of
        every bucket over idle rows, so that no run waits for either mid-serving; with lanes
        (the state's `max_lanes` > 1), those of runs with lanes too (drafting after
        `draft_loops` loops), and `settle` for runs of up to `lane_rows` rows (it writes slot
        0's newest token, which no request holds yet)."""
        lanes = self.state.max_lanes
        variants = [DecodeRun(exit_mode, (), ())]
        if lanes > 1:
            variants.append(DecodeRun(exit_mode, (), (), lanes=lanes, draft_loops=draft_loops))
        for run in variants:
            for bucket in self.buckets:
                rows = bucket * run.lanes
                self._sample(rows, self.state.idle(rows), run)
                idle = RunRows(self, rows, exit_mode, self._static_metadata(rows), run.lanes)
                key = ("step", rows, exit_mode, run.lanes > 1)
                self._call(key, lambda: self._step(idle))  # noqa: B023
        if lanes > 1:
            self.state.idle(self.buckets[-1] * lanes)  # (whatever the loop above left)
            for n in range(1, min(lane_rows, self.buckets[-1]) + 1):
                self._settle(n, lanes)

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

    def _settle(self, n: int, lanes: int) -> None:
        """`RunState.settle` after a run with lanes of `n` rows, through its graph."""
        buffer, tokens = self.states.buffer, self.windows.tokens
        self._call(("settle", n, lanes), lambda: self.state.settle(n, lanes, buffer, tokens))

    def _sample(self, r: int, tensors: SamplingTensors, run: DecodeRun | None = None) -> None:
        """A sample phase of the first `r` rows (of `run`: its lanes), through its graph."""
        lanes, drafts = (run.lanes, run.draft_loops) if run is not None else (1, 0)
        flags = (tensors.all_greedy, tensors.any_cut, tensors.min_p is not None,
                 tensors.bias is not None, tensors.penalty is not None, tensors.num_logprobs,
                 lanes, drafts)  # fmt: skip
        self._call(("sample", r, *flags), lambda: self._sample_rows(r, tensors, lanes, drafts))

    def _sample_rows(self, r: int, tensors: SamplingTensors, lanes: int, drafts: int) -> None:
        """The coda and the sampler over every row; rows whose token exited take theirs and
        their next token starts (with lanes: `take_lanes`, lanes drafting after `drafts`
        loops)."""
        s = self.state
        logits = self.edges.logits(self.states.buffer[s.state_rows[:r]], [])
        if tensors.penalty is not None:  # (never with lanes: such rows do not speculate)
            tensors = replace(tensors, seen=self.penalties.rows(s.slots[:r]))
            took = s.ready[:r] & ~s.done[:r]  # the rows that take a token in this phase
        out = sample(logits, tensors)
        s.record_logprobs(r, out)
        if lanes > 1:
            self.ops.take_lanes(s, r // lanes, lanes, drafts, out.token_ids)
        else:
            self.ops.take_tokens(s, r, out.token_ids, self.windows.tokens)
        if tensors.penalty is not None:
            self.penalties.count(s.slots[:r], out.token_ids, took)

    def _step(self, rows: RunRows) -> None:
        """One loop of the run's rows alone."""
        hidden, meta = rows.enter()
        rows.leave(*self.model.recurrent_core(hidden, meta, self.kv_cache))

    def _static_metadata(self, r: int) -> AttentionMetadata | None:
        """The step's tables over the state's static buffers (None: built per step, for a
        backend that reads host copies of the positions)."""
        return None if self.host_tables else self.metadata(r)

    def metadata(self, r: int) -> AttentionMetadata:
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


@dataclass(frozen=True)
class RunRows:
    """A run's rows in one invocation, at its head: `enter` before the recurrent core (rows at
    depth 0 take the prelude of their newest token; every live row's plane, position and KV slot
    from its block tables), `leave` after it (the exit rule on the gate and, with several loop
    planes, the fill of the planes exited tokens skip). Riding another batch's invocation
    (`placeholders`, `ride`), the rows take the place of one-row segments built for them."""

    runner: DeviceRunner
    num_rows: int
    exit_mode: str
    meta: AttentionMetadata | None  # the invocation's static tables; None: built at entry
    lanes: int = 1  # rows per request (>1: a run with lanes, each lane entering its own token)

    def enter(self) -> tuple[torch.Tensor, AttentionMetadata]:
        """The rows' input hidden states and attention tables."""
        return self._enter(), self.meta or self.runner.metadata(self.num_rows)

    def _enter(self) -> torch.Tensor:
        """Rows at depth 0 take their prelude; each row's plane, slot and tables; its input."""
        d, s, r = self.runner, self.runner.state, self.num_rows
        tokens = s.token[:r] if self.lanes > 1 else d.windows.tokens[s.slots[:r], 0]
        entry = d.edges.enter(tokens, s.position[:r], [])
        d.ops.enter_rows(s, r, entry, d.states.buffer, d.scratch, d.block_size)
        return s.hidden[:r]

    def leave(self, out: torch.Tensor, gate: torch.Tensor) -> None:
        """The rows' outputs and gate logits (their first `num_rows` rows)."""
        d, s, r = self.runner, self.runner.state, self.num_rows
        d.ops.exit_rows(s, r, self.exit_mode, gate[:r], out[:r], d.states.buffer)
        if d.num_planes > 1:
            d.ops.fill_skipped(s, r, d.kv_cache)

    def placeholders(self) -> tuple[list, list, list, list]:
        """(first positions, rows, block tables, state rows) of one-row segments that hold the
        rows' places in an invocation's tables: position 0, tables of the scratch block as wide
        as the rows' own."""
        d, r = self.runner, self.num_rows
        table = (d.kv_cache.scratch_block,) * d.state.width
        return [0] * r, [1] * r, [table] * r, [np.zeros(r, dtype=np.int64)]

    def ride(self, meta: AttentionMetadata, hidden: torch.Tensor) -> AttentionMetadata:
        """Enter the rows and write them over their placeholders: the invocation's tables
        (`meta`) and input rows (`hidden`). Returns the tables with their host copies and
        context bound."""
        d, s, r = self.runner, self.runner.state, self.num_rows
        hidden[:r] = self._enter()
        meta.positions[:r] = s.position[:r]
        meta.slot_mapping[:r] = s.slot_mapping[:r]
        meta.seg_token_starts[:r] = s.seg_starts[:r]
        width = min(s.width, meta.block_tables.shape[1])
        meta.block_tables[:r, :width] = s.meta_tables[:r, :width]
        starts = meta.seg_token_starts_host
        if d.host_tables:
            starts = tuple(s.position[:r].tolist()) + starts[r:]
        return replace(
            meta, seg_token_starts_host=starts, max_context=max(meta.max_context, d.max_context)
        )


def _results(copied, wants: list[int], lanes: int) -> tuple[RunRowResult, ...]:
    """Each row's tokens (phases where it sampled; with lanes, those of all its lanes in output
    order) and final state, from the read-back (as numpy arrays: per-row tensor indexing would
    cost the host a millisecond for 32 rows, while the GPU waits for the next plan)."""
    (tokens, sampled, depths, indices, logprobs, logprob_ids, loops, remaining, exit_at, ready,
     counts) = (None if t is None else t.numpy() for t in copied)  # fmt: skip
    counts = [(0, 0, 0)] * len(wants) if counts is None else counts.T.tolist()
    loops, remaining, exit_at, ready = (
        loops.tolist(),
        remaining.tolist(),
        exit_at.tolist(),
        ready.tolist(),
    )
    results = []
    for r, want in enumerate(wants):
        cols = slice(r * lanes, (r + 1) * lanes)
        phases, col = np.nonzero(sampled[:, cols])
        col += r * lanes
        if indices is not None:  # output order
            order = np.argsort(indices[phases, col], kind="stable")
            phases, col = phases[order], col[order]
        ids = tokens[phases, col].tolist()
        lps = None if logprobs is None else logprobs[phases, col].tolist()
        lp_ids = None if logprob_ids is None else logprob_ids[phases, col].tolist()
        toks = host_tokens(ids, lps, lp_ids, [want] * len(ids))
        results.append(
            RunRowResult(
                sampled=tuple(zip(toks, depths[phases, col].tolist(), strict=True)),
                loops_done=loops[r],
                remaining=remaining[r],
                exit_at=exit_at[r],
                ready=ready[r],
                spec_counts=tuple(counts[r]),
            )
        )
    return tuple(results)
