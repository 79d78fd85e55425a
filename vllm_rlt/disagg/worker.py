"""An engine process behind a front end: loads an `LLMEngine`, joins the engines' process
group (a disaggregated server's engines; a data-parallel replica joins none), then runs the
loop of its role (`role.py`; `PrefillRole`, `DecodeRole`, `ReplicaRole` in their modules)."""

from __future__ import annotations

import dataclasses
import os
from multiprocessing.connection import Connection

import torch

from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.decode_role import DecodeRole
from vllm_rlt.disagg.prefill_role import PrefillRole
from vllm_rlt.disagg.replica_role import ReplicaRole
from vllm_rlt.disagg.role import Placement
from vllm_rlt.disagg.transport import init_group, pair_groups
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.serve_config import DisaggConfig


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
    kv_device = engine.handoff.kv_cache.kv.device
    backend = transport_backend(disagg, kv_device, place.world_size)
    if backend == "nccl":
        torch.cuda.set_device(kv_device)
    init_group(backend, disagg.pd_master_addr, place.port, place.rank, place.world_size)
    groups = pair_groups(place.num_prefill, place.num_decode)
    via_host = backend == "gloo" and kv_device.type == "cuda"
    role_cls = PrefillRole if place.is_prefill else DecodeRole
    return role_cls(engine, place, conn, groups, via_host)
