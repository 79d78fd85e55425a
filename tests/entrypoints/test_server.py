"""The OpenAI-compatible server, over real HTTP (uvicorn in a thread) with the official client."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import (
    openai_client,
    read_metrics,
    tiny_engine,
    tiny_server,
    wait_idle,
)
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

MODEL = "tiny-test"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("server") / "tiny", seed=3)


@pytest.fixture(scope="module")
def server(model_dir):
    # 256 blocks of 4 positions over 4 planes: 256 positions
    with tiny_server(model_dir, MODEL, KEY, max_body_bytes=4096) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def _create(client, **kw):
    """A completion; the vLLM-style extensions travel in extra_body."""
    names = ("ignore_eos", "min_loops", "max_loops", "exit_threshold", "top_k")
    extra = {k: kw.pop(k) for k in names if k in kw}
    return client.completions.create(model=MODEL, extra_body=extra or None, **kw)


def _stream_completion(client, depths=None, **kw):
    """(text, logprob tokens, finish reason) per choice and the usage of a streamed completion;
    `depths` (a dict) gets each choice's exit depths, joined over its chunks."""
    text, tokens, finish, usage = {}, {}, {}, None
    for chunk in _create(client, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if depths is not None:
                depths.setdefault(c.index, []).extend(c.exit_depths)
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return text, tokens, finish, usage


def _metrics(server) -> dict[str, float]:
    return read_metrics(server.url)


def _wait_idle(server) -> None:
    wait_idle(server.engine)


# ---- completions -----------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_completion_stream_matches_non_stream(client, sampling):
    kw = dict(prompt="def fib(n):", max_tokens=8, logprobs=1, ignore_eos=True, **sampling)
    full = _create(client, **kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 8
    assert full.usage.completion_tokens == 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    depths = {}
    text, tokens, finish, usage = _stream_completion(
        client, depths, stream_options={"include_usage": True}, **kw
    )
    assert text[0] == choice.text
    assert depths[0] == choice.exit_depths and len(depths[0]) == 8  # each chunk its tokens'
    assert tokens[0] == choice.logprobs.tokens
    assert finish == {0: "length"}
    assert usage.completion_tokens == 8 and usage.prompt_tokens == full.usage.prompt_tokens


def test_n_samples_with_seed_are_reproducible(client):
    kw = dict(prompt="import os", max_tokens=6, n=2, seed=11, temperature=1.0, ignore_eos=True)
    a, b = _create(client, **kw), _create(client, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12
    depths = {}
    text, _, finish, _ = _stream_completion(client, depths, **kw)
    assert text == {c.index: c.text for c in a.choices}
    assert depths == {c.index: c.exit_depths for c in a.choices}
    assert finish == {0: "length", 1: "length"}


def test_stop_string_cuts_text(client):
    kw = dict(prompt="class A:", max_tokens=12, temperature=0, ignore_eos=True)
    base = _create(client, **kw).choices[0].text
    stop = base[4:6]
    assert stop.strip("\ufffd"), f"unusable generation {base!r}"
    want = base[: base.find(stop)]
    out = _create(client, stop=[stop, "never-seen-stop"], **kw).choices[0]
    assert out.text == want and out.finish_reason == "stop"
    depths = {}
    text, _, finish, _ = _stream_completion(client, depths, stop=stop, **kw)
    assert text[0] == want and finish[0] == "stop" and depths[0] == out.exit_depths


def test_token_id_prompts_logprobs_and_echo(client, server):
    tok = server.engine.tokenizer
    ids = [tok.encode("def f(x):").ids, tok.encode("return x").ids]
    out = _create(client, prompt=ids, max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert out.usage.completion_tokens == 8
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(1 <= len(top) <= 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    offsets = [o - len(t) for o, t in zip(lp.text_offset[1:], lp.tokens, strict=False)]
    assert offsets == lp.text_offset[:-1]
    single = _create(client, prompt=ids[0], max_tokens=4, temperature=0, ignore_eos=True)
    assert single.choices[0].text == out.choices[0].text
    echo = _create(client, prompt="def f(x):", echo=True, max_tokens=4, temperature=0,
                   ignore_eos=True)  # fmt: skip
    assert echo.choices[0].text == "def f(x):" + out.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, server, model_dir):
    """lm-evaluation-harness's loglikelihood request (`local-completions`): the context and the
    continuation as one prompt, max_tokens 1, echo, logprobs 1, temperature 0. Every prompt
    token but the first has its logprob and top alternative (the greedy check), the engine's
    own prompt scoring."""
    tok = server.engine.tokenizer
    ids = tok.encode("def f(x): return x + 1").ids
    out = _create(client, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    offline = tiny_engine(model_dir)  # the same scoring offline
    offline.add_request("x", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    want = offline.generate_all()[0].prompt_logprobs
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - want[p][ids[p]]) < 1e-5


# ---- chat ------------------------------------------------------------------------------------
def test_chat_stream_matches_non_stream(client, server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=6, seed=5, temperature=0.8)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0]
    assert msg.message.role == "assistant" and msg.finish_reason in ("length", "stop")
    prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    prompt += "<|im_start|>assistant\n"
    assert full.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt).ids)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.message.content
    depths = [d for c in chunks if c.choices for d in c.choices[0].exit_depths or ()]
    assert depths == msg.exit_depths and len(depths) == full.usage.completion_tokens
    assert chunks[-1].choices[0].finish_reason == msg.finish_reason


def test_chat_stops_at_im_end_and_passes_loop_bounds(client, server, monkeypatch):
    seen = []
    add = server.engine.add_request

    def spy(request_id, prompt, params, **kw):
        seen.append(params)
        return add(request_id, prompt, params, **kw)

    monkeypatch.setattr(server.engine, "add_request", spy)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        max_tokens=5,
        temperature=0,
        extra_body={"min_loops": 2, "max_loops": 3, "exit_threshold": 0.5, "stop_token_ids": [7]},
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    assert all(2 <= d <= 4 for d in out.choices[0].exit_depths)
    im_end = server.engine.tokenizer.token_to_id("<|im_end|>")
    (params,) = seen
    assert params.stop_token_ids == (7, im_end)
    assert (params.min_loops, params.max_loops, params.exit_threshold) == (2, 3, 0.5)
    assert params.max_tokens == 5


# ---- models, health ------------------------------------------------------------------------
def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


# ---- errors ----------------------------------------------------------------------------------
def _post(server, body, path="/v1/completions", headers=AUTH, content_type="application/json"):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body).encode()
    if content_type is not None:
        headers = {**headers, "Content-Type": content_type}
    return httpx.post(server.url + path, content=content, headers=headers)


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "PayloadTooLargeError",
               415: "UnsupportedMediaTypeError"}  # fmt: skip


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> str:
    """The OpenAI error shape with the right status and type, a message that names the problem
    (param, where the problem is one field), and the server still answering a normal request."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ERROR_TYPES[status] and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"] and ".py" not in err["message"]
    if param is not None:
        assert err["param"] == param and param in err["message"]
    url = resp.request.url
    normal = {"prompt": "ok", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    ok = httpx.post(
        f"{url.scheme}://{url.host}:{url.port}/v1/completions", json=normal, headers=AUTH
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    return err["message"]


BAD_COMPLETIONS = [
    ({"max_tokens": 4}, "prompt"),  # missing prompt
    ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),  # ill-typed
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "min_loops": 5}, "min_loops"),  # the tiny model has depth 4
    ({"prompt": "x", "min_loops": 3, "max_loops": 2}, "min_loops"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 999999]}, "prompt"),  # out of the vocabulary
    ({"prompt": "x", "max_tokens": 2000}, None),  # beyond the model's 1024 positions
    ({"prompt": "x", "max_tokens": 400}, None),  # beyond max_model_len (the KV cache's 256 + 1)
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
    ({"prompt": "a", "max_tokens": 2, "top_k": 2**63}, "top_k"),  # once killed the engine
    ({"prompt": "a", "top_k": 513}, "top_k"),  # the tiny vocabulary has 512 tokens
    ({"prompt": "a", "top_k": -2}, "top_k"),
    # n = 2 gives the second sample seed + 1, beyond int64 (once killed the engine)
    ({"prompt": "a", "max_tokens": 2, "temperature": 0, "seed": 2**63 - 1, "n": 2}, "seed"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "seed": 2**64}, "seed"),
    ({"prompt": "a", "n": 17}, "n"),  # above --max-n (16)
    ({"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate
    ({"prompt": ["ok", "\udfff"]}, "prompt"),
    ({"prompt": "a", "stop": ["\ud800"]}, "stop"),
    ({"prompt": "a", "user": "\ud800"}, "user"),
    ({"prompt": "a", "\ud800": 1}, None),  # in a key
    ({"prompt": "a", "stop_token_ids": [3, 2**70]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(server, body, param):
    _assert_error(_post(server, body), 400, param)


def test_requests_beyond_max_model_len_are_400_naming_both_numbers(server):
    """The KV cache's 256 positions per request cap max_model_len at 257 (the model has 1024);
    /v1/models reports that limit and a longer request is a 400 giving both numbers."""
    card = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
    assert card["max_model_len"] == 257
    message = _assert_error(_post(server, {"prompt": [5], "max_tokens": 300}), 400)
    assert "prompt (1 tokens) + max_tokens (300) = 301 exceeds max_model_len (257)" in message
    content = " ".join(str(i) for i in range(400))
    assert len(server.engine.tokenizer.encode(content).ids) > 257
    chat = {"messages": [{"role": "user", "content": content}]}
    message = _assert_error(_post(server, chat, "/v1/chat/completions"), 400)
    assert "exceeds max_model_len (257)" in message


def test_error_statuses(server, client):
    assert "JSON" in _assert_error(_post(server, b"{not json"), 400)
    _assert_error(_post(server, b"[1, 2]"), 400)
    _assert_error(_post(server, {"messages": []}, "/v1/chat/completions"), 400)
    _assert_error(_post(server, {"messages": [{"content": "x"}]}, "/v1/chat/completions"), 400)
    chat = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    _assert_error(_post(server, chat, "/v1/chat/completions"), 400, "top_logprobs")
    _assert_error(_post(server, {"prompt": "x", "model": "gpt-9"}), 404, "model")
    _assert_error(_post(server, {"prompt": "x"}, headers={}), 401)
    _assert_error(_post(server, {"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    _assert_error(httpx.get(server.url + "/v1/models"), 401)
    _assert_error(_post(server, {"prompt": "x" * 5000}), 413)
    _assert_error(_post(server, {"prompt": "x"}, content_type="text/plain"), 415)
    _assert_error(_post(server, {"prompt": "x"}, content_type=None), 415)
    deep = '{"prompt": "x", "stop": ' + "[" * 1900 + "]" * 1900 + "}"
    assert "nested deeper" in _assert_error(_post(server, deep), 400)
    assert "nested deeper" in _assert_error(
        _post(
            server,
            {
                "prompt": "x",
                "user": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
            },
        ),
        400,
    )
    surrogate = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    msg = _assert_error(_post(server, surrogate, "/v1/chat/completions"), 400, "messages")
    assert "messages.0.content.0.text is not valid Unicode" in msg
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}
    _assert_error(_post(server, chat, "/v1/chat/completions"), 400, "max_completion_tokens")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=0)  # fmt: skip
    _wait_idle(server)


# ---- disconnects -----------------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_kv(server, client):
    _wait_idle(server)
    generated = server.engine.stats.generated_tokens
    other: dict = {}

    def run_other():
        other["out"] = _create(client, prompt="y", max_tokens=30, temperature=0, ignore_eos=True)

    body = {"prompt": "def f(x):", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        worker = threading.Thread(target=run_other)
        worker.start()
        assert server.engine.kv_manager.num_free_blocks < server.engine.kv_manager.num_total_blocks
    worker.join(timeout=30)
    assert other["out"].choices[0].finish_reason == "length"
    assert other["out"].usage.completion_tokens == 30
    _wait_idle(server)
    # the aborted request stopped long before its 240 tokens
    assert server.engine.stats.generated_tokens - generated < 30 + 100
    m = _metrics(server)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm_rlt:num_free_kv_blocks"] == m["vllm_rlt:num_total_kv_blocks"]
    assert m['vllm:request_success_total{finished_reason="abort"}'] >= 1
