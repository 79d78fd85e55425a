"""The front end of a disaggregated server: starts the engine processes, routes each request
to the least-loaded prefill and decode engine, relays the control messages of its life
(protocol.py) and streams its outputs from the decode side.

`PDRouter` has the interface the OpenAI app uses of `AsyncLLMEngine` (`add_request` returning a
`RequestStream`, `abort`, `snapshot`, `is_healthy`, `error`, `start`, `shutdown`, and `engine`,
here a `FrontEndInfo`), so the same app serves it. It lives on the event loop; a reader thread
waits on every engine's connection (and a local one's process sentinel) and hands what arrives
to the loop. The engine processes, local or on other hosts, are started by `engines.py`.

Faults: when an engine process dies, every request it was serving ends with
`RequestFailedError` naming it, the surviving side of each is told to drop it (its blocks are
freed), the prefill engines stop sending KV to a dead decode engine, and `is_healthy` turns False
(`health_message` names the dead engines) while the others go on serving. With no prefill or
no decode engine left, `error` is set and the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.engines import EngineHandle, join_all, start_engines
from vllm_rlt.disagg.prefill_role import prefill_params
from vllm_rlt.engine.async_engine import (
    EngineDeadError,
    EngineSnapshot,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from vllm_rlt.models.loader import read_config, read_tokenizer
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.serve_config import DisaggConfig

logger = logging.getLogger(__name__)
PD_COUNTERS = {  # the transfer counters of `snapshot.stats`, each a /metrics counter
    "pd_transfers": "Requests whose KV the decode engines imported.",
    "pd_kv_transfer_chunks": "KV chunks received by the decode engines.",
    "pd_kv_transfer_bytes": "KV bytes received by the decode engines.",
    "pd_kv_transfer_skipped_blocks": "Prompt KV blocks not sent: the decode engine's prefix "
    "cache held them.",
    "pd_transfer_overlap_seconds": "Summed over requests: how long before the end of the "
    "prompt's prefill its first KV chunk reached the decode engine.",
}


@dataclass(frozen=True)
class FrontEndInfo:
    """What the OpenAI app reads of the engine (the attributes it reads of an `LLMEngine`)."""

    config: EngineConfig
    tokenizer: object
    model_config: object
    num_loops: int
    max_model_len: int  # the smallest of the engines'


@dataclass
class _Flight:
    handle: int
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    prefill: EngineHandle
    decode: EngineHandle
    stream: RequestStream
    accepted: asyncio.Future
    prefill_done: bool = False  # the first token came back: the prefill side is finished
    transfer: dict[str, float] = field(default_factory=dict)  # see `PDRouter.transfers`


class PDRouter:
    def __init__(
        self,
        config: EngineConfig,
        disagg: DisaggConfig,
        *,
        max_waiting_requests: int | None = None,
        record_transfers: bool = False,
    ):
        """Starts pd_prefill + pd_decode engine processes (`engines.start_engines`: the remote
        ones connect) and waits until all are ready
        (ConfigError with the first engine's message when one cannot start).
        `record_transfers`: keep, per finished request, when the prefill engine completed its
        prompt, when its first chunk reached the decode engine and how many blocks the decode
        engine's prefix cache held (`transfers`; tests)."""
        self.max_waiting_requests = max_waiting_requests
        self.transfers: dict[str, dict[str, float]] | None = {} if record_transfers else None
        self.engines = start_engines(config, disagg)
        max_len = min(e.max_model_len for e in self.engines)
        model_dir = Path(config.model.model or default_model_dir())
        self.engine = FrontEndInfo(
            config,
            read_tokenizer(model_dir),
            read_config(model_dir),
            self.engines[0].num_loops,
            max_len,
        )
        self._flights: dict[int, _Flight] = {}
        self._by_id: dict[str, int] = {}
        self._handles = itertools.count()
        self._seeds = random.Random(config.model.seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._transfer_stats = dict.fromkeys(PD_COUNTERS, 0)
        self.snapshot = EngineSnapshot(stats=dict(self._transfer_stats))

    # ---- the AsyncLLMEngine interface -----------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.error is None and all(e.alive for e in self.engines)

    @property
    def health_message(self) -> str:
        dead = [e.name for e in self.engines if not e.alive]
        if self.error is not None:
            return f"no prefill or no decode engine is left: {', '.join(dead)} died"
        alive = len(self.engines) - len(dead)
        return f"degraded: {', '.join(dead)} died; {alive} of {len(self.engines)} engines serve"

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            threading.Thread(target=self._read, daemon=True, name="pd-reader").start()

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Route a request; returns its stream once the decode engine accepted it. Raises
        ValueError for bad input, QueueFullError, EngineDeadError as `AsyncLLMEngine`."""
        self.start()
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if self.error is not None:
            raise EngineDeadError(self.health_message)
        if params.n != 1:
            raise ValueError("n: a disaggregated server runs one sample per request (n=1)")
        if isinstance(prompt, str):
            prompt = self.engine.tokenizer.encode(prompt).ids
        limit = self.max_waiting_requests
        waiting = sum(not f.prefill_done for f in self._flights.values())
        if limit is not None and waiting + 1 > limit:
            raise QueueFullError(f"{limit} samples are already waiting; retry later")
        if request_id in self._by_id:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prefill, decode = self._least_loaded(True), self._least_loaded(False)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        handle = next(self._handles)
        flight = _Flight(
            handle, request_id, tuple(prompt), params, seed, prefill, decode,
            RequestStream(self, request_id), self._loop.create_future(),
        )  # fmt: skip
        self._flights[handle] = flight
        self._by_id[request_id] = handle
        prefill.load += 1
        decode.load += 1
        expect = msg.Expect(handle, request_id, flight.prompt, params, seed, prefill.place.rank)
        self._send(decode, expect)
        try:
            await flight.accepted
        except asyncio.CancelledError:  # the client went away before the engine answered
            self.abort(request_id)
            raise
        return flight.stream

    def abort(self, request_id: str) -> None:
        """Drop a request on both sides (its blocks are freed there)."""
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

    def engine_pids(self, prefill: bool) -> list[int]:
        return [e.pid for e in self.engines if e.place.is_prefill == prefill]

    # ---- routing --------------------------------------------------------------------------
    def _least_loaded(self, prefill: bool) -> EngineHandle:
        alive = [e for e in self.engines if e.alive and e.place.is_prefill == prefill]
        if not alive:
            raise EngineDeadError(self.health_message)
        return min(alive, key=lambda e: e.load)

    def _send(self, engine: EngineHandle, message) -> None:
        if not engine.alive:
            return
        with contextlib.suppress(OSError):  # it died; its sentinel will say so
            engine.conn.send(message)

    def _end(self, flight: _Flight, notify: bool = False, error: BaseException | None = None):
        """Forget a request; `notify`: tell its engines to drop it; `error`: end its stream
        (or its pending add) with that error."""
        if self._flights.pop(flight.handle, None) is None:
            return
        del self._by_id[flight.request_id]
        flight.decode.load -= 1
        if not flight.prefill_done:
            flight.prefill.load -= 1
            if notify:
                self._send(flight.prefill, msg.Abort(flight.handle))
        if notify:
            self._send(flight.decode, msg.Abort(flight.handle))
        if error is not None:
            if not flight.accepted.done():
                flight.accepted.set_exception(error)
            else:
                flight.stream.put(error)
        if self.transfers is not None and error is None:
            self.transfers[flight.request_id] = flight.transfer

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
        elif isinstance(m, msg.Reserved):
            flight.transfer["skip_blocks"] = m.skip_blocks
            params = prefill_params(flight.params, flight.seed)
            order = msg.Prefill(
                flight.handle, flight.request_id, flight.prompt, params,
                flight.decode.place.rank, m.skip_blocks,
            )  # fmt: skip
            self._send(flight.prefill, order)
        elif isinstance(m, msg.FirstToken):
            flight.prefill_done = True
            flight.prefill.load -= 1
            flight.transfer["prefill_done_at"] = m.prefill_done_at
            self._send(flight.decode, m)
        elif isinstance(m, msg.Imported):
            flight.transfer["first_chunk_at"] = m.first_chunk_at
            self._count_transfer(flight.transfer, m)

    def _on_outputs(self, m: msg.Outputs) -> None:
        for handle, out in m.items:
            flight = self._flights.get(handle)
            if flight is None:
                continue
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
            if flight.decode is engine or flight.prefill is engine and not flight.prefill_done:
                self._end(flight, notify=True, error=err)
        if not engine.place.is_prefill:  # (a decode engine's receiving threads end by themselves)
            for e in self.engines:
                if e.place.is_prefill:
                    self._send(e, msg.PeerDead(engine.place.rank))
        sides = {e.place.is_prefill for e in self.engines if e.alive}
        if sides != {True, False}:
            self.error = EngineDeadError(self.health_message)
            self._fail_all(self.error)
        self._refresh_snapshot()

    def _fail_all(self, error: BaseException) -> None:
        for flight in list(self._flights.values()):
            self._end(flight, notify=True, error=error)

    def _count_transfer(self, transfer: dict[str, float], m: msg.Imported) -> None:
        """Add an imported request's transfer to the counters `/metrics` reports (the overlap:
        how long before the end of its prefill its first KV chunk arrived; one clock per host)."""
        t = self._transfer_stats
        t["pd_transfers"] += 1
        t["pd_kv_transfer_chunks"] += m.num_chunks
        t["pd_kv_transfer_bytes"] += m.num_bytes
        t["pd_kv_transfer_skipped_blocks"] += transfer.get("skip_blocks", 0)
        overlap = transfer.get("prefill_done_at", m.first_chunk_at) - m.first_chunk_at
        t["pd_transfer_overlap_seconds"] += max(0.0, overlap)
        self._refresh_snapshot()

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
            stats=dict(self._transfer_stats),
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
        except RuntimeError:  # the event loop closed: the router is gone
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
