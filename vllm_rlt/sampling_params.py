"""Per-request sampling and looping options (frozen, validated on construction).

Names and defaults follow vLLM's `SamplingParams`. Every bad value raises `ValueError` naming the
field and the value. What depends on the model (the loop bounds against its depth, top_k and
logprobs against its vocabulary) is checked later, by the engine, through `validate_for_model`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20  # most top alternatives a request may ask for (vLLM's default max_logprobs)
GREEDY_TEMPERATURE_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
SEED_MAX = 2**63 - 1  # seeds are int64 on the device; every sample's seed (seed + i) fits
MAX_LOGIT_BIAS = 300  # most tokens a request's logit_bias may name
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (OpenAI's range)
# repetition_penalty's range: vLLM takes any value > 0; these bounds keep the division and the
# product of a float32 logit finite (a larger one bans repeats no more than 1000 does)
REPETITION_RANGE = (1e-3, 1e3)


def _int(name: str, value: Any) -> int:
    """`value` as a plain int; bools, floats and strings are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _float(name: str, value: Any) -> float:
    """`value` as a finite float; ints are accepted, bools, strings and NaN/inf are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_text(name: str, text: str) -> None:
    """Raise ValueError unless `text` is a sequence of Unicode scalar values (a lone surrogate,
    such as JSON's "\\ud800", is not: no tokenizer or UTF-8 encoder accepts it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} is not valid Unicode: a lone surrogate {text[err.start]!r} at character "
            f"{err.start}"
        ) from None


def _at_least(name: str, value: Any, low: int) -> int:
    value = _int(name, value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a str or a list of str, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must hold non-empty strings, got {item!r} in {value!r}")
        check_text("stop", item)
    return tuple(items)


def _token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of int, got {value!r}")
    ids = tuple(_int("stop_token_ids", item) for item in value)
    for item in ids:
        if item < 0:
            raise ValueError(f"stop_token_ids must hold ids >= 0, got {item} in {value!r}")
    return ids


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...] | None:
    """A {token id: bias} map (or (id, bias) pairs) as pairs sorted by id; None if empty."""
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}")
    pairs = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {item!r}")
        token, bias = _int("logit_bias token id", item[0]), _float("logit_bias", item[1])
        if token < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
        if abs(bias) > LOGIT_BIAS_LIMIT:
            raise ValueError(
                f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got "
                f"{bias} for token {token}"
            )
        pairs[token] = bias
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias names at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    return tuple(sorted(pairs.items())) or None


def penalized(params) -> bool:
    """Whether settings with penalty fields (SamplingParams, NewRequestData) turn one on."""
    return bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    )


