"""The FastAPI app: routes, API-key check, OpenAI-shaped errors.

`build_app(engine, served_model_name, ...)` takes an `AsyncLLMEngine` (or an `LLMEngine`, which
it wraps); the app starts the engine loop on startup and stops it on shutdown. `app.state.drain`
is the gate's `Drain`: a server that stops closes it (see lifecycle.py).
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer
from vllm_rlt.entrypoints.openai.metrics import ServerMetrics
from vllm_rlt.entrypoints.openai.middleware import CatchAll, Drain, DrainGate
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from vllm_rlt.entrypoints.openai.serving_chat import create_chat_completion
from vllm_rlt.entrypoints.openai.serving_common import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_MAX_N,
    APIError,
    ServerState,
    read_json,
)
from vllm_rlt.entrypoints.openai.serving_completion import create_completion
from vllm_rlt.models.tiny import default_model_dir

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
) -> FastAPI:
    if isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests)
    elif max_waiting_requests is not None:
        engine.max_waiting_requests = max_waiting_requests
    metrics = ServerMetrics(engine.engine.num_loops)
    model_dir = engine.engine.config.model.model or default_model_dir()
    chat = ChatRenderer(model_dir)
    state = ServerState(
        engine, served_model_name, api_key, max_body_bytes, metrics, chat, max_n, body_read_timeout
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
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
            msg = "invalid or missing API key"
            raise APIError(401, msg, type="authentication_error", code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(_, APIError(400, "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return await api_error(_, APIError(err.status_code, str(err.detail), type=kind))

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return JSONResponse(
            APIError(503, "the engine loop has stopped", type="internal_server_error").body(), 503
        )

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        text = metrics.render(engine.snapshot)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

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

    return app
