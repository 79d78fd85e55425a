"""Size the KV cache at startup, before anything is allocated: how many blocks the settings ask
for, whether the device (or host) has the memory free, and the longest request it can hold
(`max_model_len`). A setting that cannot work raises ConfigError naming it and the numbers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from vllm_rlt.config import CacheConfig, ConfigError

logger = logging.getLogger(__name__)
GIB = 2**30


@dataclass(frozen=True)
class KVBlocks:
    num_blocks: int  # blocks in the pool (all planes share them)
    setting: str  # the setting that chose the number, as messages name it


def plan_kv_blocks(
    cache: CacheConfig,
    model_config: Any,
    num_planes: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVBlocks:
    """The number of KV blocks `cache` asks for; ConfigError when they are fewer than one block
    per plane, or when they (plus the scratch block) need more memory than `device` has free."""
    c = model_config
    block_bytes = (
        c.num_hidden_layers * 2 * cache.block_size * c.num_key_value_heads * c.head_dim
    ) * dtype.itemsize
    if cache.num_kv_blocks is not None:
        num_blocks, setting = cache.num_kv_blocks, f"num_kv_blocks={cache.num_kv_blocks}"
    else:
        num_blocks = int(cache.kv_cache_memory_gb * GIB // block_bytes)
        setting = f"kv_cache_memory_gb={cache.kv_cache_memory_gb}"
    name = setting.split("=")[0]
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
    return KVBlocks(num_blocks, setting)


def free_memory_bytes(device: torch.device) -> int:
    """Bytes free on a CUDA device, or the host memory available to a new allocation."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
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
            f"{kv_positions} per request; raise {blocks.setting.split('=')[0]} or lower "
            "max_model_len"
        )
    return requested
