"""An engine process of a disaggregated server: loads an `LLMEngine`, joins the engines'
process group, then loops: control messages from the front end, KV links, engine steps.

The loop (`_Role.run`) never blocks on a peer: KV sends and receives are polled, and while
the engine has nothing to run it waits at most IDLE_WAIT_S for a message. The role classes
(`PrefillRole`, `DecodeRole` in their modules) add what each side does with a request.
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
    """Where an engine process runs in the group."""

    rank: int  # prefill i is rank i, decode j is rank num_prefill + j
    num_prefill: int
    num_decode: int
    port: int  # the rendezvous port (resolved: never 0)

    @property
    def is_prefill(self) -> bool:
        return self.rank < self.num_prefill

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
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.world_size))
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
        engine = LLMEngine(config)
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
        role = role_cls(engine, place, conn, groups, via_host)
    except Exception as err:
        conn.send(msg.StartFailed(place.rank, f"{type(err).__name__}: {err}"))
        return
    conn.send(msg.Ready(place.rank, engine.max_model_len, engine.num_loops, os.getpid()))
    role.run()
    # the link threads may sit in a blocking receive: end the process without joining them
    os._exit(0)


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
