"""The uvicorn server of `vllm-rlt serve`: graceful shutdown, exit on engine death, bounded reads.

SIGTERM or SIGINT closes the app's drain gate (new requests get 503), lets the running requests
finish for up to `shutdown_timeout` seconds, then shuts the engine down, which ends the rest (a
stream gets an error event then `[DONE]`, a non-streaming request a 503), and stops uvicorn. A
second signal ends the wait at once. When the engine loop dies of a fault, the server closes the
gate the same way, waits at most DEAD_ENGINE_DRAIN_S for the failed requests to be answered, and
stops with `engine_failed` set, so that the process exits non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.entrypoints.openai.middleware import Drain

# uvicorn's logger: its handler prints our info lines beside uvicorn's own
logger = logging.getLogger("uvicorn.error")
# uvicorn's logging setup, plus the package's loggers (start line, stats, requests) on its handler
LOG_CONFIG = {
    **LOGGING_CONFIG,
    "loggers": {
        **LOGGING_CONFIG["loggers"],
        "vllm_rlt": {"handlers": ["default"], "level": "INFO", "propagate": False},
    },
}
DEAD_ENGINE_DRAIN_S = 3.0  # most seconds a server whose engine died answers before it stops
CUT_OFF_GRACE_S = 0.5  # seconds the requests ended by the cut-off get to send their last bytes


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, except that an idle connection (just opened, or its last response
    sent) is closed unless a whole request head arrives within `timeout_keep_alive` seconds.
    uvicorn arms that timer only after a response and disarms it at the first byte received, so
    a client that sends nothing, or half a head, would hold its connection forever."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        # the timer stays armed until handle_events() has parsed a request head
        self.conn.receive_data(data)
        self.handle_events()


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        shutdown_timeout: float,
        timeout_keep_alive: int,
    ):
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            log_config=LOG_CONFIG,
            http=HeadTimeoutH11Protocol,
            timeout_keep_alive=timeout_keep_alive,
            timeout_graceful_shutdown=CUT_OFF_GRACE_S,
        )
        super().__init__(config)
        self.engine: AsyncLLMEngine = app.state.server.engine
        self.drain: Drain = app.state.drain
        self.shutdown_timeout = shutdown_timeout
        self._num_signals = 0
        self._deadline: float | None = None  # end of the drain; None while serving

    @property
    def engine_failed(self) -> bool:
        return self.engine.error is not None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Replaces uvicorn's handler, which stops at once and raises the signal again after the
        # shutdown (SIGTERM would then end the process with status -15). on_tick() acts on it.
        self._num_signals += 1

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        if self._deadline is None:
            if self._num_signals:
                self._close_gate(now + self.shutdown_timeout)
                logger.info(
                    "stopping: new requests get 503; %d running request(s) get up to %g s",
                    self.drain.num_in_flight,
                    self.shutdown_timeout,
                )
            elif self.engine_failed:
                self._close_gate(now + DEAD_ENGINE_DRAIN_S)
                logger.error("the engine failed; stopping the server")
            else:
                return False
        elif self._num_signals > 1:
            self._deadline = now
        if self.drain.num_in_flight and now < self._deadline:
            return False
        await self._cut_off()
        return True

    def _close_gate(self, deadline: float) -> None:
        self.drain.closed = True
        self._deadline = deadline

    async def _cut_off(self) -> None:
        """Shut the engine down (open requests end with an error) and give the requests a moment
        to send it; uvicorn then stops."""
        if self.drain.num_in_flight:
            logger.warning("ending %d request(s) still running", self.drain.num_in_flight)
        await self.engine.shutdown()
        deadline = time.monotonic() + CUT_OFF_GRACE_S
        while self.drain.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
