"""Self-speculative decoding on the GPU (docs/design/speculative.md), one process per mode:

`packaged`: the packaged tiny-ouro-stdlib at fixed depth (exit threshold 1; `--exit-threshold`
0.6, its default, for the exit gate), prompts cut from
the Python standard library's sources (the model's domain), greedy forced outputs. For each
concurrency c, `--seats` x c requests (default 2c) at once to an engine of max_num_seqs = c,
speculation off and every (d, K) of `--draft-loops` x `--drafts`, interleaved over `--repeats`
rounds (one engine per setting, sharing the weights, warmed up first): output tokens/s
(median), acceptance rate and mean accepted length, speedup over off (of the medians, and the
median of each round's ratio).

`cost`: a model shape with dummy weights (default Ouro-1.4B): the device time of decode-only
recurrent-core invocations by rows (`InvocationTimer`), measured with speculation on (draft
invocations of B rows, verify invocations of B (K + 1) rows) and off, per concurrency B; the
speedup the cost model gives for the acceptance rates `--acceptance` (labelled a model, with its
inputs); and the measured output tokens/s with speculation off and with the default adaptive rule
(which turns it off above `speculative_max_decode_rows` decoding requests).

    python -m benchmarks.speculative packaged --concurrency 1 8 --out packaged.json
    python -m benchmarks.speculative cost --concurrency 1 8 32 --acceptance 0.6 0.8 \
        --kv-cache-gb 16 --out cost.json  # KV for 32 requests of the 1.4B shape at once
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from benchmarks.model_shapes import write_shape
from benchmarks.provenance import commit, engine_digest
from benchmarks.wcpb_matrix import add_async_scheduling_flag, release_device_memory
from vllm_rlt.config import EngineConfig
from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.metrics import engine_counters, summarize
from vllm_rlt.entrypoints.bench.throughput import run_requests
from vllm_rlt.models.loader import load_model
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.worker.invocation_timer import InvocationTimer


def settings(args) -> list[tuple[int, int]]:
    """(draft loops d, drafts K), (0, 0) = speculation off."""
    return [(0, 0)] + [(d, k) for d in args.draft_loops for k in args.drafts]


def make_engines(args, model_dir: str, load_format: str, concurrency: int, keys=None, **extra):
    """An engine per setting of `keys` (default: all), sharing one set of weights."""
    loaded = load_model(
        model_dir, dtype=args.dtype, load_format=load_format, attention_backend="auto"
    )
    engines = {}
    for d, k in keys or settings(args):
        spec = {"num_speculative_tokens": k, "speculative_draft_loops": max(d, 1)}
        config = EngineConfig.from_kwargs(
            model=model_dir, dtype=args.dtype, load_format=load_format,
            exit_threshold=args.exit_threshold,
            max_num_seqs=concurrency, kv_cache_memory_gb=args.kv_cache_gb,
            async_scheduling=args.async_scheduling, **spec, **extra,
        )  # fmt: skip
        engines[d, k] = LLMEngine(config, loaded)
    return engines


def stdlib_prompts(tokenizer, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` windows of `length` tokens from random standard-library sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < num:
        ids = tokenizer.encode(rng.choice(files).read_text(errors="replace")).ids
        if len(ids) > length:
            start = rng.randrange(len(ids) - length)
            prompts.append(ids[start : start + length])
    return prompts


def timed_run(engine, prompts, output_len: int) -> dict:
    before = engine.stats_dict()
    records, wall = run_requests(engine, prompts, output_len)
    out = {
        "summary": summarize(records, wall),
        "engine": engine_counters(before, engine.stats_dict(), len(prompts)),
    }
    governor = engine.scheduler.governor
    if governor is not None:  # the measured fallback's rates so far, tokens/s by (load, mode)
        out["governor_rates"] = {
            f"{load}:{'on' if on else 'off'}": rate for (load, on), rate in governor.rates.items()
        }
    return out


def run_packaged(args) -> list[dict]:
    out = []
    for c in args.concurrency:
        engines = make_engines(args, str(default_model_dir()), "auto", c)
        tokenizer = next(iter(engines.values())).tokenizer
        runs = {key: [] for key in engines}
        for rep in range(args.repeats + 1):  # round 0 warms up (compiles, captures)
            prompts = stdlib_prompts(tokenizer, args.seats * c, args.prompt_len, seed=rep)
            for key, engine in engines.items():
                result = timed_run(engine, prompts, args.output_len)
                if rep:
                    runs[key].append(result)
        base = statistics.median(r["summary"]["output_token_throughput"] for r in runs[0, 0])
        for (d, k), rs in runs.items():
            tok_s = statistics.median(r["summary"]["output_token_throughput"] for r in rs)
            # each round runs every setting back to back: its ratio to off cancels host drift
            rounds = [
                r["summary"]["output_token_throughput"] / o["summary"]["output_token_throughput"]
                for r, o in zip(rs, runs[0, 0], strict=True)
            ]
            row = {"concurrency": c, "draft_loops": d, "drafts": k, "output_tok_s": tok_s,
                   "speedup": tok_s / base, "speedup_by_round": rounds,
                   "speedup_round_median": statistics.median(rounds), "runs": rs}  # fmt: skip
            if k and "spec_acceptance_rate" in rs[0]["engine"]:  # (windows: fixed depth)
                row["acceptance_rate"] = statistics.median(
                    r["engine"]["spec_acceptance_rate"] for r in rs
                )
                row["mean_accepted_length"] = statistics.median(
                    r["engine"]["spec_mean_accepted_length"] for r in rs
                )
            print({k: v for k, v in row.items() if k != "runs"})
            out.append(row)
    return out


def decode_costs(timer: InvocationTimer) -> dict[int, float]:
    """Mean ms of decode-only invocations by rows (keys `detailed_shape`: d{rows} p0)."""
    costs: dict[int, list[tuple[int, float]]] = {}
    for shape, s in timer.summary().items():
        m = re.search(r" d(\d+) p0 ", shape)
        if m and int(m.group(1)):
            costs.setdefault(int(m.group(1)), []).append((s["count"], s["mean_ms"]))
    return {
        rows: sum(n * ms for n, ms in v) / sum(n for n, _ in v) for rows, v in sorted(costs.items())
    }


def force_windows(planner) -> None:
    """Every window drafts K (`planner`: the engine's SpecPlanner, None when off). On dummy
    weights nearly every draft is rejected, so the adaptive rule would stop speculating and the
    verify invocations that `cost` times would not run; the rule now reads every draft as
    accepted (`cost` reports no acceptance)."""
    if planner is not None:
        planner.acceptance = lambda: 1.0


def check_kv_holds(kv, num_requests: int, positions: int) -> None:
    """Stop when the KV cache cannot hold every request at once: they would be admitted as
    others finish, so their windows would not verify in lockstep and `cost` would time no
    verify invocation of every request."""
    need = num_requests * kv.blocks_for(positions)
    if need > kv.num_total_blocks:
        raise SystemExit(
            f"the KV cache holds {kv.num_total_blocks} blocks; {num_requests} requests of "
            f"{positions} positions need {need}: raise --kv-cache-gb"
        )


def modeled_speedup(a: float, k: int, d: int, depth: int, c_b: float, c_verify: float) -> float:
    """The cost model of docs/design/speculative.md §5: tokens per window over its cost,
    relative to plain decoding (D invocations of B rows per token)."""
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens * depth * c_b / ((k + 1) * d * c_b + (depth - d) * c_verify)


def run_cost(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_shape(args.shape, tmp))
        result = {"costs_ms": {}, "model": [], "adaptive": []}
        for c in args.concurrency:
            # a budget that prefills every prompt in one step: the windows open, and verify, in
            # lockstep, so invocations of c and c (K + 1) rows both run; one engine at a time,
            # each with KV for all c requests (`--kv-cache-gb`)
            budget = max(SchedulerConfig.max_num_batched_tokens, c * args.prompt_len)
            costs: dict[int, float] = {}
            for key in settings(args):
                engine = make_engines(
                    args, model_dir, "dummy", c, [key], speculative_max_decode_rows=10**6,
                    max_num_batched_tokens=budget,
                )[key]  # fmt: skip
                depth = engine.num_loops
                check_kv_holds(engine.scheduler.kv, c, args.prompt_len + args.output_len + key[1])
                force_windows(engine.scheduler.spec)
                prompts = [[1 + i] * args.prompt_len for i in range(c)]
                run_requests(engine, prompts, args.output_len)  # warm-up
                engine.runner.timer = InvocationTimer(engine.runner.device, by_context=True)
                run_requests(engine, prompts, args.output_len)
                costs.update(decode_costs(engine.runner.timer))
                del engine
                release_device_memory()
            result["costs_ms"][c] = costs
            for (d, k), a in ((s, a) for s in settings(args)[1:] for a in args.acceptance):
                if c in costs and c * (k + 1) in costs:
                    speedup = modeled_speedup(a, k, d, depth, costs[c], costs[c * (k + 1)])
                    row = {"concurrency": c, "draft_loops": d, "drafts": k, "acceptance": a,
                           "modeled_speedup": speedup}  # fmt: skip
                    print(row)
                    result["model"].append(row)
            # measured: off against the default adaptive rule (off above its row limit)
            keys = ((0, 0), settings(args)[-1])
            adaptive = make_engines(args, model_dir, "dummy", c, keys)
            prompts = [[1 + i] * args.prompt_len for i in range(2 * c)]
            for key in keys:
                timed_run(adaptive[key], prompts, args.output_len)  # warm-up
                tok_s = statistics.median(
                    timed_run(adaptive[key], prompts, args.output_len)["summary"][
                        "output_token_throughput"
                    ]
                    for _ in range(args.repeats)
                )
                row = {"concurrency": c, "draft_loops": key[0], "drafts": key[1],
                       "output_tok_s": tok_s}  # fmt: skip
                print(row)
                result["adaptive"].append(row)
            del adaptive
            release_device_memory()
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["packaged", "cost"])
    p.add_argument("--shape", default="ouro-1.4b", help="cost: the model shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2])
    p.add_argument("--drafts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.8, 0.9])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--seats", type=int, default=2,
        help="packaged: requests per seat (c seats) in each run; more make longer, steadier runs",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--exit-threshold", type=float, default=1.0,
        help="packaged: 1 = fixed depth (windows); below 1 the exit gate (device runs with lanes)",
    )  # fmt: skip
    p.add_argument("--kv-cache-gb", type=float, default=8.0)
    add_async_scheduling_flag(p)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    results = run_packaged(args) if args.mode == "packaged" else run_cost(args)
    meta = {
        "command": "python -m benchmarks.speculative "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": commit(),
        "engine_sha256": engine_digest(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.node(),
        "torch": torch.__version__,
    }
    out = {"meta": meta, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
