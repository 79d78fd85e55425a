"""ASGI middleware at the HTTP edge of the app.

`DrainGate` counts the requests in flight and, once its `Drain` is closed (the server is
stopping), answers every new request 503 with `Connection: close`. `CatchAll` turns an error no
handler caught into a 500 JSON answer without re-raising it (re-raised, uvicorn would close the
connection behind a response that did not say so), and lets a client that left mid-body go
quietly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_rlt.entrypoints.openai.errors import APIError, shutting_down

logger = logging.getLogger(__name__)


@dataclass
class Drain:
    """What the gate shares with the server that stops it."""

    num_in_flight: int = 0  # HTTP requests whose handling has started and not ended
    closed: bool = False  # True once the server stops: new requests get 503


async def _send_error(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    await response(scope, receive, send)


class DrainGate:
    def __init__(self, app: ASGIApp, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.closed:
            await _send_error(shutting_down(), scope, receive, send)
            return
        self.drain.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.num_in_flight -= 1


class CatchAll:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:
            return  # the client left while sending its body: nobody to answer
        except Exception:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:  # else the response is cut short and uvicorn closes the connection
                error = APIError(500, "internal server error")
                await _send_error(error, scope, receive, send)
