"""Size the KV cache at startup, before anything is allocated: how many blocks the settings ask
for, whether the device (or host) has the memory free, and the longest request it can hold
(`max_model_len`). A setting that cannot work raises ConfigError naming it and the numbers.

The number of blocks comes from the first of: `num_kv_blocks`; `kv_cache_memory_gb`; on CUDA,
what `gpu_memory_utilization` of the device's memory leaves once the weights, the buffers, the
peak of the largest invocation and the CUDA graphs are counted (`worker/memory_profile.py`
measures them); on the CPU, a tenth of the available host memory, at most `CPU_KV_CAP_BYTES`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_rlt.config import CacheConfig, ConfigError
from vllm_rlt.kernels.kv_format import FP8
from vllm_rlt.worker.memory_profile import DeviceMemory

logger = logging.getLogger(__name__)
GIB = 2**30
CPU_KV_FRACTION = 0.1  # of the available host memory, the CPU default's KV cache
CPU_KV_CAP_BYTES = GIB  # at most: the CPU serves small models, and tests start fast
MEMINFO = "/proc/meminfo"  # the host's available memory (Linux)


@dataclass(frozen=True)
class KVBlocks:
    num_blocks: int  # blocks in the pool (all planes share them)
    setting: str  # how the number was chosen, as messages name it ("num_kv_blocks=64")

    @property
    def name(self) -> str:
        """The setting that changes the number."""
        return self.setting.split("=")[0]


KV_DTYPES = {"fp8": FP8, "fp8_e4m3": FP8}  # kv_cache_dtype's values besides "auto"


def kv_cache_dtype(
    setting: str, model_dtype: torch.dtype, scales: tuple[tuple[float, float], ...] | None
) -> torch.dtype:
    """The dtype `kv_cache_dtype` = `setting` stores K and V in (and a log line saying so)."""
    if setting == "auto":
        return model_dtype
    source = "the checkpoint's" if scales else "1.0 (the checkpoint gives none)"
    logger.info("KV cache: FP8 (e4m3), K and V scales per layer: %s", source)
    return KV_DTYPES[setting]


def plan_kv_blocks(
    cache: CacheConfig,
    model_config: Any,
    num_planes: int,
    dtype: torch.dtype,
    device: torch.device,
    measure: Callable[[], DeviceMemory],
) -> KVBlocks:
    """The number of KV blocks `cache` asks for; ConfigError when they are fewer than one block
    per plane, or when they (plus the scratch block) need more memory than `device` has free.
    `measure`: the device memory besides the KV cache (CUDA, sized by gpu_memory_utilization)."""
    c = model_config
    block_bytes = (
        c.num_kv_layers * 2 * cache.block_size * c.num_key_value_heads * c.head_dim
    ) * dtype.itemsize
    if cache.num_kv_blocks is not None:
        num_blocks, setting = cache.num_kv_blocks, f"num_kv_blocks={cache.num_kv_blocks}"
    elif cache.kv_cache_memory_gb is not None:
        num_blocks = int(cache.kv_cache_memory_gb * GIB // block_bytes)
        setting = f"kv_cache_memory_gb={cache.kv_cache_memory_gb}"
    elif device.type == "cuda":
        num_blocks = gpu_kv_bytes(cache.gpu_memory_utilization, measure()) // block_bytes
        setting = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
    else:
        budget = int(min(CPU_KV_CAP_BYTES, CPU_KV_FRACTION * free_memory_bytes(device)))
        num_blocks = budget // block_bytes
        setting = f"kv_cache_memory_gb={budget / GIB:.2f} by default"
    blocks = KVBlocks(num_blocks, setting)
    name = blocks.name
    if num_blocks < num_planes:
        raise ConfigError(
            f"{setting} gives {num_blocks} KV blocks of {block_bytes} bytes, too few for one "
            f"request: kv_layout={cache.kv_layout!r} needs a block in each of its {num_planes} "
            f"planes; raise {name}"
        )
    need, free = (num_blocks + 1) * block_bytes, free_memory_bytes(device)
    if need > free:
        raise ConfigError(
            f"the KV cache needs {need / GIB:.2f} GiB ({setting}: {num_blocks} blocks of "
            f"{block_bytes} bytes) but only {free / GIB:.2f} GiB of {device.type} memory is "
            f"free; lower {name}"
        )
    return blocks


def gpu_kv_bytes(utilization: float, mem: DeviceMemory) -> int:
    """The KV cache's share of `utilization` x the device's memory: what the memory in use, the
    activation peak and the CUDA graphs leave of it; ConfigError when nothing is left."""
    limit = int(utilization * mem.total_bytes)
    budget = limit - mem.in_use_bytes - mem.activation_bytes - mem.graph_bytes
    parts = (
        f"{utilization} x {mem.total_bytes / GIB:.2f} GiB = {limit / GIB:.2f} GiB; in use "
        f"(weights, buffers, other processes) {mem.in_use_bytes / GIB:.2f} GiB, activation peak "
        f"{mem.activation_bytes / GIB:.2f} GiB, CUDA graphs {mem.graph_bytes / GIB:.2f} GiB"
    )
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache ({parts}); "
            "raise gpu_memory_utilization, lower max_num_batched_tokens, or set num_kv_blocks "
            "or kv_cache_memory_gb"
        )
    logger.info("KV cache memory: %.2f GiB (%s)", budget / GIB, parts)
    return budget


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free on a CUDA device, or the host memory available to a new allocation."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_max_model_len(
    requested: int | None, max_position_embeddings: int, kv_positions: int, blocks: KVBlocks
) -> int:
    """The longest request (prompt + output positions) the engine accepts: `requested`
    (max_model_len), or by default the model's max_position_embeddings capped by what the KV
    cache holds for one request. `kv_positions`: the KV positions one request can hold; a
    request of n positions writes n - 1 of them (its last token is sampled, never fed)."""
    longest = kv_positions + 1
    if requested is None:
        if longest < max_position_embeddings:
            logger.info(
                "max_model_len is %d: the KV cache (%s) holds %d positions per request, fewer "
                "than the model's %d",
                longest,
                blocks.setting,
                kv_positions,
                max_position_embeddings,
            )
        return min(max_position_embeddings, longest)
    if requested > max_position_embeddings:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings} (config.json)"
        )
    if requested > longest:
        raise ConfigError(
            f"max_model_len={requested} needs {requested - 1} KV positions for one request, but "
            f"the KV cache ({blocks.setting}: {blocks.num_blocks} blocks) holds at most "
            f"{kv_positions} per request; raise {blocks.name} or lower max_model_len"
        )
    return requested


def log_kv_cache(blocks: KVBlocks, positions: int, num_planes: int, max_model_len: int) -> None:
    """The start log line: blocks, `positions` per plane and how many requests of
    `max_model_len` positions the cache holds at once."""
    logger.info(
        "KV cache: %d blocks (%s), %d positions per plane x %d planes; maximum concurrency for "
        "%d tokens per request: %.2fx",
        blocks.num_blocks,
        blocks.setting,
        positions,
        num_planes,
        max_model_len,
        positions / max_model_len,
    )
