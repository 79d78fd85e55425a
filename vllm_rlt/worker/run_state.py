"""The persistent device buffers of device runs (`worker/device_runs.py`): each run row's state
and settings, its block tables, the static attention tables of its invocations and the record of
what it sampled. Their addresses never change, so the run's functions, captured once as CUDA
graphs, replay over whichever run the host loads into them (`RunState.load`). Allocated with the
other per-request buffers, before the KV cache is sized."""

from __future__ import annotations

import numpy as np
import torch

from vllm_rlt.core.sched.execution_batch import DecodeRun
from vllm_rlt.sampling_params import MAX_LOGIT_BIAS, penalized
from vllm_rlt.tensor_utils import to_device_packed
from vllm_rlt.worker.sampler import (
    SamplerOutput,
    SamplingTensors,
    bias_arrays,
    penalty_rows,
    shortcuts,
)

_CARRIED_INTS = 3  # the integer fields every run loads (top-k, seed, the trace's base)
_INTS = 12  # and those a fresh run loads after them


class RunState:
    def __init__(self, max_rows: int, max_loops: int, vocab_size: int, num_planes: int,
                 max_blocks: int, hidden_size: int, dtype: torch.dtype, device,
                 lanes: int = 1):  # fmt: skip
        """Room for `max_rows` rows of up to `lanes` lanes each, runs of up to `max_loops`
        invocations, block tables of `max_blocks` blocks per plane."""
        s, t, device = max_rows * lanes, max(max_loops, 1), torch.device(device)
        self.device = device
        self.max_lanes = lanes

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        # per row, one buffer per kind, so that a load is few copies: integers
        # (the sampler's top-k and seed and the trace's base, which every run loads; then its
        # slot and decode row, its token's state and its settings, which a fresh run loads),
        # float32 sampling settings, the exit rule's float64 state, flags
        self._ints = zeros(_INTS, s)
        (self.top_k, self.seeds, self.base, self.slots, self.state_rows, self.loops,
         self.exit_at, self.position, self.count, self.max_count, self.min_loops,
         self.max_loops) = self._ints  # fmt: skip
        self._f32 = zeros(6, s, dtype=torch.float32)
        self.temperature, self.top_p, self.min_p = self._f32[:3]
        self.penalty = self._f32[3:]  # presence, frequency, repetition
        self._f64 = zeros(2, s, dtype=torch.float64)
        self.remaining, self.threshold = self._f64
        self._flags = zeros(5, s, dtype=torch.bool)
        # ready: exited, waiting for the coda; exited: its token exited in the last invocation;
        # with lanes (a row's positions in flight, docs/design/speculative.md §3): has_target:
        # `target` holds the token sampled from its exited state; speculates: it drafts
        self.ready, self.done, self.exited, self.has_target, self.speculates = self._flags
        # with lanes: the token each lane's position holds (it enters at depth 0), the target
        self._lane = zeros(2, s)
        self.token, self.target = self._lane
        # with lanes, a run's counters on each row's first lane: drafts, accepted drafts and
        # tokens taken by drafting rows
        self.counts = zeros(3, s)
        # with lanes, after a run: each row's final loops, remaining, exit loop and ready flag
        # (those of its oldest lane, `settle`), where the read-back finds them
        self.settled = (zeros(max_rows), zeros(max_rows, dtype=torch.float64), zeros(max_rows),
                        zeros(max_rows, dtype=torch.bool))  # fmt: skip
        self.stop_mask = zeros(s, vocab_size, dtype=torch.bool)  # [row, token]: it ends the row
        # logit bias: each row's token ids and biases (`sampler.bias_arrays`)
        self.bias_ids = zeros(s, MAX_LOGIT_BIAS)
        self.bias = zeros(s, MAX_LOGIT_BIAS, dtype=torch.float32)
        # trace mode: exit loops of the tokens it starts, in order (of a run and its carry)
        self.trace = zeros(s, 2 * t)
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
        self.indices = zeros(t + 1, s)  # with lanes: each token's output index
        self.sampled = zeros(t + 1, s, dtype=torch.bool)
        self.phase = zeros(1)
        self._logprobs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def load(self, run: DecodeRun, mirrors, states, padded: int,
             window_tokens: torch.Tensor) -> SamplingTensors:  # fmt: skip
        """Load the run's rows (`mirrors`: RunMirror per row, `states`: the HiddenStateStore)
        into the first R * lanes rows (a carried run: only what it changes), and idle rows after
        them up to `padded` rows (sampling as the first row); returns the sampling tensors of
        all of them, views of the buffers. A row's lanes are consecutive rows; the lane of its
        newest token (position % lanes) starts live from the row's state, the others free, each
        lane with its own hidden-state row (`window_tokens`: each slot's newest token, the live
        lane's). Every value crosses in one upload: the host's time here is the GPU's idle time
        when a run follows a read-back."""
        rows, lanes = run.rows, run.lanes
        r = len(rows) * lanes
        params = [m.params for m in mirrors for _ in range(lanes)]
        params += params[:1] * (padded - r)
        ints = np.zeros((_CARRIED_INTS, padded), dtype=np.int64)
        ints[0] = [p.top_k for p in params]
        ints[1] = [p.seed for p in params]
        ints[2, :r] = np.repeat([x.num_sampled for x in rows], lanes)  # the trace's base
        # (the rows' requests: whether any has a logit bias or a penalty)
        biased = any(m.params.logit_bias for m in mirrors)
        penalties = any(penalized(m.params) for m in mirrors)
        f32 = [[p.temperature for p in params], [p.top_p for p in params],
               [p.min_p for p in params]]  # fmt: skip
        if penalties:  # (the penalty rows are read only then)
            f32 += np.array(penalty_rows(params)).T.tolist()
        f32 = np.array(f32, np.float32)
        # the blocks of the positions the runs may reach (all the rows' blocks)
        planes = self.tables.shape[1]
        width = min(max(len(t) for m in mirrors for t in m.block_tables[:planes]),
                    self.tables.shape[2])  # fmt: skip
        tables = np.zeros((len(rows), planes, width), dtype=np.int64)
        for i, m in enumerate(mirrors):
            for p in range(planes):
                table = m.block_tables[p][:width]
                tables[i, p, : len(table)] = table
        trace = np.zeros((len(rows), max(len(x.trace) for x in rows)), dtype=np.int64)
        for i, x in enumerate(rows):
            trace[i, : len(x.trace)] = x.trace
        arrays = [ints, f32, np.repeat(tables, lanes, axis=0), np.repeat(trace, lanes, axis=0)]
        # rows loaded as a fresh run's, from `first` on: all of a fresh run's, or a carried
        # run's joined rows (lanes 1); and the idle rows after them
        first = len(rows) - run.joined if run.carried else 0
        if first < len(rows) or not run.carried:
            more, *fresh = self._fresh(rows[first:], mirrors[first:], states,
                                       padded - first * lanes, lanes)  # fmt: skip
            if first:  # a carried run's joined rows: their integers after the carried ones
                fresh.insert(0, more)
            else:  # a fresh run's integers: one array, one copy
                arrays[0] = np.concatenate([ints, more])
            arrays += fresh
        if biased:  # (last: popped first)
            arrays += bias_arrays([p.logit_bias for p in params])
        arrays_t = list(to_device_packed(arrays, self.device))
        if biased:
            self.bias[:padded].copy_(arrays_t.pop())
            self.bias_ids[:padded].copy_(arrays_t.pop())
        ints, f32, tables, trace, *fresh = arrays_t
        self._ints[: len(ints), :padded].copy_(ints)
        self._f32[: len(f32), :padded].copy_(f32)
        self.tables[:r, :, :width].copy_(tables)
        self.width = width
        if trace.shape[1]:
            self.trace[:r, : trace.shape[1]].copy_(trace)
        if fresh:
            f = first * lanes
            if first:  # a carried run's joined rows
                self._ints[_CARRIED_INTS:, f:padded].copy_(fresh.pop(0))
            f64, flags, stops, *moves = fresh
            self._f64[:, f:padded].copy_(f64)
            self._flags[:, f:padded].copy_(flags)
            self.stop_mask[f:r] = False
            if len(stops):
                self.stop_mask[stops[:, 0] + f, stops[:, 1]] = True
            if moves:  # (lanes)
                decode_rows, lane_rows = moves[0]
                states.buffer[lane_rows] = states.buffer[decode_rows]
                self.token[:r] = window_tokens[self.slots[:r], 0]
        self.phase.zero_()
        self.counts[:, :padded].zero_()
        num_logprobs = max(p.num_logprobs for p in params)
        return self._sampling(arrays[0][0], *arrays[1][:3], num_logprobs, biased, penalties)

    @staticmethod
    def _fresh(rows, mirrors, states, padded: int, lanes: int) -> list[np.ndarray]:
        """The host arrays of what a fresh run loads of `rows` (`mirrors` theirs) and of the
        idle rows after them, up to `padded` rows: the integer fields after the carried ones,
        the exit rule's state, the flags, the stop tokens ((row, token) pairs), and with lanes
        the moves of each row's newest state to its lane's row. Idle rows: stopped, at
        position 0, slot and state row 0."""
        r = len(rows) * lanes
        lane = np.tile(np.arange(lanes), len(rows))
        live = lane == np.repeat([x.position % lanes for x in rows], lanes)
        # with lanes, every lane's state in the ring (the decode row is the oldest's copy for
        # the host path, `settle`)
        state_rows = np.array([
            states.ring_row(m.slot, j) if lanes > 1 else states.decode_row(m.slot)
            for m, j in zip([m for m in mirrors for _ in range(lanes)], lane, strict=True)
        ], dtype=np.int64)  # fmt: skip
        ints = np.zeros((_INTS - _CARRIED_INTS, padded), dtype=np.int64)
        ints[:, :r] = np.repeat(np.array([
            (m.slot, 0, x.loops_done, x.exit_at, x.position, x.num_sampled, x.max_tokens,
             x.min_loops, x.max_loops)
            for m, x in zip(mirrors, rows, strict=True)
        ], dtype=np.int64).T.reshape(_INTS - _CARRIED_INTS, -1), lanes, axis=1)  # fmt: skip
        ints[1, :r] = state_rows
        f64 = np.zeros((2, padded))
        f64[:, :r] = np.repeat([[x.remaining for x in rows], [x.threshold for x in rows]],
                               lanes, axis=1)  # fmt: skip
        flags = np.zeros((5, padded), dtype=bool)
        flags[1] = True  # done: idle rows and free lanes
        flags[1, :r] = ~live
        flags[4, :r] = np.repeat([x.speculates for x in rows], lanes)
        stops = [(i * lanes + j, t) for i, x in enumerate(rows) for t in x.stop_token_ids
                 for j in range(lanes)]  # fmt: skip
        arrays = [ints, f64, flags, np.array(stops, dtype=np.int64).reshape(-1, 2)]
        if lanes > 1:  # the newest token's state moves from the decode row to its lane's
            decode_rows = [states.decode_row(m.slot) for m in mirrors]
            arrays.append(np.array([decode_rows, state_rows[live]], dtype=np.int64))
        return arrays

    def settle(self, n: int, lanes: int, buffer: torch.Tensor, window_tokens: torch.Tensor) -> None:
        """After a run with lanes, of its first `n` rows (real ones, each with its own slot): the
        state of each row's oldest lane (its newest taken token's) goes to the row's decode row
        of `buffer` and its token is the slot's newest (`window_tokens` column 0), where the host
        path finds them, and its final loops, remaining, exit loop and ready flag to `settled`.
        The lanes after it go on in a carried run; a fresh run starts from the oldest lane alone.
        Torch ops over the static buffers, no host sync: the runner captures them per `n`."""
        r = n * lanes
        head = oldest_lanes(self.done[:r].view(n, lanes), self.position[:r].view(n, lanes))
        kept = self.ids[:n] * lanes + head
        slots = self.slots[kept]
        buffer[slots] = buffer[self.state_rows[kept]]  # (decode row = slot)
        window_tokens[slots, 0] = self.token[kept]
        for out, lane_values in zip(self.settled, self.finals(r), strict=True):
            out[:n] = lane_values[kept]

    def finals(self, rows: int, lanes: int = 1) -> tuple[torch.Tensor, ...]:
        """Each of a run's first `rows` rows' final loops, remaining, exit loop and ready flag,
        as the read-back copies them: with lanes, those `settle` took from each row's oldest
        lane (without, a row is its run row)."""
        if lanes > 1:
            return tuple(x[:rows] for x in self.settled)
        return self.loops[:rows], self.remaining[:rows], self.exit_at[:rows], self.ready[:rows]

    def idle(self, rows: int) -> SamplingTensors:
        """The first `rows` rows idle (stopped: they run no loop and take no token), with greedy
        sampling tensors: a run's functions over them change nothing but the scratch block."""
        self._idle(0, rows)
        self.phase.zero_()
        self._ints[:2, :rows] = 0  # top-k, seed
        self._f32[0, :rows] = 0.0  # greedy
        self._f32[1, :rows] = 1.0
        self._f32[2:5, :rows] = 0.0  # min-p, presence, frequency
        self._f32[5, :rows] = 1.0  # repetition
        zeros = np.zeros(rows, dtype=np.float32)
        return self._sampling(zeros.astype(np.int64), zeros, zeros + 1, zeros, -1)

    def _idle(self, start: int, end: int) -> None:
        """Rows [start, end) stopped, their state rows and slots valid indices, at position 0
        (their attention reads one position)."""
        self.done[start:end] = True
        self.position[start:end] = 0
        self.ready[start:end] = False
        self.exited[start:end] = False
        self.has_target[start:end] = False
        self.speculates[start:end] = False
        self.state_rows[start:end] = 0
        self.slots[start:end] = 0

    def _sampling(self, top_k, temperature, top_p, min_p, num_logprobs: int,
                  biased: bool = False, penalties: bool = False) -> SamplingTensors:  # fmt: skip
        """The sampling tensors over the loaded buffers (host copies of the settings, float32
        as on the device: the shortcut flags cost no device sync; `biased`: some row has a
        logit bias; `penalties`: some row has a penalty, whose counts the sample phase
        gathers, `seen`)."""
        r = len(top_k)
        all_greedy, any_cut, any_min_p = shortcuts(temperature, top_k, top_p, min_p)
        if num_logprobs >= 0 and num_logprobs not in self._logprobs:
            shape = (*self.tokens.shape, 1 + num_logprobs)
            self._logprobs[num_logprobs] = (
                torch.zeros(shape, dtype=torch.float32, device=self.device),
                torch.zeros(shape, dtype=torch.int64, device=self.device),
            )
        return SamplingTensors(
            temperature=self.temperature[:r], top_k=self.top_k[:r], top_p=self.top_p[:r],
            min_p=self.min_p[:r] if any_min_p else None, seeds=self.seeds[:r],
            counters=self.count[:r],
            num_logprobs=num_logprobs, all_greedy=all_greedy, any_cut=any_cut,
            bias_ids=self.bias_ids[:r] if biased else None, bias=self.bias[:r] if biased else None,
            penalty=self.penalty[:, :r] if penalties else None,
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


def oldest_lanes(done: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Per row of lanes ([n, lanes] flags and positions), its lane holding the oldest position
    among the live ones (0 if none)."""
    return torch.where(done, torch.iinfo(pos.dtype).max, pos).argmin(1)
