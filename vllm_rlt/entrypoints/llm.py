"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams

Prompt = str | list[int]


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
        """Generate for every prompt (text or token ids); outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
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
