"""Huginn-0125 (`model_type: "huginn_raven"`) configuration: the `config.json` fields the engine
uses (HF names and defaults of the released model, docs/models.md §3), with the names the engine
shares with Ouro (`vocab_size`, `head_dim`, `num_loops`, ...) as derived properties."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from vllm_rlt.config_fields import check_field_types
from vllm_rlt.models.registry import UnsupportedConfigError

# HF aliases RavenConfig accepts for its own field names
_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_heads", "n_layers": None}


@dataclass(frozen=True)
class HuginnConfig:
    n_embd: int = 5280
    n_heads: int = 55
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    intermediate_size: int = 17920
    vocab_size: int = 65536
    block_size: int = 4096  # most positions (the length of the `freqs_cis` table)
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    bias: bool = False
    qk_bias: bool = True
    mean_recurrence: int = 32  # recurrences per token (the depth D)
    bos_token_id: int | None = 65504
    eos_token_id: int | list[int] | None = None
    model_type: str = "huginn_raven"

    @property
    def num_loops(self) -> int:
        return self.mean_recurrence

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def num_kv_layers(self) -> int:
        """Layers whose K/V one KV block holds: the recurrent core's (see `HuginnForCausalLM`)."""
        return self.n_layers_in_recurrent_block

    @property
    def max_position_embeddings(self) -> int:
        return self.block_size

    @property
    def num_key_value_heads(self) -> int:
        return self.n_heads  # multi-head attention

    @property
    def early_exit_threshold(self) -> float:
        return 1.0  # no exit gate: every token runs its loops

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.n_embd)

    @property
    def init_std(self) -> float:
        """The std of the "like-init" initial state before it is scaled by sqrt(n_embd)."""
        return math.sqrt(2 / (5 * self.n_embd))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HuginnConfig:
        """Parse and validate an HF config dict (`generation_eos_token_id`: the eos ids of the
        checkpoint's generation_config.json, which win over config.json's)."""
        if raw.get("model_type") != "huginn_raven":
            raise UnsupportedConfigError(
                f"model_type must be 'huginn_raven', got {raw.get('model_type')!r}"
            )
        raw = dict(raw)
        for alias, name in _ALIASES.items():
            if name is not None and alias in raw and name not in raw:
                raw[name] = raw[alias]
        if raw.get("generation_eos_token_id") is not None:
            raw["eos_token_id"] = raw["generation_eos_token_id"]
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names and v is not None}
        check_field_types(cls, kwargs)
        problems = []
        if raw.get("injection_type", "linear") != "linear":
            problems.append(f"injection_type={raw['injection_type']!r} (only linear)")
        if raw.get("state_init", "like-init") != "like-init":
            problems.append(f"state_init={raw['state_init']!r} (only like-init)")
        if kwargs.get("bias"):
            problems.append("bias=true (Huginn linears have no bias)")
        if not kwargs.get("qk_bias", True):
            problems.append("qk_bias=false (the q/k bias is part of every released block)")
        if raw.get("n_layers") is not None:
            total = sum(
                kwargs.get(k, getattr(cls, k))
                for k in ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
            )
            if raw["n_layers"] != total:
                problems.append(f"n_layers={raw['n_layers']} is not prelude + core + coda={total}")
        kv_heads = raw.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != raw.get("n_heads", cls.n_heads):
            problems.append(f"num_key_value_heads={kv_heads} (Huginn attention is multi-head)")
        padded = raw.get("padded_vocab_size")
        if padded is not None and padded != raw.get("vocab_size", cls.vocab_size):
            problems.append(f"padded_vocab_size={padded} differs from vocab_size")
        if problems:
            raise UnsupportedConfigError("unsupported Huginn config: " + "; ".join(problems))
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        sizes = {
            "n_embd": self.n_embd,
            "n_heads": self.n_heads,
            "n_layers_in_recurrent_block": self.n_layers_in_recurrent_block,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "mean_recurrence": self.mean_recurrence,
        }
        small = {k: v for k, v in sizes.items() if v < 1}
        if small or self.n_layers_in_prelude < 0 or self.n_layers_in_coda < 0:
            raise UnsupportedConfigError(f"these fields must be >= 1 (prelude, coda >= 0): {small}")
        if self.n_embd % self.n_heads or self.head_dim % 2:
            raise UnsupportedConfigError(
                f"n_embd={self.n_embd} must split into n_heads={self.n_heads} heads of an even size"
            )
