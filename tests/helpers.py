"""Factories and metrics shared by the tests."""

from __future__ import annotations

from collections import Counter

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


def chi_square_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom for two samples over the same categories;
    categories whose expected count is below 5 in either sample are merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    big, small = [], (0, 0)
    for cat in set(a) | set(b):
        total = a[cat] + b[cat]
        if min(total * na, total * nb) / (na + nb) >= 5:
            big.append((a[cat], b[cat]))
        else:
            small = (small[0] + a[cat], small[1] + b[cat])
    if sum(small):
        big.append(small)
    stat = 0.0
    for ca, cb in big:
        total = ca + cb
        for count, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(big) - 1


def chi_square_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
