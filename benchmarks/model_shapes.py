"""Config files of real model shapes, for benchmarks with dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_rlt.models.tiny import TINY_OURO

OURO_1_4B = {
    "architectures": ["OuroForCausalLM"],
    "model_type": "ouro",
    "vocab_size": 49152,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "use_sliding_window": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}

SHAPES = {"ouro-1.4b": OURO_1_4B, "tiny": {**TINY_OURO, "vocab_size": 512}}


def write_shape(name: str, path: str | Path) -> Path:
    """A model directory holding only config.json (load it with load_format="dummy")."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return path
