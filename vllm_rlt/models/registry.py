"""HF `model_type` -> (config class, model class), imported lazily."""

from __future__ import annotations

import importlib

from vllm_rlt.config import ConfigError

_MODELS = {
    "ouro": ("vllm_rlt.models.ouro", "OuroConfig", "OuroForCausalLM"),
    "huginn_raven": ("vllm_rlt.models.huginn", "HuginnConfig", "HuginnForCausalLM"),
}


class UnsupportedConfigError(ConfigError):
    """A checkpoint configuration this engine cannot run faithfully."""


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def resolve(model_type: str | None) -> tuple[type, type]:
    """(config class with `from_dict`, model class) for a checkpoint's `model_type`."""
    if model_type not in _MODELS:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported; supported: {supported_model_types()}"
        )
    module, config_cls, model_cls = _MODELS[model_type]
    mod = importlib.import_module(module)
    return getattr(mod, config_cls), getattr(mod, model_cls)
