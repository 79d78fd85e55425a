"""Render chat messages into a prompt: the checkpoint's Jinja `chat_template` (from
tokenizer_config.json) when it has one and jinja2 is installed, ChatML otherwise. A broken
tokenizer_config.json or template raises ConfigError naming the file at startup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_rlt.config import ConfigError
from vllm_rlt.models.loader import read_json_file

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
        config = read_json_file(path)
        source = config.get("chat_template")
        if not isinstance(source, str):
            return
        try:
            from jinja2 import TemplateSyntaxError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # jinja2 comes with torch; without it ChatML is used
            return
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as err:
            msg = f"{path}: chat_template is not a valid Jinja template: {err} (line {err.lineno})"
            raise ConfigError(msg) from None
        for key in ("bos_token", "eos_token"):
            if isinstance(config.get(key), str):
                self.special[key] = config[key]

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.template is None:
            return render_chatml(messages)
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
