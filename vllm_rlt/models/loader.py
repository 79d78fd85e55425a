"""Load a looped model from an HF checkpoint directory.

Reads `config.json` (model chosen by `model_type`), then `model.safetensors` or the shards named
by `model.safetensors.index.json`, checks names and shapes strictly, and casts to the chosen dtype.
`load_format="dummy"` builds seeded random weights for any real config instead (benchmarks of
full-size shapes without the checkpoint). The tokenizer (`tokenizer.json`) comes from the same
directory when present.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from vllm_rlt.config import DTYPE_NAMES, LOAD_FORMATS, ConfigError
from vllm_rlt.kernels import device_info
from vllm_rlt.models import registry

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if name != "auto"}


class CheckpointError(ConfigError):
    """A checkpoint whose files or tensors do not match the model; the message names the file."""


@dataclass
class LoadedModel:
    model: torch.nn.Module  # in eval mode, on its device and dtype
    config: object  # the parsed model config (e.g. OuroConfig)
    tokenizer: Tokenizer | None  # from tokenizer.json, if the directory has one
    model_dir: Path
    # (k_scale, v_scale) per KV layer for an FP8 KV cache, when the checkpoint gives them
    kv_scales: tuple[tuple[float, float], ...] | None = None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" is bf16 on GPU and fp32 on CPU; otherwise a name from DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(
    device: str | torch.device | None, attention_backend: str, layer_kernels: str
) -> torch.device:
    """The device to run on (default: CUDA when available); ConfigError for an unknown device,
    CUDA without a GPU, or Triton kernels on the CPU without the Triton interpreter."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a device name; use cpu or cuda") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use cpu or cuda")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device={device!r} but no CUDA GPU is available; use device='cpu'")
        if resolved.index is not None and resolved.index >= count:
            raise ConfigError(f"device={device!r} but only {count} CUDA GPU(s) are visible")
        return resolved
    triton = {
        "attention_backend": ("triton", "triton_invariant"),
        "layer_kernels": ("fused", "skinny", "invariant"),
    }
    chosen = {"attention_backend": attention_backend, "layer_kernels": layer_kernels}
    for name, value in chosen.items():
        if value in triton[name] and not device_info.INTERPRET:
            invariant = value in ("triton_invariant", "invariant")
            what = "batch_invariant" if invariant else f"{name}={value!r}"
            fix = "" if invariant else f"; use {name}='torch'"
            raise ConfigError(
                f"{what} runs Triton kernels, which on the CPU need the Triton interpreter "
                f"(TRITON_INTERPRET=1 in the environment){fix}"
            )
    return resolved


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; CheckpointError naming the file (and the line and column of a
    syntax error) otherwise."""
    try:
        raw = json.loads(path.read_bytes())
    except json.JSONDecodeError as err:
        msg = f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
        raise CheckpointError(msg) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not valid JSON: it is not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_config(model_dir: str | Path) -> object:
    if not Path(model_dir).is_dir():
        what = "is not a directory" if Path(model_dir).exists() else "does not exist"
        raise CheckpointError(f"model directory {model_dir} {what}")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a model directory needs config.json")
    raw = read_json_file(path)
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():  # the stop ids generate() uses (Huginn's live only there)
        raw["generation_eos_token_id"] = read_json_file(generation).get("eos_token_id")
    try:
        config_cls, _ = registry.resolve(raw.get("model_type"))
        return config_cls.from_dict(raw)
    except ConfigError as err:
        raise type(err)(f"{path}: {err}") from None


def read_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The tokenizer from `tokenizer.json`, None when the directory has none."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for every kind of bad file
        raise CheckpointError(f"{path} is not a valid tokenizer: {err}") from None


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    load_format: str = "auto",
    attention_backend: str = "auto",
    layer_kernels: str = "auto",
    seed: int = 0,
) -> LoadedModel:
    """Build the model on `device` (default: CUDA when available) and read its weights.
    `attention_backend="auto"` picks triton on CUDA and torch on the CPU; `layer_kernels` is the
    model's `LayerKernels` strategy (`vllm_rlt.config.LAYER_KERNELS`)."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_dir = Path(model_dir)
    device = resolve_device(device, attention_backend, layer_kernels)
    torch_dtype = resolve_dtype(dtype, device)
    if attention_backend == "auto":
        attention_backend = "triton" if device.type == "cuda" else "torch"
    config = read_config(model_dir)
    _, model_cls = registry.resolve(config.model_type)
    with torch.device(device):
        model = model_cls(config, attention_backend=attention_backend, layer_kernels=layer_kernels)
    model.to(torch_dtype)
    kv_scales = None
    if load_format == "dummy":
        init_random_weights(model, seed)
    else:
        load_safetensors(model, model_dir)
        kv_scales = read_kv_scales(model, model_dir)
    tokenizer = read_tokenizer(model_dir)
    model = model.eval().requires_grad_(False)
    return LoadedModel(model, config, tokenizer, model_dir, kv_scales)


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> parameter (a tied LM head is not stored separately)."""
    return dict(model.named_parameters())  # named_parameters drops the tied duplicate


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it (single file or sharded index)."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_file(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index.name} has no 'weight_map'")
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        absent = sorted({p.name for p in files.values() if not p.is_file()})
        if absent:
            raise CheckpointError(f"{index.name} names shard files that are missing: {absent}")
        return files
    if single.is_file():
        with open_weights(single) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no iter
    raise CheckpointError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


@contextlib.contextmanager
def open_weights(path: Path) -> Iterator[Any]:
    """`safe_open(path)`; an empty, truncated or foreign file (or a read of one of its tensors)
    raises CheckpointError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from None


