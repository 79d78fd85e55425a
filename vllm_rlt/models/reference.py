"""Dense Ouro reference: the test oracle.

Recomputes a single sequence from the weights with no paging, no batching and none of the
engine's layers (its own RMSNorm, RoPE and attention), and returns the hidden state, gate logit
and logits at every depth. Given per-token loop counts it reproduces the two KV semantics:

- LAST_EXITED: a token at depth d reads an earlier token's K/V from depth min(d, its last depth);
- SHARED: a token reads each earlier token's K/V from that token's last executed depth (one
  overwritten plane, prefill in position waves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_rlt.config import KVLayout
from vllm_rlt.models.ouro import OuroConfig
from vllm_rlt.tensor_utils import acc_dtype


def dense_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with statistics in fp32 (fp64 for fp64), the weight applied after the cast back."""
    x32 = x.to(acc_dtype(x.dtype))
    y = x32 / torch.sqrt(x32.square().mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def dense_attention(q, keys, values, visible) -> torch.Tensor:
    """q: [Sq, Hq, d]; keys/values: [Sk, Hkv, d]; visible: [Sq, Sk] bool -> [Sq, Hq, d], scaled
    by 1/sqrt(d) and accumulated in fp32 (fp64 for fp64)."""
    group = q.shape[1] // keys.shape[1]
    acc = acc_dtype(q.dtype)
    keys = keys.to(acc).repeat_interleave(group, 1)
    values = values.to(acc).repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), keys) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)


@dataclass(frozen=True)
class ReferenceOutput:
    hidden: torch.Tensor  # [D, S, H] normed state after each loop; NaN where a token did not run
    gate_logits: torch.Tensor  # [D, S] fp32 exit-gate logit after each loop; NaN likewise
    logits: torch.Tensor  # [D, S, V] LM-head logits of each loop's state; NaN likewise


