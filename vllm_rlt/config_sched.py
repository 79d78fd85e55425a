"""The engine settings of scheduling, early exit and speculation (`SchedulerConfig`,
`ExitConfig`, `SpeculativeConfig`), each validated on its own: sections of
`config.EngineConfig` (beside the model and cache sections there), which checks how they
combine with the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.config_fields import check, check_choices_and_types, field_help

SCHEDULING_MODES = ("refill", "no_refill", "mixed")
EXIT_MODES = ("ouro", "ouro_delayed", "trace")
QUEUE_POLICIES = ("fcfs", "priority")
# device runs' length by default (`SchedulerConfig.device_decode_loops`): offline, where every
# request is there from the start, and in the server (one Ouro token's loops at full depth)
OFFLINE_RUN_LOOPS = 16
SERVER_RUN_LOOPS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field_help("most requests running at once (and so per batch)", default=8)
    max_num_batched_tokens: int = field_help(
        "most rows in one recurrent-core invocation", default=1024
    )
    prefill_chunk_size: int | None = field_help(
        "prompt positions per prefill chunk (default: max_num_batched_tokens)", default=None
    )
    scheduling_mode: str = field_help(
        "refill: prefill and decode in separate batches; no_refill: decode cohorts; "
        "mixed: prefill rows fill the budget beside decode rows",
        choices=SCHEDULING_MODES,
        default="mixed",
    )
    queue_policy: str = field_help(
        "fcfs or priority (lower value first, then arrival)",
        choices=QUEUE_POLICIES,
        default="fcfs",
    )
    wavefront_chunked_prefill: bool = field_help(
        "WCPB: batch ready (prompt chunk, depth) tasks of all requests into each invocation",
        default=False,
    )
    max_prefill_stall_loops: int | None = field_help(
        "latency rule: a batch (prefill-only, or decode rows with no exit decision due) runs at "
        "most this many loops before the scheduler decides again, so arrivals wait at most that "
        "long (default: no limit)",
        default=None,
    )
    device_decode_loops: int | None = field_help(
        "a decode-only step whose tokens exit early (gate or trace) runs up to this many "
        "invocations with exit decisions, sampling and the next token's entry on the device, "
        "with no host work between them (beside a prefill batch: that batch's loops); its "
        "tokens come back together after the step "
        "(0 or 1: the host decides after every loop that reads a gate; default: "
        f"{OFFLINE_RUN_LOOPS} offline, {SERVER_RUN_LOOPS} in the server, where requests arrive "
        "while a run goes on: streams get their tokens and arrivals their turn about as often "
        "as at fixed depth)",
        default=None,
    )
    async_scheduling: bool = field_help(
        "schedule and queue each step before the tokens of the one before are read back, so "
        "the GPU does not idle while the host prepares a step (a step's outputs come with the "
        "next step)",
        default=True,
    )
    max_prefill_rows_with_decode: int | None = field_help(
        "latency rule: an invocation that carries decode rows takes at most this many prefill "
        "rows (default: half of max_num_batched_tokens with WCPB, otherwise whatever budget the "
        "decode rows leave)",
        default=None,
    )
    max_prefill_rows_per_decode_token: int | None = field_help(
        "latency rule: a decode token rides at most this many prefill rows summed over the "
        "invocations of its loops, while the engine holds fewer requests than max_num_seqs; "
        "its other loops run in decode-only invocations, so fewer, shorter gaps between tokens "
        "wait for prefill (default: half of max_num_batched_tokens with WCPB, one capped "
        "invocation, otherwise no limit; max_num_batched_tokens x loops or more: no limit)",
        default=None,
    )
    max_context_with_decode: int = field_help(
        "decode rows share invocations with prefill rows only while no prompt in prefill is "
        "longer than this and no decoding request is past this position; otherwise decode "
        "steps (all their loops) and prefill batches of the whole budget alternate "
        "(fixed-depth decoding only). A mixed invocation lasts as long as its longest-context "
        "row, so past some context a riding decode row costs more than a decode invocation of "
        "its own (docs/design/scheduler.md R7; 0: always apart; max_model_len or more: never)",
        default=2048,
    )

    @property
    def run_loops(self) -> int:
        """`device_decode_loops`, its offline default if unset."""
        runs = self.device_decode_loops
        return OFFLINE_RUN_LOOPS if runs is None else runs

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        chunk = self.prefill_chunk_size
        check(chunk is None or chunk >= 1, "prefill_chunk_size", chunk, ">= 1")
        stall = self.max_prefill_stall_loops
        check(stall is None or stall >= 1, "max_prefill_stall_loops", stall, ">= 1")
        runs = self.device_decode_loops
        check(runs is None or runs >= 0, "device_decode_loops", runs, ">= 0")
        cap = self.max_prefill_rows_with_decode
        check(cap is None or cap >= 1, "max_prefill_rows_with_decode", cap, ">= 1")
        ride = self.max_prefill_rows_per_decode_token
        check(ride is None or ride >= 1, "max_prefill_rows_per_decode_token", ride, ">= 1")
        apart = self.max_context_with_decode
        check(apart >= 0, "max_context_with_decode", apart, ">= 0")

    @property
    def prefill_rows_with_decode(self) -> int | None:
        """The cap `max_prefill_rows_with_decode` puts in force (None: no cap). WCPB fills its
        invocations with ready tasks of every depth, so decode rows beside them would ride
        invocations up to the whole budget; half of it keeps their ITL tail at Split's
        (docs/benchmarks/wcpb-matrix.md §4)."""
        return self._wcpb_half_budget(self.max_prefill_rows_with_decode)

    @property
    def prefill_rows_per_decode_token(self) -> int | None:
        """The ride limit `max_prefill_rows_per_decode_token` puts in force (None: none). WCPB's
        default lets a token ride one invocation's cap of prefill rows: in the matrix's arrival
        cells that keeps its ITL tail at Split's (docs/benchmarks/wcpb-matrix.md §3)."""
        return self._wcpb_half_budget(self.max_prefill_rows_per_decode_token)

    def _wcpb_half_budget(self, value: int | None) -> int | None:
        """A latency rule's value in force: the user's, else half the budget with WCPB (None:
        no limit)."""
        if value is not None:
            return value
        return max(1, self.max_num_batched_tokens // 2) if self.wavefront_chunked_prefill else None

    @property
    def chunk_size(self) -> int:
        return self.prefill_chunk_size or self.max_num_batched_tokens


@dataclass(frozen=True)
class ExitConfig:
    exit_mode: str = field_help(
        "ouro: exit when the gate's exit CDF reaches the threshold; ouro_delayed: one loop "
        "later; trace: replay given exit depths",
        choices=EXIT_MODES,
        default="ouro",
    )
    exit_threshold: float | None = field_help(
        "default CDF threshold in [0, 1] (1 = fixed depth); default: the model config's",
        default=None,
    )
    trace_seed: int | None = field_help(
        "trace mode: draw each decode token's loops from this seed when a request gives no "
        "trace (default: such tokens run max_loops)",
        default=None,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        t = self.exit_threshold
        check(t is None or 0.0 <= t <= 1.0, "exit_threshold", t, "in [0, 1]")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = field_help(
        "self-speculative decoding: tokens a decoding request drafts with fewer loops before "
        "the full-depth model checks them (0: off). At fixed depth in windows; with the exit "
        "gate in device runs, greedy requests only, at most loops - 1 drafts in flight "
        "(docs/design/speculative.md)",
        default=0,
    )
    speculative_draft_loops: int = field_help(
        "loops a draft token runs (1 <= loops < the model's depth)", default=1
    )
    speculative_max_decode_rows: int = field_help(
        "speculation is off for a window or device run that starts while more requests than "
        "this decode (verify rows multiply the rows per invocation, which stops paying once "
        "invocations leave the weight-bound regime)",
        default=8,
    )
    speculative_fallback: bool = field_help(
        "measure output tokens/s with speculation and without it at the current load (phases "
        "of steps, on the engine's clock) and speculate only while it measures faster "
        "(docs/design/speculative.md §5); outputs are the same either way",
        default=True,
    )
    speculative_invocation_costs: str | None = field_help(
        "adaptive rule: measured cost of one recurrent-core invocation by rows, as "
        "'rows:cost,rows:cost,...' (any unit, interpolated linearly); with it each window takes "
        "the number of drafts the cost model predicts fastest, 0 (off) included (default: "
        "none, the row limit alone decides)",
        default=None,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        k = self.num_speculative_tokens
        check(k >= 0, "num_speculative_tokens", k, ">= 0")
        d = self.speculative_draft_loops
        check(d >= 1, "speculative_draft_loops", d, ">= 1")
        rows = self.speculative_max_decode_rows
        check(rows >= 0, "speculative_max_decode_rows", rows, ">= 0")
        if self.speculative_invocation_costs is not None:
            self.invocation_costs()

    def invocation_costs(self) -> tuple[tuple[int, float], ...]:
        """`speculative_invocation_costs` as (rows, cost) points, rows ascending."""
        text = self.speculative_invocation_costs or ""
        want = "'rows:cost,...' with rows >= 1 ascending and costs > 0"
        try:
            points = tuple(
                (int(r), float(c)) for r, c in (p.split(":") for p in text.split(",") if p)
            )
        except ValueError:
            points = ()
        ok = bool(points) and all(r >= 1 and c > 0 for r, c in points)
        ok = ok and all(a[0] < b[0] for a, b in zip(points, points[1:], strict=False))
        check(ok, "speculative_invocation_costs", text, want)
        return points
