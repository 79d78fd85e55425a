"""Server metrics in the Prometheus text format, written by hand.

Request timings (TTFT, inter-token latency, end-to-end latency), token counters and the exit
depth of every generated token are observed as outputs stream out of the engine; the gauges and
the looped-model counters come from the engine snapshot taken between steps.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import AsyncIterator

from vllm_rlt.engine.async_engine import EngineSnapshot
from vllm_rlt.outputs import RequestOutput

PREFIX = "vllm_rlt:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        name = PREFIX + self.name
        lines = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        total = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else _num(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {total}')
        lines += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return lines


def _num(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else str(int(x)) + ".0"


def _metric(kind: str, name: str, help: str, value: float) -> list[str]:
    name = PREFIX + name
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_num(value)}"]


class ServerMetrics:
    def __init__(self, num_loops: int = 4):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.ttft = Histogram(
            "time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        )
        self.exit_depth = Histogram(
            "exit_depth",
            "Loops run by each generated token (its exit depth, 1..D).",
            tuple(float(d) for d in range(1, num_loops + 1)),
        )

    async def track(self, stream) -> AsyncIterator[RequestOutput]:
        """Pass `stream`'s outputs through, observing timings, tokens and exit depths; a stream
        closed before its request finished counts as an abort."""
        start = last = time.monotonic()
        seen: dict[int, int] = {}  # tokens already counted per sample
        finished = False
        try:
            async for out in stream:
                now = time.monotonic()
                if not seen:
                    self.prompt_tokens += len(out.prompt_token_ids)
                new = 0
                for comp in out.outputs:
                    done = seen.get(comp.index, 0)
                    for depth in comp.exit_depths[done:]:
                        self.exit_depth.observe(depth)
                    new += len(comp.token_ids) - done
                    seen[comp.index] = len(comp.token_ids)
                if new:
                    first = sum(seen.values()) == new
                    self.generation_tokens += new
                    if first:
                        self.ttft.observe(now - start)
                    else:
                        self.itl.observe((now - last) / new)
                    last = now
                finished = out.finished
                if finished:
                    self.e2e.observe(now - start)
                    for comp in out.outputs:
                        self._count_finish(comp.finish_reason or "abort")
                yield out
        finally:
            if not finished:
                self._count_finish("abort")

    def _count_finish(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def render(self, snap: EngineSnapshot) -> str:
        stats = snap.stats
        lines = [
            *_metric("gauge", "num_requests_running", "Requests running.", snap.num_running),
            *_metric("gauge", "num_requests_waiting", "Requests waiting.", snap.num_waiting),
            *_metric("gauge", "kv_cache_usage_perc", "KV blocks in use (0-1).", snap.kv_usage),
            *_metric("gauge", "num_free_kv_blocks", "Free KV blocks.", snap.num_free_blocks),
            *_metric("gauge", "num_total_kv_blocks", "KV blocks.", snap.num_total_blocks),
            *_metric(
                "counter",
                "num_preemptions_total",
                "Requests preempted (KV freed; they recompute when they resume).",
                snap.num_preemptions,
            ),
            *_metric(
                "counter",
                "prefix_cache_queries_total",
                "Prompt positions looked up in the prefix cache.",
                snap.prefix_cache_queries,
            ),
            *_metric(
                "counter",
                "prefix_cache_hits_total",
                "Prompt positions found in the prefix cache.",
                snap.prefix_cache_hits,
            ),
            *_metric("counter", "prompt_tokens_total", "Prompt tokens.", self.prompt_tokens),
            *_metric(
                "counter", "generation_tokens_total", "Generated tokens.", self.generation_tokens
            ),
        ]
        name = PREFIX + "kv_cache_usage_perc_by_plane"
        lines += [
            f"# HELP {name} KV blocks in use in each depth plane, of all blocks (0-1).",
            f"# TYPE {name} gauge",
        ]
        for plane, usage in enumerate(snap.kv_plane_usage):
            lines.append(f'{name}{{plane="{plane}"}} {_num(usage)}')
        name = PREFIX + "request_success_total"
        lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
        for reason, n in sorted(self.requests_finished.items()):
            lines.append(f'{name}{{finished_reason="{reason}"}} {n}')
        for hist in (self.ttft, self.itl, self.e2e, self.exit_depth):
            lines += hist.render()
        looped = [
            ("invocations", "Recurrent-core invocations."),
            ("rows", "Rows over all invocations."),
            ("tasks", "Tasks (row ranges of one request at one depth) over all invocations."),
        ]
        for key, help in looped:
            lines += _metric("counter", f"{key}_total", help, stats.get(key, 0))
        for key, help in [
            ("rows_per_invocation", "Mean rows per recurrent-core invocation."),
            ("tasks_per_invocation", "Mean tasks per recurrent-core invocation."),
            ("loops_per_token", "Mean loops (exit depth) per generated token."),
        ]:
            lines += _metric("gauge", key, help, stats.get(key, 0.0))
        return "\n".join(lines) + "\n"
