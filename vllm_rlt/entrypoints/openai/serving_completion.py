"""`POST /v1/completions`: prompts as text or token ids (one or many), n samples each,
legacy-format logprobs, echo, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from vllm_rlt.entrypoints.openai.errors import APIError, engine_error
from vllm_rlt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
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


def _prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [state.encode(prompt)]
    elif prompt and isinstance(prompt[0], str):
        prompts = [state.encode(p) for p in prompt]
    elif prompt and isinstance(prompt[0], list):
        prompts = list(prompt)
    else:
        prompts = [list(prompt)]
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "prompt is empty", param="prompt")
    return prompts


class _Logprobs:
    """Legacy completions logprobs for a range of a choice's tokens; keeps each choice's offset."""

    def __init__(self, state: ServerState, as_ids: bool):
        self.state, self.as_ids = state, as_ids
        self.offset: dict[int, int] = {}

    def build(
        self, index: int, ids: list[int], lps: list[dict[int, float] | None]
    ) -> CompletionLogProbs:
        out = CompletionLogProbs()
        offset = self.offset.get(index, 0)
        name = self.state.token_name
        for i, tok in enumerate(ids):
            text = self.state.token_text(tok)
            out.tokens.append(name(tok, self.as_ids))
            out.text_offset.append(offset)
            offset += len(text)
            entry = lps[i]
            if entry is None:  # the prompt's first token: nothing scores it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(entry[tok])
            top = {name(t, self.as_ids): lp for t, lp in entry.items() if t != tok}
            top[name(tok, self.as_ids)] = entry[tok]  # two ids may decode alike: this one wins
            out.top_logprobs.append(top)
        self.offset[index] = offset
        return out

    def extend(self, a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
        return CompletionLogProbs(
            tokens=a.tokens + b.tokens,
            token_logprobs=a.token_logprobs + b.token_logprobs,
            top_logprobs=a.top_logprobs + b.top_logprobs,
            text_offset=a.text_offset + b.text_offset,
        )


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    state.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream")
    prompts = _prompts(state, req.prompt)
    # echo with logprobs: the prompt's tokens are scored too (evaluation harnesses read them)
    prompt_logprobs = req.logprobs if req.echo else None
    max_tokens = req.max_tokens
    if max_tokens is None:  # the rest of the context after the longest prompt
        max_tokens = max(1, state.max_model_len - max(len(p) for p in prompts))
    params = state.sampling_params(
        max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
        **req.sampling_kwargs(),
    )  # fmt: skip
    request_id = random_id("cmpl")
    sub = await add_all(state, request_id, prompts, params)
    ctx = _Context(state, req, request_id, prompts, params.n)
    if req.stream:
        return StreamingResponse(ctx.stream(sub, raw), media_type="text/event-stream")
    finals: dict[int, RequestOutput] = {}
    outputs = merge(state, sub)
    try:
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
            if await raw.is_disconnected():
                return JSONResponse({}, status_code=499)  # nobody reads it; aborted on close
    except Exception as err:
        raise engine_error(err) from None
    finally:
        await outputs.aclose()
    return ctx.response(finals)


class _Context:
    def __init__(self, state, req: CompletionRequest, request_id, prompts, n):
        self.state, self.req, self.request_id, self.prompts, self.n = (
            state,
            req,
            request_id,
            prompts,
            n,
        )
        self.model = state.served_model_name
        self.logprobs = _Logprobs(state, req.return_tokens_as_token_ids)

    def _prompt_text(self, i: int) -> str:
        p = self.req.prompt
        if isinstance(p, str):
            return p
        if p and isinstance(p[0], str):
            return p[i]
        tok = self.state.tokenizer
        return tok.decode(self.prompts[i], skip_special_tokens=False) if tok else ""

    def _echo_logprobs(self, index: int, i: int, out: RequestOutput) -> CompletionLogProbs | None:
        if not self.req.echo:
            return None
        return self.logprobs.build(index, self.prompts[i], out.prompt_logprobs)

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices, comps = [], []
        for i in range(len(self.prompts)):
            for comp in finals[i].outputs:
                index = i * self.n + comp.index
                text = comp.text
                lp = None
                if self.req.logprobs is not None:
                    head = self._echo_logprobs(index, i, finals[i])
                    lp = self.logprobs.build(index, comp.token_ids, comp.logprobs)
                    lp = self.logprobs.extend(head, lp) if head else lp
                if self.req.echo:
                    text = self._prompt_text(i) + text
                choices.append(_choice(index, text, lp, comp, comp.exit_depths))
                comps.append(comp)
        use = usage([len(p) for p in self.prompts], comps)
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=use)

    async def stream(self, sub: Submission, raw: Request) -> AsyncIterator[str]:
        tracker = DeltaTracker(tuple(self.req.sampling_kwargs()["stop"]))
        comps: dict[int, CompletionOutput] = {}
        depths_sent: dict[int, int] = {}  # choice -> exit depths sent (with its chunks' tokens)
        outputs = merge(self.state, sub)
        try:
            async for i, out in outputs:
                for comp in out.outputs:
                    index = i * self.n + comp.index
                    first = index not in tracker.sent_tokens
                    text, start, end = tracker.delta(index, comp)
                    if comp.finished:
                        comps[index] = comp
                    quiet = start == end or self.req.logprobs is None
                    if not text and quiet and not comp.finished and not first:
                        continue
                    lp = None
                    if self.req.logprobs is not None:
                        head = self._echo_logprobs(index, i, out) if first else None
                        lps = comp.logprobs[start:end] if comp.logprobs else []
                        lp = self.logprobs.build(index, comp.token_ids[start:end], lps)
                        lp = self.logprobs.extend(head, lp) if head else lp
                    if first and self.req.echo:
                        text = self._prompt_text(i) + text
                    depths = comp.exit_depths[depths_sent.get(index, 0) : end]
                    depths_sent[index] = end
                    yield self._chunk([_choice(index, text, lp, comp, depths)])
                if await raw.is_disconnected():
                    return
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                prompt_lens = [len(p) for p in self.prompts]
                yield self._chunk([], usage(prompt_lens, list(comps.values())))
        except Exception as err:
            yield sse(engine_error(err).body())
        finally:
            await outputs.aclose()
        yield SSE_DONE

    def _chunk(self, choices, use=None) -> str:
        return sse(
            CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=use)
        )


def _choice(index, text, lp, comp: CompletionOutput, depths: list[int]) -> CompletionChoice:
    """`depths`: the exit depths of the tokens the choice delivers (a streamed chunk: those
    since the last chunk)."""
    done = comp.finished
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=lp,
        finish_reason=comp.finish_reason,
        stop_reason=comp.stop_reason if done else None,
        exit_depths=depths,
    )
