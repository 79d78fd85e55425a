"""Dense Huginn reference: the test oracle for `models/huginn.py`.

Recomputes one sequence from the weights (checkpoint names) with no paging, no batching and
none of the engine's layers: its own interleaved RoPE (angles in fp64), and the RMSNorm and
attention of the Ouro reference (`models/reference.py`).
It returns the recurrent state after every recurrence and the logits after the coda. Given
per-token loop counts it reproduces the engine's LAST_EXITED cache: a token at recurrence r
reads an earlier token's core K/V from recurrence min(r, its last one), and the coda reads each
token's coda K/V computed from its last state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_rlt.models.huginn_config import HuginnConfig
from vllm_rlt.models.reference import dense_attention, dense_rms_norm
from vllm_rlt.tensor_utils import acc_dtype


@dataclass(frozen=True)
class HuginnReferenceOutput:
    states: torch.Tensor  # [D, S, E] state after each recurrence; NaN where a token did not run
    logits: torch.Tensor  # [S, V] logits of each token's last state (through the coda)


class DenseHuginnReference:
    def __init__(self, config: HuginnConfig, weights: dict[str, torch.Tensor]):
        self.c = config
        self.w = weights
        d = config.head_dim
        device = weights["transformer.wte.weight"].device
        exponents = torch.arange(0, d, 2, dtype=torch.float64, device=device) / d
        self.inv_freq = config.rope_base**-exponents

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> DenseHuginnReference:
        weights = {k: v.detach() for k, v in model.named_parameters()}
        weights.setdefault("lm_head.weight", weights["transformer.wte.weight"])
        return cls(model.config, weights)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return dense_rms_norm(x, self.w[name], self.c.norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [S, heads, d] rotated by adjacent pairs at `positions`, in fp32 (fp64 for fp64)."""
        ang = positions.double()[:, None] * self.inv_freq[None, :]
        acc = acc_dtype(x.dtype)
        cos, sin = ang.cos().to(acc)[:, None, :], ang.sin().to(acc)[:, None, :]
        even, odd = x.to(acc)[..., 0::2], x.to(acc)[..., 1::2]
        out = torch.empty_like(x, dtype=acc)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = odd * cos + even * sin
        return out.to(x.dtype)

    def _qkv(self, x: torch.Tensor, p: str, positions: torch.Tensor):
        a = self._norm(x, p + "norm_1.weight")
        qkv = (a @ self.w[p + "attn.Wqkv.weight"].T).view(x.shape[0], 3, self.c.n_heads, -1)
        bias = self.w[p + "attn.qk_bias"]
        q = self._rope(qkv[:, 0] + bias[0, 0], positions)
        k = self._rope(qkv[:, 1] + bias[1, 0], positions)
        return q, k, qkv[:, 2]

    def _finish(self, x: torch.Tensor, attn: torch.Tensor, p: str) -> torch.Tensor:
        o = attn.reshape(x.shape[0], -1) @ self.w[p + "attn.proj.weight"].T
        x = self._norm(o + x, p + "norm_2.weight")
        gate, up = (self._norm(x, p + "norm_3.weight") @ self.w[p + "mlp.fc.weight"].T).chunk(2, -1)
        mlp = (torch.nn.functional.silu(gate) * up) @ self.w[p + "mlp.proj.weight"].T
        return self._norm(mlp + x, p + "norm_4.weight")

    def _block(self, x: torch.Tensor, p: str, positions, causal) -> torch.Tensor:
        q, k, v = self._qkv(x, p, positions)
        return self._finish(x, dense_attention(q, k, v, causal), p)

    def run(
        self,
        token_ids: Sequence[int],
        loops: Sequence[int] | None = None,
        initial_states: torch.Tensor | None = None,
    ) -> HuginnReferenceOutput:
        """token_ids: one sequence; loops[i] in [1, D]: recurrences token i runs (default D);
        initial_states: [S, E] the states before the first recurrence (default zeros)."""
        c, seq = self.c, len(token_ids)
        num_loops = c.num_loops
        loops_t = torch.tensor(loops if loops is not None else [num_loops] * seq)
        if loops_t.numel() != seq or loops_t.min() < 1 or loops_t.max() > num_loops:
            raise ValueError(f"loops must give 1..{num_loops} for each of the {seq} tokens")
        wte = self.w["transformer.wte.weight"]
        ids = torch.tensor(list(token_ids), device=wte.device)
        pos = torch.arange(seq, device=wte.device)
        causal = pos[None, :] <= pos[:, None]
        e = wte[ids] * math.sqrt(c.n_embd)
        for i in range(c.n_layers_in_prelude):
            e = self._block(e, f"transformer.prelude.{i}.", pos, causal)
        s = torch.zeros_like(e) if initial_states is None else initial_states.to(e)
        kv: list = [None] * c.n_layers_in_recurrent_block
        states = []
        for r in range(num_loops):
            active = (loops_t > r).to(e.device)
            x = torch.cat([s, e], -1) @ self.w["transformer.adapter.weight"].T
            for j in range(c.n_layers_in_recurrent_block):
                p = f"transformer.core_block.{j}."
                q, k, v = self._qkv(x, p, pos)
                if kv[j] is None:
                    kv[j] = (k.clone(), v.clone())
                keys, values = kv[j]
                keys[active], values[active] = k[active], v[active]
                x = self._finish(x, dense_attention(q, keys, values, causal), p)
            states.append(torch.where(active[:, None], x, float("nan")))
            s = torch.where(active[:, None], x, s)
        z = self._norm(s, "transformer.ln_f.weight")
        for i in range(c.n_layers_in_coda):
            z = self._block(z, f"transformer.coda.{i}.", pos, causal)
        logits = self._norm(z, "transformer.ln_f.weight") @ self.w["lm_head.weight"].T
        return HuginnReferenceOutput(torch.stack(states), logits)
