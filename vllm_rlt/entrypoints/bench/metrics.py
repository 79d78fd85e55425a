"""Per-request records and the metrics of docs/benchmarks/README.md §2 (vLLM `bench serve`
definitions), and the percentile table the `vllm-rlt bench` commands print."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    send_s: float  # when the request was sent (after the concurrency semaphore)
    prompt_tokens: int
    chunk_s: list[float] = field(default_factory=list)  # arrivals of token-bearing chunks
    output_tokens: int = 0
    ok: bool = True

    @property
    def ttft(self) -> float:
        return self.chunk_s[0] - self.send_s

    @property
    def e2e(self) -> float:
        return self.chunk_s[-1] - self.send_s


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if len(values) == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": float(a.mean())}
    out.update({f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)})
    return out


def percentile_table(rows: dict[str, dict[str, float]]) -> str:
    """A text table of `percentiles()` results in milliseconds, one row per metric."""
    columns = ("mean", "p50", "p90", "p99")
    width = max(len(name) for name in rows)
    lines = [f"{'(ms)':<{width}}" + "".join(f"{c:>11}" for c in columns)]
    for name, values in rows.items():
        lines.append(f"{name:<{width}}" + "".join(f"{values[c] * 1e3:>11.2f}" for c in columns))
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    """A summary's numbers, one per line, then its percentiles (the `*_s` dicts) as a table."""
    lines = [
        f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}"
        for name, value in summary.items()
        if not isinstance(value, dict)
    ]
    rows = {k.removesuffix("_s").upper(): v for k, v in summary.items() if isinstance(v, dict)}
    return "\n".join([*lines, percentile_table(rows)])


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """TTFT, TPOT, ITL (pooled), E2E percentiles in seconds; request and token throughput."""
    done = [r for r in records if r.ok and r.chunk_s]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [b - a for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.e2e for r in done]),
    }


def engine_counters(before: dict, after: dict, num_requests: int) -> dict:
    """Engine counters of one run (`LLMEngine.stats_dict()` before and after it) and the ratios
    of docs/benchmarks/README.md §2: rows per invocation, prefill rows per prefill invocation,
    invocations per request (whose Split / WCPB quotient is the invocation bound), loops per
    generated token; with speculation, the run's acceptance rate and mean accepted length
    (tokens per window)."""
    counters = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}

    def ratio(a: str, b: str) -> float:
        return counters[a] / counters[b] if counters.get(b) else 0.0

    spec = {}
    if "spec_windows" in counters:
        spec = {
            "spec_acceptance_rate": ratio("spec_accepted_tokens", "spec_draft_tokens"),
            "spec_mean_accepted_length": 1 + ratio("spec_accepted_tokens", "spec_windows"),
        }
    return {
        **counters,
        **spec,
        "rows_per_invocation": ratio("rows", "invocations"),
        "tasks_per_invocation": ratio("tasks", "invocations"),
        "prefill_rows_per_prefill_invocation": ratio("prefill_rows", "prefill_invocations"),
        "invocations_per_request": counters["invocations"] / num_requests,
        "loops_per_token": ratio("generated_loops", "generated_tokens"),
    }


def device_events(trace_events: list[dict]) -> list[dict]:
    """The GPU activities (kernels, copies, memsets) of a Chrome trace's `traceEvents`."""
    return [
        e
        for e in trace_events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]


def device_time_by_name(trace_events: list[dict]) -> list[tuple[str, float, int]]:
    """(name cut to 90 characters, summed GPU microseconds, count) per GPU activity name, the
    most time first."""
    counts, micros = Counter(), Counter()
    for e in device_events(trace_events):
        counts[e["name"][:90]] += 1
        micros[e["name"][:90]] += e["dur"]
    return [(name, round(us, 1), counts[name]) for name, us in micros.most_common()]


def gpu_busy_seconds(trace_events: list[dict]) -> float:
    """Seconds during which the GPU ran something (kernels, copies, memsets) in a Chrome trace's
    `traceEvents`, overlapping activities merged."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in device_events(trace_events))
    busy, end = 0.0, -math.inf
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6
