"""Engine counters (invocations, rows, tasks, depth mix, loops per token), an optional trace
of which tasks ran in which invocation (for the wavefront picture), and the gauges an engine
reports between steps (`EngineSnapshot`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm_rlt.core.sched.execution_batch import ExecutionBatch, RowKind


@dataclass(frozen=True)
class TraceRecord:
    invocation: int  # global invocation index
    request_id: str
    kind: str  # "prefill" or "decode"
    token_start: int
    num_tokens: int
    depth: int  # depth the rows ran in this invocation


@dataclass
class EngineStats:
    steps: int = 0
    invocations: int = 0  # recurrent-core calls
    rows: int = 0  # rows over all invocations
    tasks: int = 0  # tasks (row ranges of one request at one depth) over all invocations
    prefill_rows: int = 0
    prefill_invocations: int = 0  # invocations that carried at least one prefill row
    generated_tokens: int = 0
    generated_loops: int = 0  # sum of the exit depths of generated tokens
    depth_rows: Counter = field(default_factory=Counter)  # depth -> rows run at that depth
    trace: list[TraceRecord] | None = None  # set to [] to record every task

    def record_batch(self, batch: ExecutionBatch, num_loops: int) -> None:
        self.steps += 1
        for i in range(batch.loop_count):
            live = batch.live(i, num_loops)
            if not live:
                break
            prefill = sum(t.num_tokens for t, _ in live if t.kind is RowKind.PREFILL)
            for t, depth in live:
                self.depth_rows[depth] += t.num_tokens
                if self.trace is not None:
                    self.trace.append(
                        TraceRecord(
                            self.invocations,
                            t.request_id,
                            t.kind.value,
                            t.token_start,
                            t.num_tokens,
                            depth,
                        )
                    )
            self.invocations += 1
            self.tasks += len(live)
            self.rows += sum(t.num_tokens for t, _ in live)
            self.prefill_rows += prefill
            self.prefill_invocations += prefill > 0

    def record_token(self, exit_depth: int) -> None:
        self.generated_tokens += 1
        self.generated_loops += exit_depth

    def as_dict(self) -> dict[str, float]:
        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        counters = {k: v for k, v in self.__dict__.items() if isinstance(v, int)}
        return {
            **counters,
            "rows_per_invocation": ratio(self.rows, self.invocations),
            "tasks_per_invocation": ratio(self.tasks, self.invocations),
            "prefill_rows_per_prefill_invocation": ratio(
                self.prefill_rows, self.prefill_invocations
            ),
            "loops_per_token": ratio(self.generated_loops, self.generated_tokens),
            **{f"rows_at_depth_{d}": n for d, n in sorted(self.depth_rows.items())},
        }


@dataclass(frozen=True)
class KVCapacity:
    """What the engine's KV cache holds (fixed once the engine is built)."""

    num_blocks: int  # blocks of each plane
    block_size: int  # positions per block
    num_planes: int  # KV planes (loop depths, plus edge planes)
    max_tokens_per_request: int  # most positions one request can hold in every plane


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges read on the loop between steps (safe to read from anywhere)."""

    num_running: int = 0  # requests (samples) running
    num_waiting: int = 0  # requests (samples) waiting for admission
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_plane_usage: tuple[float, ...] = ()  # per KV plane: its blocks in use / all blocks
    num_preemptions: int = 0  # requests preempted so far (their KV freed, recomputed later)
    prefix_cache_queries: int = 0  # prompt positions looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt positions found there
    stats: dict[str, float] = field(default_factory=dict)  # LLMEngine.stats_dict()

    @classmethod
    def of(cls, scheduler, kv, stats: dict[str, float]) -> EngineSnapshot:
        """The gauges of a `Scheduler` and its `KVCacheManager` now, with `stats`."""
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            kv_plane_usage=tuple(n / kv.num_total_blocks for n in kv.pool.plane_usage()),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_queries,
            prefix_cache_hits=scheduler.prefix_hits,
            stats=stats,
        )
