"""`vllm-rlt bench serve`: replay a workload (serial, concurrent, or Poisson arrivals) against the
async engine in this process or a server's streaming `/v1/completions`, and measure TTFT, TPOT,
ITL and E2E (docs/benchmarks/README.md §2). In-process runs add the engine's counters (rows per
invocation, tasks per invocation, prefill rows per prefill invocation, loops per token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from tqdm import tqdm

from vllm_rlt.entrypoints.bench.drivers import OnDone, gpu_activity, run_http, run_inprocess
from vllm_rlt.entrypoints.bench.metrics import engine_counters, summarize
from vllm_rlt.entrypoints.bench.workload import PROFILES, Workload, build_workload


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=("inprocess", "http"),
        default="inprocess",
        help="inprocess: an engine in this process; http: a running server at --base-url",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="http: the server")
    p.add_argument("--served-model-name", default="tiny-ouro-stdlib", help="http: its model name")
    p.add_argument("--api-key", default=None, help="http: the server's API key (default: none)")
    p.add_argument("--profile", choices=PROFILES, default="concurrent", help="arrival pattern")
    p.add_argument("--num-requests", type=int, default=100, help="requests to replay")
    p.add_argument(
        "--input-lens", type=int, nargs="+", default=[512], help="prompt lengths (drawn uniformly)"
    )
    p.add_argument("--output-len", type=int, default=64, help="tokens per output (EOS ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--rate", type=float, default=2.0, help="arrival profile: requests per second")
    p.add_argument(
        "--vocab-size", type=int, default=256, help="http: prompt token ids are drawn below this"
    )
    p.add_argument("--bench-seed", type=int, default=0, help="workload seed")
    p.add_argument("--warmup-requests", type=int, default=2, help="in-process: untimed requests")
    p.add_argument(
        "--gpu-busy",
        action="store_true",
        help="in-process on CUDA: record GPU activity during the run and report the busy fraction "
        "(recording adds a little host time per launch)",
    )


def _workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    return build_workload(
        args.profile, args.num_requests, args.input_lens, args.output_len, vocab_size,
        concurrency=args.concurrency, rate=args.rate, seed=args.bench_seed,
    )  # fmt: skip


async def _inprocess(args: argparse.Namespace, engine_kwargs: dict, on_done: OnDone) -> dict:
    from vllm_rlt.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_kwargs(args.model, **engine_kwargs)
    try:
        vocab = engine.engine.model_config.vocab_size
        workload = _workload(args, vocab)
        if args.warmup_requests:
            warm = build_workload("concurrent", args.warmup_requests, [8], 4, vocab, seed=99)
            await run_inprocess(engine, warm, tag="warmup")
        before = engine.engine.stats_dict()
        with gpu_activity() if args.gpu_busy else contextlib.nullcontext({}) as gpu:
            records, duration = await run_inprocess(engine, workload, on_done=on_done)
        counters = engine_counters(before, engine.engine.stats_dict(), len(workload.requests))
    finally:
        await engine.shutdown()
    result = {"summary": summarize(records, duration), "engine": counters}
    if args.gpu_busy:
        result["gpu_busy_fraction"] = gpu["gpu_busy_s"] / duration
    return result


def _check_server(base_url: str) -> None:
    """ValueError naming `base_url` when no server answers there."""
    import httpx

    try:
        httpx.get(base_url.rstrip("/") + "/health", timeout=10)
    except httpx.TransportError as err:
        raise ValueError(f"base_url {base_url}: no server answers ({err})") from None


async def _http(args: argparse.Namespace, on_done: OnDone) -> dict:
    workload = _workload(args, args.vocab_size)
    name, key = args.served_model_name, args.api_key
    records, duration = await run_http(args.base_url, name, workload, key, on_done=on_done)
    return {"summary": summarize(records, duration)}


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict:
    """The result: `summary` (throughput and percentiles), and in-process `engine` counters."""
    if args.backend == "http":
        _check_server(args.base_url)
    with tqdm(total=args.num_requests, desc="requests", unit="req") as bar:
        done = lambda: bar.update(1)  # noqa: E731
        if args.backend == "http":
            return asyncio.run(_http(args, done))
        return asyncio.run(_inprocess(args, engine_kwargs, done))
