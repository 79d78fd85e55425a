"""Serving benchmark CLI.

    python -m benchmarks.serving --profile concurrent --input-lens 512 --output-len 64 \\
        --num-requests 100 --concurrency 8 [engine flags] --out result.json          # in-process
    python -m benchmarks.serving --backend http --base-url http://127.0.0.1:8000 \\
        --served-model-name tiny-ouro-stdlib --profile arrival --rate 2 --out r.json  # a server

In-process runs add the engine's counters (rows per invocation, tasks per invocation, prefill rows
per prefill invocation, loops per token) to the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
from pathlib import Path

from benchmarks.serving.drivers import gpu_activity, run_http, run_inprocess
from benchmarks.serving.metrics import engine_counters, summarize
from benchmarks.serving.workload import PROFILES, build_workload
from vllm_rlt.entrypoints import cli_args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "model",
        nargs="?",
        help="model directory (in-process; default: the packaged tiny-ouro-stdlib)",
    )
    p.add_argument("--backend", choices=["inprocess", "http"], default="inprocess")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default="tiny-ouro-stdlib")
    p.add_argument("--api-key", default=None)
    p.add_argument("--profile", choices=PROFILES, default="concurrent")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--input-lens", type=int, nargs="+", default=[512])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rate", type=float, default=2.0, help="arrival profile: requests/s")
    p.add_argument("--vocab-size", type=int, default=None, help="http: token id range")
    p.add_argument("--bench-seed", type=int, default=0, help="workload seed")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument(
        "--gpu-busy",
        action="store_true",
        help="in-process on CUDA: record GPU activity during the run and report the busy fraction "
        "(recording adds a little host time per launch)",
    )
    p.add_argument("--out", required=True)
    cli_args.add_engine_args(p)
    return p.parse_args(argv)


async def bench(args: argparse.Namespace) -> dict:
    if args.backend == "http":
        vocab = args.vocab_size or 256
        wl = build_workload(
            args.profile, args.num_requests, args.input_lens, args.output_len, vocab,
            concurrency=args.concurrency, rate=args.rate, seed=args.bench_seed,
        )  # fmt: skip
        records, duration = await run_http(args.base_url, args.served_model_name, wl, args.api_key)
        return {"summary": summarize(records, duration)}
    from vllm_rlt.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_kwargs(args.model, **cli_args.engine_kwargs(args))
    vocab = engine.engine.model_config.vocab_size
    wl = build_workload(
        args.profile, args.num_requests, args.input_lens, args.output_len, vocab,
        concurrency=args.concurrency, rate=args.rate, seed=args.bench_seed,
    )  # fmt: skip
    if args.warmup_requests:
        warm = build_workload("concurrent", args.warmup_requests, [8], 4, vocab, seed=99)
        await run_inprocess(engine, warm, tag="warmup")
    before = engine.engine.stats.as_dict()
    with gpu_activity() if args.gpu_busy else contextlib.nullcontext({}) as gpu:
        records, duration = await run_inprocess(engine, wl)
    counters = engine_counters(before, engine.engine.stats.as_dict(), len(wl.requests))
    await engine.shutdown()
    result = {"summary": summarize(records, duration), "engine": counters}
    if args.gpu_busy:
        result["gpu_busy_fraction"] = gpu["gpu_busy_s"] / duration
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    result["meta"] = {"args": vars(args), "python": platform.python_version()}
    Path(args.out).write_text(json.dumps(result, indent=2))
    s = result["summary"]
    print(
        f"{args.profile}: {s['completed']} done, {s['request_throughput']:.3f} req/s, "
        f"{s['output_token_throughput']:.1f} out tok/s, "
        f"TTFT p50 {s['ttft_s']['p50'] * 1e3:.1f} ms, ITL p99 {s['itl_s']['p99'] * 1e3:.1f} ms"
    )
    return result


if __name__ == "__main__":
    main()
