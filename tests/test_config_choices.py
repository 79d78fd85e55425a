"""Enumerated settings: one list of valid values per setting (the field's `choices`), which
construction checks and the layers that implement the values agree with."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_rlt import config, config_sched
from vllm_rlt.config import SECTIONS, ConfigError, EngineConfig

EXPECTED = {
    "dtype": config.DTYPE_NAMES,
    "load_format": config.LOAD_FORMATS,
    "attention_backend": config.ATTENTION_BACKENDS,
    "layer_kernels": config.LAYER_KERNELS,
    "kv_layout": config.KV_LAYOUTS,
    "kv_cache_dtype": config.KV_CACHE_DTYPES,
    "scheduling_mode": config_sched.SCHEDULING_MODES,
    "queue_policy": config_sched.QUEUE_POLICIES,
    "exit_mode": config_sched.EXIT_MODES,
}


def _choices() -> dict[str, tuple[str, ...]]:
    return {
        f.name: f.metadata["choices"]
        for cls in SECTIONS.values()
        for f in dataclasses.fields(cls)
        if "choices" in f.metadata
    }


def test_every_enumerated_setting_has_its_choices_and_its_default_among_them():
    assert _choices() == EXPECTED
    defaults = EngineConfig()
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(defaults, section)):
            if f.name in EXPECTED:
                assert f.default in EXPECTED[f.name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_value_outside_the_choices_fails_naming_the_setting(name):
    with pytest.raises(ConfigError, match=f"{name} must be one of .* got 'bogus'"):
        EngineConfig.from_kwargs(**{name: "bogus"})


def test_the_implementations_accept_exactly_the_choices():
    from vllm_rlt.attention.backend import _BACKENDS
    from vllm_rlt.engine.kv_sizing import KV_DTYPES
    from vllm_rlt.models.layer_kernels import _STRATEGIES
    from vllm_rlt.models.loader import DTYPES

    assert {"auto", *_BACKENDS} == set(config.ATTENTION_BACKENDS)
    assert {"auto", *_STRATEGIES} == set(config.LAYER_KERNELS)
    assert {"auto", *DTYPES} == set(config.DTYPE_NAMES)
    assert {"auto", *KV_DTYPES} == set(config.KV_CACHE_DTYPES)


def test_every_setting_without_a_default_value_says_what_unset_means():
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            if f.name != "model" and f.default is None:
                assert "default" in f.metadata["help"], f.name
