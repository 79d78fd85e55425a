"""/tokenize, /detokenize, /version, logprobs counts (chat and completions), logprob tokens as
ids (`return_tokens_as_token_ids`) and the one error shape of every status the server answers,
over real HTTP."""

from __future__ import annotations

import math
from importlib.metadata import version

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import openai_client, tiny_server
from vllm_rlt.models.tiny import write_tiny_ouro

MODEL = "tiny-surface"
KEY = "sk-surface"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("surface") / "tiny", seed=5)
    with tiny_server(model_dir, MODEL, KEY, max_body_bytes=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def _post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers)


# ---- tokenize, detokenize, version -----------------------------------------------------------
def test_tokenize_prompt_and_detokenize_round_trip(server):
    tok = server.engine.tokenizer
    text = "def fib(n):\n    return n"
    resp = _post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tok.encode(text).ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_model_len == 257
    assert body["token_strs"] is None
    strs = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["tokens"] == body["tokens"] and "".join(strs["token_strs"]) == text
    back = _post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_counts_what_chat_sends(server, client):
    body = _post(server, "/tokenize", {"messages": MESSAGES}).json()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert body["count"] == chat.usage.prompt_tokens == len(body["tokens"])
    prompt = _post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    bare = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    bare_prompt = _post(server, "/detokenize", {"tokens": bare.json()["tokens"]}).json()["prompt"]
    assert bare_prompt == prompt.removesuffix("<|im_start|>assistant\n")


def test_version_needs_no_key(server):
    resp = httpx.get(server.url + "/version")
    assert resp.status_code == 200 and resp.json() == {"version": version("vllm-rlt")}


# ---- logprobs --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("num_top", [1, 2, 5])
def test_chat_top_logprobs_gives_n_entries_including_the_sampled_token(client, num_top, stream):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=num_top, extra_body={"ignore_eos": True})  # fmt: skip
    if stream:
        content = [
            t for c in client.chat.completions.create(stream=True, **kw) if c.choices
            for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])
        ]  # fmt: skip
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 6
    for token in content:
        top = token.top_logprobs
        assert len(top) == num_top
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        # greedy: the sampled token is the most likely one
        assert (top[0].token, top[0].logprob) == (token.token, token.logprob)


def test_chat_logprobs_without_top_logprobs_has_empty_top_lists(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, temperature=0.9, seed=1
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(not t.top_logprobs for t in content)


def test_sampled_token_outside_the_top_is_not_in_chat_top_logprobs(client):
    """At a high temperature some sampled tokens are not the most likely: the top list still has
    exactly N entries, the N most likely, and the sampled logprob is reported beside them."""
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, logprobs=True, top_logprobs=1,
        temperature=5.0, seed=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 1 for t in content)
    assert all(t.logprob <= t.top_logprobs[0].logprob for t in content)
    assert any(t.logprob < t.top_logprobs[0].logprob for t in content)


@pytest.mark.parametrize("num", [0, 1, 3])
def test_completion_logprobs_give_n_most_likely_plus_the_sampled_token(client, num):
    """OpenAI's legacy format: `logprobs: N` returns the N most likely tokens and always the
    sampled one, so N or N + 1 entries per position."""
    out = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=16, logprobs=num, temperature=5.0, seed=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    outside = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and math.isfinite(logprob) and logprob <= 0
        assert 1 <= len(top) <= num + 1
        if any("\ufffd" in t for t in top):  # byte pieces decode alike: their keys merge
            continue
        assert len(top) in (max(num, 1), num + 1)
        if len(top) == num + 1 and num:  # the sampled token is not among the N most likely
            assert all(logprob <= v for v in top.values())
            outside += 1
    assert outside or num == 0


