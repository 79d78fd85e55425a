"""`vllm-rlt serve`: the OpenAI-compatible HTTP server (uvicorn) around one engine."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from vllm_rlt.entrypoints import cli_args
from vllm_rlt.entrypoints.openai.serving_common import DEFAULT_MAX_N


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    p.add_argument(
        "model", nargs="?", help="HF model directory (default: the packaged tiny-ouro-stdlib)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1")
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
    cli_args.add_engine_args(p)
    p.set_defaults(func=run)


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return Path(args.model).resolve().name
    from vllm_rlt.models.tiny import default_model_dir

    return default_model_dir().name


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from vllm_rlt.config import EngineConfig
    from vllm_rlt.engine.llm_engine import LLMEngine
    from vllm_rlt.entrypoints.openai.api_server import build_app

    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit("error: max_waiting_requests must be >= 1")
    if args.max_body_bytes < 1:
        raise SystemExit("error: max_body_bytes must be >= 1")
    if args.max_n < 1:
        raise SystemExit("error: max_n must be >= 1")
    name = served_name(args)
    try:  # bad settings or model files (weights, tokenizer, chat template): one line, no traceback
        config = EngineConfig.from_kwargs(model=args.model, **cli_args.engine_kwargs(args))
        app = build_app(
            LLMEngine(config),
            name,
            args.api_key,
            max_body_bytes=args.max_body_bytes,
            max_waiting_requests=args.max_waiting_requests,
            max_n=args.max_n,
        )
    except ValueError as err:
        raise cli_args.error_exit(err) from None
    print(f"vllm-rlt: serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5
    )
    # on Ctrl-C uvicorn stops accepting, finishes the app shutdown (the engine loop stops), then
    # re-raises the signal, which arrives here as KeyboardInterrupt
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
    print("vllm-rlt: server stopped", flush=True)
    return 0
