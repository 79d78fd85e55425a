"""The engine processes behind a front end (a disaggregated server's prefill and decode engines,
or data-parallel replicas), seen from the front end: starting them (local ones spawned here,
remote PD engines accepted as they connect), waiting until they are ready, stopping them.

A remote engine is started on its own host with `vllm-rlt pd-engine --pd-connect HOST:PORT
--pd-rank R` (`remote_engine_main`). It connects to the front end's control port, authenticated
by the secret both read from $VLLM_RLT_PD_AUTHKEY, says which rank it is (`Join`), receives
the placement and the settings (`Assign`), and from then on runs as a local engine does, with
the socket in place of the pipe. The front end learns that it died when its connection closes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener, wait

from vllm_rlt.config import ConfigError, EngineConfig
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.role import Placement
from vllm_rlt.disagg.worker import engine_main
from vllm_rlt.serve_config import AUTHKEY_ENV, DisaggConfig

START_TIMEOUT_S = 300.0  # most seconds the engines get to connect, load and join the group
STOP_TIMEOUT_S = 10.0  # most seconds an engine gets to stop before it is killed
CONNECT_RETRY_S = 0.2  # a remote engine's wait between attempts to reach the front end


@dataclass
class EngineHandle:
    place: Placement
    process: multiprocessing.process.BaseProcess | None  # None: on another host
    conn: Connection
    host: str = ""  # a remote engine's host
    pid: int = 0
    max_model_len: int = 0
    num_loops: int = 0
    alive: bool = True
    load: int = 0  # requests routed here and not finished on this side
    routed: int = 0  # requests routed here in all
    status: msg.Status | None = None

    @property
    def name(self) -> str:
        p = self.place
        where = f"pid {self.pid} on {self.host}" if self.process is None else f"pid {self.pid}"
        if p.is_replica:
            return f"replica {p.rank} ({where})"
        if p.is_prefill:
            return f"prefill engine {p.rank} ({where})"
        return f"decode engine {p.rank - p.num_prefill} ({where})"

    def waitables(self) -> list:
        """What the front end's reader waits on: the connection, and a local process's
        sentinel (a remote engine's death shows as its connection closing)."""
        return [self.conn] if self.process is None else [self.conn, self.process.sentinel]


def authkey() -> bytes:
    key = os.environ.get(AUTHKEY_ENV, "")
    if not key:
        raise ConfigError(
            f"engines on other hosts need a shared secret: set {AUTHKEY_ENV} on every host"
        )
    return key.encode()


def start_engines(config: EngineConfig, disagg: DisaggConfig) -> list[EngineHandle]:
    """Start the local engines, accept the remote ones, and wait until all are ready
    (ConfigError with the first failure; every engine is then stopped): the PD engines, or
    with data_parallel_size > 1 the replicas."""
    ctx = multiprocessing.get_context("spawn")
    if disagg.data_parallel_size > 1:
        num = disagg.data_parallel_size
        places = [Placement(rank, 0, 0, 0, num_replicas=num) for rank in range(num)]
    else:
        port = disagg.pd_master_port or free_port(disagg.pd_master_addr)
        n, m = disagg.pd_prefill, disagg.pd_decode
        places = [Placement(rank, n, m, port) for rank in range(n + m)]
    remote = [p for p in places if disagg.is_remote(p.rank)]
    accepted = _Acceptor(disagg, [p.rank for p in remote]) if remote else None
    engines = []
    for place in places:
        if disagg.is_remote(place.rank):
            continue
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=engine_main, args=(place, config, disagg, there), daemon=True,
            name=f"vllm-rlt-{place.kind}-{place.rank}",
        )  # fmt: skip
        proc.start()
        there.close()
        engines.append(EngineHandle(place, proc, here))
    if accepted is not None:
        try:
            joined = accepted.result(time.monotonic() + START_TIMEOUT_S)
        except ConfigError:
            kill_all(engines)
            raise
        for place in remote:
            conn, host = joined[place.rank]
            conn.send(msg.Assign(place, config, disagg))
            engines.append(EngineHandle(place, None, conn, host))
        engines.sort(key=lambda e: e.place.rank)
    _wait_ready(engines)
    return engines


