"""The `vllm-rlt` command: one subcommand per module, each adding its own arguments."""

from __future__ import annotations

import argparse
import sys

from vllm_rlt.entrypoints import generate_cmd, inspect_cmd, serve_cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-rlt", description="Serving engine for recurrent-depth (looped) language models"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    inspect_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
