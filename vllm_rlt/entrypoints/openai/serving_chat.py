"""`POST /v1/chat/completions`: messages rendered with the checkpoint's chat template (ChatML when
it has none), generation stops at `<|im_end|>` (besides EOS); streaming sends the role first,
then content deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from vllm_rlt.entrypoints.openai.chat_template import IM_END
from vllm_rlt.entrypoints.openai.errors import APIError, engine_error
from vllm_rlt.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    random_id,
)
from vllm_rlt.entrypoints.openai.serving_common import (
    SSE_DONE,
    DeltaTracker,
    ServerState,
    Submission,
    add_all,
    merge,
    sse,
    usage,
)
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import MAX_LOGPROBS


def _content(msg: ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for part in msg.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "messages: only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def render_messages(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool
) -> str:
    """The chat prompt of `messages`; 400 for content or roles the template cannot render."""
    plain = [{"role": m.role, "content": _content(m)} for m in messages]
    try:
        return state.chat.render(plain, add_generation_prompt)
    except Exception:  # a template error (e.g. roles it rejects)
        msg = "messages: the chat template cannot render them"
        raise APIError(400, msg, param="messages") from None


def _logprobs(
    state: ServerState, ids: list[int], lps: list[dict[int, float]], num_top: int, as_ids: bool
) -> ChatLogProbs:
    """Per token: the sampled token's logprob and the `num_top` most likely tokens, most likely
    first (the sampled token among them when it is one of them). The engine reports the sampled
    token and the `num_top` most likely, so the first `num_top` by logprob are those. `as_ids`:
    tokens named `token_id:N` (`bytes` stay the token's text)."""

    def entry(tok: int, lp: float) -> ChatTopLogprob:
        text = state.token_text(tok)
        return ChatTopLogprob(
            token=state.token_name(tok, as_ids), logprob=lp, bytes=list(text.encode())
        )

    content = []
    for tok, alts in zip(ids, lps, strict=True):
        ranked = sorted(alts.items(), key=lambda item: -item[1])[:num_top]
        head = entry(tok, alts[tok])
        top = [entry(t, lp) for t, lp in ranked]
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=top))
    return ChatLogProbs(content=content)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    state.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream")
    prompt = render_messages(state, req.messages, add_generation_prompt=True)
    ids = state.encode(prompt, add_special_tokens=False)  # the template writes them (as vLLM)
    kwargs = req.sampling_kwargs()
    im_end = state.tokenizer.token_to_id(IM_END) if state.tokenizer else None
    if im_end is not None:
        kwargs["stop_token_ids"] = (*kwargs["stop_token_ids"], im_end)
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:  # the newer name wins; 0 is a value, not "unset"
        max_tokens = req.max_completion_tokens
        if max_tokens < 1:
            msg = f"max_completion_tokens must be >= 1, got {max_tokens}"
            raise APIError(400, msg, param="max_completion_tokens")
    if max_tokens is None:  # the rest of the context
        max_tokens = max(1, state.max_model_len - len(ids))
    num_top, as_ids = req.top_logprobs or 0, req.return_tokens_as_token_ids
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if not 0 <= num_top <= MAX_LOGPROBS:
        msg = f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {num_top}"
        raise APIError(400, msg, param="top_logprobs")
    logprobs = num_top if req.logprobs else None
    params = state.sampling_params(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    sub = await add_all(state, random_id("chatcmpl"), [ids], params)
    if req.stream:
        return StreamingResponse(_stream(state, req, sub, raw), media_type="text/event-stream")
    final: RequestOutput | None = None
    outputs = merge(state, sub)
    try:
        async for _, out in outputs:
            final = out if out.finished else final
            if await raw.is_disconnected():
                return JSONResponse({}, status_code=499)
    except Exception as err:
        raise engine_error(err) from None
    finally:
        await outputs.aclose()
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatResponseMessage(role="assistant", content=c.text),
            logprobs=_logprobs(state, c.token_ids, c.logprobs, num_top, as_ids)
            if req.logprobs
            else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            exit_depths=c.exit_depths,
        )
        for c in final.outputs
    ]
    return ChatCompletionResponse(
        id=sub.request_id,
        model=state.served_model_name,
        choices=choices,
        usage=usage([len(ids)], final.outputs),
    )


async def _stream(
    state: ServerState, req: ChatCompletionRequest, sub: Submission, raw
) -> AsyncIterator[str]:
    num_top, as_ids = req.top_logprobs or 0, req.return_tokens_as_token_ids

    def chunk(choices, use=None) -> str:
        resp = ChatCompletionResponse(
            id=sub.request_id,
            object="chat.completion.chunk",
            model=state.served_model_name,
            choices=choices,
            usage=use,
        )
        return sse(resp)

    tracker = DeltaTracker(tuple(req.sampling_kwargs()["stop"]))
    finals: dict[int, CompletionOutput] = {}
    depths_sent: dict[int, int] = {}  # choice -> exit depths sent (with its chunks' tokens)
    outputs = merge(state, sub)
    try:
        for i in range(req.n):
            role = ChatResponseMessage(role="assistant", content="")
            yield chunk([ChatStreamChoice(index=i, delta=role)])
        async for _, out in outputs:
            for comp in out.outputs:
                text, start, end = tracker.delta(comp.index, comp)
                if comp.finished:
                    finals[comp.index] = comp
                if not text and not comp.finished and (start == end or not req.logprobs):
                    continue
                lp = None
                if req.logprobs:
                    lps = comp.logprobs[start:end]
                    lp = _logprobs(state, comp.token_ids[start:end], lps, num_top, as_ids)
                delta = ChatResponseMessage(content=text)
                depths = comp.exit_depths[depths_sent.get(comp.index, 0) : end]
                depths_sent[comp.index] = end
                choice = ChatStreamChoice(
                    index=comp.index, delta=delta, logprobs=lp, finish_reason=comp.finish_reason,
                    exit_depths=depths,
                )  # fmt: skip
                yield chunk([choice])
            if await raw.is_disconnected():
                return
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage([len(sub.prompts[0])], list(finals.values())))
    except Exception as err:
        yield sse(engine_error(err).body())
    finally:
        await outputs.aclose()
    yield SSE_DONE
