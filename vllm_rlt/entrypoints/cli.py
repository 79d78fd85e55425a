"""The `vllm-rlt` command: one subcommand per module, each adding its own arguments.

Usage errors (an unknown flag, a value outside a setting's choices) and settings the engine
cannot start with end the command with one line on stderr and a non-zero status, no traceback;
so does Ctrl-C (status 130).
"""

from __future__ import annotations

import sys

import vllm_rlt
from vllm_rlt.entrypoints import (
    bench_cmd,
    calibrate_cmd,
    cli_args,
    generate_cmd,
    inspect_cmd,
    pd_engine_cmd,
    serve_cmd,
)


def build_parser() -> cli_args.CLIParser:
    parser = cli_args.CLIParser(
        prog="vllm-rlt", description="Serving engine for recurrent-depth (looped) language models"
    )
    parser.add_argument("--version", action="version", version=f"vllm-rlt {vllm_rlt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (serve_cmd, generate_cmd, inspect_cmd, bench_cmd, calibrate_cmd, pd_engine_cmd)
    for command in commands:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli_args.resolve_model(args, args.parser)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while a model loads or a benchmark runs: no traceback
        print("vllm-rlt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
