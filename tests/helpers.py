"""Factories and metrics shared by the tests."""

from __future__ import annotations

import torch

from vllm_rlt.models.loader import init_random_weights
from vllm_rlt.models.ouro import OuroConfig, OuroForCausalLM
from vllm_rlt.models.tiny import TINY_OURO

GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}
MHA = {"num_attention_heads": 4, "num_key_value_heads": 4}


def tiny_config(**overrides) -> OuroConfig:
    return OuroConfig.from_dict({**TINY_OURO, "vocab_size": 96, **overrides})


def tiny_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    device: str = "cpu",
    layer_kernels: str = "auto",
    **overrides,
) -> OuroForCausalLM:
    with torch.device(device):
        model = OuroForCausalLM(
            tiny_config(**overrides), attention_backend=backend, layer_kernels=layer_kernels
        )
    init_random_weights(model, seed)
    return model.to(dtype).eval().requires_grad_(False)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b| over the entries where `expected` is not NaN."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    mask = ~torch.isnan(expected)
    a, b = actual[mask], expected[mask]
    return float((a - b).abs().max() / b.abs().max())
