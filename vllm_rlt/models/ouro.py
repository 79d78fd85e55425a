"""Native Ouro (ByteDance looped LM): configuration and the three stages over packed rows.

`prelude` embeds tokens, `recurrent_core` runs one loop (all shared layers, the end-of-loop norm
and the exit-gate logit) for rows that may each sit at their own position, depth and request,
and `coda` is the LM head. Maths per docs MODELS.md §1.3; parameter names match the HF
checkpoint exactly so the loader maps tensors one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vllm_rlt.attention.backend import AttentionBackend, get_attention_backend
from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, acc_dtype


class UnsupportedConfigError(ValueError):
    """A checkpoint configuration this engine cannot run faithfully."""


@dataclass(frozen=True)
class OuroConfig:
    """The fields of an Ouro `config.json` the engine uses (HF names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    total_ut_steps: int = 4  # loops per token (the recurrence depth D)
    early_exit_threshold: float | None = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "ouro"

    @property
    def num_loops(self) -> int:
        return self.total_ut_steps

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        """Parse and validate an HF config dict; unsupported settings raise with their name."""
        if raw.get("model_type") != "ouro":
            raise UnsupportedConfigError(
                f"model_type must be 'ouro', got {raw.get('model_type')!r}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        )
        missing = [k for k in required if raw.get(k) is None]
        if missing:
            raise UnsupportedConfigError(f"config.json lacks required fields: {missing}")
        problems = []
        if raw.get("use_sliding_window"):
            problems.append("use_sliding_window=true (sliding-window attention)")
        layer_types = raw.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            problems.append(f"layer_types={sorted(set(layer_types))} (only full_attention)")
        if raw.get("rope_scaling") not in (None, {}):
            problems.append(f"rope_scaling={raw['rope_scaling']!r} (no RoPE scaling supported)")
        if raw.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={raw['hidden_act']!r} (only silu)")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            problems.append("attention_bias/mlp_bias=true (Ouro linears have no bias)")
        if problems:
            raise UnsupportedConfigError("unsupported Ouro config: " + "; ".join(problems))
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
        kwargs.setdefault("num_key_value_heads", raw["num_attention_heads"])
        kwargs.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.total_ut_steps < 1:
            raise UnsupportedConfigError(f"total_ut_steps={self.total_ut_steps} must be >= 1")


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """rope: this invocation's tables from `RotaryEmbedding.tables`."""
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(rope, q), RotaryEmbedding.apply(rope, k)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(rows, -1))


class OuroDecoderLayer(nn.Module):
    """Sandwich-norm layer: a norm before each block and another before each residual add."""

    def __init__(self, config: OuroConfig, backend: AttentionBackend):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = OuroAttention(config, backend)
        self.mlp = SwiGLUMLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(self, h, rope, meta, k_cache, v_cache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), rope, meta, k_cache, v_cache)
        h = h + self.input_layernorm_2(attn)
        mlp = self.mlp(self.post_attention_layernorm(h))
        return h + self.post_attention_layernorm_2(mlp)


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OuroDecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


class OuroForCausalLM(nn.Module):
    """Ouro over packed rows; the KV cache and the hidden-state buffers live outside."""

    # capabilities the engine checks at startup
    requires_atomic_prefill = False  # Ouro's prefill may split between depths (split, WCPB)

    def __init__(self, config: OuroConfig, attention_backend: str | AttentionBackend = "torch"):
        super().__init__()
        backend = (
            get_attention_backend(attention_backend)
            if isinstance(attention_backend, str)
            else attention_backend
        )
        self.config = config
        self.model = OuroModel(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    def prelude(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """token_ids, positions: [R] -> hidden [R, H]. Ouro's prelude is the embedding alone."""
        del positions  # RoPE is applied inside attention, from the metadata
        return self.model.embed_tokens(token_ids)

    def recurrent_core(
        self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop for every row: hidden [R, H] -> (normed hidden [R, H], gate logit [R] fp32).

        `kv.layer(i)` gives layer i's (k_cache, v_cache); the metadata says which plane and
        positions each row writes and reads.
        """
        h = hidden
        rope = self.rotary.tables(attn_metadata.positions, hidden.dtype)
        for i, layer in enumerate(self.model.layers):
            k_cache, v_cache = kv.layer(i)
            h = layer(h, rope, attn_metadata, k_cache, v_cache)
        h = self.model.norm(h)
        gate = self.model.early_exit_gate
        acc = acc_dtype(h.dtype)  # the gate runs in fp32 (fp64 for an fp64 model)
        gate_logit = torch.nn.functional.linear(h.to(acc), gate.weight.to(acc), gate.bias.to(acc))
        return h, gate_logit.squeeze(-1)

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, V] (in the model dtype)."""
        return self.lm_head(hidden)
