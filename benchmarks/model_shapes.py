"""Config files of real model shapes, for benchmarks with dummy weights.

`python -m benchmarks.model_shapes NAME DIR` writes one (e.g. `huginn-0125`, then
`vllm-rlt bench DIR --load-format dummy ...`)."""

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

# the released Huginn-0125 (RavenConfig's defaults, docs/models.md §3)
HUGINN_0125 = {
    "architectures": ["RavenForCausalLM"],
    "model_type": "huginn_raven",
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers": 8,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "intermediate_size": 17920,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "block_size": 4096,
    "rope_base": 50000,
    "norm_eps": 1e-6,
    "tie_embeddings": True,
    "bias": False,
    "qk_bias": True,
    "injection_type": "linear",
    "state_init": "like-init",
    "mean_recurrence": 32,
    "bos_token_id": 65504,
    "eos_token_id": 65505,
    "pad_token_id": 65509,
    "torch_dtype": "bfloat16",
}
# generation_config.json beside a shape's config.json (Huginn's stop ids live there)
GENERATION = {"huginn-0125": {"bos_token_id": 65504, "eos_token_id": [65505, 65508]}}

SHAPES = {
    "ouro-1.4b": OURO_1_4B,
    "huginn-0125": HUGINN_0125,
    "tiny": {**TINY_OURO, "vocab_size": 512},
}


def write_shape(name: str, path: str | Path) -> Path:
    """A model directory holding only config.json (load it with load_format="dummy")."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    if name in GENERATION:
        (path / "generation_config.json").write_text(json.dumps(GENERATION[name], indent=2))
    return path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("path")
    args = parser.parse_args()
    print(write_shape(args.name, args.path))
