"""Chat prompts: ChatML without a template, the checkpoint's Jinja chat_template when present,
and a template given to the server (a file or inline) over both."""

from __future__ import annotations

import json

import pytest

from vllm_rlt.config import ConfigError
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer, render_chatml

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_chatml_without_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    want = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chatml(MESSAGES) == want
    assert ChatRenderer(tmp_path).render(MESSAGES) == want
    assert ChatRenderer(None).render(MESSAGES) == want


def test_checkpoint_template_is_rendered(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    out = ChatRenderer(tmp_path).render(MESSAGES)
    assert out == "<s>[system] be brief\n[user] hi\n[assistant] "


def test_chat_template_flag_replaces_the_checkpoint_template(tmp_path):
    config = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<s>"}))
    template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{% endfor %}"
    template += "{% if add_generation_prompt %}<assistant>{% endif %}"
    file = tmp_path / "chat.jinja"
    file.write_text(template)
    for given in (str(file), template):
        renderer = ChatRenderer(tmp_path, given)
        assert renderer.render(MESSAGES) == "<s><system><user><assistant>"
        assert renderer.render(MESSAGES, add_generation_prompt=False) == "<s><system><user>"
    assert ChatRenderer(None, template).render(MESSAGES) == "<system><user><assistant>"


def test_chatml_without_the_generation_prompt():
    out = ChatRenderer(None).render(MESSAGES, add_generation_prompt=False)
    assert out == render_chatml(MESSAGES).removesuffix("<|im_start|>assistant\n")
    assert out.endswith("hi<|im_end|>\n")


def test_bad_chat_template_flag_names_it(tmp_path):
    with pytest.raises(ConfigError, match="--chat-template .*missing.jinja: not a readable file"):
        ChatRenderer(None, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="--chat-template is not a valid Jinja template"):
        ChatRenderer(None, "{% for m in %}")
    (tmp_path / "broken.jinja").write_text("{{ unclosed")
    with pytest.raises(ConfigError, match="broken.jinja is not a valid Jinja template"):
        ChatRenderer(None, str(tmp_path / "broken.jinja"))
