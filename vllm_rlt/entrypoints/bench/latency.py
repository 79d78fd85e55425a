"""`vllm-rlt bench latency`: how long one batch takes from submission to its last token.
`--batch-size` prompts of `--input-len` random token ids, `--output-len` forced output tokens
(EOS ignored), timed `--num-iters` times after `--num-iters-warmup` untimed runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from tqdm import tqdm

from vllm_rlt.entrypoints.bench.metrics import percentiles
from vllm_rlt.entrypoints.bench.throughput import make_engine, random_prompts, run_requests
from vllm_rlt.entrypoints.bench.workload import check_positive


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens per output (EOS ignored)")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed batches first")
    p.add_argument("--num-iters", type=int, default=10, help="timed batches")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the prompts")


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict:
    lengths = {"input_len": args.input_len, "output_len": args.output_len}
    check_positive(batch_size=args.batch_size, num_iters=args.num_iters, **lengths)
    engine = make_engine(args.model, engine_kwargs)
    prompts = random_prompts(engine, args.batch_size, args.input_len, args.bench_seed)
    for _ in tqdm(range(args.num_iters_warmup), desc="warm-up", unit="batch"):
        run_requests(engine, prompts, args.output_len)
    latencies = [
        run_requests(engine, prompts, args.output_len)[1]
        for _ in tqdm(range(args.num_iters), desc="batches", unit="batch")
    ]
    summary = {
        "batch_size": args.batch_size,
        "iterations": args.num_iters,
        "latency_s": percentiles(latencies),
    }
    return {"summary": summary, "latencies_s": latencies}
