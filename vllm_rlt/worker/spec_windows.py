"""Device state of the tokens that enter decode rows, and the speculative windows' sampling
(docs/design/speculative.md).

Per request slot, `tokens[slot, 0]` is the request's newest sampled token, which its next decode
row (or its window's first row) takes at depth 0; `tokens[slot, j]` the draft token at window
offset j, and `probs[slot, j - 1]` the distribution it was drawn from (random requests only).
The window's hidden states live at the start of the request's prefill ring (the prompt is done),
so the rows of offset j are ring rows j of the slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_rlt.core.sched.execution_batch import DraftSample, SampledToken, VerifySample
from vllm_rlt.tensor_utils import read_back, to_device
from vllm_rlt.worker.sampler import SamplingTensors, plain_argmax
from vllm_rlt.worker.spec_decode import accept, draft_tokens


class WindowTokens:
    def __init__(self, max_num_seqs: int, max_drafts: int, vocab_size: int, device):
        """`max_drafts`: most drafts of a window (0: speculation off). Everything is allocated
        here, before the engine sizes the KV cache."""
        self.device = torch.device(device)
        shape = (max_num_seqs, max_drafts + 1)
        self.tokens = torch.zeros(shape, dtype=torch.int64, device=self.device)
        # [max_num_seqs, max_drafts, V] fp32
        shape = (max_num_seqs, max_drafts, vocab_size if max_drafts else 0)
        self.probs = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def set_newest(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """slots [N] int64, token_ids [N] int64: the requests' newest sampled tokens."""
        self.tokens[slots, 0] = token_ids

    def entry_tokens(self, slots: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
        """[N] int64 tokens of rows entering at depth 0 at window `offsets` of `slots`."""
        index = to_device([*slots, *offsets], torch.int64, self.device).view(2, -1)
        return self.tokens[index[0], index[1]]

    def draft(self, drafts: Sequence[DraftSample], slots: list[int], hidden_rows: list[int],
              params: list, coda: Callable, buffer: torch.Tensor) -> None:  # fmt: skip
        """Sample `drafts` (request i: slot `slots[i]`, its state at flat row `hidden_rows[i]`,
        sampling settings `params[i]`) from the coda of those states."""
        index = [*hidden_rows, *slots, *(d.offset for d in drafts)]
        rows, slot_t, cols = to_device(index, torch.int64, self.device).view(3, -1)
        logits = coda(buffer[rows])
        tensors = self._tensors(params, [d.index for d in drafts])
        token_ids, probs = draft_tokens(logits, tensors)
        self.tokens[slot_t, cols] = token_ids
        if probs is not None:
            self.probs[slot_t, cols - 1] = probs

    def verify(self, verifies: Sequence[VerifySample], slots: list[int], ring_rows: list[int],
               params: list, coda: Callable, buffer: torch.Tensor):  # fmt: skip
        """Accept `verifies` (request i: slot `slots[i]`, its window's rows from flat row
        `ring_rows[i]`, settings `params[i]`) on the coda of their final states. Returns a
        callable that reads the accepted tokens back: VerifySample -> tuple of SampledToken (keyed
        by the window, not the request: a request's first token may be sampled in the same step)."""
        k = max(v.num_drafts for v in verifies)
        width = k + 1
        rows = [r + min(j, v.num_drafts) for v, r in zip(verifies, ring_rows, strict=True)
                for j in range(width)]  # fmt: skip
        n = len(verifies)
        index = to_device([*rows, *slots, *(v.num_drafts for v in verifies)], torch.int64,
                          self.device)  # fmt: skip
        logits = coda(buffer[index[: n * width]])
        slot_t, num_drafts = index[n * width :].view(2, n)
        counters = [v.index + j for v in verifies for j in range(width)]
        tensors = self._tensors([p for p in params for _ in range(width)], counters)
        probs = None if tensors is None or tensors.all_greedy else self.probs[slot_t, :k]
        tokens, counts = accept(
            logits.reshape(n, width, -1),
            self.tokens[slot_t, 1:width],
            probs,
            num_drafts,
            tensors,
        )
        self.set_newest(slot_t, tokens.gather(1, (counts - 1)[:, None])[:, 0])
        copied = read_back(tokens, counts)

        def to_host() -> dict[VerifySample, tuple[SampledToken, ...]]:
            host_tokens, host_counts = (t.tolist() for t in copied())
            return {
                v: tuple(SampledToken(tok, None, ()) for tok in host_tokens[i][: host_counts[i]])
                for i, v in enumerate(verifies)
            }

        return to_host

    def _tensors(self, params: list, counters: list[int]) -> SamplingTensors | None:
        """The sampling tensors of rows with settings `params` (None when all take the plain
        argmax: the draft and the acceptance then need nothing else)."""
        if plain_argmax(params):
            return None
        return SamplingTensors.of(params, counters, -1, self.device)