class DenseOuroReference:
    def __init__(self, config: OuroConfig, weights: dict[str, torch.Tensor]):
        self.c = config
        self.w = weights
        d, device = config.head_dim, weights["lm_head.weight"].device
        exponents = torch.arange(0, d, 2, dtype=torch.float64, device=device) / d
        self.inv_freq = config.rope_theta**-exponents

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> DenseOuroReference:
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        return cls(model.config, weights)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return dense_rms_norm(x, self.w[name], self.c.rms_norm_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [S, heads, d] rotated by split-half RoPE at `positions`."""
        ang = (positions.double()[:, None] * self.inv_freq[None, :]).float()
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _qkv(self, x: torch.Tensor, layer: int, positions: torch.Tensor):
        p = f"model.layers.{layer}."
        a = self._norm(x, p + "input_layernorm.weight")
        shape = (x.shape[0], -1, self.c.head_dim)
        q = (a @ self.w[p + "self_attn.q_proj.weight"].T).view(shape)
        k = (a @ self.w[p + "self_attn.k_proj.weight"].T).view(shape)
        v = (a @ self.w[p + "self_attn.v_proj.weight"].T).view(shape)
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish_layer(self, x: torch.Tensor, attn: torch.Tensor, layer: int) -> torch.Tensor:
        p = f"model.layers.{layer}."
        o = attn.reshape(x.shape[0], -1) @ self.w[p + "self_attn.o_proj.weight"].T
        x = x + self._norm(o, p + "input_layernorm_2.weight")
        m = self._norm(x, p + "post_attention_layernorm.weight")
        gate = m @ self.w[p + "mlp.gate_proj.weight"].T
        up = m @ self.w[p + "mlp.up_proj.weight"].T
        mlp = (torch.nn.functional.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        return x + self._norm(mlp, p + "post_attention_layernorm_2.weight")

    def _attend(self, q, keys, values, visible) -> torch.Tensor:
        return dense_attention(q, keys, values, visible)

    def run(
        self,
        token_ids: Sequence[int],
        loops: Sequence[int] | None = None,
        layout: KVLayout | str = KVLayout.LAST_EXITED,
    ) -> ReferenceOutput:
        """token_ids: one sequence; loops[i] in [1, D] = loops token i runs (default all D)."""
        num_loops, seq = self.c.num_loops, len(token_ids)
        loops_t = torch.tensor(loops if loops is not None else [num_loops] * seq)
        if loops_t.numel() != seq or loops_t.min() < 1 or loops_t.max() > num_loops:
            raise ValueError(f"loops must give 1..{num_loops} for each of the {seq} tokens")
        ids = torch.tensor(list(token_ids), device=self.w["lm_head.weight"].device)
        x0 = self.w["model.embed_tokens.weight"][ids]
        if KVLayout(layout) is KVLayout.LAST_EXITED:
            states = self._run_last_exited(x0, loops_t)
        else:
            states = self._run_shared(x0, loops_t)
        return self._collect(states, loops_t)

    def _run_last_exited(self, x0: torch.Tensor, loops: torch.Tensor) -> list[torch.Tensor]:
        """Depth by depth over the whole sequence; each layer keeps the K/V of every token at
        the deepest depth it has reached (= min(d, its last depth) when read at depth d)."""
        seq = x0.shape[0]
        pos = torch.arange(seq, device=x0.device)
        causal = pos[None, :] <= pos[:, None]
        kv = [None] * self.c.num_hidden_layers
        states, h = [], x0
        for depth in range(self.c.num_loops):
            active = (loops > depth).to(x0.device)
            x = h
            for layer in range(self.c.num_hidden_layers):
                q, k, v = self._qkv(x, layer, pos)
                if kv[layer] is None:
                    kv[layer] = (k.clone(), v.clone())
                keys, values = kv[layer]
                keys[active], values[active] = k[active], v[active]
                x = self._finish_layer(x, self._attend(q, keys, values, causal), layer)
            x = self._norm(x, "model.norm.weight")
            states.append(x)
            h = torch.where(active[:, None], x, h)
        return states

    def _run_shared(self, x0: torch.Tensor, loops: torch.Tensor) -> list[torch.Tensor]:
        """Position by position: token i runs all its loops reading the final K/V of j < i."""
        seq, num_layers = x0.shape[0], self.c.num_hidden_layers
        final_k = [[] for _ in range(num_layers)]
        final_v = [[] for _ in range(num_layers)]
        states = [x0.clone() for _ in range(self.c.num_loops)]
        for i in range(seq):
            x, pos = x0[i : i + 1], torch.tensor([i], device=x0.device)
            visible = torch.ones(1, i + 1, dtype=torch.bool, device=x0.device)
            for depth in range(int(loops[i])):
                last = depth == int(loops[i]) - 1
                for layer in range(num_layers):
                    q, k, v = self._qkv(x, layer, pos)
                    keys = torch.cat([*final_k[layer], k])
                    values = torch.cat([*final_v[layer], v])
                    if last:
                        final_k[layer].append(k)
                        final_v[layer].append(v)
                    x = self._finish_layer(x, self._attend(q, keys, values, visible), layer)
                x = self._norm(x, "model.norm.weight")
                states[depth][i] = x[0]
        return states

    def _readout(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gate logit (fp32) and logits of a normed loop state."""
        acc = acc_dtype(x.dtype)
        gate_w = self.w["model.early_exit_gate.weight"].to(acc)
        gate = (x.to(acc) @ gate_w.T + self.w["model.early_exit_gate.bias"].to(acc)).squeeze(-1)
        return gate, x @ self.w["lm_head.weight"].T

    def _collect(self, states: list[torch.Tensor], loops: torch.Tensor) -> ReferenceOutput:
        hidden, gates, logits = [], [], []
        for depth, x in enumerate(states):
            ran = (loops > depth).to(x.device)[:, None]
            gate, logit = self._readout(x)
            nan = float("nan")
            hidden.append(torch.where(ran, x, nan))
            gates.append(torch.where(ran[:, 0], gate, nan))
            logits.append(torch.where(ran, logit, nan))
        return ReferenceOutput(torch.stack(hidden), torch.stack(gates), torch.stack(logits))
