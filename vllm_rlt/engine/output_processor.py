"""Turns request state into public outputs: incremental detokenization, stop strings, n > 1.

Text is decoded from all tokens so far; a trailing replacement character (an incomplete UTF-8
sequence) is held back until the next token completes it, so a multi-byte character is never
split. A stop string ends the request; the text stops before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.request import Request, RequestStatus


@dataclass
class _Parent:
    output: RequestOutput
    children: list[str]  # engine-internal ids of the n samples
    unfinished: set[str] = field(default_factory=set)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], child_ids: list[str]):
        out = RequestOutput(request_id, prompt, prompt_ids)
        out.outputs = [CompletionOutput(i, "", [], [], None) for i in range(len(child_ids))]
        self._parents[request_id] = _Parent(out, child_ids, set(child_ids))
        for i, child in enumerate(child_ids):
            self._child[child] = (request_id, i)

    def children(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.unfinished) if parent else []

    def process(self, req: Request) -> str | None:
        """Refresh the child's completion from `req`; returns a stop string it hit, if any."""
        parent_id, index = self._child[req.request_id]
        comp = self._parents[parent_id].output.outputs[index]
        comp.token_ids = list(req.output_token_ids)
        comp.exit_depths = list(req.output_exit_depths)
        if req.sampling_params.logprobs is not None:
            comp.logprobs = list(req.output_logprobs)
        if req.prompt_logprobs is not None:
            self._parents[parent_id].output.prompt_logprobs = list(req.prompt_logprobs)
        hit = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
            hit, text = _find_stop(text, req.sampling_params.stop)
            if hit is None and not req.status.finished:
                text = text.rstrip("\ufffd")
            comp.text = text
        if hit is not None:
            req.stop_reason = hit
        if req.status.finished or hit is not None:
            status = RequestStatus.FINISHED_STOPPED if hit is not None else req.status
            comp.finish_reason = status.value
            comp.stop_reason = req.stop_reason
        return hit

    def stop_prefix(self, req: Request, known: int) -> int:
        """The fewest output tokens of `req` (more than `known`, whose text held no stop
        string) whose text holds one of its stop strings."""
        stops, ids = req.sampling_params.stop, req.output_token_ids
        for n in range(known + 1, len(ids)):
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if _find_stop(text, stops)[0] is not None:
                return n
        return len(ids)

    def finish(self, child_id: str, status: RequestStatus) -> None:
        """Mark a child finished without new tokens (abort)."""
        parent_id, index = self._child[child_id]
        comp = self._parents[parent_id].output.outputs[index]
        if comp.finish_reason is None:
            comp.finish_reason = status.value

    def collect(self, child_ids: list[str]) -> list[RequestOutput]:
        """Outputs of the parents of `child_ids`; finished parents are released."""
        by_parent: dict[str, list[int]] = {}
        for child in child_ids:
            parent_id, index = self._child[child]
            by_parent.setdefault(parent_id, []).append(index)
        results = []
        for parent_id, indices in by_parent.items():
            parent = self._parents[parent_id]
            for index in indices:
                if parent.output.outputs[index].finish_reason is not None:
                    parent.unfinished.discard(parent.children[index])
            parent.output.finished = not parent.unfinished
            results.append(parent.output)
            if parent.output.finished:
                del self._parents[parent_id]
                for child in parent.children:
                    del self._child[child]
        return results


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[str | None, str]:
    best = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None, text
    return best[1], text[: best[0]]
