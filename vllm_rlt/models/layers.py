"""Building blocks shared by the looped models: RMSNorm, rotary embedding, SwiGLU MLP, and the
base of modules whose HF-named linears also run as one fused GEMM.

Each layer works on packed rows (`[num_rows, ...]`); nothing here knows about requests or depths.
These modules are plain torch (the trainer in tools/ backpropagates through them); the engine's
fused Triton path lives in `vllm_rlt.models.layer_kernels`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_rlt.tensor_utils import acc_dtype


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics; the weight multiplies after the cast back (HF Llama style)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = acc_dtype(x.dtype)
        x32 = x if x.dtype == acc else x.to(acc)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (normed if x.dtype == acc else normed.to(x.dtype))


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


class FusesLinears(nn.Module):
    """Base of modules whose sibling linears (one input, no bias) also run as a single GEMM.

    `fused_linears` maps an attribute name to child `nn.Linear` names in output order. `_fuse()`
    stores under that attribute one weight [sum of out_features, in_features] and makes each
    linear's `weight` a view into it: checkpoints still load, save and initialise by their HF
    names, the fused GEMM reads the same memory, and nothing is stored twice. `Module.to()`,
    `.cuda()` and `.float()` convert parameters one at a time (leaving separate tensors), so
    `_apply` fuses again after them. Other ways of replacing the weights
    (`load_state_dict(assign=True)`, `copy.deepcopy`) leave the fused weight stale.
    """

    fused_linears: dict[str, tuple[str, ...]] = {}

    def _fuse(self) -> None:
        for name, parts in self.fused_linears.items():
            linears = [getattr(self, part) for part in parts]
            fused = getattr(self, name, None)
            storage = None if fused is None else fused.untyped_storage().data_ptr()
            if all(lin.weight.untyped_storage().data_ptr() == storage for lin in linears):
                continue  # the views survived (a conversion that changed nothing)
            with torch.no_grad():
                fused = torch.cat([lin.weight for lin in linears])
            views = fused.split([lin.out_features for lin in linears])
            for lin, view in zip(linears, views, strict=True):
                lin.weight.data = view
            setattr(self, name, fused)  # a plain attribute: not a parameter, not in state_dict

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._fuse()
        return self


def rotate_interleaved(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [R, heads, d] rotated by adjacent pairs (2i, 2i + 1) in fp32 (fp64 for fp64); table:
    [R, 1, d/2, 2] fp32."""
    acc = acc_dtype(x.dtype)
    x32 = x.to(acc).unflatten(-1, (-1, 2))
    x0, x1 = x32[..., 0], x32[..., 1]
    cos, sin = table[..., 0].to(acc), table[..., 1].to(acc)
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(-2).to(x.dtype)
