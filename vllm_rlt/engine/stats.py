"""Engine counters: invocations, rows per invocation, loops per generated token."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.core.sched.execution_batch import ExecutionBatch, RowKind


@dataclass
class EngineStats:
    steps: int = 0
    invocations: int = 0  # recurrent-core calls
    rows: int = 0  # rows over all invocations
    prefill_rows: int = 0
    prefill_invocations: int = 0  # invocations that carried at least one prefill row
    generated_tokens: int = 0
    generated_loops: int = 0  # sum of the exit depths of generated tokens

    def record_batch(self, batch: ExecutionBatch, num_loops: int) -> None:
        self.steps += 1
        for i in range(batch.loop_count):
            live = batch.live(i, num_loops)
            if not live:
                break
            prefill = sum(t.num_tokens for t in live if t.kind is RowKind.PREFILL)
            self.invocations += 1
            self.rows += sum(t.num_tokens for t in live)
            self.prefill_rows += prefill
            self.prefill_invocations += prefill > 0

    def record_token(self, exit_depth: int) -> None:
        self.generated_tokens += 1
        self.generated_loops += exit_depth

    @property
    def rows_per_invocation(self) -> float:
        return self.rows / self.invocations if self.invocations else 0.0

    @property
    def prefill_rows_per_prefill_invocation(self) -> float:
        return self.prefill_rows / self.prefill_invocations if self.prefill_invocations else 0.0

    @property
    def loops_per_token(self) -> float:
        return self.generated_loops / self.generated_tokens if self.generated_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **self.__dict__,
            "rows_per_invocation": self.rows_per_invocation,
            "prefill_rows_per_prefill_invocation": self.prefill_rows_per_prefill_invocation,
            "loops_per_token": self.loops_per_token,
        }
