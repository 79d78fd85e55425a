"""The tiny Ouro as a dense batched causal forward for training, and the Ouro objectives.

Model: the Ouro architecture of docs/models.md §1.3 (sandwich RMSNorms with fp32 statistics,
split-half RoPE, SwiGLU, `model.norm` after every loop, the exit gate on the normed state), with
parameters under the HF checkpoint names so the engine's loader reads the export. The test suite
checks it against `DenseOuroReference` per loop.

Objective (the Ouro paper's two stages, docs/models.md §1.5; my own implementation): with
λ_t = σ(g_t), the exit distribution p_t = λ_t Π_{j<t}(1-λ_j) and p_D = Π_{j<D}(1-λ_j); stage 1
minimises Σ_t p_t·L_t − β·H(p), stage 2 trains the gate alone with binary cross-entropy against
"one more loop lowers the loss by less than a margin".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_rlt.models.layers import RMSNorm, SwiGLUMLP
from vllm_rlt.models.ouro import OuroConfig

GATE_SHARPNESS = 100.0  # k in the stage-2 target σ(k·(I_t − margin))


def rope_tables(config: OuroConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim] fp32 for positions 0..T-1 (split-half layout)."""
    d = config.head_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    ang = (torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq).float()
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; the tables are cast to x's dtype, as in the HF reference."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H], causal."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = SwiGLUMLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class Backbone(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


class TrainOuro(nn.Module):
    """Dense batched Ouro for training; `named_parameters()` are the HF checkpoint names."""

    def __init__(self, config: OuroConfig):
        super().__init__()
        if config.tie_word_embeddings:
            raise ValueError("the trainer writes an untied lm_head")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """ids: [B, T] -> the normed state after each loop, D tensors of [B, T, H]."""
        cos, sin = rope_tables(self.config, ids.shape[1], ids.device)
        h, out = self.model.embed_tokens(ids), []
        for _ in range(self.config.num_loops):
            for layer in self.model.layers:
                h = layer(h, cos, sin)
            h = self.model.norm(h)
            out.append(h)
        return out

    def gate_logits(self, state: torch.Tensor) -> torch.Tensor:
        """state: [..., H] -> exit-gate logit [...] in fp32 (also under autocast)."""
        gate = self.model.early_exit_gate
        with torch.autocast(state.device.type, enabled=False):
            return F.linear(state.float(), gate.weight.float(), gate.bias.float()).squeeze(-1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids: [B, T] -> (logits [D, B, T, V], gate logits [D, B, T] fp32)."""
        states = self.states(ids)
        logits = torch.stack([self.lm_head(s) for s in states])
        return logits, torch.stack([self.gate_logits(s) for s in states])


@torch.no_grad()
def init_weights(model: TrainOuro, seed: int, gate_bias: float) -> None:
    """N(0, 0.02) matrices, unit norms, the exit-gate bias `gate_bias`."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name == "model.early_exit_gate.bias":
            p.fill_(gate_bias)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def log_exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """gate_logits: [D, ...] -> log p_t [D, ...], p_t = λ_t Π_{j<t}(1-λ_j), last = remainder."""
    log_exit = F.logsigmoid(gate_logits[:-1].float())
    log_stay = F.logsigmoid(-gate_logits[:-1].float())
    zero = torch.zeros_like(log_stay[:1])
    log_survive = torch.cat([zero, log_stay.cumsum(0)])  # log Π_{j<t}(1-λ_j), t = 0..D-1
    return torch.cat([log_exit + log_survive[:-1], log_survive[-1:]])


def per_loop_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [D, B, T, V], targets [B, T] -> next-token cross-entropy L_t [D, B, T] fp32."""
    num_loops = logits.shape[0]
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(flat, targets.reshape(-1).repeat(num_loops), reduction="none")
    return ce.view(num_loops, *targets.shape)


def stage1_loss(losses: torch.Tensor, gate_logits: torch.Tensor, beta: float):
    """losses, gate_logits: [D, ...] -> (mean Σ_t p_t L_t − β H(p), mean entropy)."""
    log_p = log_exit_distribution(gate_logits)
    p = log_p.exp()
    entropy = -(p * log_p).sum(0)
    return (p * losses).sum(0).mean() - beta * entropy.mean(), entropy.mean()


def stage2_loss(losses: torch.Tensor, gate_logits: torch.Tensor, margin: float) -> torch.Tensor:
    """BCE of λ_t against the soft target 'loop t+1 improves the loss by less than margin'."""
    improvement = losses[:-1] - losses[1:]
    exit_target = 1.0 - torch.sigmoid(GATE_SHARPNESS * (improvement - margin))
    return F.binary_cross_entropy_with_logits(gate_logits[:-1].float(), exit_target.detach())


def exit_steps(gate_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """The Ouro rule: the first loop (0-based) whose CDF ≥ threshold, else the last -> [...]."""
    cdf = log_exit_distribution(gate_logits).exp().cumsum(0)
    reached = cdf >= threshold
    last = torch.full_like(reached[0], gate_logits.shape[0] - 1, dtype=torch.long)
    return torch.where(reached.any(0), reached.long().argmax(0), last)
