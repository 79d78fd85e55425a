"""Public results of generation (what `LLM.generate` and the server return)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # detokenized output (a matched stop string is excluded)
    token_ids: list[int]  # generated tokens
    exit_depths: list[int]  # loops behind each token's logits (1..D; the first token reports D)
    # "stop", "length", "abort", "error" (a fault of this request ended it; the engine logged
    # it), or None while running
    finish_reason: str | None
    # per token: {token id: logprob} for the sampled token and the top alternatives
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # SamplingParams.prompt_logprobs: per prompt token, {token id: logprob} for it and the top
    # alternatives (None for the first token, which nothing scores)
    prompt_logprobs: list[dict[int, float] | None] | None = None
