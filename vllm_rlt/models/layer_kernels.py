"""How a decoder layer's pieces run: plain torch ops, or fused projections and Triton kernels.

A model calls these operations through one of these strategies (Ouro those up to `logits`;
Huginn, whose layers differ, `norm`, `linear`, `logits`, `bias_rope` and `gated_mlp`):

- `norm(x, norm)`: an RMSNorm;
- `add_norm(h, y, norm_a, norm_b)`: the sandwich residual step `h + norm_a(y)` and the norm after
  it, returning both;
- `qkv(attn, x, rope, kv)`: q, k, v [R, heads, d] of a block input, q and k rotated, and
  whether it also wrote k and v into the KV cache `kv` (the attention backend writes them
  otherwise);
- `swiglu(mlp, x)`: the MLP;
- `out_proj(attn, x)`: attention's output projection;
- `exit_gate(x, gate)`: the early-exit gate's logit of each end-of-loop row, in fp32 (fp64 for
  an fp64 model);
- `logits(x, weight)`: the LM head;
- `linear(x, weight)`: a projection without bias;
- `bias_rope(qkv, qk_bias, table, heads, d, kv)`: Huginn's q and k plus their bias, rotated by
  adjacent pairs, and whether it also wrote k and v into the KV cache `kv`;
- `gated_mlp(x, gate_up_weight, down_weight)`: a SwiGLU MLP from its fused [gate; up] weight
  (Huginn's; the fused strategies' `swiglu` is this on Ouro's fused weight).

`torch` runs each arithmetic step as its own torch op on the modules' HF-named weights (three
q/k/v GEMMs, two gate/up GEMMs): the reference numerics, the CPU default. `fused` does one GEMM
on the fused [q; k; v] and [gate; up] weights (views of the same memory, see
`layers.FusesLinears`) and one Triton launch per norm pair, per RoPE (with the KV write of k
and v), per SwiGLU activation and per exit gate (`vllm_rlt.kernels.fused_ops`). `skinny`, the
CUDA default, is `fused` with the projections of invocations of up to 16 rows (decode) on
`vllm_rlt.kernels.skinny_gemm` instead of cuBLAS, the SwiGLU activation done by the gate/up GEMM
itself, and RoPE and the KV write by the q/k/v GEMM for up to 8 rows (docs/design/runner.md
§4). `invariant` is `fused` with every
projection and the LM head on `vllm_rlt.kernels.invariant_gemm`, whose rows do not depend on
each other or on their number; with the fused ops, which work per row, a row's whole layer does
not (the engine's batch_invariant, docs/design/runner.md §6).
Inference only (no autograd through Triton).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch
from torch import nn

from vllm_rlt.config import check_layer_kernels
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.models.layers import RMSNorm, RotaryEmbedding, rotate_interleaved
from vllm_rlt.tensor_utils import acc_dtype

# where a layer's k and v go: (its caches, slots [R])
KVTarget = tuple[KVLayer, torch.Tensor]


class LayerKernels(Protocol):
    name: str

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x: [R, H] -> norm(x) [R, H]."""
        ...

    def add_norm(
        self, h: torch.Tensor, y: torch.Tensor, norm_a: RMSNorm, norm_b: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h, y: [R, H] -> (out, norm_b(out)) with out = h + norm_a(y)."""
        ...

    def qkv(
        self, attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, ...], kv: KVTarget
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """x: [R, H]; rope: `RotaryEmbedding.tables` -> rotated q [R, Hq, d] and k, v
        [R, Hkv, d], and whether k and v are already stored in kv's caches at its slots."""
        ...

    def swiglu(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [R, H] -> down(silu(gate(x)) * up(x)) [R, H]."""
        ...

    def out_proj(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [R, Hq * d] attention output -> o_proj(x) [R, H]."""
        ...

    def exit_gate(self, x: torch.Tensor, gate: nn.Linear) -> torch.Tensor:
        """x: [R, H] end-of-loop norm -> gate(x) [R] computed in `acc_dtype(x.dtype)`."""
        ...

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [R, H] final hidden -> x @ weight.T [R, V], the LM head."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x: [R, K] -> x @ weight.T [R, N]: a projection without bias (Huginn's layers)."""
        ...

    def bias_rope(
        self,
        qkv: torch.Tensor,
        qk_bias: torch.Tensor,
        table: torch.Tensor,
        num_heads: int,
        head_dim: int,
        kv: KVTarget,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """qkv [R, 3 H d] (q | k | v) -> q, k, v [R, H, d]: q and k plus qk_bias [2, 1, H, d],
        rotated by adjacent pairs (2i, 2i + 1) with the table [R, 1, d/2, 2] fp32; and whether
        k and v are already stored in kv's caches at its slots."""
        ...

    def gated_mlp(
        self, x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor
    ) -> torch.Tensor:
        """x: [R, H] -> silu(gate) * up @ down_weight.T with [gate | up] = x @ gate_up_weight.T."""
        ...


class TorchLayerKernels:
    name = "torch"

    def norm(self, x, norm):
        return norm(x)

    def add_norm(self, h, y, norm_a, norm_b):
        out = h + norm_a(y)
        return out, norm_b(out)

    def qkv(self, attn, x, rope, kv):
        rows = x.shape[0]
        q = attn.q_proj(x).view(rows, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(rows, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(rows, attn.num_kv_heads, attn.head_dim)
        return RotaryEmbedding.apply(rope, q), RotaryEmbedding.apply(rope, k), v, False

    def swiglu(self, mlp, x):
        return mlp(x)

    def out_proj(self, attn, x):
        return attn.o_proj(x)

    def exit_gate(self, x, gate):
        acc = acc_dtype(x.dtype)
        logit = nn.functional.linear(x.to(acc), gate.weight.to(acc), gate.bias.to(acc))
        return logit.squeeze(-1)

    def linear(self, x, weight):
        return nn.functional.linear(x, weight)

    logits = linear

    def bias_rope(self, qkv, qk_bias, table, num_heads, head_dim, kv):
        q, k, v = qkv.view(qkv.shape[0], 3, num_heads, head_dim).unbind(1)
        q, k = (rotate_interleaved(t + b, table) for t, b in ((q, qk_bias[0]), (k, qk_bias[1])))
        return q, k, v, False

    def gated_mlp(self, x, gate_up_weight, down_weight):
        gate, up = self.linear(x, gate_up_weight).chunk(2, dim=-1)
        return self.linear(nn.functional.silu(gate) * up, down_weight)


class FusedLayerKernels:
    name = "fused"

    def __init__(self) -> None:
        # imported here so the torch path never imports Triton (and TRITON_INTERPRET may be set
        # by the caller before the first fused call)
        self.ops = importlib.import_module("vllm_rlt.kernels.fused_ops")
        self.rope = importlib.import_module("vllm_rlt.kernels.interleaved_rope")

    def norm(self, x, norm):
        return self.ops.rms_norm(x, norm.weight, norm.eps)

    def add_norm(self, h, y, norm_a, norm_b):
        return self.ops.add_rms_norm(h, y, norm_a.weight, norm_a.eps, norm_b.weight, norm_b.eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [R, K] @ weight [N, K].T: every projection of the layer."""
        return nn.functional.linear(x, weight)

    def qkv(self, attn, x, rope, kv):
        qkv = self.linear(x, attn.qkv_weight)
        cos, signed_sin = rope
        heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        return *self.ops.rope_qk_(qkv, cos, signed_sin, *heads, kv=kv), True

    def swiglu(self, mlp, x):
        return self.gated_mlp(x, mlp.gate_up_weight, mlp.down_proj.weight)

    def gated_mlp(self, x, gate_up_weight, down_weight):
        return self.linear(self.ops.silu_mul(self.linear(x, gate_up_weight)), down_weight)

    def bias_rope(self, qkv, qk_bias, table, num_heads, head_dim, kv):
        return *self.rope.bias_rope_(qkv, qk_bias, table, num_heads, head_dim, kv=kv), True

    def out_proj(self, attn, x):
        return self.linear(x, attn.o_proj.weight)

    def exit_gate(self, x, gate):
        return self.ops.gate_logits(x, gate.weight, gate.bias)

    def logits(self, x, weight):
        return nn.functional.linear(x, weight)


class SkinnyLayerKernels(FusedLayerKernels):
    name = "skinny"
    # RoPE in the q/k/v GEMM is 1.3 us faster than a separate launch at 1 row, even at 8 and
    # 3.5 us slower at 16 (docs/design/runner.md §4)
    rope_max_rows = 8
    # the few-row GEMM takes up to 32 rows, but an invocation of 24 or 32 rows ran faster on
    # cuBLAS (docs/design/runner.md §4)
    max_rows = 16

    def __init__(self) -> None:
        super().__init__()
        self.gemm = importlib.import_module("vllm_rlt.kernels.skinny_gemm")

    def _few_rows(self, x: torch.Tensor, max_rows: int | None = None) -> bool:
        max_rows = self.max_rows if max_rows is None else max_rows
        return x.shape[0] <= max_rows and x.dtype in self.gemm.DTYPES

    def linear(self, x, weight):
        if self._few_rows(x):
            return self.gemm.skinny_linear(x, weight)
        return nn.functional.linear(x, weight)

    def qkv(self, attn, x, rope, kv):
        if not (self._few_rows(x, self.rope_max_rows) and self.gemm.rope_fits(attn.head_dim)):
            return super().qkv(attn, x, rope, kv)
        heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        qkv = self.gemm.skinny_qkv_rope(x, attn.qkv_weight, *rope, *heads, kv=kv)
        return *self.ops.split_qkv(qkv, *heads), True

    def gated_mlp(self, x, gate_up_weight, down_weight):
        if not self._few_rows(x):
            return super().gated_mlp(x, gate_up_weight, down_weight)
        return self.linear(self.gemm.skinny_swiglu(x, gate_up_weight), down_weight)


class InvariantLayerKernels(FusedLayerKernels):
    name = "invariant"

    def __init__(self) -> None:
        super().__init__()
        self.gemm = importlib.import_module("vllm_rlt.kernels.invariant_gemm")

    def linear(self, x, weight):
        return self.gemm.invariant_linear(x, weight)

    logits = linear


_STRATEGIES = {
    "torch": TorchLayerKernels,
    "fused": FusedLayerKernels,
    "skinny": SkinnyLayerKernels,
    "invariant": InvariantLayerKernels,
}
_INSTANCES: dict[str, LayerKernels] = {}


def get_layer_kernels(name: str, device: torch.device) -> LayerKernels:
    """The strategy `name` from LAYER_KERNELS; "auto" picks skinny on CUDA, torch elsewhere."""
    check_layer_kernels(name)
    if name == "auto":
        name = "skinny" if device.type == "cuda" else "torch"
    if name not in _INSTANCES:
        _INSTANCES[name] = _STRATEGIES[name]()
    return _INSTANCES[name]
