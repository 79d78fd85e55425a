"""The bookkeeping of device runs in torch ops: the four functions of `kernels/run_rows.py`, same
signatures, same results bit for bit (the kernels' test oracle). Device runs use these off CUDA,
where the Triton interpreter would run each kernel's programs in Python."""

from __future__ import annotations

import torch

from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.run_state import oldest_lanes


def _live(s, r: int) -> torch.Tensor:
    return ~(s.done[:r] | s.ready[:r])


def _slots(s, r: int, plane: torch.Tensor, position: torch.Tensor, block_size: int):
    """Flat KV slots of `position` in `plane` (both [r] or [r, P]) of the first r rows."""
    index = torch.arange(r, device=plane.device).view(-1, *([1] * (plane.dim() - 1)))
    column = (position // block_size).clamp(max=s.tables.shape[2] - 1)
    return s.tables[index.expand_as(plane), plane, column] * block_size + position % block_size


def enter_rows(s, r: int, entry: torch.Tensor, buffer: torch.Tensor, scratch: int,
               block_size: int) -> None:  # fmt: skip
    """`kernels/run_rows.enter_rows`."""
    live, loops, positions = _live(s, r), s.loops[:r], s.position[:r]
    plane = loops.clamp(max=s.tables.shape[1] - 1)
    slots = _slots(s, r, plane, positions, block_size)
    s.slot_mapping[:r].copy_(torch.where(live, slots, scratch))
    s.seg_starts[:r].copy_(positions)
    s.meta_tables[:r].copy_(s.tables[torch.arange(r, device=plane.device), plane])
    entering = (live & (loops == 0))[:, None]
    s.hidden[:r].copy_(torch.where(entering, entry.to(buffer.dtype), buffer[s.state_rows[:r]]))


def exit_rows(s, r: int, mode: str, gate: torch.Tensor, out: torch.Tensor,
              buffer: torch.Tensor) -> None:  # fmt: skip
    """`kernels/run_rows.exit_rows`."""
    live, loops, exit_at = _live(s, r), s.loops[:r], s.exit_at[:r]
    buffer[s.state_rows[:r][live]] = out[live].to(buffer.dtype)  # (idle rows may share one)
    loops += live
    if mode == "trace":
        exits = loops >= exit_at
    else:
        pending = exit_at == 0
        reads = live & (s.threshold[:r] < 1.0)
        if mode == "ouro_delayed":
            reads &= pending
        x = gate.double()
        e = torch.exp(-x.abs())
        sigmoid = torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        remaining = s.remaining[:r]
        remaining.copy_(torch.where(reads, remaining * (1.0 - sigmoid), remaining))
        fires = reads & (loops >= s.min_loops[:r]) & (1.0 - remaining >= s.threshold[:r])
        max_loops = s.max_loops[:r]
        if mode == "ouro":
            exits = fires | (loops >= max_loops)
        else:
            exit_at.copy_(
                torch.where(fires & pending, torch.minimum(loops + 1, max_loops), exit_at)
            )
            exits = loops >= torch.where(exit_at == 0, max_loops, exit_at)
    s.exited[:r].copy_(exits & live)
    s.ready[:r] |= s.exited[:r]


def fill_skipped(s, r: int, kv_cache: DeviceKVCache) -> None:
    """`kernels/run_rows.fill_skipped`."""
    block_size = kv_cache.block_size
    planes = torch.arange(s.tables.shape[1], device=kv_cache.kv.device).expand(r, -1)
    loops = s.loops[:r, None]
    fill = s.exited[:r, None] & (planes >= loops)
    position = s.position[:r, None].expand_as(planes)
    src = _slots(s, r, (loops - 1).clamp(min=0).expand_as(planes), position, block_size)
    dst = _slots(s, r, planes, position, block_size)
    kv_cache.copy_slots(src[fill], dst[fill])


def take_tokens(s, r: int, token_ids: torch.Tensor, window_tokens: torch.Tensor) -> None:
    """`kernels/run_rows.take_tokens`."""
    phase = s.phase
    now = s.ready[:r] & ~s.done[:r]
    s.tokens[:, :r].index_copy_(0, phase, token_ids[None])
    s.sampled[:, :r].index_copy_(0, phase, now[None])
    s.depths[:, :r].index_copy_(0, phase, s.loops[None, :r])
    window_tokens[s.slots[:r][now], 0] = token_ids[now]
    count = s.count[:r]
    count += now
    stop = s.stop_mask[:r].gather(1, token_ids[:, None])[:, 0]
    ends = now & ((count >= s.max_count[:r]) | stop)
    s.done[:r] |= ends
    start = now & ~ends
    s.ready[:r] &= ~now
    s.loops[:r].masked_fill_(now, 0)
    s.remaining[:r].masked_fill_(start, 1.0)
    s.position[:r] += start
    column = (count - 1 - s.base[:r]).clamp(0, s.trace.shape[1] - 1)
    traced = s.trace[:r].gather(1, column[:, None])[:, 0]
    s.exit_at[:r].copy_(torch.where(start, traced, s.exit_at[:r]))
    phase += 1


def take_lanes(s, n: int, lanes: int, draft_loops: int, token_ids: torch.Tensor) -> None:
    """`kernels/run_rows.take_lanes` in torch ops (its oracle; what runs off CUDA): after a
    sample phase of a run with lanes (`n` rows of `lanes` lanes, docs/design/speculative.md §3;
    `token_ids` [n * lanes]), lanes whose token exited keep the token sampled from their state
    (their target); from the row's oldest lane on, each target is taken (the row's next output
    token, recorded with its output index) while the lane after it holds that very token (an
    accepted draft: it goes on), else the lanes after it are dropped and the target enters the
    next position at depth 0; then the newest lane drafts the next position from its state once
    its token ran `draft_loops` loops or exited."""
    w, r = lanes, n * lanes
    lane = torch.arange(w, device=token_ids.device)

    def grid(t):
        return t[:r].view(n, w)

    done, ready, loops, pos = grid(s.done), grid(s.ready), grid(s.loops), grid(s.position)
    token, target, has_target = grid(s.token), grid(s.target), grid(s.has_target)
    drawn = token_ids[:r].view(n, w)
    fresh = ready & ~done & ~has_target
    target.copy_(torch.where(fresh, drawn, target))
    has_target |= fresh
    count, max_count = grid(s.count)[:, 0].clone(), grid(s.max_count)[:, 0]
    stops = s.stop_mask[:r].view(n, w, -1)[:, 0]
    record = [torch.zeros_like(drawn) for _ in range(3)]  # token, depth, output index
    taken = torch.zeros_like(done)
    cur = oldest_lanes(done, pos)
    go = ~done.all(1)
    accepted = torch.zeros_like(count)
    # the lane each row starts at depth 0 (at most one: after a restart no lane drafts)
    starts = torch.zeros_like(go)
    start_lane, start_token, start_position = (torch.zeros_like(count) for _ in range(3))

    def starting(mask, lane_, tok, position) -> None:
        starts.logical_or_(mask)
        for into, value in zip((start_lane, start_token, start_position), (lane_, tok, position),
                               strict=True):  # fmt: skip
            into.copy_(torch.where(mask, value, into))

    for _ in range(w):
        at = lane == cur[:, None]
        go = go & (at & ~done & has_target).any(1)
        hot = at & go[:, None]
        tok = (target * at).sum(1)
        taken |= hot
        for rec, value in zip(record, (tok[:, None], loops, count[:, None]), strict=True):
            rec.copy_(torch.where(hot, value, rec))
        count += go
        ends = go & ((count >= max_count) | stops.gather(1, tok[:, None])[:, 0])
        nxt = (cur + 1) % w
        accept = go & ~ends & ((lane == nxt[:, None]) & ~done & (token == tok[:, None])).any(1)
        accepted += accept
        again = go & ~ends & ~accept
        done |= hot | (ends | again)[:, None]
        starting(again, nxt, tok, (pos * at).sum(1) + 1)
        cur, go = torch.where(accept, nxt, cur), accept
    grid(s.count).copy_(count[:, None].expand(n, w))
    # the newest lane drafts
    length = (~done).sum(1)
    tail = (oldest_lanes(done, pos) + length - 1) % w
    at = lane == tail[:, None]
    exited = (ready & at).any(1)
    draft = torch.where(exited, (target * at).sum(1), (drawn * at).sum(1))
    drafts = (length > 0) & (length < w) & (grid(s.speculates) & at).any(1)
    drafts &= exited | ((loops * at).sum(1) >= draft_loops)
    drafts &= (count + length < max_count) & ~stops.gather(1, draft[:, None])[:, 0]
    starting(drafts, (tail + 1) % w, draft, (pos * at).sum(1) + 1)
    hot = (lane == start_lane[:, None]) & starts[:, None]
    for flags in (done, ready, has_target, grid(s.exited)):
        flags.masked_fill_(hot, False)
    loops.masked_fill_(hot, 0)
    grid(s.exit_at).masked_fill_(hot, 0)
    grid(s.remaining).masked_fill_(hot, 1.0)
    token.copy_(torch.where(hot, start_token[:, None], token))
    pos.copy_(torch.where(hot, start_position[:, None], pos))
    for rec, value in zip((s.tokens, s.depths, s.indices), record, strict=True):
        rec[:, :r].index_copy_(0, s.phase, value.view(1, r))
    s.sampled[:, :r].index_copy_(0, s.phase, taken.view(1, r))
    s.phase += 1
    drafting = grid(s.speculates).any(1)
    s.counts[:, :r:w] += torch.stack((drafts, accepted, taken.sum(1) * drafting)).long()
