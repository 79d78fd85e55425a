"""The bookkeeping kernels of device runs (`kernels/run_rows.py`) against their torch form
(`worker/run_rows_torch.py`), bit for bit: random row states (live, exited, stopped rows; rows at
every depth; several loop planes), every exit mode, several rounds of enter, exit, fill and take.
On CPU the kernels run under the Triton interpreter; the `gpu` variant runs them on CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from vllm_rlt.kernels import run_rows
from vllm_rlt.kernels.kv_format import FP8
from vllm_rlt.worker import run_rows_torch
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.run_state import RunState

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS, MAX_ROWS, VOCAB, PLANES, BLOCKS, HIDDEN, BLOCK_SIZE, SLOTS = 5, 8, 64, 4, 6, 40, 4, 12


def _state(device: str, gen: torch.Generator) -> RunState:
    s = RunState(MAX_ROWS, 8, VOCAB, PLANES, BLOCKS, HIDDEN, torch.float32, device)
    r = ROWS

    def ints(low, high, *shape):
        return torch.randint(low, high, shape or (r,), generator=gen).to(device)

    s.slots[:r] = torch.randperm(SLOTS, generator=gen)[:r].to(device)
    s.state_rows[:r] = torch.randperm(SLOTS, generator=gen)[:r].to(device)
    s.loops[:r] = ints(0, PLANES)
    s.position[:r] = ints(0, BLOCKS * BLOCK_SIZE - 8)
    s.count[:r] = ints(0, 4)
    s.base[:r] = s.count[:r]
    s.max_count[:r] = s.count[:r] + ints(1, 4)
    s.min_loops[:r] = ints(1, 3)
    s.max_loops[:r] = torch.maximum(s.min_loops[:r], ints(2, PLANES + 1))
    s.exit_at[:r] = torch.where(ints(0, 2) > 0, ints(1, PLANES + 1), 0)
    s.remaining[:r] = torch.rand(r, generator=gen, dtype=torch.float64).to(device)
    s.threshold[:r] = torch.tensor([0.3, 0.6, 1.0, 0.5, 0.9], dtype=torch.float64).to(device)
    s.ready[:r] = ints(0, 4) == 0
    s.done[:r] = ints(0, 5) == 0
    s.stop_mask[:r] = torch.rand(r, VOCAB, generator=gen).to(device) < 0.2
    s.trace[:r] = ints(1, PLANES + 1, r, s.trace.shape[1])
    num_blocks = r * PLANES * BLOCKS
    tables = torch.randperm(num_blocks, generator=gen).view(r, PLANES, BLOCKS)
    s.tables[:r] = tables.to(device)
    return s


def _compare(a: RunState, b: RunState, columns: list[int]) -> None:
    """Every buffer equal; of the attention tables, the `columns` each row's context covers."""
    for name, value in vars(a).items():
        if isinstance(value, torch.Tensor) and name != "meta_tables":
            assert torch.equal(value, getattr(b, name)), name
    for i, cols in enumerate(columns):
        assert torch.equal(a.meta_tables[i, :cols], b.meta_tables[i, :cols])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(run_rows.EXIT_MODES))
