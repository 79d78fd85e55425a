"""Native Ouro (ByteDance looped LM): configuration and the three stages over packed rows.

`prelude` embeds tokens, `recurrent_core` runs one loop (all shared layers, the end-of-loop norm
and the exit-gate logit) for rows that may each sit at their own position, depth and request,
and `coda` is the LM head. Maths per docs/models.md §1.3; parameter names match the HF
checkpoint exactly so the loader maps tensors one to one (q/k/v and gate/up weights are views
into fused weights, see `layers.FusesLinears`). The element-wise work runs through a
`LayerKernels` strategy: torch ops, or fused projections and Triton kernels (CUDA default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vllm_rlt.attention.backend import AttentionBackend, get_attention_backend
from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.config_fields import check_field_types
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.models.layer_kernels import LayerKernels
from vllm_rlt.models.layers import FusesLinears, RMSNorm, RotaryEmbedding, SwiGLUMLP
from vllm_rlt.models.looped_lm import LoopedCausalLM
from vllm_rlt.models.registry import UnsupportedConfigError


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

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V one KV block holds."""
        return self.num_hidden_layers

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
            raise UnsupportedConfigError(f"required fields are missing: {missing}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
        check_field_types(cls, kwargs)
        sizes = (*required, "num_key_value_heads", "head_dim", "total_ut_steps")
        small = {k: kwargs[k] for k in sizes if k in kwargs and kwargs[k] < 1}
        if small:
            raise UnsupportedConfigError(f"these fields must be >= 1: {small}")
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


class OuroAttention(FusesLinears):
    """Attention with HF-named q/k/v/o projections; `qkv_weight` [(Hq + 2 Hkv) d, H] fuses q/k/v."""

    fused_linears = {"qkv_weight": ("q_proj", "k_proj", "v_proj")}

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
        self._fuse()

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        cache: KVLayer,
        kernels: LayerKernels,
    ) -> torch.Tensor:
        """x: [R, H] normed block input; rope: this invocation's `RotaryEmbedding.tables`."""
        q, k, v, written = kernels.qkv(self, x, rope, (cache, meta.slot_mapping))
        out = self.backend.forward(q, k, v, cache, meta, kv_stored=written)
        return kernels.out_proj(self, out.reshape(x.shape[0], -1))


class OuroMLP(FusesLinears, SwiGLUMLP):
    """SwiGLU whose gate/up weights are views into `gate_up_weight` [2 I, H]."""

    fused_linears = {"gate_up_weight": ("gate_proj", "up_proj")}

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__(hidden_size, intermediate_size)
        self._fuse()


class OuroDecoderLayer(nn.Module):
    """Sandwich-norm layer: a norm before each block and another before each residual add."""

    def __init__(self, config: OuroConfig, backend: AttentionBackend):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = OuroAttention(config, backend)
        self.mlp = OuroMLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        next_norm: RMSNorm,
        rope: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        cache: KVLayer,
        kernels: LayerKernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [R, H] residual stream entering the layer; x: [R, H] = input_layernorm(h).

        Returns (h leaving the layer, next_norm of it): the norm that follows a layer (the next
        layer's input norm, or the end-of-loop norm) runs in the same step as the residual add.
        """
        attn = self.self_attn(x, rope, meta, cache, kernels)
        h, x = kernels.add_norm(h, attn, self.input_layernorm_2, self.post_attention_layernorm)
        mlp = kernels.swiglu(self.mlp, x)
        return kernels.add_norm(h, mlp, self.post_attention_layernorm_2, next_norm)


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OuroDecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)


class OuroForCausalLM(LoopedCausalLM):
    """Ouro over packed rows; the KV cache and the hidden-state buffers live outside."""

    # capabilities the engine checks at startup
    requires_atomic_prefill = False  # Ouro's prefill may split between depths (split, WCPB)
    supports_shared_kv = True  # kv_layout="shared" (one plane, position-wave prefill)
    has_exit_gate = True  # exit thresholds below 1 exit by the gate
    random_initial_state = False  # prompt KV is a function of the token ids (prefix caching)
    prompt_runs_max_loops = False  # prompts run every loop, as the reference's
    num_edge_planes = 0  # every attention layer runs in the loop

    def __init__(
        self,
        config: OuroConfig,
        attention_backend: str | AttentionBackend = "torch",
        layer_kernels: str = "auto",
    ):
        super().__init__(config, layer_kernels)
        self.model = OuroModel(config, get_attention_backend(attention_backend))
        self._add_lm_head(self.model.embed_tokens, config.tie_word_embeddings)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )

    @property
    def num_loops(self) -> int:
        return self.config.num_loops

    @property
    def state_size(self) -> int:
        """Width of a hidden-state row."""
        return self.config.hidden_size

    def prelude(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """token_ids, positions: [R] -> hidden [R, H]. Ouro's prelude is the embedding alone."""
        del positions  # RoPE is applied inside attention, from the metadata
        return self.model.embed_tokens(token_ids)

    def recurrent_core(
        self, hidden: torch.Tensor, attn_metadata: AttentionMetadata, kv: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop for every row: hidden [R, H] -> (normed hidden [R, H], gate logit [R] fp32).

        `kv.layer(i)` gives layer i's caches (`KVLayer`); the metadata says which plane and
        positions each row writes and reads.
        """
        kernels = self._kernels(hidden.device)
        rope = self.rotary.tables(attn_metadata.positions, hidden.dtype)
        layers = self.model.layers
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        h, x = hidden, kernels.norm(hidden, layers[0].input_layernorm)
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms, strict=True)):
            h, x = layer(h, x, next_norm, rope, attn_metadata, kv.layer(i), kernels)
        # x is the end-of-loop norm of h (the last layer's next norm)
        return x, kernels.exit_gate(x, self.model.early_exit_gate)

    def kv_scale_names(self) -> list[tuple[str, str]]:
        """Checkpoint names of each layer's FP8 KV scales (vLLM's, for Llama-style layers)."""
        return [
            (f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale")
            for i in range(self.config.num_hidden_layers)
        ]

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, V] (in the model dtype)."""
        kernels = self._kernels(hidden.device)
        return kernels.logits(hidden, self.lm_head.weight)
