"""The base of the looped models' top modules (`OuroForCausalLM`, `HuginnForCausalLM`)."""

from __future__ import annotations

import torch
from torch import nn

from vllm_rlt.config import check_layer_kernels
from vllm_rlt.models.layer_kernels import LayerKernels, get_layer_kernels


class LoopedCausalLM(nn.Module):
    """What the looped models' top modules share: their config, the layer-kernel strategy by
    name (`layer_kernels`: "auto" is skinny on CUDA and torch elsewhere; tests and benchmarks
    pick "torch", "fused", "skinny" or "invariant") and an LM head over the input embedding's
    vocabulary, tied to it where the config says so."""

    def __init__(self, config, layer_kernels: str):
        check_layer_kernels(layer_kernels)
        super().__init__()
        self.layer_kernels = layer_kernels
        self.config = config

    def _add_lm_head(self, embedding: nn.Embedding, tie: bool) -> None:
        self.lm_head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        if tie:
            self.lm_head.weight = embedding.weight

    def _kernels(self, device: torch.device) -> LayerKernels:
        return get_layer_kernels(self.layer_kernels, device)
