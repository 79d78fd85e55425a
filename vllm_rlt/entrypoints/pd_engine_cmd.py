"""`vllm-rlt pd-engine`: one engine of a disaggregated server, on a host other than the front
end's (docs/serving.md §7). The front end (`vllm-rlt serve --pd-remote-decode ...`) sends the
settings; the model directory must be at the same path here."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pd-engine",
        help="run one engine of a disaggregated server for a front end on another host",
    )
    p.add_argument(
        "--pd-connect", required=True, metavar="HOST:PORT",
        help="the front end's pd_master_addr and pd_control_port",
    )  # fmt: skip
    p.add_argument(
        "--pd-rank", required=True, type=int,
        help="which engine this is: prefill engines are ranks 0..pd_prefill-1, decode engines "
        "follow",
    )  # fmt: skip
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from vllm_rlt.disagg.engines import remote_engine_main
    from vllm_rlt.entrypoints import cli_args

    host, _, port = args.pd_connect.rpartition(":")
    if not host or not port.isdigit():
        args.parser.error(f"--pd-connect must be HOST:PORT, got {args.pd_connect!r}")
    try:
        remote_engine_main(host, int(port), args.pd_rank)
    except ValueError as err:  # (ConfigError is one)
        raise cli_args.error_exit(err) from None
    return 0
