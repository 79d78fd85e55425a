"""Building blocks shared by the looped models: RMSNorm, rotary embedding, SwiGLU MLP.

Each layer works on packed rows (`[num_rows, ...]`); nothing here knows about requests or depths.
"""

from __future__ import annotations

import torch
from torch import nn


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype for statistics and accumulations: fp32, or the input's own if wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics; the weight multiplies after the cast back (HF Llama style)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(acc_dtype(x.dtype))
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Split-half ("rotate_half") RoPE over the full head dimension.

    The cos/sin tables are computed in fp32 once for every position and cast to the activation
    dtype when applied, so the rotation runs in the activation dtype as in the HF reference.
    `tables` gathers them once per invocation; every layer then applies them. The sin table is
    stored with the first half negated, so rotate_half(x) * sin == roll(x, d/2) * signed_sin
    exactly (a sign flip commutes with rounding) in one op instead of three.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq).float()
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1), persistent=False)
        signed = torch.cat([-freqs.sin(), freqs.sin()], -1)
        self.register_buffer("signed_sin", signed, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [R] int64 -> (cos, signed_sin), each [R, 1, d] in `dtype`."""
        cos = self.cos[positions].to(dtype).unsqueeze(1)
        return cos, self.signed_sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def apply(tables: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        """Rotate x [R, heads, d] with tables from `tables`."""
        cos, signed_sin = tables
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [R] int64; q: [R, Hq, d]; k: [R, Hkv, d] -> rotated (q, k)."""
        t = self.tables(positions, q.dtype)
        return self.apply(t, q), self.apply(t, k)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
