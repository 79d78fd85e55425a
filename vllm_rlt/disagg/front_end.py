"""The front end of engine processes (`engines.py`): what the PD router (`router.PDRouter`) and
the data-parallel replicas' router (`replicas.ReplicaRouter`) share. The subclasses choose the
engines of a request and the messages of its life; this class keeps the requests in flight, the
streams, health, the gauges and the engines' deaths.

`FrontEnd` has the interface the OpenAI app uses of `AsyncLLMEngine` (`add_request` returning a
`RequestStream`, `abort`, `snapshot`, `is_healthy`, `error`, `start`, `shutdown`, and `engine`,
here a `FrontEndInfo`), so the same app serves it. It lives on the event loop; a reader thread
waits on every engine's connection (and a local one's process sentinel) and hands what arrives
to the loop.

Faults: when an engine process dies, every request that depends on it ends with
`RequestFailedError` naming it, the surviving engines are told to drop those requests (their
blocks are freed), and `is_healthy` turns False (`health_message` names the dead engines) while
the others go on serving. When the survivors cannot serve (`_survive`), `error` is set and the
server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.engines import EngineHandle, join_all, start_engines
from vllm_rlt.engine.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from vllm_rlt.engine.stats import EngineSnapshot
from vllm_rlt.models.hub import resolve_model_dir
from vllm_rlt.models.loader import read_config, read_tokenizer
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.serve_config import DisaggConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontEndInfo:
    """What the OpenAI app reads of the engine (the attributes it reads of an `LLMEngine`)."""

    config: EngineConfig
    tokenizer: object
    model_config: object
    num_loops: int
    max_model_len: int  # the smallest of the engines'
    model_dir: Path  # (a hub id resolved)


@dataclass(kw_only=True)
class Flight:
    """A request routed to the engines and not finished (the subclasses add its engines)."""

    handle: int  # its number in the control messages
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    stream: RequestStream
    accepted: asyncio.Future  # done once the engine validated it
    started: bool = False  # an output came


class FrontEnd:
    KIND = "a server of several engines"  # what the server is, in messages
    GONE = "too few engines are left"  # why it stops, in messages

    def __init__(
        self,
        config: EngineConfig,
        disagg: DisaggConfig,
        *,
        max_waiting_requests: int | None = None,
    ):
        """Starts the engine processes (`engines.start_engines`: the remote ones connect) and
        waits until all are ready (ConfigError with the first engine's message when one cannot
        start)."""
        self.max_waiting_requests = max_waiting_requests
        self.engines = start_engines(config, disagg)
        max_len = min(e.max_model_len for e in self.engines)
        mc = config.model
        model_dir = resolve_model_dir(mc.model, mc.revision, mc.download_dir)
        self.engine = FrontEndInfo(
            config,
            read_tokenizer(model_dir),
            read_config(model_dir),
            self.engines[0].num_loops,
            max_len,
            model_dir,
        )
        self._flights: dict[int, Flight] = {}
        self._by_id: dict[str, int] = {}
        self._handles = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot(stats=self._stats())

    # ---- what the subclasses define -------------------------------------------------------
    def _route(self, **request) -> Flight:
        """Choose the engines of a new request (`Flight`'s fields as keywords), count it in
        their load and send it its first message; its Flight. EngineDeadError when no engine
        can take it."""
        raise NotImplementedError

    def _forget(self, flight: Flight, notify: bool, failed: bool) -> None:
        """A request ends: take it off its engines' load; `notify`: tell them to drop it."""
        raise NotImplementedError

    def _num_waiting(self) -> int:
        """Requests routed and not yet served (what max_waiting_requests limits)."""
        raise NotImplementedError

    def _depends_on(self, flight: Flight, engine: EngineHandle) -> bool:
        """Whether the request fails when `engine` dies."""
        raise NotImplementedError

    def _survive(self, engine: EngineHandle) -> bool:
        """`engine` died and its requests failed: tell the others what they need to know;
        whether the survivors can still serve."""
        raise NotImplementedError

    def _on_request_message(self, flight: Flight, m) -> None:
        """A message about `flight` beyond Accepted and Rejected (none by default)."""

    def _stats(self) -> dict[str, float]:
        """The counters of `snapshot.stats` (none by default)."""
        return {}

    # ---- the AsyncLLMEngine interface -----------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.error is None and all(e.alive for e in self.engines)

    @property
    def health_message(self) -> str:
        dead = [e.name for e in self.engines if not e.alive]
        if self.error is not None:
            return f"{self.GONE}: {', '.join(dead)} died"
        alive = len(self.engines) - len(dead)
        return f"degraded: {', '.join(dead)} died; {alive} of {len(self.engines)} engines serve"

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            threading.Thread(target=self._read, daemon=True, name="front-end-reader").start()

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Route a request; returns its stream once the engine accepted it. Raises ValueError
        for bad input, QueueFullError, EngineDeadError as `AsyncLLMEngine`."""
        self.start()
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if self.error is not None:
            raise EngineDeadError(self.health_message)
        if params.n != 1:
            raise ValueError(f"n: {self.KIND} runs one sample per request (n=1)")
        if isinstance(prompt, str):
            prompt = self.engine.tokenizer.encode(prompt).ids
        limit = self.max_waiting_requests
        if limit is not None and self._num_waiting() + 1 > limit:
            raise QueueFullError(f"{limit} samples are already waiting; retry later")
        if request_id in self._by_id:
            raise ValueError(f"request_id {request_id!r} is already in use")
        handle = next(self._handles)
        flight = self._route(
            handle=handle, request_id=request_id, prompt=tuple(prompt), params=params,
            stream=RequestStream(self, request_id), accepted=self._loop.create_future(),
        )  # fmt: skip
        self._flights[handle] = flight
        self._by_id[request_id] = handle
        try:
            await flight.accepted
        except asyncio.CancelledError:  # the client went away before the engine answered
            self.abort(request_id)
            raise
        return flight.stream

    def abort(self, request_id: str) -> None:
        """Drop a request on its engines (its blocks are freed there)."""
        handle = self._by_id.get(request_id)
        if handle is not None:
            self._end(self._flights[handle], notify=True)

    async def shutdown(self) -> None:
        """Stop the engines; open streams end with EngineStoppedError."""
        self._stopping = True
        for e in self.engines:
            if e.alive:
                self._send(e, msg.Shutdown())
        await asyncio.to_thread(join_all, self.engines)
        self._fail_all(EngineStoppedError("the server is shutting down"))

    async def probe(self) -> list[msg.Status | None]:
        """Fresh gauges of every engine (None for a dead one)."""
        for e in self.engines:
            e.status = None
            if e.alive:
                self._send(e, msg.Probe())
        while any(e.alive and e.status is None for e in self.engines):
            await asyncio.sleep(0.01)
        return [e.status if e.alive else None for e in self.engines]

    def engine_pids(self, kind: str) -> list[int]:
        """The pids of the engines of `kind` ("prefill", "decode" or "replica")."""
        return [e.pid for e in self.engines if e.place.kind == kind]

    # ---- requests -------------------------------------------------------------------------
    def _least_loaded(self, kind: str) -> EngineHandle:
        alive = [e for e in self.engines if e.alive and e.place.kind == kind]
        if not alive:
            raise EngineDeadError(self.health_message)
        return min(alive, key=lambda e: e.load)

    def _send(self, engine: EngineHandle, message) -> None:
        if not engine.alive:
            return
        with contextlib.suppress(OSError):  # it died; its sentinel will say so
            engine.conn.send(message)

    def _end(self, flight: Flight, notify: bool = False, error: BaseException | None = None):
        """Forget a request; `notify`: tell its engines to drop it; `error`: end its stream
        (or its pending add) with that error."""
        if self._flights.pop(flight.handle, None) is None:
            return
        del self._by_id[flight.request_id]
        self._forget(flight, notify, failed=error is not None)
        if error is not None:
            if not flight.accepted.done():
                flight.accepted.set_exception(error)
            else:
                flight.stream.put(error)

    # ---- messages from the engines (on the event loop) -----------------------------------
    def _on_message(self, engine: EngineHandle, m) -> None:
        if isinstance(m, msg.Status):
            engine.status = m
            self._refresh_snapshot()
            return
        if isinstance(m, msg.Outputs):
            self._on_outputs(m)
            return
        flight = self._flights.get(m.handle)
        if flight is None:
            return  # a request that ended meanwhile
        if isinstance(m, msg.Accepted):
            flight.accepted.set_result(None)
        elif isinstance(m, msg.Rejected):
            err = ValueError(m.message) if m.invalid else RequestFailedError(m.message)
            self._end(flight, notify=True, error=err)
        else:
            self._on_request_message(flight, m)

    def _on_outputs(self, m: msg.Outputs) -> None:
        for handle, out in m.items:
            flight = self._flights.get(handle)
            if flight is None:
                continue
            flight.started = True
            flight.stream.put(out)
            if out.finished:
                self._end(flight)

    def _on_death(self, engine: EngineHandle) -> None:
        if not engine.alive:
            return
        engine.alive = False
        if self._stopping:
            return
        logger.error("%s died; its requests fail, the other engines go on", engine.name)
        err = RequestFailedError(f"the {engine.name} serving this request died")
        for flight in list(self._flights.values()):
            if self._depends_on(flight, engine):
                self._end(flight, notify=True, error=err)
        if not self._survive(engine):
            self.error = EngineDeadError(self.health_message)
            self._fail_all(self.error)
        self._refresh_snapshot()

    def _fail_all(self, error: BaseException) -> None:
        for flight in list(self._flights.values()):
            self._end(flight, notify=True, error=error)

    def _refresh_snapshot(self) -> None:
        live = [e.status for e in self.engines if e.alive and e.status is not None]
        free = sum(s.num_free_blocks for s in live)
        total = sum(s.num_total_blocks for s in live)
        self.snapshot = EngineSnapshot(
            num_running=sum(s.num_running for s in live),
            num_waiting=sum(s.num_waiting for s in live),
            kv_usage=1.0 - free / total if total else 0.0,
            num_free_blocks=free,
            num_total_blocks=total,
            stats=self._stats(),
        )

    # ---- the reader thread and the processes ---------------------------------------------
    def _read(self) -> None:
        """Hand every message, then the death of each engine, to the event loop (until the
        loop closes)."""
        watched = {w: e for e in self.engines for w in e.waitables()}
        try:
            while watched:
                for ready in wait(list(watched), timeout=0.5):
                    if ready in watched:
                        self._take(watched, ready)
        except RuntimeError:  # the event loop closed: the front end is gone
            return

    def _take(self, watched: dict, ready) -> None:
        engine = watched[ready]
        hand = self._loop.call_soon_threadsafe
        if ready is engine.conn:
            try:
                hand(self._on_message, engine, engine.conn.recv())
            except (EOFError, OSError):
                del watched[ready]
                if engine.process is None:  # a remote engine: its connection closing is its end
                    hand(self._on_death, engine)
            return
        with contextlib.suppress(EOFError, OSError):  # the process ended: its last messages first
            while engine.conn.poll():
                hand(self._on_message, engine, engine.conn.recv())
        watched.pop(engine.conn, None)
        del watched[ready]
        hand(self._on_death, engine)
