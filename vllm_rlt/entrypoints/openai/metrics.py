"""Server metrics for Prometheus (`prometheus_client`, one registry per app).

Names and labels follow vLLM's (`vllm:*`, each with a `model_name` label) for what vLLM also
exports; the looped-model metrics (exit depths, invocations, rows and tasks per invocation, KV
usage by plane) keep the project's prefix `vllm_rlt:`.

How things are counted: a request with k prompts and n samples each is k x n samples (vLLM
runs every sample as its own engine request). Every per-request metric counts samples: each one
ends exactly once, with one `request_success_total` increment (finish reason "stop", "length",
"abort" when its client left or the server stopped, "error" when a fault ended it) and one
observation in each per-request histogram, so those always agree. Token counters match the
responses' `usage`: prompt tokens once per prompt, every generated token once.

Request timings and tokens are observed as outputs stream out of the engine; the gauges and the
engine counters are read from the engine snapshot (taken between steps) at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vllm_rlt.disagg.router import PD_COUNTERS
from vllm_rlt.engine.async_engine import AsyncLLMEngine, EngineStoppedError
from vllm_rlt.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def _1_2_5_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class _EngineCollector:
    """Gauges and engine counters, read from the engine snapshot at each scrape."""

    def __init__(self, model_name: str, engine: AsyncLLMEngine):
        self.model_name, self.engine = model_name, engine

    def collect(self):
        snap, name = self.engine.snapshot, self.model_name
        stats = snap.stats

        def one(family, metric: str, help: str, value: float):
            fam = family(metric, help, labels=["model_name"])
            fam.add_metric([name], value)
            return fam

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield one(g, "vllm:num_requests_running", "Samples running.", snap.num_running)
        yield one(
            g, "vllm:num_requests_waiting", "Samples waiting for admission.", snap.num_waiting
        )
        yield one(g, "vllm:kv_cache_usage_perc", "KV blocks in use (1 = all).", snap.kv_usage)
        yield one(
            c,
            "vllm:num_preemptions",
            "Samples preempted (KV freed, recomputed later).",
            snap.num_preemptions,
        )
        yield one(
            c,
            "vllm:prefix_cache_queries",
            "Prompt positions looked up in the prefix cache.",
            snap.prefix_cache_queries,
        )
        yield one(
            c,
            "vllm:prefix_cache_hits",
            "Prompt positions found in the prefix cache.",
            snap.prefix_cache_hits,
        )
        by_plane = GaugeMetricFamily(
            "vllm_rlt:kv_cache_usage_perc_by_plane",
            "KV blocks in use in each depth plane, of all blocks (1 = all).",
            labels=["model_name", "plane"],
        )
        for plane, usage in enumerate(snap.kv_plane_usage):
            by_plane.add_metric([name, str(plane)], usage)
        yield by_plane
        yield one(g, "vllm_rlt:num_free_kv_blocks", "Free KV blocks.", snap.num_free_blocks)
        yield one(g, "vllm_rlt:num_total_kv_blocks", "KV blocks.", snap.num_total_blocks)
        yield one(
            c, "vllm_rlt:invocations", "Recurrent-core invocations.", stats.get("invocations", 0)
        )
        yield one(c, "vllm_rlt:rows", "Rows over all invocations.", stats.get("rows", 0))
        yield one(
            c,
            "vllm_rlt:tasks",
            "Tasks (row ranges of one request at one depth) over all invocations.",
            stats.get("tasks", 0),
        )
        for key, metric, help in [
            ("spec_windows", "vllm:spec_decode_num_drafts", "Speculative windows verified."),
            ("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."),
            (
                "spec_accepted_tokens",
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted (each window also emits one token of the target).",
            ),
        ]:
            yield one(c, metric, help, stats.get(key, 0))
        for key, help in [
            ("spec_acceptance_rate", "Accepted / drafted tokens of speculative decoding."),
            (
                "spec_mean_accepted_length",
                "Mean tokens per speculative window (accepted drafts + the target's token).",
            ),
            ("rows_per_invocation", "Mean rows per recurrent-core invocation."),
            ("tasks_per_invocation", "Mean tasks per recurrent-core invocation."),
            ("loops_per_token", "Mean loops (exit depth) per generated token."),
        ]:
            yield one(g, f"vllm_rlt:{key}", help, stats.get(key, 0.0))
        for key, help in PD_COUNTERS.items():  # a disaggregated server's transfers
            if key in stats:
                yield one(c, f"vllm_rlt:{key}", help, stats[key])


class ServerMetrics:
    def __init__(self, model_name: str, engine: AsyncLLMEngine):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, engine))
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        max_len = engine.engine.max_model_len

        def counter(name: str, help: str) -> Counter:
            return Counter(name, help, **labels).labels(model_name)

        def histogram(name: str, help: str, buckets) -> Histogram:
            return Histogram(name, help, buckets=buckets, **labels).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens (once per prompt).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        success = Counter(
            "vllm:request_success",
            "Finished samples by finish reason (stop, length, abort, error); a request with k "
            "prompts and n samples counts k x n.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.finished = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        per_sample = " (per sample, like vllm:request_success)"
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time to a sample's first token" + per_sample,
            _TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between a sample's tokens, observed for every token but its first",
            _ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, of each finished sample with 2 or more",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to end of each sample" + per_sample,
            _E2E_BUCKETS,
        )
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens" + per_sample, _1_2_5_buckets(max_len)
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens",
            "Generated tokens" + per_sample,
            _1_2_5_buckets(max_len),
        )
        depths = tuple(float(d) for d in range(1, engine.engine.num_loops + 1))
        self.exit_depth = histogram(
            "vllm_rlt:exit_depth",
            "Loops run by each generated token (its exit depth, 1..D).",
            depths,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0 when absent), e.g. `value("vllm:prompt_tokens_total")`."""
        got = self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})
        return got or 0.0

    async def track(self, stream, prompt_len: int, n: int) -> AsyncIterator[RequestOutput]:
        """Pass the outputs of `stream` (one prompt, `n` samples) through, observing timings,
        tokens and exit depths; samples unfinished when it ends count as "abort" (the stream was
        closed or the server stopped) or "error" (a fault ended it)."""
        start = time.monotonic()
        seen = [0] * n  # tokens counted per sample
        first_at: list[float | None] = [None] * n
        last_at = [start] * n
        done = [False] * n
        left_reason, counted_prompt = "abort", False
        try:
            async for out in stream:
                now = time.monotonic()
                if not counted_prompt:
                    self.prompt_tokens.inc(prompt_len)
                    counted_prompt = True
                for comp in out.outputs:
                    i = comp.index
                    new = len(comp.token_ids) - seen[i]
                    for depth in comp.exit_depths[seen[i] :]:
                        self.exit_depth.observe(depth)
                    if new:
                        self.generation_tokens.inc(new)
                        if first_at[i] is None:
                            first_at[i] = last_at[i] = now
                            self.ttft.observe(now - start)
                            new -= 1
                        for _ in range(new):
                            self.itl.observe((now - last_at[i]) / new)
                        seen[i], last_at[i] = len(comp.token_ids), now
                    if comp.finished and not done[i]:
                        done[i] = True
                        self._finish(comp.finish_reason, now - start, prompt_len, seen[i],
                                     first_at[i], now)  # fmt: skip
                yield out
        except EngineStoppedError:
            raise
        except Exception:
            left_reason = "error"
            raise
        finally:
            now = time.monotonic()
            for i in range(n):
                if not done[i]:
                    self._finish(left_reason, now - start, prompt_len, seen[i], first_at[i], now)

    def _finish(self, reason, e2e, prompt_len, num_tokens, first_at, now) -> None:
        self.finished[reason if reason in self.finished else "error"].inc()
        self.e2e.observe(e2e)
        self.request_prompt.observe(prompt_len)
        self.request_generation.observe(num_tokens)
        if first_at is not None and num_tokens > 1:
            self.tpot.observe((now - first_at) / (num_tokens - 1))
