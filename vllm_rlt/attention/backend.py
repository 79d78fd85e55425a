"""The attention-backend interface and the registry of backends (lazy imports)."""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.config import ConfigError
from vllm_rlt.kernels.kv_format import KVLayer


class AttentionBackend(Protocol):
    """Writes an invocation's K/V into the paged cache, then attends over it."""

    name: str
    # True when forward launches read the metadata's device tensors and only shape-level host
    # fields (max_context, tile counts), so a CUDA graph captured over static metadata buffers
    # stays valid when the buffers change
    supports_cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVLayer,
        meta: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q: [R, Hq, d]; k, v: [R, Hkv, d]; the layer's caches: [num_blocks, block_size, Hkv, d].

        Writes k, v at `meta.slot_mapping` (unless `kv_stored`: the caller stored them there
        already), then returns the causal attention output [R, Hq, d] of every row over
        its plane (positions <= its own), accumulated in fp32.
        """
        ...


_BACKENDS = {
    "torch": ("vllm_rlt.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("vllm_rlt.attention.triton_backend", "TritonAttentionBackend"),
    # batch_invariant's (vllm_rlt.config.ModelConfig.kernel_names)
    "triton_invariant": ("vllm_rlt.attention.triton_backend", "InvariantTritonAttentionBackend"),
}


def get_attention_backend(name: str | AttentionBackend) -> AttentionBackend:
    """The backend registered as `name` (a backend instance passes through)."""
    if not isinstance(name, str):
        return name
    if name not in _BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()
