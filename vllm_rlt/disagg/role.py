"""What an engine process of a front end is and does: its `Placement` in the group, and the
loop every role runs (`Role.run`: control messages from the front end, KV links, engine steps).

The loop never blocks on a peer: KV sends and receives are polled, and while the engine has
nothing to run it waits at most IDLE_WAIT_S for a message. The role classes (`PrefillRole`,
`DecodeRole`, `ReplicaRole` in their modules) add what each does with a request;
`StreamingRole` is the part of the last two that streams a request's outputs to the front end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from multiprocessing.connection import Connection

import torch

from vllm_rlt.disagg import protocol as msg
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.engine.stats import EngineSnapshot

IDLE_WAIT_S = 0.002  # longest wait for a message while the engine has nothing to run
STATUS_INTERVAL_S = 0.05  # shortest time between two Status messages


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an engine process runs in the group (a PD engine), or which replica it is."""

    rank: int  # prefill i is rank i, decode j is rank num_prefill + j; replica k is rank k
    num_prefill: int
    num_decode: int
    port: int  # the rendezvous port (resolved: never 0; unused by replicas)
    num_replicas: int = 0  # > 0: a data-parallel replica, of this many (no process group)

    @property
    def is_prefill(self) -> bool:
        return self.rank < self.num_prefill

    @property
    def is_replica(self) -> bool:
        return self.num_replicas > 0

    @property
    def kind(self) -> str:
        if self.is_replica:
            return "replica"
        return "prefill" if self.is_prefill else "decode"

    @property
    def num_engines(self) -> int:
        """The engine processes of the server (they share the host's cores on CPU)."""
        return self.num_replicas or self.world_size

    @property
    def world_size(self) -> int:
        return self.num_prefill + self.num_decode


class Role:
    def __init__(self, engine: LLMEngine, place: Placement, conn: Connection):
        self.engine = engine
        self.place = place
        self.conn = conn
        self._last_status: tuple | None = None
        self._status_at = 0.0

    def handle(self, message) -> None:
        raise NotImplementedError

    def poll_links(self) -> None:
        """Take in what arrived over the KV links (the decode side)."""

    def after_step(self, outputs) -> None:
        raise NotImplementedError

    def num_waiting(self, snapshot: EngineSnapshot) -> int:
        return snapshot.num_waiting

    def admit(self, order) -> bool:
        """Add the request of `order` (a `Prefill` or `Generate`) to the engine; one the engine
        refuses is `Rejected` as invalid (False)."""
        try:
            self.engine.add_request(order.request_id, list(order.prompt_token_ids), order.params)
        except ValueError as err:
            self.conn.send(msg.Rejected(order.handle, str(err), invalid=True))
            return False
        return True

    def run(self) -> None:
        """The loop, until `Shutdown` or until the front end is gone (its pipe closed)."""
        with torch.inference_mode(), contextlib.suppress(EOFError, OSError):
            while True:
                busy = self.engine.has_unfinished_requests()
                if self.conn.poll(0 if busy else IDLE_WAIT_S):
                    while self.conn.poll():
                        message = self.conn.recv()
                        if isinstance(message, msg.Shutdown):
                            return
                        if isinstance(message, msg.Probe):
                            self._report(force=True)
                        else:
                            self.handle(message)
                self.poll_links()
                if self.engine.has_unfinished_requests():
                    self.after_step(self.engine.step())
                self._report()

    def _report(self, force: bool = False) -> None:
        """Send the gauges when they changed, at most every STATUS_INTERVAL_S (or `force`);
        inside the interval nothing is read."""
        now = time.monotonic()
        if not force and now - self._status_at < STATUS_INTERVAL_S:
            return
        s = self.engine.snapshot()
        gauges = (s.num_running, self.num_waiting(s), s.num_free_blocks, s.num_total_blocks)
        if force or gauges != self._last_status:
            self.conn.send(msg.Status(self.place.rank, *gauges))
            self._last_status, self._status_at = gauges, now


class StreamingRole(Role):
    """A role whose engine generates requests to the end: sends their outputs (`Outputs`, by
    handle) after each step."""

    def __init__(self, engine: LLMEngine, place: Placement, conn: Connection):
        super().__init__(engine, place, conn)
        self.active: dict[str, int] = {}  # request id -> handle, while it generates here

    def abort_active(self, handle: int) -> None:
        """Drop the generating request of `handle`, if any (its blocks are freed)."""
        for req_id, h in list(self.active.items()):
            if h == handle:
                del self.active[req_id]
                self.engine.abort_request(req_id)

    def after_step(self, outputs) -> None:
        items = []
        for out in outputs:
            handle = self.active.get(out.request_id)
            if handle is None:
                continue
            items.append((handle, out))
            if out.finished:
                del self.active[out.request_id]
        if items:
            self.conn.send(msg.Outputs(tuple(items)))
