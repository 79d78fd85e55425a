"""An engine process behind a front end: loads an `LLMEngine`, joins the engines' process
group (a disaggregated server's engines; a data-parallel replica joins none), then loops:
control messages from the front end, KV links, engine steps.

The loop (`_Role.run`) never blocks on a peer: KV sends and receives are polled, and while
the engine has nothing to run it waits at most IDLE_WAIT_S for a message. The role classes
(`PrefillRole`, `DecodeRole`, `ReplicaRole` in their modules) add what each does with a request;
`StreamingRole` is the part of the last two that streams a request's outputs to the front end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from multiprocessing.connection import Connection

import torch

from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.transport import init_group, pair_groups
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.serve_config import DisaggConfig

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


def engine_device(config: EngineConfig, rank: int) -> str | None:
    """Engine `rank`'s device: on CUDA one GPU per engine while there are enough, else shared."""
    device = config.model.device
    if device is None and torch.cuda.is_available():
        device = "cuda"
    if device == "cuda":
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def transport_backend(disagg: DisaggConfig, device: torch.device, world_size: int) -> str:
    """nccl when every engine has a GPU of its own (auto), else gloo."""
    own_gpus = device.type == "cuda" and torch.cuda.device_count() >= world_size
    if disagg.pd_transport == "nccl" and not own_gpus:
        raise ValueError(
            f"pd_transport='nccl' needs a GPU per engine ({world_size} engines, "
            f"{torch.cuda.device_count() if device.type == 'cuda' else 0} GPUs); use gloo"
        )
    if disagg.pd_transport == "auto":
        return "nccl" if own_gpus else "gloo"
    return disagg.pd_transport


def engine_main(
    place: Placement, config: EngineConfig, disagg: DisaggConfig, conn: Connection
) -> None:
    """The body of an engine process (`multiprocessing` spawn target)."""
    try:
        device = engine_device(config, place.rank)
        if torch.device(device or "cpu").type == "cpu":  # the engines share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.num_engines))
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
        engine = LLMEngine(config)
        if place.is_replica:
            from vllm_rlt.disagg.replica_role import ReplicaRole

            role = ReplicaRole(engine, place, conn)
        else:
            role = _pd_role(engine, place, disagg, conn)
    except Exception as err:
        conn.send(msg.StartFailed(place.rank, f"{type(err).__name__}: {err}"))
        return
    conn.send(msg.Ready(place.rank, engine.max_model_len, engine.num_loops, os.getpid()))
    role.run()
    # the link threads may sit in a blocking receive: end the process without joining them
    os._exit(0)


def _pd_role(engine: LLMEngine, place: Placement, disagg: DisaggConfig, conn: Connection):
    """Join the PD engines' process group; the prefill or decode role of engine `place`."""
    kv_device = engine.runner.kv_cache.kv.device
    backend = transport_backend(disagg, kv_device, place.world_size)
    if backend == "nccl":
        torch.cuda.set_device(kv_device)
    init_group(backend, disagg.pd_master_addr, place.port, place.rank, place.world_size)
    groups = pair_groups(place.num_prefill, place.num_decode)
    via_host = backend == "gloo" and kv_device.type == "cuda"
    if place.is_prefill:
        from vllm_rlt.disagg.prefill_role import PrefillRole as role_cls
    else:
        from vllm_rlt.disagg.decode_role import DecodeRole as role_cls
    return role_cls(engine, place, conn, groups, via_host)


class _Role:
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

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

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
        kv, sched = self.engine.kv_manager, self.engine.scheduler
        gauges = (len(sched.running), self.num_waiting(), kv.num_free_blocks, kv.num_total_blocks)
        now = time.monotonic()
        if force or gauges != self._last_status and now - self._status_at >= STATUS_INTERVAL_S:
            self.conn.send(msg.Status(self.place.rank, *gauges))
            self._last_status, self._status_at = gauges, now


class StreamingRole(_Role):
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
