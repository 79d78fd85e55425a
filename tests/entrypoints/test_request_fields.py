"""Request fields of OpenAI's and vLLM's APIs that the engine does not implement
(`min_tokens`, structured outputs, tools, ...): a value that asks for something is a 400
naming the field, the values that ask for nothing are served as if absent; completions'
`max_tokens: null` takes the rest of the context; `min_p`, `logit_bias` and the penalties,
which it implements. Over real HTTP with the `openai` client.
"""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.server_utils import openai_client, tiny_server
from vllm_rlt.models.tiny import write_tiny_ouro

MODEL = "tiny-fields"
KEY = "sk-fields"
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

ASKING = {  # field: a value that asks for what the engine does not do
    "min_tokens": 3,
    "bad_words": ["def"],
    "allowed_token_ids": [1, 2],
    "use_beam_search": True,
    "include_stop_str_in_output": True,
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 4,
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'",
    "structured_outputs": {"choice": ["yes"]},
}
NEUTRAL = {  # the values that ask for nothing, as some clients send them
    "min_p": 0,
    "min_tokens": 0,
    "logit_bias": {},
    "bad_words": [],
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "guided_json": None,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("fields") / "tiny", seed=5)
    with tiny_server(model_dir, MODEL, KEY) as srv:
        yield openai_client(srv, KEY)


def _refused(create, field: str, **kwargs) -> None:
    """`create(**kwargs)` is a 400 whose message and param name `field`."""
    with pytest.raises(openai.BadRequestError) as err:
        create(**kwargs)
    body = err.value.body
    assert body["code"] == 400 and body["param"] == field, body
    assert body["message"].startswith(f"{field}: ") and "not supported" in body["message"]
    assert "Value error" not in body["message"]


@pytest.mark.parametrize("field", sorted(ASKING))
def test_a_field_that_asks_for_what_the_engine_does_not_do_is_a_400_naming_it(client, field):
    extra = {field: ASKING[field]}
    _refused(client.completions.create, field, model=MODEL, prompt="x", extra_body=extra)
    _refused(client.chat.completions.create, field, model=MODEL, messages=MESSAGES,
             extra_body=extra)  # fmt: skip


def test_completion_and_chat_only_fields(client):
    complete, chat = client.completions.create, client.chat.completions.create
    _refused(complete, "suffix", model=MODEL, prompt="x", suffix="y")
    _refused(complete, "best_of", model=MODEL, prompt="x", n=1, best_of=2)
    # a bool is not a number: False asks for no minimum only in the wrong type
    _refused(complete, "min_tokens", model=MODEL, prompt="x", extra_body={"min_tokens": False})
    json_mode = {"type": "json_object"}
    _refused(chat, "response_format", model=MODEL, messages=MESSAGES, response_format=json_mode)
    for choice in (openai.NOT_GIVEN, "auto", "required"):
        _refused(chat, "tools", model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice)
    # the server goes on serving
    out = complete(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_the_values_that_ask_for_nothing_are_served_as_if_absent(client):
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    want = client.completions.create(prompt="def f(x):", n=2, **greedy)
    got = client.completions.create(
        prompt="def f(x):", n=2, best_of=2, suffix="", extra_body=NEUTRAL, **greedy
    )
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    want = client.chat.completions.create(messages=MESSAGES, **greedy)
    got = client.chat.completions.create(
        messages=MESSAGES, response_format={"type": "text"}, tools=TOOLS, tool_choice="none",
        extra_body=NEUTRAL, **greedy,
    )  # fmt: skip
    assert got.choices[0].message.content == want.choices[0].message.content


def test_completion_max_tokens_null_takes_the_rest_of_the_context(client):
    out = client.completions.create(
        model=MODEL, prompt=[[5] * 40, [7] * 3], temperature=0,
        extra_body={"max_tokens": None, "ignore_eos": True},
    )  # fmt: skip
    max_model_len = 257  # (the tiny model's window)
    assert out.usage.completion_tokens == 2 * (max_model_len - 40)
    assert {c.finish_reason for c in out.choices} == {"length"}


def test_min_p_one_samples_the_most_likely_token_at_any_temperature(client):
    """min_p keeps the tokens at least min_p times as likely as the most likely: at 1 only the
    most likely, so a hot seeded sample is the greedy one; at 0 it is off."""
    greedy = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    hot = {"temperature": 3.0, "seed": 11, "max_tokens": 12}
    pinned = client.completions.create(
        model=MODEL, prompt="def f(x):", extra_body={"min_p": 1.0, "ignore_eos": True}, **hot
    )
    assert pinned.choices[0].text == greedy.choices[0].text
    free = client.completions.create(
        model=MODEL, prompt="def f(x):", extra_body={"min_p": 0.0, "ignore_eos": True}, **hot
    )
    assert free.choices[0].text != greedy.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"min_p": 1.5})
    assert err.value.body["param"] == "min_p" and "[0, 1]" in err.value.body["message"]


def _token_ids(out) -> list[int]:
    """The completion's token ids (requested with logprobs and return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_logit_bias_forces_or_bans_tokens_and_leaves_logprobs_raw(client):
    base = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 6, "logprobs": 1,
            "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}  # fmt: skip
    forced = 17
    pinned = client.completions.create(**base, temperature=1.0, seed=3,
                                       logit_bias={str(forced): 100})  # fmt: skip
    assert _token_ids(pinned) == [forced] * 6
    # its logprobs are the model's own, not the biased ones: the forced token is not certain
    assert all(lp < -1e-3 for lp in pinned.choices[0].logprobs.token_logprobs)
    greedy = _token_ids(client.completions.create(**base, temperature=0))
    banned = client.completions.create(**base, temperature=0, logit_bias={str(greedy[0]): -100})
    assert _token_ids(banned)[0] != greedy[0]
    for bad, why in (({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                     ({"100000": 1}, "vocabulary")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", logit_bias=bad)
        assert err.value.body["param"] == "logit_bias" and why in err.value.body["message"]


def test_penalties_stop_a_pushed_token_from_recurring(client):
    """A +5 bias makes a token every greedy token; presence and frequency penalties of 2 let
    it recur at most a few times; out of range, a 400 naming the penalty."""
    base = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 12, "temperature": 0,
            "logprobs": 0, "logit_bias": {"17": 5},
            "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}  # fmt: skip
    assert _token_ids(client.completions.create(**base)) == [17] * 12
    out = client.completions.create(**base, presence_penalty=2.0, frequency_penalty=2.0)
    assert 1 <= _token_ids(out).count(17) <= 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", presence_penalty=2.5)
    assert err.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       extra_body={"repetition_penalty": 0})  # fmt: skip
    assert err.value.body["param"] == "repetition_penalty"
