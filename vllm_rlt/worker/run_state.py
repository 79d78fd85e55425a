"""The persistent device buffers of device runs (`worker/device_runs.py`): each run row's state
and settings, its block tables, the static attention tables of its invocations and the record of
what it sampled. Their addresses never change, so the run's functions, captured once as CUDA
graphs, replay over whichever run the host loads into them (`RunState.load`). Allocated with the
other per-request buffers, before the KV cache is sized."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from vllm_rlt.core.sched.execution_batch import DecodeRun
from vllm_rlt.tensor_utils import to_device
from vllm_rlt.worker.sampler import SamplerOutput, SamplingTensors


class RunState:
    def __init__(self, max_rows: int, max_loops: int, vocab_size: int, num_planes: int,
                 max_blocks: int, hidden_size: int, dtype: torch.dtype, device):  # fmt: skip
        """Room for `max_rows` rows, runs of up to `max_loops` invocations, block tables of
        `max_blocks` blocks per plane."""
        s, t, device = max_rows, max(max_loops, 1), torch.device(device)
        self.device = device

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        # per row: its request's slot and decode row, its token's state, its settings
        self.slots, self.state_rows = zeros(s), zeros(s)
        self.loops, self.exit_at, self.position, self.count = zeros(s), zeros(s), zeros(s), zeros(s)
        self.base, self.max_count, self.min_loops, self.max_loops = (zeros(s) for _ in range(4))
        self.remaining, self.threshold = (
            zeros(s, dtype=torch.float64),
            zeros(s, dtype=torch.float64),
        )
        self.ready, self.done = zeros(s, dtype=torch.bool), zeros(s, dtype=torch.bool)
        self.exited = zeros(s, dtype=torch.bool)  # its token exited in the last invocation
        self.stop_mask = zeros(s, vocab_size, dtype=torch.bool)  # [row, token]: it ends the row
        # trace mode: exit loops of the tokens it starts, in order (of a run and its carry)
        self.trace = zeros(s, 2 * t)
        self.temperature, self.top_p = zeros(s, dtype=torch.float32), zeros(s, dtype=torch.float32)
        self.top_k, self.seeds = zeros(s), zeros(s)
        # block tables of every plane, and the invocation's attention tables
        self.tables = zeros(s, num_planes, max_blocks)
        self.width = 1  # blocks per plane the loaded run's tables hold
        self.meta_tables = zeros(s, max_blocks, dtype=torch.int32)
        self.slot_mapping, self.seg_starts = zeros(s), zeros(s, dtype=torch.int32)
        self.hidden = zeros(s, hidden_size, dtype=dtype)
        self.ids = torch.arange(s + 1, dtype=torch.int32, device=device)
        self.ones = torch.ones(s, dtype=torch.int32, device=device)
        # what each sampling phase sampled (phase = the record's row)
        self.tokens, self.depths = zeros(t + 1, s), zeros(t + 1, s)
        self.sampled = zeros(t + 1, s, dtype=torch.bool)
        self.phase = zeros(1)
        self._logprobs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def load(self, run: DecodeRun, mirrors, states, padded: int) -> SamplingTensors:
        """Load the run's rows (`mirrors`: RunMirror per row, `states`: the HiddenStateStore)
        into the first R rows (a carried run: only what it changes), and idle rows after them
        up to `padded` rows; returns the sampling tensors of all of them, views of the
        buffers."""
        rows, r = run.rows, len(run.rows)
        if not run.carried:
            self._load_states(run, mirrors, states)
            self._idle(r, padded)
        self.phase.zero_()
        self.base[:r].copy_(to_device([x.num_sampled for x in rows], torch.int64, self.device))
        # the blocks of the positions the runs may reach (all the rows' blocks)
        planes = self.tables.shape[1]
        width = min(max(len(t) for m in mirrors for t in m.block_tables[:planes]),
                    self.tables.shape[2])  # fmt: skip
        tables = np.zeros((r, planes, width), dtype=np.int64)
        for i, m in enumerate(mirrors):
            for p in range(planes):
                table = m.block_tables[p][:width]
                tables[i, p, : len(table)] = table
        self.tables[:r, :, :width].copy_(to_device(tables, torch.int64, self.device))
        self.width = width
        traces = max(len(x.trace) for x in rows)
        if traces:
            trace = np.zeros((r, traces), dtype=np.int64)
            for i, x in enumerate(rows):
                trace[i, : len(x.trace)] = x.trace
            self.trace[:r, :traces].copy_(to_device(trace, torch.int64, self.device))
        params = [m.params for m in mirrors]
        return self._sampling(params + params[:1] * (padded - r))

    def idle(self, rows: int) -> SamplingTensors:
        """The first `rows` rows idle (stopped: they run no loop and take no token), with greedy
        sampling tensors: a run's functions over them change nothing but the scratch block."""
        self._idle(0, rows)
        self.phase.zero_()
        greedy = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, seed=0, num_logprobs=-1)
        return self._sampling([greedy] * rows)

    def _idle(self, start: int, end: int) -> None:
        """Rows [start, end) stopped, their state rows and slots valid indices, at position 0
        (their attention reads one position)."""
        self.done[start:end] = True
        self.position[start:end] = 0
        self.ready[start:end] = False
        self.exited[start:end] = False
        self.state_rows[start:end] = 0
        self.slots[start:end] = 0

    def _load_states(self, run: DecodeRun, mirrors, states) -> None:
        """The rows' token states, counts, settings and stop tokens."""
        rows, r = run.rows, len(run.rows)
        ints = np.array([
            (m.slot, states.decode_row(m.slot), row.loops_done, row.exit_at, row.position,
             row.num_sampled, row.max_tokens, row.min_loops, row.max_loops)
            for m, row in zip(mirrors, rows, strict=True)
        ], dtype=np.int64).T  # fmt: skip
        dev = to_device(ints, torch.int64, self.device)
        targets = (
            self.slots, self.state_rows, self.loops, self.exit_at, self.position, self.count,
            self.max_count, self.min_loops, self.max_loops,
        )  # fmt: skip
        for target, values in zip(targets, dev, strict=True):
            target[:r].copy_(values)
        floats = to_device([[x.remaining for x in rows], [x.threshold for x in rows]],
                           torch.float64, self.device)  # fmt: skip
        self.remaining[:r].copy_(floats[0])
        self.threshold[:r].copy_(floats[1])
        self.ready[:r] = False
        self.done[:r] = False
        stops = [(i, t) for i, x in enumerate(rows) for t in x.stop_token_ids]
        self.stop_mask[:r] = False
        if stops:
            index = to_device(stops, torch.int64, self.device)
            self.stop_mask[index[:, 0], index[:, 1]] = True

    def _sampling(self, params: list) -> SamplingTensors:
        r = len(params)
        t = SamplingTensors.of(params, [0] * r, max(p.num_logprobs for p in params), self.device)
        for target, values in ((self.temperature, t.temperature), (self.top_k, t.top_k),
                               (self.top_p, t.top_p), (self.seeds, t.seeds)):  # fmt: skip
            target[:r].copy_(values)
        if t.num_logprobs >= 0 and t.num_logprobs not in self._logprobs:
            shape = (*self.tokens.shape, 1 + t.num_logprobs)
            self._logprobs[t.num_logprobs] = (
                torch.zeros(shape, dtype=torch.float32, device=self.device),
                torch.zeros(shape, dtype=torch.int64, device=self.device),
            )
        return replace(
            t, temperature=self.temperature[:r], top_k=self.top_k[:r], top_p=self.top_p[:r],
            seeds=self.seeds[:r], counters=self.count[:r],
        )  # fmt: skip

    def record_logprobs(self, r: int, out: SamplerOutput) -> None:
        """The logprobs of the first `r` rows in this sampling phase, if any row asked."""
        if out.logprobs is not None:
            values, ids = self._logprobs[out.logprobs.shape[1] - 1]
            values[:, :r].index_copy_(0, self.phase, out.logprobs[None])
            ids[:, :r].index_copy_(0, self.phase, out.logprob_token_ids[None])

    def logprob_views(self, num_logprobs: int, phases: int, r: int):
        """(logprobs, their token ids) recorded in the first `phases` phases (None, None when
        no row asked for logprobs)."""
        if num_logprobs < 0:
            return None, None
        values, ids = self._logprobs[num_logprobs]
        return values[:phases, :r], ids[:phases, :r]
