"""`vllm-rlt serve HUGINN_DIR` in a subprocess, over real HTTP with the official client:
completions (greedy, zero initial state, equal to the engine offline; seeded and reproducible)
and chat rendered with the checkpoint's template, stopping at its generation-config eos ids."""

from __future__ import annotations

import httpx
import openai
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tests.engine.harness import Job, make_engine, run_batched
from tests.entrypoints.server_utils import ServeProcess
from tests.helpers import HUGINN_CHAT_TEMPLATE, write_tiny_huginn
from vllm_rlt.sampling_params import SamplingParams

NAME = "huginn-tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_huginn(tmp_path_factory.mktemp("srv") / NAME, seed=8)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = [str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256"]
    with ServeProcess(tmp_path_factory.mktemp("log") / "log", flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_completion_greedy_zero_state_equals_offline(client, model_dir):
    prompt = "def fibonacci(n):"
    out = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"init_scale": 0.0, "ignore_eos": True},
    )
    eng = make_engine(model_dir)
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(prompt).ids
    params = SamplingParams(max_tokens=6, temperature=0.0, init_scale=0.0, ignore_eos=True)
    tokens, _ = run_batched(eng, [Job("a", ids, params)])["a"]
    assert out.choices[0].text == eng.tokenizer.decode(list(tokens))
    assert out.usage.completion_tokens == 6


def test_seeded_completions_repeat(client):
    kw = dict(model=NAME, prompt="x = 1", max_tokens=5, temperature=1.0, seed=3)
    kw["extra_body"] = {"ignore_eos": True}
    assert client.completions.create(**kw).choices[0].text == (
        client.completions.create(**kw).choices[0].text
    )


def test_chat_uses_the_checkpoint_template_and_eos(client, server, model_dir):
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, seed=1)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(HUGINN_CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=True, bos_token="<|begin_text|>"
    )
    assert text.endswith("<|begin_header|>Huginn<|end_header|>\n\n")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert out.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False).ids)
    assert out.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(
        server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": True}
    ).json()
    assert rendered["tokens"] == tok.encode(text, add_special_tokens=False).ids
    assert rendered["tokens"][0] == tok.token_to_id("<|begin_text|>")
