"""What completions and chat share: the server state, reading a request body, turning a request
into SamplingParams, running several engine streams at once (metrics and request log lines
included), and streaming text deltas."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from tokenizers import Tokenizer

from vllm_rlt.engine.async_engine import AsyncLLMEngine, RequestStream
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer
from vllm_rlt.entrypoints.openai.errors import APIError, bad_request, engine_error
from vllm_rlt.entrypoints.openai.metrics import ServerMetrics
from vllm_rlt.entrypoints.openai.server_log import log_finished, log_received
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import SamplingParams, check_text


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_name: str
    api_key: str | None
    max_body_bytes: int
    metrics: ServerMetrics
    chat: ChatRenderer
    max_n: int
    body_read_timeout: float
    log_requests: bool  # a log line when each request arrives and when it ends

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.served_model_name!r}",
                param="model",
            )

    def sampling_params(self, **kwargs: Any) -> SamplingParams:
        """A request's SamplingParams; 400 naming the field for a bad value or n above max_n."""
        n = kwargs.get("n", 1)
        if isinstance(n, int) and n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} (--max-n), got {n}", param="n")
        try:
            return SamplingParams(**kwargs)
        except ValueError as err:
            raise bad_request(str(err)) from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("prompt: text needs a tokenizer; this model has none, pass token ids")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token_id: int) -> str:
        tok = self.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else ""

    def token_name(self, token_id: int, as_id: bool) -> str:
        """How a logprobs entry names a token: its text, or `token_id:N` with vLLM's
        `return_tokens_as_token_ids` (exact, and defined without a tokenizer)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)


async def read_json(
    request: Request, model: type[BaseModel], max_bytes: int, timeout_s: float
) -> Any:
    """The body parsed into `model`; 415 unless it is declared JSON, 413 above `max_bytes`, 408
    (and the connection closed) unless the whole body arrives within `timeout_s`, 400 for bad JSON
    (nested deeper than MAX_JSON_DEPTH, strings that are not valid Unicode) or fields."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        msg = f"the request body must be application/json (Content-Type: {shown})"
        raise APIError(415, msg)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body exceeds {max_bytes} bytes")
    try:
        body = await asyncio.wait_for(_read_body(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        msg = f"the request body did not arrive within {timeout_s:g} s"
        raise APIError(408, msg, headers={"Connection": "close"}) from None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_json(data)
    try:
        return model.model_validate(data)
    except Exception as err:  # pydantic.ValidationError
        errors = getattr(err, "errors", lambda: [])()
        if not errors:
            raise APIError(400, "invalid request") from None
        first = errors[0]
        loc = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        msg = first["msg"].removeprefix("Value error, ")  # (a validator's own message)
        raise APIError(400, f"{loc}: {msg}", param=param) from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


MAX_JSON_DEPTH = 32  # nesting of objects and arrays a request body may have
_TOO_DEEP = f"the request body is nested deeper than {MAX_JSON_DEPTH} levels"


def _check_json(data: dict) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH or a string (key or value) that is not valid
    Unicode, naming where it is (`messages.0.content`; a key is checked before its value, so a
    path never holds an invalid one)."""
    stack: list[tuple[str, Any, int]] = [("", data, 1)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, str):
            _check_text_at(path, value)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, _TOO_DEEP)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text_at(f"a key in {path or 'the request body'}", key, param=path)
            stack.append((f"{path}.{key}" if path else str(key), item, depth + 1))


def _check_text_at(name: str, text: str, param: str | None = None) -> None:
    try:
        check_text(name, text)
    except ValueError as err:
        field = (name if param is None else param).split(".", 1)[0]
        raise APIError(400, str(err), param=field or None) from None


@dataclass
class Submission:
    """The engine requests of one API request: one stream per prompt, `params.n` samples each."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    streams: list[RequestStream]


async def add_all(
    state: ServerState, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> Submission:
    """Add one engine request per prompt (ids `request_id-i`); on an error abort the added ones.
    A request whose samples (prompts x n) could never all wait at once is a 400, not a 429."""
    limit = state.engine.max_waiting_requests
    if limit is not None and len(prompts) * params.n > limit:
        param = "n" if len(prompts) == 1 else "prompt"
        msg = (f"{param}: {len(prompts)} prompt(s) x n={params.n} samples exceed the server's "
               f"max_waiting_requests ({limit})")  # fmt: skip
        raise APIError(400, msg, param=param)
    if state.log_requests:
        log_received(request_id, prompts, params)
    streams = []
    try:
        for i, ids in enumerate(prompts):
            streams.append(await state.engine.add_request(f"{request_id}-{i}", ids, params))
    except BaseException as err:
        for s in streams:
            s.close()
        if isinstance(err, Exception):
            raise engine_error(err) from None
        raise
    return Submission(request_id, prompts, params, streams)


async def merge(state: ServerState, sub: Submission) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from the streams of `sub` as they come, observed by the metrics;
    closing aborts the unfinished (and logs the end of the request)."""
    queue: asyncio.Queue = asyncio.Queue()
    start = time.monotonic()
    last: list[RequestOutput | None] = [None] * len(sub.streams)

    async def pump(i: int, stream) -> None:
        try:
            async for out in state.metrics.track(stream, len(sub.prompts[i]), sub.params.n):
                last[i] = out
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as err:
            await queue.put((i, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sub.streams)]
    try:
        remaining = len(sub.streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in sub.streams:
            s.close()
        if state.log_requests:
            log_finished(sub.request_id, last, sub.params.n, start)


class DeltaTracker:
    """Per choice: the text and tokens already sent while streaming. While a choice runs, the last
    `len(longest stop) - 1` characters are held back, as they may turn out to start a stop string
    (the engine then cuts the text before it)."""

    def __init__(self, stops: tuple[str, ...]):
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}

    def delta(self, index: int, comp: CompletionOutput) -> tuple[str, int, int]:
        """(new text, first new token, end of new tokens) for choice `index`."""
        text_from = self.sent_text.get(index, 0)
        end = len(comp.text) if comp.finished else max(len(comp.text) - self.holdback, text_from)
        tok_from = self.sent_tokens.get(index, 0)
        self.sent_text[index] = end
        self.sent_tokens[index] = len(comp.token_ids)
        return comp.text[text_from:end], tok_from, len(comp.token_ids)


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(exclude_none=False)
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_lens: list[int], outputs: list[CompletionOutput]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