def samples_greedily(temperature: float, top_k: int) -> bool:
    """Whether these settings reduce sampling to argmax (temperature below 1e-5, or top_k == 1)."""
    return temperature < GREEDY_TEMPERATURE_EPS or top_k == 1


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions to return for the prompt (>= 1)
    max_tokens: int = 16  # most tokens to generate per completion (>= 1)
    temperature: float = 1.0  # softmax temperature (>= 0); 0 (below 1e-5) samples greedily
    top_p: float = 1.0  # nucleus: keep the fewest top tokens whose mass reaches top_p; 1 = off
    # keep the k most likely tokens; 0 = off (-1 is accepted and stored as 0); the engine checks
    # k against the vocabulary
    top_k: int = 0
    # min-p: keep the tokens whose probability (after temperature) is at least min_p times the
    # most likely token's; 0 = off
    min_p: float = 0.0
    # {token id: bias} added to the logits before sampling (greedy too), each in [-100, 100],
    # at most 300 tokens; stored as (id, bias) pairs sorted by id. Logprobs stay the raw ones
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    # penalties (vLLM's, after the logit bias): presence subtracts presence_penalty from the
    # logit of every token the output holds, frequency frequency_penalty times its count (each
    # in [-2, 2], OpenAI's range); repetition divides the positive logits of tokens in the
    # prompt or the output by repetition_penalty (in [0.001, 1000]) and multiplies the negative
    # ones. Off: 0, 0, 1. A request with penalties does not speculate
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # sample i's seed is seed + i, in [0, 2**63 - 1]; None = drawn
    min_loops: int | None = None  # fewest loops a decode token runs before it may exit; None = 1
    # most loops a decode token runs (Huginn: every position, prompt included); None = depth
    max_loops: int | None = None
    exit_threshold: float | None = None  # exit when cumulative exit prob >= this; None = config
    # Huginn: scale of the random initial recurrent state (0 = zero state); None = the engine's
    init_scale: float | None = None
    ignore_eos: bool = False  # keep generating after the EOS token
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation (a list is ok)
    stop: tuple[str, ...] = ()  # strings that end generation, not included in the output
    logprobs: int | None = None  # top alternatives returned per token besides the sampled one
    # per prompt token after the first: its logprob and this many top alternatives (computed
    # at full depth, where the prompt runs; the request skips the prefix cache)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        fix = self._fix
        fix("n", _at_least("n", self.n, 1))
        fix("max_tokens", _at_least("max_tokens", self.max_tokens, 1))

        temperature = _float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        fix("temperature", temperature)

        top_p = _float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        fix("top_p", top_p)

        min_p = _float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        fix("min_p", min_p)

        if self.logit_bias is not None:
            fix("logit_bias", _logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            fix(name, value)
        repetition = _float("repetition_penalty", self.repetition_penalty)
        if not REPETITION_RANGE[0] <= repetition <= REPETITION_RANGE[1]:
            raise ValueError(
                f"repetition_penalty must be in [{REPETITION_RANGE[0]:g}, "
                f"{REPETITION_RANGE[1]:g}], got {repetition}"
            )
        fix("repetition_penalty", repetition)

        top_k = _int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {top_k}")
        fix("top_k", max(top_k, 0))

        if self.seed is not None:
            seed = _int("seed", self.seed)
            if not 0 <= seed <= SEED_MAX - (self.n - 1):
                raise ValueError(
                    f"seed must be in [0, 2**63 - 1 - (n - 1)] (sample i uses seed + i), got "
                    f"{seed} with n={self.n}"
                )
            fix("seed", seed)

        for name in ("min_loops", "max_loops"):
            if getattr(self, name) is not None:
                fix(name, _at_least(name, getattr(self, name), 1))
        bounded = self.min_loops is not None and self.max_loops is not None
        if bounded and self.min_loops > self.max_loops:
            raise ValueError(
                f"min_loops must be <= max_loops, got min_loops={self.min_loops} "
                f"and max_loops={self.max_loops}"
            )

        if self.exit_threshold is not None:
            threshold = _float("exit_threshold", self.exit_threshold)
            if not 0 <= threshold <= 1:
                raise ValueError(f"exit_threshold must be in [0, 1], got {threshold}")
            fix("exit_threshold", threshold)

        if self.init_scale is not None:
            init_scale = _float("init_scale", self.init_scale)
            if init_scale < 0:
                raise ValueError(f"init_scale must be >= 0, got {init_scale}")
            fix("init_scale", init_scale)

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        fix("stop_token_ids", _token_ids(self.stop_token_ids))
        fix("stop", _stop_strings(self.stop))

        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = _int(name, getattr(self, name))
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
                fix(name, value)

    def _fix(self, name: str, value: Any) -> None:
        """Store a normalised value on the frozen instance (only from __post_init__)."""
        object.__setattr__(self, name, value)

    @property
    def penalized(self) -> bool:
        """Whether some penalty is on (its logits depend on the tokens before)."""
        return penalized(self)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0, or below 1e-5, or top_k == 1)."""
        return samples_greedily(self.temperature, self.top_k)

    def validate_for_model(self, num_loops: int, vocab_size: int) -> None:
        """Check what depends on the model: the loop bounds against its depth D = `num_loops`
        (each in [1, D]); `top_k`, `logprobs` and `stop_token_ids` against its vocabulary."""
        if self.top_k > vocab_size:
            raise ValueError(
                f"top_k must be -1, 0 (off) or in [1, {vocab_size}] (the vocabulary), got "
                f"{self.top_k}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(
                    f"{name} must be at most {vocab_size} (the vocabulary), got {value}"
                )
        outside = [t for t, _ in self.logit_bias or () if t >= vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}"
            )
        outside = [t for t in self.stop_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(
                f"stop_token_ids has ids outside the vocabulary [0, {vocab_size}): {outside[:5]}"
            )
        for name in ("min_loops", "max_loops"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= num_loops:
                raise ValueError(
                    f"{name} must be in [1, {num_loops}] (the model's depth), got {value}"
                )
