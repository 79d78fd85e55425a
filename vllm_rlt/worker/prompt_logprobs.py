"""Logprobs of prompt tokens (`SamplingParams.prompt_logprobs`): the state of prompt position p,
once its loops are done, scores the prompt's token at p + 1 with the model's head, as the first
generated token is scored from the last position. Computed in the invocation where a prefill
chunk runs its last loop, read back with the step's tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_rlt.core.sched.execution_batch import NewRequestData, SampledToken
from vllm_rlt.tensor_utils import read_back, to_device
from vllm_rlt.worker.edge_stages import EdgeSegment
from vllm_rlt.worker.sampler import host_tokens, token_logprobs

# (first row in the invocation, first position, the request, its rows' segment)
Pick = tuple[int, int, NewRequestData, EdgeSegment]


class PromptLogprobs:
    def __init__(self, edges, device: torch.device):
        """`edges`: the runner's edge stages (their head gives the logits)."""
        self.edges = edges
        self.device = device
        self._reads: list[tuple[list[tuple[str, int]], list[int], Callable]] = []

    @staticmethod
    def rows_of(data: NewRequestData, start: int, count: int) -> int:
        """How many of a request's prefill rows [start, start + count) score a prompt token:
        those before its last prompt position (its fed-back output positions score none)."""
        if data.num_prompt_logprobs < 0:
            return 0
        last = len(data.prompt_token_ids) - len(data.resumed_loops) - 1
        return max(0, min(start + count, last) - start)

    def score(self, out: torch.Tensor, picks: list[Pick]) -> None:
        """Score the rows of `picks` in an invocation's output states `out`; the copies to the
        host start now."""
        rows, targets, keys, wants = [], [], [], []
        for row, start, data, segment in picks:
            n = segment.num_tokens
            rows += range(row, row + n)
            targets += data.prompt_token_ids[start + 1 : start + n + 1]
            keys += [(data.request_id, p + 1) for p in range(start, start + n)]
            wants += [data.num_prompt_logprobs] * n
        states = out[to_device(rows, torch.int64, self.device)]
        logits = self.edges.logits(states, [segment for *_, segment in picks])
        target = to_device(targets, torch.int64, self.device)
        self._reads.append((keys, wants, read_back(*token_logprobs(logits, target, max(wants)))))

    def take(self) -> Callable[[], dict[str, list[tuple[int, SampledToken]]]]:
        """What was scored since the last call: a callable that waits for it and gives each
        request's (position, its prompt token with logprob and top alternatives)."""
        reads, self._reads = self._reads, []

        def to_host() -> dict[str, list[tuple[int, SampledToken]]]:
            result: dict[str, list[tuple[int, SampledToken]]] = {}
            for keys, wants, copied in reads:
                values, ids = (t.tolist() for t in copied())
                tokens = host_tokens([i[0] for i in ids], values, ids, wants)
                for (req_id, position), token in zip(keys, tokens, strict=True):
                    result.setdefault(req_id, []).append((position, token))
            return result

        return to_host
