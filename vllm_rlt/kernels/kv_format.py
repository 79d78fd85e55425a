"""How a KV cache stores its values (torch only: importing it compiles no kernel).

A cache holds the model's dtype, or FP8 (e4m3, `--kv-cache-dtype fp8`): each layer's K and V
then carry a scale, and a value x is stored as fp8(clamp(x / scale, -448, 448)), x divided and
clamped in fp32 and rounded to nearest even; readers multiply by the scale. A layer's planes
share its scales, so the copies of LAST_EXITED between planes move bits unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


class KVLayer(NamedTuple):
    """One layer's paged K/V: caches [num_blocks, block_size, Hkv, d] and, for an FP8 cache,
    the scales its values are stored in (1.0 and unused for other dtypes)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def fp8(self) -> bool:
        return self.k.dtype == FP8


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it (FP8: scaled, clamped, rounded; others: cast)."""
    if dtype != FP8:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in `dtype` (an FP8 cache's times its scale, in `dtype`)."""
    if stored.dtype != FP8:
        return stored.to(dtype)
    return stored.to(dtype) * scale
