"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming the field for every bad
value (range and type errors alike)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from vllm_rlt.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 1.0, 1.0, 0)
    assert p.seed is None and p.logprobs is None and p.exit_threshold is None
    assert (p.min_loops, p.max_loops) == (None, None)
    assert p.ignore_eos is False and p.stop_token_ids == () and p.stop == ()
    assert not p.is_greedy


def test_normalisation():
    p = SamplingParams(top_k=-1, stop_token_ids=[3, 5], stop="END", temperature=2, top_p=1)
    assert p.top_k == 0
    assert p.stop_token_ids == (3, 5)
    assert p.stop == ("END",)
    assert isinstance(p.temperature, float) and p.temperature == 2.0
    assert isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    hash(p)  # tuples, not lists: the frozen params stay hashable


def test_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy
    assert not SamplingParams(temperature=0.8, top_p=0.1).is_greedy


BAD_VALUES = [
    ("n", 0, "n must be >= 1, got 0"),
    ("n", 1.0, "n must be an int"),
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("max_tokens", -3, "max_tokens must be >= 1, got -3"),
    ("max_tokens", "5", "max_tokens must be an int, got '5'"),
    ("max_tokens", True, "max_tokens must be an int, got True"),
    ("max_tokens", 4.0, "max_tokens must be an int, got 4.0"),
    ("temperature", -0.1, "temperature must be >= 0, got -0.1"),
    ("temperature", math.nan, "temperature must be finite, got nan"),
    ("temperature", math.inf, "temperature must be finite, got inf"),
    ("temperature", "1.0", "temperature must be a number, got '1.0'"),
    ("temperature", False, "temperature must be a number, got False"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
    ("top_p", math.nan, "top_p must be finite, got nan"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\], got -0.1"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
    ("min_p", "0.1", "min_p must be a number, got '0.1'"),
    ("logit_bias", {-1: 1.0}, "logit_bias token ids must be >= 0, got -1"),
    ("logit_bias", {"5": 1.0}, "logit_bias token id must be an int, got '5'"),
    ("logit_bias", {5: 100.5}, r"logit_bias values must be in \[-100, 100\], got 100.5"),
    ("logit_bias", {5: math.nan}, "logit_bias must be finite, got nan"),
    ("logit_bias", {t: 1.0 for t in range(301)}, "logit_bias names at most 300 tokens, got 301"),
    ("logit_bias", 5, "logit_bias must map token ids to biases, got 5"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ("frequency_penalty", -2.1, r"frequency_penalty must be in \[-2, 2\], got -2.1"),
    ("frequency_penalty", math.inf, "frequency_penalty must be finite, got inf"),
    ("repetition_penalty", 0, r"repetition_penalty must be in \[0.001, 1000\], got 0.0"),
    ("repetition_penalty", 1e39, r"repetition_penalty must be in \[0.001, 1000\], got 1e\+39"),
    ("repetition_penalty", True, "repetition_penalty must be a number, got True"),
    ("top_k", -2, "top_k must be -1, 0 .* got -2"),
    ("top_k", 2.5, "top_k must be an int, got 2.5"),
    ("seed", 1.5, "seed must be an int, got 1.5"),
    ("seed", "7", "seed must be an int, got '7'"),
    ("seed", 2**63, rf"seed must be in \[0, 2\*\*63 - 1 - \(n - 1\)\] .* got {2**63}"),
    ("seed", -1, "seed must be in .* got -1 with n=1"),
    ("min_loops", 0, "min_loops must be >= 1, got 0"),
    ("max_loops", 0, "max_loops must be >= 1, got 0"),
    ("max_loops", 2.0, "max_loops must be an int, got 2.0"),
    ("exit_threshold", 1.2, r"exit_threshold must be in \[0, 1\], got 1.2"),
    ("exit_threshold", -0.5, r"exit_threshold must be in \[0, 1\], got -0.5"),
    ("exit_threshold", math.nan, "exit_threshold must be finite, got nan"),
    ("init_scale", -0.5, "init_scale must be >= 0, got -0.5"),
    ("init_scale", math.inf, "init_scale must be finite, got inf"),
    ("init_scale", "1", "init_scale must be a number, got '1'"),
    ("ignore_eos", 1, "ignore_eos must be a bool, got 1"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of int, got 5"),
    ("stop_token_ids", "12", "stop_token_ids must be a list of int, got '12'"),
    ("stop_token_ids", [1, True], "stop_token_ids must be an int, got True"),
    ("stop_token_ids", [1, -4], "stop_token_ids must hold ids >= 0, got -4"),
    ("stop", [""], "stop must hold non-empty strings, got ''"),
    ("stop", "", "stop must hold non-empty strings, got ''"),
    ("stop", ["a", 3], "stop must hold non-empty strings, got 3"),
    ("stop", 3, "stop must be a str or a list of str, got 3"),
    (
        "stop",
        ["ok", "a\ud800"],
        "stop is not valid Unicode: a lone surrogate '\\\\ud800' at character 1",
    ),
    ("logprobs", -1, r"logprobs must be in \[0, 20\], got -1"),
    ("logprobs", 21, r"logprobs must be in \[0, 20\], got 21"),
    ("logprobs", True, "logprobs must be an int, got True"),
    ("prompt_logprobs", 21, r"prompt_logprobs must be in \[0, 20\], got 21"),
    ("prompt_logprobs", 1.5, "prompt_logprobs must be an int, got 1.5"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_VALUES)
def test_bad_value_names_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_every_field_has_a_bad_value_case():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == {field for field, _, _ in BAD_VALUES}


def test_accepts_edge_values():
    p = SamplingParams(
        temperature=0,
        top_p=1e-9,
        top_k=1,
        min_p=1,
        logit_bias={7: -100, 3: 100.0},
        seed=2**63 - 1,
        min_loops=2,
        max_loops=2,
        exit_threshold=0,
        logprobs=20,
    )
    assert p.exit_threshold == 0.0 and p.logprobs == 20 and p.seed == 2**63 - 1
    assert p.logit_bias == ((3, 100.0), (7, -100.0)) and hash(p)  # sorted pairs: hashable
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(exit_threshold=1, logprobs=0).exit_threshold == 1.0
    assert SamplingParams(n=3, seed=2**63 - 3).seed == 2**63 - 3  # the last sample's seed fits


def test_every_samples_seed_fits_in_int64():
    with pytest.raises(ValueError, match=rf"seed must be .* got {2**63 - 1} with n=2"):
        SamplingParams(n=2, seed=2**63 - 1)


def test_min_loops_above_max_loops():
    with pytest.raises(ValueError, match="min_loops must be <= max_loops, got min_loops=3 and "):
        SamplingParams(min_loops=3, max_loops=2)


def test_validate_for_model():
    SamplingParams(min_loops=1, max_loops=4, top_k=96, logprobs=20).validate_for_model(4, 96)
    SamplingParams().validate_for_model(1, 2)
    with pytest.raises(ValueError, match=r"max_loops must be in \[1, 4\] .*, got 5"):
        SamplingParams(max_loops=5).validate_for_model(4, 96)
    with pytest.raises(ValueError, match=r"min_loops must be in \[1, 3\] .*, got 4"):
        SamplingParams(min_loops=4).validate_for_model(3, 96)
    with pytest.raises(ValueError, match=r"top_k must be -1, 0 \(off\) or in \[1, 96\] .*, got 97"):
        SamplingParams(top_k=97).validate_for_model(4, 96)
    with pytest.raises(ValueError, match=r"top_k .* got 9223372036854775808"):
        SamplingParams(top_k=2**63).validate_for_model(4, 96)
    with pytest.raises(ValueError, match="logprobs must be at most 16 .*, got 17"):
        SamplingParams(logprobs=17).validate_for_model(4, 16)
    with pytest.raises(ValueError, match=r"stop_token_ids has ids outside .* \[0, 96\): \[96\]"):
        SamplingParams(stop_token_ids=[95, 96]).validate_for_model(4, 96)