class _Acceptor:
    """Accepts the remote engines' connections on the control port, in a thread (so that the
    local engines load meanwhile)."""

    def __init__(self, disagg: DisaggConfig, ranks: list[int]):
        address = (disagg.pd_master_addr, disagg.pd_control_port)
        self.listener = Listener(address, authkey=authkey())
        self.ranks = set(ranks)
        self.joined: dict[int, tuple[Connection, str]] = {}
        self.closed = False
        self.refused = False  # an engine's handshake failed: its secret differs
        self.thread = threading.Thread(target=self._accept, daemon=True, name="pd-acceptor")
        self.thread.start()

    def _accept(self) -> None:
        while self.ranks - set(self.joined):
            try:
                conn = self.listener.accept()
                join = conn.recv()
            except multiprocessing.AuthenticationError:
                self.refused = True  # no wait for the deadline: the start fails now
                return
            except (OSError, EOFError):
                if self.closed:  # the deadline passed
                    return
                continue  # a connection that did not complete: wait for the next
            if not isinstance(join, msg.Join) or join.rank not in self.ranks - set(self.joined):
                conn.send(msg.StartFailed(-1, f"this front end expects no engine {join!r}"))
                conn.close()
                continue
            self.joined[join.rank] = (conn, join.host)

    def result(self, deadline: float) -> dict[int, tuple[Connection, str]]:
        self.thread.join(max(0.0, deadline - time.monotonic()))
        missing = sorted(self.ranks - set(self.joined))
        self.closed = True
        self.listener.close()
        if missing:
            for conn, _ in self.joined.values():
                conn.close()
            if self.refused:
                raise ConfigError(
                    f"remote engines {missing} did not connect: an engine's handshake was "
                    f"refused ({AUTHKEY_ENV} differs from this front end's)"
                )
            raise ConfigError(f"remote engines {missing} did not connect in {START_TIMEOUT_S} s")
        return self.joined


def _wait_ready(engines: list[EngineHandle]) -> None:
    """Wait for every engine's Ready; the first that fails (or exits, or the deadline) ends
    the start, and every engine with it (the others may wait for it to join the group)."""
    waiting = {e.conn: e for e in engines}
    deadline = time.monotonic() + START_TIMEOUT_S
    while waiting:
        ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        for conn in ready or list(waiting)[:1]:
            e = waiting.pop(conn)
            try:
                reply = conn.recv() if ready else None
            except (EOFError, OSError):  # the process ended
                reply = None
            if not isinstance(reply, msg.Ready):
                kill_all(engines)
                why = reply.message if isinstance(reply, msg.StartFailed) else "exited or hung"
                raise ConfigError(f"engine {e.place.rank} could not start: {why}")
            e.pid, e.max_model_len, e.num_loops = reply.pid, reply.max_model_len, reply.num_loops


def join_all(engines: list[EngineHandle]) -> None:
    for e in engines:
        if e.process is not None:
            e.process.join(STOP_TIMEOUT_S)
    kill_all(engines)


def kill_all(engines: list[EngineHandle]) -> None:
    """Kill the local engines; close the remote ones' connections (they stop when it closes)."""
    for e in engines:
        if e.process is None:
            e.conn.close()
        elif e.process.is_alive():
            e.process.kill()
            e.process.join()


def remote_engine_main(host: str, port: int, rank: int) -> None:
    """The body of `vllm-rlt pd-engine`: reach the front end (retrying until it listens, at
    most START_TIMEOUT_S), then run engine `rank` as it assigns."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            conn = Client((host, port), authkey=authkey())
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise ConfigError(f"no front end listens on {host}:{port}") from None
            time.sleep(CONNECT_RETRY_S)
        except multiprocessing.AuthenticationError:
            raise ConfigError(f"the front end at {host}:{port} refused {AUTHKEY_ENV}") from None
    conn.send(msg.Join(rank, socket.gethostname()))
    order = conn.recv()
    if isinstance(order, msg.StartFailed):
        raise ConfigError(order.message)
    with contextlib.suppress(EOFError, OSError):
        engine_main(order.place, order.config, order.disagg, conn)


def free_port(addr: str) -> int:
    """A TCP port free on `addr` now."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
