"""`vllm-rlt bench throughput`: offline throughput of the engine. `--num-prompts` prompts of
`--input-len` random token ids with `--output-len` forced output tokens (EOS ignored) are
submitted at once; reports request and token throughput and TTFT / TPOT / ITL / E2E percentiles
(the same records and metrics as `bench serve`) and the engine's counters (loops per token
among them). The exit configuration is the engine's (`--exit-threshold`, `--exit-mode`,
`--trace-seed`, `--device-decode-loops`) and `--min-loops` per request.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from vllm_rlt.entrypoints.bench.metrics import RequestRecord, engine_counters, summarize
from vllm_rlt.entrypoints.bench.workload import build_workload, check_positive
from vllm_rlt.sampling_params import SamplingParams


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64, help="prompts submitted at once")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens per output (EOS ignored)")
    p.add_argument("--warmup-requests", type=int, default=2, help="untimed requests first")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--min-loops",
        type=int,
        default=None,
        help="fewest loops each output token runs (with --exit-threshold below 1: every gate "
        "is read; equal to the depth: every token still runs every loop; default: 1)",
    )


def make_engine(model: str | None, engine_kwargs: dict[str, Any]):
    from vllm_rlt.config import EngineConfig
    from vllm_rlt.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))


def random_prompts(engine, num: int, length: int, seed: int) -> list[list[int]]:
    vocab = engine.model_config.vocab_size
    workload = build_workload("concurrent", num, [length], 1, vocab, seed=seed)
    return [spec.prompt_token_ids for spec in workload.requests]


def run_requests(
    engine,
    prompts: list[list[int]],
    output_len: int,
    on_done: Callable[[], None] | None = None,
    **params,
) -> tuple[list[RequestRecord], float]:
    """Submit every prompt at once and step the engine until all finish; returns the records
    (a chunk per step that brought a request new tokens) and the wall time. `params`: more
    sampling settings (exit_threshold, min_loops, ...)."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, **params)
    start = time.perf_counter()
    records: dict[str, RequestRecord] = {}
    for i, prompt in enumerate(prompts):
        req_id = f"bench-{time.perf_counter_ns()}-{i}"
        engine.add_request(req_id, prompt, params, arrival_time=start)
        records[req_id] = RequestRecord(start, len(prompt))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rec = records[out.request_id]
            num_tokens = len(out.outputs[0].token_ids)
            if num_tokens > rec.output_tokens:
                rec.chunk_s.append(now)
                rec.output_tokens = num_tokens
            if out.finished and on_done is not None:
                on_done()
    return list(records.values()), time.perf_counter() - start


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict:
    check_positive(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    engine = make_engine(args.model, engine_kwargs)
    if args.warmup_requests:
        run_requests(engine, random_prompts(engine, args.warmup_requests, 8, 99), 4)
    prompts = random_prompts(engine, args.num_prompts, args.input_len, args.bench_seed)
    before = engine.stats_dict()
    with tqdm(total=len(prompts), desc="requests", unit="req") as bar:
        records, duration = run_requests(
            engine, prompts, args.output_len, lambda: bar.update(1), min_loops=args.min_loops
        )
    counters = engine_counters(before, engine.stats_dict(), len(prompts))
    return {"summary": summarize(records, duration), "engine": counters}
