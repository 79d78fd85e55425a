"""`vllm-rlt generate`: offline generation for prompts given on the command line."""

from __future__ import annotations

import argparse

from vllm_rlt.entrypoints import cli_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts")
    cli_args.add_model_arg(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    cli_args.add_sampling_args(p)
    cli_args.add_engine_args(p)
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from vllm_rlt.entrypoints.llm import LLM

    try:  # bad settings, model files or prompts: one line, no traceback
        params = cli_args.sampling_params(args)
        llm = LLM(args.model, **cli_args.engine_kwargs(args))
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as err:
        raise cli_args.error_exit(err) from None
    for out in outputs:
        for comp in out.outputs:
            print(f"prompt: {out.prompt!r}  sample {comp.index}  finish: {comp.finish_reason}")
            print(f"  text: {comp.text!r}")
            print(f"  exit depths: {comp.exit_depths}")
    print("stats:", {k: round(v, 3) for k, v in llm.engine.stats_dict().items()})
    return 0
