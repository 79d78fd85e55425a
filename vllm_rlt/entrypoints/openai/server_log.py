"""The server's log lines: what it serves (at start), a stats line every few seconds (as vLLM
prints: throughput, running and waiting samples, KV usage, prefix-cache hit rate, plus loops per
token), and one line when a request arrives and one when it ends."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.openai.metrics import ServerMetrics
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MAX_LOGGED_IDS = 32  # prompt token ids shown per request line


def log_startup(engine: LLMEngine, served_model_name: str) -> None:
    weight = engine.model.lm_head.weight
    kv = engine.kv_capacity()
    logger.info(
        "serving %r (%s) dtype=%s device=%s depth=%d; KV cache: %d blocks of %d positions over %d "
        "planes, max_model_len %d; maximum concurrency for %d tokens per request: %.2fx",
        served_model_name,
        str(engine.model_dir),
        str(weight.dtype).removeprefix("torch."),
        weight.device,
        engine.num_loops,
        kv.num_blocks,
        kv.block_size,
        kv.num_planes,
        engine.max_model_len,
        engine.max_model_len,
        kv.max_tokens_per_request / engine.max_model_len,
    )
    logger.info("engine: %s", engine.settings_summary())


@dataclass
class _Totals:
    time: float
    prompt_tokens: float
    generation_tokens: float
    loops: float  # sum of exit depths of generated tokens (engine stats)
    tokens: float  # generated tokens (engine stats)


class StatLogger:
    """Every `interval` seconds: `Avg prompt throughput: ... tokens/s, Avg generation throughput:
    ... tokens/s, Running: N reqs, Waiting: N reqs, KV cache usage: x%, Prefix cache hit rate:
    x%, Loops per token: x`. Idle intervals (nothing generated now or in the previous interval,
    nothing running or waiting) log at DEBUG so an idle server stays quiet."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics
        self.last = self._totals()
        self.was_busy = False

    def _totals(self) -> _Totals:
        m, stats = self.metrics, self.engine.snapshot.stats
        return _Totals(
            time.monotonic(),
            m.value("vllm:prompt_tokens_total"),
            m.value("vllm:generation_tokens_total"),
            stats.get("generated_loops", 0),
            stats.get("generated_tokens", 0),
        )

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.log()

    def log(self) -> None:
        now, last = self._totals(), self.last
        self.last = now
        snap = self.engine.snapshot
        elapsed = max(now.time - last.time, 1e-9)
        prompt = (now.prompt_tokens - last.prompt_tokens) / elapsed
        generation = (now.generation_tokens - last.generation_tokens) / elapsed
        tokens = now.tokens - last.tokens
        loops = (now.loops - last.loops) / tokens if tokens else 0.0
        queries = snap.prefix_cache_queries
        hit_rate = snap.prefix_cache_hits / queries if queries else 0.0  # since the start
        busy = bool(prompt or generation or snap.num_running or snap.num_waiting)
        level = logging.INFO if busy or self.was_busy else logging.DEBUG
        self.was_busy = busy
        logger.log(
            level,
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%, Loops per token: %.2f",
            prompt,
            generation,
            snap.num_running,
            snap.num_waiting,
            snap.kv_usage * 100,
            hit_rate * 100,
            loops,
        )


def log_received(request_id: str, prompts: list[list[int]], params: SamplingParams) -> None:
    shown = prompts[0][:MAX_LOGGED_IDS]
    more = "..." if len(prompts[0]) > MAX_LOGGED_IDS else ""
    logger.info(
        "Received request %s: %d prompt(s) of %s tokens, prompt_token_ids: %s%s, params: %s",
        request_id,
        len(prompts),
        [len(p) for p in prompts],
        shown,
        more,
        params,
    )


def log_finished(request_id: str, outputs: list[RequestOutput | None], n: int, start: float):
    """`outputs`: each prompt's last output (None if none came); a sample without a finish
    reason was aborted."""
    reasons, tokens = [], 0
    for out in outputs:
        comps = out.outputs if out is not None else []
        reasons += [c.finish_reason or "abort" for c in comps] + ["abort"] * (n - len(comps))
        tokens += sum(len(c.token_ids) for c in comps)
    logger.info(
        "Finished request %s: finish_reason %s, %d generated tokens, %.3f s",
        request_id,
        ",".join(reasons),
        tokens,
        time.monotonic() - start,
    )
