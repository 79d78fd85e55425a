"""The offline API, as vLLM's: `LLM(model, **engine_args)`, then `generate(prompts,
sampling_params)` or `chat(messages, sampling_params)`; `get_tokenizer()`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams

# text, token ids, {"prompt": text} or {"prompt_token_ids": token ids}
Prompt = str | list[int] | dict[str, Any]
PROMPT_FORMS = (
    "a prompt is a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int]}"
)


class LLM:
    """An engine for offline batched generation. `model` is an HF directory (default: the
    packaged tiny-ouro-stdlib); `engine_args` are the config fields (`max_num_seqs=`, ...)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (one, or a list of them; each text, token ids or vLLM's
        prompt dict); outputs come back in input order. TypeError or ValueError (nothing runs)
        for anything else."""
        prompts = _prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            req_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(req_id, prompt, p, priority=priority[i] if priority else 0)
            ids.append(req_id)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered as the server renders chat: the model's chat template
        (tokenizer_config.json), else ChatML; `chat_template` (a Jinja template or a file
        holding one) replaces it."""
        conversations = list(messages)
        if not conversations or isinstance(conversations[0], dict):
            conversations = [conversations]
        renderer = ChatRenderer(self.engine.model_dir, chat_template)
        prompts = [renderer.render(_messages(c), add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self):
        """The model's tokenizer (a `tokenizers.Tokenizer`; None for a model without one)."""
        return self.engine.tokenizer


def _is_ids(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompt(item: Any) -> str | list[int]:
    """One prompt in any of vLLM's forms -> text or token ids."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if set(item) == {"prompt"} and isinstance(item["prompt"], str):
            return item["prompt"]
        if set(item) == {"prompt_token_ids"} and _is_ids(item["prompt_token_ids"]):
            return list(item["prompt_token_ids"])
        raise ValueError(f"{PROMPT_FORMS}; got a dict with keys {sorted(map(str, item))}")
    if _is_ids(item):
        return list(item)
    raise TypeError(f"{PROMPT_FORMS}; got {type(item).__name__}")


def _prompts(prompts: Any) -> list[str | list[int]]:
    """One prompt or a list of them -> a list of text or token-id prompts."""
    if isinstance(prompts, str | dict) or (_is_ids(prompts) and len(prompts) > 0):
        return [_prompt(prompts)]
    if not isinstance(prompts, list | tuple):
        raise TypeError(f"{PROMPT_FORMS}, or a list of prompts; got {type(prompts).__name__}")
    return [_prompt(p) for p in prompts]


def _messages(conversation: Any) -> list[dict[str, str]]:
    """A conversation's messages as {"role", "content"} strings (content parts of type text are
    joined); ValueError naming what is wrong."""
    plain = []
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: a message is a dict with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}]: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content is a string or a list of text parts")
        plain.append({"role": m["role"], "content": content or ""})
    return plain
