"""Factories and metrics shared by the tests."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from benchmarks.model_shapes import HUGINN_0125
from vllm_rlt.models.huginn import HuginnConfig, HuginnForCausalLM, rope_table
from vllm_rlt.models.loader import init_random_weights
from vllm_rlt.models.ouro import OuroConfig, OuroForCausalLM
from vllm_rlt.models.tiny import TINY_OURO, save_checkpoint, train_tokenizer

GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}
MHA = {"num_attention_heads": 4, "num_key_value_heads": 4}


def tiny_config(**overrides) -> OuroConfig:
    return OuroConfig.from_dict({**TINY_OURO, "vocab_size": 96, **overrides})


def tiny_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    device: str = "cpu",
    layer_kernels: str = "auto",
    **overrides,
) -> OuroForCausalLM:
    with torch.device(device):
        model = OuroForCausalLM(
            tiny_config(**overrides), attention_backend=backend, layer_kernels=layer_kernels
        )
    init_random_weights(model, seed)
    return model.to(dtype).eval().requires_grad_(False)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b| over the entries where `expected` is not NaN."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    mask = ~torch.isnan(expected)
    a, b = actual[mask], expected[mask]
    return float((a - b).abs().max() / b.abs().max())


# ---- Huginn ---------------------------------------------------------------------------------
HUGINN_SPECIAL_TOKENS = [
    "<|begin_text|>",
    "<|end_text|>",
    "<|begin_header|>",
    "<|end_header|>",
    "<|end_turn|>",
    "<|pad|>",
]
# the release's template (docs/models.md §3.4), over the tiny tokenizer's special tokens
HUGINN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|begin_header|>"
    "{{ 'Huginn' if m['role'] == 'assistant' else m['role'] }}<|end_header|>\n\n"
    "{{ m['content'] }}<|end_turn|>{% endfor %}"
    "{% if add_generation_prompt %}<|begin_header|>Huginn<|end_header|>\n\n"
    "{% else %}<|end_text|>{% endif %}"
)
TINY_HUGINN = {
    **HUGINN_0125,
    "n_embd": 32,
    "n_heads": 4,
    "n_layers": 4,
    "n_layers_in_prelude": 1,
    "n_layers_in_recurrent_block": 2,
    "n_layers_in_coda": 1,
    "intermediate_size": 64,
    "vocab_size": 96,
    "padded_vocab_size": None,
    "block_size": 256,
    "mean_recurrence": 4,
    "bos_token_id": 0,
    "eos_token_id": None,
    "pad_token_id": 5,
    "torch_dtype": "float32",
}


def tiny_huginn_config(**overrides) -> HuginnConfig:
    return HuginnConfig.from_dict({**TINY_HUGINN, **overrides})


def tiny_huginn(
    seed: int = 0,
    dtype=torch.float32,
    backend="torch",
    device: str = "cpu",
    layer_kernels: str = "auto",
    **overrides,
):
    with torch.device(device):
        config = tiny_huginn_config(**overrides)
        model = HuginnForCausalLM(config, attention_backend=backend, layer_kernels=layer_kernels)
    init_random_weights(model, seed)
    return model.to(dtype).eval().requires_grad_(False)


def write_tiny_huginn(path, *, vocab_size: int = 256, seed: int = 0, **overrides) -> Path:
    """A tiny Huginn checkpoint as the release stores it: fp32 tensors under the HF names, the
    tied head's duplicate `lm_head.weight`, `freqs_cis`, eos ids in generation_config.json and
    the chat template in tokenizer_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size, special_tokens=HUGINN_SPECIAL_TOKENS)
    raw = {**TINY_HUGINN, "vocab_size": tokenizer.get_vocab_size(), **overrides}
    model = tiny_huginn(seed, **{k: v for k, v in raw.items() if k != "model_type"})
    tensors = {k: v.detach().contiguous() for k, v in model.named_parameters()}
    tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    c = model.config
    tensors["freqs_cis"] = rope_table(c.head_dim, c.block_size, c.rope_base)[None, :, None]
    save_checkpoint(tensors, path)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    generation = {"bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 5}
    (path / "generation_config.json").write_text(json.dumps(generation))
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_text|>",
        "eos_token": "<|end_text|>",
        "chat_template": HUGINN_CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


def chi_square_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom for two samples over the same categories;
    categories whose expected count is below 5 in either sample are merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    big, small = [], (0, 0)
    for cat in set(a) | set(b):
        total = a[cat] + b[cat]
        if min(total * na, total * nb) / (na + nb) >= 5:
            big.append((a[cat], b[cat]))
        else:
            small = (small[0] + a[cat], small[1] + b[cat])
    if sum(small):
        big.append(small)
    stat = 0.0
    for ca, cb in big:
        total = ca + cb
        for count, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    return stat, len(big) - 1


def chi_square_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
