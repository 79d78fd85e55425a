"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): a prompt, or chat messages rendered
as `/v1/chat/completions` renders them, to token ids, and token ids back to text."""

from __future__ import annotations

from vllm_rlt.entrypoints.openai.errors import APIError
from vllm_rlt.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm_rlt.entrypoints.openai.serving_chat import render_messages
from vllm_rlt.entrypoints.openai.serving_common import ServerState


def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "prompt: give either prompt or messages", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = state.encode(req.prompt, add_special_tokens=special)
    else:
        prompt = render_messages(state, req.messages, req.add_generation_prompt)
        ids = state.encode(prompt, add_special_tokens=bool(req.add_special_tokens))
    strs = [state.token_text(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(req.model)
    if state.tokenizer is None:
        raise APIError(400, "tokens: this model has no tokenizer", param="tokens")
    vocab_size = state.engine.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        msg = f"tokens: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        raise APIError(400, msg, param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, skip_special_tokens=False))
