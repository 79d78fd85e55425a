"""The FastAPI app: routes, API-key check, OpenAI-shaped errors (errors.py).

`build_app(engine, served_model_name, ...)` takes an `AsyncLLMEngine` (or an `LLMEngine`, which
it wraps); the app starts the engine loop on startup (logging what it serves, then the periodic
stats line) and stops it on shutdown. `app.state.drain` is the gate's `Drain`: a server that
stops closes it (see lifecycle.py).
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer
from vllm_rlt.entrypoints.openai.defaults import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_LOG_STATS_INTERVAL_S,
    DEFAULT_MAX_N,
)
from vllm_rlt.entrypoints.openai.errors import APIError
from vllm_rlt.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vllm_rlt.entrypoints.openai.middleware import CatchAll, Drain, DrainGate
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from vllm_rlt.entrypoints.openai.server_log import StatLogger, log_startup
from vllm_rlt.entrypoints.openai.serving_chat import create_chat_completion
from vllm_rlt.entrypoints.openai.serving_common import ServerState, read_json
from vllm_rlt.entrypoints.openai.serving_completion import create_completion
from vllm_rlt.entrypoints.openai.serving_tokenize import detokenize, tokenize

DEFAULT_MAX_BODY_BYTES = 1 << 20


def build_app(
    engine: AsyncLLMEngine | LLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = None,
    max_n: int = DEFAULT_MAX_N,
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT_S,
    chat_template: str | None = None,
    log_stats: bool = True,
    log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL_S,
    log_requests: bool = True,
) -> FastAPI:
    """`chat_template`: a Jinja template, or a file holding one, used instead of the checkpoint's;
    `log_stats`: log a stats line every `log_stats_interval` seconds; `log_requests`: log a line
    when each request arrives and when it ends."""
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests)
    # else an AsyncLLMEngine, or a front end of engine processes (disagg), which has its interface
    elif max_waiting_requests is not None:
        engine.max_waiting_requests = max_waiting_requests
    metrics = ServerMetrics(served_model_name, engine)
    chat = ChatRenderer(engine.engine.model_dir, chat_template)
    state = ServerState(
        engine,
        served_model_name,
        api_key,
        max_body_bytes,
        metrics,
        chat,
        max_n,
        body_read_timeout,
        log_requests,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if isinstance(engine.engine, LLMEngine):  # (a front end's engines log their own)
            log_startup(engine.engine, served_model_name)
        stats = None
        if log_stats:
            stats = asyncio.create_task(StatLogger(engine, metrics).run(log_stats_interval))
        yield
        if stats is not None:
            stats.cancel()
        await engine.shutdown()

    app = FastAPI(title="vllm-rlt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.drain = Drain()
    app.add_middleware(CatchAll)
    app.add_middleware(DrainGate, drain=app.state.drain)  # added last: the outermost

    async def check_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), state.api_key.encode()
        )
        if not ok:
            raise APIError(401, "invalid or missing API key")

    auth = [Depends(check_api_key)]

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(_, APIError(400, "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # 404 for an unknown path, 405 (with its Allow header) for a known path's other methods
        message = f"{err.detail}: {request.method} {request.url.path}"
        return await api_error(request, APIError(err.status_code, message, headers=err.headers))

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        raise APIError(503, engine.health_message)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version("vllm-rlt")}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=state.max_model_len)])

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req = await read_json(
            request, CompletionRequest, state.max_body_bytes, state.body_read_timeout
        )
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = await read_json(
            request, ChatCompletionRequest, state.max_body_bytes, state.body_read_timeout
        )
        return await create_chat_completion(state, req, request)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_route(request: Request):
        req = await read_json(
            request, TokenizeRequest, state.max_body_bytes, state.body_read_timeout
        )
        return tokenize(state, req)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_route(request: Request):
        req = await read_json(
            request, DetokenizeRequest, state.max_body_bytes, state.body_read_timeout
        )
        return detokenize(state, req)

    return app
