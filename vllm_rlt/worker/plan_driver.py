"""Hand-made plans for the model runner: `vllm-rlt inspect` and the model and kernel tests run
rows of their choosing (requests, positions, depths) through the real `ModelRunner` and see every
invocation's output states and gate logits (`ModelRunner.observer`).

The driver takes the scheduler's part in the simplest way. A request holds every position of its
tokens from the start: blocks on every plane from a free list, and a hidden-state ring row per
position. Its rows are prompt rows (`prompt_rows`): depth 0 enters through the prelude with the
token at that position, a deeper row takes the state its position's row left in the ring, so a
position runs its depths in order, in whatever invocations. Only plans cross to the runner: a
request's data and block tables, the rows of each invocation, the skipped-depth copies of a token
that stops early, and a request's end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_rlt.config import KVLayout
from vllm_rlt.core.sched.execution_batch import (
    ExecutionBatch,
    NewRequestData,
    RowKind,
    ScheduledRequest,
)
from vllm_rlt.worker.hidden_state import HiddenStateStore
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.model_runner import ModelRunner
from vllm_rlt.worker.spec_windows import WindowTokens


def prompt_rows(req_id: str, token_start: int, num_tokens: int, depth: int) -> ScheduledRequest:
    """`num_tokens` rows of a driver's request from position `token_start`, at `depth` in their
    first invocation."""
    return ScheduledRequest(
        req_id,
        RowKind.PREFILL,
        token_start,
        num_tokens,
        depth,
        prefill_hidden_row_offset=token_start,
    )


class PlanDriver:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        layout: KVLayout | str = KVLayout.LAST_EXITED,
        max_num_seqs: int = 16,
        tile_rows: int = 16,
    ):
        """A runner over `model` (eager; a test may give `runner.graphs`) with a KV cache of
        `num_blocks` blocks on the model's device and dtype, for up to `max_num_seqs` requests
        at once; `tile_rows`: rows per multi-row attention tile (the tests' short prompts span
        several)."""
        self.num_loop_planes = KVLayout(layout).num_planes(model.num_loops)
        self.num_planes = self.num_loop_planes + model.num_edge_planes
        self.block_size = block_size
        self.kv_cache = DeviceKVCache.for_model(model, num_blocks, block_size)
        weight = model.lm_head.weight
        max_tokens = num_blocks // self.num_planes * block_size  # the longest request
        states = HiddenStateStore(
            max_num_seqs, max_tokens, model.state_size, weight.dtype, weight.device
        )
        windows = WindowTokens(max_num_seqs, 0, model.config.vocab_size, weight.device)
        self.runner = ModelRunner(
            model, self.kv_cache, states, windows, self.num_loop_planes, tile_rows=tile_rows
        )
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # since the last `run`
        self.runner.observer = lambda out, gate: self._seen.append((out.clone(), gate.clone()))
        self.tables: dict[str, tuple[tuple[int, ...], ...]] = {}  # req_id -> blocks per plane
        self._free = list(range(num_blocks - 1, -1, -1))  # free blocks, the next one last

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def add(
        self, req_id: str, token_ids: Sequence[int], seed: int = 0, init_scale: float = 0.0
    ) -> None:
        """A request whose rows may run at any position of `token_ids` (`seed`, `init_scale`: a
        random initial state's, Huginn)."""
        per_plane = -(-len(token_ids) // self.block_size)
        if per_plane * self.num_planes > len(self._free):
            need = per_plane * self.num_planes
            raise ValueError(f"{req_id!r} needs {need} KV blocks, {len(self._free)} are free")
        tables = tuple(
            tuple(self._free.pop() for _ in range(per_plane)) for _ in range(self.num_planes)
        )
        self.tables[req_id] = tables
        data = NewRequestData(
            req_id, tuple(token_ids), ring_slots=1, chunk_size=len(token_ids), temperature=0.0,
            top_k=0, top_p=1.0, min_p=0.0, seed=seed, num_logprobs=-1, num_prompt_logprobs=-1,
            init_scale=init_scale,
        )  # fmt: skip
        batch = ExecutionBatch((), 0, new_requests=(data,), block_tables=((req_id, tables),))
        self.runner.execute(batch)

    def finish(self, req_id: str) -> None:
        """The request ends: the runner forgets it, its blocks are free (their KV stays)."""
        self._free.extend(block for table in self.tables.pop(req_id) for block in table)
        self.runner.execute(ExecutionBatch((), 0, finished_req_ids=(req_id,)))

    def run(
        self, tasks: Sequence[ScheduledRequest], loop_count: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`loop_count` invocations over `tasks` (`prompt_rows`; each one depth further in
        each, none past the last depth): output states [loop_count, R, S] and gate logits
        [loop_count, R] fp32, rows in task order."""
        self.runner.execute(ExecutionBatch(tuple(tasks), loop_count))
        seen, self._seen = self._seen, []
        return torch.stack([out for out, _ in seen]), torch.stack([gate for _, gate in seen])

    def prefill_all_depths(
        self,
        req_id: str,
        token_ids: Sequence[int],
        chunk_size: int | None = None,
        seed: int = 0,
        init_scale: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a request and run its tokens through every depth, chunk by chunk (a chunk's loops
        in one plan). Returns per-depth states [D, S, H] and gate logits [D, S]."""
        self.add(req_id, token_ids, seed, init_scale)
        seq, num_loops = len(token_ids), self.runner.num_loops
        chunk = chunk_size or seq
        runs = [
            self.run([prompt_rows(req_id, start, min(chunk, seq - start), 0)], num_loops)
            for start in range(0, seq, chunk)
        ]
        return torch.cat([s for s, _ in runs], 1), torch.cat([g for _, g in runs], 1)

    def exit(self, req_id: str, positions: Sequence[int], exit_depths: Sequence[int]) -> None:
        """The tokens at `positions` stopped after 0-based depth `exit_depths[i]`: their K/V
        there fills the loop planes they skipped (one plane: nothing to fill)."""
        copies = tuple(
            (self.slot(req_id, depth, pos), self.slot(req_id, plane, pos))
            for pos, depth in zip(positions, exit_depths, strict=True)
            for plane in range(depth + 1, self.num_loop_planes)
        )
        self.runner.execute(ExecutionBatch((), 0, kv_copies=copies))

    def logits(self, req_id: str, states: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [N, V] of candidate final states [N, S] of `req_id`'s `position`, one at a
        time (a coda with attention rewrites that position's K/V for each)."""
        return torch.cat([self.runner.coda_logits(req_id, s[None], position) for s in states])

    def slot(self, req_id: str, plane: int, position: int) -> int:
        """The flat KV slot of `position` in `plane` of `req_id`."""
        block = self.tables[req_id][plane][position // self.block_size]
        return block * self.block_size + position % self.block_size