@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8], ids=["fp32_kv", "fp8_kv"])
def test_the_kernels_compute_what_their_torch_form_computes(device, mode, kv_dtype):
    gen = torch.Generator().manual_seed(len(mode))
    kernel_state = _state(device, gen)
    torch_state = copy.deepcopy(kernel_state)
    buffers = [torch.randn(SLOTS, HIDDEN, generator=gen).to(device) for _ in range(2)]
    buffers[1].copy_(buffers[0])
    kv = [DeviceKVCache(2, ROWS * PLANES * BLOCKS, BLOCK_SIZE, 2, 8, kv_dtype, device)
          for _ in range(2)]  # fmt: skip
    kv[0].kv.copy_(torch.randn(kv[0].kv.shape, generator=gen).to(kv_dtype))
    kv[1].bytes.copy_(kv[0].bytes)
    windows = [torch.randint(0, VOCAB, (SLOTS, 3), generator=gen).to(device) for _ in range(2)]
    windows[1].copy_(windows[0])
    scratch = ROWS * PLANES * BLOCKS * BLOCK_SIZE
    for _ in range(4):
        entry = torch.randn(ROWS, HIDDEN, generator=gen).to(device)
        out = torch.randn(ROWS, HIDDEN, generator=gen).to(device)
        gate = (torch.randn(ROWS, generator=gen) * 3).to(device)
        tokens = torch.randint(0, VOCAB, (ROWS,), generator=gen).to(device)
        columns = (kernel_state.position[:ROWS] // BLOCK_SIZE + 1).tolist()
        for ops, s, buffer, cache, window in zip(
            (run_rows, run_rows_torch), (kernel_state, torch_state), buffers, kv, windows,
            strict=True,
        ):  # fmt: skip
            ops.enter_rows(s, ROWS, entry, buffer, scratch, BLOCK_SIZE)
            ops.exit_rows(s, ROWS, mode, gate, out, buffer)
            ops.fill_skipped(s, ROWS, cache)
            ops.take_tokens(s, ROWS, tokens, window)
        _compare(kernel_state, torch_state, columns)
        assert torch.equal(buffers[0], buffers[1]) and torch.equal(kv[0].bytes, kv[1].bytes)
        assert torch.equal(windows[0], windows[1])
    assert int(kernel_state.exited[:ROWS].sum()) + int(kernel_state.done[:ROWS].sum()) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lanes,draft_loops", [(3, 1), (4, 2), (2, 1)])
def test_take_lanes_computes_what_its_torch_form_computes(device, lanes, draft_loops):
    """Runs with lanes (speculation with the exit gate): rows of one live lane each, driven
    through rounds of the exit rule and `take_lanes` with tokens from a vocabulary of two, so
    that drafts are accepted, rejected and taken several at a time."""
    gen = torch.Generator().manual_seed(lanes * 10 + draft_loops)
    n = 3
    r = n * lanes
    rounds = 24
    s = RunState(MAX_ROWS, rounds, VOCAB, PLANES, BLOCKS, HIDDEN, torch.float32, device,
                 lanes=lanes)  # fmt: skip
    position = torch.randint(0, 20, (n,), generator=gen)
    s.position[:r] = position.repeat_interleave(lanes).to(device)
    live = torch.arange(r) % lanes == (position % lanes).repeat_interleave(lanes)
    s.done[:r] = ~live.to(device)
    s.count[:r] = torch.randint(1, 4, (n,), generator=gen).repeat_interleave(lanes).to(device)
    s.max_count[:r] = s.count[:r] + rounds
    s.min_loops[:r], s.max_loops[:r] = 1, PLANES
    s.threshold[:r] = 0.6
    s.remaining[:r] = 1.0
    s.speculates[:r] = torch.tensor([True, True, False]).repeat_interleave(lanes).to(device)
    s.stop_mask[lanes : 2 * lanes, 1] = True  # the second row stops on token 1
    s.state_rows[:r] = torch.arange(r).to(device)
    states = [s, copy.deepcopy(s)]
    buffer = torch.zeros(r, HIDDEN, device=device)
    several = 0  # phases where a row took more than one token
    for _ in range(rounds):
        gate = (torch.randn(r, generator=gen) * 2).to(device)
        tokens = torch.randint(0, 2, (r,), generator=gen).to(device)
        for ops, state in zip((run_rows, run_rows_torch), states, strict=True):
            run_rows_torch.exit_rows(state, r, "ouro", gate, buffer[:r], buffer.clone())
            ops.take_lanes(state, n, lanes, draft_loops, tokens)
        _compare(states[0], states[1], [])
        taken = states[0].sampled[int(states[0].phase) - 1, :r].view(n, lanes).sum(1)
        several += int((taken > 1).sum())
    assert several > 0
