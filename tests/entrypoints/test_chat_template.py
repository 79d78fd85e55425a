"""Chat prompts: ChatML without a template, the checkpoint's Jinja chat_template when present."""

from __future__ import annotations

import json

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
