"""The bookkeeping of device runs (`worker/device_runs.py`, docs/design/runner.md §7) as four
kernels over the run rows' state buffers (`worker/run_state.py`), so that an invocation costs a
handful of launches besides the recurrent core:

- `enter_rows` (before the core): each live row's plane, KV slot and attention table row, and its
  state row (a row at depth 0 takes the prelude of its newest token);
- `exit_rows` (after the core): live rows keep the core's output and count the loop, then the
  exit rule (`core/sched/exit_policy.py`'s rules; the gate's sigmoid and the running product in
  fp64, in the host's order of operations) marks the rows whose token exits;
- `fill_skipped` (after it, with several loop planes): a token that exited after e loops copies
  its plane e-1 K/V into planes e.. at its position, for every layer (LAST_EXITED);

Each program takes a block of rows (all of them in the interpreter, whose cost grows with the
number of programs);
- `take_tokens` (after the sampler): rows whose token exited take the sampled token and record
  it, stop at max_tokens or a stop token, or start the next token at depth 0 one position on;
- `take_lanes` (after the sampler, in a run with lanes: speculation with the exit gate,
  docs/design/speculative.md §3): exited lanes keep their target, targets are taken from each
  row's oldest lane on while the next lane holds that token, the newest lane drafts.

Booleans are stored as torch.bool; a row is live when its request has not stopped (`done`) and its
token has not exited (`ready`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET

EXIT_MODES = {"ouro": 0, "ouro_delayed": 1, "trace": 2}


@triton.jit
def _enter_kernel(
    done_ptr, ready_ptr, loops_ptr, position_ptr, state_rows_ptr, tables_ptr, slot_ptr,
    seg_start_ptr, meta_ptr, entry_ptr, buffer_ptr, hidden_ptr, scratch, num_rows, num_planes,
    max_blocks, hidden_size, BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = rows < num_rows
    stopped = tl.load(done_ptr + rows, mask=m, other=1).to(tl.int32)
    live = (stopped | tl.load(ready_ptr + rows, mask=m, other=1).to(tl.int32)) == 0
    loops = tl.load(loops_ptr + rows, mask=m, other=0)
    position = tl.load(position_ptr + rows, mask=m, other=0)
    plane = tl.minimum(loops, num_planes - 1)
    column = tl.minimum(position // BLOCK_SIZE, max_blocks - 1)
    table = tables_ptr + (rows.to(tl.int64) * num_planes + plane) * max_blocks
    block = tl.load(table + column, mask=m, other=0)
    slot = tl.where(live, block * BLOCK_SIZE + position % BLOCK_SIZE, scratch)
    tl.store(slot_ptr + rows, slot, mask=m)
    tl.store(seg_start_ptr + rows, position.to(tl.int32), mask=m)
    for start in range(0, tl.max(column) + 1, BLOCK_T):  # the columns each context covers
        offs = start + tl.arange(0, BLOCK_T)[None, :]
        mask = m[:, None] & (offs <= column[:, None])
        values = tl.load(table[:, None] + offs, mask=mask).to(tl.int32)
        tl.store(meta_ptr + rows[:, None].to(tl.int64) * max_blocks + offs, values, mask=mask)
    entering = (live & (loops == 0))[:, None]
    kept_rows = tl.load(state_rows_ptr + rows, mask=m, other=0)[:, None] * hidden_size
    own_rows = rows[:, None].to(tl.int64) * hidden_size
    for start in range(0, hidden_size, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)[None, :]
        mask = m[:, None] & (offs < hidden_size)
        kept = tl.load(buffer_ptr + kept_rows + offs, mask=mask & ~entering)
        entry = tl.load(entry_ptr + own_rows + offs, mask=mask & entering)
        tl.store(hidden_ptr + own_rows + offs, tl.where(entering, entry.to(kept.dtype), kept),
                 mask=mask)  # fmt: skip


@triton.jit
def _exit_kernel(
    done_ptr, ready_ptr, exited_ptr, loops_ptr, exit_at_ptr, remaining_ptr, threshold_ptr,
    min_loops_ptr, max_loops_ptr, gate_ptr, state_rows_ptr, out_ptr, buffer_ptr, num_rows,
    hidden_size, MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = rows < num_rows
    ready = tl.load(ready_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    live = ~(ready | (tl.load(done_ptr + rows, mask=m, other=1).to(tl.int32) != 0)) & m
    kept_rows = tl.load(state_rows_ptr + rows, mask=m, other=0)[:, None] * hidden_size
    own_rows = rows[:, None].to(tl.int64) * hidden_size
    for start in range(0, hidden_size, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)[None, :]
        mask = live[:, None] & (offs < hidden_size)
        tl.store(buffer_ptr + kept_rows + offs, tl.load(out_ptr + own_rows + offs, mask=mask),
                 mask=mask)  # fmt: skip
    loops = tl.load(loops_ptr + rows, mask=m, other=0) + live.to(tl.int64)
    tl.store(loops_ptr + rows, loops, mask=m)
    exit_at = tl.load(exit_at_ptr + rows, mask=m, other=0)
    if MODE == 2:  # trace: the depth is given
        exits = loops >= exit_at
    else:
        max_loops = tl.load(max_loops_ptr + rows, mask=m, other=1)
        threshold = tl.load(threshold_ptr + rows, mask=m, other=1.0)
        pending = exit_at == 0
        reads = live & (threshold < 1.0)
        if MODE == 1:
            reads = reads & pending
        x = tl.load(gate_ptr + rows, mask=m, other=0.0).to(tl.float64)
        e = tl.exp(-tl.abs(x))
        sigmoid = tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        remaining = tl.load(remaining_ptr + rows, mask=m, other=1.0)
        remaining = tl.where(reads, remaining * (1.0 - sigmoid), remaining)
        tl.store(remaining_ptr + rows, remaining, mask=m)
        min_loops = tl.load(min_loops_ptr + rows, mask=m, other=1)
        fires = reads & (loops >= min_loops) & (1.0 - remaining >= threshold)
        if MODE == 0:
            exits = fires | (loops >= max_loops)
        else:
            exit_at = tl.where(fires & pending, tl.minimum(loops + 1, max_loops), exit_at)
            tl.store(exit_at_ptr + rows, exit_at, mask=m)
            exits = loops >= tl.where(exit_at == 0, max_loops, exit_at)
    exits = exits & live
    tl.store(exited_ptr + rows, exits, mask=m)
    tl.store(ready_ptr + rows, ready | exits, mask=m)


@triton.jit
def _fill_kernel(
    exited_ptr, loops_ptr, position_ptr, tables_ptr, kv_ptr, num_rows, num_planes, max_blocks,
    layer_stride, BLOCK_SIZE: tl.constexpr, ROW_ELEMS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    exited = tl.load(exited_ptr + rows, mask=rows < num_rows, other=0).to(tl.int32) != 0
    loops = tl.load(loops_ptr + rows, mask=exited, other=1)
    position = tl.load(position_ptr + rows, mask=exited, other=0)
    column = tl.minimum(position // BLOCK_SIZE, max_blocks - 1)
    within = position % BLOCK_SIZE
    tables = tables_ptr + rows.to(tl.int64) * num_planes * max_blocks + column
    layer = kv_ptr + tl.program_id(1).to(tl.int64) * layer_stride
    src = tl.load(tables + (loops - 1) * max_blocks, mask=exited, other=0) * BLOCK_SIZE + within
    offs = tl.arange(0, BLOCK)[None, :]
    mask = exited[:, None] & (offs < ROW_ELEMS)
    value = tl.load(layer + src[:, None] * ROW_ELEMS + offs, mask=mask)
    for plane in range(1, num_planes):  # the planes at or past each exited row's depth
        fill = exited & (plane >= loops)
        dst = tl.load(tables + plane * max_blocks, mask=fill, other=0) * BLOCK_SIZE + within
        tl.store(layer + dst[:, None] * ROW_ELEMS + offs, value, mask=mask & fill[:, None])


@triton.jit
def _take_kernel(
    token_ptr, done_ptr, ready_ptr, loops_ptr, count_ptr, max_count_ptr, base_ptr, stop_ptr,
    record_token_ptr, record_sampled_ptr, record_depth_ptr, phase_ptr, window_ptr, window_stride,
    slots_ptr, remaining_ptr, position_ptr, exit_at_ptr, trace_ptr, num_rows, max_rows,
    vocab_size, trace_len, BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, BLOCK_R)
    m = rows < num_rows
    phase = tl.load(phase_ptr)
    token = tl.load(token_ptr + rows, mask=m)
    ready = tl.load(ready_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    done = tl.load(done_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    loops = tl.load(loops_ptr + rows, mask=m)
    now = ready & ~done
    record = phase * max_rows + rows
    tl.store(record_token_ptr + record, token, mask=m)
    tl.store(record_sampled_ptr + record, now, mask=m)
    tl.store(record_depth_ptr + record, loops, mask=m)
    window = window_ptr + tl.load(slots_ptr + rows, mask=m) * window_stride
    tl.store(window, token, mask=m & now)
    count = tl.load(count_ptr + rows, mask=m) + now.to(tl.int64)
    tl.store(count_ptr + rows, count, mask=m)
    stop = tl.load(stop_ptr + rows.to(tl.int64) * vocab_size + token, mask=m, other=0)
    ends = now & ((count >= tl.load(max_count_ptr + rows, mask=m)) | (stop.to(tl.int32) != 0))
    start = now & ~ends
    tl.store(done_ptr + rows, done | ends, mask=m)
    tl.store(ready_ptr + rows, ready & ~now, mask=m)
    tl.store(loops_ptr + rows, tl.where(now, 0, loops), mask=m)
    tl.store(remaining_ptr + rows, tl.full([BLOCK_R], 1.0, tl.float64), mask=m & start)
    position = tl.load(position_ptr + rows, mask=m)
    tl.store(position_ptr + rows, position + start.to(tl.int64), mask=m)
    column = tl.minimum(tl.maximum(count - 1 - tl.load(base_ptr + rows, mask=m), 0), trace_len - 1)
    traced = tl.load(trace_ptr + rows * trace_len + column, mask=m & start)  # 0 outside trace
    tl.store(exit_at_ptr + rows, traced, mask=m & start)
    tl.store(phase_ptr, phase + 1)


@triton.jit
def _take_lanes_kernel(
    token_ptr, done_ptr, ready_ptr, exited_ptr, has_target_ptr, speculates_ptr, loops_ptr,
    position_ptr, lane_token_ptr, target_ptr, exit_at_ptr, remaining_ptr, count_ptr,
    max_count_ptr, stop_ptr, record_token_ptr, record_sampled_ptr, record_depth_ptr,
    record_index_ptr, phase_ptr, counts_ptr, num_requests, max_rows, vocab_size, draft_loops,
    LANES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    req = tl.arange(0, BLOCK_N)[:, None]
    lane = tl.arange(0, BLOCK_W)[None, :]
    m = (req < num_requests) & (lane < LANES)
    rows = req * LANES + lane
    first = tl.arange(0, BLOCK_N) * LANES  # each request's first lane
    mr = tl.arange(0, BLOCK_N) < num_requests
    done = tl.load(done_ptr + rows, mask=m, other=1).to(tl.int32) != 0
    ready = tl.load(ready_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    exited = tl.load(exited_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    has_target = tl.load(has_target_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    speculates = tl.load(speculates_ptr + rows, mask=m, other=0).to(tl.int32) != 0
    loops = tl.load(loops_ptr + rows, mask=m, other=0)
    pos = tl.load(position_ptr + rows, mask=m, other=0)
    token = tl.load(lane_token_ptr + rows, mask=m, other=0)
    target = tl.load(target_ptr + rows, mask=m, other=0)
    exit_at = tl.load(exit_at_ptr + rows, mask=m, other=0)
    remaining = tl.load(remaining_ptr + rows, mask=m, other=1.0)
    drawn = tl.load(token_ptr + rows, mask=m, other=0)
    fresh = ready & ~done & ~has_target
    target = tl.where(fresh, drawn, target)
    has_target = has_target | fresh
    count = tl.load(count_ptr + first, mask=mr, other=0)
    max_count = tl.load(max_count_ptr + first, mask=mr, other=0)
    stops = stop_ptr + first.to(tl.int64) * vocab_size
    big = 1 << 62
    taken = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int1)
    rec_token = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int64)
    rec_depth = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int64)
    rec_index = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int64)
    cur = tl.argmin(tl.where(done, big, pos), axis=1).to(tl.int64)
    go = tl.sum((~done).to(tl.int32), axis=1) > 0
    drafting = tl.sum(speculates.to(tl.int32), axis=1) > 0
    accepted = tl.zeros([BLOCK_N], dtype=tl.int64)
    # the lane each row starts at depth 0 (at most one: after a restart no lane drafts)
    starts = tl.zeros([BLOCK_N], dtype=tl.int1)
    start_lane = tl.zeros([BLOCK_N], dtype=tl.int64)
    start_token = tl.zeros([BLOCK_N], dtype=tl.int64)
    start_position = tl.zeros([BLOCK_N], dtype=tl.int64)
    for _ in tl.static_range(LANES):  # from the oldest lane on: take, accept or start again
        at = lane == cur[:, None]
        go = go & (tl.sum((at & ~done & has_target).to(tl.int32), axis=1) > 0)
        hot = at & go[:, None]
        tok = tl.sum(tl.where(at, target, 0), axis=1)
        taken = taken | hot
        rec_token = tl.where(hot, tok[:, None], rec_token)
        rec_depth = tl.where(hot, loops, rec_depth)
        rec_index = tl.where(hot, count[:, None], rec_index)
        count += go.to(tl.int64)
        stop = tl.load(stops + tok, mask=mr & go, other=0).to(tl.int32) != 0
        ends = go & ((count >= max_count) | stop)
        nxt = (cur + 1) % LANES
        same = (lane == nxt[:, None]) & ~done & (token == tok[:, None])
        accept = go & ~ends & (tl.sum(same.to(tl.int32), axis=1) > 0)
        accepted += accept.to(tl.int64)
        again = go & ~ends & ~accept
        done = done | hot | (ends | again)[:, None]
        starts = starts | again
        start_lane = tl.where(again, nxt, start_lane)
        start_token = tl.where(again, tok, start_token)
        start_position = tl.where(again, tl.sum(tl.where(at, pos, 0), axis=1) + 1, start_position)
        cur = tl.where(accept, nxt, cur)
        go = accept
    # the newest lane drafts the next position
    length = tl.sum((~done).to(tl.int64), axis=1)
    tail = (tl.argmin(tl.where(done, big, pos), axis=1).to(tl.int64) + length - 1) % LANES
    at = lane == tail[:, None]
    tail_exited = tl.sum((at & ready).to(tl.int32), axis=1) > 0
    draft = tl.where(tail_exited, tl.sum(tl.where(at, target, 0), axis=1),
                     tl.sum(tl.where(at, drawn, 0), axis=1))  # fmt: skip
    deep = tl.sum(tl.where(at, loops, 0), axis=1) >= draft_loops
    spec = tl.sum((at & speculates).to(tl.int32), axis=1) > 0
    stop = tl.load(stops + draft, mask=mr, other=0).to(tl.int32) != 0
    drafts = (length > 0) & (length < LANES) & spec & (tail_exited | deep)
    drafts = drafts & (count + length < max_count) & ~stop
    starts = starts | drafts
    start_lane = tl.where(drafts, (tail + 1) % LANES, start_lane)
    start_token = tl.where(drafts, draft, start_token)
    start_position = tl.where(drafts, tl.sum(tl.where(at, pos, 0), axis=1) + 1, start_position)
    start = (lane == start_lane[:, None]) & starts[:, None]
    done = done & ~start
    ready = ready & ~start
    has_target = has_target & ~start
    exited = exited & ~start
    loops = tl.where(start, 0, loops)
    exit_at = tl.where(start, 0, exit_at)
    remaining = tl.where(start, 1.0, remaining)
    token = tl.where(start, start_token[:, None], token)
    pos = tl.where(start, start_position[:, None], pos)
    tl.store(done_ptr + rows, done, mask=m)
    tl.store(ready_ptr + rows, ready, mask=m)
    tl.store(exited_ptr + rows, exited, mask=m)
    tl.store(has_target_ptr + rows, has_target, mask=m)
    tl.store(loops_ptr + rows, loops, mask=m)
    tl.store(position_ptr + rows, pos, mask=m)
    tl.store(lane_token_ptr + rows, token, mask=m)
    tl.store(target_ptr + rows, target, mask=m)
    tl.store(exit_at_ptr + rows, exit_at, mask=m)
    tl.store(remaining_ptr + rows, remaining, mask=m)
    tl.store(count_ptr + rows, count[:, None] + tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int64),
             mask=m)  # fmt: skip
    phase = tl.load(phase_ptr)
    record = phase * max_rows + rows
    tl.store(record_token_ptr + record, rec_token, mask=m)
    tl.store(record_sampled_ptr + record, taken, mask=m)
    tl.store(record_depth_ptr + record, rec_depth, mask=m)
    tl.store(record_index_ptr + record, rec_index, mask=m)
    tl.store(phase_ptr, phase + 1)
    # the run's counters, on each row's first lane: drafts, accepted drafts, tokens taken by
    # drafting rows
    taken_here = tl.sum(taken.to(tl.int64), axis=1) * drafting.to(tl.int64)
    counts = counts_ptr + first
    tl.store(counts, tl.load(counts, mask=mr) + drafts.to(tl.int64), mask=mr)
    counts += max_rows
    tl.store(counts, tl.load(counts, mask=mr) + accepted, mask=mr)
    counts += max_rows
    tl.store(counts, tl.load(counts, mask=mr) + taken_here, mask=mr)


def _row_block(r: int) -> int:
    """Rows per program: all of them in the interpreter (whose cost grows with programs)."""
    return triton.next_power_of_2(r) if INTERPRET else min(triton.next_power_of_2(r), 16)


def enter_rows(s, r: int, entry: torch.Tensor, buffer: torch.Tensor, scratch: int,
               block_size: int) -> None:  # fmt: skip
    """The first `r` rows of RunState `s` before an invocation: KV slots, attention tables and
    state rows (`entry`: [r, H] prelude of each row's newest token; `buffer`: the
    HiddenStateStore's rows; `scratch`: the slot of rows not running)."""
    planes, max_blocks = s.tables.shape[1:]
    hidden, rows = s.hidden.shape[1], _row_block(r)
    _enter_kernel[(triton.cdiv(r, rows),)](
        s.done, s.ready, s.loops, s.position, s.state_rows, s.tables, s.slot_mapping,
        s.seg_starts, s.meta_tables, entry, buffer, s.hidden, scratch, r, planes, max_blocks,
        hidden, BLOCK_SIZE=block_size, BLOCK_R=rows,
        BLOCK_T=min(triton.next_power_of_2(max_blocks), 64),
        BLOCK_H=min(triton.next_power_of_2(hidden), 256), num_warps=4,
    )  # fmt: skip


def exit_rows(s, r: int, mode: str, gate: torch.Tensor, out: torch.Tensor,
              buffer: torch.Tensor) -> None:  # fmt: skip
    """After an invocation of the first `r` rows of RunState `s`: live rows store the core's
    `out` [r, H] in `buffer` and count the loop; the exit rule of `mode` on `gate` [r] marks
    `s.exited` and `s.ready`."""
    hidden, rows = out.shape[1], _row_block(r)
    _exit_kernel[(triton.cdiv(r, rows),)](
        s.done, s.ready, s.exited, s.loops, s.exit_at, s.remaining, s.threshold, s.min_loops,
        s.max_loops, gate, s.state_rows, out, buffer, r, hidden, MODE=EXIT_MODES[mode],
        BLOCK_R=rows, BLOCK_H=min(triton.next_power_of_2(hidden), 256), num_warps=4,
    )  # fmt: skip


def fill_skipped(s, r: int, kv_cache) -> None:
    """LAST_EXITED for the rows of RunState `s` that exited in the last invocation: planes
    loops.. at their position take plane loops-1's K/V, in every layer of `kv_cache` (a
    DeviceKVCache), moved as bytes whatever the cache's dtype."""
    kv, block_size = kv_cache.bytes, kv_cache.block_size
    planes, max_blocks = s.tables.shape[1:]
    row_elems, rows = kv.shape[-1], _row_block(r)
    layers = kv.shape[0] * kv.shape[1]
    _fill_kernel[(triton.cdiv(r, rows), layers)](
        s.exited, s.loops, s.position, s.tables, kv, r, planes, max_blocks, kv[0, 0].numel(),
        BLOCK_SIZE=block_size, ROW_ELEMS=row_elems, BLOCK_R=rows,
        BLOCK=triton.next_power_of_2(row_elems), num_warps=4,
    )  # fmt: skip


def take_tokens(s, r: int, token_ids: torch.Tensor, window_tokens: torch.Tensor) -> None:
    """After a sampling phase of the first `r` rows of RunState `s` (`token_ids` [r]): record
    the phase, and rows whose token exited take theirs (`window_tokens` [slots, k]: column 0
    holds each request's newest token)."""
    max_rows, vocab = s.stop_mask.shape
    _take_kernel[(1,)](
        token_ids, s.done, s.ready, s.loops, s.count, s.max_count, s.base, s.stop_mask,
        s.tokens, s.sampled, s.depths, s.phase, window_tokens, window_tokens.stride(0), s.slots,
        s.remaining, s.position, s.exit_at, s.trace, r, max_rows, vocab, s.trace.shape[1],
        BLOCK_R=triton.next_power_of_2(max(r, 16)), num_warps=4,
    )  # fmt: skip


def take_lanes(s, n: int, lanes: int, draft_loops: int, token_ids: torch.Tensor) -> None:
    """After a sample phase of a run with lanes (`n` rows of `lanes` lanes in RunState `s`,
    `token_ids` [n * lanes]): `worker/run_rows_torch.take_lanes`, in one program."""
    max_rows, vocab = s.stop_mask.shape
    _take_lanes_kernel[(1,)](
        token_ids, s.done, s.ready, s.exited, s.has_target, s.speculates, s.loops, s.position,
        s.token, s.target, s.exit_at, s.remaining, s.count, s.max_count, s.stop_mask, s.tokens,
        s.sampled, s.depths, s.indices, s.phase, s.counts, n, max_rows, vocab, draft_loops,
        LANES=lanes,
        BLOCK_N=triton.next_power_of_2(n), BLOCK_W=triton.next_power_of_2(lanes), num_warps=4,
    )  # fmt: skip