def _ids(names: list[str]) -> list[int]:
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.removeprefix("token_id:")) for n in names]


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_completion_logprob_tokens_by_id(server, client, stream):
    """vLLM's `return_tokens_as_token_ids`: logprob tokens (echoed prompt included) and their
    top keys come back as `token_id:N`; the same ids as the text of a plain request."""
    prompt = [5, 17, 42, 99]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})  # fmt: skip
    plain = client.completions.create(**kw).choices[0]
    as_ids = {**kw["extra_body"], "return_tokens_as_token_ids": True}
    if stream:
        chunks = client.completions.create(stream=True, **{**kw, "extra_body": as_ids})
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        tops = [t for lp in lps for t in lp.top_logprobs]
    else:
        lp = client.completions.create(**{**kw, "extra_body": as_ids}).choices[0].logprobs
        tokens, tops = lp.tokens, lp.top_logprobs
    ids = _ids(tokens)
    assert ids[:4] == prompt and len(ids) == 12
    text = _post(server, "/detokenize", {"tokens": ids[4:]}).json()["prompt"]
    assert text == "".join(plain.logprobs.tokens[4:]) and plain.text.endswith(text)
    for name, top in zip(tokens[4:], tops[4:], strict=True):
        _ids(list(top))
        assert name in top and 1 <= len(top) <= 3


def test_return_tokens_as_token_ids_in_chat_logprobs(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    kw["extra_body"]["return_tokens_as_token_ids"] = True
    content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [t.bytes for t in content] == [t.bytes for t in plain]  # bytes: the token's text
    # (to fp32 rounding: a request still running from an earlier test may share the batch)
    assert [t.logprob for t in content] == pytest.approx([t.logprob for t in plain], abs=1e-5)
    for t in content:
        _ids([t.token, *(top.token for top in t.top_logprobs)])
        assert t.token == t.top_logprobs[0].token  # greedy: the most likely


# ---- errors ----------------------------------------------------------------------------------
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
         405: "MethodNotAllowedError", 413: "PayloadTooLargeError",
         415: "UnsupportedMediaTypeError"}  # fmt: skip


def _check(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == TYPES[status]
    assert isinstance(err["message"], str) and err["message"] and err["param"] == param
    return err


def test_error_shape_for_each_status(server):
    url = server.url
    _check(_post(server, "/tokenize", {"prompt": "x"}, headers={}), 401)
    _check(_post(server, "/detokenize", {"tokens": [1]}, headers={}), 401)
    _check(_post(server, "/tokenize", {"prompt": "x", "model": "other"}), 404, "model")
    _check(_post(server, "/detokenize", {"tokens": [1], "model": "other"}), 404, "model")
    assert "/nowhere" in _check(httpx.get(url + "/nowhere"), 404)["message"]
    wrong = _check(httpx.get(url + "/v1/completions", headers=AUTH), 405)
    assert "GET /v1/completions" in wrong["message"]
    assert httpx.get(url + "/tokenize").headers["allow"] == "POST"
    _check(_post(server, "/tokenize", {"prompt": "x" * 3000}), 413)
    raw = httpx.post(url + "/tokenize", content=b'{"prompt": "x"}', headers=AUTH)
    _check(raw, 415)
    _check(_post(server, "/tokenize", {}), 400, "prompt")
    _check(_post(server, "/tokenize", {"prompt": "x", "messages": MESSAGES}), 400, "prompt")
    _check(_post(server, "/tokenize", {"prompt": 5}), 400, "prompt")
    _check(_post(server, "/detokenize", {"tokens": [1, 512]}), 400, "tokens")
    _check(_post(server, "/detokenize", {"tokens": ["a"]}), 400, "tokens")
    bad_role = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    _check(_post(server, "/tokenize", bad_role), 400, "messages")
    chat = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}
    _check(_post(server, "/v1/chat/completions", chat), 400, "top_logprobs")


def test_openai_client_sees_the_matching_exceptions(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="other", prompt="x")
    assert err.value.body["type"] == "NotFoundError" and err.value.body["code"] == 404
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert err.value.body["param"] == "max_tokens" and err.value.body["code"] == 400
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.body["type"] == "AuthenticationError" and err.value.body["code"] == 401
