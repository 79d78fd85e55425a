"""The offline API takes vLLM's prompt forms (text, token ids, {"prompt": ...},
{"prompt_token_ids": ...}, one or a list, mixed) with the same results for the same prompt, refuses
anything else with TypeError or ValueError before it runs, and `LLM.chat` renders conversations
with the model's chat template (or a given one) as the server does."""

from __future__ import annotations

import pytest

from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=256)


def _tokens(outputs) -> list[tuple[int, ...]]:
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def test_every_prompt_form_gives_the_same_result(llm):
    ids = llm.get_tokenizer().encode("import os").ids
    forms = ["import os", ids, {"prompt": "import os"}, {"prompt_token_ids": ids}]
    single = [_tokens(llm.generate(f, GREEDY, use_tqdm=False)) for f in forms]
    assert all(s == single[0] for s in single) and len(single[0]) == 1
    mixed = _tokens(llm.generate(forms + [tuple(ids)], GREEDY, use_tqdm=False))
    assert mixed == single[0] * 5


@pytest.mark.parametrize(
    "prompts,error,words",
    [
        (3.5, TypeError, "got float"),
        ([1, "a"], TypeError, "got int"),
        ({"text": "x"}, ValueError, "keys ['text']"),
        ({"prompt": "x", "extra": 1}, ValueError, "keys ['extra', 'prompt']"),
        ({"prompt_token_ids": "abc"}, ValueError, "prompt_token_ids"),
        ([True, False], TypeError, "got bool"),
    ],
)
def test_other_prompt_forms_are_refused_before_anything_runs(llm, prompts, error, words):
    with pytest.raises(error, match="a prompt is a string") as info:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert words in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_chat_renders_with_the_model_template_or_a_given_one(llm):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = ChatRenderer(default_model_dir()).render(conversation)
    assert rendered.startswith("<|im_start|>system")  # the packaged model's template
    want = _tokens(llm.generate(rendered, GREEDY, use_tqdm=False))
    assert _tokens(llm.chat(conversation, GREEDY, use_tqdm=False)) == want
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    ]
    both = llm.chat([conversation, parts], GREEDY, use_tqdm=False)
    plain = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert _tokens(both) == [want[0], _tokens(plain)[0]]  # text parts are joined
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    own = _tokens(llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=template))
    assert own == _tokens(llm.generate("[system] be brief\n[user] hi\n", GREEDY, use_tqdm=False))


def test_chat_refuses_malformed_messages(llm):
    with pytest.raises(ValueError, match=r"messages\[0\]: a message is a dict"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]: only text content parts"):
        llm.chat(
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image"}]}]
        )
