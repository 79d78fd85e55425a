"""Render chat messages into a prompt: the checkpoint's Jinja `chat_template` (from
tokenizer_config.json) when it has one and jinja2 is installed, ChatML otherwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def render_chatml(messages: list[dict[str, str]]) -> str:
    """`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the assistant's turn."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + f"{IM_START}assistant\n"


class ChatRenderer:
    def __init__(self, model_dir: str | Path | None):
        self.template = None
        self.special: dict[str, Any] = {}
        path = Path(model_dir) / "tokenizer_config.json" if model_dir else None
        if path is None or not path.is_file():
            return
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if not isinstance(source, str):
            return
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # jinja2 comes with torch; without it ChatML is used
            return
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string(source)
        for key in ("bos_token", "eos_token"):
            if isinstance(config.get(key), str):
                self.special[key] = config[key]

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.template is None:
            return render_chatml(messages)
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
