"""Pydantic models of the OpenAI-compatible API (requests validated strictly, responses built
from plain fields). Looped-model extensions: `min_loops`, `max_loops`, `exit_threshold`, and
Huginn's `init_scale`; vLLM's `return_tokens_as_token_ids` (logprob tokens as `token_id:N`)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; unknown fields are ignored like OpenAI's
    model_config = ConfigDict(strict=True, extra="ignore")


# Fields of OpenAI's and vLLM's requests that this server does not implement, with the values
# that ask for nothing (clients send some of them by default): any other value is a 400 that
# names the field, where ignoring it would serve the request as if it had not been asked.
_NOT_IMPLEMENTED = {
    "min_tokens": (0,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
}


def _refuse(name: str, value: Any, neutral: tuple) -> None:
    """A ValueError naming the field unless `value` is None or one of its `neutral` values (a
    bool matches only a bool: False is not 0)."""
    if value is None or any(
        value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral
    ):
        return
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    takes = " or ".join(repr(v) for v in (None, *neutral))
    raise ValueError(f"{name}={shown} is not supported by this server (it takes {takes})")


def _unimplemented(base: type[BaseModel], neutral: dict[str, tuple]) -> type[BaseModel]:
    """`base` with a field per name of `neutral` (any JSON, default None) that refuses every
    value but None and the name's neutral ones (`_refuse`)."""

    def refuse(cls, value: Any, info: ValidationInfo) -> Any:
        _refuse(info.field_name, value, neutral[info.field_name])
        return value

    name = f"{base.__name__.lstrip('_')}Unimplemented"
    return create_model(
        name,
        __base__=base,
        # (named after the model: a subclass's validator of the same name would replace it)
        __validators__={f"refuse_{name}": field_validator(*neutral)(refuse)},
        **{field: (Any, None) for field in neutral},
    )


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_unimplemented(_Request, _NOT_IMPLEMENTED)):
    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None  # {token id (a decimal string): bias}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # (vLLM's)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    init_scale: float | None = None
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" (vLLM's)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        """The keys as token ids (SamplingParams checks the ids and biases)."""
        if value is None:
            return None
        bad = [k for k in value if not k.isdecimal()]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids, got {bad[0]!r}")
        return {int(k): v for k, v in value.items()}

    def sampling_kwargs(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            logit_bias=self.logit_bias,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_loops=self.min_loops,
            max_loops=self.max_loops,
            exit_threshold=self.exit_threshold,
            init_scale=self.init_scale,
        )


class CompletionRequest(_unimplemented(_SamplingFields, {"suffix": ("",)})):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # None: the rest of the context after the longest prompt
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # accepted where it equals n (one completion per sample)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            msg = f"best_of={value} is not supported by this server (it takes None or n={n})"
            raise ValueError(msg)
        return value


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(
    _unimplemented(_SamplingFields, {"response_format": ({"type": "text"},)})
):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Any = None
    tools: Any = None

    @field_validator("tools")
    @classmethod
    def _no_tool_calls(cls, value: Any, info: ValidationInfo) -> Any:
        """Tools are refused unless tool_choice is "none": this server parses no tool calls."""
        if value and info.data.get("tool_choice") != "none":
            raise ValueError(
                "tools are not supported by this server (it parses no tool calls) unless "
                'tool_choice is "none"'
            )
        return value


class TokenizeRequest(_Request):
    """`prompt` (text), or chat `messages` rendered with the chat template (vLLM's shapes)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True  # messages: end with the assistant's turn
    return_token_strs: bool = False  # also return each token's text


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] | None = None  # extension: loops behind each generated token


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    exit_depths: list[int] | None = None  # extension: loops behind the chunk's new tokens


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice] | list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm-rlt"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
