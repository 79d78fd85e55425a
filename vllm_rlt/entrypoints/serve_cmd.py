"""`vllm-rlt serve`: the OpenAI-compatible HTTP server (uvicorn) around one engine.

The listening socket is bound before the model loads, so that a port in use (or a host that is
not this machine's) ends the command at once with one line, and "serving on" is printed only once
the server holds its port.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import NoReturn

from vllm_rlt.entrypoints import cli_args
from vllm_rlt.entrypoints.openai.defaults import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_LOG_STATS_INTERVAL_S,
    DEFAULT_MAX_N,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    cli_args.add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=cli_args.port, default=8000, help="port to listen on (0: any)")
    p.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (default: none)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name of the API (default: the model directory's name)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 429 when this many requests wait for admission (default: no limit)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help="answer 400 for requests that ask for more samples (n) than this",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="answer 413 for request bodies larger than this",
    )
    p.add_argument(
        "--body-read-timeout",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="answer 408 (and close the connection) when a request body takes longer to arrive",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="close a connection that sends no whole request head within this many seconds of "
        "opening or of its last response",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests get to finish before they are ended "
        "with an error (new requests get 503 meanwhile)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="chat template for /v1/chat/completions: a file, or the Jinja template itself "
        "(default: the checkpoint's, else ChatML)",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="do not log the stats line (throughput, running, waiting, KV usage)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=DEFAULT_LOG_STATS_INTERVAL_S,
        help="seconds between stats lines",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log a line when each request arrives and when it ends",
    )
    cli_args.add_engine_args(p)
    cli_args.add_serve_args(p)
    p.set_defaults(func=run, parser=p)


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return Path(args.model).resolve().name
    from vllm_rlt.models.tiny import default_model_dir

    return default_model_dir().name


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on (host, port); exits with one line when it cannot."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise cli_args.error_exit(f"host {host!r} cannot be resolved: {err.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise cli_args.error_exit(f"port {port} on {host}: cannot listen: {err.strerror}") from None
    return sock


def run(args: argparse.Namespace) -> NoReturn:
    from vllm_rlt.config import EngineConfig
    from vllm_rlt.disagg.replicas import ReplicaRouter
    from vllm_rlt.disagg.router import PDRouter
    from vllm_rlt.engine.llm_engine import LLMEngine
    from vllm_rlt.entrypoints.openai.api_server import build_app
    from vllm_rlt.entrypoints.openai.lifecycle import GracefulServer
    from vllm_rlt.serve_config import DisaggConfig

    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit("error: max_waiting_requests must be >= 1")
    if args.max_body_bytes < 1:
        raise SystemExit("error: max_body_bytes must be >= 1")
    if args.max_n < 1:
        raise SystemExit("error: max_n must be >= 1")
    if args.body_read_timeout <= 0 or args.timeout_keep_alive < 1 or args.shutdown_timeout < 0:
        msg = "body_read_timeout must be > 0, timeout_keep_alive >= 1, shutdown_timeout >= 0"
        raise SystemExit(f"error: {msg}")
    if args.log_stats_interval <= 0:
        raise SystemExit("error: log_stats_interval must be > 0")
    name = served_name(args)
    sock = bind(args.host, args.port)
    try:  # bad settings or model files (weights, tokenizer, chat template): one line, no traceback
        config = EngineConfig.from_kwargs(model=args.model, **cli_args.engine_kwargs(args))
        config = config.for_server()
        disagg = DisaggConfig(**cli_args.config_kwargs(args, [DisaggConfig]))
        # engine processes behind a router, which the app serves alike
        limit = args.max_waiting_requests
        if disagg.enabled:
            engine = PDRouter(config, disagg, max_waiting_requests=limit)
            for role in ("prefill", "decode"):
                print(f"vllm-rlt: {role} engines: pids {engine.engine_pids(role)}", flush=True)
        elif disagg.data_parallel_size > 1:
            engine = ReplicaRouter(config, disagg, max_waiting_requests=limit)
            print(f"vllm-rlt: replicas: pids {engine.engine_pids('replica')}", flush=True)
        else:
            engine = LLMEngine(config)
        app = build_app(
            engine,
            name,
            args.api_key,
            max_body_bytes=args.max_body_bytes,
            max_waiting_requests=args.max_waiting_requests,
            max_n=args.max_n,
            body_read_timeout=args.body_read_timeout,
            chat_template=args.chat_template,
            log_stats=not args.disable_log_stats,
            log_stats_interval=args.log_stats_interval,
            log_requests=not args.disable_log_requests,
        )
    except ValueError as err:
        raise cli_args.error_exit(err) from None
    port = sock.getsockname()[1]
    print(f"vllm-rlt: serving {name!r} on http://{args.host}:{port}/v1", flush=True)
    server = GracefulServer(
        app,
        host=args.host,
        port=port,
        shutdown_timeout=args.shutdown_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
    )
    server.run(sockets=[sock])
    failed = server.engine_failed  # then exit non-zero, so that a supervisor restarts the server
    print(f"vllm-rlt: server stopped{': the engine failed' if failed else ''}", flush=True)
    sys.stderr.flush()
    # The engine has stopped and every socket is closed: skip the interpreter's teardown, which
    # takes ~0.6 s with torch loaded (more on a busy machine) and would stretch the stop.
    os._exit(1 if failed else 0)
