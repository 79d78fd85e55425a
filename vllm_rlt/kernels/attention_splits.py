"""How many pieces paged attention splits each tile's KV range into (flash-decoding).

A launch's grid holds a fixed number of splits S per tile (CUDA graphs fix it at capture);
`paged_attention` then gives each tile pieces of ceil(context / S) positions, at least the
policy's `min_len`. The policy depends on the launch: few decode rows want many short pieces to
fill the GPU, prefill tiles and many rows fewer, longer ones.

Decode-only launches of the fine policy also balance the work (`decode_balance`): the kernel
sizes every row's pieces from the launch's total context, at least total / P positions for P
pieces per KV head in all, so that one long row among short ones is cut into many pieces and
the short rows into few, whatever the contexts at replay time.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


# Automatic KV splits: a launch holding fewer than `split_below` programs per SM before
# splitting splits until the grid holds about `programs_per_sm` programs per SM, each split at
# least `min_len` positions long. Decode-only launches of at most FINE_MAX_FILL programs per SM
# before splitting (up to 32 rows of Ouro-1.4B's 16 heads on an H200) split finer: at 512-1024
# positions 1-8 rows run up to 19% faster in 128-position splits up to ~2 programs per SM, and
# 16-32 rows 5-15% faster with it and their own launch configs (2 splits at 16 rows, none at 32:
# `paged_attention.decode_config_for`; docs/design/runner.md §4). Launches with prefill tiles
# that hold 2 programs per SM already do not split, as mixed CUDA graphs never do: eagerly, a
# 2,048-row prefill invocation ran 8-13% faster unsplit (H100, docs/design/runner.md §4).
@dataclass(frozen=True)
class SplitPolicy:
    programs_per_sm: int
    min_len: int
    split_below: int


SPLITS = SplitPolicy(programs_per_sm=8, min_len=256, split_below=8)
CHUNK_SPLITS = SplitPolicy(programs_per_sm=8, min_len=256, split_below=2)
DECODE_SPLITS = SplitPolicy(programs_per_sm=2, min_len=128, split_below=2)
MAX_SPLITS = 64
FINE_MAX_FILL = 4  # programs per SM before splitting up to which decode-only launches split finer


def split_policy(num_programs: int, decode_only: bool, num_sms: int) -> SplitPolicy:
    """The split policy of a launch of `num_programs` (tiles x KV heads) before splitting."""
    if not decode_only:
        return CHUNK_SPLITS
    return DECODE_SPLITS if num_programs <= FINE_MAX_FILL * num_sms else SPLITS


# Balanced decode launches: about BALANCE_PROGRAMS_PER_SM programs per SM over all rows' pieces,
# in a grid of up to BALANCE_GRID_PER_SM programs per SM, idle splits included (programs past
# their row's context exit at once). Measured on the H200 (docs/design/runner.md §4): one row at
# 10,240 positions beside 7 at 600 takes 84 us per attention call in 3 even splits, 48 in
# 16; 8 rows at 600 or 2,048 positions run fastest in 2 pieces each.
BALANCE_PROGRAMS_PER_SM = 2
BALANCE_GRID_PER_SM = 16


def decode_balance(
    num_programs: int, num_kv_heads: int, max_context: int, num_sms: int
) -> tuple[int, int]:
    """(splits in the grid, pieces per KV head over all rows) of a balanced decode-only launch
    of `num_programs` (rows x KV heads) before splitting, at most `max_context` positions."""
    pieces = max(1, BALANCE_PROGRAMS_PER_SM * num_sms // num_kv_heads)
    by_fill = choose_num_splits(num_programs, max_context, num_sms, DECODE_SPLITS)
    by_grid = min(pieces, triton.cdiv(BALANCE_GRID_PER_SM * num_sms, num_programs))
    by_len = max(1, max_context // DECODE_SPLITS.min_len)
    return max(1, min(max(by_fill, by_grid), by_len, MAX_SPLITS)), pieces


def choose_num_splits(
    num_programs: int, max_context: int, num_sms: int, policy: SplitPolicy = SPLITS
) -> int:
    """KV splits per tile in the grid so that it holds about policy.programs_per_sm programs per
    SM, each split covering >= policy.min_len at `max_context`; none for a grid of at least
    policy.split_below programs per SM (at most policy.programs_per_sm)."""
    target = num_sms * policy.programs_per_sm
    if num_programs >= num_sms * policy.split_below:
        return 1
    by_fill = triton.cdiv(target, num_programs)
    by_len = max(1, max_context // policy.min_len)
    return max(1, min(by_fill, by_len, MAX_SPLITS))


def launch_splits(
    num_programs: int, num_kv_heads: int, max_context: int, num_sms: int, decode_only: bool
) -> tuple[SplitPolicy, int, int]:
    """(policy, splits in the grid, balanced pieces per KV head or 0) of a launch of
    `num_programs` (tiles x KV heads) whose split count is automatic."""
    policy = split_policy(num_programs, decode_only, num_sms)
    if policy is DECODE_SPLITS:
        return policy, *decode_balance(num_programs, num_kv_heads, max_context, num_sms)
    return policy, choose_num_splits(num_programs, max_context, num_sms, policy), 0
