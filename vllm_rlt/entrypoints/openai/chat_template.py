"""Render chat messages into a prompt: a template given to the server (`--chat-template`: a file
or the template itself), else the checkpoint's Jinja `chat_template` (from
tokenizer_config.json), else ChatML. A broken tokenizer_config.json or template, or a template
file that cannot be read, raises ConfigError naming it at startup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_rlt.config import ConfigError
from vllm_rlt.models.loader import read_json_file

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the assistant's turn."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + f"{IM_START}assistant\n" if add_generation_prompt else text


def load_chat_template(value: str) -> tuple[str, str]:
    """(template source, where it came from) for `--chat-template`: the file `value` names, or
    `value` itself when it holds Jinja markup (`{{`, `{%`)."""
    path = Path(value)
    if "{{" in value or "{%" in value:
        return value, "--chat-template"
    try:
        return path.read_text(), str(path)
    except (OSError, UnicodeDecodeError) as err:
        kind = err.__class__.__name__
        msg = f"--chat-template {value}: not a readable file ({kind}) nor a Jinja template"
        raise ConfigError(msg) from None


class ChatRenderer:
    def __init__(self, model_dir: str | Path | None, chat_template: str | None = None):
        """`chat_template`: replaces the checkpoint's template (see load_chat_template)."""
        self.template = None
        self.special: dict[str, Any] = {}
        path = Path(model_dir) / "tokenizer_config.json" if model_dir else None
        config = read_json_file(path) if path is not None and path.is_file() else {}
        for key in ("bos_token", "eos_token"):
            if isinstance(config.get(key), str):
                self.special[key] = config[key]
        source, origin = config.get("chat_template"), f"{path}: chat_template"
        if chat_template is not None:
            source, origin = load_chat_template(chat_template)
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
            msg = f"{origin} is not a valid Jinja template: {err} (line {err.lineno})"
            raise ConfigError(msg) from None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return render_chatml(messages, add_generation_prompt)
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )
