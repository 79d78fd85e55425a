"""`vllm-rlt bench serve|throughput|latency`: the benchmarks of `vllm_rlt.entrypoints.bench` with
the engine flags of `serve`; live progress while they run, a percentile table at the end, and the
whole result as JSON with `--out`."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
from pathlib import Path

from vllm_rlt.entrypoints import cli_args

BENCHMARKS = {
    "serve": "replay a workload against the async engine (in-process) or a server (--backend http)",
    "throughput": "offline throughput: many prompts submitted at once",
    "latency": "latency of one batch, from submission to its last token",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark the engine: " + ", ".join(BENCHMARKS))
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, text in BENCHMARKS.items():
        module = importlib.import_module(f"vllm_rlt.entrypoints.bench.{name}")
        p = kinds.add_parser(name, help=text, description=module.__doc__)
        cli_args.add_model_arg(p)
        module.add_cli_args(p)
        p.add_argument("--out", help="write the result as JSON to this file (default: none)")
        cli_args.add_engine_args(p)
        p.set_defaults(func=run, parser=p, module=module)


def run(args: argparse.Namespace) -> int:
    from vllm_rlt.entrypoints.bench.metrics import format_summary

    try:  # bad settings, model files or workload values: one line, no traceback
        result = args.module.run(args, cli_args.engine_kwargs(args))
    except ValueError as err:
        raise cli_args.error_exit(err) from None
    meta = {k: v for k, v in vars(args).items() if k not in ("func", "parser", "module")}
    result["meta"] = {"args": meta, "python": platform.python_version()}
    print(format_summary(result["summary"]))
    if "engine" in result:
        print("engine:", {k: round(v, 3) for k, v in result["engine"].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"result written to {args.out}")
    return 0
