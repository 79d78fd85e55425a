"""Tiny Ouro models: a random one written as a real HF-format directory (tests), and the path of
the trained one shipped as package data (the default model of `serve`, `generate`, `LLM()`).

The directory holds config.json, model.safetensors (or shards plus an index), tokenizer.json (a
byte-level BPE trained offline with `tokenizers` on docstrings of the standard library) and
tokenizer_config.json, so the real loader and tokenizer paths are exercised.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vllm_rlt.models.loader import init_random_weights
from vllm_rlt.models.ouro import OuroConfig, OuroForCausalLM

PACKAGED_MODEL_DIR = Path(__file__).resolve().parents[1] / "model_data" / "tiny-ouro-stdlib"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_OURO = {
    "architectures": ["OuroForCausalLM"],
    "model_type": "ouro",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "use_sliding_window": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def _corpus() -> list[str]:
    import collections
    import functools
    import itertools
    import json as json_mod
    import os
    import pathlib
    import re
    import string
    import textwrap

    modules = [collections, functools, itertools, json_mod, os, pathlib, re, string, textwrap]
    texts = []
    for mod in modules:
        for obj in [mod, *vars(mod).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    return texts


def train_tokenizer(
    vocab_size: int,
    texts: Iterable[str] | None = None,
    special_tokens: list[str] = SPECIAL_TOKENS,
) -> Tokenizer:
    """A byte-level BPE with `special_tokens` (default: Ouro's) at ids 0, 1, ..., trained on
    `texts` (default: docstrings of a few standard-library modules)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if texts is None else texts, trainer)
    return tok


def write_tiny_ouro(
    path: str | Path, *, vocab_size: int = 512, seed: int = 0, num_shards: int = 1, **overrides
) -> Path:
    """Write a tiny Ouro checkpoint to `path`; `overrides` change config.json fields."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    raw = {**TINY_OURO, "vocab_size": tokenizer.get_vocab_size(), **overrides}
    model = OuroForCausalLM(OuroConfig.from_dict(raw))
    init_random_weights(model, seed)
    tensors = {k: v.detach().contiguous() for k, v in model.named_parameters()}
    save_checkpoint(tensors, path, num_shards)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "model_max_length": raw["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


def default_model_dir() -> Path:
    """The model used when none is given: the trained tiny Ouro shipped as package data
    (`tools/train_tiny_ouro.py` made it; its README.md is the model card)."""
    return PACKAGED_MODEL_DIR


def save_checkpoint(tensors: dict[str, torch.Tensor], path: Path, num_shards: int = 1) -> None:
    """model.safetensors, or `num_shards` files plus model.safetensors.index.json."""
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]
        save_file({n: tensors[n] for n in part}, str(path / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