@torch.no_grad()
def load_safetensors(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into the model after a strict name and shape check."""
    params = expected_tensors(model)
    files = checkpoint_files(model_dir)
    # tensors a checkpoint may hold beside the parameters (a tied head's copy, a RoPE table)
    optional = set(getattr(model, "optional_checkpoint_tensors", ())) & set(files)
    scale_names = {name for pair in kv_scale_names(model) for name in pair}  # read_kv_scales
    problems = []
    missing = sorted(set(params) - set(files))
    unexpected = sorted(set(files) - set(params) - optional - scale_names)
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(set(params) & set(files)):
        by_file.setdefault(files[name], []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(optional):
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with open_weights(path) as f:
            for name in names:
                if name in optional:
                    loaded[name] = f.get_tensor(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    problems.append(
                        f"{name} has shape {list(shape)}, expected {list(params[name].shape)}"
                    )
                elif not problems:
                    loaded[name] = f.get_tensor(name)
    if problems:
        raise CheckpointError(
            f"checkpoint in {model_dir} does not match the model: " + "; ".join(problems)
        )
    for name, tensor in loaded.items():
        if name not in optional:
            params[name].copy_(tensor)
    vetted = (model.check_checkpoint_tensor(name, loaded[name]) for name in sorted(optional))
    problems = [problem for problem in vetted if problem is not None]
    if problems:
        raise CheckpointError(f"checkpoint in {model_dir}: " + "; ".join(problems))


def kv_scale_names(model: torch.nn.Module) -> list[tuple[str, str]]:
    """The checkpoint names of the (K, V) scales of each KV layer `model` reads (none for a
    model without `kv_scale_names`, such as Huginn)."""
    return getattr(model, "kv_scale_names", list)()


def read_kv_scales(
    model: torch.nn.Module, model_dir: Path
) -> tuple[tuple[float, float], ...] | None:
    """The checkpoint's (k_scale, v_scale) of each KV layer (scalars, as FP8 checkpoints store
    them), or None when it has none; some but not all, or a scale that is not a positive finite
    scalar, raises CheckpointError."""
    names = [name for pair in kv_scale_names(model) for name in pair]
    files = checkpoint_files(model_dir)
    present = [name for name in names if name in files]
    if not present:
        return None
    if len(present) != len(names):
        missing = sorted(set(names) - set(present))
        raise CheckpointError(f"checkpoint in {model_dir} has KV scales but not {missing}")
    values = []
    for name in names:
        with open_weights(files[name]) as f:
            t = f.get_tensor(name)
        if t.numel() != 1 or not torch.isfinite(t).all() or t.item() <= 0:
            raise CheckpointError(f"{name} must be one positive finite value, got {t.tolist()}")
        values.append(float(t.item()))
    return tuple(zip(values[0::2], values[1::2], strict=True))


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights that keep activations and logits in a useful range.

    Matrices ~ N(0, 1/fan_in) (the embedding ~ N(0, 1)), norm weights ~ U(0.5, 1.5) so that a
    swapped norm changes results, biases ~ N(0, 1).
    """
    for name, param in sorted(expected_tensors(model).items()):
        gen = torch.Generator(device=param.device).manual_seed(seed + _stable_hash(name))
        if name.endswith(("norm.weight", "ln_f.weight")) or ".norm_" in name:
            values = torch.rand(param.shape, generator=gen, device=param.device) + 0.5
        elif param.dim() == 1:
            values = torch.randn(param.shape, generator=gen, device=param.device)
        else:
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(param.shape[1])
            values = torch.randn(param.shape, generator=gen, device=param.device) * std
        param.copy_(values)


def _stable_hash(text: str) -> int:
    """A hash that does not change between processes (unlike hash())."""
    return sum((i + 1) * ord(ch) for i, ch in enumerate(text)) % (2**31)
