"""The async engine for servers: one background loop owns the `LLMEngine` and every step.

The `LLMEngine` is not thread-safe. Every engine call (add, abort, step) happens on the loop:
`add_request` and aborts are queued as commands and applied between steps; `step()` itself runs
in a worker thread (`asyncio.to_thread`) so the event loop stays responsive. Outputs are copied
before they leave the loop, so a consumer never sees a later step's mutation.

If a step raises, the loop dies: `error` holds the fault, every open stream and every pending add
gets `EngineDeadError`, `is_healthy` turns False, and later requests fail at once. `shutdown()` ends
open streams and later requests with `EngineStoppedError` instead. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import torch

from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.engine.stats import EngineSnapshot
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.request import RequestStatus
from vllm_rlt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The background loop stopped after an error; the engine serves nothing more."""


class EngineStoppedError(EngineDeadError):
    """The engine was shut down (the server is stopping); it serves nothing more."""


class QueueFullError(RuntimeError):
    """`max_waiting_requests` samples are already waiting."""


class RequestFailedError(RuntimeError):
    """A fault of this request ended it (finish_reason "error"); other requests go on."""


def _copy(out: RequestOutput) -> RequestOutput:
    # The processor replaces (never mutates) the per-completion lists, so shallow copies do.
    return dataclasses.replace(out, outputs=[dataclasses.replace(c) for c in out.outputs])


class RequestStream:
    """Async iterator over one request's outputs; `close()` aborts it if it is still running."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if any(c.finish_reason == RequestStatus.FINISHED_ERROR.value for c in item.outputs):
                raise RequestFailedError(
                    f"request {self.request_id} failed while generating; see the server log"
                )
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._streams: dict[str, RequestStream] = {}
        # commands applied before the next step: ("add", id, prompt, params, future) / ("abort", id)
        self._commands: list[tuple] = []
        self._num_pending_samples = 0  # samples of queued adds (they count as waiting)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.error: BaseException | None = None  # the fault that ended the loop (None: no fault)
        self.snapshot = EngineSnapshot()
        self._refresh_snapshot()

    @classmethod
    def from_kwargs(cls, model: str | None = None, *, max_waiting_requests=None, **engine_args):
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        return cls(LLMEngine(config.for_server()), max_waiting_requests=max_waiting_requests)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and not (self._task is not None and self._task.done())

    @property
    def health_message(self) -> str:
        """Why /health fails (read when `is_healthy` is False)."""
        return "the engine loop has stopped"

    # ---- public API (call from the event loop) -------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def shutdown(self) -> None:
        """Stop the loop after the current step; open streams end with EngineStoppedError."""
        self._stopping = True
        if self._task is not None:
            self._wakeup.set()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail(EngineStoppedError("the server is shutting down"))

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Raises ValueError for
        bad input, QueueFullError when too many samples wait (each of the n samples counts),
        EngineDeadError after a loop failure."""
        self.start()
        self._check_alive()
        limit = self.max_waiting_requests
        if (
            limit is not None
            and self.snapshot.num_waiting + self._num_pending_samples + params.n > limit
        ):
            raise QueueFullError(f"{limit} samples are already waiting; retry later")
        future = asyncio.get_running_loop().create_future()
        stream = RequestStream(self, request_id)
        self._num_pending_samples += params.n
        self._commands.append(("add", request_id, prompt, params, future, stream))
        self._wakeup.set()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                stream.close()  # accepted, but nobody will read it
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as its tokens arrive; closing the iterator aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request before the next step (its KV is freed then); safe to call anytime."""
        self._streams.pop(request_id, None)
        if self._task is not None and not self._task.done():
            self._commands.append(("abort", request_id))
            self._wakeup.set()

    # ---- the loop ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError("the engine loop has stopped; see the server log")
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")

    async def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._refresh_snapshot()
                    self._wakeup.clear()
                    if not self._commands:
                        await self._wakeup.wait()
                    continue
                outputs = await asyncio.to_thread(self._step)
                self._refresh_snapshot()
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    if stream is not None:
                        stream.put(_copy(out))
        except Exception as err:
            logger.exception("engine loop failed")
            self._fail(EngineDeadError(f"the engine failed: {type(err).__name__}"), cause=err)

    def _step(self) -> list[RequestOutput]:
        with torch.inference_mode():
            return self.engine.step()

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for cmd in commands:
            if cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
                continue
            _, request_id, prompt, params, future, stream = cmd
            self._num_pending_samples -= params.n
            if future.cancelled():
                continue
            try:  # a request that cannot be added fails alone (the engine queues all or nothing)
                self.engine.add_request(request_id, prompt, params)
            except Exception as err:
                if not isinstance(err, ValueError):
                    logger.exception("adding request %s failed", request_id)
                future.set_exception(err)
                continue
            self._streams[request_id] = stream
            future.set_result(None)
        if commands:
            self._refresh_snapshot()

    def _refresh_snapshot(self) -> None:
        self.snapshot = self.engine.snapshot()

    def _fail(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        if self.error is None:
            self.error = cause
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        for cmd in self._commands:
            if cmd[0] == "add" and not cmd[4].done():
                cmd[4].set_exception(error)
        self._commands.clear()
        self._num_pending_samples = 0
