"""What the sampler's penalties read (`SamplingParams.presence_penalty`, `frequency_penalty`,
`repetition_penalty`): per request slot, how often each token occurs in the output so far and
whether it occurs in the prompt. One owner for both, on the device: the runner fills a slot
when it admits a request (a resumed one counts the output it feeds back and its newest token)
and counts every token it samples for it, on the host path and inside device runs alike."""

from __future__ import annotations

import torch

from vllm_rlt.core.sched.execution_batch import NewRequestData
from vllm_rlt.sampling_params import penalized
from vllm_rlt.tensor_utils import to_device


class PenaltyState:
    def __init__(self, max_num_seqs: int, vocab_size: int, device):
        """Allocated with the other per-request buffers, before the KV cache is sized."""
        self.device = torch.device(device)
        self.counts = torch.zeros(max_num_seqs, vocab_size, dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros(max_num_seqs, vocab_size, dtype=torch.bool,
                                     device=self.device)  # fmt: skip

    def admit(self, slot: int, data: NewRequestData) -> None:
        """A request takes `slot`: its prompt's tokens, and the output it resumes with (the
        output tokens fed back after the prompt and the newest one), if it has penalties (rows
        without read nothing here)."""
        if not penalized(data):
            return
        fed = len(data.resumed_loops)
        ids = list(data.prompt_token_ids)
        output = ids[len(ids) - fed :] if fed else []
        if data.resume_token is not None:
            output.append(data.resume_token)
        prompt = to_device(ids[: len(ids) - fed], torch.int64, self.device)
        self.in_prompt[slot] = False
        self.in_prompt[slot, prompt] = True
        self.counts[slot] = 0
        if output:
            out = to_device(output, torch.int64, self.device)
            self.counts[slot].index_put_((out,), torch.ones_like(out, dtype=torch.int32),
                                         accumulate=True)  # fmt: skip

    def count(self, slots: torch.Tensor, token_ids: torch.Tensor,
              took: torch.Tensor | None = None) -> None:  # fmt: skip
        """Count `token_ids` [N] as the output of `slots` [N] (`took` [N] bool: only where
        set). No host sync: it runs inside captured device runs."""
        ones = torch.ones_like(token_ids, dtype=torch.int32) if took is None else took.int()
        self.counts.index_put_((slots, token_ids), ones, accumulate=True)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, V] output counts and prompt flags of `slots` [N]."""
        return self.counts[slots], self.in_prompt[slots]
